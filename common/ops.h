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
// This is the CPU implementation: GEMMs go through OpenBLAS (cblas_sgemm), the
// rest are plain loops. The CUDA implementation has the same signatures.
#pragma once

#include <cstdint>

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
// (dinp and dbias may be null when not needed)
void linear_backward(float* dinp,          // (N, IC) or null
                     float* dweight,       // (OC, IC)
                     float* dbias,         // (OC) or null
                     const float* dout,    // (N, OC)
                     const float* inp,     // (N, IC)
                     const float* weight,  // (OC, IC)
                     int N, int IC, int OC);

// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
void gelu_forward(float* out, const float* inp, int64_t n);                  // (n), (n)
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);  // (n) x3

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

}  // namespace course::ops
