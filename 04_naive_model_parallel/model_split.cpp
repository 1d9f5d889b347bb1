#include "04_naive_model_parallel/model_split.h"

#include <cmath>
#include <cstdio>

#include "common/train/checkpoint.h"
#include "common/train/checkpoint_manifest.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/model/part_backward.h"
#include "common/train/trainer_parts.h"
#include "common/tensor/ops.h"
#include "common/train/sharded_checkpoint.h"

namespace course {

// ----------------------------------------------------------------------------
// the cut

std::vector<StageRange> split_stages(const GPTConfig& config, int parts) {
  const int L = config.n_layer;
  if (parts < 1 || parts > L) {
    throw FlagError("cannot cut " + std::to_string(L) + " blocks into " + std::to_string(parts) +
                    " pipeline parts: every part needs at least one block (hint: use at most " + std::to_string(L) +
                    " ranks, or more --layers)");
  }
  std::vector<StageRange> ranges;
  int next_block = 0;  // block b is model stage 1 + b
  for (int part = 0; part < parts; part++) {
    const int blocks = L / parts + (part < L % parts ? 1 : 0);
    StageRange range;
    range.first = part == 0 ? 0 : 1 + next_block;
    next_block += blocks;
    range.last = part == parts - 1 ? L + 1 : next_block;
    ranges.push_back(range);
  }
  return ranges;
}

std::string describe_stages(const GPTConfig& config, StageRange range) {
  const int first_block = std::max(range.first, 1) - 1;
  const int last_block = std::min(range.last, config.n_layer) - 1;
  std::string text = range.first == 0 ? "embedding + " : "";
  text += first_block == last_block ? "block " + std::to_string(first_block)
                                    : "blocks " + std::to_string(first_block) + "-" + std::to_string(last_block);
  if (range.last == config.n_layer + 1) text += " + head";
  return text;
}

StageCut::StageCut(const GPTConfig& config, std::vector<std::vector<StageRange>> ranges)
    : every_rank(std::move(ranges)) {
  for (size_t r = 0; r < every_rank.size(); r++) {
    std::string label;
    for (const StageRange& range : every_rank[r]) {
      label += (label.empty() ? "" : "; ") + describe_stages(config, range);
      if (range.last == config.n_layer + 1) head_rank = static_cast<int>(r);
    }
    labels.push_back(label);
  }
}

float StageCut::report_loss(Comm& world, float loss) const {
  world.broadcast(&loss, 1, head_rank);
  return loss;
}

void StageCut::print(const std::string& backend, int micro_batch) const {
  std::printf("model parallel: %zu ranks, micro-batches of %d sequence(s), backend %s\n", labels.size(), micro_batch,
              backend.c_str());
  print_ranks();
}

void StageCut::print_ranks() const {
  for (size_t r = 0; r < labels.size(); r++) std::printf("  rank %zu: %s\n", r, labels[r].c_str());
}

StageCut one_part_per_rank(const Run& run, int pp) {
  std::vector<std::vector<StageRange>> every_rank;
  for (const StageRange& range : split_stages(run.options.model, whole_world_degree("--pp", pp, run.ranks))) {
    every_rank.push_back({range});
  }
  return StageCut(run.options.model, every_rank);
}

static int block_count(const GPTConfig& config, StageRange range) {
  return std::min(range.last, config.n_layer) - std::max(range.first, 1) + 1;
}

// ----------------------------------------------------------------------------
// one micro-batch's activations

size_t PartActivations::floats(const GPTConfig& config, StageRange range, int micro_batch) {
  const size_t BTC = static_cast<size_t>(micro_batch) * config.seq_len * config.d_model;
  const size_t blocks = block_count(config, range);
  size_t total = BTC;  // the received input, or the embedding's output
  total += blocks * BlockActivations::floats(config, micro_batch);
  if (range.last == config.n_layer + 1) total += HeadActivations::floats(config, micro_batch);
  return total;
}

PartActivations::PartActivations(const GPTConfig& config, StageRange range, int micro_batch, Device where)
    : batch(static_cast<size_t>(micro_batch) * config.seq_len, where,
            /*read_on_device=*/range.first == 0 || range.last == config.n_layer + 1),
      device(where) {
  if (range.first == 0) {
    embedding.emplace_back(config, micro_batch, device);
  } else {
    input = Buffer(static_cast<size_t>(micro_batch) * config.seq_len * config.d_model, MemCategory::Activations,
                   device);
  }
  const int blocks_here = block_count(config, range);
  for (int b = 0; b < blocks_here; b++) blocks.emplace_back(config, micro_batch, device);
  if (range.last == config.n_layer + 1) head.emplace_back(config, micro_batch, device);
}

BackwardWorkspace::BackwardWorkspace(const GPTConfig& config, int micro_batch, Device device)
    : scratch(config, micro_batch, device),
      residual_grad(2 * static_cast<size_t>(micro_batch) * config.seq_len * config.d_model, MemCategory::Workspace,
                    device),
      recompute(config, micro_batch, device) {}

// ----------------------------------------------------------------------------
// the part: its stages' parameters, forward and backward

ModelPart::ModelPart(const GPTConfig& config, StageRange range, int micro_batch, uint64_t seed, Device device)
    : config_(config), range_(range), micro_batch_(micro_batch), device_(device) {
  const std::vector<StageLayout> layout = model_layout(config);
  size_t part_floats = 0;
  for (int stage = 0; stage < static_cast<int>(layout.size()); stage++) {
    if (stage < range.first) global_offset_ += layout[stage].numel;
    if (stage >= range.first && stage <= range.last) {
      stage_offset_.push_back(part_floats);
      part_floats += layout[stage].numel;
    }
  }
  params = Buffer(part_floats, MemCategory::Parameters, device);
  grads = Buffer(part_floats, MemCategory::Gradients, device);
  // each element's value depends only on (seed, name, index): the same numbers
  // chapter 00 puts there, without making the stages this rank does not own.
  // Made on the host, then copied to the device (as chapter 00's GPT does).
  Buffer host_params(device == Device::CPU ? 0 : part_floats, MemCategory::Workspace);  // (part's P)
  float* init_target = device == Device::CPU ? params.data() : host_params.data();
  for (int stage = range.first; stage <= range.last; stage++) {
    init_stage_slice(layout[stage], seed, init_target + stage_offset_[stage - range.first], 0, layout[stage].numel);
  }
  if (device != Device::CPU) copy_bytes(params.data(), device, init_target, Device::CPU, params.bytes());
}

size_t ModelPart::activation_floats() const {
  return static_cast<size_t>(micro_batch_) * config_.seq_len * config_.d_model;
}

const float* ModelPart::block_input(const PartActivations& acts, int block) const {
  if (block > 0) return acts.blocks[block - 1].out;
  return has_embedding() ? acts.embedding[0].out : acts.input.data();
}

void ModelPart::forward(PartActivations& acts, StepLoss& loss, BackwardWorkspace& work) {
  const int B = micro_batch_;
  acts.batch.upload();
  if (has_embedding()) {
    embedding_forward(config_, embedding_weights(stage_params(0), config_), acts.embedding[0], acts.batch.device_tokens(),
                      B);
  }
  const int first_block_stage = std::max(range_.first, 1);
  for (size_t b = 0; b < acts.blocks.size(); b++) {
    block_forward_kept(config_, block_weights(stage_params(first_block_stage + b), config_), acts.blocks[b],
                       work.recompute, block_input(acts, b), B);
  }
  if (!has_head()) return;
  head_forward(config_, head_weights(stage_params(range_.last), config_), acts.head[0], acts.blocks.back().out,
               acts.batch.device_targets(), B);
  loss.add(acts.head[0].losses, static_cast<int64_t>(B) * config_.seq_len);
}

const float* ModelPart::output(const PartActivations& acts) const { return acts.blocks.back().out; }

void ModelPart::backward(PartActivations& acts, const float* dout, float* dinput, float dloss,
                         BackwardWorkspace& work) {
  backward_pass(acts, dout, dinput, dloss, work, /*defer_weights=*/false);
}

void ModelPart::backward_input(PartActivations& acts, const float* dout, float* dinput, float dloss,
                               BackwardWorkspace& work) {
  backward_pass(acts, dout, dinput, dloss, work, /*defer_weights=*/true);
}

// dst = src, both (n) on the ops' device: one row of n columns
static void copy_on_device(const OpTable& op, float* dst, const float* src, int64_t n) {
  op.copy_strided(dst, n, src, n, /*rows=*/1, /*width=*/n);
}

// The same walk as GPT::backward, over this part's stages only (common/model/part_backward.h):
// from the head (or the received dout) back through the blocks to the embedding (or
// into dinput).
void ModelPart::backward_pass(PartActivations& acts, const float* dout, float* dinput, float dloss,
                              BackwardWorkspace& work, bool defer_weights) {
  const OpTable& op = ops_for(device_);
  const int B = micro_batch_;
  const int64_t NC = static_cast<int64_t>(activation_floats());
  const int first_block_stage = std::max(range_.first, 1);
  PartBackwardStages stages;
  if (has_head()) {
    stages.head = [&](float* dx) {
      head_backward(config_, head_weights(stage_params(range_.last), config_),
                    head_weights(stage_grads(range_.last), config_), acts.head[0], work.scratch,
                    acts.blocks.back().out, acts.batch.device_targets(), dloss, dx, B);
    };
  }
  stages.blocks = static_cast<int>(acts.blocks.size());
  stages.block = [&](int b, const float* d, float* dx) {
    const int stage = first_block_stage + b;
    const BlockWeights weights = block_weights(stage_params(stage), config_);
    const BlockWeights block_grads = block_weights(stage_grads(stage), config_);
    const BlockTensors whole =
        block_recompute(config_, weights, acts.blocks[b], work.recompute, block_input(acts, b), B);
    if (!defer_weights) {
      block_backward(config_, weights, block_grads, whole, work.scratch, block_input(acts, b), d, dx, B);
    } else {
      // (selective recomputation at most: the weight half reads what the block keeps,
      // not attention's probabilities; full keeps none of it, and is refused)
      block_backward_input(config_, weights, block_grads, whole, work.scratch, block_input(acts, b), d, dx, B);
      // Keep the four gradients the deferred weight GEMMs need. Each has the shape of
      // an activation that backward is now done with (qkv, res2, fch, and out, the
      // next block's input), so they are stored there: deferring W costs no memory.
      // (Not written there in the first place: backward still reads each of those
      // activations while it makes the gradient.) Device copies, on the ops' queue.
      BlockActivations& a = acts.blocks[b];
      const BackwardScratch& s = work.scratch;
      copy_on_device(op, a.qkv, s.dqkv, 3 * NC);
      copy_on_device(op, a.res2, s.dres2, NC);
      copy_on_device(op, a.fch, s.dfch, 4 * NC);
      copy_on_device(op, a.out, d, NC);
    }
  };
  if (has_embedding()) {
    stages.embedding = [&](const float* d) {
      embedding_backward(config_, embedding_weights(stage_grads(0), config_), acts.batch.device_tokens(), d, B, device_);
    };
  }
  walk_part_backward(stages, dout, dinput, work.residual_grad.data(), NC, device_);
}

void ModelPart::backward_weight(PartActivations& acts) {
  const int first_block_stage = std::max(range_.first, 1);
  for (int b = static_cast<int>(acts.blocks.size()) - 1; b >= 0; b--) {
    const BlockActivations& a = acts.blocks[b];
    // where backward_input left the linear layers' output gradients
    const LinearOutputGrads d{a.qkv, a.res2, a.fch, a.out};
    block_backward_weight(config_, block_weights(stage_grads(first_block_stage + b), config_), a, d, micro_batch_);
  }
}

// ----------------------------------------------------------------------------
// a rank's parts, and chapter 04's walk through them

RankParts::RankParts(const TrainOptions& options, const std::vector<StageRange>& ranges, int micro_batch,
                     Device device)
    : workspace(options.model, micro_batch, device) {
  for (const StageRange& range : ranges) {
    owned_parts_.push_back(std::make_unique<ModelPart>(options.model, range, micro_batch, options.seed, device));
    owned_optimizers_.push_back(
        std::make_unique<AdamW>(adamw_config(options), owned_parts_.back()->params.size(), device));
    parts.push_back(owned_parts_.back().get());
    optimizers.push_back(owned_optimizers_.back().get());
  }
}

void RankParts::zero_grad() {
  for (ModelPart* part : parts) part->grads.zero();
}

void RankParts::clip_gradients(Comm& world, float max_norm) { clip_part_gradients(world, parts, max_norm); }

void RankParts::update(int step) {
  for (size_t i = 0; i < parts.size(); i++) {
    optimizers[i]->update(parts[i]->params.data(), parts[i]->grads.data(), step);
  }
}

PartWalk::PartWalk(ModelPart& part, BackwardWorkspace& workspace, Comm& world, Trace& trace, int micro_batch,
                   DType message_type)
    : acts(part.config(), part.range(), micro_batch, part.device()),
      part_(part),
      workspace_(workspace),
      world_(world),
      trace_(trace),
      dout_(part.has_head() ? 0 : part.activation_floats(), MemCategory::CommBuffers, part.device()),
      dinput_(part.has_embedding() ? 0 : part.activation_floats(), MemCategory::CommBuffers, part.device()),
      message_type_(message_type) {}

void PartWalk::forward(const JsonLine& where, StepLoss& loss) {
  const int rank = world_.rank();
  if (!part_.has_embedding()) recv("recv activation", acts.input.data(), rank - 1, where);
  const double start = now_seconds();
  part_.forward(acts, loss, workspace_);
  synchronize(part_.device());  // busy until the device has finished, not until the ops are queued
  busy_ += now_seconds() - start;
  trace_.span_since("forward", start, Trace::kComputeLane, where);
  if (!part_.has_head()) send("send activation", part_.output(acts), rank + 1, where);
}

void PartWalk::backward(float dloss, const JsonLine& where) {
  const int rank = world_.rank();
  const bool first = part_.has_embedding(), last = part_.has_head();
  if (!last) recv("recv gradient", dout_.data(), rank + 1, where);
  const double start = now_seconds();
  if (!first) dinput_.zero();  // backward adds into it
  part_.backward(acts, last ? nullptr : dout_.data(), first ? nullptr : dinput_.data(), dloss, workspace_);
  synchronize(part_.device());
  busy_ += now_seconds() - start;
  trace_.span_since("backward", start, Trace::kComputeLane, where);
  if (!first) send("send gradient", dinput_.data(), rank - 1, where);
}

double PartWalk::take_busy_seconds() {
  const double busy = busy_;
  busy_ = 0.0;
  return busy;
}

void PartWalk::send(const char* span, const float* data, int peer, const JsonLine& where) {
  const double start = now_seconds();
  send_boundary(world_, data, part_.activation_floats(), peer, message_type_, message_, part_.device()).wait();
  trace_.span_since(span, start, Trace::kCommunicationLane, where);
}

void PartWalk::recv(const char* span, float* data, int peer, const JsonLine& where) {
  const double start = now_seconds();
  recv_boundary(world_, data, part_.activation_floats(), peer, message_type_, message_, part_.device());
  trace_.span_since(span, start, Trace::kCommunicationLane, where);
}

// ----------------------------------------------------------------------------
// a stage boundary's messages

Work send_boundary(Comm& comm, const float* values, size_t count, int peer, DType type, TypedBuffer<bf16>& message,
                   Device device) {
  if (type == DType::F32) return comm.send_async(values, count, peer);
  // m = bf16(x): half the bytes on the wire
  if (message.size() != count) message = TypedBuffer<bf16>(count, MemCategory::CommBuffers, device);
  ops_for(device).cast_to_bf16(message.data(), values, static_cast<int64_t>(count));
  return comm.send_async(message.data(), count, peer);
}

void recv_boundary(Comm& comm, float* values, size_t count, int peer, DType type, TypedBuffer<bf16>& message,
                   Device device) {
  if (type == DType::F32) {
    comm.recv(values, count, peer);
    return;
  }
  if (message.size() != count) message = TypedBuffer<bf16>(count, MemCategory::CommBuffers, device);
  comm.recv(message.data(), count, peer);
  // x = float(m): exact, the values the sender's bf16 kept
  ops_for(device).cast_to_fp32(values, message.data(), static_cast<int64_t>(count));
}

// ----------------------------------------------------------------------------
// the summary

void print_naive_idle(double measured, int ranks) {
  std::printf("idle share of the step, mean over ranks: measured %.1f%%, (N-1)/N = %.1f%% expected at N = %d\n",
              100.0 * measured, 100.0 * (ranks - 1) / ranks, ranks);
}

// ----------------------------------------------------------------------------
// gradient clipping over all ranks' parts

void clip_part_gradients(Comm& comm, std::vector<ModelPart*> parts, float max_norm) {
  double mine = 0.0;
  for (ModelPart* part : parts) mine += grad_norm_squared(part->grads.data(), part->grads.size(), part->device());
  float norm_squared = static_cast<float>(mine);
  comm.all_reduce(&norm_squared, 1, ReduceOp::Sum);
  const double norm = std::sqrt(static_cast<double>(norm_squared));
  for (ModelPart* part : parts) clip_grads(part->grads.data(), part->grads.size(), norm, max_norm, part->device());
}

// ----------------------------------------------------------------------------
// checkpoints: one file per rank, holding its parts

// How the parts cut the model, as the manifest says it: every rank's stages (0 is the
// embedding, L + 1 the head), in its file's order.
static std::string parts_layout(const std::vector<std::vector<StageRange>>& every_rank) {
  std::string text = "model parts at " + std::to_string(every_rank.size()) + " ranks (model stages:";
  for (size_t rank = 0; rank < every_rank.size(); rank++) {
    text += (rank ? "; rank " : " rank ") + std::to_string(rank);
    for (size_t i = 0; i < every_rank[rank].size(); i++) {
      const StageRange& range = every_rank[rank][i];
      text += (i ? ", " : " ") + std::to_string(range.first) +
              (range.last > range.first ? "-" + std::to_string(range.last) : "");
    }
  }
  return text + ")";
}

// How the parts cut the model: part i of rank r is sections params<i>, adam_m<i>,
// adam_v<i> of its file, chapter 00's flat buffer from its first stage to the end of
// its last.
static ShardedCut parts_cut(const GPTConfig& config, const std::vector<std::vector<StageRange>>& every_rank) {
  std::vector<size_t> stage_offset = {0};  // [s]: where stage s starts in chapter 00's flat buffer
  for (const StageLayout& stage : model_layout(config)) stage_offset.push_back(stage_offset.back() + stage.numel);
  const std::vector<ManifestParam> params = manifest_params(config);
  const auto shards_of = [=](int rank) {
    std::vector<ManifestShard> shards;
    for (size_t i = 0; i < every_rank[rank].size(); i++) {
      const std::string part = std::to_string(i);
      const size_t begin = stage_offset[every_rank[rank][i].first], end = stage_offset[every_rank[rank][i].last + 1];
      shards.push_back({"", "params" + part, "adam_m" + part, "adam_v" + part,
                        pieces_of_flat_range(params, begin, end - begin)});
    }
    return shards;
  };
  return {parts_layout(every_rank), static_cast<int>(every_rank.size()), shards_of};
}

void save_parts(const TrainOptions& options, const Comm& comm, int step, const std::vector<ModelPart*>& parts,
                const std::vector<AdamW*>& optimizers, const std::vector<std::vector<StageRange>>& every_rank) {
  std::vector<ShardValues> mine;
  std::vector<std::pair<std::string, int64_t>> meta = {{"parts_per_rank", static_cast<int64_t>(parts.size())}};
  for (size_t i = 0; i < parts.size(); i++) {
    mine.push_back({parts[i]->params.data(), optimizers[i]->m.data(), optimizers[i]->v.data(), parts[i]->device()});
    meta.emplace_back("part" + std::to_string(i) + "_first_stage", parts[i]->range().first);
    meta.emplace_back("part" + std::to_string(i) + "_last_stage", parts[i]->range().last);
  }
  save_sharded(options, step, comm.rank(), parts_cut(options.model, every_rank), mine, meta);
}

int resume_parts_if_asked(const TrainOptions& options, const std::vector<ModelPart*>& parts,
                          const std::vector<AdamW*>& optimizers, const std::vector<std::vector<StageRange>>& every_rank,
                          bool verbose) {
  // each part: its slice of chapter 00's flat buffer, from whichever files hold it
  const std::vector<ManifestParam> params = manifest_params(options.model);
  std::vector<ShardTarget> targets;
  for (size_t i = 0; i < parts.size(); i++) {
    const ShardBuffers part_buffers{parts[i]->params.data(), optimizers[i]->m.data(), optimizers[i]->v.data(),
                                    parts[i]->device()};
    targets.push_back({pieces_of_flat_range(params, parts[i]->global_offset(), parts[i]->params.size()),
                       part_buffers});
  }
  return resume_sharded(options, parts_cut(options.model, every_rank), targets, verbose);
}

}  // namespace course
