#include "common/train/cli.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <iostream>
#include <sstream>
#include <thread>

#include "common/comm/env.h"
#include "common/tensor/error.h"

namespace course {

void add_common_flags(ArgParser& parser, TrainOptions& o) {
  parser.record_given(&o.given);
  parser.add_int("--layers", &o.model.n_layer, 1, "transformer blocks L");
  parser.add_int("--d-model", &o.model.d_model, 1, "model width C");
  parser.add_int("--heads", &o.model.n_head, 1, "attention heads NH (must divide --d-model)");
  parser.add_int("--seq", &o.model.seq_len, 1, "sequence length T, in bytes");
  parser.add_int("--experts", &o.model.n_experts, 1, "a mixture of E expert MLPs per block (none: dense MLPs)");
  parser.add_int("--top-k", &o.model.top_k, 1, "with --experts: experts per token");
  parser.add_float("--capacity-factor", &o.model.capacity_factor, 0.0f, false,
                   "with --experts: tokens per expert at most ceil(F tokens k / E), 0 = no limit");
  parser.add_float("--aux-loss-coef", &o.model.aux_loss_coef, 0.0f, false,
                   "with --experts: weight of the load-balancing loss");
  parser.add_int("--steps", &o.steps, 1, "optimizer steps");
  parser.add_int("--batch", &o.batch, 1, "global batch, in sequences, over all ranks");
  parser.add_int("--micro-batches", &o.micro_batches, 1, "micro-batches per step (gradient accumulation)");
  parser.add_float("--lr", &o.lr, 0.0f, true, "AdamW learning rate");
  parser.add_float("--weight-decay", &o.weight_decay, 0.0f, false, "AdamW weight decay");
  parser.add_float("--grad-clip", &o.grad_clip, 0.0f, false, "clip the global gradient norm to this, 0 = off");
  parser.add_choice("--recompute", &o.recompute, {"none", "selective", "full"},
                    "activation recomputation: selective = attention's T x T part, full = every block");
  parser.add_uint64("--seed", &o.seed, "seed for the initial weights and the batch order");
  parser.add_string("--data", &o.data, "training text file, read as bytes (none: the built-in corpus)");
  parser.add_choice("--device", &o.device, {"cpu", "cuda", "guarded"},
                    "where to compute (guarded: the CPU behind a GPU's walls, for tests)");
  parser.add_choice("--dtype", &o.dtype, {"fp32", "bf16"},
                    "matmul inputs: bf16 = rounded to bf16, summed in fp32 (weights, gradients, optimizer stay fp32)");
  parser.add_switch("--tf32", &o.tf32, "GPU fp32 matmuls on TF32 tensor cores");
  parser.add_int("--threads", &o.threads, 1, "BLAS threads per process");
  parser.add_string("--log", &o.log, "write metrics as JSON lines to this file");
  parser.add_string("--trace", &o.trace, "write a Chrome/Perfetto trace (one file per rank, and a merged one)");
  parser.add_string("--checkpoint-dir", &o.checkpoint_dir, "directory for checkpoints");
  parser.add_int("--checkpoint-every", &o.checkpoint_every, 0, "save every N steps (0 = only after the last)");
  parser.add_switch("--resume", &o.resume, "resume from the newest checkpoint in --checkpoint-dir");
  parser.add_int("--print-every", &o.print_every, 1, "print a progress line every N steps");
  parser.add_switch("--quiet", &o.quiet, "no per-step lines: the header and the summary only");
}

RequestedBytes requested_bytes(const TrainOptions& o, int dp_size) {
  const GPTConfig& m = o.model;
  const double V = m.vocab_size, C = m.d_model, T = m.seq_len, L = m.n_layer, NH = m.n_head;
  const double E = m.n_experts, k = m.top_k;
  RequestedBytes requested;
  const double B = static_cast<double>(o.batch) / dp_size / o.micro_batches;
  // count_parameters: a block's MLP (8 C^2 + 5 C), or a router (E C) and E such experts
  const double mlp_parameters = m.n_experts > 0 ? E * C + E * (8 * C * C + 5 * C) : 8 * C * C + 5 * C;
  requested.parameters = 2 * V * C + T * C + L * (4 * C * C + 8 * C + mlp_parameters) + 2 * C;
  // per token of a block, the MLP's: fch and fch_gelu (4C each), or an MoE layer's
  // (common/model/moe.h: E + 3k + 10 k C, and 2E + 1 per block)
  const double mlp_floats = m.n_experts > 0 ? B * T * (E + 3 * k + 10 * k * C) + 2 * E + 1 : B * T * 8 * C;
  // under --dtype bf16 the linear layers' saved inputs take half (model.h's LinearInput):
  // ln1, and a dense block's ln2 and fch_gelu (6C a token), and the head's lnf
  const bool bf16 = o.dtype == "bf16";
  const double halved_in_block = bf16 ? (m.n_experts > 0 ? C : 6 * C) / 2 : 0, halved_in_head = bf16 ? C / 2 : 0;
  // a block keeping everything: 8 (B, T, C) arrays, 4 (B, T) rows, the attention matrix and the MLP's
  const double block_floats = B * T * (8 * C + 4 + NH * T - halved_in_block) + mlp_floats, scores = B * NH * T * T;
  // the L blocks as --recompute keeps them, and the one shared buffer (model.h's RecomputeWorkspace)
  const double blocks = m.recompute == Recompute::Full        ? L * B * T * C + block_floats
                        : m.recompute == Recompute::Selective ? L * (block_floats - scores) + scores
                                                              : L * block_floats;
  // embedding out; the blocks; the head's
  requested.activation_bytes = 4 * (B * T * (C + C - halved_in_head + 3 + 2 * V) + blocks);
  requested.total = 16 * requested.parameters + requested.activation_bytes;
  return requested;
}

// A model that no machine of the job can hold is a flag mistake, said before
// anything is allocated (see requested_bytes).
static void check_model_fits(const TrainOptions& o, int dp_size) {
  const RequestedBytes requested = requested_bytes(o, dp_size);
  // At best every rank holds an equal share; the ranks on this machine share its
  // memory, so their shares together must fit in it (a job of one rank per node
  // may ask for the nodes' memory together).
  const LaunchEnv env = read_launch_env();
  const int ranks = env.world_size;
  const double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  if (requested.total * env.local_world_size / ranks > memory) {
    char text[400];
    std::snprintf(text, sizeof(text),
                  "the model flags ask for %.3g bytes: %.3g parameters x 16 bytes (weights, gradients, AdamW's two "
                  "moments) plus %.3g bytes of activations per micro-batch; its %d rank(s) on this machine need "
                  "%d/%d of that at least, more than its %.3g bytes of memory (hint: make --layers, --d-model, "
                  "--seq or --batch smaller)",
                  requested.total, requested.parameters, requested.activation_bytes, env.local_world_size,
                  env.local_world_size, ranks, memory);
    throw FlagError(text);
  }
}

// --experts and the flags that shape its experts
static void validate_expert_flags(const TrainOptions& o) {
  const GPTConfig& m = o.model;
  if (m.n_experts == 0) {
    if (o.given.count("--top-k") || o.given.count("--capacity-factor") || o.given.count("--aux-loss-coef")) {
      throw FlagError("--top-k, --capacity-factor and --aux-loss-coef shape the experts of --experts, and this run "
                      "has none (hint: add --experts E, e.g. --experts 4)");
    }
    return;
  }
  if (m.top_k > m.n_experts) {
    throw FlagError("--top-k " + std::to_string(m.top_k) + " is more than --experts " + std::to_string(m.n_experts) +
                    " (hint: a token goes to k different experts, so --top-k is at most --experts)");
  }
}

void validate_flags(const TrainOptions& o) {
  const GPTConfig& m = o.model;
  if (m.d_model % m.n_head != 0) {
    throw FlagError("--heads " + std::to_string(m.n_head) + " does not divide --d-model " +
                    std::to_string(m.d_model) + " (hint: every head gets d-model/heads channels; try --heads " +
                    (m.d_model % 4 == 0 ? "4" : "1") + ")");
  }
  if (o.tf32 && o.device != "cuda") {
    throw FlagError("--tf32 needs --device cuda (TF32 is a GPU's tensor-core format; hint: drop the flag, or "
                    "--dtype bf16 for a reduced precision the CPU computes too)");
  }
  if (o.dtype == "bf16" && o.tf32) {
    throw FlagError("--tf32 and --dtype bf16 both choose how the matmuls compute: pick one");
  }
  if (o.resume && o.checkpoint_dir.empty()) {
    throw FlagError("--resume needs --checkpoint-dir to know where to look");
  }
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty()) {
    throw FlagError("--checkpoint-every needs --checkpoint-dir");
  }
  validate_expert_flags(o);
}

