#include "planner/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "02_ddp/ddp.h"
#include "03_fsdp/zero.h"
#include "04_naive_model_parallel/model_split.h"
#include "05_pipeline/pipeline.h"
#include "06_tensor_parallel/tensor_parallel.h"
#include "06_tensor_parallel/tp_model.h"
#include "08_context_parallel/context_parallel.h"
#include "08_context_parallel/ring_attention.h"
#include "08_context_parallel/ulysses_attention.h"
#include "common/comm/ring_volume.h"
#include "common/tensor/error.h"
#include "common/train/metrics.h"

namespace course {

const char* cp_mode_name(CPMode mode) { return mode == CPMode::AllToAll ? "a2a" : "ring"; }

const char* precision_name(Precision precision) {
  return precision == Precision::FP32 ? "fp32" : precision == Precision::BF16 ? "bf16" : "bf16-stored";
}

Precision parse_precision(const std::string& name) {
  for (const Precision p : {Precision::FP32, Precision::BF16, Precision::BF16Stored}) {
    if (name == precision_name(p)) return p;
  }
  throw FlagError("--precision must be one of fp32|bf16|bf16-stored, got '" + name + "'");
}

std::string describe(const Layout& layout) {
  std::string text = std::to_string(layout.dp) + "x" + std::to_string(layout.pp) + "x" + std::to_string(layout.tp);
  if (layout.zero_stage > 0) {
    text += " z" + std::to_string(layout.zero_stage) + (layout.reshard_after_forward ? "r" : "");
  }
  // 1f1b is the default and goes unsaid
  if (layout.pp > 1 && layout.schedule == ScheduleKind::Interleaved) text += " i" + std::to_string(layout.chunks);
  if (layout.pp > 1 && layout.schedule != ScheduleKind::Interleaved && layout.schedule != ScheduleKind::OneFOneB) {
    text += std::string(" ") + schedule_name(layout.schedule);
  }
  if (layout.sequence_parallel) text += " sp";
  if (layout.cp > 1) {
    text += " cp" + std::to_string(layout.cp);
    if (layout.cp_mode == CPMode::AllToAll) text += " a2a";
    if (layout.cp_split == SplitKind::Contiguous) text += " contiguous";
  }
  return text;
}

// chapter 08's own checks, through its flags: dp only, the world dp x cp, the split
// dividing the sequence, a2a's heads
static void check_cp_layout(const PlanJob& job, const Layout& layout) {
  if (layout.pp > 1 || layout.tp > 1 || layout.zero_stage != 0 || layout.sequence_parallel) {
    throw FlagError("--cp " + std::to_string(layout.cp) + " at " + describe(layout) +
                    ": cp > 1 runs in chapter 08, with dp only (hint: pp 1, tp 1, no ZeRO, no SP)");
  }
  if (job.recompute != Recompute::None) {
    throw FlagError("--cp " + std::to_string(layout.cp) + " with --recompute " + recompute_name(job.recompute) +
                    ": chapter 08 recomputes nothing (hint: --recompute none)");
  }
  CPFlags flags;
  flags.dp = layout.dp;
  flags.cp = layout.cp;
  flags.split = split_kind_name(layout.cp_split);
  flags.mode = cp_mode_name(layout.cp_mode);
  resolve_cp_flags(flags, job.model, layout.dp * layout.cp);
}

void check_layout(const PlanJob& job, const Layout& layout) {
  if (layout.zero_stage < 0 || layout.zero_stage > 3) {
    throw FlagError("--zero-stage " + std::to_string(layout.zero_stage) + ": chapter 07 runs ZeRO stage 0 to 3");
  }
  if (layout.reshard_after_forward && layout.zero_stage != 3) {
    throw FlagError("--reshard-after-forward at --zero-stage " + std::to_string(layout.zero_stage) +
                    ": only ZeRO-3 gathers parameters (hint: add --zero-stage 3)");
  }
  if (layout.cp < 1) throw FlagError("--cp " + std::to_string(layout.cp) + ": at least 1 rank per sequence");
  if (layout.cp > 1) check_cp_layout(job, layout);
  ProcessGrid(layout.dp * layout.pp * layout.tp, layout.dp, layout.pp, layout.tp);  // every degree at least 1
  check_tp_shape(job.model, layout.tp, layout.sequence_parallel);
  check_interleaved_cut(layout.schedule, job.model.n_layer, layout.pp, layout.chunks);
  check_recompute_schedule(layout.schedule, job.recompute);
  if (job.global_batch % (layout.dp * job.micro_batches) != 0) {
    throw FlagError("--batch " + std::to_string(job.global_batch) + " does not divide into dp " +
                    std::to_string(layout.dp) + " x " + std::to_string(job.micro_batches) +
                    " micro-batches (hint: --batch a multiple of " + std::to_string(layout.dp * job.micro_batches) +
                    ", or fewer --micro-batches)");
  }
}

// ----------------------------------------------------------------------------
// one rank

double RankPlan::memory() const {
  return parameters + gradients + optimizer_state + activations + workspace + comm_buffers;
}

namespace {

// every rank's StepLoss (common/model/step_loss.h): the step's loss, one fp32 float on the device
constexpr double kStepLossBytes = sizeof(float);

// What a value takes, by precision (planner.h)
struct Bytes {
  double stored;     // a weight, gradient or activation as kept
  double optimizer;  // AdamW's state of a parameter (bf16-stored: with the fp32 master weight)
  double message;    // a value sent: an activation (tp, pp, cp) or a gathered parameter (ZeRO)
  double master;     // ZeRO-1/2's fp32 copy of a shard's values, beside its replica's bf16 ones
  // a message's bf16 copy beside its values as stored (bf16: the course rounds into one to send)
  double message_copy() const { return message < stored ? message : 0.0; }
};
Bytes bytes_of(Precision precision) {
  switch (precision) {
    case Precision::FP32: return {4, 8, 4, 0};
    case Precision::BF16: return {4, 8, 2, 4};
    case Precision::BF16Stored: return {2, 12, 2, 0};
  }
  throw CourseError("unknown precision");
}

// The job's model as a rank stores it: this trainer at bf16 keeps its linear layers'
// saved inputs in bf16 (model.h's LinearInput), half the floats of fp32's; bf16-stored
// counts every value at 2 bytes already (Bytes::stored), its floats as fp32's
GPTConfig stored_model(const PlanJob& job) {
  GPTConfig config = job.model;
  config.linear_inputs = job.precision == Precision::BF16 ? DType::BF16 : DType::F32;
  return config;
}

// What a gradient takes on the dp axis: --grad-comm-dtype's bf16, or the gradients as stored
double sent_gradient_bytes(const PlanJob& job) {
  return job.grad_comm_dtype == DType::BF16 ? dtype_bytes(DType::BF16) : bytes_of(job.precision).stored;
}

// chapter 02's buckets of `numel` gradients over `ranks` replicas: one all-reduce each
double ddp_bytes(uint64_t numel, double bucket_mb, int ranks, double weight_bytes) {
  double sent = 0.0;
  for (const GradBucket& bucket : cut_buckets(numel, bucket_mb)) {
    const auto bucket_bytes = static_cast<uint64_t>((bucket.end - bucket.begin) * weight_bytes);
    sent += static_cast<double>(ring_all_reduce_bytes(bucket_bytes, ranks));
  }
  return sent;
}

// What ZeRO-2/3 lend one chunk (07_3d/parallel_3d.h, ShardedChunk), in floats, and
// what gathering its stages costs this rank.
struct LentChunk {
  uint64_t numel = 0;                // P: the chunk's floats, its whole gradients
  std::vector<size_t> shard_counts;  // [dp rank]: how many of them each shard holds
  std::vector<double> stages;        // [stage of the chunk]: its gathered parameters (ZeRO-3)
  std::vector<double> gather_bytes;  // [stage of the chunk]: this rank's bytes to gather them
};

// The chunk of stages `range` on dp rank `dp_rank` of `dp`, its slices over tp ranks
LentChunk lent_chunk(const GPTConfig& config, StageRange range, int tp, int dp, int dp_rank, double weight) {
  const TPLayout slices = tp_layout(config, range.first, range.last, tp);
  const ShardLayout shards = shard_layout(slices.numel, dp);
  LentChunk lent{slices.numel, shards.count, {}, {}};
  for (const TPStageSpan& span : tp_stage_spans(tp_stage_layouts(config, range.first, range.last, tp))) {
    // ShardedChunk's two all-gathers of the stage: its split run and its replicated one
    const uint64_t sent = ring_gather_bytes(shard_counts_in(shards, span.split_begin, span.split_end), dp_rank) +
                          ring_gather_bytes(shard_counts_in(shards, span.replicated_begin, span.replicated_end), dp_rank);
    lent.stages.push_back(static_cast<double>(span.numel()));
    lent.gather_bytes.push_back(static_cast<double>(sent) / sizeof(float) * weight);
  }
  return lent;
}

// The chunk's stages (indices into LentChunk::stages) whose parameters action `type`
// reads, in its order: a forward all in order, a backward and zero bubble's input half
// all in reverse, its weight half none (dW = dy^T x from what the input half kept).
std::vector<size_t> stages_computed(ActionType type, const LentChunk& chunk) {
  std::vector<size_t> order;
  if (type == ActionType::BackwardWeight) return order;
  for (size_t s = 0; s < chunk.stages.size(); s++) order.push_back(s);
  if (type != ActionType::Forward) std::reverse(order.begin(), order.end());
  return order;
}

// ZeRO-2/3's lent buffers on rank `pp`, played along its action list: chunk c's
// whole gradients from its first backward to the step's end; at stage 3 each of its
// stages' parameters from before the stage first computes to the chunk's last
// action (reshard_after_forward: only while that stage computes), and while a stage
// computes, the next one's, prefetched (stages_computed's order). The most floats
// held at once.
double peak_lent_floats(const Schedule& schedule, int pp, const std::vector<LentChunk>& chunks, int zero_stage,
                        bool reshard_after_forward, DType grad_comm_dtype) {
  const std::vector<Action>& actions = schedule.actions[pp];
  std::vector<size_t> last(chunks.size(), 0);  // [chunk]: its last compute action
  for (size_t i = 0; i < actions.size(); i++) {
    if (is_compute(actions[i].type)) last[actions[i].chunk] = i;
  }
  std::vector<std::vector<bool>> gathered(chunks.size());  // [chunk][stage]
  for (size_t c = 0; c < chunks.size(); c++) gathered[c].assign(chunks[c].stages.size(), false);
  std::vector<bool> lent_grads(chunks.size(), false);
  double held = 0.0, peak = 0.0;
  for (size_t i = 0; i < actions.size(); i++) {
    const Action& a = actions[i];
    if (!is_compute(a.type)) continue;
    const LentChunk& chunk = chunks[a.chunk];
    if (is_backward(a.type) && !lent_grads[a.chunk]) {
      lent_grads[a.chunk] = true;
      held += static_cast<double>(chunk.numel);
    }
    peak = std::max(peak, held);
    if (zero_stage == 3) {
      const std::vector<size_t> order = stages_computed(a.type, chunk);
      const auto gather = [&](size_t s) {
        if (!gathered[a.chunk][s]) held += chunk.stages[s];
        gathered[a.chunk][s] = true;
      };
      for (size_t k = 0; k < order.size(); k++) {
        gather(order[k]);
        if (k + 1 < order.size()) gather(order[k + 1]);
        peak = std::max(peak, held);
        if (reshard_after_forward) {
          gathered[a.chunk][order[k]] = false;
          held -= chunk.stages[order[k]];
        }
      }
    }
    if (i != last[a.chunk]) continue;
    for (size_t s = 0; s < chunk.stages.size(); s++) {
      if (gathered[a.chunk][s]) held -= chunk.stages[s];
      gathered[a.chunk][s] = false;
    }
    // its reduction starts: with bf16 gradients, their copy (a bf16 is half a float)
    if (grad_comm_dtype == DType::BF16) held += static_cast<double>(chunk.numel) / 2;
    peak = std::max(peak, held);
  }
  return peak;
}

// dp: chapter 02's buckets (one all-reduce each), or the distributed optimizer's
// reduce-scatter of the gradients and all-gather of the parameters (1x DDP); at ZeRO-3
// the all-gathers of each stage of the chunk before it first computes, or before each
// of its forwards and backwards. Added to plan's dp_bytes (and dp_gather_bytes).
void add_dp_bytes(const PlanJob& job, const Layout& layout, const Schedule& schedule, int pp, int chunk,
                  const LentChunk& lent, int dp_rank, RankPlan& plan) {
  const Bytes bytes = bytes_of(job.precision);
  const double grad_weight = sent_gradient_bytes(job);
  if (layout.zero_stage == 0) {
    plan.dp_bytes += ddp_bytes(lent.numel, job.bucket_mb, layout.dp, grad_weight);
    return;
  }
  // the ring's bytes for the shards as cut (the last may be shorter): floats, then as the parameters travel
  const auto in_precision = [&](uint64_t float_bytes) { return static_cast<double>(float_bytes) / 4 * bytes.message; };
  const double reduce_scatter =
      static_cast<double>(ring_reduce_scatter_bytes(lent.shard_counts, dp_rank)) / 4 * grad_weight;
  if (layout.zero_stage < 3) {  // and the all-gather after the step
    plan.dp_bytes += reduce_scatter + in_precision(ring_gather_bytes(lent.shard_counts, dp_rank));
    return;
  }
  double gathers = 0;
  if (!layout.reshard_after_forward) {
    for (double stage : lent.gather_bytes) gathers += stage;
  } else {
    for (const Action& a : schedule.actions[pp]) {
      if (!is_compute(a.type) || a.chunk != chunk) continue;
      for (size_t s : stages_computed(a.type, lent)) gathers += lent.gather_bytes[s];
    }
  }
  plan.dp_bytes += reduce_scatter + gathers;
  plan.dp_gather_bytes += gathers;
}

// plan_rank with the schedule and the cut made once per layout
RankPlan plan_rank(const PlanJob& job, const Layout& layout, GridCoords me, const Schedule& schedule,
                   const std::vector<StageRange>& cut) {
  const GPTConfig config = stored_model(job);
  const Bytes bytes = bytes_of(job.precision);
  const int N = layout.tp, M = job.micro_batches, b = job.global_batch / layout.dp / M;
  const double T = config.seq_len, C = config.d_model, Tl = layout.sequence_parallel ? T / N : T;
  const double whole_floats = b * T * C, boundary_floats = b * Tl * C;
  const uint64_t whole = static_cast<uint64_t>(whole_floats * bytes.message);  // one (b, T, C) message
  const uint64_t boundary = static_cast<uint64_t>(boundary_floats * bytes.message);  // what crosses a stage boundary
  const double copied = bytes.message_copy();
  RankPlan plan;
  std::vector<LentChunk> lent_chunks;  // [chunk]: what ZeRO-2/3 lend it
  for (int c = 0; c < schedule.chunks; c++) {
    const int stage = schedule.stage(me.pp, c);
    const StageRange range = cut[stage];
    const bool embedding = range.first == 0, head = range.last == config.n_layer + 1;
    const int blocks = range.last - range.first + 1 - (embedding ? 1 : 0) - (head ? 1 : 0);
    const TPLayout slices = tp_layout(config, range.first, range.last, N);
    const double P = static_cast<double>(slices.numel);

    // memory: chapter 06's slices, chapter 03's shards, chapter 05's live micro-batches
    const double shard = static_cast<double>(shard_layout(slices.numel, layout.dp).count[me.dp]);
    const LentChunk lent = lent_chunk(config, range, N, layout.dp, me.dp, bytes.message);
    lent_chunks.push_back(lent);
    plan.parameters += (layout.zero_stage == 3 ? shard : P) * bytes.stored;
    plan.gradients += (layout.zero_stage >= 2 ? shard : P) * bytes.stored;
    plan.optimizer_state += (layout.zero_stage >= 1 ? shard : P) * bytes.optimizer;
    if (layout.zero_stage == 1 || layout.zero_stage == 2) plan.optimizer_state += shard * bytes.master;
    const double slot = static_cast<double>(
        TPActivations::floats(config, b, N, layout.sequence_parallel, range.first, range.last,
                              /*split_backward=*/layout.schedule == ScheduleKind::ZeroBubbleH1, job.recompute));
    plan.activations += peak_live_slots(schedule, me.pp, c) * slot * bytes.stored;

    // tp: chapter 06's f and g per micro-batch (the README's counts; full
    // recomputation repeats a block's forward ones: 4 with SP, 2 without), the
    // cross-entropy's max and sums, and with SP the replicated gradients once a step (as
    // stored: --grad-comm-dtype is the dp axis's)
    const int repeated = job.recompute == Recompute::Full ? 1 : 0;
    if (layout.sequence_parallel) {
      const int gathers = (embedding ? 2 : 0) + (10 + 4 * repeated) * blocks + (head ? 3 : 0);
      plan.tp_bytes += static_cast<double>(M) * gathers * static_cast<double>(ring_gather_bytes(whole, N));
      const uint64_t replicated = slices.numel - slices.replicated_offset;
      plan.tp_bytes += static_cast<double>(ring_all_reduce_bytes(replicated * bytes.stored, N));
    } else {
      const int all_reduces = (embedding ? 1 : 0) + (4 + 2 * repeated) * blocks + (head ? 1 : 0);
      plan.tp_bytes += static_cast<double>(M) * all_reduces * static_cast<double>(ring_all_reduce_bytes(whole, N));
    }
    if (head) {
      const uint64_t rows = static_cast<uint64_t>(b * T) * 4;  // one float per position: max, then (sum, target)
      plan.tp_bytes += static_cast<double>(M) * static_cast<double>(ring_all_reduce_bytes(rows, N) +
                                                                     ring_all_reduce_bytes(2 * rows, N));
    }

    // pp: every micro-batch's boundary, forward to the next stage and back to the previous
    const bool has_next = stage < schedule.stages() - 1, has_prev = stage > 0;
    plan.pp_bytes += static_cast<double>(M) * boundary * ((has_next ? 1 : 0) + (has_prev ? 1 : 0));
    // an upper bound: gradients sent back stay in flight until the step ends
    // (pipeline.h), M of them; received ones live until their backward, at most M;
    // with bf16 messages each beside its bf16 copy, and the copy a receive brings
    const int directions = (has_next ? 1 : 0) + (has_prev ? 1 : 0);
    plan.comm_buffers += static_cast<double>(M) * boundary_floats * (bytes.stored + copied) * directions;
    if (directions > 0) plan.comm_buffers += boundary_floats * copied;

    add_dp_bytes(job, layout, schedule, me.pp, c, lent, me.dp, plan);
    // DDP's and ZeRO-1's bf16 copy of the gradients, kept (ZeRO-2/3 lend theirs: below)
    if (job.grad_comm_dtype == DType::BF16 && layout.zero_stage < 2) plan.comm_buffers += P * dtype_bytes(DType::BF16);
    // an upper bound: ZeRO's parameters gathered through a bf16 copy (03's ReplicatedParams,
    // GatheredStage), at most the whole chunk's
    if (layout.zero_stage >= 1) plan.comm_buffers += P * copied;
  }
  if (layout.zero_stage >= 2) {
    plan.lent = peak_lent_floats(schedule, me.pp, lent_chunks, layout.zero_stage, layout.reshard_after_forward,
                                 job.grad_comm_dtype) *
                bytes.stored;
    plan.comm_buffers += plan.lent;
  }
  // the rank's one recomputation buffer (TPWorkspace::recomputed), which every chunk shares
  plan.activations +=
      static_cast<double>(TPRecomputed::floats(config, b, N, layout.sequence_parallel, job.recompute)) * bytes.stored;
  plan.comm_buffers += 3.0 * b * T * 4;  // the cross-entropy's rows (TPWorkspace::reduce)
  // TPGroup's two staging buffers (an all-gather's output, a reduce-scatter's input);
  // bf16 messages: the all-reduce's (or reduce-scatter's) copy, and with SP the
  // scattered, chunk and gathered ones (06's tensor_parallel.h), at any tp, 1 included
  if (layout.sequence_parallel) plan.comm_buffers += 2.0 * whole_floats * bytes.stored;
  plan.comm_buffers += whole_floats * (layout.sequence_parallel ? 2.0 + 2.0 / N : 1.0) * copied;
  // (at bf16 the course's run holds more: its GEMMs' rounding copies, the largest A and B
  // operand's, 4 or 2 bytes a value as the CPU has bf16 instructions or not; not counted)
  plan.workspace =
      static_cast<double>(TPWorkspace::floats(config, b, N, layout.sequence_parallel)) * bytes.stored + kStepLossBytes;
  return plan;
}

// A rank of chapter 08 (every rank alike): chapter 00's model on its Tl = T/N tokens
// of every sequence, whose attention saves what the cp mode saves instead of the
// (b, NH, Tl, Tl) probabilities; the parameters replicated, DDP over all dp x cp ranks.
RankPlan plan_cp_rank(const PlanJob& job, const Layout& layout) {
  const GPTConfig config = stored_model(job);
  const Bytes bytes = bytes_of(job.precision);
  const int N = layout.cp, M = job.micro_batches, b = job.global_batch / layout.dp / M;
  const SequenceSplit split(config.seq_len, N, layout.cp_split);
  GPTConfig local = config;  // what a rank's per-token buffers hold: Tl tokens of each sequence
  local.seq_len = split.local_len();
  const double Tl = local.seq_len, C = config.d_model, NH = config.n_head;
  const bool ring = layout.cp_mode == CPMode::Ring;
  const ContextAttentionFloats attention =
      ring ? ring_attention_floats(config, split, b) : ulysses_attention_floats(config, split, b);
  RankPlan plan;
  const uint64_t P = count_parameters(config);
  plan.parameters = static_cast<double>(P) * bytes.stored;
  plan.gradients = static_cast<double>(P) * bytes.stored;
  plan.optimizer_state = static_cast<double>(P) * bytes.optimizer;

  // one micro-batch at a time: the embedding's output, the blocks, the head (the
  // attention's own saved tensors instead of the (b, NH, Tl, Tl) probabilities)
  const double saved = static_cast<double>(attention.saved);
  const double block = static_cast<double>(BlockActivations::floats(local, b)) - b * NH * Tl * Tl + saved;
  plan.activations =
      (b * Tl * C + config.n_layer * block + static_cast<double>(HeadActivations::floats(local, b))) * bytes.stored;
  // the model's backward scratch (no (T, T) scores: the attention brings its own) and
  // residual gradient (2 b Tl C), and the attention's own
  const double scratch = static_cast<double>(BackwardScratch::floats(local, b, /*with_scores=*/false));
  plan.workspace = (scratch + 2 * b * Tl * C + attention.workspace) * bytes.stored + kStepLossBytes;
  // at bf16 each of the attention's buffers has its bf16 copy beside it
  plan.comm_buffers = static_cast<double>(attention.comm_buffers) * (bytes.stored + bytes.message_copy());

  // cp: the attention's formula (in fp32 bytes) per layer and micro-batch
  double per_layer = 0.0;
  if (ring) {
    const AttentionBytes sent = ring_attention_bytes(b, split.local_len(), config.d_model, N);
    per_layer = static_cast<double>(sent.forward + sent.backward);
  } else {
    const AttentionBytes sent = ulysses_attention_bytes(b, config.seq_len, config.d_model, N);
    per_layer = static_cast<double>(sent.forward + sent.backward);
  }
  plan.cp_bytes = per_layer * config.n_layer * M * bytes.message / 4.0;
  plan.dp_bytes = ddp_bytes(P, job.bucket_mb, layout.dp * N, sent_gradient_bytes(job));
  // DDP's bf16 copy of the gradients, kept
  if (job.grad_comm_dtype == DType::BF16) plan.comm_buffers += static_cast<double>(P) * dtype_bytes(DType::BF16);
  return plan;
}

}  // namespace

RankPlan plan_rank(const PlanJob& job, const Layout& layout, GridCoords coords) {
  check_layout(job, layout);
  if (layout.cp > 1) return plan_cp_rank(job, layout);
  const Schedule schedule = make_schedule(layout.schedule, layout.pp, job.micro_batches, layout.chunks);
  return plan_rank(job, layout, coords, schedule, split_stages(job.model, schedule.stages()));
}

// ----------------------------------------------------------------------------
// a layout on a cluster

// a group whose span of consecutive ranks fits in a node talks over the node's links,
// else some of its messages cross nodes
static std::string link_name(const Cluster& cluster, int degree, int span) {
  if (degree == 1) return "-";
  return span <= cluster.devices_per_node ? cluster.intra_name : cluster.inter_name;
}
static double link_bandwidth(const Cluster& cluster, int span) {
  return span <= cluster.devices_per_node ? cluster.intra_node_bandwidth : cluster.inter_node_bandwidth;
}

// FLOPs per token of a training step: forward and backward (chapter 00's count), and
// recomputation's extra forward: full, the blocks' whole forward again (24 L C^2 +
// 4 L T C, a third of their training FLOPs); selective, attention's (T, T) products
// again (4 L T C)
static double step_flops_per_token(const PlanJob& job) {
  const double L = job.model.n_layer, C = job.model.d_model, T = job.model.seq_len;
  const double extra = job.recompute == Recompute::Full        ? 24.0 * L * C * C + 4.0 * L * T * C
                       : job.recompute == Recompute::Selective ? 4.0 * L * T * C
                                                                 : 0.0;
  return training_flops_per_token(job.model) + extra;
}

// DP's gradient average overlaps the last micro-batch's backward (chapter 02's buckets
// start as its gradients are done; chapter 07 starts a chunk's once its last backward
// has run): only what is left after that backward is exposed.
//   exposed = max(0, dp bytes / dp link - (compute - forward) / M)
// compute_seconds: the rank's forward and backward (and recomputation), no bubble
static double exposed_dp_seconds(const PlanJob& job, double dp_seconds, double compute_seconds) {
  const double forward_share = training_flops_per_token(job.model) / 3.0 / step_flops_per_token(job);
  const double forward_seconds = compute_seconds * forward_share;
  const double last_backward = (compute_seconds - forward_seconds) / job.micro_batches;
  return std::max(0.0, dp_seconds - last_backward);
}

// Chapter 08's dp x cp: a cp group is N consecutive ranks (rank = dp_rank N + cp_rank),
// DDP's group the whole world. The ring's hops run while attention computes (its
// 12 L T C FLOPs per token of chapter 00's count, split evenly by zigzag): only the
// time they take beyond it is exposed. a2a's all-to-alls are all exposed; DDP's
// average only beyond the last micro-batch's backward, as chapter 07's.
static LayoutPlan plan_cp_layout(const PlanJob& job, const Layout& layout, const Cluster& cluster) {
  LayoutPlan plan{layout, {}, {}, 0.0, false, "-", "-", "", "", 0.0, 0.0, 0.0, 0.0, 0.0};
  plan.worst = plan_cp_rank(job, layout);
  plan.pipeline_ranks = {plan.worst};
  plan.peak_memory = plan.worst.memory();
  plan.fits = plan.peak_memory <= cluster.device_memory;
  const int world = layout.dp * layout.cp;
  plan.cp_link = link_name(cluster, layout.cp, layout.cp);
  plan.dp_link = link_name(cluster, world, world);

  const GPTConfig& config = job.model;
  const double tokens = static_cast<double>(job.global_batch) * config.seq_len;
  plan.compute_seconds = training_flops_per_token(config) * tokens / cluster.devices() / cluster.device_flops;
  const double attention_seconds = 12.0 * config.n_layer * config.seq_len * config.d_model * tokens /
                                   cluster.devices() / cluster.device_flops;
  const double cp_seconds = plan.worst.cp_bytes / link_bandwidth(cluster, layout.cp);
  const double cp_exposed =
      layout.cp_mode == CPMode::Ring ? std::max(0.0, cp_seconds - attention_seconds) : cp_seconds;
  plan.exposed_comm_seconds =
      cp_exposed + exposed_dp_seconds(job, plan.worst.dp_bytes / link_bandwidth(cluster, world), plan.compute_seconds);
  plan.step_seconds = plan.compute_seconds + plan.exposed_comm_seconds;
  plan.tokens_per_second = tokens / plan.step_seconds;
  return plan;
}

LayoutPlan plan_layout(const PlanJob& job, const Layout& layout, const Cluster& cluster) {
  check_layout(job, layout);
  if (layout.cp > 1) return plan_cp_layout(job, layout, cluster);
  const Schedule schedule = make_schedule(layout.schedule, layout.pp, job.micro_batches, layout.chunks);
  const std::vector<StageRange> cut = split_stages(job.model, schedule.stages());
  LayoutPlan plan{layout, {}, {}, 0.0, false, "", "", "", "-", 0.0, 0.0, 0.0, 0.0, 0.0};
  // dp 0 holds the largest ZeRO shard, and the TP ranks of a stage hold the same
  // amounts: the pipeline's ranks at (0, pp, 0) are the ones that differ
  for (int pp = 0; pp < layout.pp; pp++) {
    const RankPlan rank = plan_rank(job, layout, {0, pp, 0}, schedule, cut);
    plan.pipeline_ranks.push_back(rank);
    RankPlan& w = plan.worst;
    w.parameters = std::max(w.parameters, rank.parameters);
    w.gradients = std::max(w.gradients, rank.gradients);
    w.optimizer_state = std::max(w.optimizer_state, rank.optimizer_state);
    w.activations = std::max(w.activations, rank.activations);
    w.workspace = std::max(w.workspace, rank.workspace);
    w.comm_buffers = std::max(w.comm_buffers, rank.comm_buffers);
    w.tp_bytes = std::max(w.tp_bytes, rank.tp_bytes);
    w.pp_bytes = std::max(w.pp_bytes, rank.pp_bytes);
    w.dp_bytes = std::max(w.dp_bytes, rank.dp_bytes);
    w.dp_gather_bytes = std::max(w.dp_gather_bytes, rank.dp_gather_bytes);
    w.lent = std::max(w.lent, rank.lent);
    plan.peak_memory = std::max(plan.peak_memory, rank.memory());
  }
  plan.fits = plan.peak_memory <= cluster.device_memory;

  // an axis's span is its degree times the distance between neighbours on it, which
  // the grid's order decides: dp-pp-tp: tp 1, pp TP, dp PP x TP; pp-dp-tp: tp 1, dp TP, pp DP x TP
  const ProcessGrid grid(layout.dp * layout.pp * layout.tp, layout.dp, layout.pp, layout.tp, layout.order);
  const auto link = [&](int degree, int span) { return link_name(cluster, degree, span); };
  const auto bandwidth = [&](int span) { return link_bandwidth(cluster, span); };
  const int tp_span = layout.tp * grid.rank_of({0, 0, 1}), pp_span = layout.pp * grid.rank_of({0, 1, 0}),
            dp_span = layout.dp * grid.rank_of({1, 0, 0});
  plan.tp_link = link(layout.tp, tp_span);
  plan.pp_link = link(layout.pp, pp_span);
  plan.dp_link = link(layout.dp, dp_span);

  const GPTConfig& config = job.model;
  const double tokens = static_cast<double>(job.global_batch) * config.seq_len;
  plan.bubble = bubble_formula(layout.schedule, layout.pp, job.micro_batches, layout.chunks);
  const double busy_seconds = step_flops_per_token(job) * tokens / cluster.devices() / cluster.device_flops;
  plan.compute_seconds = busy_seconds / (1.0 - plan.bubble);
  const int b = job.global_batch / layout.dp / job.micro_batches;
  const double boundary = static_cast<double>(b) * config.seq_len / (layout.sequence_parallel ? layout.tp : 1) *
                          config.d_model * bytes_of(job.precision).message;
  plan.exposed_comm_seconds = plan.worst.tp_bytes / bandwidth(tp_span) +
                              2.0 * (layout.pp - 1) * boundary / bandwidth(pp_span) +
                              plan.worst.dp_gather_bytes / bandwidth(dp_span) +
                              exposed_dp_seconds(job, (plan.worst.dp_bytes - plan.worst.dp_gather_bytes) /
                                                          bandwidth(dp_span), busy_seconds);
  plan.step_seconds = plan.compute_seconds + plan.exposed_comm_seconds;
  plan.tokens_per_second = tokens / plan.step_seconds;
  return plan;
}

// The job as `layout` runs it: chapter 08 recomputes nothing, so its rows are
// counted without --recompute
PlanJob job_of(const PlanJob& job, const Layout& layout) {
  PlanJob as_run = job;
  if (layout.cp > 1) as_run.recompute = Recompute::None;
  return as_run;
}

std::vector<LayoutPlan> plan_all(const PlanJob& job, const Cluster& cluster, bool with_cp) {
  const int devices = cluster.devices();
  std::vector<LayoutPlan> plans;
  for (int tp = 1; tp <= devices; tp++) {
    for (int pp = 1; tp * pp <= devices; pp++) {
      if (devices % (tp * pp) != 0) continue;
      const int dp = devices / (tp * pp);
      // ZeRO 0, 1, and 3 resharded after forward. Stage 2, and 3 keeping the gathered
      // stages over the step, hold more than ZeRO-1 at the peak (the whole gradients
      // besides the shards, and the whole parameters): never a better candidate.
      for (int zero : {0, 1, 3}) {
        if (zero > 0 && dp == 1) continue;
        for (int sp = 0; sp <= (tp > 1 ? 1 : 0); sp++) {
          for (const ScheduleKind kind :
               {ScheduleKind::OneFOneB, ScheduleKind::Interleaved, ScheduleKind::ZeroBubbleH1}) {
            if (kind != ScheduleKind::OneFOneB && pp == 1) continue;
            Layout layout{dp, pp, tp, zero, kind, kind == ScheduleKind::Interleaved ? 2 : 1, sp == 1};
            layout.reshard_after_forward = zero == 3;
            try {
              plans.push_back(plan_layout(job, layout, cluster));
            } catch (const UsageError&) {
              // a layout chapter 07 cannot run for this model: not a candidate
            }
          }
        }
      }
    }
  }
  for (int cp = 2; with_cp && cp <= devices; cp++) {
    if (devices % cp != 0) continue;
    for (const CPMode mode : {CPMode::Ring, CPMode::AllToAll}) {
      Layout layout;
      layout.dp = devices / cp;
      layout.cp = cp;
      layout.cp_mode = mode;
      try {
        plans.push_back(plan_layout(job_of(job, layout), layout, cluster));
      } catch (const UsageError&) {
        // a layout chapter 08 cannot run for this model (the split, a2a's heads, the batch)
      }
    }
  }
  std::stable_sort(plans.begin(), plans.end(), [](const LayoutPlan& a, const LayoutPlan& b) {
    if (a.fits != b.fits) return a.fits;
    return a.fits ? a.step_seconds < b.step_seconds : a.peak_memory < b.peak_memory;
  });
  return plans;
}

std::string format_plans(const std::vector<LayoutPlan>& plans, size_t rows) {
  std::string text;
  char line[160];
  const bool with_cp = std::any_of(plans.begin(), plans.end(), [](const LayoutPlan& p) { return p.layout.cp > 1; });
  std::snprintf(line, sizeof(line), "  %-16s %9s %9s %4s  %-12s %-12s %-12s %6s %8s\n", "dp x pp x tp", "memory",
                "activ.", "fits", with_cp ? "tp|cp/step" : "tp/step", "pp/step", "dp/step", "bubble", "step");
  text += line;
  for (size_t i = 0; i < plans.size() && i < rows; i++) {
    const LayoutPlan& p = plans[i];
    const auto sent = [](double bytes, const std::string& link) {
      return link == "-" ? std::string("-") : format_bytes(bytes) + " " + link.substr(0, 2);
    };
    std::snprintf(line, sizeof(line), "  %-16s %9s %9s %4s  %-12s %-12s %-12s %5.1f%% %6.3f s\n",
                  describe(p.layout).c_str(), format_bytes(p.peak_memory).c_str(),
                  format_bytes(p.worst.activations).c_str(), p.fits ? "yes" : "no",
                  (p.layout.cp > 1 ? sent(p.worst.cp_bytes, p.cp_link) : sent(p.worst.tp_bytes, p.tp_link)).c_str(),
                  sent(p.worst.pp_bytes, p.pp_link).c_str(),
                  sent(p.worst.dp_bytes, p.dp_link).c_str(), 100.0 * p.bubble, p.step_seconds);
    text += line;
  }
  return text;
}

std::string format_grid_orders(const std::vector<LayoutPlan>& plans, size_t rows, const PlanJob& job,
                               const Cluster& cluster) {
  std::string text;
  char line[160];
  std::snprintf(line, sizeof(line), "the grid's order, %d devices per node: the link each axis crosses, and the step\n",
                cluster.devices_per_node);
  text += line;
  const std::vector<GridOrder> orders = {GridOrder::DpPpTp, GridOrder::PpDpTp};
  std::string header = "  dp x pp x tp    ";
  for (const GridOrder order : orders) header += std::string("   ") + grid_order_name(order) + ": tp pp dp      step";
  text += header + "\n";
  const auto short_name = [](const std::string& link) { return link.substr(0, 2); };
  for (size_t i = 0; i < plans.size() && i < rows; i++) {
    std::snprintf(line, sizeof(line), "  %-16s", describe(plans[i].layout).c_str());
    text += line;
    for (const GridOrder order : orders) {
      Layout layout = plans[i].layout;
      layout.order = order;
      const LayoutPlan p = plan_layout(job_of(job, layout), layout, cluster);
      // a cp row (chapter 08 has one order, cp fastest): cp's link under tp, as format_plans's tp|cp
      std::snprintf(line, sizeof(line), "             %-2s %-2s %-2s %7.3f s",
                    short_name(p.layout.cp > 1 ? p.cp_link : p.tp_link).c_str(),
                    short_name(p.pp_link).c_str(), short_name(p.dp_link).c_str(), p.step_seconds);
      text += line;
    }
    text += "\n";
  }
  return text;
}

}  // namespace course
