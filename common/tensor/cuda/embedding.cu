// Token + position embedding: forward (look up and add) and backward (scatter-add the gradient).
// Reference: embedding_forward / embedding_backward in common/tensor/ops_cpu.cpp.
// Shape: one thread per channel c, so a warp reads 32 neighbouring floats of a row (coalesced);
// backward gives each thread one (t, c) and loops over the batch, so dwpe needs no atomics, while
// dwte rows are shared by every occurrence of a token and take atomicAdd.
#include <cstdint>

#include "common/tensor/cuda/ops_cuda.h"
#include "common/tensor/cuda/runtime.h"

namespace course::cuda_ops {
namespace {

// out[b,t,c] = wte[tokens[b,t], c] + wpe[t, c]      (one thread per output element)
__global__ void embedding_forward_kernel(float* out, const int* tokens, const float* wte, const float* wpe, int B,
                                         int T, int C) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(B) * T * C) return;
  const int64_t bt = i / C;
  const int c = static_cast<int>(i % C);
  const int t = static_cast<int>(bt % T);
  out[i] = wte[static_cast<int64_t>(tokens[bt]) * C + c] + wpe[static_cast<int64_t>(t) * C + c];
}

// dwpe[t,c] += sum_b dout[b,t,c];  dwte[tokens[b,t], c] += dout[b,t,c]      (one thread per (t, c))
__global__ void embedding_backward_kernel(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T,
                                          int C) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(T) * C) return;
  const int t = static_cast<int>(i / C);
  const int c = static_cast<int>(i % C);
  // position t is this thread's alone: add the batch in order b = 0, 1, ..., as the CPU does
  float dposition = dwpe[i];
  for (int b = 0; b < B; b++) {
    const int64_t bt = static_cast<int64_t>(b) * T + t;
    const float d = dout[bt * C + c];
    dposition += d;
    // the same token can appear at many (b, t): other threads may be adding to this row now
    atomicAdd(&dwte[static_cast<int64_t>(tokens[bt]) * C + c], d);
  }
  dwpe[i] = dposition;
}

void launch_embedding_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C,
                              cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(B) * T * C;
  if (n == 0) return;
  embedding_forward_kernel<<<cuda::blocks_for(n), cuda::kThreadsPerBlock, 0, stream>>>(out, tokens, wte, wpe, B, T, C);
  CUDA_CHECK_LAUNCH("embedding_forward_kernel");
}

void launch_embedding_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C,
                               cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(T) * C;
  if (n == 0 || B == 0) return;
  embedding_backward_kernel<<<cuda::blocks_for(n), cuda::kThreadsPerBlock, 0, stream>>>(dwte, dwpe, dout, tokens, B,
                                                                                         T, C);
  CUDA_CHECK_LAUNCH("embedding_backward_kernel");
}

}  // namespace

void embedding_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C) {
  launch_embedding_forward(out, tokens, wte, wpe, B, T, C, cuda::compute_stream());
}

// dwte accumulates with atomics, so the order of the additions into a token's row (and with it
// the last bits of dwte) can change from run to run; dwpe's order is fixed.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C) {
  launch_embedding_backward(dwte, dwpe, dout, tokens, B, T, C, cuda::compute_stream());
}

}  // namespace course::cuda_ops
