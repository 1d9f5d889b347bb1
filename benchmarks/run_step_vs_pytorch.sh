#!/usr/bin/env bash
# Chapter 00's training step next to the same model in PyTorch eager, or (--ddp)
# chapter 02 next to PyTorch DistributedDataParallel, on this machine's CPU, in
# alternating rounds, with the single-core sgemm rate beside them:
#   ./benchmarks/run_step_vs_pytorch.sh [--ddp] [--ranks 2] [--dtype fp32] [--rounds 3] [--layers 4]
#       [--d-model 128] [--heads 4] [--seq 128] [--batch 8] [--steps 30] [--warmup 3]
#       [--python PATH] [--no-sgemm] [--no-build | --bin DIR]
# First it runs bench_train_step (this core's sgemm rate, and chapter 00's tiny and
# larger configurations as % of it). Then each round runs ours (00_single_gpu, one
# process, or with --ddp build/bin/launch ... 02_ddp on --ranks processes; our median
# tokens/s over --steps steps) and then PyTorch's side (benchmarks/pytorch_gpt.py
# --device cpu --dtype fp32 --threads 1, or with --ddp benchmarks/pytorch_ddp.py; the
# median over --steps steps after --warmup untimed ones), and prints ours / PyTorch
# per round, the median ratio and its spread, and both sides' median as % of the
# sgemm rate (× ranks with --ddp). One thread per process on both sides; --ddp splits
# the same global --batch over the ranks on both. --dtype bf16 (without --ddp): ours at
# --dtype bf16 against PyTorch's CPU autocast to bf16. PyTorch is looked for in
# ~/.cache/course-bench-venv, then python3 (--python picks one); without it only our
# rows are printed. --no-build uses build/bin as it is, --bin DIR another build's bin/
# (build/cpu/bin), without building. --no-sgemm skips bench_train_step.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/alternate_rounds.sh

bin=build/bin ddp=0 ranks=2 dtype=fp32 rounds=3 layers=4 dmodel=128 heads=4 seq=128 batch=8 steps=30 warmup=3
python="" build=1 sgemm=1
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ddp) ddp=1; shift ;;
    --ranks) ranks="$2"; shift 2 ;;
    --dtype) dtype="${2:?--dtype needs fp32 or bf16}"; shift 2 ;;
    --no-sgemm) sgemm=0; shift ;;
    -h|--help) usage ;;
    *) if shared_flag "$@"; then shift "$consumed"; else echo "run_step_vs_pytorch.sh: unknown argument '$1'" >&2; usage; fi ;;
  esac
done

if [[ $dtype != fp32 && $dtype != bf16 ]]; then
  echo "run_step_vs_pytorch.sh: --dtype must be fp32 or bf16, not '$dtype'" >&2
  exit 2
fi
if [[ $dtype == bf16 && $ddp == 1 ]]; then
  echo "run_step_vs_pytorch.sh: --dtype bf16 compares chapter 00 only (hint: drop --ddp; 02's bf16 gradients are benchmarks/run_bf16.sh's)" >&2
  exit 2
fi

# ---- both sides, in alternating rounds (benchmarks/alternate_rounds.sh)
script=run_step_vs_pytorch.sh
model_shape=(--layers "$layers" --d-model "$dmodel" --heads "$heads" --seq "$seq" --batch "$batch")
shape=("${model_shape[@]}" --steps "$steps")
if [[ $ddp == 1 ]]; then
  program=02_ddp module=torch.nn.parallel
  label="02_ddp vs torch DDP, $ranks ranks, global batch $batch"
  run_ours() {
    "$bin/launch" --nproc-per-node "$ranks" --master-port 0 -- "$bin/02_ddp" "${shape[@]}" --quiet --log "$1" > "$2" 2>&1
  }
  run_theirs() {
    "$python" benchmarks/pytorch_ddp.py --ranks "$ranks" "${shape[@]}" --warmup "$warmup" > "$1" 2>&1
  }
else
  program=00_single_gpu module=torch ranks=1
  label="00_single_gpu vs PyTorch eager, 1 thread, $dtype"
  run_ours() {
    "$bin/00_single_gpu" "${shape[@]}" --dtype "$dtype" --threads 1 --quiet --log "$1" > "$2" 2>&1
  }
  run_theirs() {
    "$python" benchmarks/pytorch_gpt.py --device cpu --dtype "$dtype" --threads 1 "${shape[@]}" --warmup "$warmup" > "$1" 2>&1
  }
fi
find_both_sides

# ---- this core's sgemm rate (bench_train_step, one thread), before the rounds
sgemm_rate=""
if [[ $sgemm == 1 ]]; then
  if [[ -x "$bin/bench_train_step" ]]; then
    echo "this core's sgemm rate and chapter 00's step as % of it ($bin/bench_train_step, about 20 s):"
    sgemm_out="$(OMP_NUM_THREADS=1 "$bin/bench_train_step" 2>&1)" || { echo "$sgemm_out" >&2; exit 1; }
    # the sgemm lines and the step table (not the phase table after it)
    awk '/^config +forward/ { exit } /^(sgemm |reference rate|config +parameters|tiny |larger )/' <<<"$sgemm_out" |
      sed 's/^/  /'
    sgemm_rate="$(sed -n 's/^reference rate (best): *\([0-9.]*\) GFLOP\/s.*/\1/p' <<<"$sgemm_out")"
    echo
  else
    echo "(no $bin/bench_train_step: no sgemm rate, no % sgemm column)" >&2
  fi
fi

over=""
[[ $ddp == 1 ]] && over=" over $ranks ranks"
echo "shape: ${shape[*]}$over (PyTorch: --warmup $warmup more)"
alternate_rounds

# ---- the medians as % of the sgemm rate (model FLOPs as course::training_flops_per_token counts them)
if [[ -n "$sgemm_rate" ]]; then
  python3 - "$tmp/rows.tsv" "$sgemm_rate" "$ranks" "$layers" "$dmodel" "$seq" <<'EOF'
import math, statistics, sys
rows = [line.split("\t") for line in open(sys.argv[1]).read().splitlines()]
rate, ranks, L, C, T = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
V = 256
flops = 6.0 * (12.0 * L * C * C + V * C) + 12.0 * L * T * C  # course::training_flops_per_token
cores = f" x {ranks} ranks = {rate * ranks:.1f}" if ranks > 1 else ""
print(f"FLOPs per token {flops:.3g} (6 x (12 L C^2 + V C) + 12 L T C); sgemm rate {rate:.1f} GFLOP/s a core{cores}")
for name, col in (("ours", 1), ("PyTorch", 2)):
    vals = [float(row[col]) for row in rows if not math.isnan(float(row[col]))]
    if vals:
        m = statistics.median(vals)
        gflops = m * flops / 1e9
        print(f"{name:>8}: median {m:.0f} tok/s = {gflops:.1f} GFLOP/s = {100 * gflops / (rate * ranks):.1f}% of the sgemm rate"
              + (" (per core)" if ranks > 1 else ""))
EOF
fi
