#include "09_expert_parallel/expert_parallel.h"

#include <algorithm>
#include <numeric>

#include "common/train/checkpoint_manifest.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/train/meters.h"
#include "common/train/metrics.h"
#include "common/tensor/ops.h"

namespace course {

GPTConfig expert_parallel_config(GPTConfig config, int ranks, int rank) {
  if (config.n_experts % ranks != 0) {
    // --ep is the whole world: the hint changes the ranks, or the experts
    int dividing_ranks = 1;  // the most ranks, up to this many, that E experts can be spread over
    for (int r = 1; r <= std::min(config.n_experts, ranks); r++) {
      if (config.n_experts % r == 0) dividing_ranks = r;
    }
    const int more_experts = (config.n_experts / ranks + 1) * ranks;
    throw FlagError("--experts " + std::to_string(config.n_experts) + " is not divisible by --ep " +
                    std::to_string(ranks) + " (hint: every rank holds the same number of experts: launch with " +
                    "--nproc-per-node " + std::to_string(dividing_ranks) + ", or give --experts " +
                    std::to_string(more_experts) + ")");
  }
  config.expert_count = config.n_experts / ranks;
  config.expert_first = rank * config.expert_count;
  return config;
}

ExpertBytes expert_parallel_bytes(const std::vector<int>& kept, int ranks, int rank, int channels, size_t element) {
  const int E = static_cast<int>(kept.size()) / ranks, local = E / ranks;
  const uint64_t row_bytes = static_cast<uint64_t>(channels) * element;
  ExpertBytes bytes;
  for (int e = 0; e < E; e++) {
    const bool mine = e / local == rank;
    // dispatch: this rank's rows for experts elsewhere; combine: other ranks' rows of its experts, sent back
    if (!mine) bytes.dispatch += row_bytes * kept[static_cast<size_t>(rank) * E + e];
    for (int source = 0; mine && source < ranks; source++) {
      if (source != rank) bytes.combine += row_bytes * kept[static_cast<size_t>(source) * E + e];
    }
  }
  return bytes;
}

// ----------------------------------------------------------------------------
// what forward saves, and what both passes derive from the exchanged counts

struct ExpertSaved {
  float* probs;        // (N, E)      router softmax of this rank's tokens
  int* expert;         // (N, k)      their chosen experts
  float* gate;         // (N, k)
  int* row;            // (N, k)      each choice's row in the send buffer; -1: dropped
  float* counts;       // (R, 2E)     every rank's routed counts, then router prob sums, per expert
  float* returned;     // (N k, C)    the expert outputs of this rank's kept choices, in send order
  float* expert_in;    // (M, C)      rows this rank's experts received, by local expert
  float* hidden;       // (M, 4C)
  float* hidden_gelu;  // (M, 4C)
};

// rows [recv_first, recv_first + rows) of recv are rows [expert_first, ...) of expert_in:
// one source rank's kept choices of one local expert, contiguous on both sides
struct RowBlock {
  int64_t recv_first, expert_first, rows;
};

struct ExpertRouting {
  std::vector<float> counts;           // (R, 2E) the exchanged counts, on the host
  std::vector<int> kept;               // (R, E)  kept choices of each source rank for each expert
  std::vector<int> routed;             // (E)     all ranks' choices of each expert, before capacity
  std::vector<size_t> send_counts;     // (R)     floats to each rank in dispatch
  std::vector<size_t> recv_counts;     // (R)     floats from each rank in dispatch
  std::vector<RowBlock> blocks;        // recv (by source, expert) <-> expert_in (by expert, source)
  int received_rows = 0;               // rows this rank's experts received
  std::vector<int> expert_begin;       // (E/R + 1)  local expert e's rows in expert_in
  int dropped = 0;                     // all ranks' choices over capacity
};

static MoeSizes local_sizes(const GPTConfig& config, int B, int ranks) {
  const int N = B * config.seq_len;
  return {N, config.d_model, config.n_experts, config.top_k,
          moe_capacity(config.capacity_factor, ranks * N, config.n_experts, config.top_k)};
}

ExpertParallel::ExpertParallel(const GPTConfig& config, Comm& ep, int micro_batch, Device device,
                               DType message_type)
    : config_(config),
      ep_(ep),
      device_(device),
      ops_(ops_for(device)),
      moe_(moe_ops_for(device)),
      ep_ops_(ep_ops_for(device)),
      max_batch_(micro_batch),
      ranks_(ep.size()),
      rank_(ep.rank()),
      local_experts_(config.local_experts()),
      send_(static_cast<size_t>(micro_batch) * config.seq_len * config.top_k * config.d_model,
            MemCategory::CommBuffers, device),
      recv_(static_cast<size_t>(max_received_rows(micro_batch)) * config.d_model, MemCategory::CommBuffers, device),
      back_(recv_.size(), MemCategory::CommBuffers, device),
      expert_out_(recv_.size(), MemCategory::Workspace, device),
      message_type_(message_type) {
  if (message_type_ == DType::BF16) {
    const size_t largest = std::max(send_.size(), recv_.size());
    send_message_ = TypedBuffer<bf16>(largest, MemCategory::CommBuffers, device);
    recv_message_ = TypedBuffer<bf16>(largest, MemCategory::CommBuffers, device);
  }
  if (local_experts_ * ranks_ != config.n_experts || config.expert_first != rank_ * local_experts_) {
    throw UsageError("rank " + std::to_string(rank_) + " of " + std::to_string(ranks_) + " holds experts " +
                     std::to_string(config.expert_first) + ".." +
                     std::to_string(config.expert_first + local_experts_ - 1) + " of " +
                     std::to_string(config.n_experts) + " (hint: make its config with expert_parallel_config)");
  }
  reset_counters();
}

int ExpertParallel::max_received_rows(int B) const {
  const MoeSizes s = local_sizes(config_, B, ranks_);
  return std::min(ranks_ * s.rows(), local_experts_ * s.capacity);
}

size_t ExpertParallel::saved_floats(int B) const {
  const size_t N = static_cast<size_t>(B) * config_.seq_len, C = config_.d_model, E = config_.n_experts,
               k = config_.top_k, M = max_received_rows(B);
  return N * (E + 3 * k + k * C) + ranks_ * 2 * E + M * 9 * C;
}

ExpertSaved ExpertParallel::carve_saved(float* saved, int B) const {
  static_assert(sizeof(int) == sizeof(float), "the routing keeps int32 in float-sized slots");
  if (B > max_batch_) {
    throw UsageError("the expert-parallel layer was made for " + std::to_string(max_batch_) +
                     " sequences per call and got " + std::to_string(B));
  }
  const size_t N = static_cast<size_t>(B) * config_.seq_len, C = config_.d_model, E = config_.n_experts,
               k = config_.top_k, M = max_received_rows(B);
  Carver carve(saved);
  ExpertSaved s;
  s.probs = carve.take(N * E);
  s.expert = reinterpret_cast<int*>(carve.take(N * k));
  s.gate = carve.take(N * k);
  s.row = reinterpret_cast<int*>(carve.take(N * k));
  s.counts = carve.take(ranks_ * 2 * E);
  s.returned = carve.take(N * k * C);
  s.expert_in = carve.take(M * C);
  s.hidden = carve.take(M * 4 * C);
  s.hidden_gelu = carve.take(M * 4 * C);
  return s;
}

// dexpert_out, dhidden_gelu, dhidden, dexpert_in (M rows), dgate (N, k), dprobs and dlogits (N, E)
size_t ExpertParallel::scratch_floats(int B) const {
  const size_t N = static_cast<size_t>(B) * config_.seq_len, C = config_.d_model, E = config_.n_experts,
               k = config_.top_k, M = max_received_rows(B);
  return M * 10 * C + N * (k + 2 * E);
}

void ExpertParallel::reset_counters() {
  counters_ = ExpertCounters();
  counters_.tokens_per_expert.assign(config_.n_experts, 0);
}

// ----------------------------------------------------------------------------
// the counts exchange

// Everything the kept counts decide, the same on every rank: capacity in rank order,
// the all-to-alls' counts, and the order of the rows this rank's experts receive.
static void route_from_counts(ExpertRouting& r, const float* counts, int ranks, int rank,
                              const GPTConfig& config, int capacity) {
  const int E = config.n_experts, local = E / ranks, first = rank * local, C = config.d_model;
  r.kept.assign(static_cast<size_t>(ranks) * E, 0);
  r.routed.assign(E, 0);
  for (int e = 0; e < E; e++) {
    // expert e takes rank 0's choices first, then rank 1's, ...: what capacity leaves
    for (int source = 0; source < ranks; source++) {
      const int routed = static_cast<int>(counts[static_cast<size_t>(source) * 2 * E + e]);
      r.kept[static_cast<size_t>(source) * E + e] = std::min(routed, std::max(0, capacity - r.routed[e]));
      r.routed[e] += routed;
    }
    r.dropped += r.routed[e] - std::min(r.routed[e], capacity);
  }
  r.send_counts.assign(ranks, 0);
  r.recv_counts.assign(ranks, 0);
  for (int e = 0; e < E; e++) {
    r.send_counts[e / local] += static_cast<size_t>(C) * r.kept[static_cast<size_t>(rank) * E + e];
  }
  // recv holds source 0's rows (its experts first..first+local-1 in turn), then source 1's, ...
  std::vector<int> source_begin(ranks + 1, 0);
  for (int source = 0; source < ranks; source++) {
    for (int e = first; e < first + local; e++) source_begin[source + 1] += r.kept[static_cast<size_t>(source) * E + e];
    r.recv_counts[source] = static_cast<size_t>(C) * source_begin[source + 1];
    source_begin[source + 1] += source_begin[source];
  }
  // expert_in is by local expert, then source, then token: chapter 00's order of each expert's rows
  r.blocks.clear();
  r.expert_begin.assign(1, 0);
  std::vector<int> next(source_begin.begin(), source_begin.end() - 1);  // each source's next row in recv
  int expert_row = 0;
  for (int e = first; e < first + local; e++) {
    for (int source = 0; source < ranks; source++) {
      const int rows = r.kept[static_cast<size_t>(source) * E + e];
      if (rows > 0) r.blocks.push_back({next[source], expert_row, rows});
      next[source] += rows;
      expert_row += rows;
    }
    r.expert_begin.push_back(expert_row);
  }
  r.received_rows = expert_row;
}

// The counts' routing, for B sequences: counts (R, 2E) copied to the host first
ExpertRouting ExpertParallel::routing_of(const float* counts, int B) const {
  ExpertRouting r;
  r.counts.resize(static_cast<size_t>(ranks_) * 2 * config_.n_experts);
  copy_bytes(r.counts.data(), Device::CPU, counts, device_, r.counts.size() * sizeof(float));
  route_from_counts(r, r.counts.data(), ranks_, rank_, config_, local_sizes(config_, B, ranks_).capacity);
  return r;
}

// expert_in[block's expert rows] = recv[its recv rows] (to_experts), or the reverse
static void move_blocks(float* expert_rows, float* recv_rows, const std::vector<RowBlock>& blocks, int64_t C,
                        bool to_experts, const OpTable& op) {
  for (const RowBlock& b : blocks) {
    float* experts_side = expert_rows + b.expert_first * C;
    float* recv_side = recv_rows + b.recv_first * C;
    if (to_experts) {
      op.copy_strided(experts_side, C, recv_side, C, b.rows, C);
    } else {
      op.copy_strided(recv_side, C, experts_side, C, b.rows, C);
    }
  }
}

ExpertRouting ExpertParallel::exchange_counts(const ExpertSaved& s, int B) {
  const MoeSizes local = local_sizes(config_, B, ranks_);
  const int E = local.experts;
  // this rank's (routed, prob sum) per expert into its own row, then every rank's (in place)
  float* mine = s.counts + static_cast<size_t>(rank_) * 2 * E;
  ep_ops_.routing_counts(mine, s.expert, s.probs, local);
  const double start = now_seconds();
  ep_.all_gather(mine, s.counts, 2 * E);
  counters_.exchange_seconds += now_seconds() - start;
  if (meters_) meters_->record_exposed(now_seconds() - start);
  trace_communication(trace_, "expert counts all_gather", start, now_seconds());
  return routing_of(s.counts, B);
}

// aux = E sum_e f_e P_e over all ranks' tokens: f_e = routed_e / (R N k), P_e = sum of prob sums / (R N)
static float global_aux_loss(const float* counts, const std::vector<int>& routed, int ranks, const MoeSizes& local) {
  const int E = local.experts;
  const double tokens = static_cast<double>(ranks) * local.tokens;
  double aux = 0.0;
  for (int e = 0; e < E; e++) {
    double prob_sum = 0.0;
    for (int source = 0; source < ranks; source++) prob_sum += counts[static_cast<size_t>(source) * 2 * E + E + e];
    aux += (routed[e] / (tokens * local.top_k)) * (prob_sum / tokens);
  }
  return static_cast<float>(E * aux);
}

// ----------------------------------------------------------------------------
// forward

void ExpertParallel::timed_all_to_all(const std::string& name, const float* in, const std::vector<size_t>& send_counts,
                                      float* out, const std::vector<size_t>& recv_counts) {
  const OpStats before = op_stats(ep_, "all_to_all");
  const double start = now_seconds();
  if (message_type_ == DType::F32) {
    ep_.all_to_all(in, send_counts, out, recv_counts);
  } else {
    // m = bf16(x): half the bytes, widened once they have arrived
    const int64_t sent = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
    const int64_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
    ops_.cast_to_bf16(send_message_.data(), in, sent);
    ep_.all_to_all(send_message_.data(), send_counts, recv_message_.data(), recv_counts);
    ops_.cast_to_fp32(out, recv_message_.data(), received);
  }
  counters_.all_to_all_seconds += now_seconds() - start;
  if (meters_) meters_->record_exposed(now_seconds() - start);
  trace_communication(trace_, name, start, now_seconds());
  counters_.all_to_all += op_stats(ep_, "all_to_all") - before;
}

void ExpertParallel::dispatch(const ExpertSaved& s, const ExpertRouting& r, const float* x, int B) {
  const MoeSizes local = local_sizes(config_, B, ranks_);
  // send[row[n, j]] = x[n] for every kept choice; to the owners; then expert_in by local expert
  moe_.dispatch_forward(send_.data(), x, s.row, local);
  timed_all_to_all("dispatch all_to_all", send_.data(), r.send_counts, recv_.data(), r.recv_counts);
  move_blocks(s.expert_in, recv_.data(), r.blocks, config_.d_model, /*to_experts=*/true, ops_);
}

void ExpertParallel::combine(float* out, const ExpertSaved& s, const ExpertRouting& r, const MoeWeights& w, int B) {
  const MoeSizes local = local_sizes(config_, B, ranks_);
  const MoeSizes owner{0, config_.d_model, local_experts_, config_.top_k, local.capacity};
  const double start = now_seconds();
  experts_forward(expert_out_.data(), s.hidden, s.hidden_gelu, s.expert_in, w, r.expert_begin.data(), owner, ops_);
  counters_.expert_seconds += now_seconds() - start;
  trace_compute(trace_, "experts forward", start);
  // back by source again; to the sources; out = sum of gate x returned row
  move_blocks(expert_out_.data(), back_.data(), r.blocks, config_.d_model, /*to_experts=*/false, ops_);
  timed_all_to_all("combine all_to_all", back_.data(), r.recv_counts, s.returned, r.send_counts);
  moe_.combine_forward(out, s.returned, s.gate, s.row, local);
}

void ExpertParallel::forward(float* out, float* saved, const float* x, const MoeWeights& w, int B) {
  const MoeSizes local = local_sizes(config_, B, ranks_);
  const ExpertSaved s = carve_saved(saved, B);
  router_forward(s.probs, x, w.router_w, local, ops_, moe_);
  moe_.route_top_k(s.expert, s.gate, s.probs, local);
  const ExpertRouting r = exchange_counts(s, B);
  ep_ops_.assign_send_rows(s.row, s.expert, s.counts, rank_, local);
  last_aux_loss_ = global_aux_loss(r.counts.data(), r.routed, ranks_, local);
  last_dropped_ = r.dropped;
  dispatch(s, r, x, B);
  combine(out, s, r, w, B);

  const int64_t choices = static_cast<int64_t>(ranks_) * local.rows();
  for (int e = 0; e < local.experts; e++) counters_.tokens_per_expert[e] += r.routed[e];
  counters_.choices += choices;
  counters_.dropped += r.dropped;
  counters_.formula_bytes +=
      expert_parallel_bytes(r.kept, ranks_, rank_, config_.d_model, dtype_bytes(message_type_)).forward();
  if (routing_) {
    // the whole batch's routing, as chapter 00's one process sees it
    MoeActivations whole;
    whole.routed_counts = r.routed;
    whole.aux_loss = last_aux_loss_;
    whole.dropped = r.dropped;
    routing_->add(whole, {ranks_ * local.tokens, local.channels, local.experts, local.top_k, local.capacity});
  }
}

// ----------------------------------------------------------------------------
// backward

void ExpertParallel::backward(float* dx, const MoeWeights& g, float* scratch, const float* dout, float daux,
                              const float* x, const MoeWeights& w, const float* saved, int B) {
  const MoeSizes local = local_sizes(config_, B, ranks_);
  const MoeSizes owner{0, config_.d_model, local_experts_, config_.top_k, local.capacity};
  const ExpertSaved s = carve_saved(const_cast<float*>(saved), B);
  const ExpertRouting r = routing_of(s.counts, B);
  const int64_t C = config_.d_model, N = local.tokens, E = local.experts, k = local.top_k,
                M = max_received_rows(B), rows = r.received_rows;
  Carver carve(scratch);
  float* dexpert_out = carve.take(M * C);   // (M, C)   by local expert
  float* dhidden_gelu = carve.take(M * 4 * C);
  float* dhidden = carve.take(M * 4 * C);
  float* dexpert_in = carve.take(M * C);    // (M, C)
  float* dgate = carve.take(N * k);         // (N, k)
  float* dprobs = carve.take(N * E);        // (N, E)
  float* dlogits = carve.take(N * E);       // (N, E)
  ops_.zero(send_.data(), N * k * C);
  ops_.zero(dhidden_gelu, rows * 4 * C);
  ops_.zero(dhidden, rows * 4 * C);
  ops_.zero(dexpert_in, rows * C);
  ops_.zero(dgate, N * k);
  ops_.zero(dprobs, N * E);

  // combine in reverse: dreturned (in send_) and dgate; dreturned to the owners, by local expert
  moe_.combine_backward(send_.data(), dgate, dout, s.returned, s.gate, s.row, local);
  timed_all_to_all("combine backward all_to_all", send_.data(), r.send_counts, recv_.data(), r.recv_counts);
  move_blocks(dexpert_out, recv_.data(), r.blocks, C, /*to_experts=*/true, ops_);
  const double start = now_seconds();
  experts_backward(dexpert_in, dhidden, dhidden_gelu, g, dexpert_out, s.expert_in, s.hidden, s.hidden_gelu, w,
                   r.expert_begin.data(), owner, ops_);
  counters_.expert_seconds += now_seconds() - start;
  trace_compute(trace_, "experts backward", start);
  // dexpert_in back to the sources (by source again), then into dx at each kept choice's token
  move_blocks(dexpert_in, back_.data(), r.blocks, C, /*to_experts=*/false, ops_);
  timed_all_to_all("dispatch backward all_to_all", back_.data(), r.recv_counts, send_.data(), r.send_counts);
  moe_.dispatch_backward(dx, send_.data(), s.row, local);
  counters_.formula_bytes +=
      expert_parallel_bytes(r.kept, ranks_, rank_, config_.d_model, dtype_bytes(message_type_)).forward();

  // the router: through the gates, and through the aux loss with this rank's tokens as
  // the whole batch, dprobs[n, e] += daux E f_e / N (DDP's average makes it chapter 00's)
  moe_.route_top_k_backward(dprobs, dgate, s.expert, s.gate, s.probs, local);
  ep_ops_.aux_loss_backward(dprobs, s.counts, daux, ranks_, local);
  router_backward(dx, g.router_w, dlogits, dprobs, s.probs, x, w.router_w, local, ops_, moe_);
}

// ----------------------------------------------------------------------------
// the model's expert parameters

std::vector<FlatRange> expert_ranges(const GPT& model) {
  std::vector<FlatRange> ranges;
  if (model.config().n_experts == 0) return ranges;
  for (int layer = 0; layer < model.config().n_layer; layer++) {
    const StageLayout& stage = model.layout()[1 + layer];
    // the four expert_* parameters end the stage (block_layout)
    const ParamSpec& first = stage.params[stage.params.size() - 4];
    ranges.push_back({model.stage_offset(1 + layer) + first.offset, model.stage_offset(1 + layer) + stage.numel});
  }
  return ranges;
}

void average_expert_gradients(GPT& model, int ranks) {
  const float scale = 1.0f / static_cast<float>(ranks);
  const OpTable& op = ops_for(model.device());
  for (const FlatRange& range : expert_ranges(model)) {
    // grads /= R: the all-to-all summed every rank's rows, each weighed by its own 1/N
    op.scale(model.grads.data() + range.begin, static_cast<int64_t>(range.end - range.begin), scale);
  }
}

std::vector<ManifestPiece> expert_parallel_pieces(const GPTConfig& config) {
  std::vector<ManifestPiece> pieces;
  for (const StageLayout& stage : model_layout(config)) {
    for (const ParamSpec& spec : stage.params) {
      ManifestPiece piece;
      piece.param = spec.name;
      piece.first = spec.global_first;
      piece.count = spec.numel;
      pieces.push_back(piece);
    }
  }
  return pieces;
}

}  // namespace course
