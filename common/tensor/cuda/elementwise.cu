// Element-wise ops: GELU forward/backward, residual forward/backward, zero, scale, copy_strided,
// the bf16 casts.
// Reference: the loops of the same names in common/tensor/ops_cpu.cpp (same formulas, same order).
// Shape: each output element depends on one input element only, so every thread takes elements
// i, i + stride, ... of a grid-stride loop with 64-bit indices (n may exceed 2^31).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "common/tensor/cuda/ops_cuda.h"
#include "common/tensor/cuda/runtime.h"

namespace course::cuda_ops {
namespace {

// Enough blocks to fill an H100 many times over; a larger n loops instead of asking
// for more blocks, so the grid size never overflows however big n is.
constexpr int64_t kMaxBlocks = 65536;

unsigned int grid_for(int64_t n) {
  return static_cast<unsigned int>(std::min<int64_t>(cuda::blocks_for(n), kMaxBlocks));
}

// The first element this thread handles, and how far it steps each time.
__device__ int64_t first_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// sqrt(2/pi), computed in fp32 the way ops_cpu.cpp computes it (so the same float)
__device__ float gelu_scale() { return sqrtf(2.0f / static_cast<float>(M_PI)); }

// sigmoid(2u) = 0.5 (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3), as ops_cpu.cpp's
// gelu_sigmoid (which takes e^x from exp_approx instead of expf). For x below about -4,
// 1 + tanh(u) cancels to exactly 0 in fp32; e^(-2u) keeps the tail's tiny values.
__device__ float gelu_sigmoid(float x) {
  const float u = gelu_scale() * (x + 0.044715f * x * x * x);
  return 1.0f / (1.0f + expf(-2.0f * u));
}

// ---- kernels ----------------------------------------------------------------

// out = x sigmoid(2u)  (= 0.5 x (1 + tanh(u)))
__global__ void gelu_forward_kernel(float* out, const float* inp, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float x = inp[i];
    out[i] = x * gelu_sigmoid(x);
  }
}

// the same, rounded to bf16 as it is stored
__global__ void gelu_forward_bf16_kernel(__nv_bfloat16* out, const float* inp, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float x = inp[i];
    out[i] = __float2bfloat16_rn(x * gelu_sigmoid(x));
  }
}

// dinp += dout (s + 2 x s (1 - s) du/dx),  s = sigmoid(2u),  du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// (d/dx of x sigmoid(2u); the same function as the tanh form's derivative)
__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    const float x = inp[i];
    const float s = gelu_sigmoid(x);
    const float du_dx = gelu_scale() * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] += (s + 2.0f * x * s * (1.0f - s) * du_dx) * dout[i];
  }
}

// out = a + b
__global__ void residual_forward_kernel(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = a[i] + b[i];
}

// da += dout  (b's gradient is dout itself: the caller passes it on, nothing to compute)
__global__ void residual_backward_kernel(float* da, const float* dout, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) da[i] += dout[i];
}

// x *= factor
__global__ void scale_kernel(float* x, int64_t n, float factor) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) x[i] *= factor;
}

// out = bf16(x), rounded to nearest even: bf16.h's to_bf16 bit for bit on every number,
// subnormals, Inf and overflow to Inf; a NaN stays a NaN, but CUDA's one (0x7fff), not
// to_bf16's with the input's sign and top payload bits
__global__ void cast_to_bf16_kernel(__nv_bfloat16* out, const float* x, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = __float2bfloat16_rn(x[i]);
}

// out = float(x)
__global__ void cast_to_fp32_kernel(float* out, const __nv_bfloat16* x, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = __bfloat162float(x[i]);
}

// ---- launchers: n == 0 launches nothing (a grid of 0 blocks is a launch error) ----

void launch_gelu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gelu_forward_kernel<<<grid_for(n), cuda::kThreadsPerBlock, 0, stream>>>(out, inp, n);
  CUDA_CHECK_LAUNCH("gelu_forward_kernel");
}

