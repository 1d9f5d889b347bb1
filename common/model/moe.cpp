#include "common/model/moe.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/tensor/device.h"

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

void router_forward(float* probs, const float* x, const float* router_w, const MoeSizes& s, const OpTable& op,
                    const MoeOpTable& moe) {
  // logits = x @ router_w^T, written where the probabilities go; then their softmax per token
  op.linear_forward(probs, x, router_w, nullptr, s.tokens, s.channels, s.experts);
  moe.router_softmax(probs, s.tokens, s.experts);
}

void router_backward(float* dx, float* drouter_w, float* dlogits, const float* dprobs, const float* probs,
                     const float* x, const float* router_w, const MoeSizes& s, const OpTable& op,
                     const MoeOpTable& moe) {
  moe.router_softmax_backward(dlogits, dprobs, probs, s.tokens, s.experts);
  op.linear_backward(dx, drouter_w, nullptr, dlogits, x, router_w, s.tokens, s.channels, s.experts);
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
// the whole layer

int dropped_choices(const int* routed, const MoeSizes& s) {
  int dropped = 0;
  for (int e = 0; e < s.experts; e++) dropped += std::max(routed[e] - s.capacity, 0);
  return dropped;
}

// expert_begin (E + 1) then routed (E), next to each other in the activations: one copy
static std::vector<int> counts_on_host(const MoeActivations& a, const MoeSizes& s, Device device) {
  std::vector<int> counts(2 * s.experts + 1);
  copy_bytes(counts.data(), Device::CPU, a.expert_begin, device, counts.size() * sizeof(int));
  return counts;
}

void moe_forward(float* out, const float* x, const MoeWeights& w, MoeActivations& a, const MoeSizes& s,
                 Device device) {
  const OpTable& op = ops_for(device);
  const MoeOpTable& moe = moe_ops_for(device);
  router_forward(a.probs, x, w.router_w, s, op, moe);
  moe.route_top_k(a.expert, a.gate, a.probs, s);
  moe.assign_rows(a.row, a.expert_begin, a.routed, a.expert, s);
  const std::vector<int> counts = counts_on_host(a, s, device);  // expert_begin, routed
  const int* routed = counts.data() + s.experts + 1;
  a.routed_counts.assign(routed, routed + s.experts);
  a.dropped = dropped_choices(routed, s);
  a.aux_loss = moe.aux_loss_forward(a.probs, a.routed, s);
  moe.dispatch_forward(a.expert_in, x, a.row, s);
  experts_forward(a.expert_out, a.hidden, a.hidden_gelu, a.expert_in, w, counts.data(), s, op);
  moe.combine_forward(out, a.expert_out, a.gate, a.row, s);
}

void moe_backward(float* dx, const MoeWeights& g, MoeScratch& d, const float* dout, float daux, const float* x,
                  const MoeWeights& w, const MoeActivations& a, const MoeSizes& s, Device device) {
  const OpTable& op = ops_for(device);
  const MoeOpTable& moe = moe_ops_for(device);
  const int64_t N = s.tokens, R = s.rows(), C = s.channels;
  // every backward step accumulates, so the layer's scratch starts from zero
  op.zero(d.dexpert_out, R * C);
  op.zero(d.dhidden_gelu, R * 4 * C);
  op.zero(d.dhidden, R * 4 * C);
  op.zero(d.dexpert_in, R * C);
  op.zero(d.dgate, N * s.top_k);
  op.zero(d.dprobs, N * s.experts);

  moe.combine_backward(d.dexpert_out, d.dgate, dout, a.expert_out, a.gate, a.row, s);
  const std::vector<int> counts = counts_on_host(a, s, device);  // expert_begin: each expert's rows
  experts_backward(d.dexpert_in, d.dhidden, d.dhidden_gelu, g, d.dexpert_out, a.expert_in, a.hidden, a.hidden_gelu,
                   w, counts.data(), s, op);
  moe.dispatch_backward(dx, d.dexpert_in, a.row, s);
  // the router's two paths to the loss: through the gates and through the aux loss
  moe.route_top_k_backward(d.dprobs, d.dgate, a.expert, a.gate, a.probs, s);
  moe.aux_loss_backward(d.dprobs, a.routed, daux, s);
  router_backward(dx, g.router_w, d.dlogits, d.dprobs, a.probs, x, w.router_w, s, op, moe);
}

// ----------------------------------------------------------------------------
// statistics

void RoutingStats::add(const MoeActivations& a, const MoeSizes& s) {
  expert_choices.resize(s.experts, 0);
  int64_t most = 0;
  for (int e = 0; e < s.experts; e++) {
    expert_choices[e] += a.routed_counts[e];
    most = std::max<int64_t>(most, a.routed_counts[e]);
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
