// The mixture of experts' ops on the CPU (moe_ops.h): plain loops over the tokens.
#include "common/model/moe_ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace course::moe_ops {

// ----------------------------------------------------------------------------
// router

void router_softmax(float* probs, int N, int E) {
  for (int n = 0; n < N; n++) {
    float* p = probs + static_cast<int64_t>(n) * E;
    const float max_logit = *std::max_element(p, p + E);
    float sum = 0.0f;
    for (int e = 0; e < E; e++) {
      p[e] = std::exp(p[e] - max_logit);
      sum += p[e];
    }
    for (int e = 0; e < E; e++) p[e] /= sum;
  }
}

void router_softmax_backward(float* dlogits, const float* dprobs, const float* probs, int N, int E) {
  for (int n = 0; n < N; n++) {
    const float* p = probs + static_cast<int64_t>(n) * E;
    const float* dp = dprobs + static_cast<int64_t>(n) * E;
    float* dl = dlogits + static_cast<int64_t>(n) * E;
    // softmax backward: dlogit_e = p_e (dp_e - sum_i p_i dp_i)
    float p_dot_dp = 0.0f;
    for (int e = 0; e < E; e++) p_dot_dp += p[e] * dp[e];
    for (int e = 0; e < E; e++) dl[e] = p[e] * (dp[e] - p_dot_dp);
  }
}

// ----------------------------------------------------------------------------
// top-k and gates

