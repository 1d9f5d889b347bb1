// CPU implementation of common/tensor/ops.h. GEMMs through OpenBLAS, everything else loops.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/tensor/gemm_cpu.h"
#include "common/tensor/ops.h"
#include "common/tensor/vector_math.h"

namespace course::ops {

// ----------------------------------------------------------------------------
// embedding

void embedding_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      float* out_bt = out + (static_cast<int64_t>(b) * T + t) * C;
      const float* token_row = wte + static_cast<int64_t>(tokens[b * T + t]) * C;
      const float* position_row = wpe + static_cast<int64_t>(t) * C;
      for (int c = 0; c < C; c++) out_bt[c] = token_row[c] + position_row[c];
    }
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float* dout_bt = dout + (static_cast<int64_t>(b) * T + t) * C;
      float* dtoken_row = dwte + static_cast<int64_t>(tokens[b * T + t]) * C;
      float* dposition_row = dwpe + static_cast<int64_t>(t) * C;
      for (int c = 0; c < C; c++) {
        dtoken_row[c] += dout_bt[c];
        dposition_row[c] += dout_bt[c];
      }
    }
  }
}

// ----------------------------------------------------------------------------
// layernorm

// A value as it is stored: fp32 as it is, or rounded to bf16
static inline void store(float* out, float value) { *out = value; }
static inline void store(bf16* out, float value) { *out = to_bf16(value); }

// layernorm_forward's rows, stored as Out: inlined into each of the two ops below, whose
// clones vectorise it
template <typename Out>
static inline __attribute__((always_inline)) void layernorm_rows(Out* out, float* mean, float* rstd,
                                                                 const float* inp, const float* weight,
                                                                 const float* bias, int N, int C) {
  const float eps = 1e-5f;
  for (int i = 0; i < N; i++) {
    const float* x = inp + static_cast<int64_t>(i) * C;
    // m = sum(x) / C, variance = sum((x - m)^2) / C, each a lane_sum
    const float m = lane_sum(C, [&](int c) { return x[c]; }) / C;
    const float variance = lane_sum(C, [&](int c) { return (x[c] - m) * (x[c] - m); }) / C;
    const float s = 1.0f / std::sqrt(variance + eps);
    Out* y = out + static_cast<int64_t>(i) * C;
    for (int c = 0; c < C; c++) store(y + c, (x[c] - m) * s * weight[c] + bias[c]);
    mean[i] = m;
    rstd[i] = s;
  }
}

COURSE_VECTOR_CLONES void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                                            const float* bias, int N, int C) {
  layernorm_rows(out, mean, rstd, inp, weight, bias, N, C);
}

COURSE_VECTOR_CLONES void layernorm_forward_bf16(bf16* out, float* mean, float* rstd, const float* inp,
                                                 const float* weight, const float* bias, int N, int C) {
  layernorm_rows(out, mean, rstd, inp, weight, bias, N, C);
}

