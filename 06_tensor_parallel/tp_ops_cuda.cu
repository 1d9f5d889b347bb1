// Tensor parallelism's own ops (chapter 06): the row-parallel layer's bias and residual,
// the vocabulary-parallel embedding and cross-entropy, the position rows of a sequence chunk.
// Reference: the functions of the same names in tp_ops_cpu.cpp (same formulas).
// Compiled, never run on a GPU yet (test_cuda_ops holds every one against the CPU's where
// there is one).
// Shape: element-wise ops take one thread per element; the cross-entropy's steps one warp per
// row, as common/tensor/cuda/crossentropy.cu (the row's max and sum are warp shuffles). Gradients scattered into
// vocabulary rows take atomicAdd (a token occurs at many positions), so their last bits can
// change from run to run; position rows are one thread's each, added in batch order.
#include <cmath>
#include <cstdint>

#include "06_tensor_parallel/tp_ops.h"
#include "common/tensor/cuda/launch.h"
#include "common/tensor/cuda/runtime.h"
#include "common/tensor/cuda/warp.h"

namespace course::tp_cuda_ops {
namespace {

using cuda::item_index;
using cuda::kWarpSize;
using cuda::launch_per_item;
constexpr int kRowsPerBlock = cuda::kThreadsPerBlock / kWarpSize;  // one warp per row

// this warp's row; the whole warp leaves together when it is past the end, so the
// shuffles see all 32 lanes
__device__ int64_t warp_row() { return static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize; }
__device__ int lane() { return threadIdx.x % kWarpSize; }

// the row of token `token` here, or -1 when another rank holds it
__device__ int local_row(int token, int vocab_start, int Vl) {
  const int local = token - vocab_start;
  return local >= 0 && local < Vl ? local : -1;
}

// ---- kernels ----------------------------------------------------------------

// out = residual + (y + bias[c])      (one thread per element)
__global__ void bias_residual_forward_kernel(float* out, const float* residual, const float* y, const float* bias,
                                             int64_t n, int C) {
  const int64_t i = item_index();
  if (i < n) out[i] = residual[i] + (y[i] + bias[i % C]);
}

// out[i, c] = wte_rows[tokens[i] - vocab_start, c], or 0      (one thread per element)
__global__ void vocab_embedding_forward_kernel(float* out, const int* tokens, const float* wte_rows, int vocab_start,
                                               int Vl, int64_t n, int C) {
  const int64_t i = item_index();
  if (i >= n) return;
  const int local = local_row(tokens[i / C], vocab_start, Vl);
  out[i] = local < 0 ? 0.0f : wte_rows[static_cast<int64_t>(local) * C + i % C];
}

// dwte_rows[tokens[i] - vocab_start, c] += dout[i, c] where the row is here      (one thread per element)
__global__ void vocab_embedding_backward_kernel(float* dwte_rows, const float* dout, const int* tokens, int vocab_start,
                                                int Vl, int64_t n, int C) {
  const int64_t i = item_index();
  if (i >= n) return;
  const int local = local_row(tokens[i / C], vocab_start, Vl);
  if (local >= 0) atomicAdd(&dwte_rows[static_cast<int64_t>(local) * C + i % C], dout[i]);
}

// out[b, t, c] = inp[b, t, c] + wpe_rows[t, c]      (one thread per element)
__global__ void position_embedding_forward_kernel(float* out, const float* inp, const float* wpe_rows, int64_t n, int T,
                                                  int C) {
  const int64_t i = item_index();
  if (i >= n) return;
  const int64_t t = (i / C) % T;
  out[i] = inp[i] + wpe_rows[t * C + i % C];
}

// dwpe_rows[t, c] += sum over b of dout[b, t, c]      (one thread per (t, c): no atomics)
__global__ void position_embedding_backward_kernel(float* dwpe_rows, const float* dout, int B, int T, int C) {
  const int64_t i = item_index();
  if (i >= static_cast<int64_t>(T) * C) return;
  float dposition = dwpe_rows[i];
  for (int b = 0; b < B; b++) dposition += dout[static_cast<int64_t>(b) * T * C + i];
  dwpe_rows[i] = dposition;
}

// row_max[row] = max of the row's Vl logits      (one warp per row)
__global__ void vocab_crossentropy_local_max_kernel(float* row_max, const float* logits_local, int64_t rows, int Vl) {
  const int64_t row = warp_row();
  if (row >= rows) return;
  const float* z = logits_local + row * Vl;
  float m = -INFINITY;
  for (int v = lane(); v < Vl; v += kWarpSize) m = fmaxf(m, z[v]);
  m = cuda::warp_max(m);
  if (lane() == 0) row_max[row] = m;
}

// exps = exp(z - row_max), sum_exp = their sum, target_logit = z[target] or 0      (one warp per row)
__global__ void vocab_crossentropy_local_sums_kernel(float* exps, float* sum_exp, float* target_logit,
                                                     const float* logits_local, const float* row_max,
                                                     const int* targets, int vocab_start, int64_t rows, int Vl) {
  const int64_t row = warp_row();
  if (row >= rows) return;
  const float* z = logits_local + row * Vl;
  float* e = exps + row * Vl;
  const float m = row_max[row];
  float sum = 0.0f;
  for (int v = lane(); v < Vl; v += kWarpSize) {
    const float exp_v = expf(z[v] - m);
    e[v] = exp_v;
    sum += exp_v;
  }
  sum = cuda::warp_sum(sum);
  if (lane() != 0) return;
  sum_exp[row] = sum;
  const int local = local_row(targets[row], vocab_start, Vl);
  target_logit[row] = local < 0 ? 0.0f : z[local];
}

// probs /= sum_exp, losses = -(target_logit - row_max - log(sum_exp))      (one warp per row)
__global__ void vocab_crossentropy_finish_kernel(float* losses, float* probs, const float* row_max,
                                                 const float* sum_exp, const float* target_logit, int64_t rows,
                                                 int Vl) {
  const int64_t row = warp_row();
  if (row >= rows) return;
  float* p = probs + row * Vl;
  const float sum = sum_exp[row];
  for (int v = lane(); v < Vl; v += kWarpSize) p[v] /= sum;
  if (lane() == 0) losses[row] = -(target_logit[row] - row_max[row] - logf(sum));
}

// dlogits += (probs - onehot(target, where it is here)) * dloss      (one thread per logit)
__global__ void vocab_crossentropy_backward_kernel(float* dlogits_local, const float* probs_local, const int* targets,
                                                   float dloss, int vocab_start, int64_t n, int Vl) {
  const int64_t i = item_index();
  if (i >= n) return;
  const int local = local_row(targets[i / Vl], vocab_start, Vl);
  const float onehot = i % Vl == local ? 1.0f : 0.0f;
  dlogits_local[i] += (probs_local[i] - onehot) * dloss;
}

// ---- launcher: nothing to do launches nothing (a grid of 0 blocks is a launch error) ----

// one warp per row, kRowsPerBlock rows a block
template <typename... Params, typename... Args>
void launch_per_row(void (*kernel)(Params...), const char* name, int64_t rows, Args... args) {
  if (rows == 0) return;
  kernel<<<cuda::blocks_for(rows, kRowsPerBlock), cuda::kThreadsPerBlock, 0, cuda::compute_stream()>>>(args...);
  CUDA_CHECK_LAUNCH(name);
}

}  // namespace

// ---- the ops (common/tensor/ops.h), on the compute stream ---------------------------

void bias_residual_forward(float* out, const float* residual, const float* y, const float* bias, int N, int C) {
  const int64_t n = static_cast<int64_t>(N) * C;
  launch_per_item(bias_residual_forward_kernel, "bias_residual_forward_kernel", n, out, residual, y, bias, n, C);
}

void vocab_embedding_forward(float* out, const int* tokens, const float* wte_rows, int vocab_start, int Vl, int N,
                             int C) {
  const int64_t n = static_cast<int64_t>(N) * C;
  launch_per_item(vocab_embedding_forward_kernel, "vocab_embedding_forward_kernel", n, out, tokens, wte_rows,
                  vocab_start, Vl, n, C);
}

void vocab_embedding_backward(float* dwte_rows, const float* dout, const int* tokens, int vocab_start, int Vl, int N,
                              int C) {
  const int64_t n = static_cast<int64_t>(N) * C;
  launch_per_item(vocab_embedding_backward_kernel, "vocab_embedding_backward_kernel", n, dwte_rows, dout, tokens,
                  vocab_start, Vl, n, C);
}

void position_embedding_forward(float* out, const float* inp, const float* wpe_rows, int B, int T, int C) {
  const int64_t n = static_cast<int64_t>(B) * T * C;
  launch_per_item(position_embedding_forward_kernel, "position_embedding_forward_kernel", n, out, inp, wpe_rows, n, T,
                  C);
}

void position_embedding_backward(float* dwpe_rows, const float* dout, int B, int T, int C) {
  if (B == 0) return;
  launch_per_item(position_embedding_backward_kernel, "position_embedding_backward_kernel", static_cast<int64_t>(T) * C,
                  dwpe_rows, dout, B, T, C);
}

void vocab_crossentropy_local_max(float* row_max, const float* logits_local, int B, int T, int Vl) {
  const int64_t rows = static_cast<int64_t>(B) * T;
  launch_per_row(vocab_crossentropy_local_max_kernel, "vocab_crossentropy_local_max_kernel", rows, row_max,
                 logits_local, rows, Vl);
}

void vocab_crossentropy_local_sums(float* exps, float* sum_exp, float* target_logit, const float* logits_local,
                                   const float* row_max, const int* targets, int vocab_start, int B, int T, int Vl) {
  const int64_t rows = static_cast<int64_t>(B) * T;
  launch_per_row(vocab_crossentropy_local_sums_kernel, "vocab_crossentropy_local_sums_kernel", rows, exps, sum_exp,
                 target_logit, logits_local, row_max, targets, vocab_start, rows, Vl);
}

void vocab_crossentropy_finish(float* losses, float* probs, const float* row_max, const float* sum_exp,
                               const float* target_logit, int B, int T, int Vl) {
  const int64_t rows = static_cast<int64_t>(B) * T;
  launch_per_row(vocab_crossentropy_finish_kernel, "vocab_crossentropy_finish_kernel", rows, losses, probs, row_max,
                 sum_exp, target_logit, rows, Vl);
}

void vocab_crossentropy_backward(float* dlogits_local, const float* probs_local, const int* targets, float dloss,
                                 int vocab_start, int B, int T, int Vl) {
  const int64_t n = static_cast<int64_t>(B) * T * Vl;
  launch_per_item(vocab_crossentropy_backward_kernel, "vocab_crossentropy_backward_kernel", n, dlogits_local,
                  probs_local, targets, dloss, vocab_start, n, Vl);
}

}  // namespace course::tp_cuda_ops
