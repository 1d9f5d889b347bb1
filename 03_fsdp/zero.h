// ZeRO (Rajbhandari et al., 2020): data parallelism without every rank keeping
// all of the training state.
//
// DDP keeps, on every rank, 4 bytes of parameters, 4 of gradients and 8 of AdamW
// moments per parameter: N identical copies of everything. But AdamW's update of
// element i reads only element i (adamw.h), so each rank can own one contiguous
// slice of the flat parameter buffer, its shard, and be the only one to keep
// optimizer state for it and to update it:
//
//   flat params (P floats, S = ceil(P/N) per shard, the last shard shorter):
//     [ shard 0 | shard 1 | shard 2 | shard 3 ]
//       rank 0    rank 1    rank 2    rank 3      each: AdamW(m, v) for its shard only
//
// Stage 1 shards the optimizer state. The gradients are all-reduced as in DDP;
// each rank updates its shard of the parameters; an all-gather then gives every
// rank the whole updated model again.
//
// Stage 2 also shards the gradients: a rank only needs the averaged gradient of
// its own shard, so a reduce-scatter (half an all-reduce) replaces the all-reduce,
// and no rank keeps the whole gradient. That needs backward to hand each model
// stage's gradient to the reduce-scatter as soon as it is computed, instead of
// filling GPT's one flat gradient buffer: so stage 2 runs class FSDP's stage loop
// (fsdp.h) with the parameters replicated. Stage 3, which shards the parameters as
// well and so keeps no whole model, is FSDP too. Both share shard_layout and the
// checkpoint helpers below; this class is stage 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/model/adamw.h"
#include "common/train/checkpoint.h"
#include "common/train/checkpoint_manifest.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/model/model.h"
#include "common/train/trace.h"

namespace course {

// Which floats of the flat parameter buffer each rank owns.
struct ShardLayout {
  size_t shard_floats;          // S = ceil(P / N): what every rank but possibly the last owns
  std::vector<size_t> begin;    // begin[r]: rank r's first float; begin[r] = min(r S, P)
  std::vector<size_t> count;    // count[r]: how many it owns; the counts add up to P
};
ShardLayout shard_layout(size_t parameters, int ranks);
// [r]: how many floats of [begin, end) rank r's shard holds. In rank order they are
// [begin, end) itself (chapter 07's FSDP gathers a chunk one stage at a time).
std::vector<size_t> shard_counts_in(const ShardLayout& cut, size_t begin, size_t end);

// --grad-comm-dtype bf16's reduce-scatter over cut's blocks (ZeRO-1 and 2/3 here, chapter
// 07's chunks): the gradients (all of cut's floats, on `device`) rounded into `travelling`,
// then averaged in place there, each rank's block at its begin, with fp32 additions
// inside the backend. Once the Work is done, widen_own_block puts this rank's averaged
// block back into fp32 (cut.count[rank] floats at `block`).
Work start_bf16_reduce_scatter(Comm& comm, const ShardLayout& cut, const float* grads, bf16* travelling,
                               Device device);
void widen_own_block(float* block, const ShardLayout& cut, const bf16* travelling, int rank, Device device);

// ZeRO-1/2's parameters: every rank keeps the whole flat buffer (the replica the model
// computes with), updates only its shard of it, and all-gathers the updated shards
// after the step. With gather_dtype bf16 (--dtype bf16, as FSDP2's param_dtype) the
// all-gather moves bf16, half the bytes, so the replica holds bf16 values, the weights
// the model computes with (Megatron-LM's bf16 parameters). The shard's fp32 values,
// which AdamW updates, then live on in a master copy (Megatron's main parameters):
//
//   fp32:  AdamW(replica[shard])                      -> all-gather the replica (4 bytes a value)
//   bf16:  AdamW(master) -> bf16 copy[shard] = master -> all-gather the copy    (2 bytes a value)
//                                                     -> replica = float(copy)
class ReplicatedParams {
 public:
  // replica: (P) on `device`, cut over the ranks by `cut`, holding the initial values
  // (take_replica).
  ReplicatedParams(Comm& comm, float* replica, const ShardLayout& cut, Device device, DType gather_dtype);
  // Once the replica holds fp32 values (built, or loaded from a checkpoint whole): at
  // bf16 the master copy takes the shard's values and the replica is rounded to bf16,
  // so the model computes with bf16 values from the first step on. Nothing at fp32.
  void take_replica();
  // (count[rank])  the fp32 values this rank updates and checkpoints: its master copy
  // at bf16, its shard of the replica at fp32
  float* owned() const { return owned_; }
  // Every rank's whole replica again, from the ranks' updated values; returns when the all-gather ran.
  // At bf16 the values travel through a copy of P bf16 values: `borrowed` when given
  // (ZeRO's gradient copy, idle from the reduction's end to the next backward), else
  // one lent for the gather.
  OpInterval all_gather_updated(bf16* borrowed = nullptr);

