#!/usr/bin/env bash
# Chapter 06's tensor-parallel trainer next to PyTorch's DTensor tensor parallelism
# (torch.distributed.tensor.parallel) on the same model and batch, on this machine's
# CPU, in alternating rounds:
#   ./benchmarks/run_tensor_parallel.sh [--rounds 3] [--tp 2] [--sp] [--layers 4]
#       [--d-model 512] [--heads 8] [--seq 256] [--batch 4] [--steps 20] [--warmup 3]
#       [--python PATH] [--no-build | --bin DIR]
# Each round runs ours (build/bin/launch ... 06_tensor_parallel, our median tokens/s
# over --steps steps) and then benchmarks/pytorch_tp.py (median over --steps steps
# after --warmup untimed ones), then prints ours / PyTorch per round, the median
# ratio and its spread. Both sides: --tp processes, one thread per process, every rank
# on the whole batch; --sp adds sequence parallelism on both. PyTorch is looked for
# in ~/.cache/course-bench-venv (see below), then python3; without it only our rows
# are printed. --no-build uses build/bin as it is, --bin DIR another build's bin/
# (build/cpu/bin), without building.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/alternate_rounds.sh

bin=build/bin rounds=3 tp=2 sp=0 layers=4 dmodel=512 heads=8 seq=256 batch=4 steps=20 warmup=3
python="" build=1
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tp) tp="$2"; shift 2 ;;
    --sp) sp=1; shift ;;
    -h|--help) usage ;;
    *) if shared_flag "$@"; then shift "$consumed"; else echo "run_tensor_parallel.sh: unknown argument '$1'" >&2; usage; fi ;;
  esac
done

# ---- both sides, in alternating rounds (benchmarks/alternate_rounds.sh)
script=run_tensor_parallel.sh program=06_tensor_parallel module=torch.distributed.tensor.parallel ranks=$tp
sp_flag=()
[[ $sp == 1 ]] && sp_flag=(--sp)
label="tp $tp${sp_flag[*]:+, sequence parallel}"
shape=(--layers "$layers" --d-model "$dmodel" --heads "$heads" --seq "$seq" --batch "$batch" --steps "$steps")
run_ours() {
  "$bin/launch" --nproc-per-node "$tp" --master-port 0 -- "$bin/06_tensor_parallel" --tp "$tp" \
    ${sp_flag[@]+"${sp_flag[@]}"} "${shape[@]}" --quiet --log "$1" > "$2" 2>&1
}
run_theirs() {
  "$python" benchmarks/pytorch_tp.py --tp "$tp" ${sp_flag[@]+"${sp_flag[@]}"} "${shape[@]}" --warmup "$warmup" > "$1" 2>&1
}
find_both_sides
echo "shape: --tp $tp ${sp_flag[*]:+${sp_flag[*]} }${shape[*]} (PyTorch: --warmup $warmup more)"
alternate_rounds