void validate_common(const TrainOptions& o, int dp_size) {
  validate_flags(o);
  if (o.batch % dp_size != 0) {
    throw FlagError("--batch " + std::to_string(o.batch) + " does not divide evenly over " +
                    std::to_string(dp_size) + " data-parallel ranks (hint: use a multiple of " +
                    std::to_string(dp_size) + ")");
  }
  int local_batch = o.batch / dp_size;
  if (local_batch % o.micro_batches != 0) {
    throw FlagError("the per-rank batch " + std::to_string(local_batch) + " (--batch " + std::to_string(o.batch) +
                    " over " + std::to_string(dp_size) + " data-parallel rank(s)) does not divide into " +
                    "--micro-batches " + std::to_string(o.micro_batches) +
                    " (hint: make --batch a multiple of micro-batches x data-parallel ranks)");
  }
  check_model_fits(o, dp_size);
}

// One write(2) for the whole line: under a launcher a rank can be stopped at any
// moment, and a line written piecewise could be cut in the middle.
static void print_error(const std::string& program, const char* message) {
  std::fflush(stdout);
  const std::string line = program + ": error: " + message + "\n";
  size_t done = 0;
  while (done < line.size()) {
    ssize_t count = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (count <= 0 && errno != EINTR) return;  // stderr is gone: nowhere left to report to
    if (count > 0) done += static_cast<size_t>(count);
  }
}

int guarded_main(const std::string& program, const std::function<int()>& body) {
  // A pipe or a file would get stdout in 4 KB blocks: under a launcher, or piped
  // into tee, a trainer's progress would then show minutes late. Line by line,
  // however the output is read.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    return body();
  } catch (const AlreadyDone& done) {
    std::printf("%s\n", done.what());
    return 0;
  } catch (const CourseError& error) {
    // Every rank found this same error (the same command line, the same loss): rank 0
    // says it once. The others wait a moment before they exit, so that a launcher,
    // which stops every rank as soon as one fails, cannot stop rank 0 before it has
    // said it; it normally stops them first, when rank 0 exits.
    if (error.found_by_every_rank() && launch_rank() != 0) {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      return error.exit_code();
    }
    if (error.reported_by_another_rank()) return error.exit_code();
    print_error(program, error.what());
    return error.exit_code();
  } catch (const std::exception& error) {
    print_error(program, error.what());
    return 1;
  }
}

}  // namespace course
