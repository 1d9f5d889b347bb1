// The parts a trainer is assembled from, the same in every chapter and not its
// technique: the device, AdamW's settings, the run header, resuming and saving, when to
// checkpoint, the checks that copies agree. (common/train/trainer.h is the loop that
// runs a chapter's steps; this file holds what that loop and the chapters call.)
#pragma once

#include <optional>
#include <string>

#include "common/model/adamw.h"
#include "common/train/checkpoint_manifest.h"
#include "common/train/cli.h"
#include "common/model/data.h"
#include "common/tensor/bf16.h"
#include "common/tensor/device.h"
#include "common/train/metrics.h"
#include "common/train/trace.h"

namespace course {

class Comm;

// Picks the device (--device) and how its matmuls compute (--dtype, --tf32).
Device setup_device(const TrainOptions& options);

// What activations and their gradients travel as between ranks (a pipeline's stage
// boundary, tensor parallelism's f and g), and ZeRO's gathered parameters: bf16 under
// --dtype bf16, half the bytes; fp32 otherwise.
DType message_dtype(const TrainOptions& options);

// AdamW as every chapter configures it: --lr and --weight-decay, GPT-2's betas (0.9, 0.95).
AdamWConfig adamw_config(const TrainOptions& options);

// A parallel degree that spans the whole world (chapter 04/05's --pp, 06's --tp):
// 0 means the world size; any other value must equal it, or a FlagError says how
// to launch ("--tp 4 needs 4 ranks and this run has 2 (hint: ...)").
int whole_world_degree(const std::string& flag, int value, int world_size);

// "model: ... parameters" and "batch: ..." lines (and on a GPU, "device: ..."). The
// rank trains on `my_rows` of every global batch (its data-parallel slice), in
// --micro-batches pieces.
void print_run_header(const TrainOptions& options, const TextData& data, RowSlice my_rows);

// The run's training flags and communication backend ("none" for one device) as
// summary fields, for the course report: RunReport adds the model shape and the machine.
JsonLine run_configuration(const TrainOptions& options, const std::string& backend);

// Whether this run continues from a checkpoint: with --resume, and in a group that
// the launcher restarted (TORCHELASTIC_RESTART_COUNT > 0) when --checkpoint-dir is
// set. A launcher restarts a failed group so that it goes on from its last
// checkpoint, not so that it trains from step 1 again.
bool resume_wanted(const TrainOptions& options);

// The checkpoint to resume from, when resume_wanted: the newest in --checkpoint-dir
// (per_rank: the newest that every rank finished saving, as rank 0's file; see
// latest_complete_rank_checkpoint). None when none is wanted, or when there is none
// yet, which `verbose` says.
std::optional<std::string> checkpoint_to_resume(const TrainOptions& options, bool per_rank, bool verbose);

// A sharded chapter's resume, when resume_wanted: the manifest of the newest step
// every rank finished saving (common/train/checkpoint_manifest.h), or of a newer file of
// the whole model in chapter 00's format (whole_checkpoint_manifest: chapter 00's
// own, or an imported one), checked against this run (model shape, seed, batch, a
// step below --steps), and rank 0's file of that step (or the whole file) in
// *newest, for print_resumed. None when there is nothing to resume. When
// the manifest's layout is not `this_layout` (another world size, stage, --pp or
// --tp), `verbose` says that this run reshards it: each rank then loads its own
// pieces with load_pieces, whatever cut wrote them.
std::optional<CheckpointManifest> manifest_to_resume(const TrainOptions& options, const std::string& this_layout,
                                                     bool verbose, std::string* newest);

// "resumed from PATH<others>: continuing at step N", saying why when the launcher
// restarted the group; `others` names the other ranks' files in sharded chapters.
void print_resumed(const std::string& path, const std::string& others, int next_step);

// With resume_wanted, loads the newest checkpoint of a replicated model into params
// and optimizer and returns the step to continue at; otherwise (or when there is
// none yet) returns 1. Refuses a checkpoint that already reached --steps.
int resume_if_asked(const TrainOptions& options, float* params, AdamW& optimizer, bool verbose);
// Its counterpart: the training state of a replicated model (common/train/checkpoint.h's
// save_training_state) into --checkpoint-dir's file of `step`.
void save_training_state(const TrainOptions& options, int step, const float* params, const AdamW& optimizer);

// Whether to save after `step`: every --checkpoint-every steps, and after the last.
// Every rank asks after every step, so this is also where the restart tests make
// a rank die between two checkpoints (die_at_step, common/comm/test_faults.h).
bool checkpoint_due(const TrainOptions& options, int step);

// Copies must stay identical (data-parallel replicas, tensor-parallel replicated
// parameters): false if any rank's values differ from rank 0's. It compares a
// checksum, so it costs one tiny all_gather (and on a device, one copy to the host).
bool replicas_identical(Comm& comm, const float* params, size_t count, Device device);
// After training, on every rank of `comm`: a CourseError naming `what` (e.g. "the
// replicas' parameters") unless every rank holds the same values.
void check_copies_agree(Comm& comm, const float* params, size_t count, Device device, const std::string& what);

// After the last step of a run with --trace: every rank writes its file, and with
// several ranks rank 0 merges them (merged_trace_path) once all are complete. Rank 0
// says which file to open. Collective over `world`; nullptr for a single process
// (chapter 00). Does nothing without --trace.
void finish_trace(Trace& trace, const std::string& path, Comm* world);

}  // namespace course
