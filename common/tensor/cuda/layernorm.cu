// Layer normalisation over the channels of each row: forward and backward.
// Reference: layernorm_forward / layernorm_backward in common/tensor/ops_cpu.cpp (eps 1e-5, biased variance,
// rstd = 1 / sqrt(var + eps), the mean subtracted before squaring).
// Shape: one warp per row: C = 768 is 24 floats a lane, and the row's sums are warp shuffles, with no
// shared memory or __syncthreads; backward's dweight and dbias (a sum over rows) are added up per
// block in shared memory, then once per block into global memory with atomicAdd.
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/tensor/cuda/ops_cuda.h"
#include "common/tensor/cuda/runtime.h"
#include "common/tensor/error.h"

namespace course::cuda_ops {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = cuda::kThreadsPerBlock / kWarpSize;  // = rows per block
constexpr float kEps = 1e-5f;
// backward: blocks loop over rows, so that each block's partial dweight/dbias covers many
// rows and the global atomics stay few (a few blocks per SM of an H100 with 132 SMs)
constexpr int kMaxBackwardBlocks = 512;
// backward keeps 2 C floats of shared memory per block; 48 KiB is what a block gets by default
constexpr int kMaxSharedBytes = 48 * 1024;

// The sum of v over the 32 lanes of a warp, returned to every lane (butterfly of shuffles).
__device__ float warp_sum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// mean = sum(x)/C; var = sum((x - mean)^2)/C; rstd = 1/sqrt(var + eps); out = (x - mean) rstd weight + bias
__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                                         const float* bias, int N, int C) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= N) return;  // the whole warp leaves together, so the shuffles below see all 32 lanes
  const float* x = inp + static_cast<int64_t>(row) * C;
  float* y = out + static_cast<int64_t>(row) * C;

  float sum = 0.0f;
  for (int c = lane; c < C; c += kWarpSize) sum += x[c];
  const float m = warp_sum(sum) / C;
  // a second pass over the row (now in cache) for the variance, as the CPU does: it does not
  // lose precision the way E[x^2] - E[x]^2 does
  float squares = 0.0f;
  for (int c = lane; c < C; c += kWarpSize) squares += (x[c] - m) * (x[c] - m);
  const float variance = warp_sum(squares) / C;
  const float s = 1.0f / sqrtf(variance + kEps);

  for (int c = lane; c < C; c += kWarpSize) y[c] = (x[c] - m) * s * weight[c] + bias[c];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// norm = (x - mean) rstd, dnorm = weight dout:
// dinp += rstd (dnorm - mean(dnorm) - norm mean(dnorm norm));  dweight += sum_rows(norm dout);  dbias += sum_rows(dout)
__global__ void layernorm_backward_kernel(float* dinp, float* dweight, float* dbias, const float* dout,
                                          const float* inp, const float* weight, const float* mean,
                                          const float* rstd, int N, int C) {
  // this block's share of dweight and dbias, C floats each
  extern __shared__ float block_partials[];
  float* dweight_block = block_partials;
  float* dbias_block = block_partials + C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    dweight_block[c] = 0.0f;
    dbias_block[c] = 0.0f;
  }
  __syncthreads();

  const int lane = threadIdx.x % kWarpSize;
  for (int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize; row < N; row += gridDim.x * kWarpsPerBlock) {
    const float* dy = dout + static_cast<int64_t>(row) * C;
    const float* x = inp + static_cast<int64_t>(row) * C;
    float* dx = dinp + static_cast<int64_t>(row) * C;
    const float m = mean[row];
    const float s = rstd[row];

    // the two row reductions: mean of dnorm and mean of dnorm * norm
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
    for (int c = lane; c < C; c += kWarpSize) {
      const float norm = (x[c] - m) * s;
      const float dnorm = weight[c] * dy[c];
      dnorm_sum += dnorm;
      dnorm_norm_sum += dnorm * norm;
    }
    const float dnorm_mean = warp_sum(dnorm_sum) / C;
    const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / C;

    for (int c = lane; c < C; c += kWarpSize) {
      const float norm = (x[c] - m) * s;
      const float dnorm = weight[c] * dy[c];
      // the block's warps share these columns: shared-memory atomics (cheap) keep them apart
      atomicAdd(&dbias_block[c], dy[c]);
      atomicAdd(&dweight_block[c], norm * dy[c]);
      dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }

  // one global atomic per column per block adds this block's rows to the parameter gradients
  __syncthreads();
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    atomicAdd(&dweight[c], dweight_block[c]);
    atomicAdd(&dbias[c], dbias_block[c]);
  }
}

void launch_layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, int N, int C, cudaStream_t stream) {
  if (N == 0) return;
  const unsigned int blocks = cuda::blocks_for(N, kWarpsPerBlock);  // one warp per row, 8 rows a block
  layernorm_forward_kernel<<<blocks, cuda::kThreadsPerBlock, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C);
  CUDA_CHECK_LAUNCH("layernorm_forward_kernel");
}

void launch_layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, const float* mean, const float* rstd, int N, int C,
                               cudaStream_t stream) {
  if (N == 0) return;
  const size_t shared_bytes = 2 * static_cast<size_t>(C) * sizeof(float);
  if (shared_bytes > kMaxSharedBytes) {
    throw CourseError("layernorm_backward (CUDA): " + std::to_string(C) + " channels need " +
                      std::to_string(shared_bytes) + " bytes of shared memory per block, more than the " +
                      std::to_string(kMaxSharedBytes) + " a block gets; use at most " +
                      std::to_string(kMaxSharedBytes / (2 * sizeof(float))) + " channels");
  }
  const unsigned int blocks = std::min<unsigned int>(cuda::blocks_for(N, kWarpsPerBlock), kMaxBackwardBlocks);
  layernorm_backward_kernel<<<blocks, cuda::kThreadsPerBlock, shared_bytes, stream>>>(dinp, dweight, dbias, dout, inp,
                                                                                      weight, mean, rstd, N, C);
  CUDA_CHECK_LAUNCH("layernorm_backward_kernel");
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C) {
  launch_layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, cuda::compute_stream());
}

// dweight and dbias add their rows through atomics, so the order of the additions (and with it
// the last bits of those two gradients) can change from run to run; dinp's order is fixed.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C) {
  launch_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, cuda::compute_stream());
}

}  // namespace course::cuda_ops
