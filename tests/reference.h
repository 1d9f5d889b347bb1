// A reference GPT forward pass in double precision, written to be obviously right
// rather than fast: plain loops, no BLAS, nothing shared with common/tensor/ops_cpu.cpp.
//
// The tests hold the real (fp32, BLAS) implementation against it in two ways:
// - forward: the fp32 op must agree with the double one to about fp32 rounding;
// - backward: the fp32 analytic gradient must agree with central finite
//   differences of these functions. In double, a step h = 1e-4 leaves a
//   truncation error ~h^2 and a rounding error ~1e-16/h, both far below fp32
//   rounding, so any disagreement is the analytic gradient's.
//
// Shapes and conventions are those of common/tensor/ops.h: row-major, N = B*T rows,
// C channels, V vocabulary, NH heads of hs = C/NH channels.
#pragma once

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/model/model.h"

namespace course {

// max |actual - expected| / max(max |expected|, 1e-6): one number per tensor,
// relative to the tensor's scale, so tiny elements do not blow it up.
template <typename Actual>
double relative_error(const std::vector<Actual>& actual, const std::vector<double>& expected) {
  if (actual.size() != expected.size()) throw std::invalid_argument("relative_error: sizes differ");
  double max_difference = 0.0, max_expected = 1e-6;
  for (size_t i = 0; i < actual.size(); i++) {
    max_difference = std::max(max_difference, std::abs(static_cast<double>(actual[i]) - expected[i]));
    max_expected = std::max(max_expected, std::abs(expected[i]));
  }
  return max_difference / max_expected;
}

// out[b,t,c] = wte[tokens[b,t], c] + wpe[t, c]                      -> (B, T, C)
inline std::vector<double> reference_embedding(const int* tokens, const double* wte, const double* wpe, int B, int T,
                                               int C) {
  std::vector<double> out(static_cast<size_t>(B) * T * C);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int c = 0; c < C; c++)
        out[(b * T + t) * C + c] = wte[tokens[b * T + t] * C + c] + wpe[t * C + c];
  return out;
}

// Per row x of inp (N, C):
//   mean = sum_c x_c / C,  var = sum_c (x_c - mean)^2 / C   (the biased variance)
//   out_c = (x_c - mean) / sqrt(var + 1e-5) * weight_c + bias_c     -> (N, C)
inline std::vector<double> reference_layernorm(const double* inp, const double* weight, const double* bias, int N,
                                               int C) {
  std::vector<double> out(static_cast<size_t>(N) * C);
  for (int i = 0; i < N; i++) {
    const double* x = inp + i * C;
    double mean = 0.0;
    for (int c = 0; c < C; c++) mean += x[c];
    mean /= C;
    double variance = 0.0;
    for (int c = 0; c < C; c++) variance += (x[c] - mean) * (x[c] - mean);
    variance /= C;
    for (int c = 0; c < C; c++) out[i * C + c] = (x[c] - mean) / std::sqrt(variance + 1e-5) * weight[c] + bias[c];
  }
  return out;
}

// out[n,o] = sum_i inp[n,i] * weight[o,i] + bias[o]   (no bias term when bias is null)
// inp (N, IC), weight (OC, IC), bias (OC)                           -> (N, OC)
inline std::vector<double> reference_linear(const double* inp, const double* weight, const double* bias, int N,
                                            int IC, int OC) {
  std::vector<double> out(static_cast<size_t>(N) * OC);
  for (int n = 0; n < N; n++) {
    for (int o = 0; o < OC; o++) {
      double sum = bias != nullptr ? bias[o] : 0.0;
      for (int i = 0; i < IC; i++) sum += inp[n * IC + i] * weight[o * IC + i];
      out[n * OC + o] = sum;
    }
  }
  return out;
}

