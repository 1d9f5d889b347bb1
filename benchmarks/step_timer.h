// Timing chapter 00's training step, phase by phase: shared by the CPU and the GPU
// step benchmarks.
#pragma once

#include <cstddef>

#include "common/tensor/memory.h"
#include "common/model/model.h"

namespace course {

struct StepTimes {
  size_t parameters;
  int tokens_per_step;
  double step_ms, forward_ms, backward_ms, optimizer_ms;  // medians over the timed steps
};

// Builds the model, data and optimizer exactly as 00_single_gpu does (one
// micro-batch of `batch` sequences, default lr and seed) on `device`, runs `warmup`
// untimed steps and then `steps` timed ones. On a GPU each phase ends with a
// synchronize, so a phase's time is the GPU's time for it, not the time to queue it.
StepTimes time_training_steps(const GPTConfig& config, int batch, int warmup, int steps, Device device);

}  // namespace course
