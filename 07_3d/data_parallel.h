// dp: one pipeline chunk (a TPPart) averaged over the DP group, by one of chapters
// 02 and 03's techniques, picked by --zero-stage:
//
//   0  ReplicatedChunk             chapter 02: every DP rank keeps the whole chunk and
//                                  AdamW for it; the gradients all-reduced in buckets
//   1  DistributedOptimizerChunk   chapter 03's ZeRO-1, as Megatron's distributed
//                                  optimizer: reduce-scatter the gradients, AdamW on this
//                                  rank's shard, all-gather the updated parameters
//   2  ShardedChunk                and no whole gradient kept between steps: one is lent
//                                  to the part from its first backward to the reduce-scatter
//   3  ShardedChunk (FSDP)         and no whole parameters: each stage gathered from the
//                                  shards as it computes (chapter 03's GatheredStage)
//
// Each started as soon as the chunk's last backward of the step has run, under the
// backwards the pipeline still runs. The shard is ZeRO-1's: the chunk's P floats cut
// in dp contiguous pieces (shard_layout).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "02_ddp/ddp.h"
#include "03_fsdp/gathered_stage.h"
#include "03_fsdp/zero.h"
#include "05_pipeline/schedule.h"
#include "06_tensor_parallel/tp_model.h"
#include "common/model/adamw.h"
#include "common/train/cli.h"
#include "common/train/trace.h"

namespace course {

// FlagError for a --zero-stage other than 0-3, or --reshard-after-forward below 3.
void check_zero_stage(int zero_stage, bool reshard_after_forward);

// ZeRO-2 and -3's parameters of one chunk, kept out of its TPPart (the part's
// TPParamSource). ZeRO-2: the whole chunk on every DP rank, as the part would keep it.
// ZeRO-3: only this rank's shard; each stage of the chunk (FSDP's unit: the
// embedding, a block or the head) is all-gathered from the shards before it first
// computes in the step and kept across the micro-batches until the chunk's last
// backward (reshard_after_forward: gathered before each of its forwards and
// backwards, freed after each). While a stage computes, the one the part computes
// next is being gathered (prefetched); that queues on the DP group's thread behind
// whatever is there (with interleaving, possibly another chunk's reduce-scatter).
// The gathered stages are CommBuffers, as chapter 03's.
class ChunkParams : public TPParamSource {
 public:
  // the chunk of stages [first_stage, last_stage] on `tp`'s rank, from `seed`
  // (param_gather_dtype: what the all-gathers move; bf16 under --dtype bf16, gathered_stage.h
  // and zero.h's ReplicatedParams)
  ChunkParams(Comm& dp, const TPGroup& tp, const GPTConfig& config, int first_stage, int last_stage,
              int zero_stage, bool reshard_after_forward, uint64_t seed, DType param_gather_dtype);

  StageRuns stage_params(int stage, int next_stage) override;
  void stage_done(int stage) override;
  // ZeRO-3, after the chunk's last backward of the step: every gathered stage freed
  void release_all();
  // ZeRO-2, after the step: every rank's updated shard into every rank's whole copy
  void all_gather_updated();

  const ShardLayout& cut() const { return cut_; }
  size_t shard_begin() const { return cut_.begin[dp_.rank()]; }
  float* owned();    // (shard count)  the fp32 values of this rank's shard, which it updates
  float* replica();  // (P)  ZeRO-2's whole copy; null at ZeRO-3
  // ZeRO-2, after a load into the whole copy: ReplicatedParams::take_replica
  void replica_loaded();
  size_t gathered_floats() const;  // ZeRO-3's stages held now
  void set_trace(Trace* trace) { trace_ = trace; }
  // Called each time stage_params has a stage gathered (and the next one on its way):
  // when the most is held, for a meter of it.
  void on_gathered(std::function<void()> hook) { on_gathered_ = std::move(hook); }
  // ZeRO-3: the seconds this step waited for its gathers, then 0 again
  double take_waited();

 private:
  Comm& dp_;
  int first_stage_;
  bool sharded_;  // ZeRO-3
  bool reshard_after_forward_;
  ShardLayout cut_;                     // the chunk's P floats over the DP group
  std::vector<TPStageSpan> spans_;      // [stage - first]: where it sits in the chunk
  Buffer params_;                       // ZeRO-2: (P)  the whole chunk; ZeRO-3: (shard count)  this rank's shard
  std::optional<ReplicatedParams> replica_;  // ZeRO-2: params_ as every rank's copy, updated shard by shard
  std::vector<GatheredStage> gathered_;  // ZeRO-3: [stage - first]: its split run and its replicated run
  Device device_;
  double waited_ = 0.0;
  Trace* trace_ = nullptr;
  std::function<void()> on_gathered_;
};

// What averages one chunk's gradients over the DP group and updates its parameters.
class ChunkDataParallel {
 public:
  virtual ~ChunkDataParallel() = default;
  // before each of the executor's compute actions on the chunk
  virtual void before_compute(ActionType) {}
  // the chunk's last backward of the step has run: its reduction starts on the DP group's thread
  virtual void start_reduction() = 0;
  // waits for it: the gradients of owned_range are the DP group's average. Returns
  // the seconds waited (ZeRO-3: its gathers' waits too).
  virtual double wait_reduction() = 0;
  // AdamW on owned_range, then whatever gives every rank the parameters it keeps
  virtual void step(int step) = 0;

  virtual AdamW& optimizer() = 0;  // the moments of owned_range
  // the part of the chunk's buffer this rank averages and updates: all of it, or its shard
  virtual FlatRange owned_range() const = 0;
  virtual float* owned_params() = 0;  // (owned_range's floats)  their parameters
  virtual float* owned_grads() = 0;   // (same)  their averaged gradients
  // (P)  this rank's whole copy of the chunk's parameters; null when it keeps none (ZeRO-3)
  virtual float* replica() = 0;
  // floats of whole buffers lent for a while (ZeRO-2/3: gradients, gathered stages)
  virtual size_t lent_floats() const { return 0; }
  // after a resume wrote the whole replica (ZeRO-1/2): at bf16 the fp32 values to
  // update are taken from it, and it is rounded (ReplicatedParams::take_replica)
  virtual void replica_loaded() {}
  virtual void set_trace(Trace* trace) = 0;  // its collectives, on the data-parallel lane
};

// The technique --zero-stage asks for over `part` (ZeRO-2/3: with the part's
// ChunkParams, `params`; null below 2), its gradient reductions sent as grad_comm_dtype
// (bf16: rounded into a bf16 copy, 2 bytes a value, added in fp32, widened back), ZeRO-1's
// parameter all-gather as param_gather_dtype (ZeRO-2/3's: their ChunkParams').
std::unique_ptr<ChunkDataParallel> make_chunk_data_parallel(Comm& dp, TPPart& part, ChunkParams* params,
                                                            int zero_stage, const AdamWConfig& adamw,
                                                            float bucket_mb, DType grad_comm_dtype,
                                                            DType param_gather_dtype);

}  // namespace course
