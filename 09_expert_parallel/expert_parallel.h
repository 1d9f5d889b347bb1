// Expert parallelism: a mixture-of-experts layer whose E experts are spread over the
// R ranks of an ep group, E/R each, while everything else is replicated.
//
// Every rank trains on its own rows of the global batch (data parallel, as chapter
// 02) and holds experts [r E/R, (r+1) E/R) of every block, and only those. A token's
// chosen experts mostly live on other ranks, so per block and micro-batch:
//
//   x (N, C) this rank's tokens
//     │ router and top-k on this rank's tokens (moe.h's router_forward, moe_ops.h's route_top_k)
//     │
//     ├─► counts exchange: all_gather of every rank's (routed per expert, router
//     │   prob sum per expert): 2E floats per rank (counts are exact below 2^24),
//     │   then copied to the host, where the all-to-alls' counts are needed
//     │     - the global routed counts: the aux loss's f_e, and P_e from the prob sums
//     │     - capacity = moe_capacity(F, R N, E, k), as one process over all R N tokens
//     │     - kept[s][e]: expert e takes the choices in rank order, then token order,
//     │       so source s keeps min(routed[s][e], what capacity leaves after ranks < s)
//     │       (chapter 00's order, ranks holding consecutive rows of the global batch)
//     │     - the all-to-alls' counts: every rank knows every rank's kept[s][e]
//     │
//     ├─► dispatch: each kept choice's token to its expert's owner. The send rows are
//     │   grouped by expert (so by owner: rank d owns a block of experts), then token
//     │   order (ep_ops.h's assign_send_rows): moe_ops.h's dispatch_forward with those rows
//     │       all_to_all(send, recv)           recv: by source rank, then expert, then token
//     │       expert_in = recv, block by block  by local expert, then source, then token:
//     │                                         each expert's rows contiguous, in chapter 00's order
//     │                                         (one copy per source rank and expert)
//     ├─► experts_forward over the local experts: one GEMM per expert per layer
//     │       back = expert_out, block by block; all_to_all(back, returned)
//     └─► combine: out[n] = sum of gate x returned row (moe_ops.h's combine_forward)
//
//   Backward runs the same path in reverse: combine_backward -> dreturned to the
//   owners (all_to_all) -> experts_backward -> dexpert_in back (all_to_all) ->
//   dispatch_backward into dx -> top-k, aux and router backward on this rank's tokens.
//
// Gradient scaling. Each rank's loss is the mean over its own N tokens (dloss = 1/N
// = R / (R N)), and chapter 02's DDP averages the replicated gradients over the R
// ranks, which makes them chapter 00's. The expert gradients are not all-reduced:
// expert e lives on one rank, and the all-to-all already brought it every rank's rows,
// each scaled by its rank's 1/N = R x chapter 00's 1/(R N). That all-to-all is the
// all-reduce's sum; the average's division by R is left to do:
// average_expert_gradients (after the last backward, before clipping and the optimizer).
// The aux loss is computed from the global f_e and P_e, the same number on every rank,
// and is a term of every rank's loss. Its gradient reaches the router only through the
// probs of this rank's tokens: daux E f_e / (R N) each in chapter 00. DDP's average
// divides by R, so this layer gives each of its tokens daux E f_e / N (as if its tokens
// were the whole batch): after the average, chapter 00's. (The trainer passes
// moe_aux_grad's daux as chapter 00 does, from its own dloss.)
//
// Bytes this rank sends per block and micro-batch (fp32; rows it keeps for itself cost
// nothing), from the kept counts (expert_parallel_bytes):
//   dispatch  4 C x (its kept choices of experts on other ranks)
//   combine   4 C x (other ranks' kept choices of its experts)
// Under --dtype bf16 the rows travel as bf16: 2 C instead of 4 C. (A dispatched row
// loses nothing by it: the expert's first product rounds it to bf16 anyway.)
// Backward sends the same two amounts (dreturned as dispatch, dexpert_in as combine);
// received equals sent summed the other way, and over the ranks the totals match.
//
// Memory per rank: its E/R experts' parameters (and gradients, AdamW moments). The rows
// it may receive are bounded by every choice of every rank coming to its experts:
// M = min(R N k, E/R x capacity) rows, and its buffers are sized for that worst case.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "02_ddp/ddp.h"
#include "09_expert_parallel/ep_ops.h"
#include "common/train/checkpoint_manifest.h"
#include "common/comm/comm.h"
#include "common/tensor/memory.h"
#include "common/train/meters.h"
#include "common/model/model.h"
#include "common/model/moe.h"
#include "common/train/trace.h"

