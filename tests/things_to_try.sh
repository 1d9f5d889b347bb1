#!/usr/bin/env bash
# Every chapter README's "Things to try", run: each item's commands with a few steps,
# and what the item says the reader will see, checked (the figures the item names,
# exactly; "halves", "the same losses" and the like, as ratios and equal losses). The
# items that ask the reader to edit the code are covered by the test named beside them.
#   tests/things_to_try.sh BIN_DIR CHAPTER     (CHAPTER: 00 01 02 03 04 05 06 07 08 09 10)
# Exit 0: every item did what its README says; 1: at least one did not (each named).
# CTest runs one chapter per test (things_to_try_00 ...), each under a timeout.
set -uo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 BIN_DIR CHAPTER" >&2; exit 2; }
bin="$(cd "$1" 2>/dev/null && pwd)" || { echo "things_to_try: no directory '$1' (hint: the build's bin, e.g. build/cpu/bin)" >&2; exit 2; }
chapter="$2"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 2

failures=0
item=""
out=""
status=0
fail() {
  echo "FAIL [$chapter] $item: $*"
  tail -n 8 <<<"$out" | sed 's/^/    | /'
  failures=$((failures + 1))
}
# try NAME COMMAND...: runs it (a hang stops after 300 s and fails the item); its output
# (stdout and stderr) in $out, its exit status in $status. COMMAND may start with
# `launch N` (the course launcher with N ranks) or `mpirun_np N` (Open MPI's).
try() {
  item="$1"
  shift
  local command=("$@")
  case "$1" in
    launch) command=("$bin/launch" --nproc-per-node "$2" -- "${@:3}") ;;
    mpirun_np) command=(mpirun --oversubscribe --allow-run-as-root -np "$2" "${@:3}") ;;
  esac
  out="$(timeout 300 "${command[@]}" 2>&1)"
  status=$?
  echo "[$chapter] $item: exit $status"
}
ok() { [[ $status == 0 ]] || fail "exit $status, expected 0"; }
refused() { [[ $status == 2 ]] || fail "exit $status, expected 2 (a refused flag)"; }
see() { grep -qE -- "$1" <<<"$out" || fail "no line matching '$1'"; }
launch() {  # the course launcher with $1 ranks, outside try
  local n="$1"
  shift
  "$bin/launch" --nproc-per-node "$n" -- "$@"
}
# the last JSON line's KEY in FILE (a --log file): a number
logged() { grep -o "\"$2\": *[-0-9.e+]*" "$1" | tail -n 1 | sed 's/.*: *//'; }
# the losses of the step lines in $out, one per line (rank 0's)
losses() { sed -nE 's/^(\[rank 0\] )?step +[0-9]+\/[0-9]+ \| loss ([0-9.]+).*/\2/p' <<<"$out"; }
# near A B RATIO: A / B is RATIO within 1% (a figure that "halves" or "grows 3/2")
near() { awk -v a="$1" -v b="$2" -v r="$3" 'BEGIN { exit !(b > 0 && a / b > r * 0.99 && a / b < r * 1.01) }'; }
check_near() { [[ -n "$1" && -n "$2" ]] && near "$1" "$2" "$3" || fail "$4: '$1' / '$2' is not $3"; }
# check_less A B WHAT: A < B, both figures there (an empty one is no figure, not 0)
check_less() { [[ -n "$1" && -n "$2" ]] && awk -v a="$1" -v b="$2" 'BEGIN { exit !(a < b) }' || fail "$3: '$1' against '$2'"; }
# see_figure BYTES UNIT: the output shows BYTES in UNIT (KB or MB) as the programs print it, a word of its own
see_figure() {
  [[ -n "$1" ]] || { fail "no figure to look for"; return; }
  local shown
  shown="$(awk -v b="$1" -v u="$2" 'BEGIN { printf "%.2f %s", b / (u == "MB" ? 1e6 : 1e3), u }')"
  grep -qE -- "(^| )${shown//./[.]}( |$)" <<<"$out" || fail "no '$shown' in the output"
}
check_same() { [[ "$1" == "$2" && -n "$1" ]] || fail "$3: '$1' against '$2'"; }
# check_losses A B WHAT: two runs' printed losses, equal up to their last printed digit
# (the tests hold them to 1e-5 relative; a sum's last bits can tip the 4th decimal)
check_losses() {
  [[ -n "$1" && $(wc -l <<<"$1") == $(wc -l <<<"$2") ]] &&
    paste <(echo "$1") <(echo "$2") | awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1.5e-4) exit 1 }' ||
    fail "$3: '$(echo $1)' against '$(echo $2)'"
}
have_mpirun() { command -v mpirun >/dev/null 2>&1; }
# the pid of a running process whose command line is exactly PATTERN (pgrep -x), waited for
wait_for_pid() {
  local pid=""
  for _ in $(seq 100); do
    pid="$(pgrep -f -x "$1" | head -n 1)"
    [[ -n "$pid" ]] && { echo "$pid"; return; }
    sleep 0.1
  done
}