COURSE_VECTOR_CLONES void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C) {
  for (int i = 0; i < N; i++) {
    const float* dy = dout + static_cast<int64_t>(i) * C;
    const float* x = inp + static_cast<int64_t>(i) * C;
    float* dx = dinp + static_cast<int64_t>(i) * C;
    // mean and rstd in locals: read through the pointers, the compiler must assume the
    // stores to dx, dweight, dbias may change them
    const float m = mean[i], s = rstd[i];
    // two reductions over the row: mean of dnorm and mean of dnorm * norm,
    // where norm = (x - m) s and dnorm = weight dy
    const float dnorm_mean = lane_sum(C, [&](int c) { return weight[c] * dy[c]; }) / C;
    const float dnorm_norm_mean = lane_sum(C, [&](int c) { return weight[c] * dy[c] * ((x[c] - m) * s); }) / C;
    // two loops, not one: with stores to dbias, dweight and dx in one loop GCC gives up
    // on vectorising it (its alias checks); each loop alone runs 16 or 8 floats at a time
    for (int c = 0; c < C; c++) {
      const float norm = (x[c] - m) * s;
      dbias[c] += dy[c];
      dweight[c] += norm * dy[c];
    }
    for (int c = 0; c < C; c++) {
      const float norm = (x[c] - m) * s;
      const float dnorm = weight[c] * dy[c];
      // dx = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
      dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
}

// ----------------------------------------------------------------------------
// linear

// linear_forward and linear_backward, their input fp32 or bf16 (In): the GEMMs take
// either (gemm_cpu.h)
template <typename In>
static void linear_forward_of(float* out, const In* inp, const float* weight, const float* bias, int N, int IC,
                              int OC) {
  // out (N, OC) = inp (N, IC) @ weight^T (IC, OC) + bias (OC)
  if (bias == nullptr) {
    cpu::gemm(false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 0.0f, out, OC);
    return;
  }
  // The bias is written first and the GEMM adds the product onto it (beta = 1): with
  // beta = 0 OpenBLAS would first zero out, and the bias would be one more pass over it.
  for (int i = 0; i < N; i++) std::memcpy(out + static_cast<int64_t>(i) * OC, bias, OC * sizeof(float));
  cpu::gemm(false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 1.0f, out, OC);
}

template <typename In>
static void linear_backward_of(float* dinp, float* dweight, float* dbias, const float* dout, const In* inp,
                               const float* weight, int N, int IC, int OC) {
  // dout is the A of both GEMMs: under bf16, rounded once for the two
  const cpu::PreparedA dout_a =
      dinp != nullptr || dweight != nullptr ? cpu::prepare_a(dout, N, OC, OC) : cpu::PreparedA{dout, OC, false};
  // dinp (N, IC) += dout (N, OC) @ weight (OC, IC)
  if (dinp != nullptr) {
    cpu::gemm(false, false, N, IC, OC, 1.0f, dout_a, weight, IC, 1.0f, dinp, IC);
  }
  // dweight (OC, IC) += dout^T (OC, N) @ inp (N, IC)
  if (dweight != nullptr) {
    cpu::gemm(true, false, OC, IC, N, 1.0f, dout_a, inp, IC, 1.0f, dweight, IC);
  }
  if (dbias == nullptr) return;
  for (int i = 0; i < N; i++) {
    const float* row = dout + static_cast<int64_t>(i) * OC;
    for (int o = 0; o < OC; o++) dbias[o] += row[o];
  }
}

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int IC, int OC) {
  linear_forward_of(out, inp, weight, bias, N, IC, OC);
}
void linear_forward_bf16(float* out, const bf16* inp, const float* weight, const float* bias, int N, int IC, int OC) {
  linear_forward_of(out, inp, weight, bias, N, IC, OC);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC) {
  linear_backward_of(dinp, dweight, dbias, dout, inp, weight, N, IC, OC);
}
void linear_backward_bf16(float* dinp, float* dweight, float* dbias, const float* dout, const bf16* inp,
                          const float* weight, int N, int IC, int OC) {
  linear_backward_of(dinp, dweight, dbias, dout, inp, weight, N, IC, OC);
}

// ----------------------------------------------------------------------------
// gelu (tanh approximation, as GPT-2)
//
// out = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as
// out = x sigmoid(2u) = x / (1 + e^(-2u)): the same function, since
// 0.5 (1 + tanh(u)) = sigmoid(2u), without the cancellation of 1 + tanh(u) for
// very negative x, and with e^x from exp_approx (common/tensor/vector_math.h) instead of
// std::tanh. The library's tanhf is one scalar call per element; it was 40% of a
// training step. exp_approx is plain arithmetic, so the compiler runs the loops 4
// floats at a time (SSE2, any x86-64; common/CMakeLists.txt compiles this file with
// -fno-trapping-math, which lets the clamp's comparisons become vector min/max).
// test_ops checks the result against double precision at every spacing of 1/1024
// over [-16, 16] and beyond.

static const float kGeluScale = std::sqrt(2.0f / static_cast<float>(M_PI));

// sigmoid(2u) = 0.5 (1 + tanh(u))
static inline float gelu_sigmoid(float x) {
  const float u = kGeluScale * (x + 0.044715f * x * x * x);
  return 1.0f / (1.0f + exp_approx(-2.0f * u));
}

COURSE_VECTOR_CLONES void gelu_forward(float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = inp[i] * gelu_sigmoid(inp[i]);
}

// In blocks: GELU into an fp32 block, then the block rounded. One loop doing both is not
// vectorised by GCC (the narrowing store after exp_approx), and ran 7x slower.
COURSE_VECTOR_CLONES void gelu_forward_bf16(bf16* out, const float* inp, int64_t n) {
  constexpr int64_t kBlock = 256;
  float values[kBlock];  // (kBlock)  one block's GELU in fp32
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t count = std::min(kBlock, n - start);
    for (int64_t i = 0; i < count; i++) values[i] = inp[start + i] * gelu_sigmoid(inp[start + i]);
    for (int64_t i = 0; i < count; i++) out[start + i] = to_bf16(values[i]);
  }
}

