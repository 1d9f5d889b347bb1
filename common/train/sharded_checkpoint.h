// Saving and resuming a checkpoint whose state is spread over the ranks: the one
// implementation behind every chapter that writes one file per rank (03's ZeRO
// shards, 04/05's model parts, 06's TP slices, 07's grid). A chapter says only
// what each rank holds, as manifest pieces (checkpoint_manifest.h); this file
// writes the manifest and the files, and at resume reads each rank's pieces out
// of whichever files hold them, whatever cut wrote them (resharding).
//
//   save:   rank 0: step_N.manifest (every rank's shards)   then every rank:
//           step_N_rank<r>.ckpt: meta + per shard the sections params, adam_m, adam_v
//   resume: the newest step every rank finished -> its manifest checked against this
//           run -> load_pieces for each of this rank's targets
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/train/checkpoint_manifest.h"
#include "common/train/cli.h"

namespace course {

// How a chapter cuts the model, as its checkpoints say it.
struct ShardedCut {
  std::string layout;  // the manifest's layout line: "03_fsdp ZeRO-3 at 4 ranks: ..." (how it decides the cut)
  int ranks = 1;
  // rank r's shards, in its file's order: each one's section names and the pieces of
  // chapter 00's parameters it holds (the file name is filled in by save_sharded)
  std::function<std::vector<ManifestShard>(int rank)> shards_of;
  // what the resume line calls the other ranks' files: "files", or "shards" (ZeRO)
  std::string files_are = "files";
};

// Where one of this rank's shards lies in memory: its parameters and AdamW moments,
// each as many floats as the shard's pieces hold (read when saving, filled at resume).
struct ShardValues {
  const float* params = nullptr;
  const float* adam_m = nullptr;
  const float* adam_v = nullptr;
  Device device = Device::CPU;  // where all three are (copied to the host to be written)
};
struct ShardBuffers {
  float* params = nullptr;
  float* adam_m = nullptr;
  float* adam_v = nullptr;
  Device device = Device::CPU;  // where all three are (the file's values copied there)
};

// Rank 0 writes the step's manifest first (so a step whose every file exists has
// one), then every rank writes its shards (`mine`, in shards_of(rank)'s order) and
// the chapter's own `meta` into checkpoint_path(dir, step, rank_suffix(rank)).
void save_sharded(const TrainOptions& options, int step, int rank, const ShardedCut& cut,
                  const std::vector<ShardValues>& mine,
                  const std::vector<std::pair<std::string, int64_t>>& meta = {});

// What to read at resume: `pieces` of chapter 00's parameters, end to end, into any
// of the three buffers (null: not wanted). A rank may want more than it saved: a
// ZeRO-1 rank saves its shard of the parameters and reads back its whole replica.
struct ShardTarget {
  std::vector<ManifestPiece> pieces;
  ShardBuffers buffers;
};

// With --resume or after a restart (resume_wanted): fills the targets from the
// newest checkpoint every rank finished saving, at any cut, and returns the step to
// continue at; 1 when there is none yet. `verbose` prints what was resumed (and
// that this run reshards, when cut.layout is not the saved one).
int resume_sharded(const TrainOptions& options, const ShardedCut& cut, const std::vector<ShardTarget>& targets,
                   bool verbose);
// The usual case: read back exactly what this rank saves, shards_of(rank) into `mine`.
int resume_sharded(const TrainOptions& options, int rank, const ShardedCut& cut, const std::vector<ShardBuffers>& mine,
                   bool verbose);

}  // namespace course
