#!/usr/bin/env bash
# Prints the CMake preset to build with: `cuda` when the CUDA toolkit is installed
# (so the GPU backend is always compiled where it can be), else `cpu`.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo cuda
else
  echo cpu
fi
