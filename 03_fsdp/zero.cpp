#include "03_fsdp/zero.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/tensor/ops.h"
#include "common/train/sharded_checkpoint.h"
#include "common/train/trainer_parts.h"

namespace course {

ShardLayout shard_layout(size_t parameters, int ranks) {
  ShardLayout layout;
  layout.shard_floats = (parameters + ranks - 1) / ranks;
  for (int r = 0; r < ranks; r++) {
    const size_t begin = std::min(r * layout.shard_floats, parameters);
    layout.begin.push_back(begin);
    layout.count.push_back(std::min(layout.shard_floats, parameters - begin));
  }
  return layout;
}

std::vector<size_t> shard_counts_in(const ShardLayout& cut, size_t begin, size_t end) {
  std::vector<size_t> counts;
  for (size_t r = 0; r < cut.begin.size(); r++) {
    const size_t first = std::max(begin, cut.begin[r]), last = std::min(end, cut.begin[r] + cut.count[r]);
    counts.push_back(last > first ? last - first : 0);
  }
  return counts;
}

ZeRO::ZeRO(Comm& comm, GPT& model, const AdamWConfig& adamw, DType grad_comm_dtype, DType param_gather_dtype)
    : ZeRO(comm, model.params.data(), model.grads.data(), model.params.size(), adamw, model.device(),
           grad_comm_dtype, param_gather_dtype) {}

ZeRO::ZeRO(Comm& comm, float* params, float* grads, size_t count, const AdamWConfig& adamw, Device device,
           DType grad_comm_dtype, DType param_gather_dtype)
    : comm_(comm),
      grads_(grads),
      count_(count),
      device_(device),
      layout_(shard_layout(count, comm.size())),
      params_(comm, params, layout_, device, param_gather_dtype),
      optimizer_(adamw, layout_.count[comm.rank()], device),
      grad_comm_dtype_(grad_comm_dtype) {
  if (grad_comm_dtype == DType::BF16) grads_bf16_ = TypedBuffer<bf16>(count_, MemCategory::CommBuffers, device_);
}

void ZeRO::reduce_gradients() {
  const OpStats before = comm_.total_stats();
  // (P)  this rank's gradients, summed over its micro-batches
  // (started and waited at once: the blocking call, but the Work says when it ran)
  OpInterval ran;
  if (grad_comm_dtype_ == DType::BF16) {
    // grads = float(average of bf16(grads)): chapter 02's bf16 buckets, as one bucket
    const OpTable& op = ops_for(device_);
    op.cast_to_bf16(grads_bf16_.data(), grads_, static_cast<int64_t>(count_));
    ran = comm_.all_reduce_async(grads_bf16_.data(), count_, ReduceOp::Average).wait();
    op.cast_to_fp32(grads_, grads_bf16_.data(), static_cast<int64_t>(count_));
  } else {
    ran = comm_.all_reduce_async(grads_, count_, ReduceOp::Average).wait();
  }
  trace_collective(trace_, "all-reduce gradients", ran, JsonLine(), trace_lane_);
  gradient_stats_ += comm_.total_stats() - before;  // read after the wait: nothing in flight
}

Work start_bf16_reduce_scatter(Comm& comm, const ShardLayout& cut, const float* grads, bf16* travelling,
                               Device device) {
  const size_t total = cut.begin.back() + cut.count.back();
  ops_for(device).cast_to_bf16(travelling, grads, static_cast<int64_t>(total));
  return comm.reduce_scatter_async(travelling, travelling + cut.begin[comm.rank()], cut.count, ReduceOp::Average);
}

void widen_own_block(float* block, const ShardLayout& cut, const bf16* travelling, int rank, Device device) {
  ops_for(device).cast_to_fp32(block, travelling + cut.begin[rank], static_cast<int64_t>(cut.count[rank]));
}

void ZeRO::start_reduce_scatter() {
  // in place: this rank's block of the output is its shard of grads_ (P), or of their bf16 copy
  if (grad_comm_dtype_ == DType::BF16) {
    reduce_scatter_ = start_bf16_reduce_scatter(comm_, layout_, grads_, grads_bf16_.data(), device_);
  } else {
    reduce_scatter_ = comm_.reduce_scatter_async(grads_, grads_ + shard_begin(), layout_.count, ReduceOp::Average);
  }
}

double ZeRO::wait_reduce_scatter() {
  const double wait_start = now_seconds();
  const OpInterval ran = reduce_scatter_.wait();
  const double waited = now_seconds() - wait_start;
  if (grad_comm_dtype_ == DType::BF16) {  // this rank's averaged block, widened into its shard
    widen_own_block(grads_ + shard_begin(), layout_, grads_bf16_.data(), comm_.rank(), device_);
  }
  trace_collective(trace_, "reduce-scatter gradients", ran, JsonLine(), trace_lane_);
  return waited;
}

double ZeRO::grad_norm_squared() {
  const float* shard = grads_ + shard_begin();  // (S)  this rank's averaged gradients
  float norm_squared = static_cast<float>(course::grad_norm_squared(shard, shard_count(), device_));
  comm_.all_reduce(&norm_squared, 1, ReduceOp::Sum);
  return static_cast<double>(norm_squared);
}

void ZeRO::clip_gradients(double norm, float max_norm) {
  clip_grads(grads_ + shard_begin(), shard_count(), norm, max_norm, device_);
}

void ZeRO::step(int step) {
  optimizer_.update(params_.owned(), grads_ + shard_begin(), step);
  const OpStats before = comm_.total_stats();
  const OpInterval ran = params_.all_gather_updated(gather_copy());
  trace_collective(trace_, "all-gather parameters", ran, JsonLine(), trace_lane_);
  parameter_stats_ += comm_.total_stats() - before;
}

ReplicatedParams::ReplicatedParams(Comm& comm, float* replica, const ShardLayout& cut, Device device,
                                   DType gather_dtype)
    : comm_(comm),
      replica_(replica),
      cut_(cut),
      device_(device),
      gather_dtype_(gather_dtype),
      owned_(replica + cut.begin[comm.rank()]) {
  if (gather_dtype != DType::BF16) return;
  master_ = Buffer(cut.count[comm.rank()], MemCategory::OptimizerState, device);
  owned_ = master_.data();
  take_replica();
}

void ReplicatedParams::take_replica() {
  if (gather_dtype_ != DType::BF16) return;
  const size_t total = cut_.begin.back() + cut_.count.back();
  copy_bytes(master_.data(), device_, replica_ + cut_.begin[comm_.rank()], device_, master_.bytes());
  // replica = float(bf16(replica)): what every later all-gather leaves there
  const OpTable& op = ops_for(device_);
  TypedBuffer<bf16> rounded(total, MemCategory::CommBuffers, device_);  // (P)  as the all-gather's copy
  op.cast_to_bf16(rounded.data(), replica_, static_cast<int64_t>(total));
  op.cast_to_fp32(replica_, rounded.data(), static_cast<int64_t>(total));
}

OpInterval ReplicatedParams::all_gather_updated(bf16* borrowed) {
  const int rank = comm_.rank();
  if (gather_dtype_ != DType::BF16) {  // in place: this rank's block of the output is its updated shard
    return comm_.all_gather_async(replica_ + cut_.begin[rank], replica_, cut_.count).wait();
  }
  const size_t total = cut_.begin.back() + cut_.count.back();
  const OpTable& op = ops_for(device_);
  TypedBuffer<bf16> lent(borrowed != nullptr ? 0 : total, MemCategory::CommBuffers, device_);  // (P) or none
  bf16* travelling = borrowed != nullptr ? borrowed : lent.data();                          // (P)
  bf16* mine = travelling + cut_.begin[rank];
  op.cast_to_bf16(mine, master_.data(), static_cast<int64_t>(cut_.count[rank]));
  const OpInterval ran = comm_.all_gather_async(mine, travelling, cut_.count).wait();
  op.cast_to_fp32(replica_, travelling, static_cast<int64_t>(total));
  return ran;
}

std::vector<ManifestPiece> zero_pieces(const GPTConfig& config, int ranks, int rank, int zero_stage) {
  const std::vector<ManifestParam> params = manifest_params(config);
  if (zero_stage < 3) {
    const ShardLayout flat = shard_layout(count_parameters(config), ranks);
    return pieces_of_flat_range(params, flat.begin[rank], flat.count[rank]);
  }
  std::vector<ManifestPiece> pieces;
  size_t stage_offset = 0;  // where the stage starts in chapter 00's flat buffer
  for (const StageLayout& stage : model_layout(config)) {
    const ShardLayout cut = shard_layout(stage.numel, ranks);
    const std::vector<ManifestPiece> mine = pieces_of_flat_range(params, stage_offset + cut.begin[rank], cut.count[rank]);
    pieces.insert(pieces.end(), mine.begin(), mine.end());
    stage_offset += stage.numel;
  }
  return pieces;
}

// How `ranks` ranks at `zero_stage` cut the model, as the manifest says it: stages 1
// and 2 cut alike, so either resumes the other as a plain load.
static std::string zero_layout(int ranks, int zero_stage) {
  const std::string n = std::to_string(ranks);
  return zero_stage == 3 ? "03_fsdp ZeRO-3 at " + n + " ranks: every model stage cut in " + n + " contiguous shards"
                         : "03_fsdp ZeRO-1/2 at " + n + " ranks: chapter 00's flat buffer cut in " + n +
                               " contiguous shards";
}

// How `ranks` ranks at `zero_stage` cut the model: one shard per rank, its zero_pieces.
static ShardedCut zero_cut(const GPTConfig& config, int ranks, int zero_stage) {
  const auto shards_of = [config, ranks, zero_stage](int rank) {
    return std::vector<ManifestShard>{{"", "params", "adam_m", "adam_v", zero_pieces(config, ranks, rank, zero_stage)}};
  };
  return {zero_layout(ranks, zero_stage), ranks, shards_of, "shards"};
}

void save_zero_shard(const TrainOptions& options, const Comm& comm, int step, int zero_stage, const float* params,
                     const AdamW& optimizer) {
  const ShardValues mine{params, optimizer.m.data(), optimizer.v.data(), optimizer.m.device()};
  save_sharded(options, step, comm.rank(), zero_cut(options.model, comm.size(), zero_stage), {mine},
               {{"zero_stage", zero_stage}});
}

int resume_zero_shard(const Comm& comm, const TrainOptions& options, int zero_stage, bool verbose, float* params,
                      AdamW& optimizer) {
  return resume_sharded(options, comm.rank(), zero_cut(options.model, comm.size(), zero_stage),
                        {{params, optimizer.m.data(), optimizer.v.data(), optimizer.m.device()}}, verbose) - 1;
}

void ZeRO::save(const TrainOptions& options, int step) const {
  save_zero_shard(options, comm_, step, 1, params_.owned(), optimizer_);
}

int ZeRO::resume_if_asked(const TrainOptions& options, bool verbose) {
  const int step = resume_zero_shard(comm_, options, 1, verbose, params_.owned(), optimizer_);
  if (step == 0) return 1;
  params_.all_gather_updated(gather_copy());  // every rank: the whole model again
  return step + 1;
}

}  // namespace course
