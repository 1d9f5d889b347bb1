// Layer normalisation over the channels of each row: forward and backward.
// Reference: layernorm_forward / layernorm_backward in common/tensor/ops_cpu.cpp (eps 1e-5, biased variance,
// rstd = 1 / sqrt(var + eps), the mean subtracted before squaring).
// Shape: one warp per row: C = 768 is 24 floats a lane, and the row's sums are warp shuffles, with no
// shared memory or __syncthreads; backward's dweight and dbias (sums over rows) are column sums in a
// fixed order (column_sums.h): no atomics, so a run's bits are the next run's, on every rank.
#include <cuda_bf16.h>

#include <cstdint>

#include "common/tensor/cuda/column_sums.h"
#include "common/tensor/cuda/ops_cuda.h"
#include "common/tensor/cuda/runtime.h"

namespace course::cuda_ops {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = cuda::kThreadsPerBlock / kWarpSize;  // = rows per block
constexpr float kEps = 1e-5f;

// The sum of v over the 32 lanes of a warp, returned to every lane (butterfly of shuffles).
__device__ float warp_sum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// an output value as it is stored: fp32, or rounded to bf16 (nearest even, as bf16.h's to_bf16)
__device__ void store(float* out, float value) { *out = value; }
__device__ void store(__nv_bfloat16* out, float value) { *out = __float2bfloat16_rn(value); }

// mean = sum(x)/C; var = sum((x - mean)^2)/C; rstd = 1/sqrt(var + eps); out = (x - mean) rstd weight + bias
// (Out: float, or __nv_bfloat16 for layernorm_forward_bf16)
template <typename Out>
__global__ void layernorm_forward_kernel(Out* out, float* mean, float* rstd, const float* inp, const float* weight,
                                         const float* bias, int N, int C) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= N) return;  // the whole warp leaves together, so the shuffles below see all 32 lanes
  const float* x = inp + static_cast<int64_t>(row) * C;
  Out* y = out + static_cast<int64_t>(row) * C;

  float sum = 0.0f;
  for (int c = lane; c < C; c += kWarpSize) sum += x[c];
  const float m = warp_sum(sum) / C;
  // a second pass over the row (now in cache) for the variance, as the CPU does: it does not
  // lose precision the way E[x^2] - E[x]^2 does
  float squares = 0.0f;
  for (int c = lane; c < C; c += kWarpSize) squares += (x[c] - m) * (x[c] - m);
  const float variance = warp_sum(squares) / C;
  const float s = 1.0f / sqrtf(variance + kEps);

  for (int c = lane; c < C; c += kWarpSize) store(y + c, (x[c] - m) * s * weight[c] + bias[c]);
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// norm = (x - mean) rstd, dnorm = weight dout:
// dinp += rstd (dnorm - mean(dnorm) - norm mean(dnorm norm))   (dweight and dbias: the column sums below)
__global__ void layernorm_backward_input_kernel(float* dinp, const float* dout, const float* inp, const float* weight,
                                                const float* mean, const float* rstd, int N, int C) {
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= N) return;  // the whole warp leaves together
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
    dx[c] += (weight[c] * dy[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
  }
}

// dweight's term: norm[i, c] dout[i, c]
struct NormTimesDout {
  const float* dout;
  const float* inp;
  const float* mean;
  const float* rstd;
  int C;
  __device__ float operator()(int row, int column) const {
    const int64_t i = static_cast<int64_t>(row) * C + column;
    return (inp[i] - mean[row]) * rstd[row] * dout[i];
  }
};

template <typename Out>
void launch_layernorm_forward(Out* out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, int N, int C, cudaStream_t stream) {
  if (N == 0) return;
  const unsigned int blocks = cuda::blocks_for(N, kWarpsPerBlock);  // one warp per row, 8 rows a block
  layernorm_forward_kernel<Out><<<blocks, cuda::kThreadsPerBlock, 0, stream>>>(out, mean, rstd, inp, weight, bias, N,
                                                                                C);
  CUDA_CHECK_LAUNCH("layernorm_forward_kernel");
}

void launch_layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, const float* mean, const float* rstd, int N, int C,
                               cudaStream_t stream) {
  if (N == 0) return;
  const unsigned int blocks = cuda::blocks_for(N, kWarpsPerBlock);  // one warp per row, 8 rows a block
  layernorm_backward_input_kernel<<<blocks, cuda::kThreadsPerBlock, 0, stream>>>(dinp, dout, inp, weight, mean, rstd,
                                                                                 N, C);
  CUDA_CHECK_LAUNCH("layernorm_backward_input_kernel");
  // dweight[c] += sum_rows(norm dout);  dbias[c] += sum_rows(dout)
  launch_column_sum(dweight, NormTimesDout{dout, inp, mean, rstd, C}, N, C, stream);
  launch_column_sum(dbias, MatrixElement{dout, C}, N, C, stream);
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C) {
  launch_layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, cuda::compute_stream());
}

// course::bf16 and __nv_bfloat16 are both the 16 bits of a bfloat16. Compiled, never run on a GPU yet.
void layernorm_forward_bf16(bf16* out, float* mean, float* rstd, const float* inp, const float* weight,
                            const float* bias, int N, int C) {
  launch_layernorm_forward(reinterpret_cast<__nv_bfloat16*>(out), mean, rstd, inp, weight, bias, N, C,
                           cuda::compute_stream());
}

// Every sum in a fixed order: the same inputs give the same bits on every run (two TP ranks'
// replicated LayerNorm gradients stay equal).
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C) {
  launch_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, cuda::compute_stream());
}

}  // namespace course::cuda_ops