// GELU, tanh approximation (GPT-2): out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   -> (n)
inline std::vector<double> reference_gelu(const double* inp, int n) {
  const double pi = std::acos(-1.0);
  std::vector<double> out(n);
  for (int i = 0; i < n; i++) {
    double x = inp[i];
    out[i] = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / pi) * (x + 0.044715 * x * x * x)));
  }
  return out;
}

// out = a + b, element-wise                                         -> (n)
inline std::vector<double> reference_residual(const double* a, const double* b, int n) {
  std::vector<double> out(n);
  for (int i = 0; i < n; i++) out[i] = a[i] + b[i];
  return out;
}

// The attention probabilities of causal multi-head attention over packed qkv (B, T, 3C),
// where qkv[b,t] = [q | k | v] and head h owns channels [h*hs, (h+1)*hs) of each third:
//   score[i,j] = q_i . k_j / sqrt(hs) for j <= i (position i sees itself and the past)
//   att[i,j]   = exp(score[i,j]) / sum_{j' <= i} exp(score[i,j']), and 0 for j > i
//                                                                   -> (B, NH, T, T)
inline std::vector<double> reference_attention_probs(const double* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  std::vector<double> att(static_cast<size_t>(B) * NH * T * T, 0.0);
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      double* probs = att.data() + (b * NH + h) * T * T;
      for (int i = 0; i < T; i++) {
        const double* q = qkv + (b * T + i) * 3 * C + h * hs;
        double sum = 0.0;
        for (int j = 0; j <= i; j++) {
          const double* k = qkv + (b * T + j) * 3 * C + C + h * hs;
          double score = 0.0;
          for (int c = 0; c < hs; c++) score += q[c] * k[c];
          // scores are O(1) here, so exp() without subtracting the row maximum is safe and simpler
          probs[i * T + j] = std::exp(score / std::sqrt(static_cast<double>(hs)));
          sum += probs[i * T + j];
        }
        for (int j = 0; j <= i; j++) probs[i * T + j] /= sum;
      }
    }
  }
  return att;
}

// out[b,i, head h's channels] = sum_{j <= i} att[b,h,i,j] * v_j  (v_j: head h's channels of the v third)
//                                                                   -> (B, T, C)
inline std::vector<double> reference_attention(const double* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  std::vector<double> att = reference_attention_probs(qkv, B, T, C, NH);
  std::vector<double> out(static_cast<size_t>(B) * T * C, 0.0);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++)
      for (int i = 0; i < T; i++)
        for (int j = 0; j <= i; j++) {
          const double* v = qkv + (b * T + j) * 3 * C + 2 * C + h * hs;
          for (int c = 0; c < hs; c++) out[(b * T + i) * C + h * hs + c] += att[((b * NH + h) * T + i) * T + j] * v[c];
        }
  return out;
}

// probs[n,:] = softmax(logits[n,:]) = exp(z_v - max z) / sum_v' exp(z_v' - max z)   -> (N, V)
inline std::vector<double> reference_softmax(const double* logits, int N, int V) {
  std::vector<double> probs(static_cast<size_t>(N) * V);
  for (int n = 0; n < N; n++) {
    const double* z = logits + n * V;
    double z_max = z[0];
    for (int v = 1; v < V; v++) z_max = std::fmax(z_max, z[v]);
    double sum = 0.0;
    for (int v = 0; v < V; v++) sum += std::exp(z[v] - z_max);
    for (int v = 0; v < V; v++) probs[n * V + v] = std::exp(z[v] - z_max) / sum;
  }
  return probs;
}

// losses[n] = -log softmax(logits[n,:])[targets[n]]   -> (N)
// (in double, the softmax's probabilities are far from underflow for the test's logits)
inline std::vector<double> reference_crossentropy(const double* logits, const int* targets, int N, int V) {
  const std::vector<double> probs = reference_softmax(logits, N, V);
  std::vector<double> losses(N);
  for (int n = 0; n < N; n++) losses[n] = -std::log(probs[static_cast<size_t>(n) * V + targets[n]]);
  return losses;
}