COURSE_VECTOR_CLONES void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float x = inp[i];
    const float s = gelu_sigmoid(x);
    // d/dx [x sigmoid(2u)] = sigmoid(2u) + x sigmoid(2u) (1 - sigmoid(2u)) 2 du/dx
    // (= 0.5 (1 + tanh(u)) + 0.5 x sech^2(u) du/dx, the tanh form's derivative)
    const float du_dx = kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] += (s + 2.0f * x * s * (1.0f - s) * du_dx) * dout[i];
  }
}

// ----------------------------------------------------------------------------
// residual

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void residual_backward(float* da, const float* dout, int64_t n) {
  for (int64_t i = 0; i < n; i++) da[i] += dout[i];
}

// ----------------------------------------------------------------------------
// causal self-attention, one (batch, head) pair at a time with BLAS GEMMs.
// q, k, v of head h are the columns [h*hs, (h+1)*hs) of the q, k, v thirds of qkv,
// so each is a (T, hs) matrix with row stride 3C: BLAS reads them in place.
//
// Query i sees keys 0..i only, so the upper triangle of every T x T product is
// masked. The products are made in blocks of kCausalRows query rows: the block of
// rows [r0, r1) multiplies only keys [0, r1), skipping what the mask would zero.
// With T = 4 blocks that is 10 of 16 tiles, 62% of the FLOPs of the whole square.

static const int kCausalRows = 64;

// row[0..visible) = softmax of itself, row[visible..T) = 0. The exponentials are
// exp_approx (2 ulp, see gelu above) in a loop of their own, so the clones compute
// 16 or 8 at a time; the max and the sum are lane_max and lane_sum (8 partial sums).
COURSE_VECTOR_CLONES static void causal_softmax_row(float* row, int visible, int T) {
  const float row_max = lane_max(row, visible);
  for (int j = 0; j < visible; j++) row[j] = exp_approx(row[j] - row_max);
  const float sum = lane_sum(visible, [&](int j) { return row[j]; });
  for (int j = 0; j < visible; j++) row[j] /= sum;
  for (int j = visible; j < T; j++) row[j] = 0.0f;
}

// softmax backward of one row: d_j = p_j (d_j - sum_k p_k d_k) for j < visible, and
// d_j = 0 for j in [visible, end) (masked). The dot product is a lane_sum.
COURSE_VECTOR_CLONES static void causal_softmax_backward_row(float* d, const float* p, int visible, int end) {
  const float dot = lane_sum(visible, [&](int j) { return p[j] * d[j]; });
  for (int j = 0; j < visible; j++) d[j] = p[j] * (d[j] - dot);
  for (int j = visible; j < end; j++) d[j] = 0.0f;
}

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const float* q = qkv + static_cast<int64_t>(b) * T * 3 * C + h * hs;  // (T, hs), stride 3C
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* probs = att + (static_cast<int64_t>(b) * NH + h) * T * T;  // (T, T)
      float* y = out + static_cast<int64_t>(b) * T * C + h * hs;        // (T, hs), stride C

      for (int r0 = 0; r0 < T; r0 += kCausalRows) {
        const int r1 = std::min(T, r0 + kCausalRows), rows = r1 - r0;
        float* block = probs + static_cast<int64_t>(r0) * T;  // rows [r0, r1), keys [0, r1)
        // scores = q k^T / sqrt(hs)
        cpu::gemm(false, true, rows, r1, hs, scale, q + static_cast<int64_t>(r0) * 3 * C,
                    3 * C, k, 3 * C, 0.0f, block, T);
        // row-wise softmax over the visible positions j <= i; the future gets probability 0
        for (int i = r0; i < r1; i++) causal_softmax_row(probs + static_cast<int64_t>(i) * T, i + 1, T);
        // y = att @ v
        cpu::gemm(false, false, rows, hs, r1, 1.0f, block, T, v, 3 * C, 0.0f,
                    y + static_cast<int64_t>(r0) * C, C);
      }
    }
  }
}

