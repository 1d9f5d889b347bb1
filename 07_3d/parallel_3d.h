// Chapter 07's three axes, each an earlier chapter's technique placed on one
// direction of the process grid (07_3d/process_grid.h):
//
//   tp  chapter 06: every matrix split over the TP group (TPPart, f and g)
//   pp  chapter 05: the blocks cut into stages, micro-batches run by a schedule; a
//       stage is a TPPart here, which TPChunk hands to chapter 05's executor
//   dp  chapters 02/03: each pipeline chunk's gradients averaged over the DP group
//       with chapter 02's buckets, or with --zero-stage 1 chapter 03's sharded
//       optimizer as Megatron's distributed optimizer (reduce-scatter, AdamW on the
//       shard, all-gather), started as soon as the chunk's last backward has run;
//       --zero-stage 2 keeps only the gradient shard, 3 (FSDP) the parameter shard too
//
// Nothing here is new technique: it is the glue that lets the three compose, and
// the place (GridPlace) that tells a rank which part of each axis is its own.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "05_pipeline/pipeline.h"
#include "05_pipeline/schedule.h"
#include "06_tensor_parallel/tp_model.h"
#include "common/model/adamw.h"
#include "common/train/cli.h"
#include "07_3d/data_parallel.h"
#include "07_3d/process_grid.h"
#include "common/train/trainer.h"

namespace course {

// ----------------------------------------------------------------------------
// where a rank sits

// Chapter 07's own flags: the grid's sizes and order, what runs on tp and dp, and
// (ScheduleFlags) the pipeline's schedule.
struct GridFlags : ScheduleFlags {
  int dp = 0, pp = 1, tp = 1;        // --dp --pp --tp (0: inferred from the world size)
  std::string order = "dp-pp-tp";    // --grid-order: the axes in the rank formula, outermost first
  bool sequence_parallel = false;    // --sp
  int zero_stage = 0;                // --zero-stage: 0 DDP buckets over dp, 1 ZeRO-1, 2, 3 (FSDP)
  bool reshard_after_forward = false;  // --reshard-after-forward: ZeRO-3 gathers per micro-batch
  float bucket_mb = 25.0f;           // --bucket-mb
  DType grad_comm_dtype = DType::F32;  // --grad-comm-dtype: what the dp axis's gradients travel as
};
void add_grid_flags(ArgParser& parser, GridFlags& flags);

// One rank's place on the grid, and what follows from it: its coordinates, its
// three groups, and the pipeline's schedule and cut, which give it its chunks.
struct GridPlace {
  // The grid the flags ask for on the run's ranks (a FlagError when the world does
  // not factor, the TP degree does not divide the model, or the schedule cannot cut
  // it), then the groups: collective over the world (split_grid).
  GridPlace(Run& run, const GridFlags& flags);

  int dp_rank() const { return me.dp; }
  int dp_size() const { return grid.dp_size(); }
  int pp_rank() const { return me.pp; }
  Comm& pp_group() const { return *groups.pp; }  // this rank's pipeline
  // the stages of this rank's chunk c
  StageRange chunk_stages(int chunk) const { return cut[schedule.stage(me.pp, chunk)]; }
  // The loss of a step, for the report: the mean of the pipelines' last stages, each
  // told by its tp 0 (one all-reduce over the world).
  float report_loss(Comm& world, float loss) const;
  // the summary's description of the layout: dp, pp, tp, sequence_parallel, zero_stage
  JsonLine summary_fields() const;
  // rank 0, under the run header: the grid, what runs on its axes, and every group
  void print(const std::string& backend, int micro_batch) const;

  GridFlags flags;
  ProcessGrid grid;
  int rank;
  GridCoords me;
  Schedule schedule;  // made before the groups: a bad schedule is a flag error, before any collective
  GridComms groups;
  std::vector<StageRange> cut;      // [stage]: split_stages for the schedule's stages
  std::vector<std::string> labels;  // [r]: "(1,0,1) embedding + blocks 0-1": rank r's (dp,pp,tp), its stages
};

// ----------------------------------------------------------------------------
// pp x tp: a tensor-parallel stage as a pipeline chunk

// The executor moves what crosses between stages; here that is each TP rank's
// copy of the residual stream, (B, T, C), or with --sp its chunk of the sequence,
// (B, T/tp, C): rank (dp, pp, tp) sends to (dp, pp+1, tp), the same tp coordinate.
class TPChunk : public PipelineChunk {
 public:
  // the part's stages are [first_stage, last_stage]; every chunk of a rank shares one
  // workspace (and its recomputation buffer). split_backward: for zb-h1, whose
  // activations keep what the deferred weight half needs; recompute: what they do not
  // keep (tp_model.h)
  TPChunk(TPPart& part, TPGroup& tp, TPWorkspace& workspace, const GPTConfig& config, int first_stage,
          int last_stage, bool split_backward, Recompute recompute);
  std::unique_ptr<ChunkActivations> new_activations() override;
  size_t activation_floats() const override;
  size_t shared_activation_floats() const override;  // the TP workspace's recomputed block
  size_t boundary_floats() const override;
  void forward(ChunkActivations& acts, StepLoss& loss) override;
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
  Recompute recompute_;
};

// What one rank holds: a TPPart per chunk, its stages sliced over the TP group,
// and the same chunks as the pipeline executor drives them. They share the TP
// group (f and g) and one workspace: one forward or backward runs at a time.
class GridChunks {
 public:
  // With --zero-stage 2 or 3 the parts keep no parameters: each gets them from its
  // ChunkParams (data_parallel.h), which these hold too.
  // The TP group's collectives go to `trace` and, as the waits of the "tp" axis, to `meters`.
  GridChunks(const TrainOptions& options, const GridPlace& place, int micro_batch, Device device, Trace& trace,
             StepMeters& meters);
  void zero_grad();
  // tp: with --sp, chunk c's replicated parameters' partial gradients summed over the group
  void finish_gradients(int chunk);

