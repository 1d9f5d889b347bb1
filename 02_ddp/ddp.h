// Distributed data parallel: every rank holds the whole model, trains on its
// slice of the global batch, and before each optimizer step the ranks average
// their gradients, so every replica takes the same step.
//
// The gradients live in one flat buffer (stages in order: embedding, blocks,
// head). Backward finishes them in reverse, head first. So we cut the buffer into
// buckets from its END backwards; a bucket is complete as soon as backward has
// finished the lowest stage it touches, and its all-reduce can start right then,
// on the communication thread, while backward computes the stages below it:
//
//   flat grads:  [ emb | block0 | block1 | block2 | block3 | head ]
//   buckets:     [ b3     ][ b2      ][ b1       ][ b0            ]   (b0 launched first)
//   backward:     <------------------------------------------- head first
//   comm thread:                    ...b1 all-reduce...  b0 all-reduce
//
// A bucket is a view into the gradient buffer, so nothing is copied: PyTorch
// copies each parameter's gradient into a bucket buffer because its parameters are
// separate tensors; ours are one contiguous block.
//
// --grad-comm-dtype bf16 sends half the bytes (PyTorch's bf16_compress_hook,
// Megatron's --grad-reduce-in-bf16): a bucket is first rounded into a bf16 copy of
// the gradients (2 bytes a parameter, a communication buffer), all-reduced there with
// fp32 additions, and widened back into the fp32 gradients before the optimizer.
// Each gradient loses its digits past bf16's 8 bits once per step: the local
// micro-batch sums stay fp32, and so do the master weights and AdamW.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "common/tensor/bf16.h"
#include "common/tensor/ops.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/model/model.h"
#include "common/train/trace.h"

namespace course {

struct GradBucket {
  size_t begin;             // first float of the bucket in the flat gradient buffer
  size_t end;               // one past its last float
  int ready_after_stage;    // the lowest stage it touches: done when that stage's backward is
};

// What one step's gradient averaging cost this rank.
struct GradSyncStats {
  uint64_t bytes_sent = 0;        // on the wire, by this rank
  double comm_seconds = 0.0;      // time the communication thread spent in the all-reduces
  double exposed_seconds = 0.0;   // time backward's caller waited for them: the part not hidden
};

// Buckets of bucket_mb cut from the end of a buffer of `count` floats backwards: the
// head's gradients are finished first. Each bucket's ready_after_stage is 0 until the
// caller knows better. (Also how chapter 07's planner counts DDP's messages.)
std::vector<GradBucket> cut_buckets(size_t count, double bucket_mb);

// [begin, end) of a flat buffer
struct FlatRange {
  size_t begin = 0;
  size_t end = 0;
};
// The same, leaving out the ranges in `skip` (in order, disjoint): each stretch between
// them is cut on its own, so no bucket spans a skipped range.
std::vector<GradBucket> cut_buckets(size_t count, double bucket_mb, const std::vector<FlatRange>& skip);

// Chapter 02's own flags.
struct DDPFlags {
  float bucket_mb = 1.0f;   // --bucket-mb: gradient bucket size in MB (10^6 bytes)
  bool no_overlap = false;  // --no-overlap: all-reduce after backward instead of during it
  DType grad_comm_dtype = DType::F32;  // --grad-comm-dtype fp32|bf16: what the buckets travel as
};
void add_ddp_flags(ArgParser& parser, DDPFlags& flags);

class DDP {
 public:
  // bucket_mb: bucket size in MB, 10^6 bytes of fp32 gradients (the last bucket, at the front
  // of the buffer, may be smaller). overlap = false keeps the naive version: all-reduce after
  // backward. grad_comm_dtype: what the buckets travel as (bf16: through a bf16 copy).
  DDP(Comm& comm, GPT& model, double bucket_mb, bool overlap, DType grad_comm_dtype = DType::F32);
  // Averaging all but the ranges in `not_replicated` (in order, disjoint): parameters
  // that differ from rank to rank (chapter 09's experts, each on one rank) keep their
  // own gradients.
  DDP(Comm& comm, GPT& model, double bucket_mb, bool overlap, const std::vector<FlatRange>& not_replicated,
      DType grad_comm_dtype = DType::F32);
  // Over any flat gradient buffer of `count` floats, all of it one stage: every
  // bucket is ready together, when on_stage_done(0) says so (chapter 07 calls it when
  // a pipeline chunk's last backward of the step has run) or at synchronize_gradients.
  // grads lives on `device` (the ops that cast bf16 buckets run there).
  DDP(Comm& comm, float* grads, size_t count, double bucket_mb, Device device,
      DType grad_comm_dtype = DType::F32);

  // Pass this to GPT::backward on the micro-batch that should communicate (the
  // last one: accumulating micro-batches just add locally, the "no_sync" idea).
  // It launches every bucket that stage `stage` completes.
  void on_stage_done(int stage);
  // The hook to pass GPT::backward: on the micro-batch that communicates (the last)
  // on_stage_done; on the others none, so they only accumulate locally (no_sync).
  std::function<void(int)> backward_hook(bool communicate);

  // Call after the last backward, before the optimizer: launches what is left
  // (all buckets, without overlap) and waits for everything. Afterwards every
  // rank's gradients are the average over all ranks.
  GradSyncStats synchronize_gradients();

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  // rank 0, under the run header: "ddp: 4 gradient bucket(s) of up to 1.00 MB, ..."
  void print(const std::string& backend) const;
  // Every synchronize_gradients so far: the buckets' all-reduces, and nothing else
  // the Comm did (a trainer's loss all-reduce is not gradient traffic).
  OpStats total_stats() const { return total_; }

  // --trace: each bucket's all-reduce becomes a communication span on `lane`, drawn
  // when it ran on the communication thread, so a timeline shows it under backward.
  // nullptr: none.
  void set_trace(Trace* trace, int lane = Trace::kCommunicationLane) {
    trace_ = trace;
    trace_lane_ = lane;
  }

 private:
  void launch_ready(int finished_stage);

  Comm& comm_;
  float* grads_;  // the model's flat gradient buffer
  bool overlap_;
  DType grad_comm_dtype_;
  const OpTable* ops_ = nullptr;  // the gradients' device's, for the casts (bf16 only)
  TypedBuffer<bf16> grads_bf16_;  // (P)  bf16: the buckets as they travel; fp32: none
  double bucket_mb_;
  std::vector<GradBucket> buckets_;  // in launch order: from the end of the buffer to its front
  std::vector<Work> in_flight_;
  size_t next_bucket_ = 0;
  OpStats before_step_;  // the all-reduce counters when this step's first bucket went out
  OpStats total_;        // the buckets' all-reduces over every step
  Trace* trace_ = nullptr;
  int trace_lane_ = Trace::kCommunicationLane;
};


}  // namespace course
