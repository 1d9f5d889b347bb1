#!/usr/bin/env bash
# What to run on a machine with an NVIDIA GPU before believing anything the course
# says about GPUs. Most informative first, each step under its own timeout, every
# line written as it comes into the results folder ($OUT when the device tool runs
# it, else runs/gpu-checks-<time>/): summary.txt (one line a step: verdict, seconds)
# and details.log (every step's output).
#
#   1. the GPU's facts (nvidia-smi)
#   2. test_cuda: every CUDA op and the GPT against the CPU
#   3. communication on GPU buffers: nccl at one rank, tcp staged through the host at
#      two ranks sharing the GPU (comm_worker, through test_comm_cuda's cases)
#   4. chapter 00 in fp32 and bf16, then every chapter at two ranks against it on the
#      same GPU (fp32 within 1e-5 relative; bf16 within 1e-2: below), and 02 on nccl
#      at one rank (its host scalars); chapter 10 (whose step loss is worker 0's own)
#      against the same run on the CPU (fp32 within 1e-3: cuBLAS and OpenBLAS add in
#      other orders, and an int8 message's rounding can flip on the last bit)
#   5. chapter 00's step at GPT-2 small's shape: MFU, informational until bf16 storage
#      is real (every GEMM converts its fp32 inputs today)
#   6. compute-sanitizer memcheck, then racecheck, on test_cuda
#
# A step that exits 77 ("skipped: no GPU") failed: on a GPU machine nothing may skip.
# Exits 1 naming what failed. Two ways to get the programs:
#   - from the GPU kit (scripts/make_gpu_kit.sh, carried as gpu_kit/): this script is
#     then gpu_kit/run_gpu_checks.sh, and needs nothing the machine lacks;
#   - else built here with the cuda preset (needs OpenBLAS and Catch2).
#   ./gpu_kit/run_gpu_checks.sh              # about 6 minutes on 16 cores (see the README)
#   ./scripts/make_gpu_kit.sh --rehearse     # the same steps here, with no GPU: the guarded device
#
# The bf16 bound: a parallel run splits the batch or the matrices, so its fp32
# accumulations add in another order and its weights differ from chapter 00's in the
# last bits. Rounded to bf16 (8 significant bits) for the next product, a value that
# sits near a rounding boundary can go the other way: a 2^-8 = 0.4% change in one
# input of one product. Averaged over the batch's tokens those flips move the loss
# by far less, but they do not cancel step after step, so 20 steps get 1e-2 (fp32
# runs stay within 1e-5 because nothing rounds away the last bits).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
rehearse=0
if [ "${1:-}" = "--rehearse" ]; then rehearse=1; fi

out="${OUT:-}"
if [ -z "$out" ]; then out="runs/gpu-checks-$(date +%Y%m%d-%H%M%S)"; fi
mkdir -p "$out"
summary="$out/summary.txt"
details="$out/details.log"
: >"$summary"
: >"$details"
say() { echo "$*" | tee -a "$summary" "$details"; }
failures=()
started_all=$(date +%s)

# step NAME SECONDS COMMAND...: runs it under `timeout`, its output into details.log;
# one summary line. A 77 is a failure, except the GPU tests of a rehearsal.
step() {
  local name="$1" seconds="$2"
  shift 2
  echo "==== $name: $*" >>"$details"
  local start rc verdict
  start=$(date +%s.%N)
  timeout --kill-after=10 "$seconds" "$@" >>"$details" 2>&1
  rc=$?
  local took
  took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  case "$rc" in
    0) verdict=ok ;;
    124 | 137) verdict="TIMEOUT after ${seconds}s" ;;
    77) verdict="SKIPPED (exit 77)" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  if [ "$rc" = 77 ] && [ "$rehearse" = 1 ]; then verdict="not run (rehearsal: no GPU)"; rc=0; fi
  if [ "$rc" != 0 ]; then failures+=("$name: $verdict"); fi
  printf '%-44s %-30s %6ss\n' "$name" "$verdict" "$took" | tee -a "$summary"
  return "$rc"
}

# ---- where the programs are ----------------------------------------------------------------------
if [ -d "$here/bin" ]; then  # the kit
  bin="$here/bin"
  # the machine's own CUDA libraries: the toolkit's, or the ones PyTorch's wheels bring
  cuda_libs="$here/lib"
  for name in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    found=$(find /usr/local/cuda/lib64/ /usr/local/cuda/targets/x86_64-linux/lib/ /usr/lib/x86_64-linux-gnu/ \
              /opt /usr/local/lib -name "$name" 2>/dev/null | head -1)
    if [ -n "$found" ]; then cuda_libs="$cuda_libs:$(dirname "$found")"; else say "note: $name not found here"; fi
  done
  export LD_LIBRARY_PATH="$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "kit: $(head -2 "$here/BUILT" | tr '\n' ' ')"