  std::vector<TPPart*> parts;                   // [chunk]
  std::vector<PipelineChunk*> pipeline_chunks;  // [chunk]: parts[chunk], as the executor drives it
  std::vector<ChunkParams*> params;             // [chunk]: ZeRO-2/3's parameters of parts[chunk]; empty below

 private:
  TPGroup tp_group_;
  TPWorkspace workspace_;
  std::vector<std::unique_ptr<ChunkParams>> owned_params_;
  std::vector<std::unique_ptr<TPPart>> owned_parts_;
  std::vector<std::unique_ptr<TPChunk>> owned_chunks_;
};

// ----------------------------------------------------------------------------
// dp: each chunk's technique over the DP group (data_parallel.h), and the optimizer step

class DataParallelOptimizer {
 public:
  // One ChunkDataParallel per chunk, as --zero-stage says.
  DataParallelOptimizer(Comm& dp, GridChunks& chunks, const GridFlags& flags, const TrainOptions& options);

  // The executor's hooks: before every compute action, the chunk's before_compute
  // (ZeRO-2/3 lend the whole gradient); when chunk c's last backward of the step has
  // run (on_gradients_done), tp's SP partial sums (GridChunks::finish_gradients),
  // then its reduction, under the backwards the pipeline still runs. Their
  // collectives go to `trace`'s data-parallel lane: they run under the pipeline's
  // TP and PP traffic.
  void attach(PipelineExecutor& executor, GridChunks& chunks, Trace* trace);
  // After the pipeline's step: waits for every chunk's reduction. Afterwards the
  // gradients this rank updates (owned_range) are the DP group's average. Returns
  // the seconds waited: the communication the pipeline did not hide (with ZeRO-3,
  // the gathers' waits too).
  double average_gradients();
  // Clips by the whole model's norm (clip_grid_gradients over the owned ranges).
  void clip_gradients(Comm& world, GridCoords me, float max_norm);
  // AdamW on what this rank owns, and each technique's all-gather.
  void step(int step);

  ChunkDataParallel& chunk(int c) { return *chunks_[c]; }
  int zero_stage() const { return zero_stage_; }
  // the executor's columns of the rank table, and at ZeRO-2/3 the most bytes of whole
  // buffers (chunks' gradients, stage 3's gathered stages) this rank held at once
  std::vector<RankColumn> memory_columns(std::vector<RankColumn> columns) const;
  // After training: a CourseError unless the DP replicas hold the same chunks (none
  // at stage 3: each holds its shard) and the TP group the same replicated parameters.
  void check_copies_agree(const GridPlace& place);
 private:
  void note_lent();  // updates peak_lent_ after a lend

  std::vector<TPPart*> parts_;
  int zero_stage_;
  std::vector<std::unique_ptr<ChunkDataParallel>> chunks_;  // [chunk]
  size_t peak_lent_ = 0;  // floats
};

// ----------------------------------------------------------------------------
// all three: the global gradient norm

// Clips by the norm of the whole model's gradient, each parameter counted once.
// updated[c] is the range of chunk c's gradients that is averaged on this rank and
// that it clips. dp: with DDP (sharded false) every replica holds the same averaged
// chunk, so only dp 0 counts; with ZeRO (sharded) each dp rank holds the average of
// its own shard only, the shards are disjoint, and every dp rank counts its shard.
// tp: the split range is disjoint (every rank counts its part of it) and the
// replicated range is the same everywhere (only tp 0 counts it). pp: the stages are
// disjoint (every pp rank counts its own). One all-reduce of one float over the
// world adds the counted squares.
// grads[c] holds those gradients, its element 0 being element updated[c].begin.
void clip_grid_gradients(Comm& world, GridCoords me, const std::vector<TPPart*>& chunks,
                         const std::vector<FlatRange>& updated, const std::vector<float*>& grads, bool sharded,
                         float max_norm);

// ----------------------------------------------------------------------------
// checkpoints: one file per rank and the step's manifest (common/train/checkpoint_manifest.h)
//
// Rank r's file holds, for each of its chunks c, sections chunk<c>_params,
// chunk<c>_adam_m and chunk<c>_adam_v: the TP slices of the chunk's stages, all of
// them, or with ZeRO (1, 2, 3) this rank's shard (the moments it keeps, and the same
// elements of the parameters: at ZeRO-3 the only ones it keeps). The manifest says which elements of which of chapter
// 00's parameters every section holds, so any layout loads any other's checkpoint:
// another dp x pp x tp, grid order, schedule or ZeRO stage is resharding, not an
// error, and tools/consolidate_checkpoint makes a chapter-00 checkpoint of it.

void save_grid_checkpoint(const TrainOptions& options, const GridPlace& place, int step, const GridChunks& chunks,
                          DataParallelOptimizer& optimizer);
// With --resume or after a restart: this rank's slices and moments from the newest
// step every rank finished saving, whatever layout wrote it. Returns the step to
// continue at.
int resume_grid_if_asked(const TrainOptions& options, const GridPlace& place, const GridChunks& chunks,
                         DataParallelOptimizer& optimizer, bool verbose);

}  // namespace course
