// Tensor parallelism's own ops: the pieces of a layer split over ranks that chapter 00's
// ops (common/tensor/ops.h) do not compute, each with a CPU and a CUDA version of one
// signature, in an op table of this chapter's own (tp_ops_for), as ops_for is the
// library's. Vl: the vocabulary rows this rank holds, [vocab_start, vocab_start + Vl);
// a token or target outside them is another rank's.
#pragma once

#include "common/tensor/memory.h"

namespace course::tp_ops {

// out = residual + (y + bias): a row-parallel layer's bias, added once after the sum
// over the ranks, fused with the residual add that follows every such layer (in
// chapter 00's order: the linear layer's bias first, then the residual)
void bias_residual_forward(float* out,             // (N, C)  may be y itself
                           const float* residual,  // (N, C)
                           const float* y,         // (N, C)
                           const float* bias,      // (C)
                           int N, int C);

// Vocabulary-parallel embedding: out[i] = wte_rows[tokens[i] - vocab_start] when the
// token's row is here, else 0 (the rank that holds it adds it in the sum over ranks)
void vocab_embedding_forward(float* out,             // (N, C)
                             const int* tokens,      // (N)
                             const float* wte_rows,  // (Vl, C)
                             int vocab_start, int Vl, int N, int C);
// dwte_rows[tokens[i] - vocab_start] += dout[i] for the tokens whose row is here
void vocab_embedding_backward(float* dwte_rows,   // (Vl, C)
                              const float* dout,  // (N, C)
                              const int* tokens,  // (N)
                              int vocab_start, int Vl, int N, int C);

// out[b,t] = inp[b,t] + wpe_rows[t]: the rows of T consecutive positions added to
// each of B sequences (a sequence-parallel rank's chunk: wpe_rows = wpe + first * C)
void position_embedding_forward(float* out,             // (B, T, C)  may be inp itself
                                const float* inp,       // (B, T, C)
                                const float* wpe_rows,  // (T, C)
                                int B, int T, int C);
// dwpe_rows[t] += sum over b of dout[b,t] (b in order)
void position_embedding_backward(float* dwpe_rows,   // (T, C)
                                 const float* dout,  // (B, T, C)
                                 int B, int T, int C);

// Vocabulary-parallel cross-entropy (Megatron's) over logits split by columns, in
// three steps around the all-reduces that combine the ranks' rows (the caller's):
//   local_max   row_max = max of each row's Vl logits        -> all-reduce, max
//   local_sums  exps = exp(z - row_max), sum_exp = row sums,
//               target_logit = z[target] if it is here, else 0 -> all-reduce, sum
//   finish      probs = exps / sum_exp, losses = -(target_logit - row_max - log sum_exp)
void vocab_crossentropy_local_max(float* row_max,             // (B, T)
                                  const float* logits_local,  // (B, T, Vl)
                                  int B, int T, int Vl);
void vocab_crossentropy_local_sums(float* exps,                // (B, T, Vl)
                                   float* sum_exp,             // (B, T)
                                   float* target_logit,        // (B, T)
                                   const float* logits_local,  // (B, T, Vl)
                                   const float* row_max,       // (B, T)  the max over every rank
                                   const int* targets,         // (B, T)
                                   int vocab_start, int B, int T, int Vl);
void vocab_crossentropy_finish(float* losses,              // (B, T)
                               float* probs,               // (B, T, Vl)  exps in, probabilities out
                               const float* row_max,       // (B, T)  each of the three summed
                               const float* sum_exp,       // (B, T)  over every rank
                               const float* target_logit,  // (B, T)
                               int B, int T, int Vl);
// dlogits_local += (probs_local - onehot(target, where it is here)) * dloss
void vocab_crossentropy_backward(float* dlogits_local,      // (B, T, Vl)
                                 const float* probs_local,  // (B, T, Vl)
                                 const int* targets,        // (B, T)
                                 float dloss, int vocab_start, int B, int T, int Vl);

}  // namespace course::tp_ops

namespace course {

// One device's implementations of the ops above (tp_ops_cpu.cpp; tp_ops_cuda.cu, compiled,
// never run on a GPU yet), with the same signatures.
struct TPOpTable {
  decltype(&tp_ops::bias_residual_forward) bias_residual_forward;
  decltype(&tp_ops::vocab_embedding_forward) vocab_embedding_forward;
  decltype(&tp_ops::vocab_embedding_backward) vocab_embedding_backward;
  decltype(&tp_ops::position_embedding_forward) position_embedding_forward;
  decltype(&tp_ops::position_embedding_backward) position_embedding_backward;
  decltype(&tp_ops::vocab_crossentropy_local_max) vocab_crossentropy_local_max;
  decltype(&tp_ops::vocab_crossentropy_local_sums) vocab_crossentropy_local_sums;
  decltype(&tp_ops::vocab_crossentropy_finish) vocab_crossentropy_finish;
  decltype(&tp_ops::vocab_crossentropy_backward) vocab_crossentropy_backward;
};

#ifdef COURSE_HAVE_CUDA
// The CUDA versions (tp_ops_cuda.cu).
namespace tp_cuda_ops {
decltype(tp_ops::bias_residual_forward) bias_residual_forward;
decltype(tp_ops::vocab_embedding_forward) vocab_embedding_forward;
decltype(tp_ops::vocab_embedding_backward) vocab_embedding_backward;
decltype(tp_ops::position_embedding_forward) position_embedding_forward;
decltype(tp_ops::position_embedding_backward) position_embedding_backward;
decltype(tp_ops::vocab_crossentropy_local_max) vocab_crossentropy_local_max;
decltype(tp_ops::vocab_crossentropy_local_sums) vocab_crossentropy_local_sums;
decltype(tp_ops::vocab_crossentropy_finish) vocab_crossentropy_finish;
decltype(tp_ops::vocab_crossentropy_backward) vocab_crossentropy_backward;
}  // namespace tp_cuda_ops
#endif

// The ops for data on `device` (every pointer passed to them lives there): the CPU's,
// the guarded device's (the CPU's with its arena open) or CUDA's. CourseError for CUDA
// in a CPU-only build.
const TPOpTable& tp_ops_for(Device device);

}  // namespace course