// A mixture-of-experts layer (common/model/moe.h), token after token, in double:
//   p = softmax(router_w x_n); the k largest p, most probable first (a tie: the lower
//   index); top-1: gate = p; top-k: gate_j = p_j / (sum of the k chosen p)
//   expert e takes the first `capacity` tokens that chose it, in token order
//   out_n = sum over n's kept choices of gate_j fcproj_e(gelu(fc_e(x_n)))
//   aux = E sum_e f_e P_e: f_e the share of the N k choices that chose e, P_e the mean p_e
// x (N, C), router_w (E, C), fc_w (E, 4C, C), fc_b (E, 4C), fcproj_w (E, C, 4C), fcproj_b (E, C)
struct ReferenceMoe {
  std::vector<double> out;  // (N, C)
  double aux = 0.0;
  std::vector<int> expert;  // (N, k) the choices
  std::vector<int> kept;    // (N, k) 1 when the choice got a place in its expert
};

inline ReferenceMoe reference_moe(const double* x, const double* router_w, const double* fc_w, const double* fc_b,
                                  const double* fcproj_w, const double* fcproj_b, int N, int C, int E, int k,
                                  int capacity) {
  const int H = 4 * C;
  ReferenceMoe result;
  result.out.assign(static_cast<size_t>(N) * C, 0.0);
  std::vector<int> taken(E, 0);
  std::vector<double> mean_prob(E, 0.0), routed(E, 0.0);
  for (int n = 0; n < N; n++) {
    const double* x_n = x + n * C;
    const std::vector<double> logits = reference_linear(x_n, router_w, nullptr, 1, C, E);
    const std::vector<double> p = reference_softmax(logits.data(), 1, E);
    std::vector<int> chosen;
    double chosen_sum = 0.0;
    for (int j = 0; j < k; j++) {
      int best = -1;
      for (int e = 0; e < E; e++) {
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end() && (best < 0 || p[e] > p[best])) best = e;
      }
      chosen.push_back(best);
      chosen_sum += p[best];
    }
    for (int e = 0; e < E; e++) mean_prob[e] += p[e] / N;
    for (int j = 0; j < k; j++) {
      const int e = chosen[j];
      routed[e] += 1.0;
      result.expert.push_back(e);
      result.kept.push_back(taken[e] < capacity ? 1 : 0);
      if (taken[e]++ >= capacity) continue;
      const std::vector<double> hidden = reference_linear(x_n, fc_w + e * H * C, fc_b + e * H, 1, C, H);
      const std::vector<double> hidden_gelu = reference_gelu(hidden.data(), H);
      const std::vector<double> y = reference_linear(hidden_gelu.data(), fcproj_w + e * C * H, fcproj_b + e * C, 1, H, C);
      const double gate = k == 1 ? p[e] : p[e] / chosen_sum;
      for (int c = 0; c < C; c++) result.out[n * C + c] += gate * y[c];
    }
  }
  for (int e = 0; e < E; e++) result.aux += E * (routed[e] / (static_cast<double>(N) * k)) * mean_prob[e];
  return result;
}

// The parameter called `name` of a stage whose parameters start at stage_params.
inline const double* reference_param(const StageLayout& stage, const double* stage_params, const std::string& name) {
  for (const ParamSpec& spec : stage.params)
    if (spec.name == name) return stage_params + spec.offset;
  throw std::invalid_argument("reference_param: stage " + stage.name + " has no parameter " + name);
}

