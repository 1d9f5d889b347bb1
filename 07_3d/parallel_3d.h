// Chapter 07's three axes, each an earlier chapter's technique placed on one
// direction of the process grid (common/process_grid.h):
//
//   tp  chapter 06: every matrix split over the TP group (TPPart, f and g)
//   pp  chapter 05: the blocks cut into stages, micro-batches run by a schedule; a
//       stage is a TPPart here, which TPChunk hands to chapter 05's executor
//   dp  chapters 02/03: each pipeline chunk's gradients averaged over the DP group
//       with chapter 02's buckets, or with --zero-stage 1 chapter 03's sharded
//       optimizer (ZeRO-1)
//
// Nothing here is new technique: it is the glue that lets the three compose.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "02_ddp/ddp.h"
#include "03_fsdp/zero.h"
#include "05_pipeline/pipeline.h"
#include "06_tensor_parallel/tp_model.h"
#include "common/adamw.h"
#include "common/cli.h"
#include "common/process_grid.h"

namespace course {

// ----------------------------------------------------------------------------
// pp x tp: a tensor-parallel stage as a pipeline chunk

// The executor moves what crosses between stages; here that is each TP rank's
// copy of the residual stream, (B, T, C), or with --sp its chunk of the sequence,
// (B, T/tp, C): rank (dp, pp, tp) sends to (dp, pp+1, tp), the same tp coordinate.
class TPChunk : public PipelineChunk {
 public:
  // the part's stages are [first_stage, last_stage]; every chunk of a rank shares one
  // workspace. split_backward: for zb-h1, whose activations keep what the deferred
  // weight half needs (tp_model.h)
  TPChunk(TPPart& part, TPGroup& tp, TPWorkspace& workspace, const GPTConfig& config, int first_stage,
          int last_stage, bool split_backward);
  std::unique_ptr<ChunkActivations> new_activations() override;
  size_t activation_floats() const override;
  size_t boundary_floats() const override;
  float forward(ChunkActivations& acts) override;
  const float* output(const ChunkActivations& acts) const override;
  void backward(ChunkActivations& acts, const float* dout, float* dinput, float dloss) override;
  bool splits_backward() const override { return split_backward_; }
  void backward_input(ChunkActivations& acts, const float* dout, float* dinput, float dloss) override;
  void backward_weight(ChunkActivations& acts) override;

 private:
  TPPart& part_;
  TPGroup& tp_;
  TPWorkspace& workspace_;
  GPTConfig config_;
  int first_stage_, last_stage_;
  bool split_backward_;
};

// ----------------------------------------------------------------------------
// dp: averaging each chunk's gradients over the DP group, and the optimizer

class DataParallelOptimizer {
 public:
  // zero_stage 0: every DP rank keeps AdamW for its whole chunks, gradients
  // all-reduced in buckets of bucket_mb (chapter 02); 1: ZeRO-1, each DP rank keeps
  // the moments of 1/dp of every chunk and all-gathers the updated parameters
  // (chapter 03).
  DataParallelOptimizer(Comm& dp, std::vector<TPPart*> chunks, int zero_stage, double bucket_mb,
                        const AdamWConfig& adamw);

  // After the pipeline's step: every chunk's gradients become the DP group's average.
  void average_gradients();
  // AdamW on what this rank owns; with ZeRO-1 the all-gather of the updated shards.
  void step(int step);

  // the moments of chunk c that this rank keeps (all of them, or its ZeRO shard),
  // and where they start in the chunk's buffer
  AdamW& optimizer(int chunk);
  size_t optimizer_begin(int chunk) const;
  // --trace: every bucket's all-reduce (ZeRO-1: the all-reduce, the update, the all-gather)
  void set_trace(Trace* trace);

 private:
  std::vector<TPPart*> chunks_;
  std::vector<std::unique_ptr<DDP>> ddp_;     // zero_stage 0, one per chunk
  std::vector<std::unique_ptr<AdamW>> adamw_;
  std::vector<std::unique_ptr<ZeRO>> zero_;  // zero_stage 1, one per chunk
};

// ----------------------------------------------------------------------------
// all three: the global gradient norm

// Clips by the norm of the whole model's gradient, each parameter counted once:
// after averaging every DP replica holds the same gradients, so only dp 0 counts;
// within a TP group the split range is disjoint (every rank counts it) and the
// replicated range is the same everywhere (only tp 0 counts it); the pipeline's
// stages are disjoint (every pp rank counts its own). One all-reduce of one float
// over the world adds the counted squares.
void clip_grid_gradients(Comm& world, GridCoords me, const std::vector<TPPart*>& chunks, float max_norm);

// ----------------------------------------------------------------------------
// checkpoints: one file per rank and the step's manifest (common/checkpoint_manifest.h)
//
// Rank r's file holds, for each of its chunks c, sections chunk<c>_params,
// chunk<c>_adam_m and chunk<c>_adam_v: the TP slices of the chunk's stages, all of
// them, or with ZeRO-1 this rank's shard (the moments it keeps, and the same
// elements of the parameters). The manifest says which elements of which of chapter
// 00's parameters every section holds, so any layout loads any other's checkpoint:
// another dp x pp x tp, schedule or ZeRO stage is resharding, not an error, and
// tools/consolidate_checkpoint makes a chapter-00 checkpoint of it.

// (cut: split_stages for the schedule's stages)
void save_grid_checkpoint(const TrainOptions& options, const Comm& world, const Schedule& schedule,
                          const std::vector<StageRange>& cut, const ProcessGrid& grid, int step, const std::vector<TPPart*>& chunks,
                          DataParallelOptimizer& optimizer, int zero_stage);
// With --resume or after a restart: this rank's slices and moments from the newest
// step every rank finished saving, whatever layout wrote it. Returns the step to
// continue at.
int resume_grid_if_asked(const TrainOptions& options, const Schedule& schedule, const std::vector<StageRange>& cut,
                         const ProcessGrid& grid, GridCoords me, const std::vector<TPPart*>& chunks, DataParallelOptimizer& optimizer,
                         int zero_stage, bool verbose);

}  // namespace course
