// The operations of a GPT, each with an explicit forward and backward.
//
// Conventions (as in llm.c):
// - pointers are row-major fp32; the comment after each names its shape;
// - N = B*T rows, C channels, V vocabulary, NH heads, hs = C/NH head size;
// - forward functions overwrite their outputs;
// - backward functions ADD (+=) into every gradient they produce, parameter and
//   input gradients alike, so a value used twice (the residual stream) simply
//   receives two contributions. The caller zeroes gradients when a step starts.
//
// These are the CPU implementations: GEMMs go through OpenBLAS (gemm_cpu.h: cblas_sgemm,
// on bf16-rounded inputs under --dtype bf16), the rest are plain loops. The CUDA
// implementations (common/tensor/cuda/ops_cuda.h) have the same signatures;
// ops_for(device) at the end of this file picks one set, and the model calls the ops
// only through it, so one model code runs on either device.
#pragma once

#include <cstdint>

#include "common/tensor/bf16.h"
#include "common/tensor/memory.h"

namespace course::ops {

// out[b,t,:] = wte[tokens[b,t], :] + wpe[t, :]
void embedding_forward(float* out,          // (B, T, C)
                       const int* tokens,   // (B, T)
                       const float* wte,    // (V, C)
                       const float* wpe,    // (maxT, C)
                       int B, int T, int C);
void embedding_backward(float* dwte,         // (V, C)
                        float* dwpe,         // (maxT, C)
                        const float* dout,   // (B, T, C)
                        const int* tokens,   // (B, T)
                        int B, int T, int C);

// out = (inp - mean) * rstd * weight + bias, rstd = 1/sqrt(var + 1e-5), per row
void layernorm_forward(float* out,           // (N, C)
                       float* mean,          // (N)
                       float* rstd,          // (N)
                       const float* inp,     // (N, C)
                       const float* weight,  // (C)
                       const float* bias,    // (C)
                       int N, int C);
void layernorm_backward(float* dinp,          // (N, C)
                        float* dweight,       // (C)
                        float* dbias,         // (C)
                        const float* dout,    // (N, C)
                        const float* inp,     // (N, C)
                        const float* weight,  // (C)
                        const float* mean,    // (N)
                        const float* rstd,    // (N)
                        int N, int C);

// out = inp @ weight^T + bias (bias may be null)
void linear_forward(float* out,           // (N, OC)
                    const float* inp,     // (N, IC)
                    const float* weight,  // (OC, IC)
                    const float* bias,    // (OC) or null
                    int N, int IC, int OC);
// dinp += dout @ weight, dweight += dout^T @ inp, dbias += sum_rows(dout)
// (any of dinp, dweight and dbias may be null: a pipeline's zero-bubble schedule
// computes dinp now and dweight later, in two calls)
void linear_backward(float* dinp,          // (N, IC) or null
                     float* dweight,       // (OC, IC) or null
                     float* dbias,         // (OC) or null
                     const float* dout,    // (N, OC)
                     const float* inp,     // (N, IC)
                     const float* weight,  // (OC, IC)
                     int N, int IC, int OC);

// The same three, for an activation that only GEMMs read, stored in bf16 under --dtype
// bf16 (common/model/model.h's LinearInput): LayerNorm's output rounded to bf16 as it is
// stored (each value computed in fp32, as above), and the linear layer reading such an
// input. A bf16 GEMM rounds its inputs anyway, so these compute what the fp32 ones do,
// bit for bit, and the stored tensor takes half the bytes.
void layernorm_forward_bf16(bf16* out,            // (N, C)
                            float* mean,          // (N)
                            float* rstd,          // (N)
                            const float* inp,     // (N, C)
                            const float* weight,  // (C)
                            const float* bias,    // (C)
                            int N, int C);
void linear_forward_bf16(float* out,           // (N, OC)
                         const bf16* inp,      // (N, IC)
                         const float* weight,  // (OC, IC)
                         const float* bias,    // (OC) or null
                         int N, int IC, int OC);
void linear_backward_bf16(float* dinp,          // (N, IC) or null
                          float* dweight,       // (OC, IC) or null
                          float* dbias,         // (OC) or null
                          const float* dout,    // (N, OC)
                          const bf16* inp,      // (N, IC)
                          const float* weight,  // (OC, IC)
                          int N, int IC, int OC);

// out = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3) (GPT-2's tanh approximation),
// which both devices compute as x sigmoid(2u): the same function, without 1 + tanh(u)
// cancelling to 0 for x below about -4. Backward: that form's derivative.
void gelu_forward(float* out, const float* inp, int64_t n);                  // (n), (n)
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);  // (n) x3
// gelu_forward's values rounded to bf16 as they are stored (the MLP's second linear input)
void gelu_forward_bf16(bf16* out, const float* inp, int64_t n);  // (n), (n)

// out = a + b
void residual_forward(float* out, const float* a, const float* b, int64_t n);   // (n) x3
// da += dout. (b's gradient is dout itself: the caller passes dout on as b's
// upstream gradient instead of copying it.)
void residual_backward(float* da, const float* dout, int64_t n);  // (n), (n)

// Causal self-attention over packed q, k, v (qkv[b,t] = [q | k | v], heads side by side):
// att = softmax(q k^T / sqrt(hs) with future positions masked), out = att @ v
void attention_forward(float* out,        // (B, T, C)
                       float* att,        // (B, NH, T, T) softmax probabilities, saved for backward
                       const float* qkv,  // (B, T, 3C)
                       int B, int T, int C, int NH);
