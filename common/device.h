// Choosing where to compute. The CPU is always there; CUDA needs a build with the
// CUDA toolkit (the `cuda` preset, or any preset on a machine with nvcc) and a GPU.
#pragma once

#include <string>

#include "common/memory.h"

namespace course {

bool built_with_cuda();

// Number of visible CUDA GPUs; 0 in a CPU-only build or when the driver finds none
// (the reason is written to *why when it is not null).
int cuda_device_count(std::string* why = nullptr);

// Turns --device into a Device, or throws UsageError saying why it cannot be used.
Device select_device(const std::string& name);

}  // namespace course
