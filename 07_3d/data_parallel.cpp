#include "07_3d/data_parallel.h"

#include <string>
#include <utility>

#include "common/tensor/clock.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"

namespace course {

void check_zero_stage(int zero_stage, bool reshard_after_forward) {
  if (zero_stage < 0 || zero_stage > 3) {
    throw FlagError("--zero-stage " + std::to_string(zero_stage) + " is not available here: 0 (DDP buckets), 1 " +
                    "(the optimizer state sharded over the DP group), 2 (and the gradients) or 3 (FSDP)");
  }
  if (reshard_after_forward && zero_stage != 3) {
    throw FlagError("--reshard-after-forward at --zero-stage " + std::to_string(zero_stage) +
                    ": only ZeRO-3 gathers parameters (hint: add --zero-stage 3)");
  }
}

// ----------------------------------------------------------------------------
// ZeRO-2/3's parameters

ChunkParams::ChunkParams(Comm& dp, const TPGroup& tp, const GPTConfig& config, int first_stage, int last_stage,
                         int zero_stage, bool reshard_after_forward, uint64_t seed, DType param_gather_dtype)
    : dp_(dp),
      first_stage_(first_stage),
      sharded_(zero_stage == 3),
      reshard_after_forward_(reshard_after_forward),
      cut_(shard_layout(tp_layout(config, first_stage, last_stage, tp.size()).numel, dp.size())),
      spans_(tp_stage_spans(tp_stage_layouts(config, first_stage, last_stage, tp.size()))),
      device_(tp.device()) {
  const TPLayout layout = tp_layout(config, first_stage, last_stage, tp.size());
  std::vector<float> initial(layout.numel);  // (P)  on the host, for the copy only
  init_tp_params(layout, seed, tp.rank(), tp.size(), initial.data());
  if (!sharded_) {
    params_ = Buffer(layout.numel, MemCategory::Parameters, device_);
    copy_bytes(params_.data(), device_, initial.data(), Device::CPU, params_.bytes());
    replica_.emplace(dp, params_.data(), cut_, device_, param_gather_dtype);
    return;
  }
  // only this rank's shard is ever on the device: no rank materialises the chunk
  params_ = Buffer(cut_.count[dp.rank()], MemCategory::Parameters, device_);
  copy_bytes(params_.data(), device_, initial.data() + shard_begin(), Device::CPU, params_.bytes());
  for (int stage = first_stage; stage <= last_stage; stage++) {
    const TPStageSpan& span = spans_[stage - first_stage];
    gathered_.emplace_back(std::vector<ShardedRun>{sharded_run(cut_, span.split_begin, span.split_end, dp.rank()),
                                                   sharded_run(cut_, span.replicated_begin, span.replicated_end,
                                                               dp.rank())},
                           param_gather_dtype, "all-gather parameters", JsonLine().add("stage", stage), Trace::kDataParallelLane);
  }
}

float* ChunkParams::owned() { return sharded_ ? params_.data() : replica_->owned(); }

float* ChunkParams::replica() { return sharded_ ? nullptr : params_.data(); }

void ChunkParams::replica_loaded() { replica_->take_replica(); }

StageRuns ChunkParams::stage_params(int stage, int next_stage) {
  const TPStageSpan& span = spans_[stage - first_stage_];
  if (!sharded_) return {params_.data() + span.split_begin, params_.data() + span.replicated_begin};
  GatheredStage& unit = gathered_[stage - first_stage_];
  unit.start_gather(dp_, params_.data(), device_);  // nothing to do when it was prefetched
  if (next_stage >= 0) gathered_[next_stage - first_stage_].start_gather(dp_, params_.data(), device_);
  float* whole = unit.finish_gather(trace_, &waited_);  // (span.numel())  laid out as the stage alone
  if (on_gathered_) on_gathered_();
  return {whole, whole + span.split_count()};
}

void ChunkParams::stage_done(int stage) {
  if (sharded_ && reshard_after_forward_) gathered_[stage - first_stage_].release();
}

void ChunkParams::release_all() {
  for (GatheredStage& unit : gathered_) unit.release();
}

void ChunkParams::all_gather_updated() {
  const OpInterval ran = replica_->all_gather_updated();
  trace_collective(trace_, "all-gather parameters", ran, JsonLine(), Trace::kDataParallelLane);
}

size_t ChunkParams::gathered_floats() const {
  size_t held = 0;
  for (const GatheredStage& unit : gathered_) held += unit.held_floats();
  return held;
}

double ChunkParams::take_waited() { return std::exchange(waited_, 0.0); }

// ----------------------------------------------------------------------------
// the three techniques

namespace {

// zero stage 0: chapter 02's buckets, the chunk one stage for its DDP
class ReplicatedChunk : public ChunkDataParallel {
 public:
  ReplicatedChunk(Comm& dp, TPPart& part, const AdamWConfig& adamw, float bucket_mb, DType grad_comm_dtype)
      : part_(part),
        ddp_(dp, part.grads.data(), part.grads.size(), bucket_mb, part.group().device(), grad_comm_dtype),
        adamw_(adamw, part.params.size(), part.group().device()) {}
  void start_reduction() override { ddp_.on_stage_done(0); }  // every bucket is ready
  double wait_reduction() override { return ddp_.synchronize_gradients().exposed_seconds; }
  void step(int step) override { adamw_.update(part_.params.data(), part_.grads.data(), step); }
  AdamW& optimizer() override { return adamw_; }
  FlatRange owned_range() const override { return {0, part_.params.size()}; }
  float* owned_params() override { return part_.params.data(); }
  float* owned_grads() override { return part_.grads.data(); }
  float* replica() override { return part_.params.data(); }
  void set_trace(Trace* trace) override { ddp_.set_trace(trace, Trace::kDataParallelLane); }