void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att, int B,
                        int T, int C, int NH) {
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const int64_t qkv_offset = static_cast<int64_t>(b) * T * 3 * C + h * hs;
      const float* q = qkv + qkv_offset;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + qkv_offset;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* probs = att + (static_cast<int64_t>(b) * NH + h) * T * T;  // (T, T)
      const float* dy = dout + static_cast<int64_t>(b) * T * C + h * hs;       // (T, hs), stride C
      float* dscores = scratch;                                                 // (T, T)

      // the same blocks of query rows [r0, r1) against keys [0, r1) as forward
      for (int r0 = 0; r0 < T; r0 += kCausalRows) {
        const int r1 = std::min(T, r0 + kCausalRows), rows = r1 - r0;
        const float* p_block = probs + static_cast<int64_t>(r0) * T;
        float* d_block = dscores + static_cast<int64_t>(r0) * T;
        const float* dy_block = dy + static_cast<int64_t>(r0) * C;
        // dprobs = dy v^T
        cpu::gemm(false, true, rows, r1, hs, 1.0f, dy_block, C, v, 3 * C, 0.0f, d_block,
                    T);
        // dv += probs^T dy
        cpu::gemm(true, false, r1, hs, rows, 1.0f, p_block, T, dy_block, C, 1.0f, dv,
                    3 * C);
        // softmax backward: dscores_ij = p_ij (dprobs_ij - sum_k p_ik dprobs_ik), zero where masked
        for (int i = r0; i < r1; i++) {
          causal_softmax_backward_row(dscores + static_cast<int64_t>(i) * T, probs + static_cast<int64_t>(i) * T, i + 1,
                                      r1);
        }
        // dq += dscores k / sqrt(hs),  dk += dscores^T q / sqrt(hs): dscores is the A of
        // both (under bf16, rounded once for the two)
        const cpu::PreparedA d_a = cpu::prepare_a(d_block, rows, r1, T);
        cpu::gemm(false, false, rows, hs, r1, scale, d_a, k, 3 * C, 1.0f, dq + static_cast<int64_t>(r0) * 3 * C,
                  3 * C);
        cpu::gemm(true, false, r1, hs, rows, scale, d_a, q + static_cast<int64_t>(r0) * 3 * C, 3 * C, 1.0f, dk,
                  3 * C);
      }
    }
  }
}

// ----------------------------------------------------------------------------
// softmax cross-entropy

// The softmax of each row as the attention's: lane_max, then the exponentials with
// exp_approx (2 ulp, vectorised like GELU's; std::exp is one scalar library call per
// logit), then lane_sum. One std::log per row.
COURSE_VECTOR_CLONES void crossentropy_forward(float* losses, float* probs, const float* logits, const int* targets, int B, int T, int V) {
  for (int64_t i = 0; i < static_cast<int64_t>(B) * T; i++) {
    const float* z = logits + i * V;
    float* p = probs + i * V;
    const float z_max = lane_max(z, V);
    for (int v = 0; v < V; v++) p[v] = exp_approx(z[v] - z_max);
    const float sum = lane_sum(V, [&](int v) { return p[v]; });
    for (int v = 0; v < V; v++) p[v] /= sum;
    // -log p[target], computed from the logits so a tiny probability does not underflow to log(0)
    losses[i] = -(z[targets[i]] - z_max - std::log(sum));
  }
}

void crossentropy_backward(float* dlogits, const float* probs, const int* targets, float dloss, int B, int T, int V) {
  for (int64_t i = 0; i < static_cast<int64_t>(B) * T; i++) {
    const float* p = probs + i * V;
    float* dz = dlogits + i * V;
    for (int v = 0; v < V; v++) dz[v] += (p[v] - (v == targets[i] ? 1.0f : 0.0f)) * dloss;
  }
}

// ----------------------------------------------------------------------------
// helpers for the model and the optimizer

void zero(float* x, int64_t n) { std::memset(x, 0, static_cast<size_t>(n) * sizeof(float)); }

float mean(const float* x, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; i++) sum += x[i];
  return static_cast<float>(sum / n);
}

// (mean's roundings, then the division, then the add: what `loss += mean / micro_batches` did on the host)
void add_mean(float* total, const float* x, int64_t n, float divisor) { total[0] += mean(x, n) / divisor; }

double sum_squares(const float* x, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; i++) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

void scale(float* x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; i++) x[i] *= factor;
}

// (vector clones: to_bf16 has no branches, so 16 values at a time on AVX-512)
COURSE_VECTOR_CLONES void cast_to_bf16(bf16* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = to_bf16(x[i]);
}

COURSE_VECTOR_CLONES void cast_to_fp32(float* out, const bf16* x, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = to_float(x[i]);
}

void copy_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t width) {
  if (width == 0) return;
  for (int64_t r = 0; r < rows; r++) {
    std::memcpy(dst + r * dst_stride, src + r * src_stride, static_cast<size_t>(width) * sizeof(float));
  }
}

COURSE_VECTOR_CLONES void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, float m_correction, float v_correction) {
  for (int64_t i = 0; i < n; i++) {
    float g = grads[i];
    m[i] = beta1 * m[i] + (1.0f - beta1) * g;
    v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
    float m_hat = m[i] / m_correction;
    float v_hat = v[i] / v_correction;
    params[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + weight_decay * params[i]);
  }
}

}  // namespace course::ops
