// Causal self-attention on the GPU: attention_forward and attention_backward.
//
// The reference is ops_cpu.cpp, which loops over (batch, head) pairs and reads each
// head's q, k, v in place as (T, hs) matrices with row stride 3C. Here the loop is
// over the batch only: within one batch element, head h's matrices start h*hs floats
// after head 0's, so the NH heads are one cuBLAS strided batch (stride hs, leading
// dimension 3C) and no permute kernel is needed. B calls of NH heads each, rather
// than one cublasGemmBatchedEx over B*NH pointer arrays: batch and head offsets do
// not form a single stride, and pointer arrays would have to be built on the GPU
// every call. Each GEMM keeps the CPU's cblas arguments (batched_gemm_row_major below).
//
// The masking matches the CPU exactly: future positions get probability 0 in the
// saved att, and their score gradients are 0. The softmax and its backward are
// warp-per-row kernels; 1/sqrt(hs) is applied as the GEMMs' alpha, as on the CPU.
//
// Precision follows common/tensor/device.h as in matmul.cu (FP32 plain fp32, TF32 tensor
// cores); under BF16 qkv and dout are copied whole to bf16 (so the head strides stay
// the same), and att and the score gradients one batch element at a time.
//
// Scratch (device_allocate; the ops' (T, T) `scratch` argument holds one head only,
// so it is not used): the score gradients of one batch element, NH*T*T floats (48 MB
// at NH = 12, T = 1024), reused across the batch. BF16 adds 2 bytes per element of
// qkv, dout, and two NH*T*T bf16 copies.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/tensor/cuda/gemm.h"
#include "common/tensor/cuda/ops_cuda.h"
#include "common/tensor/cuda/runtime.h"
#include "common/tensor/device.h"

namespace course::cuda_ops {
namespace {

using cuda::batched_gemm_row_major;
using cuda::gemm_mode;
using cuda::GemmInput;
using cuda::GemmMode;

// ---- softmax kernels: one warp per row of T scores --------------------------

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = cuda::kThreadsPerBlock / kWarpSize;

__device__ float warp_max(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

__device__ float warp_sum(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// att[r, j] = exp(s[r, j] - max) / sum_{j' <= i} exp(s[r, j'] - max) for j <= i, 0 for j > i,
// in place over the scores s; row r is query position i = r mod T of some head
__global__ void causal_softmax_kernel(float* att, int64_t rows, int T) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;  // the whole warp leaves together, so the shuffles below see all 32 lanes
  const int i = static_cast<int>(row % T);
  float* x = att + row * T;

  float row_max = -INFINITY;
  for (int j = lane; j <= i; j += kWarpSize) row_max = fmaxf(row_max, x[j]);
  row_max = warp_max(row_max);
  float sum = 0.0f;
  for (int j = lane; j <= i; j += kWarpSize) {
    x[j] = expf(x[j] - row_max);
    sum += x[j];
  }
  sum = warp_sum(sum);
  for (int j = lane; j <= i; j += kWarpSize) x[j] /= sum;
  for (int j = i + 1 + lane; j < T; j += kWarpSize) x[j] = 0.0f;  // the future: exactly 0, as on the CPU
}

void launch_causal_softmax(float* att, int64_t rows, int T, cudaStream_t stream) {
  if (rows == 0) return;
  causal_softmax_kernel<<<cuda::blocks_for(rows, kWarpsPerBlock), cuda::kThreadsPerBlock, 0, stream>>>(att, rows, T);
  CUDA_CHECK_LAUNCH("causal_softmax_kernel");
}

// d[r, j] = p[r, j] (d[r, j] - sum_{j' <= i} p[r, j'] d[r, j']) for j <= i, 0 for j > i,
// in place: d comes in as dL/datt and leaves as dL/dscores (before the 1/sqrt(hs))
__global__ void causal_softmax_backward_kernel(float* d, const float* p, int64_t rows, int T) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;
  const int i = static_cast<int>(row % T);
  float* d_row = d + row * T;
  const float* p_row = p + row * T;

  float dot = 0.0f;
  for (int j = lane; j <= i; j += kWarpSize) dot += p_row[j] * d_row[j];
  dot = warp_sum(dot);
  for (int j = lane; j <= i; j += kWarpSize) d_row[j] = p_row[j] * (d_row[j] - dot);
  for (int j = i + 1 + lane; j < T; j += kWarpSize) d_row[j] = 0.0f;
}

void launch_causal_softmax_backward(float* d, const float* p, int64_t rows, int T, cudaStream_t stream) {
  if (rows == 0) return;
  causal_softmax_backward_kernel<<<cuda::blocks_for(rows, kWarpsPerBlock), cuda::kThreadsPerBlock, 0, stream>>>(
      d, p, rows, T);
  CUDA_CHECK_LAUNCH("causal_softmax_backward_kernel");
}

// What forward and backward both derive from (T, C, NH): floats per batch element
// of qkv and att, per head of att, the head size and the score scale.
struct AttentionSizes {
  AttentionSizes(int T, int C, int NH)
      : hs(C / NH),
        scale(1.0f / std::sqrt(static_cast<float>(C / NH))),
        qkv_per_b(static_cast<int64_t>(T) * 3 * C),
        att_per_b(static_cast<int64_t>(NH) * T * T),
        att_per_head(static_cast<int64_t>(T) * T) {}
  int hs;
  float scale;
  int64_t qkv_per_b, att_per_b, att_per_head;
};

}  // namespace

// ---- the ops ----------------------------------------------------------------
// Per batch element b: q of head h starts at qkv + b*T*3C + h*hs (k at +C, v at +2C),
// its (T, T) att at att + (b*NH + h)*T*T, its out columns at out + b*T*C + h*hs.

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
  if (B == 0 || T == 0) return;
  const AttentionSizes sizes(T, C, NH);
  const GemmMode mode = gemm_mode(matmul_precision());
  cudaStream_t stream = cuda::compute_stream();
  const GemmInput qkv_in(qkv, B * sizes.qkv_per_b, mode);

