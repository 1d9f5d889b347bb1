// Softmax cross-entropy over the vocabulary: forward (probabilities and per-token losses) and backward.
// Reference: crossentropy_forward / crossentropy_backward in common/tensor/ops_cpu.cpp (max subtracted before
// exp; the loss taken from the logits, -(z[target] - max - log(sum)), so it never takes log(0)).
// Shape: one warp per row: the byte vocabulary (V = 256) is 8 logits a lane, and the row's max and sum
// are warp shuffles with no shared memory; backward is element-wise, one thread per logit.
#include <cmath>
#include <cstdint>

#include "common/tensor/cuda/ops_cuda.h"
#include "common/tensor/cuda/runtime.h"
#include "common/tensor/cuda/warp.h"

namespace course::cuda_ops {
namespace {

using cuda::kWarpSize;
using cuda::warp_max;
using cuda::warp_sum;
constexpr int kWarpsPerBlock = cuda::kThreadsPerBlock / kWarpSize;  // = rows per block

// probs = exp(z - max(z)) / sum(exp(z - max(z)));  losses = -(z[target] - max(z) - log(sum))
__global__ void crossentropy_forward_kernel(float* losses, float* probs, const float* logits, const int* targets,
                                            int64_t N, int V) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= N) return;  // the whole warp leaves together, so the shuffles below see all 32 lanes
  const float* z = logits + row * V;
  float* p = probs + row * V;

  float z_max = -INFINITY;
  for (int v = lane; v < V; v += kWarpSize) z_max = fmaxf(z_max, z[v]);
  z_max = warp_max(z_max);

  float sum = 0.0f;
  for (int v = lane; v < V; v += kWarpSize) {
    const float e = expf(z[v] - z_max);
    p[v] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  // each lane divides the entries it wrote itself: no other lane's writes to wait for
  for (int v = lane; v < V; v += kWarpSize) p[v] /= sum;

  if (lane == 0) losses[row] = -(z[targets[row]] - z_max - logf(sum));
}

// dlogits[row, v] += (probs[row, v] - (v == targets[row] ? 1 : 0)) * dloss      (one thread per logit)
__global__ void crossentropy_backward_kernel(float* dlogits, const float* probs, const int* targets, float dloss,
                                             int64_t N, int V) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * V) return;
  const int64_t row = i / V;
  const int v = static_cast<int>(i % V);
  const float onehot = (v == targets[row]) ? 1.0f : 0.0f;
  dlogits[i] += (probs[i] - onehot) * dloss;
}

void launch_crossentropy_forward(float* losses, float* probs, const float* logits, const int* targets, int64_t N,
                                 int V, cudaStream_t stream) {
  if (N == 0) return;
  const unsigned int blocks = cuda::blocks_for(N, kWarpsPerBlock);  // one warp per row, 8 rows a block
  crossentropy_forward_kernel<<<blocks, cuda::kThreadsPerBlock, 0, stream>>>(losses, probs, logits, targets, N, V);
  CUDA_CHECK_LAUNCH("crossentropy_forward_kernel");
}

void launch_crossentropy_backward(float* dlogits, const float* probs, const int* targets, float dloss, int64_t N,
                                  int V, cudaStream_t stream) {
  const int64_t n = N * V;
  if (n == 0) return;
  crossentropy_backward_kernel<<<cuda::blocks_for(n), cuda::kThreadsPerBlock, 0, stream>>>(dlogits, probs, targets,
                                                                                            dloss, N, V);
  CUDA_CHECK_LAUNCH("crossentropy_backward_kernel");
}

}  // namespace

void crossentropy_forward(float* losses, float* probs, const float* logits, const int* targets, int B, int T, int V) {
  launch_crossentropy_forward(losses, probs, logits, targets, static_cast<int64_t>(B) * T, V, cuda::compute_stream());
}

void crossentropy_backward(float* dlogits, const float* probs, const int* targets, float dloss, int B, int T, int V) {
  launch_crossentropy_backward(dlogits, probs, targets, dloss, static_cast<int64_t>(B) * T, V,
                               cuda::compute_stream());
}

}  // namespace course::cuda_ops
