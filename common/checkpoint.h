// Checkpoints: named float sections plus integer metadata, in one file that is
// written atomically and verified on load.
//
// File layout (little-endian):
//   "GPTCKPT1" | u64 payload bytes | u64 FNV-1a checksum of the payload | payload
//   payload = u32 #meta, {u32 key length, key, i64 value}...,
//             u32 #sections, {u32 name length, name, u64 count, float[count]}...
//
// Writing goes to "<path>.tmp<pid>", is flushed, then renamed over <path>: a crash
// mid-write leaves the previous checkpoint intact. Reading checks the magic, the
// length (truncation), the checksum (corruption) and every section's size
// (shape mismatch), and says which one failed.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/model.h"

namespace course {

class CheckpointWriter {
 public:
  void set_meta(const std::string& key, int64_t value);
  // data: (count) floats on `device`; the file holds host bytes whatever the device,
  // so a checkpoint written from a GPU loads on the CPU and the other way round.
  void add_section(const std::string& name, const float* data, size_t count, Device device = Device::CPU);
  // Writes atomically; throws CourseError on any I/O failure.
  void write(const std::string& path) const;

 private:
  std::map<std::string, int64_t> meta_;
  std::vector<std::pair<std::string, std::vector<float>>> sections_;
};

class CheckpointReader {
 public:
  // Reads and verifies the whole file; throws CourseError naming the problem.
  explicit CheckpointReader(const std::string& path);

  int64_t meta(const std::string& key) const;
  // Whether the file has the key itself (meta() also answers absent_meta_value's keys).
  bool has_meta(const std::string& key) const;
  // How many floats section `name` holds (CourseError when there is none).
  size_t section_size(const std::string& name) const;
  // Copies section `name` into dst (on `device`); its element count must be exactly `count`.
  void read_section(const std::string& name, float* dst, size_t count, Device device = Device::CPU) const;

 private:
  std::string path_;
  std::map<std::string, int64_t> meta_;
  std::map<std::string, std::vector<float>> sections_;
};

// Writes head, then body, to "<path>.tmp<pid>", flushes, closes and renames it over
// path, so a crash or a write error mid-write leaves the previous file (or none),
// never half of one. `what` ("checkpoint", "trace", "timeline") names the file in
// errors: a CourseError (exit 1) naming path and the system's reason.
void write_file_atomically(const std::string& path, const std::string& head, const std::string& body,
                           const std::string& what);

// For an output the run writes at its end (--trace, --timeline): that
// write_file_atomically can create a file next to `path`, checked at the start
// rather than found after the whole run. UsageError naming `flag` otherwise.
void check_output_path(const std::string& flag, const std::string& path);

// The model shape goes into every checkpoint; loading into a different shape is
// refused (UsageError, exit 2) with a message naming the flag that differs. An MoE
// model adds n_experts and top_k (--capacity-factor and --aux-loss-coef are how it
// trains, like --lr: a run may resume with others); a dense model's files carry
// neither, as before MoE existed, and read as n_experts 0 (absent_meta_value).
void write_model_meta(CheckpointWriter& writer, const GPTConfig& config);
// What a meta key means when a file lacks it: n_experts 0 and top_k 0 (a dense
// model); nullopt for every key a file must have.
std::optional<int64_t> absent_meta_value(const std::string& key);
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
