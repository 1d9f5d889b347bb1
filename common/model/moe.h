// A mixture-of-experts (MoE) layer: what replaces a block's MLP with --experts E
// --top-k k (GShard, Switch Transformer, Mixtral). Each token goes to k of E expert
// MLPs, chosen by a router, and gets their outputs weighted by its gates:
//
//   x (N, C) ─► router: logits = x @ router_w^T (N, E), probs = softmax(logits)
//     │         top k experts per token (a tie: the lower expert index first),
//     │         gates: top-1, the prob itself (Switch); top-k, the k probs / their sum (Mixtral)
//     │         capacity: expert e takes the first `capacity` tokens routed to it,
//     │         in token order; the others' choices of e are dropped
//     ├─► dispatch: each kept (token, expert) choice becomes a row of expert_in,
//     │   the rows grouped by expert (R <= N k rows in all)
//     ├─► each expert e over its rows: fc (C -> 4C), GELU, fcproj (4C -> C): one GEMM
//     │   per expert per layer, as a dense MLP is one GEMM per layer
//     └─► combine: y[n] = sum over n's kept choices of gate x that row's expert output
//         (a dropped choice adds nothing: the block's residual carries the token)
//
//   the gates: with k >= 2 the chosen probs are renormalised to sum to 1 (Mixtral),
//   and the router still learns from the loss through their ratios. With k = 1 the
//   renormalised gate would be p / p = 1 whatever the router says: no gradient would
//   reach the router from the language-model loss, only from the aux loss. So top-1
//   gates by p itself, as Switch Transformer does, and the router learns which
//   expert serves a token best from how much scaling that expert's output helps.
//
//   load balancing (Switch Transformer eq. 4): aux = E sum_e f_e P_e, with f_e the
//   fraction of the N k token-choices routed to e (before capacity) and P_e the mean
//   router probability of e. It is 1 when both are uniform and grows as the router
//   favours some experts; f_e counts choices, so only P_e carries a gradient.
//
// The order of the rows is the layer's contract with expert parallelism (chapter
// 09): each expert's rows are its tokens in token order (token n = b T + t of the
// forward call), so a rank that owns expert e and receives the rows of every rank
// in rank order sees the same rows in the same order, and keeps and drops the same
// choices, as this single process. Which choices are dropped depends only on the
// choices themselves: an expert appears at most once among a token's k choices, so
// "token order, then choice rank" is simply token order within each expert.
//
// The routing, dispatch and combine are the ops of moe_ops.h (CPU loops, CUDA kernels);
// the GEMMs and GELU go through the library's op table. Forward functions overwrite
// their outputs; backward functions add (+=) into every gradient, as in ops.h.
#pragma once

#include <cstdint>
#include <vector>

#include "common/model/moe_ops.h"
#include "common/tensor/memory.h"
#include "common/tensor/ops.h"

namespace course {

// ceil(factor N k / E), computed in double from the flag's float, at most N (an
// expert cannot get a token twice); factor 0 means no limit (dropless): N.
int moe_capacity(float capacity_factor, int tokens, int experts, int top_k);

// Views of an MoE layer's parameters in a block's stage buffer (the same for gradients).
struct MoeWeights {
  float* router_w = nullptr;         // (E, C)      the router, without bias
  float* expert_fc_w = nullptr;      // (E, 4C, C)  expert e's fc weight is rows [e 4C, (e+1) 4C)
  float* expert_fc_b = nullptr;      // (E, 4C)
  float* expert_fcproj_w = nullptr;  // (E, C, 4C)
  float* expert_fcproj_b = nullptr;  // (E, C)
};

// What an MoE layer's forward saves for backward, carved out of its block's
// activation buffer. The int arrays are int32 in float-sized slots.
struct MoeActivations {
  static size_t floats(const MoeSizes& s);  // N (E + 3k + 10 k C) + 2E + 1
  void carve(Carver& carve, const MoeSizes& s);

  float* probs = nullptr;        // (N, E)      router softmax
  int* expert = nullptr;         // (N, k)      the experts each token chose, most probable first
  float* gate = nullptr;         // (N, k)      their gates: top-1 the prob; top-k probs over the sum of the k chosen
  int* row = nullptr;            // (N, k)      each choice's row in the expert buffers; -1: dropped
  int* expert_begin = nullptr;   // (E + 1)     expert e's rows are [expert_begin[e], expert_begin[e + 1])
  int* routed = nullptr;         // (E)         choices routed to each expert, before capacity
  float* expert_in = nullptr;    // (N k, C)    the rows: each kept choice's token, grouped by expert
  float* hidden = nullptr;       // (N k, 4C)   fc output
  float* hidden_gelu = nullptr;  // (N k, 4C)   after GELU
  float* expert_out = nullptr;   // (N k, C)    fcproj output: each row's expert output, before its gate
  // of the last forward, on the host (the statistics read them)
  float aux_loss = 0.0f;             // E sum_e f_e P_e
  int dropped = 0;                   // choices over capacity
  std::vector<int> routed_counts;    // (E) routed, copied from the device
};

// The gradients flowing through an MoE layer during backward, carved out of the
// backward scratch (reused by every block).
struct MoeScratch {
  static size_t floats(const MoeSizes& s);  // N (10 k C + k + 2E)
  void carve(Carver& carve, const MoeSizes& s);