void route_top_k(int* expert, float* gate, const float* probs, const MoeSizes& s) {
  const int E = s.experts, k = s.top_k;
  for (int n = 0; n < s.tokens; n++) {
    const float* p = probs + static_cast<int64_t>(n) * E;
    int* chosen = expert + static_cast<int64_t>(n) * k;
    float* g = gate + static_cast<int64_t>(n) * k;
    float chosen_sum = 0.0f;
    for (int j = 0; j < k; j++) {
      // the largest prob not chosen yet; scanning upwards with a strict '>' keeps the lower index of a tie
      int best = -1;
      for (int e = 0; e < E; e++) {
        if (std::find(chosen, chosen + j, e) != chosen + j) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      chosen[j] = best;
      chosen_sum += p[best];
    }
    // top-1: gate = p (Switch); top-k: gate_j = p_j / S, S = the sum of the k chosen probs (Mixtral)
    const float divisor = k == 1 ? 1.0f : chosen_sum;
    for (int j = 0; j < k; j++) g[j] = p[chosen[j]] / divisor;
  }
}

void route_top_k_backward(float* dprobs, const float* dgate, const int* expert, const float* gate,
                          const float* probs, const MoeSizes& s) {
  const int E = s.experts, k = s.top_k;
  for (int n = 0; n < s.tokens; n++) {
    const float* p = probs + static_cast<int64_t>(n) * E;
    const int* chosen = expert + static_cast<int64_t>(n) * k;
    const float* g = gate + static_cast<int64_t>(n) * k;
    const float* dg = dgate + static_cast<int64_t>(n) * k;
    // top-1: gate = p, so dp = dgate
    if (k == 1) {
      dprobs[static_cast<int64_t>(n) * E + chosen[0]] += dg[0];
      continue;
    }
    float chosen_sum = 0.0f, dg_dot_g = 0.0f;
    for (int j = 0; j < k; j++) {
      chosen_sum += p[chosen[j]];
      dg_dot_g += dg[j] * g[j];
    }
    // gate_j = p_j / S: dp_j = (dgate_j - sum_i dgate_i gate_i) / S
    for (int j = 0; j < k; j++) dprobs[static_cast<int64_t>(n) * E + chosen[j]] += (dg[j] - dg_dot_g) / chosen_sum;
  }
}

// ----------------------------------------------------------------------------
// capacity: which choices get a row

void assign_rows(int* row, int* expert_begin, int* routed, const int* expert, const MoeSizes& s) {
  const int E = s.experts, choices = s.rows();
  std::fill(routed, routed + E, 0);
  for (int i = 0; i < choices; i++) routed[expert[i]]++;
  // expert e's rows follow those of experts 0 .. e-1, each keeping at most `capacity`
  expert_begin[0] = 0;
  for (int e = 0; e < E; e++) expert_begin[e + 1] = expert_begin[e] + std::min(routed[e], s.capacity);
  // token order (i = n k + j walks the tokens in order): the first `capacity` choices of e get its rows
  std::vector<int> taken(E, 0);
  for (int i = 0; i < choices; i++) {
    const int e = expert[i];
    row[i] = taken[e] < s.capacity ? expert_begin[e] + taken[e]++ : -1;
  }
}

// ----------------------------------------------------------------------------
// dispatch and combine

void dispatch_forward(float* expert_in, const float* x, const int* row, const MoeSizes& s) {
  const int C = s.channels, k = s.top_k;
  for (int n = 0; n < s.tokens; n++) {
    for (int j = 0; j < k; j++) {
      const int r = row[static_cast<int64_t>(n) * k + j];
      if (r < 0) continue;
      std::copy(x + static_cast<int64_t>(n) * C, x + static_cast<int64_t>(n + 1) * C,
                expert_in + static_cast<int64_t>(r) * C);
    }
  }
}

void dispatch_backward(float* dx, const float* dexpert_in, const int* row, const MoeSizes& s) {
  const int C = s.channels, k = s.top_k;
  for (int n = 0; n < s.tokens; n++) {
    float* dx_n = dx + static_cast<int64_t>(n) * C;
    for (int j = 0; j < k; j++) {
      const int r = row[static_cast<int64_t>(n) * k + j];
      if (r < 0) continue;
      const float* d = dexpert_in + static_cast<int64_t>(r) * C;
      for (int c = 0; c < C; c++) dx_n[c] += d[c];
    }
  }
}

void combine_forward(float* out, const float* expert_out, const float* gate, const int* row, const MoeSizes& s) {
  const int C = s.channels, k = s.top_k;
  for (int n = 0; n < s.tokens; n++) {
    float* y = out + static_cast<int64_t>(n) * C;
    std::fill(y, y + C, 0.0f);
    for (int j = 0; j < k; j++) {
      const int r = row[static_cast<int64_t>(n) * k + j];
      if (r < 0) continue;
      const float g = gate[static_cast<int64_t>(n) * k + j];
      const float* o = expert_out + static_cast<int64_t>(r) * C;
      for (int c = 0; c < C; c++) y[c] += g * o[c];
    }
  }
}

void combine_backward(float* dexpert_out, float* dgate, const float* dout, const float* expert_out,
                      const float* gate, const int* row, const MoeSizes& s) {
  const int C = s.channels, k = s.top_k;
  for (int n = 0; n < s.tokens; n++) {
    const float* dy = dout + static_cast<int64_t>(n) * C;
    for (int j = 0; j < k; j++) {
      const int64_t choice = static_cast<int64_t>(n) * k + j;
      const int r = row[choice];
      if (r < 0) continue;  // a dropped choice: no output, no gradient
      const float* o = expert_out + static_cast<int64_t>(r) * C;
      float* d = dexpert_out + static_cast<int64_t>(r) * C;
      float dy_dot_o = 0.0f;
      for (int c = 0; c < C; c++) {
        d[c] += gate[choice] * dy[c];
        dy_dot_o += dy[c] * o[c];
      }
      dgate[choice] += dy_dot_o;
    }
  }
}

// ----------------------------------------------------------------------------
// load balancing

float aux_loss_forward(const float* probs, const int* routed, const MoeSizes& s) {
  const int N = s.tokens, E = s.experts;
  double aux = 0.0;
  for (int e = 0; e < E; e++) {
    double mean_prob = 0.0;
    for (int n = 0; n < N; n++) mean_prob += probs[static_cast<int64_t>(n) * E + e];
    mean_prob /= N;
    const double routed_fraction = static_cast<double>(routed[e]) / s.rows();
    aux += routed_fraction * mean_prob;
  }
  return static_cast<float>(E * aux);
}

void aux_loss_backward(float* dprobs, const int* routed, float daux, const MoeSizes& s) {
  const int N = s.tokens, E = s.experts;
  for (int e = 0; e < E; e++) {
    // d aux / d probs[n, e] = E f_e / N, the same for every token
    const float d = daux * E * (static_cast<float>(routed[e]) / s.rows()) / N;
    for (int n = 0; n < N; n++) dprobs[static_cast<int64_t>(n) * E + e] += d;
  }
}

}  // namespace course::moe_ops
