#include "common/train/checkpoint.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "common/model/adamw.h"
#include "common/tensor/error.h"
#include "common/train/cli.h"

namespace course {

namespace fs = std::filesystem;

// ----------------------------------------------------------------------------
// model shape

void write_model_meta(CheckpointWriter& writer, const GPTConfig& config) {
  writer.set_meta("vocab_size", config.vocab_size);
  writer.set_meta("seq_len", config.seq_len);
  writer.set_meta("n_layer", config.n_layer);
  writer.set_meta("d_model", config.d_model);
  writer.set_meta("n_head", config.n_head);
  if (config.n_experts > 0) {
    writer.set_meta("n_experts", config.n_experts);
    writer.set_meta("top_k", config.top_k);
  }
}

GPTConfig model_from_meta(const std::function<int64_t(const std::string&)>& saved) {
  GPTConfig config;
  config.vocab_size = static_cast<int>(saved("vocab_size"));
  config.seq_len = static_cast<int>(saved("seq_len"));
  config.n_layer = static_cast<int>(saved("n_layer"));
  config.d_model = static_cast<int>(saved("d_model"));
  config.n_head = static_cast<int>(saved("n_head"));
  config.n_experts = static_cast<int>(saved("n_experts"));
  if (config.n_experts > 0) config.top_k = static_cast<int>(saved("top_k"));
  return config;
}

void check_model_meta(const CheckpointReader& reader, const GPTConfig& config, const std::string& path) {
  check_model_shape([&](const std::string& key) { return reader.meta(key); }, config, path);
}

void check_model_shape(const std::function<int64_t(const std::string&)>& saved_meta, const GPTConfig& config,
                       const std::string& path) {
  const std::pair<const char*, std::pair<const char*, int>> fields[] = {
      {"vocab_size", {"vocabulary", config.vocab_size}}, {"seq_len", {"--seq", config.seq_len}},
      {"n_layer", {"--layers", config.n_layer}},          {"d_model", {"--d-model", config.d_model}},
      {"n_head", {"--heads", config.n_head}},
  };
  for (const auto& [key, flag_and_value] : fields) {
    int64_t saved = saved_meta(key);
    if (saved != flag_and_value.second) {
      throw FlagError("checkpoint '" + path + "' was written with " + flag_and_value.first + " " +
                        std::to_string(saved) + ", this run has " + flag_and_value.first + " " +
                        std::to_string(flag_and_value.second) +
                        " (hint: resume with the same model flags, or use a fresh --checkpoint-dir)");
    }
  }
  // dense or mixture of experts, and how many experts: the blocks' parameters
  const auto blocks = [](int64_t experts) {
    return experts == 0 ? std::string("dense blocks (no --experts)") : "--experts " + std::to_string(experts);
  };
  const int64_t saved_experts = saved_meta("n_experts");
  if (saved_experts != config.n_experts) {
    throw FlagError("checkpoint '" + path + "' was written with " + blocks(saved_experts) + ", this run has " +
                     blocks(config.n_experts) +
                     " (hint: resume with the same model flags, or use a fresh --checkpoint-dir)");
  }
  if (config.n_experts > 0 && saved_meta("top_k") != config.top_k) {
    throw FlagError("checkpoint '" + path + "' was written with --top-k " + std::to_string(saved_meta("top_k")) +
                     ", this run has --top-k " + std::to_string(config.top_k) +
                     " (hint: resume with the same model flags, or use a fresh --checkpoint-dir)");
  }
}

// ----------------------------------------------------------------------------
// files in a checkpoint directory

void ensure_checkpoint_dir(const std::string& dir) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error || !fs::is_directory(dir)) {
    throw UsageError("--checkpoint-dir: cannot create directory '" + dir + "'" +
                     (error ? ": " + error.message() : std::string()) + " (hint: pick a writable path)");
  }
}

std::string checkpoint_path(const std::string& dir, int step, const std::string& suffix) {
  char name[64];
  std::snprintf(name, sizeof(name), "step_%08d", step);
  return (fs::path(dir) / (std::string(name) + suffix + ".ckpt")).string();
}

