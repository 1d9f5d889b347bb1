// FSDP's unit: one stage of the model (the embedding, a block, the head) whose whole
// parameters exist only while it computes. Every rank keeps a shard of it; before
// the stage runs, its parameters are all-gathered from the shards into a buffer of
// their own, and freed again after:
//
//   rank 0's shard   rank 1's shard            the gathered stage (numel floats)
//   [ a0 | b0 ]      [ a1 | b1 ]      ->       [ a0 a1 | b0 b1 ]
//     run a: one all-gather, run b: another (chapter 03: one run per stage;
//     chapter 07: a TP part's stage is two runs, its split and replicated parameters)
//
// A run is cut over the ranks in rank order, so its all-gather puts every rank's
// piece where it belongs. Chapter 03's FSDP and chapter 07's ZeRO-3 both gather
// through this class.
//
// At bf16 (--dtype bf16, as FSDP2's param_dtype) the all-gathers move bf16, half the
// bytes: each rank rounds its pieces into a bf16 copy of the stage, the gathers fill
// it, and it is widened into the gathered stage. So every rank computes with the same
// bf16 values; the fp32 values stay in the shards, which AdamW updates.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "03_fsdp/zero.h"
#include "common/comm/comm.h"
#include "common/tensor/memory.h"
#include "common/train/trace.h"

namespace course {

// One run of a stage's parameters, cut over the ranks in rank order.
struct ShardedRun {
  std::vector<size_t> count;  // [rank]: how many of the run's floats each rank's shard holds (they add up to the run)
  size_t shard_offset = 0;    // where this rank's piece of the run starts in its shard
};
// The run [begin, end) of a buffer cut by `cut` (a rank's shard of the whole buffer
// starts at cut.begin[rank]): each rank's piece of it, and where `rank`'s sits in its shard.
ShardedRun sharded_run(const ShardLayout& cut, size_t begin, size_t end, int rank);

class GatheredStage {
 public:
  // The stage's runs, end to end, are its whole parameters; its all-gathers move
  // gather_dtype. They are traced as `trace_name` with `trace_args` on `trace_lane`.
  GatheredStage(std::vector<ShardedRun> runs, DType gather_dtype, std::string trace_name,
                JsonLine trace_args = JsonLine(), int trace_lane = Trace::kCommunicationLane);

  // Starts gathering the stage from `shard` (this rank's shard, on `device`) into a
  // fresh CommBuffers buffer (at bf16, through a bf16 one as well), unless it is
  // already gathered or on its way.
  void start_gather(Comm& comm, const float* shard, Device device);
  // (numel)  the whole stage, once its all-gathers have finished (returns at once
  // when they had); the seconds this waited are added to *waited when it is given.
  float* finish_gather(Trace* trace, double* waited = nullptr);
  // Frees the buffer (after any gather still writing into it has finished).
  void release();

  bool held() const { return gathered_.size() != 0; }  // gathered, or being gathered
  size_t held_floats() const { return gathered_.size(); }
  size_t numel() const { return numel_; }

 private:
  std::vector<ShardedRun> runs_;
  DType gather_dtype_;
  size_t numel_ = 0;
  std::string trace_name_;
  JsonLine trace_args_;
  int trace_lane_;
  Buffer gathered_;                 // (numel)  while held
  TypedBuffer<bf16> travelling_;    // (numel)  bf16: the stage as its all-gathers fill it, until finish_gather
  std::vector<Work> gathers_;  // [run]: its all-gather, until finish_gather
};

}  // namespace course