  for (int b = 0; b < B; b++) {
    const int64_t q = b * sizes.qkv_per_b, k = q + C, v = q + 2 * C;  // element offsets of head 0
    float* att_b = att + b * sizes.att_per_b;
    // scores (T, T) = q (T, hs) @ k^T (hs, T) / sqrt(hs), per head; written into att
    batched_gemm_row_major(mode, false, true, T, T, sizes.hs, sizes.scale, qkv_in.at(q), 3 * C, sizes.hs, qkv_in.at(k),
                           3 * C, sizes.hs, 0.0f, att_b, T, sizes.att_per_head, NH);
    launch_causal_softmax(att_b, static_cast<int64_t>(NH) * T, T, stream);
    const GemmInput att_in(att_b, sizes.att_per_b, mode);  // built after the softmax: its bf16 copy holds probabilities
    // out_h (T, hs) = att (T, T) @ v (T, hs), per head, into out's columns h*hs.. (row stride C)
    batched_gemm_row_major(mode, false, false, T, sizes.hs, T, 1.0f, att_in.at(0), T, sizes.att_per_head, qkv_in.at(v),
                           3 * C, sizes.hs, 0.0f, out + static_cast<int64_t>(b) * T * C, C, sizes.hs, NH);
  }
}

void attention_backward(float* dqkv, float* /*scratch: one head's (T, T); all NH heads at once need more*/,
                        const float* dout, const float* qkv, const float* att, int B, int T, int C, int NH) {
  if (B == 0 || T == 0) return;
  const AttentionSizes sizes(T, C, NH);
  const GemmMode mode = gemm_mode(matmul_precision());
  cudaStream_t stream = cuda::compute_stream();
  const GemmInput qkv_in(qkv, B * sizes.qkv_per_b, mode);
  const GemmInput dout_in(dout, static_cast<int64_t>(B) * T * C, mode);
  // dL/datt, then dL/dscores, of one batch element's NH heads; reused by the next b
  // (the stream runs b's GEMMs before b+1's overwrite it)
  const cuda::DeviceScratch dscores_block(sizes.att_per_b * sizeof(float));
  float* dscores = dscores_block.as<float>();

  for (int b = 0; b < B; b++) {
    const int64_t q = b * sizes.qkv_per_b, k = q + C, v = q + 2 * C;  // element offsets of head 0
    const int64_t dy = static_cast<int64_t>(b) * T * C;               // dout of head 0, row stride C
    float* dq = dqkv + q;
    float* dk = dqkv + k;
    float* dv = dqkv + v;
    const GemmInput att_in(att + b * sizes.att_per_b, sizes.att_per_b, mode);

    // datt (T, T) = dy (T, hs) @ v^T (hs, T), per head
    batched_gemm_row_major(mode, false, true, T, T, sizes.hs, 1.0f, dout_in.at(dy), C, sizes.hs, qkv_in.at(v), 3 * C,
                           sizes.hs, 0.0f, dscores, T, sizes.att_per_head, NH);
    // dv (T, hs) += att^T (T, T) @ dy (T, hs), per head
    batched_gemm_row_major(mode, true, false, T, sizes.hs, T, 1.0f, att_in.at(0), T, sizes.att_per_head, dout_in.at(dy),
                           C, sizes.hs, 1.0f, dv, 3 * C, sizes.hs, NH);
    launch_causal_softmax_backward(dscores, att + b * sizes.att_per_b, static_cast<int64_t>(NH) * T, T, stream);
    const GemmInput dscores_in(dscores, sizes.att_per_b, mode);  // built after the softmax backward
    // dq (T, hs) += dscores (T, T) @ k (T, hs) / sqrt(hs), per head
    batched_gemm_row_major(mode, false, false, T, sizes.hs, T, sizes.scale, dscores_in.at(0), T, sizes.att_per_head,
                           qkv_in.at(k), 3 * C, sizes.hs, 1.0f, dq, 3 * C, sizes.hs, NH);
    // dk (T, hs) += dscores^T (T, T) @ q (T, hs) / sqrt(hs), per head
    batched_gemm_row_major(mode, true, false, T, sizes.hs, T, sizes.scale, dscores_in.at(0), T, sizes.att_per_head,
                           qkv_in.at(q), 3 * C, sizes.hs, 1.0f, dk, 3 * C, sizes.hs, NH);
  }
}

}  // namespace course::cuda_ops
