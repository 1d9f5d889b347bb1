#include "03_fsdp/fsdp.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/tensor/ops.h"

namespace course {

static std::vector<size_t> stage_offsets(const std::vector<StageLayout>& stages) {
  std::vector<size_t> offsets = {0};
  for (const StageLayout& stage : stages) offsets.push_back(offsets.back() + stage.numel);
  return offsets;
}

static size_t largest_numel(const std::vector<StageLayout>& stages) {
  size_t largest = 0;
  for (const StageLayout& stage : stages) largest = std::max(largest, stage.numel);
  return largest;
}

// shards[s]: how stage s is cut over the ranks. Stage 3: each stage on its own
// (shard_layout(n_s)). Stage 2: the flat cut `flat` restricted to the stage's
// floats [offset[s], offset[s] + n_s); the ranks' pieces are still contiguous and
// in rank order, so they are a reduce-scatter's blocks, and rank r's pieces of all
// the stages, end to end, are its shard of the flat buffer.
static std::vector<ShardLayout> cut_stages(const std::vector<StageLayout>& stages, const std::vector<size_t>& offset,
                                           const ShardLayout& flat, bool replicated) {
  const int ranks = static_cast<int>(flat.count.size());
  std::vector<ShardLayout> shards;
  for (size_t s = 0; s < stages.size(); s++) {
    if (!replicated) {
      shards.push_back(shard_layout(stages[s].numel, ranks));
      continue;
    }
    ShardLayout cut{0, {}, {}};
    for (int r = 0; r < ranks; r++) {
      const size_t first = std::clamp(flat.begin[r], offset[s], offset[s + 1]);
      const size_t end = std::clamp(flat.begin[r] + flat.count[r], offset[s], offset[s + 1]);
      cut.begin.push_back(first - offset[s]);
      cut.count.push_back(end - first);
      cut.shard_floats = std::max(cut.shard_floats, end - first);
    }
    shards.push_back(cut);
  }
  return shards;
}

static int checked_fsdp_stage(int stage) {
  if (stage != 2 && stage != 3) throw UsageError("FSDP runs ZeRO stage 2 or 3, got " + std::to_string(stage));
  return stage;
}

// offsets[s]: where `rank`'s shard of stage s starts in its local buffers; offsets.back(): their size
static std::vector<size_t> local_offsets(const std::vector<ShardLayout>& shards, int rank) {
  std::vector<size_t> offsets = {0};
  for (const ShardLayout& cut : shards) offsets.push_back(offsets.back() + cut.count[rank]);
  return offsets;
}

// Elements [begin, end) of a stage's parameters into dst, on `device`: computed on the
// host (they depend only on the seed, the name and the index), then copied over.
static void init_on_device(const StageLayout& stage, uint64_t seed, size_t begin, size_t end, float* dst,
                           Device device) {
  std::vector<float> values(end - begin);  // (end - begin)  on the host, for the copy only
  init_stage_slice(stage, seed, values.data(), begin, end);
  copy_bytes(dst, device, values.data(), Device::CPU, values.size() * sizeof(float));
}

FSDP::FSDP(Comm& comm, const GPTConfig& config, int micro_batch, uint64_t seed, int zero_stage,
           bool reshard_after_forward, bool prefetch, const AdamWConfig& adamw, Device device,
           DType grad_comm_dtype, DType param_gather_dtype)
    : comm_(comm),
      config_(config),
      micro_batch_(micro_batch),
      zero_stage_(checked_fsdp_stage(zero_stage)),
      replicated_(zero_stage == 2),
      reshard_after_forward_(reshard_after_forward),
      prefetch_(prefetch),
      device_(device),
      stages_(model_layout(config)),
      stage_offset_(stage_offsets(stages_)),
      flat_(shard_layout(stage_offset_.back(), comm.size())),
      shards_(cut_stages(stages_, stage_offset_, flat_, replicated_)),
      local_offset_(local_offsets(shards_, comm.rank())),
      params_(replicated_ ? stage_offset_.back() : local_offset_.back(), MemCategory::Parameters, device),
      grads_(local_offset_.back(), MemCategory::Gradients, device),
      optimizer_(adamw, local_offset_.back(), device),
      grad_comm_dtype_(grad_comm_dtype),
      stage_grads_bf16_(grad_comm_dtype == DType::BF16 ? largest_numel(stages_) : 0, MemCategory::CommBuffers, device),
      embedding_acts_(config, micro_batch, device),
      recompute_(config, micro_batch, device),
      head_acts_(config, micro_batch, device),
      scratch_(config, micro_batch, device),
      residual_grad_(2 * static_cast<size_t>(micro_batch) * config.seq_len * config.d_model, MemCategory::Workspace,
                     device),
      tokens_(static_cast<size_t>(micro_batch) * config.seq_len, device) {
  const int rank = comm.rank();
  for (size_t s = 0; s < stages_.size(); s++) {
    if (replicated_) {  // every rank builds the whole model, as chapter 00 does
      init_on_device(stages_[s], seed, 0, stages_[s].numel, params_.data() + stage_offset_[s], device);
      continue;
    }
    // only this rank's floats of the stage are ever initialised here: no rank
    // materialises the whole model, not even at the start
    const size_t begin = shards_[s].begin[rank];
    init_on_device(stages_[s], seed, begin, begin + shards_[s].count[rank], shard(params_, static_cast<int>(s)),
                   device);
  }
  if (replicated_) {
    replica_.emplace(comm, params_.data(), flat_, device, param_gather_dtype);
  } else {
    for (size_t s = 0; s < stages_.size(); s++) {  // one run: the stage's own cut
      gathered_.emplace_back(std::vector<ShardedRun>{{shards_[s].count, local_offset_[s]}}, param_gather_dtype,
                             "all-gather " + stages_[s].name);
    }
  }
  for (int layer = 0; layer < config.n_layer; layer++) block_acts_.emplace_back(config, micro_batch, device);
}

void FSDP::start_gather(int s) {
  if (!replicated_) gathered_[s].start_gather(comm_, params_.data(), device_);
}

float* FSDP::gathered(int s) {
  if (replicated_) return params_.data() + stage_offset_[s];
  return gathered_[s].finish_gather(trace_);  // at once when it has finished (or was kept from forward)
}

void FSDP::release(int s) {
  if (!replicated_) gathered_[s].release();
}

void FSDP::forward(const int* tokens, const int* targets, StepLoss& loss) {
  const int B = micro_batch_, L = config_.n_layer, last = L + 1;
  tokens_.fill(tokens, targets);
  tokens_.upload();  // kept for backward, where the ops read them

  // Prefetch: stage s+1's all-gather is queued before stage s computes, so the
  // communication thread fetches it while this thread runs stage s: two stages
  // gathered at a time. Without it, each stage waits for its whole gather.
  const float* x = nullptr;  // (B, T, C)  the current stage's input: the previous stage's output
  for (int s = 0; s <= last; s++) {
    start_gather(s);  // nothing to do when it was prefetched
    if (prefetch_ && s < last) start_gather(s + 1);
    float* weights = gathered(s);  // (n_s)
    const double start = now_seconds();
    if (s == 0) {
      embedding_forward(config_, embedding_weights(weights, config_), embedding_acts_, tokens_.device_tokens(), B);
      x = embedding_acts_.out;
    } else if (s < last) {
      block_forward_kept(config_, block_weights(weights, config_), block_acts_[s - 1], recompute_, x, B);
      x = block_acts_[s - 1].out;
    } else {
      head_forward(config_, head_weights(weights, config_), head_acts_, x, tokens_.device_targets(), B);
      loss.add(head_acts_.losses, static_cast<int64_t>(B) * config_.seq_len);
    }
    trace_compute(trace_, "forward " + stages_[s].name, start);
    if (reshard_after_forward_) release(s);
  }
}

void FSDP::backward(float dloss) {
  const int B = micro_batch_, L = config_.n_layer, last = L + 1, rank = comm_.rank();
  const size_t NC = static_cast<size_t>(B) * config_.seq_len * config_.d_model;
  float* dout = residual_grad_.data();  // (B, T, C)  dL/d(output of the current stage)
  float* dx = dout + NC;                // (B, T, C)  dL/d(input of the current stage)
  const OpTable& op = ops_for(device_);
  op.zero(dout, static_cast<int64_t>(NC));

  // as in forward, one stage ahead: stage s-1's all-gather runs while stage s computes
  for (int s = last; s >= 0; s--) {
    start_gather(s);
    if (prefetch_ && s > 0) start_gather(s - 1);
    float* weights = gathered(s);  // (n_s)
    const double start = now_seconds();
    // the whole stage's gradient from this rank's rows, alive only until the
    // reduce-scatter below has taken this rank's average out of it
    Buffer stage_grads(stages_[s].numel, MemCategory::CommBuffers, device_);  // (n_s)  zeroed
    float* grads = stage_grads.data();
    const float* x = s == 0 ? nullptr : s == 1 ? embedding_acts_.out : block_acts_[s - 2].out;  // (B, T, C)
    if (s == last) {
      head_backward(config_, head_weights(weights, config_), head_weights(grads, config_), head_acts_, scratch_, x,
                    tokens_.device_targets(), dloss, dout, B);
    } else if (s > 0) {
      op.zero(dx, static_cast<int64_t>(NC));
      // with --recompute, from the gathered weights: no gather of its own
      const BlockTensors acts =
          block_recompute(config_, block_weights(weights, config_), block_acts_[s - 1], recompute_, x, B);
      block_backward(config_, block_weights(weights, config_), block_weights(grads, config_), acts, scratch_, x, dout,
                     dx, B);
      std::swap(dout, dx);
    } else {
      embedding_backward(config_, embedding_weights(grads, config_), tokens_.device_tokens(), dout, B, device_);
    }
    trace_compute(trace_, "backward " + stages_[s].name, start);
    release(s);

    // Average over the ranks; this rank's block lands in place, at its shard's
    // position in stage_grads, and is added to its gradient shard (micro-batches
    // accumulate there, as GPT's gradients do).
    const ShardLayout& cut = shards_[s];
    // (started and waited at once: the blocking call, but the Work says when it ran)
    OpInterval ran;
    if (grad_comm_dtype_ == DType::BF16) {
      // the stage's gradients as bf16, reduce-scattered in place there, this rank's block widened back
      ran = start_bf16_reduce_scatter(comm_, cut, grads, stage_grads_bf16_.data(), device_).wait();
      widen_own_block(grads + cut.begin[rank], cut, stage_grads_bf16_.data(), rank, device_);
    } else {
      ran = comm_.reduce_scatter_async(grads, grads + cut.begin[rank], cut.count, ReduceOp::Average).wait();
    }
    trace_collective(trace_, "reduce-scatter " + stages_[s].name, ran);
    // this rank's shard (count) += its block of the average: residual_backward is that sum, da += dout
    op.residual_backward(shard(grads_, s), grads + cut.begin[rank], static_cast<int64_t>(cut.count[rank]));
  }
}

double FSDP::grad_norm_squared() {
  // the sum of squares of this rank's shards, added across ranks in float (as ZeRO's)
  float norm_squared = static_cast<float>(course::grad_norm_squared(grads_.data(), grads_.size(), device_));
  comm_.all_reduce(&norm_squared, 1, ReduceOp::Sum);
  return static_cast<double>(norm_squared);
}

void FSDP::clip_gradients(double norm, float max_norm) {
  clip_grads(grads_.data(), grads_.size(), norm, max_norm, device_);
}

void FSDP::step(int step) {
  optimizer_.update(owned_params(), grads_.data(), step);
  if (replicated_) {  // stage 2: every rank the whole updated model again
    const OpInterval ran = replica_->all_gather_updated();
    trace_collective(trace_, "all-gather parameters", ran);
  }
}

void FSDP::save(const TrainOptions& options, int step) const {
  const float* owned = replicated_ ? replica_->owned() : params_.data();  // as owned_params()
  save_zero_shard(options, comm_, step, zero_stage_, owned, optimizer_);
}

int FSDP::resume_if_asked(const TrainOptions& options, bool verbose) {
  const int step = resume_zero_shard(comm_, options, zero_stage_, verbose, owned_params(), optimizer_);
  if (step == 0) return 1;
  // stage 3 gathers nothing: forward gathers every stage it needs from the shards
  if (replicated_) replica_->all_gather_updated();  // the whole model again
  return step + 1;
}

}  // namespace course