// Steps of the files "step_<8 digits><suffix><extension>" in dir, sorted ascending.
static std::vector<int> checkpoint_steps(const std::string& dir, const std::string& suffix,
                                         const std::string& extension = ".ckpt") {
  std::vector<int> steps;
  std::error_code error;
  if (!fs::is_directory(dir, error)) return steps;
  const std::string tail = suffix + extension;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    std::string name = entry.path().filename().string();
    if (name.size() != 13 + tail.size() || name.rfind("step_", 0) != 0 ||
        name.compare(13, std::string::npos, tail) != 0) {
      continue;
    }
    std::string digits = name.substr(5, 8);
    if (digits.find_first_not_of("0123456789") == std::string::npos) steps.push_back(std::stoi(digits));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<std::string> latest_checkpoint(const std::string& dir, const std::string& suffix) {
  std::vector<int> steps = checkpoint_steps(dir, suffix);
  if (steps.empty()) return std::nullopt;
  return checkpoint_path(dir, steps.back(), suffix);
}

void prune_checkpoints(const std::string& dir, int keep, const std::string& suffix, const std::string& extension) {
  std::vector<int> steps = checkpoint_steps(dir, suffix, extension);
  for (size_t i = 0; i + keep < steps.size(); i++) {
    std::error_code ignored;  // a file that is already gone is fine
    const std::string path = checkpoint_path(dir, steps[i], suffix);  // "....ckpt"
    fs::remove(path.substr(0, path.size() - 5) + extension, ignored);
  }
}

std::string rank_suffix(int rank) { return "_rank" + std::to_string(rank); }

void remove_stale_checkpoint_files(const std::string& dir, bool per_rank) {
  // the steps rank 0 still keeps (prune_checkpoints has run): every other step is gone
  const std::vector<int> kept = checkpoint_steps(dir, rank_suffix(0));
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) != 0) continue;  // not a checkpoint's
    // "step_00000008_rank1.ckpt.tmp9648": a writer died before its rename
    const bool temporary = name.find(".tmp") != std::string::npos;
    // "step_00000004_rank5.ckpt" of a step rank 0 no longer keeps: a larger run's
    // rank, which no rank of this run prunes
    const bool pruned_step = per_rank && !temporary && name.find("_rank") != std::string::npos &&
                             std::find(kept.begin(), kept.end(), std::atoi(name.c_str() + 5)) == kept.end();
    std::error_code ignored;  // already gone is fine
    if (temporary || pruned_step) fs::remove(entry.path(), ignored);
  }
}

std::optional<std::string> latest_complete_rank_checkpoint(const std::string& dir) {
  const std::vector<int> steps = checkpoint_steps(dir, rank_suffix(0));
  for (auto step = steps.rbegin(); step != steps.rend(); ++step) {
    const std::string first = checkpoint_path(dir, *step, rank_suffix(0));
    const int64_t ranks = CheckpointReader(first).meta("world_size");
    bool complete = true;
    for (int64_t rank = 1; rank < ranks && complete; rank++) {
      complete = fs::exists(checkpoint_path(dir, *step, rank_suffix(static_cast<int>(rank))));
    }
    if (complete) return first;
  }
  return std::nullopt;
}

// ----------------------------------------------------------------------------
// a replicated model's training state

void write_run_meta(CheckpointWriter& writer, const TrainOptions& options, int step) {
  write_model_meta(writer, options.model);
  writer.set_meta("step", step);
  writer.set_meta("seed", static_cast<int64_t>(options.seed));
  writer.set_meta("global_batch", options.batch);
}

void write_rank_meta(CheckpointWriter& writer, const TrainOptions& options, int step, int world_size, int rank) {
  write_run_meta(writer, options, step);
  // a rank's file means nothing without the cut that made it
  writer.set_meta("world_size", world_size);
  writer.set_meta("rank", rank);
}

void save_training_state(const std::string& path, const TrainOptions& options, int step, const float* params,
                         const AdamW& optimizer) {
  CheckpointWriter writer;
  write_run_meta(writer, options, step);
  const Device device = optimizer.m.device();  // the parameters live with their optimizer state
  writer.add_section("params", params, optimizer.count(), device);
  writer.add_section("adam_m", optimizer.m.data(), optimizer.count(), device);
  writer.add_section("adam_v", optimizer.v.data(), optimizer.count(), device);
  writer.write(path);
}

int load_training_state(const std::string& path, const TrainOptions& options, float* params, AdamW& optimizer) {
  CheckpointReader reader(path);
  check_model_meta(reader, options.model, path);
  check_seed_and_batch([&](const std::string& key) { return reader.meta(key); }, options, path);
  const Device device = optimizer.m.device();
  reader.read_section("params", params, optimizer.count(), device);
  reader.read_section("adam_m", optimizer.m.data(), optimizer.count(), device);
  reader.read_section("adam_v", optimizer.v.data(), optimizer.count(), device);
  return static_cast<int>(reader.meta("step"));
}

void check_seed_and_batch(const std::function<int64_t(const std::string&)>& saved, const TrainOptions& options,
                          const std::string& path) {
  if (saved("seed") != static_cast<int64_t>(options.seed) || saved("global_batch") != options.batch) {
    throw FlagError("checkpoint '" + path + "' was written with --seed " + std::to_string(saved("seed")) +
                     " --batch " + std::to_string(saved("global_batch")) + ", this run has --seed " +
                     std::to_string(options.seed) + " --batch " + std::to_string(options.batch) +
                     " (hint: resume with the same flags, or use a fresh --checkpoint-dir)");
  }
}

}  // namespace course
