#include "02_ddp/ddp.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/tensor/error.h"
#include "common/train/meters.h"
#include "common/train/metrics.h"

namespace course {

// The stage that holds float `index` of the flat buffer.
static int stage_of(const GPT& model, size_t index) {
  int stage = 0;
  while (stage + 1 < static_cast<int>(model.layout().size()) && model.stage_offset(stage + 1) <= index) stage++;
  return stage;
}

std::vector<GradBucket> cut_buckets(size_t count, double bucket_mb) {
  if (!(bucket_mb > 0)) throw UsageError("--bucket-mb must be greater than 0");
  const size_t bucket_floats = std::max<size_t>(1, static_cast<size_t>(std::llround(bucket_mb * 1e6 / sizeof(float))));
  std::vector<GradBucket> buckets;
  size_t end = count;
  while (end > 0) {
    size_t begin = end > bucket_floats ? end - bucket_floats : 0;
    buckets.push_back({begin, end, 0});
    end = begin;
  }
  return buckets;
}

std::vector<GradBucket> cut_buckets(size_t count, double bucket_mb, const std::vector<FlatRange>& skip) {
  std::vector<GradBucket> buckets;
  size_t end = count;
  // the stretches between the skipped ranges, the last first
  for (size_t i = skip.size() + 1; i-- > 0;) {
    const size_t begin = i == 0 ? 0 : skip[i - 1].end;
    for (GradBucket bucket : cut_buckets(end - begin, bucket_mb)) {
      buckets.push_back({begin + bucket.begin, begin + bucket.end, 0});
    }
    if (i > 0) end = skip[i - 1].begin;
  }
  return buckets;
}

DDP::DDP(Comm& comm, GPT& model, double bucket_mb, bool overlap, DType grad_comm_dtype)
    : DDP(comm, model, bucket_mb, overlap, {}, grad_comm_dtype) {}

DDP::DDP(Comm& comm, GPT& model, double bucket_mb, bool overlap, const std::vector<FlatRange>& not_replicated,
         DType grad_comm_dtype)
    : comm_(comm),
      grads_(model.grads.data()),
      overlap_(overlap),
      grad_comm_dtype_(grad_comm_dtype),
      bucket_mb_(bucket_mb),
      buckets_(cut_buckets(model.grads.size(), bucket_mb, not_replicated)) {
  for (GradBucket& bucket : buckets_) bucket.ready_after_stage = stage_of(model, bucket.begin);
  if (grad_comm_dtype == DType::BF16) {
    ops_ = &ops_for(model.device());
    grads_bf16_ = TypedBuffer<bf16>(model.grads.size(), MemCategory::CommBuffers, model.device());
  }
}

DDP::DDP(Comm& comm, float* grads, size_t count, double bucket_mb, Device device, DType grad_comm_dtype)
    : comm_(comm),
      grads_(grads),
      overlap_(true),
      grad_comm_dtype_(grad_comm_dtype),
      bucket_mb_(bucket_mb),
      buckets_(cut_buckets(count, bucket_mb)) {
  if (grad_comm_dtype == DType::BF16) {
    ops_ = &ops_for(device);
    grads_bf16_ = TypedBuffer<bf16>(count, MemCategory::CommBuffers, device);
  }
}

void add_ddp_flags(ArgParser& parser, DDPFlags& flags) {
  parser.add_float("--bucket-mb", &flags.bucket_mb, 0.0f, true, "gradient bucket size in MB (10^6 bytes)");
  parser.add_switch("--no-overlap", &flags.no_overlap, "all-reduce after backward instead of during it");
  parser.add_dtype("--grad-comm-dtype", &flags.grad_comm_dtype,
                   "what the gradient buckets travel as: bf16 sends half the bytes (added in fp32)");
}

void DDP::print(const std::string& backend) const {
  // one bucket is ready only when backward ends: overlap has nothing to hide it behind
  const char* when = !overlap_               ? "all-reduced after backward"
                     : buckets_.size() == 1 ? "all-reduced as backward ends (one bucket: no overlap)"
                                            : "all-reduced during backward";
  std::printf("ddp: %zu gradient bucket(s) of up to %.2f MB, %s%s, backend %s\n", buckets_.size(), bucket_mb_, when,
              grad_comm_dtype_ == DType::BF16 ? ", sent as bf16" : "", backend.c_str());
}

void DDP::on_stage_done(int stage) {
  if (overlap_) launch_ready(stage);
}

void DDP::launch_ready(int finished_stage) {
  if (next_bucket_ == 0) before_step_ = op_stats(comm_, "all_reduce");
  // buckets are in launch order, so the ready ones are a prefix of what is left
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].ready_after_stage >= finished_stage) {
    const GradBucket& bucket = buckets_[next_bucket_++];
    const size_t count = bucket.end - bucket.begin;
    if (grad_comm_dtype_ == DType::BF16) {
      // bucket_bf16 = bf16(grads), queued before the all-reduce that reads it
      bf16* bucket_bf16 = grads_bf16_.data() + bucket.begin;
      ops_->cast_to_bf16(bucket_bf16, grads_ + bucket.begin, static_cast<int64_t>(count));
      in_flight_.push_back(comm_.all_reduce_async(bucket_bf16, count, ReduceOp::Average));
    } else {
      in_flight_.push_back(comm_.all_reduce_async(grads_ + bucket.begin, count, ReduceOp::Average));
    }
  }
}

std::function<void(int)> DDP::backward_hook(bool communicate) {
  if (!communicate) return {};
  return [this](int stage) { on_stage_done(stage); };
}

GradSyncStats DDP::synchronize_gradients() {
  // exposed time starts when backward is over: whatever communication is left
  // from here on is time the step spends not computing
  const double wait_start = now_seconds();
  launch_ready(0);  // stage 0 is the last to finish: everything is ready now
  for (size_t i = 0; i < in_flight_.size(); i++) {
    const OpInterval ran = in_flight_[i].wait();
    const GradBucket& bucket = buckets_[i];  // in_flight_ holds the buckets in launch order
    const size_t count = bucket.end - bucket.begin;
    // grads = the average, widened back to fp32 for the optimizer
    if (grad_comm_dtype_ == DType::BF16) {
      ops_->cast_to_fp32(grads_ + bucket.begin, grads_bf16_.data() + bucket.begin, static_cast<int64_t>(count));
    }
    trace_collective(trace_, "all-reduce bucket " + std::to_string(i), ran,
                     JsonLine().add("bytes", count * dtype_bytes(grad_comm_dtype_)), trace_lane_);
  }
  GradSyncStats stats;
  stats.exposed_seconds = now_seconds() - wait_start;
  const OpStats this_step = op_stats(comm_, "all_reduce") - before_step_;
  stats.bytes_sent = this_step.bytes_sent;
  stats.comm_seconds = this_step.seconds;
  total_ += this_step;
  in_flight_.clear();
  next_bucket_ = 0;
  return stats;
}

}  // namespace course