void launch_gelu_forward_bf16(__nv_bfloat16* out, const float* inp, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gelu_forward_bf16_kernel<<<grid_for(n), cuda::kThreadsPerBlock, 0, stream>>>(out, inp, n);
  CUDA_CHECK_LAUNCH("gelu_forward_bf16_kernel");
}

void launch_gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  gelu_backward_kernel<<<grid_for(n), cuda::kThreadsPerBlock, 0, stream>>>(dinp, inp, dout, n);
  CUDA_CHECK_LAUNCH("gelu_backward_kernel");
}

void launch_residual_forward(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  residual_forward_kernel<<<grid_for(n), cuda::kThreadsPerBlock, 0, stream>>>(out, a, b, n);
  CUDA_CHECK_LAUNCH("residual_forward_kernel");
}

void launch_residual_backward(float* da, const float* dout, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  residual_backward_kernel<<<grid_for(n), cuda::kThreadsPerBlock, 0, stream>>>(da, dout, n);
  CUDA_CHECK_LAUNCH("residual_backward_kernel");
}

void launch_scale(float* x, int64_t n, float factor, cudaStream_t stream) {
  if (n == 0) return;
  scale_kernel<<<grid_for(n), cuda::kThreadsPerBlock, 0, stream>>>(x, n, factor);
  CUDA_CHECK_LAUNCH("scale_kernel");
}

void launch_cast_to_bf16(__nv_bfloat16* out, const float* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  cast_to_bf16_kernel<<<grid_for(n), cuda::kThreadsPerBlock, 0, stream>>>(out, x, n);
  CUDA_CHECK_LAUNCH("cast_to_bf16_kernel");
}

void launch_cast_to_fp32(float* out, const __nv_bfloat16* x, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  cast_to_fp32_kernel<<<grid_for(n), cuda::kThreadsPerBlock, 0, stream>>>(out, x, n);
  CUDA_CHECK_LAUNCH("cast_to_fp32_kernel");
}

}  // namespace

// ---- the ops (common/tensor/ops.h), on the compute stream ---------------------------

void gelu_forward(float* out, const float* inp, int64_t n) {
  launch_gelu_forward(out, inp, n, cuda::compute_stream());
}

// (compiled, never run on a GPU yet)
void gelu_forward_bf16(bf16* out, const float* inp, int64_t n) {
  launch_gelu_forward_bf16(reinterpret_cast<__nv_bfloat16*>(out), inp, n, cuda::compute_stream());
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  launch_gelu_backward(dinp, inp, dout, n, cuda::compute_stream());
}

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
  launch_residual_forward(out, a, b, n, cuda::compute_stream());
}

void residual_backward(float* da, const float* dout, int64_t n) {
  launch_residual_backward(da, dout, n, cuda::compute_stream());
}

// x = 0: the bits of 0.0f are all zero, so the driver's memset does it, no kernel needed.
void zero(float* x, int64_t n) {
  if (n == 0) return;
  CUDA_CHECK(cudaMemsetAsync(x, 0, static_cast<size_t>(n) * sizeof(float), cuda::compute_stream()));
}

void scale(float* x, int64_t n, float factor) { launch_scale(x, n, factor, cuda::compute_stream()); }

// A copy of rows of a matrix: the driver's 2D copy does it, no kernel needed. Compiled,
// never run on a GPU yet (test_cuda_ops holds it against the CPU's where there is one).
void copy_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t width) {
  if (rows == 0 || width == 0) return;
  const size_t float_bytes = sizeof(float);
  CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_stride * float_bytes, src, src_stride * float_bytes, width * float_bytes,
                               rows, cudaMemcpyDeviceToDevice, cuda::compute_stream()));
}

// course::bf16 and __nv_bfloat16 are both the 16 bits of a bfloat16. Compiled, never run on a GPU yet.
void cast_to_bf16(bf16* out, const float* x, int64_t n) {
  launch_cast_to_bf16(reinterpret_cast<__nv_bfloat16*>(out), x, n, cuda::compute_stream());
}

void cast_to_fp32(float* out, const bf16* x, int64_t n) {
  launch_cast_to_fp32(out, reinterpret_cast<const __nv_bfloat16*>(x), n, cuda::compute_stream());
}

}  // namespace course::cuda_ops