else
  cd "$here/.." || exit 2
  ./scripts/setup.sh >>"$details" 2>&1 || echo "(setup could not install packages; building with what is here)"
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
  step "configure (cuda preset, sm_${arch:-?})" 120 cmake --preset cuda ${arch:+-DCMAKE_CUDA_ARCHITECTURES=$arch} ||
    { say "run_gpu_checks: cannot configure here (hint: build the kit elsewhere: scripts/make_gpu_kit.sh)"; exit 1; }
  step "build" 480 cmake --build --preset cuda -j "$(nproc)" || exit 1
  bin="$here/../build/cuda/bin"
fi
export COURSE_BIN_DIR="$bin"  # the tests' programs

# ---- 1. the GPU ----------------------------------------------------------------------------------
device=cuda
gpus=0
gpu_name="no GPU"
if [ "$rehearse" = 1 ]; then
  device=guarded  # the GPU's rules on the CPU: every step below runs, through the same code path
  say "rehearsal: no GPU; the chapters run on --device guarded, the GPU tests exit 77"
elif nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | wc -l)
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee -a "$summary" "$details"
else
  say "run_gpu_checks: no NVIDIA GPU here (nvidia-smi finds none; hint: --rehearse runs the steps without one)"
  exit 2
fi

# ---- 2. the CUDA ops and the GPT against the CPU --------------------------------------------------
step "test_cuda (CUDA ops and GPT vs the CPU)" 240 "$bin/test_cuda"

# ---- 3. communication on GPU buffers -------------------------------------------------------------
step "test_comm_cuda (nccl 1 rank, staged 2 ranks)" 240 "$bin/test_comm_cuda"

# ---- 4. every chapter against chapter 00 on the same device ---------------------------------------
ranks=2
backend=tcp  # one GPU: the ranks share it, their buffers staged through the host
if [ "$gpus" -ge "$ranks" ]; then backend=nccl; fi
model=(--layers 4 --d-model 128 --heads 4 --seq 128 --batch 8 --micro-batches 2 --steps 20 --quiet)
logs=$(mktemp -d)

# the losses of two logs, step by step: the largest relative difference
max_relative_difference() {
  paste <(grep -o '"loss": [-0-9.e+]*' "$1" | cut -d' ' -f2) <(grep -o '"loss": [-0-9.e+]*' "$2" | cut -d' ' -f2) |
    awk 'BEGIN { worst = 0; n = 0 }
         { n++; d = ($1 - $2) / ($2 == 0 ? 1 : $2); if (d < 0) d = -d; if (d > worst) worst = d }
         END { if (n == 0) print "none"; else printf "%.3g\n", worst }'
}

# compare NAME LOG REFERENCE BOUND [AGAINST]: a summary line, and a failure when it is over
# (AGAINST names the reference run: chapter 00 unless said)
compare() {
  local difference against="${5:-chapter 00}"
  difference=$(max_relative_difference "$2" "$3")
  if [ "$difference" = none ] || awk -v d="$difference" -v b="$4" 'BEGIN { exit !(d > b) }'; then
    failures+=("$1: losses differ from $against's by $difference (bound $4)")
    say "  $1: largest loss difference vs $against $difference: OVER $4"
  else
    say "  $1: largest loss difference vs $against $difference (bound $4)"
  fi
}