 private:
  Comm& comm_;
  float* replica_;  // (P)  on device_
  ShardLayout cut_;
  Device device_;
  DType gather_dtype_;
  Buffer master_;  // (count[rank])  bf16: the shard's fp32 values (optimizer state, as Megatron counts them)
  float* owned_;   // (count[rank])  master_, or the replica's shard at fp32
};

// ---- sharded checkpoints (stages 1, 2 and 3: fsdp.h) ------------------------------
// Every rank writes its shard of the parameters and its moments, rank 0 the step's
// manifest too (common/train/sharded_checkpoint.h). Resuming reads the manifest, so a
// checkpoint loads at any world size and any stage: each rank picks its new shard's
// elements out of the files that hold them (resharding).
// What rank `rank` of `ranks` holds at `zero_stage`, in its buffers' order: stages
// 1 and 2 one slice of chapter 00's flat buffer, stage 3 a slice of every model stage.
std::vector<ManifestPiece> zero_pieces(const GPTConfig& config, int ranks, int rank, int zero_stage);
// One rank's share of a save: (count) floats of each, on the optimizer's device (copied
// to the host to be written); rank 0 writes the manifest first.
void save_zero_shard(const TrainOptions& options, const Comm& comm, int step, int zero_stage, const float* params,
                     const AdamW& optimizer);
// With --resume or after a restart (resume_wanted): loads this rank's shard (its
// zero_pieces) from the newest checkpoint that every rank finished saving, after
// checking that it fits this run (model, seed, batch; any world size and stage),
// into params and optimizer (params on the optimizer's device). Returns that step, 0
// when there is nothing to resume.
int resume_zero_shard(const Comm& comm, const TrainOptions& options, int zero_stage, bool verbose, float* params,
                      AdamW& optimizer);

class ZeRO {
 public:
  // ZeRO stage 1 over `model`: the optimizer state sharded, on the model's device.
  // grad_comm_dtype bf16: the gradients' all-reduce moves a bf16 copy of them (2P bytes
  // of comm buffers), widened back into the fp32 gradients. param_gather_dtype bf16: the
  // parameters' all-gather moves bf16 (ReplicatedParams).
  ZeRO(Comm& comm, GPT& model, const AdamWConfig& adamw, DType grad_comm_dtype = DType::F32,
       DType param_gather_dtype = DType::F32);
  // The same over any flat pair of buffers of `count` floats on `device` (chapter 07:
  // one pipeline chunk's tensor-parallel slices).
  ZeRO(Comm& comm, float* params, float* grads, size_t count, const AdamWConfig& adamw, Device device,
       DType grad_comm_dtype = DType::F32, DType param_gather_dtype = DType::F32);

