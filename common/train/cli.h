// Command-line flags shared by every trainer, and the guard that turns errors
// into one clear message and an exit code.
//
// Every chapter takes the same common flags (model shape, steps, global batch,
// micro-batches, lr, seed, data, device, log, trace and checkpoint paths) and adds only
// its own technique's flags, so commands look alike across the course.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/comm/flags.h"
#include "common/model/model.h"

namespace course {

struct TrainOptions {
  GPTConfig model;               // --layers --d-model --heads --seq
  int steps = 200;               // --steps
  int batch = 8;                 // --batch: the GLOBAL batch, in sequences, summed over all ranks
  int micro_batches = 1;         // --micro-batches: gradient accumulation steps per optimizer step
  float lr = 1e-3f;              // --lr
  float weight_decay = 0.0f;     // --weight-decay
  float grad_clip = 0.0f;        // --grad-clip: max global gradient norm, 0 = off
  // --recompute none|selective|full: what backward recomputes instead of forward
  // saving it (selective: attention's (B, NH, T, T) probabilities; full: every block
  // from its input)
  std::string recompute = "none";
  uint64_t seed = 1337;          // --seed: initial weights and batch order
  std::string data;              // --data: a text file; empty = the built-in corpus
  std::string device = "cpu";    // --device cpu|cuda
  std::string dtype = "fp32";    // --dtype fp32|bf16: how the matmuls compute (common/tensor/device.h)
  bool tf32 = false;             // --tf32: fp32 matmuls on TF32 tensor cores
  int threads = 1;               // --threads: BLAS threads per process
  std::string log;               // --log: JSON-lines metrics file
  std::string trace;             // --trace: Chrome/Perfetto trace file (common/train/trace.h)
  std::string checkpoint_dir;    // --checkpoint-dir
  int checkpoint_every = 0;      // --checkpoint-every: steps between checkpoints, 0 = only at the end
  bool resume = false;           // --resume: continue from the newest checkpoint in --checkpoint-dir
  int print_every = 1;           // --print-every: a progress line every N steps
  bool quiet = false;            // --quiet: no per-step lines, summary only
  // every flag on the command line, by name ("--top-k"), the chapter's own included: a
  // flag that changes nothing in this run is refused even when given its default value
  std::set<std::string> given;
};

// Registers the common flags on `parser`, writing into `options`.
void add_common_flags(ArgParser& parser, TrainOptions& options);
// Checks the rules that involve more than one flag (heads divide d-model, batch
// divides into micro-batches, --resume needs --checkpoint-dir, the model fits in
// memory: requested_bytes, ...). `dp_size` is
// the number of data-parallel ranks the batch is split over. (--data is checked
// when it is loaded, by load_text_data.)
void validate_common(const TrainOptions& options, int dp_size = 1);
// The part of validate_common that does not depend on the ranks (the model's shape,
// the precision flags, the checkpoint flags): checked before the device and the ranks.
void validate_flags(const TrainOptions& options);

// What a run with these flags asks for, counted in double before anything is
// allocated: each size flag may be up to 10^9, and their products would wrap
// around in size_t (or take minutes building a billion layer layouts before an
// allocation failed). Chapter 00's footprint: the weights, gradients and AdamW's
// two moments (16 bytes per parameter) plus one micro-batch's activations on one of
// `dp_size` data-parallel ranks (model.h's Embedding/Block/HeadActivations, the blocks
// as --recompute keeps them, and its RecomputeWorkspace).
// validate_common refuses a total above the job's ranks x this machine's memory.
struct RequestedBytes {
  double parameters = 0;        // count_parameters, without building the layouts
  double activation_bytes = 0;  // one micro-batch's
  double total = 0;             // 16 x parameters + activation_bytes
};
RequestedBytes requested_bytes(const TrainOptions& options, int dp_size = 1);

// Runs `body` with stdout line-buffered (progress shows at once in a pipe or a
// file); a CourseError is printed as "<program>: error: <message>" and its exit
// code returned, a FlagError by rank 0 only (every rank finds it); any other
// exception exits 1 with its text.
int guarded_main(const std::string& program, const std::function<int()>& body);

}  // namespace course
