// The AdamW optimizer step: update every parameter from its gradient and its two moments.
// Reference: adamw_update in common/tensor/ops_cpu.cpp (the same formula, term for term, in the same order).
// Shape: every parameter's update reads and writes only its own p, g, m, v, so each thread takes
// elements of a grid-stride loop with 64-bit indices (a model's parameter count may exceed 2^31).
#include <algorithm>
#include <cstdint>

#include "common/tensor/cuda/ops_cuda.h"
#include "common/tensor/cuda/runtime.h"

namespace course::cuda_ops {
namespace {

// Enough blocks to fill an H100 many times over; a larger n loops instead.
constexpr int64_t kMaxBlocks = 65536;

// m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p -= lr (m/mc / (sqrt(v/vc) + eps) + wd p)
__global__ void adamw_kernel(float* params, const float* grads, float* m, float* v, int64_t n, float lr, float beta1,
                             float beta2, float eps, float weight_decay, float m_correction, float v_correction) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = grads[i];
    const float m_i = beta1 * m[i] + (1.0f - beta1) * g;
    const float v_i = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = m_i;
    v[i] = v_i;
    const float m_hat = m_i / m_correction;
    const float v_hat = v_i / v_correction;
    params[i] -= lr * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * params[i]);
  }
}

void launch_adamw(float* params, const float* grads, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, float m_correction, float v_correction, cudaStream_t stream) {
  if (n == 0) return;
  const unsigned int blocks = static_cast<unsigned int>(std::min<int64_t>(cuda::blocks_for(n), kMaxBlocks));
  adamw_kernel<<<blocks, cuda::kThreadsPerBlock, 0, stream>>>(params, grads, m, v, n, lr, beta1, beta2, eps,
                                                              weight_decay, m_correction, v_correction);
  CUDA_CHECK_LAUNCH("adamw_kernel");
}

}  // namespace

void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, float m_correction, float v_correction) {
  launch_adamw(params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay, m_correction, v_correction,
               cuda::compute_stream());
}

}  // namespace course::cuda_ops