// The mean cross-entropy of the whole GPT (common/model/model.h) on B sequences of config.seq_len tokens:
//   x   = embedding(tokens)
//   per block:  x = x + proj(attention(qkv(layernorm1(x))))
//               x = x + fcproj(gelu(fc(layernorm2(x))))     (MoE: x + moe(layernorm2(x)))
//   loss = mean over positions of crossentropy(lm_head(layernorm_f(x)), targets)
//          (MoE: + aux_loss_coef x the mean of the blocks' aux losses)
// flat_params holds the stages of model_layout(config) back to back (embedding, block 0 ..
// block L-1, head), each stage's parameters at their ParamSpec offsets within it.
inline double reference_gpt_loss(const GPTConfig& config, const std::vector<double>& flat_params,
                                 const std::vector<int>& tokens, const std::vector<int>& targets, int B) {
  const int T = config.seq_len, C = config.d_model, V = config.vocab_size, NH = config.n_head, L = config.n_layer;
  const int N = B * T;
  const std::vector<StageLayout> stages = model_layout(config);

  // stage s starts where stage s-1 ends
  std::vector<const double*> stage_params;
  size_t stage_start = 0;
  for (const StageLayout& stage : stages) {
    stage_params.push_back(flat_params.data() + stage_start);
    stage_start += stage.numel;
  }
  if (stage_start != flat_params.size()) throw std::invalid_argument("reference_gpt_loss: wrong number of parameters");
  auto param = [&](int stage, const std::string& name) {
    return reference_param(stages[stage], stage_params[stage], name);
  };

  std::vector<double> x = reference_embedding(tokens.data(), param(0, "wte"), param(0, "wpe"), B, T, C);
  double aux_sum = 0.0;  // over the MoE blocks
  for (int layer = 0; layer < L; layer++) {
    const int s = 1 + layer;
    const std::string p = "block" + std::to_string(layer) + ".";
    std::vector<double> ln1 = reference_layernorm(x.data(), param(s, p + "ln1_w"), param(s, p + "ln1_b"), N, C);
    std::vector<double> qkv = reference_linear(ln1.data(), param(s, p + "qkv_w"), param(s, p + "qkv_b"), N, C, 3 * C);
    std::vector<double> atty = reference_attention(qkv.data(), B, T, C, NH);
    std::vector<double> proj = reference_linear(atty.data(), param(s, p + "proj_w"), param(s, p + "proj_b"), N, C, C);
    x = reference_residual(x.data(), proj.data(), N * C);

    std::vector<double> ln2 = reference_layernorm(x.data(), param(s, p + "ln2_w"), param(s, p + "ln2_b"), N, C);
    if (config.n_experts > 0) {
      const ReferenceMoe moe =
          reference_moe(ln2.data(), param(s, p + "router_w"), param(s, p + "expert_fc_w"), param(s, p + "expert_fc_b"),
                        param(s, p + "expert_fcproj_w"), param(s, p + "expert_fcproj_b"), N, C, config.n_experts,
                        config.top_k, moe_capacity(config.capacity_factor, N, config.n_experts, config.top_k));
      x = reference_residual(x.data(), moe.out.data(), N * C);
      aux_sum += moe.aux;
      continue;
    }
    std::vector<double> fch = reference_linear(ln2.data(), param(s, p + "fc_w"), param(s, p + "fc_b"), N, C, 4 * C);
    std::vector<double> fch_gelu = reference_gelu(fch.data(), N * 4 * C);
    std::vector<double> mlp =
        reference_linear(fch_gelu.data(), param(s, p + "fcproj_w"), param(s, p + "fcproj_b"), N, 4 * C, C);
    x = reference_residual(x.data(), mlp.data(), N * C);
  }
  const int head = L + 1;
  std::vector<double> lnf = reference_layernorm(x.data(), param(head, "lnf_w"), param(head, "lnf_b"), N, C);
  std::vector<double> logits = reference_linear(lnf.data(), param(head, "lm_head_w"), nullptr, N, C, V);
  std::vector<double> losses = reference_crossentropy(logits.data(), targets.data(), N, V);
  double sum = 0.0;
  for (double loss : losses) sum += loss;
  return sum / N + config.aux_loss_coef * aux_sum / L;
}

}  // namespace course
