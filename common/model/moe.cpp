#include "common/model/moe.h"

#include <algorithm>
#include <cmath>

namespace course {

int moe_capacity(float capacity_factor, int tokens, int experts, int top_k) {
  if (capacity_factor == 0.0f) return tokens;
  const double capacity = std::ceil(static_cast<double>(capacity_factor) * tokens * top_k / experts);
  return static_cast<int>(std::min(capacity, static_cast<double>(tokens)));
}

// ----------------------------------------------------------------------------
// storage

size_t MoeActivations::floats(const MoeSizes& s) {
  const size_t N = s.tokens, C = s.channels, E = s.experts, k = s.top_k;
  return N * (E + 3 * k + 10 * k * C) + 2 * E + 1;
}

void MoeActivations::carve(Carver& carve, const MoeSizes& s) {
  static_assert(sizeof(int) == sizeof(float), "the routing keeps int32 in float-sized slots");
  const size_t N = s.tokens, C = s.channels, E = s.experts, k = s.top_k, R = s.rows();
  probs = carve.take(N * E);
  expert = reinterpret_cast<int*>(carve.take(N * k));
  gate = carve.take(N * k);
  row = reinterpret_cast<int*>(carve.take(N * k));
  expert_begin = reinterpret_cast<int*>(carve.take(E + 1));
  routed = reinterpret_cast<int*>(carve.take(E));
  expert_in = carve.take(R * C);
  hidden = carve.take(R * 4 * C);
  hidden_gelu = carve.take(R * 4 * C);
  expert_out = carve.take(R * C);
}

size_t MoeScratch::floats(const MoeSizes& s) {
  const size_t N = s.tokens, C = s.channels, E = s.experts, k = s.top_k;
  return N * (10 * k * C + k + 2 * E);
}

void MoeScratch::carve(Carver& carve, const MoeSizes& s) {
  const size_t N = s.tokens, C = s.channels, E = s.experts, k = s.top_k, R = s.rows();
  dexpert_out = carve.take(R * C);
  dhidden_gelu = carve.take(R * 4 * C);
  dhidden = carve.take(R * 4 * C);
  dexpert_in = carve.take(R * C);
  dgate = carve.take(N * k);
  dprobs = carve.take(N * E);
  dlogits = carve.take(N * E);
}

// ----------------------------------------------------------------------------
// router

void router_forward(float* probs, const float* x, const float* router_w, const MoeSizes& s, const OpTable& op) {
  const int N = s.tokens, E = s.experts;
  // logits = x @ router_w^T, written where the probabilities go
  op.linear_forward(probs, x, router_w, nullptr, N, s.channels, E);
  // probs = exp(logits - max) / sum exp(logits - max), per token
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

void router_backward(float* dx, float* drouter_w, float* dlogits, const float* dprobs, const float* probs,
                     const float* x, const float* router_w, const MoeSizes& s, const OpTable& op) {
  const int N = s.tokens, E = s.experts;
  for (int n = 0; n < N; n++) {
    const float* p = probs + static_cast<int64_t>(n) * E;
    const float* dp = dprobs + static_cast<int64_t>(n) * E;
    float* dl = dlogits + static_cast<int64_t>(n) * E;
    // softmax backward: dlogit_e = p_e (dp_e - sum_i p_i dp_i)
    float p_dot_dp = 0.0f;
    for (int e = 0; e < E; e++) p_dot_dp += p[e] * dp[e];
    for (int e = 0; e < E; e++) dl[e] = p[e] * (dp[e] - p_dot_dp);
  }
  op.linear_backward(dx, drouter_w, nullptr, dlogits, x, router_w, N, s.channels, E);
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

int assign_rows(int* row, int* expert_begin, int* routed, const int* expert, const MoeSizes& s) {
  const int E = s.experts, choices = s.rows();
  std::fill(routed, routed + E, 0);
  for (int i = 0; i < choices; i++) routed[expert[i]]++;
  // expert e's rows follow those of experts 0 .. e-1, each keeping at most `capacity`
  expert_begin[0] = 0;
  for (int e = 0; e < E; e++) expert_begin[e + 1] = expert_begin[e] + std::min(routed[e], s.capacity);
  // token order (i = n k + j walks the tokens in order): the first `capacity` choices of e get its rows
  std::vector<int> taken(E, 0);
  int dropped = 0;
  for (int i = 0; i < choices; i++) {
    const int e = expert[i];
    if (taken[e] < s.capacity) {
      row[i] = expert_begin[e] + taken[e]++;
    } else {
      row[i] = -1;
      dropped++;
    }
  }
  return dropped;
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
// the experts: one GEMM per expert per layer, over the expert's rows

void experts_forward(float* expert_out, float* hidden, float* hidden_gelu, const float* expert_in,
                     const MoeWeights& w, const int* expert_begin, const MoeSizes& s, const OpTable& op) {
  const int64_t C = s.channels, H = 4 * C;
  for (int e = 0; e < s.experts; e++) {
    const int first = expert_begin[e], rows = expert_begin[e + 1] - first;
    if (rows == 0) continue;
    // hidden = expert_in @ fc_w[e]^T + fc_b[e]; out = gelu(hidden) @ fcproj_w[e]^T + fcproj_b[e]
    op.linear_forward(hidden + first * H, expert_in + first * C, w.expert_fc_w + e * H * C, w.expert_fc_b + e * H,
                      rows, static_cast<int>(C), static_cast<int>(H));
    op.gelu_forward(hidden_gelu + first * H, hidden + first * H, rows * H);
    op.linear_forward(expert_out + first * C, hidden_gelu + first * H, w.expert_fcproj_w + e * C * H,
                      w.expert_fcproj_b + e * C, rows, static_cast<int>(H), static_cast<int>(C));
  }
}

void experts_backward(float* dexpert_in, float* dhidden, float* dhidden_gelu, const MoeWeights& g,
                      const float* dexpert_out, const float* expert_in, const float* hidden,
                      const float* hidden_gelu, const MoeWeights& w, const int* expert_begin, const MoeSizes& s,
                      const OpTable& op) {
  const int64_t C = s.channels, H = 4 * C;
  for (int e = 0; e < s.experts; e++) {
    const int first = expert_begin[e], rows = expert_begin[e + 1] - first;
    if (rows == 0) continue;
    op.linear_backward(dhidden_gelu + first * H, g.expert_fcproj_w + e * C * H, g.expert_fcproj_b + e * C,
                       dexpert_out + first * C, hidden_gelu + first * H, w.expert_fcproj_w + e * C * H, rows,
                       static_cast<int>(H), static_cast<int>(C));
    op.gelu_backward(dhidden + first * H, hidden + first * H, dhidden_gelu + first * H, rows * H);
    op.linear_backward(dexpert_in + first * C, g.expert_fc_w + e * H * C, g.expert_fc_b + e * H, dhidden + first * H,
                       expert_in + first * C, w.expert_fc_w + e * H * C, rows, static_cast<int>(C),
                       static_cast<int>(H));
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

// ----------------------------------------------------------------------------
// the whole layer

void moe_forward(float* out, const float* x, const MoeWeights& w, MoeActivations& a, const MoeSizes& s) {
  const OpTable& op = ops_for(Device::CPU);
  router_forward(a.probs, x, w.router_w, s, op);
  route_top_k(a.expert, a.gate, a.probs, s);
  a.dropped = assign_rows(a.row, a.expert_begin, a.routed, a.expert, s);
  a.aux_loss = aux_loss_forward(a.probs, a.routed, s);
  dispatch_forward(a.expert_in, x, a.row, s);
  experts_forward(a.expert_out, a.hidden, a.hidden_gelu, a.expert_in, w, a.expert_begin, s, op);
  combine_forward(out, a.expert_out, a.gate, a.row, s);
}

void moe_backward(float* dx, const MoeWeights& g, MoeScratch& d, const float* dout, float daux, const float* x,
                  const MoeWeights& w, const MoeActivations& a, const MoeSizes& s) {
  const OpTable& op = ops_for(Device::CPU);
  const int64_t N = s.tokens, R = s.rows(), C = s.channels;
  // every backward step accumulates, so the layer's scratch starts from zero
  op.zero(d.dexpert_out, R * C);
  op.zero(d.dhidden_gelu, R * 4 * C);
  op.zero(d.dhidden, R * 4 * C);
  op.zero(d.dexpert_in, R * C);
  op.zero(d.dgate, N * s.top_k);
  op.zero(d.dprobs, N * s.experts);

  combine_backward(d.dexpert_out, d.dgate, dout, a.expert_out, a.gate, a.row, s);
  experts_backward(d.dexpert_in, d.dhidden, d.dhidden_gelu, g, d.dexpert_out, a.expert_in, a.hidden, a.hidden_gelu,
                   w, a.expert_begin, s, op);
  dispatch_backward(dx, d.dexpert_in, a.row, s);
  // the router's two paths to the loss: through the gates and through the aux loss
  route_top_k_backward(d.dprobs, d.dgate, a.expert, a.gate, a.probs, s);
  aux_loss_backward(d.dprobs, a.routed, daux, s);
  router_backward(dx, g.router_w, d.dlogits, d.dprobs, a.probs, x, w.router_w, s, op);
}

// ----------------------------------------------------------------------------
// statistics

void RoutingStats::add(const MoeActivations& a, const MoeSizes& s) {
  expert_choices.resize(s.experts, 0);
  int64_t most = 0;
  for (int e = 0; e < s.experts; e++) {
    expert_choices[e] += a.routed[e];
    most = std::max<int64_t>(most, a.routed[e]);
  }
  layer_forwards++;
  aux_loss_sum += a.aux_loss;
  imbalance_sum += static_cast<double>(most) * s.experts / s.rows();
  choices += s.rows();
  dropped += a.dropped;
}

double RoutingStats::aux_loss() const { return empty() ? 0.0 : aux_loss_sum / layer_forwards; }

double RoutingStats::dropped_fraction() const {
  return choices == 0 ? 0.0 : static_cast<double>(dropped) / static_cast<double>(choices);
}

double RoutingStats::imbalance() const { return empty() ? 0.0 : imbalance_sum / layer_forwards; }

}  // namespace course
