// The parts of a trainer that every chapter shares and that are not the chapter's
// technique: the run header, resuming, and when to checkpoint. Keeping them here
// keeps each chapter's main.cpp about its own idea.
#pragma once

#include <string>

#include "common/adamw.h"
#include "common/cli.h"
#include "common/data.h"
#include "common/device.h"
#include "common/metrics.h"

namespace course {

// Picks the device (--device) and how its matmuls compute (--dtype, --tf32). A
// chapter whose GPU path is not written yet passes gpu_ready = false, and
// --device cuda is then refused with a clear message instead of running elsewhere.
Device setup_device(const TrainOptions& options, bool gpu_ready = true);

// "model: ... parameters" and "batch: ..." lines (and on a GPU, "device: ..."); `ranks` is the data-parallel world.
void print_run_header(const TrainOptions& options, const TextData& data, size_t parameters, int micro_batch,
                      int ranks = 1);

// The run's training flags and communication backend ("none" for one device) as
// summary fields, for the course report: RunReport adds the model shape and the machine.
JsonLine run_configuration(const TrainOptions& options, const std::string& backend);

// With --resume, loads the newest checkpoint of a replicated model into params and
// optimizer and returns the step to continue at; otherwise (or when there is none
// yet) returns 1. Refuses a checkpoint that already reached --steps.
int resume_if_asked(const TrainOptions& options, float* params, AdamW& optimizer, bool verbose);

// Whether to save after `step`: every --checkpoint-every steps, and after the last.
bool checkpoint_due(const TrainOptions& options, int step);

}  // namespace course