chapters=(
  "02_ddp 02_ddp"
  "03_zero1 03_fsdp --zero-stage 1"
  "03_fsdp 03_fsdp --zero-stage 3"
  "04_naive 04_naive_model_parallel"
  "05_1f1b 05_pipeline --schedule 1f1b"
  "05_zb-h1 05_pipeline --schedule zb-h1"
  "06_tp 06_tensor_parallel"
  "06_tp_sp 06_tensor_parallel --sp"
  "07_dp_tp 07_3d --dp 1 --pp 1 --tp 2 --sp"
  "07_pp 07_3d --dp 1 --pp 2 --tp 1"
  "07_zero3 07_3d --dp 2 --pp 1 --tp 1 --zero-stage 3"
  "08_cp 08_context_parallel"
)
# chapter 09 against chapter 00 with the same experts, over 10 steps: routing flips a
# near-tied choice once the two runs' last bits have drifted far enough (at fp32 on the
# CPU, after step 14: tests/test_ep_training.cpp), and the runs then take other routes.
# One micro-batch: capacity is per micro-batch, and 09's micro-batch holds other
# sequences of the batch than 00's (each rank's first rows), so its drops differ.
moe=(--experts 4 --top-k 2 --steps 10 --micro-batches 1)
for dtype in fp32 bf16; do
  bound=1e-5
  if [ "$dtype" = bf16 ]; then bound=1e-2; fi
  reference="$logs/00_$dtype.jsonl"
  step "00_single_gpu $dtype" 90 "$bin/00_single_gpu" "${model[@]}" --device "$device" --dtype "$dtype" \
    --log "$reference" || continue
  for entry in "${chapters[@]}"; do
    read -r name chapter flags <<<"$entry"
    log="$logs/${name}_$dtype.jsonl"
    # shellcheck disable=SC2086
    step "$name $dtype ($ranks ranks, $backend)" 120 "$bin/launch" --nproc-per-node "$ranks" -- "$bin/$chapter" \
      "${model[@]}" $flags --device "$device" --dtype "$dtype" --backend "$backend" --comm-timeout 60 \
      --log "$log" && compare "$name $dtype" "$log" "$reference" "$bound"
  done
  moe_reference="$logs/00_experts_$dtype.jsonl"
  step "00_single_gpu --experts $dtype" 90 "$bin/00_single_gpu" "${model[@]}" "${moe[@]}" --device "$device" \
    --dtype "$dtype" --log "$moe_reference" || continue
  step "09_ep $dtype ($ranks ranks, $backend)" 120 "$bin/launch" --nproc-per-node "$ranks" -- \
    "$bin/09_expert_parallel" "${model[@]}" "${moe[@]}" --device "$device" --dtype "$dtype" --backend "$backend" \
    --comm-timeout 60 --log "$logs/09_ep_$dtype.jsonl" &&
    compare "09_ep $dtype" "$logs/09_ep_$dtype.jsonl" "$moe_reference" "$bound"
  # chapter 10 against itself on the CPU: its step's loss is worker 0's own, not chapter
  # 00's. Streaming DiLoCo with int8 pseudo-gradients: the link ops (int8 messages, error
  # feedback, the outer Nesterov step) on the device, every 2 steps a fragment. At fp32
  # only: the link ops do not depend on --dtype, and the model's bf16 is proven above.
  if [ "$dtype" = fp32 ]; then
    slow_links=(--inner-steps 4 --fragments 2 --grad-compression int8 --steps 8)
    for where in cpu "$device"; do
      step "10_diloco_int8 fp32 on $where ($ranks ranks)" 120 "$bin/launch" --nproc-per-node "$ranks" -- \
        "$bin/10_slow_links" "${model[@]}" "${slow_links[@]}" --device "$where" --backend tcp --comm-timeout 60 \
        --log "$logs/10_$where.jsonl"
    done
    compare "10_diloco_int8 fp32" "$logs/10_$device.jsonl" "$logs/10_cpu.jsonl" 1e-3 "the same run on the CPU"
  fi
done
if [ "$rehearse" = 0 ]; then
  # host scalars (the loss, the gradient norm) on an nccl communicator
  step "02_ddp fp32 (1 rank, nccl)" 90 "$bin/launch" --nproc-per-node 1 -- "$bin/02_ddp" "${model[@]}" \
    --device cuda --backend nccl --comm-timeout 60 --log "$logs/02_nccl.jsonl" &&
    compare "02_ddp nccl" "$logs/02_nccl.jsonl" "$logs/00_fp32.jsonl" 1e-5
fi
# the gradient buckets sent as bf16: the casts on the device, 2-byte elements through the backend
step "02_ddp bf16 gradients ($ranks ranks, $backend)" 120 "$bin/launch" --nproc-per-node "$ranks" -- "$bin/02_ddp" \
  "${model[@]}" --device "$device" --grad-comm-dtype bf16 --backend "$backend" --comm-timeout 60 \
  --log "$logs/02_bf16_grads.jsonl" && compare "02_ddp bf16 gradients" "$logs/02_bf16_grads.jsonl" "$logs/00_fp32.jsonl" 1e-3
say "verdicts on every chapter after $(($(date +%s) - started_all)) s"

# ---- 5. chapter 00's step at GPT-2 small's shape ---------------------------------------------------
case "$gpu_name" in
  *H100*PCIe*) peak=756 ;;
  *H100* | *H200*) peak=989.4 ;;
  *A100*) peak=312 ;;
  *L4*) peak=121 ;;
  *) peak=1 ;;
esac
if [ "$rehearse" = 0 ]; then
  # MFU against the dense bf16 peak (1: an unknown GPU); informational, not a gate
  step "bench_gpu_step (GPT-2 small, MFU vs ${peak} TFLOP/s)" 180 "$bin/bench_gpu_step" --peak-tflops "$peak" \
    --steps 10 --warmup 3
  tail -8 "$details" >>"$summary"
fi

# ---- 6. compute-sanitizer on test_cuda -----------------------------------------------------------
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ "$rehearse" = 1 ] || [ ! -x "$sanitizer" ]; then
  say "compute-sanitizer: not run ($([ "$rehearse" = 1 ] && echo rehearsal || echo 'not found'))"
else
  step "compute-sanitizer memcheck (test_cuda)" 240 "$sanitizer" --tool memcheck --error-exitcode 3 "$bin/test_cuda"
  step "compute-sanitizer racecheck (test_cuda)" 240 "$sanitizer" --tool racecheck --error-exitcode 3 \
    "$bin/test_cuda"
fi
rm -rf "$logs"

say ""
say "run_gpu_checks: $(($(date +%s) - started_all)) s in all"
if [ ${#failures[@]} -eq 0 ]; then
  say "run_gpu_checks: everything passed on $gpu_name"
  exit 0
fi
say "run_gpu_checks: ${#failures[@]} failure(s) on $gpu_name:"
for failure in "${failures[@]}"; do say "  - $failure"; done
exit 1
