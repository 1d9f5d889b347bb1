#include "common/train/sharded_checkpoint.h"

#include <cstdio>

#include "common/train/checkpoint.h"
#include "common/tensor/error.h"
#include "common/train/trainer_parts.h"

namespace course {

void save_sharded(const TrainOptions& options, int step, int rank, const ShardedCut& cut,
                  const std::vector<ShardValues>& mine, const std::vector<std::pair<std::string, int64_t>>& meta) {
  if (rank == 0) {  // before its own file: a step whose every file exists has its manifest
    CheckpointManifest manifest = start_manifest(options, step, cut.ranks, cut.layout);
    for (int r = 0; r < cut.ranks; r++) {
      for (ManifestShard& shard : cut.shards_of(r)) {
        shard.file = rank_file_name(step, r);
        manifest.shards.push_back(std::move(shard));
      }
    }
    save_manifest(options.checkpoint_dir, manifest);
  }
  const std::vector<ManifestShard> shards = cut.shards_of(rank);
  if (shards.size() != mine.size()) {
    throw CourseError("rank " + std::to_string(rank) + ": " + std::to_string(mine.size()) + " buffers for " +
                      std::to_string(shards.size()) + " checkpoint shards (a bug in the chapter's cut)");
  }
  CheckpointWriter writer;
  write_rank_meta(writer, options, step, cut.ranks, rank);
  for (const auto& [key, value] : meta) writer.set_meta(key, value);
  for (size_t i = 0; i < shards.size(); i++) {
    const size_t count = shards[i].floats();
    writer.add_section(shards[i].params, mine[i].params, count, mine[i].device);
    writer.add_section(shards[i].adam_m, mine[i].adam_m, count, mine[i].device);
    writer.add_section(shards[i].adam_v, mine[i].adam_v, count, mine[i].device);
  }
  writer.write(checkpoint_path(options.checkpoint_dir, step, rank_suffix(rank)));
}

int resume_sharded(const TrainOptions& options, const ShardedCut& cut, const std::vector<ShardTarget>& targets,
                   bool verbose) {
  std::string newest;
  const auto manifest = manifest_to_resume(options, cut.layout, verbose, &newest);
  if (!manifest) return 1;
  for (const ShardTarget& target : targets) {
    load_pieces(*manifest, options.checkpoint_dir, target.pieces, target.buffers.params, target.buffers.adam_m,
                target.buffers.adam_v, target.buffers.device);
  }
  const int step = static_cast<int>(manifest->get("step"));
  const std::string others = manifest->get("world_size") > 1 ? " (and the other ranks' " + cut.files_are + ")" : "";
  if (verbose) print_resumed(newest, others, step + 1);
  return step + 1;
}

int resume_sharded(const TrainOptions& options, int rank, const ShardedCut& cut, const std::vector<ShardBuffers>& mine,
                   bool verbose) {
  const std::vector<ManifestShard> shards = cut.shards_of(rank);
  std::vector<ShardTarget> targets;
  for (size_t i = 0; i < shards.size() && i < mine.size(); i++) targets.push_back({shards[i].pieces, mine[i]});
  return resume_sharded(options, cut, targets, verbose);
}

}  // namespace course