  // After backward: all-reduces (averages) the whole gradient buffer over the ranks.
  void reduce_gradients();
  // Megatron's distributed optimizer (chapter 07): a reduce-scatter in place of the
  // all-reduce, since this rank's AdamW reads only its shard of the averaged gradient.
  // With step's all-gather that is (N-1)/N x 4P bytes each way: 1x DDP's all-reduce,
  // not 1.5x. Started here, on the communication thread, when backward is over for
  // these gradients; wait_reduce_scatter waits for it (it returns the seconds waited:
  // the exposed part). Only the shard of the gradient buffer is averaged afterwards.
  // With bf16 gradients the whole buffer is rounded into the bf16 copy first, and the
  // wait widens this rank's averaged block back into its shard.
  // Not in gradient_stats: chapter 07 starts one per chunk on one Comm, several in
  // flight, and counts the Comm's totals.
  void start_reduce_scatter();
  double wait_reduce_scatter();

  // The squared norm of the whole averaged gradient, from the shards: each rank's sum
  // of squares (in double) all-reduced in float, so it differs from chapter 00's by
  // rounding only. Collective.
  double grad_norm_squared();
  // Scales this rank's shard by max_norm / norm when the norm is larger.
  void clip_gradients(double norm, float max_norm);

  // AdamW on this rank's shard, then an all-gather of the updated shards: every
  // rank holds the whole new model again (at bf16, as bf16 values: ReplicatedParams).
  void step(int step);

  // Sharded checkpoints: each rank writes its shard of the parameters and its
  // moments to checkpoint_path(dir, step, "_rank<r>"), rank 0 the manifest.
  void save(const TrainOptions& options, int step) const;
  // With --resume or after a restart: loads this rank's shard from the newest
  // complete checkpoint (written at any world size and stage), gathers the whole
  // model, and returns the step to continue at (1 when there is none yet).
  int resume_if_asked(const TrainOptions& options, bool verbose);

  // --trace: the gradients' all-reduce and the parameters' all-gather as spans on
  // `lane` (the trainer traces the optimizer step). nullptr: none.
  void set_trace(Trace* trace, int lane = Trace::kCommunicationLane) {
    trace_ = trace;
    trace_lane_ = lane;
  }

  // Every reduce_gradients so far, and every step's all-gather: this class's
  // collectives and nothing else the Comm did (a trainer's loss all-reduce is not
  // gradient traffic).
  OpStats gradient_stats() const { return gradient_stats_; }
  OpStats parameter_stats() const { return parameter_stats_; }

  const ShardLayout& layout() const { return layout_; }
  AdamW& optimizer() { return optimizer_; }  // this rank's shard's moments (for checkpoints)
  size_t shard_begin() const { return layout_.begin[comm_.rank()]; }
  size_t shard_count() const { return layout_.count[comm_.rank()]; }
  float* owned_params() const { return params_.owned(); }  // (S)  the fp32 values this rank updates
  // after a load into the whole replica (chapter 07's resume): ReplicatedParams::take_replica
  void replica_loaded() { params_.take_replica(); }

 private:
  Comm& comm_;
  float* grads_;   // (P)  on device_
  size_t count_;   // P
  Device device_;  // where the buffers are, and the moments and the ops with them
  ShardLayout layout_;
  ReplicatedParams params_;  // every rank's full copy of the parameters, and this rank's values to update
  AdamW optimizer_;  // moments for this rank's shard only: 8 S bytes, not 8 P (on device_)
  OpStats gradient_stats_, parameter_stats_;
  Trace* trace_ = nullptr;
  int trace_lane_ = Trace::kCommunicationLane;
  Work reduce_scatter_;  // start_reduce_scatter's, until wait_reduce_scatter
  DType grad_comm_dtype_ = DType::F32;
  TypedBuffer<bf16> grads_bf16_;  // (P)  bf16: the gradients as they travel, and the parameters too; fp32: none
  bf16* gather_copy() { return grads_bf16_.size() > 0 ? grads_bf16_.data() : nullptr; }
};

}  // namespace course
