#!/usr/bin/env bash
# Chapter 05's pipeline trainer next to PyTorch's torch.distributed.pipelining on the
# same model, batch and micro-batches, on this machine's CPU, in alternating rounds:
#   ./benchmarks/run_pipeline.sh [--rounds 3] [--schedule 1f1b|gpipe] [--micro-batches 8]
#       [--pp 2] [--layers 4] [--d-model 128] [--heads 4] [--seq 128] [--batch 8]
#       [--steps 30] [--warmup 3] [--python PATH] [--no-build | --bin DIR]
# Each round runs ours (build/bin/launch ... 05_pipeline, our median tokens/s over
# --steps steps) and then benchmarks/pytorch_pipeline.py (median over --steps steps
# after --warmup untimed ones), then prints ours / PyTorch per round, the median
# ratio and its spread. Both sides: one process per stage, one thread per process.
# PyTorch is looked for in ~/.cache/course-bench-venv (see below), then python3;
# without it only our rows are printed. --no-build uses build/bin as it is, --bin DIR
# another build's bin/ (build/cpu/bin), without building.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/alternate_rounds.sh

bin=build/bin rounds=3 schedule=1f1b micro=8 pp=2 layers=4 dmodel=128 heads=4 seq=128 batch=8 steps=30 warmup=3
python="" build=1
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --schedule) schedule="$2"; shift 2 ;;
    --micro-batches) micro="$2"; shift 2 ;;
    --pp) pp="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) if shared_flag "$@"; then shift "$consumed"; else echo "run_pipeline.sh: unknown argument '$1'" >&2; usage; fi ;;
  esac
done
case "$schedule" in 1f1b|gpipe) ;; *) echo "--schedule must be 1f1b or gpipe (the schedules both sides have)" >&2; exit 2 ;; esac

# ---- both sides, in alternating rounds (benchmarks/alternate_rounds.sh)
script=run_pipeline.sh program=05_pipeline module=torch.distributed.pipelining ranks=$pp
label="$schedule, $pp stages, $micro micro-batches"
shape=(--micro-batches "$micro" --layers "$layers" --d-model "$dmodel" --heads "$heads" --seq "$seq" --batch "$batch"
       --steps "$steps")
run_ours() {
  "$bin/launch" --nproc-per-node "$pp" --master-port 0 -- "$bin/05_pipeline" --pp "$pp" --schedule "$schedule" \
    "${shape[@]}" --quiet --log "$1" > "$2" 2>&1
}
run_theirs() {
  "$python" benchmarks/pytorch_pipeline.py --pp "$pp" --schedule "$schedule" "${shape[@]}" --warmup "$warmup" > "$1" 2>&1
}
find_both_sides
echo "shape: --pp $pp --schedule $schedule ${shape[*]} (PyTorch: --warmup $warmup more)"
alternate_rounds