namespace course {

// config with the experts rank `rank` of `ranks` holds: [rank E/R, (rank+1) E/R).
// FlagError (every rank finds it): "--experts 6 is not divisible by --ep 4".
GPTConfig expert_parallel_config(GPTConfig config, int ranks, int rank);

// Bytes this rank sends per block and micro-batch in each all-to-all, from kept:
// (R, E) kept choices of each source rank for each expert (row-major), E/R experts
// per rank. Backward's two are the same (see the header comment).
struct ExpertBytes {
  uint64_t dispatch = 0;  // its choices to other ranks' experts
  uint64_t combine = 0;   // the outputs of its experts for other ranks' choices
  uint64_t forward() const { return dispatch + combine; }
};
// `element`: the bytes of one value on the wire (4, or 2 for bf16 messages)
ExpertBytes expert_parallel_bytes(const std::vector<int>& kept, int ranks, int rank, int channels,
                                  size_t element = sizeof(float));

// What the layer did since construction or reset_counters(), over its forwards and backwards.
struct ExpertCounters {
  std::vector<int64_t> tokens_per_expert;  // (E) choices routed to each expert, all ranks' tokens, before capacity
  int64_t choices = 0;                     // all ranks' tokens x k, per layer forward
  int64_t dropped = 0;                     // of them, over an expert's capacity (all ranks')
  uint64_t formula_bytes = 0;              // what expert_parallel_bytes says this rank sent, forward and backward
  OpStats all_to_all;                      // the Comm's all_to_all counters over the same calls
  double all_to_all_seconds = 0.0;         // wall time in the four all-to-alls (blocking)
  double exchange_seconds = 0.0;           // ... and in the counts exchange (all_gather)
  double expert_seconds = 0.0;             // in experts_forward and experts_backward
};

struct ExpertSaved;    // what forward saves (expert_parallel.cpp)
struct ExpertRouting;  // what the exchanged counts decide

class ExpertParallel : public BlockExperts {
 public:
  // config: the whole model's, with this rank's experts (expert_parallel_config for
  // ep.rank()); B: the most sequences a forward call takes; device: where the buffers
  // live and the ops run. Collective calls over ep.
  // message_type: what the all-to-alls move (bf16: half the bytes, rounded before and
  // widened after)
  ExpertParallel(const GPTConfig& config, Comm& ep, int micro_batch, Device device,
                 DType message_type = DType::F32);

  size_t saved_floats(int B) const override;
  size_t scratch_floats(int B) const override;
  void forward(float* out, float* saved, const float* x, const MoeWeights& w, int B) override;
  void backward(float* dx, const MoeWeights& g, float* scratch, const float* dout, float daux, const float* x,
                const MoeWeights& w, const float* saved, int B) override;

  // Each forward adds the whole batch's routing (all ranks' tokens: chapter 00's
  // numbers) to *routing when given (the step's meters: StepMeters::routing).
  void set_routing(RoutingStats* routing) { routing_ = routing; }
  // A trainer's meters: the routing (as set_routing), and every wait in the counts
  // exchange and the all-to-alls as exposed communication (nothing overlaps them: the
  // layer needs their results at once).
  void set_meters(StepMeters* meters) {
    routing_ = &meters->routing;
    meters_ = meters;
  }
  // --trace: each all-to-all a communication span, each experts' compute a compute span.
  void set_trace(Trace* trace) { trace_ = trace; }
  const ExpertCounters& counters() const { return counters_; }
  void reset_counters();
  // the aux loss and the choices dropped (all ranks') of the last forward
  float last_aux_loss() const { return last_aux_loss_; }
  int last_dropped() const { return last_dropped_; }

  // the most rows this rank's experts may receive in one call of B sequences (M above)
  int max_received_rows(int B) const;

 private:
  ExpertSaved carve_saved(float* saved, int B) const;
  ExpertRouting exchange_counts(const ExpertSaved& s, int B);
  ExpertRouting routing_of(const float* counts, int B) const;  // counts: (R, 2E) on the device
  void dispatch(const ExpertSaved& s, const ExpertRouting& r, const float* x, int B);
  void combine(float* out, const ExpertSaved& s, const ExpertRouting& r, const MoeWeights& w, int B);
  void timed_all_to_all(const std::string& name, const float* in, const std::vector<size_t>& send_counts, float* out,
                        const std::vector<size_t>& recv_counts);

  GPTConfig config_;
  Comm& ep_;
  Device device_;
  const OpTable& ops_;        // the library's ops on device_ (GEMMs, zero, copies)
  const MoeOpTable& moe_;     // the routing's ops (moe_ops.h)
  const EPOpTable& ep_ops_;   // this chapter's (ep_ops.h)
  int max_batch_;
  int ranks_, rank_, local_experts_;
  Buffer send_;        // (N k, C)  dispatch's rows out; backward: dreturned out, then dexpert_in back
  Buffer recv_;        // (M, C)    rows in, by source rank; backward: dreturned in
  Buffer back_;        // (M, C)    expert outputs out, by source rank; backward: dexpert_in out
  Buffer expert_out_;  // (M, C)    the experts' outputs, by expert
  DType message_type_;
  TypedBuffer<bf16> send_message_;  // (max(N k, M), C)  bf16 messages: an all-to-all's input as it goes out
  TypedBuffer<bf16> recv_message_;  // (max(N k, M), C)  bf16 messages: its output as it comes in
  RoutingStats* routing_ = nullptr;
  StepMeters* meters_ = nullptr;
  Trace* trace_ = nullptr;
  ExpertCounters counters_;
  float last_aux_loss_ = 0.0f;
  int last_dropped_ = 0;
};

// [begin, end) of every block's expert parameters in a GPT's flat buffers (each block's
// four expert_* parameters lie together at the end of its stage): what DDP must not
// average (its not_replicated ranges).
std::vector<FlatRange> expert_ranges(const GPT& model);
// The division by R the header comment explains: grads in every expert range /= ranks.
void average_expert_gradients(GPT& model, int ranks);

// The checkpoint manifest's pieces of a rank's stage: every parameter is one
// contiguous piece of chapter 00's (the experts from global_first on), in layout order.
std::vector<ManifestPiece> expert_parallel_pieces(const GPTConfig& config);

}  // namespace course
