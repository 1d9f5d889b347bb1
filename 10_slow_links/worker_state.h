// What a worker saves and resumes: one file per rank holding its own weights, its
// inner optimizer's moments, the outer optimizer's global weights and momentum, and
// what error feedback carries, as named sections. Every worker's file differs (the
// workers drift apart between outer steps), so every rank writes and reads its own.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "common/tensor/memory.h"
#include "common/train/cli.h"

namespace course {

struct StateSection {
  std::string name;  // "params", "adam_m", "global", "momentum", "residual_0", ...
  float* data;       // (count)  on the run's device
  size_t count;
};

// `sections` (on `device`) of this rank into --checkpoint-dir's file of `step` for `rank`,
// with the run's meta and `meta` (the algorithm's settings a resume must share).
void save_worker_state(const TrainOptions& options, int step, int world_size, int rank, Device device,
                       const std::vector<StateSection>& sections, const std::vector<std::pair<std::string, int>>& meta);
// With resume_wanted: the newest step every rank saved, this rank's file of it read
// into `sections` after checking the model, seed, batch, world size and `meta`
// (FlagError naming what differs); returns the step to continue at. Otherwise 1.
int resume_worker_state(const TrainOptions& options, int world_size, int rank, Device device,
                        const std::vector<StateSection>& sections, const std::vector<std::pair<std::string, int>>& meta);

}  // namespace course
