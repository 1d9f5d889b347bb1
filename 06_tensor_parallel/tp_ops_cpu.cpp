// The CPU versions of tp_ops.h's ops, plain loops (compiled with the CPU ops' options,
// COURSE_CPU_LOOP_OPTIONS, so that they round as they always have).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "06_tensor_parallel/tp_ops.h"

namespace course::tp_ops {

void bias_residual_forward(float* out, const float* residual, const float* y, const float* bias, int N, int C) {
  for (int i = 0; i < N; i++) {
    const int64_t row = static_cast<int64_t>(i) * C;
    for (int c = 0; c < C; c++) out[row + c] = residual[row + c] + (y[row + c] + bias[c]);
  }
}

// the row of token i here, or -1 when another rank holds it
static int local_row(const int* tokens, int i, int vocab_start, int Vl) {
  const int local = tokens[i] - vocab_start;
  return local >= 0 && local < Vl ? local : -1;
}

void vocab_embedding_forward(float* out, const int* tokens, const float* wte_rows, int vocab_start, int Vl, int N,
                             int C) {
  for (int i = 0; i < N; i++) {
    float* row = out + static_cast<int64_t>(i) * C;
    const int local = local_row(tokens, i, vocab_start, Vl);
    if (local < 0) {
      std::memset(row, 0, static_cast<size_t>(C) * sizeof(float));
      continue;
    }
    std::memcpy(row, wte_rows + static_cast<int64_t>(local) * C, static_cast<size_t>(C) * sizeof(float));
  }
}

void vocab_embedding_backward(float* dwte_rows, const float* dout, const int* tokens, int vocab_start, int Vl, int N,
                              int C) {
  for (int i = 0; i < N; i++) {
    const int local = local_row(tokens, i, vocab_start, Vl);
    if (local < 0) continue;
    float* drow = dwte_rows + static_cast<int64_t>(local) * C;
    const float* d = dout + static_cast<int64_t>(i) * C;
    for (int c = 0; c < C; c++) drow[c] += d[c];
  }
}

void position_embedding_forward(float* out, const float* inp, const float* wpe_rows, int B, int T, int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const int64_t row = (static_cast<int64_t>(b) * T + t) * C;
      const float* position = wpe_rows + static_cast<int64_t>(t) * C;
      for (int c = 0; c < C; c++) out[row + c] = inp[row + c] + position[c];
    }
  }
}

void position_embedding_backward(float* dwpe_rows, const float* dout, int B, int T, int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float* d = dout + (static_cast<int64_t>(b) * T + t) * C;
      float* dposition = dwpe_rows + static_cast<int64_t>(t) * C;
      for (int c = 0; c < C; c++) dposition[c] += d[c];
    }
  }
}

// The three steps keep one left-to-right max, sum and std::exp per logit (not
// crossentropy_forward's lanes and exp_approx): the loss chapter 06 has always computed.
void vocab_crossentropy_local_max(float* row_max, const float* logits_local, int B, int T, int Vl) {
  for (int64_t i = 0; i < static_cast<int64_t>(B) * T; i++) {
    const float* z = logits_local + i * Vl;
    float m = z[0];
    for (int v = 1; v < Vl; v++) m = std::fmax(m, z[v]);
    row_max[i] = m;
  }
}

void vocab_crossentropy_local_sums(float* exps, float* sum_exp, float* target_logit, const float* logits_local,
                                   const float* row_max, const int* targets, int vocab_start, int B, int T, int Vl) {
  for (int i = 0; i < B * T; i++) {
    const float* z = logits_local + static_cast<int64_t>(i) * Vl;
    float* e = exps + static_cast<int64_t>(i) * Vl;
    float sum = 0.0f;
    for (int v = 0; v < Vl; v++) {
      e[v] = std::exp(z[v] - row_max[i]);
      sum += e[v];
    }
    sum_exp[i] = sum;
    const int local = local_row(targets, i, vocab_start, Vl);
    target_logit[i] = local >= 0 ? z[local] : 0.0f;  // only the owner's is non-zero
  }
}

void vocab_crossentropy_finish(float* losses, float* probs, const float* row_max, const float* sum_exp,
                               const float* target_logit, int B, int T, int Vl) {
  for (int64_t i = 0; i < static_cast<int64_t>(B) * T; i++) {
    float* p = probs + i * Vl;
    for (int v = 0; v < Vl; v++) p[v] /= sum_exp[i];
    // -log p[target] from the logits, as crossentropy_forward computes it
    losses[i] = -(target_logit[i] - row_max[i] - std::log(sum_exp[i]));
  }
}

void vocab_crossentropy_backward(float* dlogits_local, const float* probs_local, const int* targets, float dloss,
                                 int vocab_start, int B, int T, int Vl) {
  for (int i = 0; i < B * T; i++) {
    const float* p = probs_local + static_cast<int64_t>(i) * Vl;
    float* dz = dlogits_local + static_cast<int64_t>(i) * Vl;
    const int local = local_row(targets, i, vocab_start, Vl);
    for (int v = 0; v < Vl; v++) dz[v] += (p[v] - (v == local ? 1.0f : 0.0f)) * dloss;
  }
}

}  // namespace course::tp_ops
