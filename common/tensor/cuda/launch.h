// One thread per item: the launch shape of the kernels that give each element, row or
// expert one thread (the chapters' own ops: 06's, 08's, 09's, and the mixture of experts').
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/tensor/cuda/runtime.h"

namespace course::cuda {

// This thread's item: its index in the whole grid.
__device__ inline int64_t item_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }

// kernel(args...) on the compute stream, with at least n threads in blocks of
// kThreadsPerBlock; each thread past n must return at once. n = 0 launches nothing (a
// grid of 0 blocks is a launch error). `name` goes into the error if the launch fails.
template <typename... Params, typename... Args>
void launch_per_item(void (*kernel)(Params...), const char* name, int64_t n, Args... args) {
  if (n == 0) return;
  kernel<<<blocks_for(n), kThreadsPerBlock, 0, compute_stream()>>>(args...);
  CUDA_CHECK_LAUNCH(name);
}

}  // namespace course::cuda