void attention_backward(float* dqkv,        // (B, T, 3C)
                        float* scratch,     // (T, T) workspace for one head's score gradient
                        const float* dout,  // (B, T, C)
                        const float* qkv,   // (B, T, 3C)
                        const float* att,   // (B, NH, T, T)
                        int B, int T, int C, int NH);

// probs = softmax(logits), losses = -log probs[target]
void crossentropy_forward(float* losses,        // (B, T)
                          float* probs,         // (B, T, V)
                          const float* logits,  // (B, T, V)
                          const int* targets,   // (B, T)
                          int B, int T, int V);
// dlogits += (probs - onehot(target)) * dloss, where dloss = dL/dlosses[b,t]
// (the same for every position: 1/(number of tokens averaged over))
void crossentropy_backward(float* dlogits,      // (B, T, V)
                           const float* probs,  // (B, T, V)
                           const int* targets,  // (B, T)
                           float dloss, int B, int T, int V);

// ----------------------------------------------------------------------------
// helpers the model and the optimizer need on the same device as the ops above

// x = 0
void zero(float* x, int64_t n);  // (n)
// returns sum(x) / n, accumulated in double (on a GPU, copied to the host, which waits for it)
float mean(const float* x, int64_t n);  // (n)
// total[0] += float(sum(x) / n) / divisor, the sum accumulated in double: a micro-batch's
// mean loss added to its step's (divisor: the micro-batches), where the losses are, so
// that the host need not wait for each one. On the CPU exactly `total += mean(x, n) / divisor`.
void add_mean(float* total,     // (1)
              const float* x,   // (n)
              int64_t n, float divisor);
// returns sum(x^2), accumulated in double (a gradient norm's square, or one shard's part of it)
double sum_squares(const float* x, int64_t n);  // (n)
// x *= factor
void scale(float* x, int64_t n, float factor);  // (n)
// dst[r, 0:width] = src[r, 0:width] for every row r, each side with its own row stride:
// a block of columns taken out of a wider matrix, or put into one (a layout change;
// context parallelism's Ulysses attention moves heads and chunks with it)
void copy_strided(float* dst,        // (rows, dst_stride), the first width columns written
                  int64_t dst_stride,
                  const float* src,  // (rows, src_stride), the first width columns read
                  int64_t src_stride, int64_t rows, int64_t width);

// out = bf16(x), rounded to nearest even (common/tensor/bf16.h): a message's half-size
// copy of fp32 values (every bf16 message: activations, gradients, ZeRO's gathers)
void cast_to_bf16(bf16* out, const float* x, int64_t n);  // (n), (n)
// out = float(x): exact
void cast_to_fp32(float* out, const bf16* x, int64_t n);  // (n), (n)

// One AdamW update of n parameters (common/model/adamw.h says what it computes);
// m_correction = 1 - beta1^step, v_correction = 1 - beta2^step.
// m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p -= lr (m/mc / (sqrt(v/vc) + eps) + wd p)
void adamw_update(float* params, const float* grads, float* m, float* v,  // (n) x4
                  int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                  float m_correction, float v_correction);

}  // namespace course::ops

namespace course {

// ----------------------------------------------------------------------------
// One device's implementations of every op above, with the same signatures.

struct OpTable {
  decltype(&ops::embedding_forward) embedding_forward;
  decltype(&ops::embedding_backward) embedding_backward;
  decltype(&ops::layernorm_forward) layernorm_forward;
  decltype(&ops::layernorm_backward) layernorm_backward;
  decltype(&ops::linear_forward) linear_forward;
  decltype(&ops::linear_backward) linear_backward;
  decltype(&ops::gelu_forward) gelu_forward;
  decltype(&ops::gelu_backward) gelu_backward;
  decltype(&ops::layernorm_forward_bf16) layernorm_forward_bf16;
  decltype(&ops::linear_forward_bf16) linear_forward_bf16;
  decltype(&ops::linear_backward_bf16) linear_backward_bf16;
  decltype(&ops::gelu_forward_bf16) gelu_forward_bf16;
  decltype(&ops::residual_forward) residual_forward;
  decltype(&ops::residual_backward) residual_backward;
  decltype(&ops::attention_forward) attention_forward;
  decltype(&ops::attention_backward) attention_backward;
  decltype(&ops::crossentropy_forward) crossentropy_forward;
  decltype(&ops::crossentropy_backward) crossentropy_backward;
  decltype(&ops::zero) zero;
  decltype(&ops::mean) mean;
  decltype(&ops::add_mean) add_mean;
  decltype(&ops::sum_squares) sum_squares;
  decltype(&ops::scale) scale;
  decltype(&ops::copy_strided) copy_strided;
  decltype(&ops::cast_to_bf16) cast_to_bf16;
  decltype(&ops::cast_to_fp32) cast_to_fp32;
  decltype(&ops::adamw_update) adamw_update;
};

// The ops for data on `device`: every pointer passed to them must live there
// (tokens and targets included). CUDA ops run in order on the compute stream and
// return before the GPU has finished, except mean and sum_squares, which return a
// number to the host and so wait for it (add_mean leaves its number on the device).
// Throws CourseError for CUDA in a CPU-only build.
const OpTable& ops_for(Device device);

}  // namespace course
