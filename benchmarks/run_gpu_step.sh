#!/usr/bin/env bash
# Chapter 00's step on a GPU next to PyTorch eager on the same GPU, same model shape
# (GPT-2 124M's blocks, byte vocabulary), in fp32, TF32 and bf16:
#   ./benchmarks/run_gpu_step.sh [--batch 8] [--peak-tflops 989.4]
# Needs a CUDA build (scripts/build.sh picks the cuda preset when nvcc is there) and,
# for the PyTorch rows, python3 with torch (skipped with a note when it is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$(./scripts/build.sh)"
if [[ ! -x "$bin/bench_gpu_step" ]]; then
  echo "bench_gpu_step was not built: this build has no CUDA backend (hint: install the CUDA toolkit)" >&2
  exit 2
fi
echo "== the course (chapter 00's GPT, course::ops on CUDA)"
"$bin/bench_gpu_step" "$@"
echo
echo "== PyTorch eager, the same model (benchmarks/pytorch_gpt.py)"
if ! python3 -c "import torch" 2>/dev/null; then
  echo "(skipped: python3 cannot import torch)"
  exit 0
fi
for dtype in fp32 tf32 bf16; do
  python3 benchmarks/pytorch_gpt.py --dtype "$dtype" --steps 10 --warmup 3 "$@" | grep -v '^RESULT '
done
python3 benchmarks/pytorch_gpt.py --dtype bf16 --sdpa --fused --steps 10 --warmup 3 "$@" | grep -v '^RESULT '
