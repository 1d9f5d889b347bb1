// Average's division after NCCL's sum (nccl_average.h). Compiled, never run on a GPU yet.
#include "common/comm/nccl_average.h"

#include <cuda_bf16.h>

#include <cstdint>

#include "common/tensor/cuda/launch.h"

namespace course {

namespace {

// x = x / ranks
__global__ void divide_fp32_kernel(float* x, int64_t n, float ranks) {
  const int64_t i = cuda::item_index();
  if (i < n) x[i] /= ranks;
}

// x = bf16(float(x) / ranks): divided in fp32, rounded once
__global__ void divide_bf16_kernel(__nv_bfloat16* x, int64_t n, float ranks) {
  const int64_t i = cuda::item_index();
  if (i < n) x[i] = __float2bfloat16_rn(__bfloat162float(x[i]) / ranks);
}

}  // namespace

void launch_divide(void* data, size_t count, DType type, int ranks, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(count);
  if (n == 0) return;  // a grid of 0 blocks is a launch error
  const float divisor = static_cast<float>(ranks);
  if (type == DType::BF16) {
    divide_bf16_kernel<<<cuda::blocks_for(n), cuda::kThreadsPerBlock, 0, stream>>>(
        static_cast<__nv_bfloat16*>(data), n, divisor);
    CUDA_CHECK_LAUNCH("divide_bf16_kernel");
  } else {
    divide_fp32_kernel<<<cuda::blocks_for(n), cuda::kThreadsPerBlock, 0, stream>>>(static_cast<float*>(data), n,
                                                                                     divisor);
    CUDA_CHECK_LAUNCH("divide_fp32_kernel");
  }
}

}  // namespace course