 private:
  TPPart& part_;
  DDP ddp_;
  AdamW adamw_;
};

// zero stage 1: chapter 03's ZeRO over the chunk's whole buffers
class DistributedOptimizerChunk : public ChunkDataParallel {
 public:
  DistributedOptimizerChunk(Comm& dp, TPPart& part, const AdamWConfig& adamw, DType grad_comm_dtype,
                            DType param_gather_dtype)
      : part_(part),
        zero_(dp, part.params.data(), part.grads.data(), part.params.size(), adamw, part.group().device(),
              grad_comm_dtype, param_gather_dtype) {}
  void start_reduction() override { zero_.start_reduce_scatter(); }
  double wait_reduction() override { return zero_.wait_reduce_scatter(); }
  void step(int step) override { zero_.step(step); }
  AdamW& optimizer() override { return zero_.optimizer(); }
  FlatRange owned_range() const override {
    return {zero_.shard_begin(), zero_.shard_begin() + zero_.shard_count()};
  }
  float* owned_params() override { return zero_.owned_params(); }
  float* owned_grads() override { return part_.grads.data() + zero_.shard_begin(); }
  float* replica() override { return part_.params.data(); }
  void replica_loaded() override { zero_.replica_loaded(); }
  void set_trace(Trace* trace) override { zero_.set_trace(trace, Trace::kDataParallelLane); }

 private:
  TPPart& part_;
  ZeRO zero_;
};

// zero stages 2 and 3: this rank keeps the averaged gradient of its shard and its
// moments; the part gets its parameters from `params` and a whole gradient, lent at
// its first backward of the step, summed over the micro-batches, reduce-scattered
// after its last one, and freed when that is over
class ShardedChunk : public ChunkDataParallel {
 public:
  ShardedChunk(Comm& dp, TPPart& part, ChunkParams& params, const AdamWConfig& adamw, DType grad_comm_dtype)
      : dp_(dp),
        part_(part),
        params_(params),
        grad_comm_dtype_(grad_comm_dtype),
        grads_(params.cut().count[dp.rank()], MemCategory::Gradients, part.group().device()),
        adamw_(adamw, params.cut().count[dp.rank()], part.group().device()) {}