  float* dexpert_out = nullptr;   // (N k, C)
  float* dhidden_gelu = nullptr;  // (N k, 4C)
  float* dhidden = nullptr;       // (N k, 4C)
  float* dexpert_in = nullptr;    // (N k, C)
  float* dgate = nullptr;         // (N, k)
  float* dprobs = nullptr;        // (N, E)
  float* dlogits = nullptr;       // (N, E)
};

// ----------------------------------------------------------------------------
// the steps the op tables do not hold whole (the routing's own ops are moe_ops.h's)

// probs = softmax(x @ router_w^T), per token
void router_forward(float* probs, const float* x, const float* router_w, const MoeSizes& s, const OpTable& op,
                    const MoeOpTable& moe);
// dlogits = probs * (dprobs - sum_e probs dprobs) (overwritten), then
// dx += dlogits @ router_w, drouter_w += dlogits^T @ x
void router_backward(float* dx, float* drouter_w, float* dlogits, const float* dprobs, const float* probs,
                     const float* x, const float* router_w, const MoeSizes& s, const OpTable& op,
                     const MoeOpTable& moe);

// Expert e over rows [expert_begin[e], expert_begin[e + 1]) (expert_begin on the host:
// it sets how many rows each GEMM takes): expert_out = fcproj_e(gelu(fc_e(expert_in))),
// two GEMMs per expert
void experts_forward(float* expert_out, float* hidden, float* hidden_gelu, const float* expert_in,
                     const MoeWeights& w, const int* expert_begin, const MoeSizes& s, const OpTable& op);
// The same in reverse: dexpert_in += ..., and every expert weight's gradient += ...
void experts_backward(float* dexpert_in, float* dhidden, float* dhidden_gelu, const MoeWeights& g,
                      const float* dexpert_out, const float* expert_in, const float* hidden,
                      const float* hidden_gelu, const MoeWeights& w, const int* expert_begin, const MoeSizes& s,
                      const OpTable& op);

// choices over capacity: sum over the experts of max(routed[e] - capacity, 0)
int dropped_choices(const int* routed, const MoeSizes& s);  // routed: (E) on the host

// ----------------------------------------------------------------------------
// the whole layer

// out = the MoE layer of x (both (N, C)), keeping what backward needs in a
// (a.aux_loss, a.dropped and a.routed_counts: this call's, on the host). Every pointer
// on `device`; the routing's ops are moe_ops_for(device)'s and the GEMMs ops_for(device)'s.
// Each expert's GEMMs need its row count on the host: the routing's counts (2E + 1 ints)
// are copied there once per forward and once per backward, the one wait on the device.
void moe_forward(float* out, const float* x, const MoeWeights& w, MoeActivations& a, const MoeSizes& s,
                 Device device);
// dx += dL/dx and every gradient += into g, given dout = dL/d(out) and
// daux = dL/d(a.aux_loss): the weight of this layer's aux loss in the loss.
void moe_backward(float* dx, const MoeWeights& g, MoeScratch& scratch, const float* dout, float daux, const float* x,
                  const MoeWeights& w, const MoeActivations& a, const MoeSizes& s, Device device);

// ----------------------------------------------------------------------------
// what the routers did over a training step, for the step line and the log

struct RoutingStats {
  // adds one layer's forward
  void add(const MoeActivations& a, const MoeSizes& s);
  void reset() { *this = RoutingStats(); }
  bool empty() const { return layer_forwards == 0; }
  double aux_loss() const;          // mean over the layer forwards added
  double dropped_fraction() const;  // of the choices
  // max over the experts of the choices routed to it, over their mean: per layer
  // forward, then the mean over them (1: perfectly balanced; E: every choice to one expert)
  double imbalance() const;

  int layer_forwards = 0;
  double aux_loss_sum = 0.0;
  double imbalance_sum = 0.0;
  int64_t choices = 0;                  // N k per layer forward
  int64_t dropped = 0;                  // over an expert's capacity
  std::vector<int64_t> expert_choices;  // (E) routed to each expert, before capacity
};

}  // namespace course