# kill_a_worker LAUNCHER_PID PATTERN OUT_FILE WAIT: once WAIT (a command) has run, kill -9
# the worker whose command line is PATTERN; then the launcher's exit in $status and
# its output (OUT_FILE) in $out
kill_a_worker() {
  local launcher="$1" pid
  pid="$(wait_for_pid "$2")"
  eval "$4"
  if [[ -n "$pid" ]]; then kill -9 "$pid"; else kill "$launcher"; fi
  wait "$launcher"
  status=$?
  out="$(cat "$3")"
  echo "[$chapter] $item: exit $status"; tail -n 3 <<<"$out"
  [[ -n "$pid" ]] || fail "no worker '$2' to kill"
}

S=(--steps 3)

case "$chapter" in
  00)
    try "chapter 00" "$bin/00_single_gpu" "${S[@]}"
    fp32_losses="$(losses)"
    try "--dtype bf16" "$bin/00_single_gpu" "${S[@]}" --dtype bf16
    ok
    see "bf16 GEMMs: inputs rounded to bf16"
    paste <(losses) <(echo "$fp32_losses") | awk '{ d = ($1 - $2) / $2; if (d < 0) d = -d; if (d > 0.02) exit 1 }' ||
      fail "losses not within 2% of fp32's: '$(echo $(losses))' against '$(echo $fp32_losses)'"
    try "--micro-batches 4" "$bin/00_single_gpu" "${S[@]}" --log whole.jsonl
    ok
    whole="$(losses)"
    try "--micro-batches 4" "$bin/00_single_gpu" "${S[@]}" --micro-batches 4 --log quarter.jsonl
    ok
    check_losses "$(losses)" "$whole" "the same losses"
    check_near "$(logged whole.jsonl peak_activations)" "$(logged quarter.jsonl peak_activations)" 4 \
      "a quarter of the activation memory"
    try "--seq 256" "$bin/00_single_gpu" --steps 1 --seq 256 --log long.jsonl
    ok
    awk -v a="$(logged long.jsonl peak_activations)" -v b="$(logged whole.jsonl peak_activations)" \
      'BEGIN { exit !(a / b > 2 && a / b < 4) }' || fail "activations at seq 256 not between 2x and 4x"
    head -c 20000 /dev/urandom >some_file.txt
    try "--data some_file.txt" "$bin/00_single_gpu" "${S[@]}" --data some_file.txt
    ok
    see "data: some_file.txt"
    try "--lr 3e-3" "$bin/00_single_gpu" "${S[@]}" --lr 3e-3
    ok
    try "--grad-clip 1.0" "$bin/00_single_gpu" "${S[@]}" --grad-clip 1.0
    ok
    try "--threads 2" "$bin/00_single_gpu" "${S[@]}" --threads 2
    ok
    try "--experts 4 --top-k 2 --capacity-factor 1.0" "$bin/00_single_gpu" "${S[@]}" --experts 4 --top-k 2 \
      --capacity-factor 1.0
    ok
    see "of the token-choices dropped over the run"
    try "... then --aux-loss-coef 0" "$bin/00_single_gpu" "${S[@]}" --experts 4 --top-k 2 --capacity-factor 1.0 \
      --aux-loss-coef 0
    ok
    see "aux loss x 0"
    try "--log run.jsonl, then compare_runs" "$bin/00_single_gpu" "${S[@]}" --log run.jsonl
    ok
    try "--log run.jsonl, then compare_runs" "$bin/compare_runs" run.jsonl
    ok
    see "^00_single_gpu +1 "
    try "--trace trace.json --steps 5 --micro-batches 2" "$bin/00_single_gpu" --trace trace.json --steps 5 \
      --micro-batches 2
    ok
    grep -q '"forward' trace.json && grep -q '"backward' trace.json && grep -q '"optimizer' trace.json ||
      fail "trace.json lacks forward, backward or optimizer spans"
    ;;
  01)
    try "collectives_tour at 3 ranks" launch 3 "$bin/collectives_tour"
    ok
    see "collectives correct on all 3 rank"
    item="kill -9 a worker"
    launch 2 "$bin/02_ddp" --steps 1000 >killed.out 2>&1 &
    kill_a_worker $! "[^ ]*02_ddp --steps 1000" killed.out "sleep 1"
    [[ $status != 0 ]] || fail "the launcher exited 0"
    see "rank [01].*(killed|signal)"
    # torchrun from the PATH, or beside the python that test_torchrun uses
    torchrun="$(command -v torchrun || true)"
    [[ -n "$torchrun" || -z "${COURSE_TORCH_PYTHON:-}" ]] || torchrun="$(dirname "$COURSE_TORCH_PYTHON")/torchrun"
    if [[ -x "$torchrun" ]]; then
      try "torchrun, 03 with ZeRO-3 at 4 ranks" "$torchrun" --standalone --nproc-per-node 4 --no-python -- \
        "$bin/03_fsdp" --steps 5
      ok
    else
      echo "[$chapter] torchrun: no torchrun here, left to test_torchrun (COURSE_TORCH_PYTHON)"
    fi
    try "--max-restarts 2" "$bin/launch" --nproc-per-node 2 --max-restarts 2 -- "$bin/launcher_worker" \
      --target-rank 1 --exit-first-attempt 3
    ok
    see "restart"
    item="COURSE_COMM_TIMEOUT=5 and kill -STOP"
    COURSE_COMM_TIMEOUT=5 "$bin/launch" --nproc-per-node 2 -- "$bin/02_ddp" --steps 1001 >stopped.out 2>&1 &
    launcher=$!
    pid="$(wait_for_pid "[^ ]*02_ddp --steps 1001")"
    sleep 1
    if [[ -n "$pid" ]]; then kill -STOP "$pid"; else kill "$launcher"; fi
    wait "$launcher"
    status=$?
    [[ -n "$pid" ]] && kill -9 "$pid" 2>/dev/null
    out="$(cat stopped.out)"
    echo "[$chapter] $item: exit $status"; tail -n 3 <<<"$out"
    [[ -n "$pid" ]] || fail "no 02_ddp worker to stop"
    [[ $status != 0 ]] || fail "the launcher exited 0"
    see "waited|timed out|timeout"
    ;;
  02)
    try "--no-overlap" launch 2 "$bin/02_ddp" "${S[@]}" --no-overlap
    ok
    see "exposed comm per step"
    try "--bucket-mb 0.05" launch 2 "$bin/02_ddp" "${S[@]}" --bucket-mb 0.05
    ok
    see "ddp: [0-9]{2,} gradient bucket"
    try "--bucket-mb 64" launch 2 "$bin/02_ddp" "${S[@]}" --bucket-mb 64
    ok
    see "ddp: 1 gradient bucket.*one bucket: no overlap"
    try "--micro-batches 4" launch 2 "$bin/02_ddp" "${S[@]}" --micro-batches 4
    ok
    see "sent 3.50 MB"
    fp32_losses="$(losses)"
    try "--grad-comm-dtype bf16" launch 2 "$bin/02_ddp" "${S[@]}" --grad-comm-dtype bf16
    ok
    see "sent 1.75 MB"
    paste <(losses) <(echo "$fp32_losses") | awk '{ d = ($1 - $2) / $2; if (d < 0) d = -d; if (d > 1e-3) exit 1 }' ||
      fail "losses not within 1e-3 of fp32's: '$(echo $(losses))' against '$(echo $fp32_losses)'"
    try "--trace trace.json --steps 5 --bucket-mb 0.05" launch 2 "$bin/02_ddp" --trace trace.json --steps 5 \
      --bucket-mb 0.05
    ok
    grep -q "all-reduce bucket" trace.merged.json || fail "no bucket all-reduce in trace.merged.json"
    try "chapter 00 at --batch 12" "$bin/00_single_gpu" "${S[@]}" --batch 12
    ok
    single="$(losses)"
    try "--nproc-per-node 3 --batch 12" launch 3 "$bin/02_ddp" "${S[@]}" --batch 12
    ok
    check_losses "$(losses)" "$single" "chapter 00's losses"
    try "chapter 00" "$bin/00_single_gpu" "${S[@]}"
    ok
    single="$(losses)"
    try "--sites 2 --wan-bandwidth 100Mbit --wan-latency 25ms" launch 2 "$bin/02_ddp" "${S[@]}" --sites 2 \
      --wan-bandwidth 100Mbit --wan-latency 25ms --log wan.jsonl
    ok
    check_losses "$(losses)" "$single" "the same losses"
    awk -v ms="$(logged wan.jsonl comm_ms_per_step)" 'BEGIN { exit !(ms >= 280 + 25) }' ||
      fail "less than 0.28 s and a latency of communication a step"
    try "COURSE_TCP_TRANSPORT=socket" env COURSE_TCP_TRANSPORT=socket "$bin/launch" --nproc-per-node 2 -- \
      "$bin/02_ddp" "${S[@]}"
    ok
    check_losses "$(losses)" "$single" "the same losses"
    if have_mpirun; then
      try "--backend mpi under mpirun" mpirun_np 2 "$bin/02_ddp" "${S[@]}"
      ok
      see "backend mpi"
      check_losses "$(losses)" "$single" "the same losses"
    fi
    ;;
  03)
    try "--zero-stage 1" launch 2 "$bin/03_fsdp" "${S[@]}" --zero-stage 1
    ok
    one="$(losses)"
    see "gradients +3.50 MB"
    see "grad 3.50 MB param 1.75 MB"
    try "--zero-stage 2" launch 2 "$bin/03_fsdp" "${S[@]}" --zero-stage 2
    ok
    check_losses "$(losses)" "$one" "the same losses"
    see "gradients +1.75 MB"
    see "grad 1.75 MB param 1.75 MB"
    try "--nproc-per-node 4 --zero-stage 2" launch 4 "$bin/03_fsdp" "${S[@]}" --zero-stage 2
    ok
    see "optimizer_state +1.75 MB"
    try "chapter 00 with --grad-clip 1.0" "$bin/00_single_gpu" "${S[@]}" --grad-clip 1.0
    ok
    single="$(losses)"
    try "--grad-clip 1.0" launch 2 "$bin/03_fsdp" "${S[@]}" --grad-clip 1.0
    ok
    check_losses "$(losses)" "$single" "chapter 00's losses"
    try "a straight 4-step run" launch 2 "$bin/03_fsdp" --steps 4 --print-every 1
    ok
    straight="$(losses | tail -n 2)"
    try "a 2-rank run to resume" launch 2 "$bin/03_fsdp" --steps 2 --checkpoint-dir ckpt
    ok
    see "checkpoint: step 2 saved in ckpt"
    cp -r ckpt ckpt_stage1
    try "resumed with --nproc-per-node 4" launch 4 "$bin/03_fsdp" --steps 4 --checkpoint-dir ckpt --resume
    ok
    see "resumed from"
    check_losses "$(losses)" "$straight" "the straight run's losses"
    try "resumed at --zero-stage 1" launch 2 "$bin/03_fsdp" --steps 4 --zero-stage 1 --checkpoint-dir ckpt_stage1 \
      --resume
    ok
    check_losses "$(losses)" "$straight" "the straight run's losses"
    if have_mpirun; then
      for stage in 1 2; do
        try "--zero-stage $stage at 4 ranks under mpirun" mpirun_np 4 "$bin/03_fsdp" "${S[@]}" --zero-stage $stage \
          --log "mpi$stage.jsonl"
        ok
        [[ -n "$(logged "mpi$stage.jsonl" comm_ms)" ]] || fail "no comm_ms in the log"
      done
    fi
    try "stage 3 at 2 ranks" launch 2 "$bin/03_fsdp" "${S[@]}"
    ok
    see "parameters +1.75 MB"
    see "comm_buffers +2.38 MB"
    try "stage 3 at 4 ranks" launch 4 "$bin/03_fsdp" "${S[@]}"
    ok
    see "parameters +875.26 KB"
    see "comm_buffers +2.38 MB"
    try "--no-reshard-after-forward" launch 2 "$bin/03_fsdp" "${S[@]}" --no-reshard-after-forward
    ok
    see "param 1.75 MB"
    see "comm_buffers +4.16 MB"
    try "--no-prefetch" launch 2 "$bin/03_fsdp" "${S[@]}" --no-prefetch
    ok
    see "comm_buffers +1.59 MB"
    try "--trace trace.json --steps 5" launch 2 "$bin/03_fsdp" --trace trace.json --steps 5
    ok
    grep -q "all-gather" trace.merged.json && grep -q "reduce-scatter" trace.merged.json ||
      fail "no all-gather or reduce-scatter in trace.merged.json"
    try "--trace at stage 1" launch 2 "$bin/03_fsdp" --trace stage1.json --steps 5 --zero-stage 1
    ok
    grep -q "all-reduce" stage1.merged.json && grep -q "all-gather parameters" stage1.merged.json ||
      fail "stage 1's trace lacks its all-reduce or its all-gather of the parameters"
    ;;
  04)
    try "--nproc-per-node 4" launch 4 "$bin/04_naive_model_parallel" "${S[@]}"
    ok
    see "\(N-1\)/N = 75.0% expected at N = 4"
    try "--layers 5 on 2 ranks" launch 2 "$bin/04_naive_model_parallel" "${S[@]}" --layers 5
    ok
    see "rank 0: embedding \+ blocks 0-2"
    see "rank 1: blocks 3-4 \+ head"
    try "one micro-batch" launch 2 "$bin/04_naive_model_parallel" "${S[@]}" --log whole.jsonl
    ok
    try "--micro-batches 4" launch 2 "$bin/04_naive_model_parallel" "${S[@]}" --micro-batches 4 --log quarter.jsonl
    ok
    check_near "$(logged whole.jsonl peak_activations)" "$(logged quarter.jsonl peak_activations)" 4 \
      "the activation memory drops by 4"
    try "--layers 2 on 4 ranks" launch 4 "$bin/04_naive_model_parallel" "${S[@]}" --layers 2
    refused
    see "layers"
    try "--trace trace.json --steps 5" launch 2 "$bin/04_naive_model_parallel" --trace trace.json --steps 5
    ok
    grep -q "recv activation" trace.merged.json && grep -q "recv gradient" trace.merged.json ||
      fail "no recv activation or recv gradient in trace.merged.json"
    ;;
  05)
    for m in 1 2 4 8 16; do
      try "--micro-batches $m" launch 2 "$bin/05_pipeline" "${S[@]}" --micro-batches $m --batch 16
      ok
      see "formula $(awk -v m=$m 'BEGIN { printf "%.1f", 100 / (m + 1) }')%"
    done
    for m in 2 8; do
      try "gpipe at $m micro-batches" launch 2 "$bin/05_pipeline" "${S[@]}" --schedule gpipe --micro-batches $m \
        --log "gpipe$m.jsonl"
      ok
      try "1f1b at $m micro-batches" launch 2 "$bin/05_pipeline" "${S[@]}" --schedule 1f1b --micro-batches $m \
        --log "1f1b$m.jsonl"
      ok
    done
    check_same "$(logged gpipe2.jsonl peak_activations)" "$(logged gpipe8.jsonl peak_activations)" \
      "GPipe's activations stay put"
    check_less "$(logged 1f1b8.jsonl peak_activations)" "$(logged 1f1b2.jsonl peak_activations)" \
      "1F1B's activations fall from 2 to 8 micro-batches"
    for schedule in gpipe 1f1b; do
      try "--schedule $schedule at 4 ranks and M = 8" launch 4 "$bin/05_pipeline" "${S[@]}" --schedule $schedule \
        --micro-batches 8
      ok
      see "formula 27.3%"
    done
    for schedule in gpipe 1f1b interleaved zb-h1; do
      try "--dry-run --pp 8 --micro-batches 8 --schedule $schedule" "$bin/05_pipeline" --dry-run --pp 8 \
        --micro-batches 8 --schedule $schedule --layers 8
      ok
      see "bubble"
    done
    try "--schedule interleaved --virtual-stages 4 --layers 8" launch 2 "$bin/05_pipeline" "${S[@]}" \
      --schedule interleaved --virtual-stages 4 --layers 8
    ok
    see "sent/step"
    echo "[$chapter] a broken schedule.cpp: the simulator's deadlock report is test_schedule's"
    ;;
  06)
    try "--tp 2" launch 2 "$bin/06_tensor_parallel" "${S[@]}" --log tp2.jsonl
    ok
    if have_mpirun; then
      try "--tp 4 under mpirun -np 4" mpirun_np 4 "$bin/06_tensor_parallel" "${S[@]}" --log tp4.jsonl
    else
      try "--tp 4" launch 4 "$bin/06_tensor_parallel" "${S[@]}" --log tp4.jsonl
    fi
    ok
    check_less "$(logged tp4.jsonl peak_parameters)" "$(logged tp2.jsonl peak_parameters)" \
      "the parameters shrink at tp 4"
    check_near "$(logged tp4.jsonl bytes_sent)" "$(logged tp2.jsonl bytes_sent)" 1.5 "bytes per step grow by 3/2"
    try "--seq 256" launch 2 "$bin/06_tensor_parallel" --steps 1 --seq 256 --log seq.jsonl
    ok
    try "--seq 256 --sp" launch 2 "$bin/06_tensor_parallel" --steps 1 --seq 256 --sp --log seq_sp.jsonl
    ok
    check_less "$(logged seq_sp.jsonl peak_activations)" "$(logged seq.jsonl peak_activations)" \
      "--sp shrinks the activations"
    echo "[$chapter] keeping the gathered LayerNorm outputs is a code change; the bytes it would save are test_tensor_parallel's"
    try "--trace trace.json --steps 5" launch 2 "$bin/06_tensor_parallel" --trace trace.json --steps 5
    ok
    grep -q "g all-reduce" trace.merged.json && grep -q "f all-reduce" trace.merged.json &&
      grep -q "wgrad GEMM" trace.merged.json || fail "the trace lacks f, g or the wgrad GEMM"
    try "--trace with --sp" launch 2 "$bin/06_tensor_parallel" --trace sp.json --steps 5 --sp
    ok
    grep -q "f all-gather (sp)" sp.merged.json && grep -q "g reduce-scatter (sp)" sp.merged.json ||
      fail "the --sp trace lacks its all-gather or reduce-scatter"
    echo "[$chapter] TPPart on a stage range: chapter 07 builds its stages so (test_3d)"
    ;;
  07)
    try "07_plan llama-70b, 60 rows" "$bin/07_plan" --model llama-70b --nodes 128 --recompute selective --rows 60
    ok
    see "IB"
    see "16x8x8"
    try "07_plan gpt2-1.5b, 4 GPUs a node" "$bin/07_plan" --model gpt2-1.5b --nodes 4 --devices-per-node 4
    ok
    see "grid's order"
    try "--layout 16x8x8 --sp --schedule interleaved" "$bin/07_plan" --model llama-70b --nodes 128 \
      --recompute selective --layout 16x8x8 --sp --schedule interleaved
    ok
    see "activ\."
    try "2x2x2 with --log" launch 8 "$bin/07_3d" --dp 2 --pp 2 --tp 2 "${S[@]}" --log grid.jsonl
    ok
    try "... and 07_plan --precision fp32 --layout 2x2x2" "$bin/07_plan" --precision fp32 --layout 2x2x2
    ok
    see_figure "$(logged grid.jsonl rank0_tp_sent_per_step)" MB
    try "4x2x1 with --log" launch 8 "$bin/07_3d" --dp 4 --pp 2 --tp 1 --micro-batches 2 "${S[@]}" --log grid4.jsonl
    ok
    try "... and 07_plan --precision fp32 --micro-batches 2 --layout 4x2x1" "$bin/07_plan" --precision fp32 \
      --micro-batches 2 --layout 4x2x1
    ok
    see_figure "$(logged grid4.jsonl rank0_pp_sent_per_step)" KB
    try "a custom llama-8b" "$bin/07_plan" --layers 32 --d-model 4096 --heads 32 --seq 8192 --vocab 128256 \
      --batch 512 --micro-batches 64 --recompute selective
    ok
    see "fit"
    try "... with --recompute full" "$bin/07_plan" --layers 32 --d-model 4096 --heads 32 --seq 8192 --vocab 128256 \
      --batch 512 --micro-batches 64 --recompute full
    ok
    see "fit"
    try "--trace trace.json --steps 3 --schedule zb-h1" launch 8 "$bin/07_3d" --dp 2 --pp 2 --tp 2 --steps 3 \
      --schedule zb-h1 --trace trace.json
    ok
    grep -q '"W0' trace.merged.json || fail "no W span in trace.merged.json"
    try "a straight 8-step run at 2x2x2" launch 8 "$bin/07_3d" --dp 2 --pp 2 --tp 2 --steps 8 --print-every 1
    ok
    straight="$(losses | tail -n 4)"
    try "train 4 steps at 2x2x2" launch 8 "$bin/07_3d" --dp 2 --pp 2 --tp 2 --steps 4 --checkpoint-dir y
    ok
    cp -r y y8
    cp -r y y1
    try "resume as 8x1x1 ZeRO-1" launch 8 "$bin/07_3d" --dp 8 --zero-stage 1 --micro-batches 1 --steps 8 \
      --checkpoint-dir y8 --resume --print-every 1
    ok
    see "resharding:"
    check_losses "$(losses)" "$straight" "the straight run's losses"
    try "resume as one process" "$bin/07_3d" --steps 8 --checkpoint-dir y1 --resume --print-every 1
    ok
    see "resharding:"
    check_losses "$(losses)" "$straight" "the straight run's losses"
    echo "[$chapter] breaking clip_grid_gradients is a code change: test_3d's clipping case fails then"
    ;;
  08)
    try "--seq 2048 --cp 2" launch 2 "$bin/08_context_parallel" --steps 1 --batch 2 --seq 2048 --cp 2 --log cp2.jsonl
    ok
    try "--seq 2048 --cp 4" launch 4 "$bin/08_context_parallel" --steps 1 --batch 2 --seq 2048 --cp 4 --log cp4.jsonl
    ok
    awk -v a="$(logged cp2.jsonl peak_activations)" -v b="$(logged cp4.jsonl peak_activations)" \
      'BEGIN { exit !(a / b > 1.8 && a / b < 2.2) }' || fail "the activations per rank do not halve"
    check_near "$(logged cp4.jsonl cp_bytes_sent)" "$(logged cp2.jsonl cp_bytes_sent)" 1.25 \
      "the ring's bytes grow from 4 B T C to 5 B T C"
    try "--cp-split contiguous --trace cp.json" launch 2 "$bin/08_context_parallel" --steps 2 --cp-split contiguous \
      --trace cp.json
    ok
    [[ -s cp.merged.json ]] || fail "no cp.merged.json"
    try "--cp-mode a2a --cp 4 --heads 4" launch 4 "$bin/08_context_parallel" "${S[@]}" --cp-mode a2a --cp 4 --heads 4
    ok
    try "--cp-mode a2a --cp 4 --heads 6 --d-model 96" launch 4 "$bin/08_context_parallel" "${S[@]}" --cp-mode a2a \
      --cp 4 --heads 6 --d-model 96
    refused
    see "heads"
    try "--heads 6 alone" launch 4 "$bin/08_context_parallel" "${S[@]}" --cp-mode a2a --cp 4 --heads 6
    refused
    see "d-model"
    try "--cp 2 on 2 ranks" launch 2 "$bin/08_context_parallel" "${S[@]}" --cp 2 --log alone.jsonl
    ok
    try "--dp 2 --cp 2 on 4 ranks" launch 4 "$bin/08_context_parallel" "${S[@]}" --dp 2 --cp 2 --log dp.jsonl
    ok
    check_near "$(logged alone.jsonl cp_bytes_sent)" "$(logged dp.jsonl cp_bytes_sent)" 2 "the cp bytes halve"
    try "a cp 2 run to resume" launch 2 "$bin/08_context_parallel" --steps 2 --cp 2 --checkpoint-dir cp
    ok
    cp -r cp cp00
    try "resumed with --cp 4" launch 4 "$bin/08_context_parallel" --steps 4 --cp 4 --checkpoint-dir cp --resume
    ok
    see "resumed from"
    try "resumed in chapter 00" "$bin/00_single_gpu" --steps 4 --checkpoint-dir cp00 --resume
    ok
    see "resumed from"
    ;;
  09)
    moe=(--experts 8 --top-k 1 --capacity-factor 1.0)
    try "--experts 8 --top-k 1 --capacity-factor 1.0 at --ep 4" launch 4 "$bin/09_expert_parallel" "${S[@]}" \
      "${moe[@]}" --ep 4
    ok
    see "expert ms"
    see "of the token-choices dropped"
    try "... then --aux-loss-coef 0" launch 4 "$bin/09_expert_parallel" "${S[@]}" "${moe[@]}" --ep 4 --aux-loss-coef 0
    ok
    try "one rank, --ep 1" launch 1 "$bin/09_expert_parallel" --steps 10 --print-every 1 --experts 4 --ep 1
    ok
    ep1="$(losses)"
    try "two ranks, --ep 2" launch 2 "$bin/09_expert_parallel" --steps 10 --print-every 1 --experts 4 --ep 2 \
      --log ep2.jsonl
    ok
    check_losses "$(losses)" "$ep1" "the same losses for ten steps"
    grep -q '"expert_choices' ep2.jsonl || fail "no expert_choices in the JSON log"
    try "--trace ep.json" launch 2 "$bin/09_expert_parallel" --steps 2 --experts 4 --trace ep.json
    ok
    grep -q "dispatch all_to_all" ep.merged.json && grep -q "combine all_to_all" ep.merged.json &&
      grep -q "experts forward" ep.merged.json || fail "no all-to-all or experts span in ep.merged.json"
    try "an --ep 2 run to resume" launch 2 "$bin/09_expert_parallel" --steps 2 --experts 4 --checkpoint-dir ep
    ok
    cp -r ep ep00
    try "resumed at --ep 4" launch 4 "$bin/09_expert_parallel" --steps 4 --experts 4 --checkpoint-dir ep --resume
    ok
    see "resumed from"
    try "consolidated" "$bin/consolidate_checkpoint" --checkpoint-dir ep00 --out-dir whole
    ok
    try "... and resumed in chapter 00" "$bin/00_single_gpu" --steps 4 --experts 4 --checkpoint-dir whole --resume
    ok
    see "resumed from"
    ;;
  10)
    wan=(--sites 2 --wan-bandwidth 100Mbit --wan-latency 25ms)
    try "DDP over the link" launch 2 "$bin/10_slow_links" --algorithm ddp "${wan[@]}" --steps 10 --log ddp.jsonl
    ok
    see "sent 3.50 MB"
    try "DiLoCo at H 10 over the link" launch 2 "$bin/10_slow_links" --inner-steps 10 "${wan[@]}" --steps 10 \
      --log diloco.jsonl
    ok
    check_near "$(logged ddp.jsonl bytes_sent_per_step)" "$(logged diloco.jsonl bytes_sent_per_step)" 10 \
      "ten times DiLoCo's bytes a step"
    try "--grad-compression int8" launch 2 "$bin/10_slow_links" --algorithm ddp --grad-compression int8 "${S[@]}"
    ok
    see "sent 889.20 KB"
    try "--grad-compression bf16" launch 2 "$bin/10_slow_links" --algorithm ddp --grad-compression bf16 "${S[@]}"
    ok
    see "sent 1.75 MB"
    sgd=(--inner-optimizer sgd --lr 0.1 --steps 20 --print-every 1)
    try "DDP with SGD" launch 2 "$bin/10_slow_links" --algorithm ddp "${sgd[@]}"
    ok
    ddp="$(losses)"
    try "DiLoCo at H 1, SGD inside and out" launch 2 "$bin/10_slow_links" --inner-steps 1 --outer-lr 1 \
      --outer-momentum 0 "${sgd[@]}"
    ok
    check_losses "$(losses)" "$ddp" "the same losses"
    try "--fragments 2 --overlap-steps 1" launch 2 "$bin/10_slow_links" --fragments 2 --overlap-steps 1 --steps 20 \
      --print-every 1
    ok
    see "sent 1.78 MB"
    see "sent 1.72 MB"
    try "--fragments 3" launch 2 "$bin/10_slow_links" --fragments 3 "${S[@]}"
    refused
    see "does not divide the 4 layers"
    item="fault tolerant, kill -9 a worker"
    "$bin/launch" --nproc-per-node 4 --restart-policy worker --max-restarts 1 -- "$bin/10_slow_links" --fault-tolerant \
      --inner-steps 10 --steps 400 --print-every 10 >ft.out 2>&1 &
    kill_a_worker $! "[^ ]*10_slow_links --fault-tolerant --inner-steps 10 --steps 400 --print-every 10" ft.out \
      'for _ in $(seq 300); do grep -q "step  20/400" ft.out && break; sleep 0.1; done'
    ok
    see "restarting rank [0-3] alone"
    see "joined at outer step [0-9]+ with the global weights"
    see "step 400/400"
    ;;
  *)
    echo "things_to_try: no chapter '$chapter' (00 to 10)" >&2
    exit 2
    ;;
esac

if [[ $failures -gt 0 ]]; then
  echo "things_to_try $chapter: $failures item(s) did not do what the README says"
  exit 1
fi
echo "things_to_try $chapter: every item did what the README says"
