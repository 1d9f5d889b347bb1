// Checkpoints of the model (common/train/checkpoint_file.h is their file format): the
// model's shape in every file and the check that a resume matches it, the files of a
// checkpoint directory (step names, the newest, pruning), and the training state of a
// replicated model (chapters 00 and 02: one file, written by rank 0).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "common/model/model.h"
#include "common/train/checkpoint_file.h"

namespace course {

// The model shape goes into every checkpoint; loading into a different shape is
// refused (UsageError, exit 2) with a message naming the flag that differs. An MoE
// model adds n_experts and top_k (--capacity-factor and --aux-loss-coef are how it
// trains, like --lr: a run may resume with others); a dense model's files carry
// neither, as before MoE existed, and read as n_experts 0 (absent_meta_value, checkpoint_file.h).
void write_model_meta(CheckpointWriter& writer, const GPTConfig& config);
void check_model_meta(const CheckpointReader& reader, const GPTConfig& config, const std::string& path);
// The model shape that meta describe (`saved` returns the value of a meta key).
GPTConfig model_from_meta(const std::function<int64_t(const std::string&)>& saved);
// The same check on meta read any other way (a checkpoint manifest's): `saved`
// returns the value of a meta key.
void check_model_shape(const std::function<int64_t(const std::string&)>& saved, const GPTConfig& config,
                       const std::string& path);

// Creates the directory (and its parents) if needed; UsageError when it cannot.
void ensure_checkpoint_dir(const std::string& dir);
// "<dir>/step_00000120<suffix>.ckpt"; the suffix tells ranks apart in sharded chapters.
std::string checkpoint_path(const std::string& dir, int step, const std::string& suffix = "");
// The newest checkpoint with this suffix in dir, if any.
std::optional<std::string> latest_checkpoint(const std::string& dir, const std::string& suffix = "");
// Deletes all but the newest `keep` checkpoints with this suffix (or, with another
// extension, files "step_00000120<suffix><extension>": the manifests).
void prune_checkpoints(const std::string& dir, int keep, const std::string& suffix = "",
                       const std::string& extension = ".ckpt");

// "_rank3": the suffix of rank 3's file in the chapters where every rank saves its
// own share of the state (03 to 06).
std::string rank_suffix(int rank);
// After a save that every rank finished, and after pruning: removes what no resume
// will read, the temporary files of writers that died before their rename
// (`*.tmp<pid>`) and, in a chapter where every rank saves its part (per_rank), every
// rank's file of a step that rank 0 no longer keeps (a larger run's ranks, which no
// rank of this run prunes). Never before a complete save: until then they may be all
// there is.
void remove_stale_checkpoint_files(const std::string& dir, bool per_rank);
// The newest step that every rank finished saving, as rank 0's file: rank 0's file
// records the world size, and every rank's file of that step must exist. A crash
// can stop a save after some ranks have written theirs: that step is skipped and
// the one before it resumed. (A file that exists is whole, since each is written
// atomically; a damaged one is refused when its rank loads it, naming it.)
std::optional<std::string> latest_complete_rank_checkpoint(const std::string& dir);

}  // namespace course

namespace course {

struct TrainOptions;
class AdamW;

// What every training checkpoint records: the model shape, the step, and the seed
// and global batch (the sampler is stateless, so these and the step are its
// position; resuming with others would silently train on other data).
void write_run_meta(CheckpointWriter& writer, const TrainOptions& options, int step);
// The same plus the world size and the rank, for a file that holds one rank's share
// of the state (sharded and model-parallel chapters).
void write_rank_meta(CheckpointWriter& writer, const TrainOptions& options, int step, int world_size, int rank);

// The full training state of a replicated model: parameters, AdamW moments and the
// step (the sampler is stateless, so the step is its position). Also records the
// seed and global batch: resuming with different ones would silently train on
// other data, so load refuses.
void save_training_state(const std::string& path, const TrainOptions& options, int step, const float* params,
                         const AdamW& optimizer);
// params live on the optimizer's device (a GPU's state is copied through the host).
// Loads into params and optimizer; returns the step the checkpoint was taken after.
int load_training_state(const std::string& path, const TrainOptions& options, float* params, AdamW& optimizer);
// UsageError unless the seed and global batch `saved` returns are this run's.
void check_seed_and_batch(const std::function<int64_t(const std::string&)>& saved, const TrainOptions& options,
                          const std::string& path);

}  // namespace course
