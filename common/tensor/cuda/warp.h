// Reductions over the 32 lanes of a warp, for kernels that give each row of a matrix
// one warp (the cross-entropies): register shuffles, no shared memory.
#pragma once

#include <cuda_runtime.h>

namespace course::cuda {

constexpr int kWarpSize = 32;

// The max and the sum of v over the 32 lanes, returned to every lane. Every lane of
// the warp must call them (a warp leaves a kernel together, or not at all).
__device__ inline float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ inline float warp_sum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

}  // namespace course::cuda