  void before_compute(ActionType type) override {
    if (is_backward(type) && part_.grads.size() == 0) {  // its first backward: a zeroed whole gradient
      part_.grads = Buffer(part_.layout().numel, MemCategory::CommBuffers, part_.group().device());  // (P)
    }
  }
  void start_reduction() override {
    params_.release_all();  // no action of this step needs the parameters again
    const ShardLayout& cut = params_.cut();
    if (grad_comm_dtype_ == DType::BF16) {  // through a bf16 copy, lent for the reduction
      const Device device = part_.group().device();
      grads_bf16_ = TypedBuffer<bf16>(part_.grads.size(), MemCategory::CommBuffers, device);  // (P)
      reduce_scatter_ = start_bf16_reduce_scatter(dp_, cut, part_.grads.data(), grads_bf16_.data(), device);
    } else {
      reduce_scatter_ = dp_.reduce_scatter_async(part_.grads.data(), grads_.data(), cut.count, ReduceOp::Average);
    }
  }
  double wait_reduction() override {
    const double wait_start = now_seconds();
    const OpInterval ran = reduce_scatter_.wait();
    const double waited = params_.take_waited() + now_seconds() - wait_start;
    trace_collective(trace_, "reduce-scatter gradients", ran, JsonLine(), Trace::kDataParallelLane);
    if (grad_comm_dtype_ == DType::BF16) {  // this rank's averaged block, widened into its shard
      widen_own_block(grads_.data(), params_.cut(), grads_bf16_.data(), dp_.rank(), part_.group().device());
      grads_bf16_ = TypedBuffer<bf16>();
    }
    part_.grads = Buffer();  // this rank's average is in its shard now
    return waited;
  }
  void step(int step) override {
    adamw_.update(params_.owned(), grads_.data(), step);
    if (params_.replica() != nullptr) params_.all_gather_updated();  // ZeRO-2; ZeRO-3's next forward gathers
  }
  AdamW& optimizer() override { return adamw_; }
  FlatRange owned_range() const override { return {params_.shard_begin(), params_.shard_begin() + grads_.size()}; }
  float* owned_params() override { return params_.owned(); }
  float* owned_grads() override { return grads_.data(); }
  float* replica() override { return params_.replica(); }
  void replica_loaded() override { params_.replica_loaded(); }
  size_t lent_floats() const override {
    return part_.grads.size() + params_.gathered_floats() + grads_bf16_.size() / 2;  // a bf16 is half a float
  }
  void set_trace(Trace* trace) override {
    trace_ = trace;
    params_.set_trace(trace);
  }

 private:
  Comm& dp_;
  TPPart& part_;
  ChunkParams& params_;
  DType grad_comm_dtype_;
  TypedBuffer<bf16> grads_bf16_;  // (P)  bf16: the gradient as it travels, lent during the reduction
  Buffer grads_;  // (shard count)  the averaged gradient of this rank's shard
  AdamW adamw_;   // moments for the shard
  Work reduce_scatter_;
  Trace* trace_ = nullptr;
};

}  // namespace

std::unique_ptr<ChunkDataParallel> make_chunk_data_parallel(Comm& dp, TPPart& part, ChunkParams* params,
                                                            int zero_stage, const AdamWConfig& adamw,
                                                            float bucket_mb, DType grad_comm_dtype,
                                                            DType param_gather_dtype) {
  if (zero_stage == 0) return std::make_unique<ReplicatedChunk>(dp, part, adamw, bucket_mb, grad_comm_dtype);
  if (zero_stage == 1) {
    return std::make_unique<DistributedOptimizerChunk>(dp, part, adamw, grad_comm_dtype, param_gather_dtype);
  }
  return std::make_unique<ShardedChunk>(dp, part, *params, adamw, grad_comm_dtype);
}

}  // namespace course
