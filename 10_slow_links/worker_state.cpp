// A worker's checkpoint (worker_state.h).
#include "10_slow_links/worker_state.h"

#include <optional>

#include "common/tensor/error.h"
#include "common/train/checkpoint.h"
#include "common/train/trainer_parts.h"

namespace course {

void save_worker_state(const TrainOptions& options, int step, int world_size, int rank, Device device,
                       const std::vector<StateSection>& sections, const std::vector<std::pair<std::string, int>>& meta) {
  CheckpointWriter writer;
  write_rank_meta(writer, options, step, world_size, rank);
  for (const auto& [key, value] : meta) writer.set_meta(key, value);
  for (const StateSection& section : sections) writer.add_section(section.name, section.data, section.count, device);
  writer.write(checkpoint_path(options.checkpoint_dir, step, rank_suffix(rank)));
}

int resume_worker_state(const TrainOptions& options, int world_size, int rank, Device device,
                        const std::vector<StateSection>& sections, const std::vector<std::pair<std::string, int>>& meta) {
  const std::optional<std::string> newest = checkpoint_to_resume(options, /*per_rank=*/true, rank == 0);
  if (!newest) return 1;
  const int step = static_cast<int>(CheckpointReader(*newest).meta("step"));
  const std::string path = checkpoint_path(options.checkpoint_dir, step, rank_suffix(rank));
  const CheckpointReader reader(path);
  check_model_meta(reader, options.model, path);
  check_seed_and_batch([&](const std::string& key) { return reader.meta(key); }, options, path);
  if (reader.meta("world_size") != world_size) {
    throw FlagError(path + " is one of " + std::to_string(reader.meta("world_size")) + " workers' files, and this run " +
                    "has " + std::to_string(world_size) + ": each worker resumes its own weights (hint: launch " +
                    std::to_string(reader.meta("world_size")) + " ranks)");
  }
  for (const auto& [key, value] : meta) {
    if (!reader.has_meta(key) || reader.meta(key) != value) {
      throw FlagError(path + " was written with another " + key + " (" +
                      (reader.has_meta(key) ? std::to_string(reader.meta(key)) : "none") + ", this run " +
                      std::to_string(value) + "): its outer state belongs to that run (hint: resume with the same " +
                      "--algorithm, --inner-steps, --fragments and --grad-compression)");
    }
  }
  for (const StateSection& section : sections) reader.read_section(section.name, section.data, section.count, device);
  if (step >= options.steps) {
    throw FlagError(path + " is already at step " + std::to_string(step) + " of --steps " +
                    std::to_string(options.steps) + ": nothing to train (hint: raise --steps)");
  }
  if (rank == 0) print_resumed(*newest, " and the other workers' files", step + 1);
  return step + 1;
}

}  // namespace course
