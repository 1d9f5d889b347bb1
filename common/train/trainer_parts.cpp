#include "common/train/trainer_parts.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "common/train/checkpoint.h"
#include "common/comm/comm.h"
#include "common/comm/env.h"
#include "common/comm/test_faults.h"
#include "common/tensor/error.h"
#include "common/tensor/gemm_cpu.h"

namespace course {

DType message_dtype(const TrainOptions& options) {
  return options.dtype == "bf16" ? DType::BF16 : DType::F32;
}

AdamWConfig adamw_config(const TrainOptions& options) {
  return {options.lr, 0.9f, 0.95f, 1e-8f, options.weight_decay};
}

int whole_world_degree(const std::string& flag, int value, int world_size) {
  const int degree = value == 0 ? world_size : value;
  if (degree != world_size) {
    throw FlagError(flag + " " + std::to_string(degree) + " needs " + std::to_string(degree) +
                    " ranks and this run has " + std::to_string(world_size) + " (hint: launch with --nproc-per-node " +
                    std::to_string(degree) + ")");
  }
  return degree;
}

Device setup_device(const TrainOptions& options) {
  // the launcher (torchrun, mpirun or srun) says which process this is on its machine,
  // and so which GPU it computes on
  const Device device = select_device(options.device, [](int gpus) { return gpu_for_rank(read_launch_env(), gpus); });
  const int capability = device == Device::CUDA ? cuda_compute_capability() : 0;
  if ((options.dtype == "bf16" || options.tf32) && device == Device::CUDA && capability < 80) {
    throw FlagError(std::string(options.tf32 ? "--tf32" : "--dtype bf16") + " needs a GPU with tensor cores " +
                     "for it (compute capability 8.0, Ampere, or newer), and this one is sm_" +
                     std::to_string(capability) + " (hint: drop the flag: fp32 runs on every GPU)");
  }
  set_matmul_precision(options.dtype == "bf16" ? MatmulPrecision::BF16
                       : options.tf32          ? MatmulPrecision::TF32
                                               : MatmulPrecision::FP32);
  return device;
}

void print_run_header(const TrainOptions& options, const TextData& data, RowSlice my_rows) {
  const GPTConfig& config = options.model;
  const size_t parameters = count_parameters(config);
  const int ranks = options.batch / my_rows.rows, micro_batch = my_rows.rows / options.micro_batches;
  std::printf("model: %d layers, d_model %d, %d heads, seq %d, vocab %d: %zu parameters\n", config.n_layer,
              config.d_model, config.n_head, config.seq_len, config.vocab_size, parameters);
  if (config.n_experts > 0) {
    char capacity[40] = "dropless";
    if (config.capacity_factor > 0.0f) {
      std::snprintf(capacity, sizeof(capacity), "capacity factor %g", config.capacity_factor);
    }
    std::printf("experts: %d per block, top-%d, %s, aux loss x %g: %zu parameters active per token\n",
                config.n_experts, config.top_k, capacity, config.aux_loss_coef, count_active_parameters(config));
  }
  if (ranks > 1) {
    std::printf("batch: %d sequences = %d ranks x %d micro-batch(es) of %d | data: %s (%zu bytes)\n", options.batch,
                ranks, options.micro_batches, micro_batch, data.source.c_str(), data.bytes.size());
  } else {
    std::printf("batch: %d sequences x %d tokens in %d micro-batch(es) of %d | data: %s (%zu bytes)\n",
                options.batch, config.seq_len, options.micro_batches, micro_batch, data.source.c_str(),
                data.bytes.size());
  }
  if (options.device == "cuda") {
    std::printf("device: %s, matmuls in %s\n", describe_device(Device::CUDA).c_str(),
                precision_name(matmul_precision()));
  } else if (matmul_precision() == MatmulPrecision::BF16) {
    std::printf("%s\n", cpu::bf16_gemm_note().c_str());
  }
}

JsonLine run_configuration(const TrainOptions& options, const std::string& backend) {
  JsonLine fields;
  fields
      .add("steps", options.steps)
      .add("micro_batches", options.micro_batches)
      .add("lr", static_cast<double>(options.lr))
      .add("weight_decay", static_cast<double>(options.weight_decay))
      .add("grad_clip", static_cast<double>(options.grad_clip))
      .add("seed", static_cast<int64_t>(options.seed))
      .add("threads", options.threads)
      .add("data", options.data.empty() ? "built-in corpus" : options.data)
      .add("backend", backend);
  if (options.model.n_experts > 0) {
    fields.add("capacity_factor", static_cast<double>(options.model.capacity_factor))
        .add("aux_loss_coef", static_cast<double>(options.model.aux_loss_coef));
  }
  return fields;
}

bool resume_wanted(const TrainOptions& options) {
  return options.resume || (!options.checkpoint_dir.empty() && read_launch_env().restart_count > 0);
}

std::optional<std::string> checkpoint_to_resume(const TrainOptions& options, bool per_rank, bool verbose) {
  if (!resume_wanted(options)) return std::nullopt;
  const std::optional<std::string> path = per_rank ? latest_complete_rank_checkpoint(options.checkpoint_dir)
                                                   : latest_checkpoint(options.checkpoint_dir);
  if (!path && !per_rank) {
    // another chapter's per-rank files: starting over would look like a resume that worked
    const std::optional<std::string> sharded = latest_checkpoint(options.checkpoint_dir, rank_suffix(0));
    if (sharded) {
      throw FlagError("--resume: " + options.checkpoint_dir + " holds a sharded checkpoint (" + *sharded +
                       " and the other ranks' files), which this chapter does not read: it loads one whole-model " +
                       "file (hint: ./build/bin/consolidate_checkpoint --checkpoint-dir " + options.checkpoint_dir +
                       " --out-dir DIR makes one; then --checkpoint-dir DIR --resume)");
    }
  }
  if (!path && verbose) {
    // rank 0's files without the others': the first save was cut short by a crash
    const bool partial = per_rank && latest_checkpoint(options.checkpoint_dir, rank_suffix(0));
    std::printf("no checkpoint in %s %s: starting from step 1\n", options.checkpoint_dir.c_str(),
                partial ? "that every rank finished saving" : "yet");
  }
  return path;
}

void print_resumed(const std::string& path, const std::string& others, int next_step) {
  const int restarts = read_launch_env().restart_count;
  if (restarts > 0) std::printf("the launcher restarted the group (restart %d): ", restarts);
  std::printf("resumed from %s%s: continuing at step %d\n", path.c_str(), others.c_str(), next_step);
}

int resume_if_asked(const TrainOptions& options, float* params, AdamW& optimizer, bool verbose) {
  const std::optional<std::string> path = checkpoint_to_resume(options, /*per_rank=*/false, verbose);
  if (!path) return 1;
  const int first_step = load_training_state(*path, options, params, optimizer) + 1;
  if (first_step > options.steps) {
    throw FlagError(*path + " is already at step " + std::to_string(first_step - 1) + " of --steps " +
                     std::to_string(options.steps) + ": nothing to train (hint: raise --steps)");
  }
  if (verbose) print_resumed(*path, "", first_step);
  return first_step;
}

void save_training_state(const TrainOptions& options, int step, const float* params, const AdamW& optimizer) {
  save_training_state(checkpoint_path(options.checkpoint_dir, step), options, step, params, optimizer);
}

std::optional<CheckpointManifest> manifest_to_resume(const TrainOptions& options, const std::string& this_layout,
                                                     bool verbose, std::string* newest) {
  if (!resume_wanted(options)) return std::nullopt;
  // a file of the whole model (chapter 00's, 02's, consolidate_checkpoint's,
  // import_safetensors') resumes here too, when it is newer than every step the ranks
  // finished saving: one shard that holds everything, resharded like any other
  const std::optional<std::string> whole = latest_checkpoint(options.checkpoint_dir);
  const std::optional<std::string> sharded = checkpoint_to_resume(options, /*per_rank=*/true, verbose && !whole);
  if (!sharded && !whole) return std::nullopt;
  const int sharded_step = sharded ? static_cast<int>(CheckpointReader(*sharded).meta("step")) : -1;
  // both names are checkpoint_path's in one directory, zero-padded: they sort as their steps
  const bool from_whole = whole && (!sharded || *whole > checkpoint_path(options.checkpoint_dir, sharded_step));
  const std::string first = from_whole ? *whole : *sharded;
  const std::string path = from_whole ? *whole : manifest_path(options.checkpoint_dir, sharded_step);
  CheckpointManifest manifest = from_whole ? whole_checkpoint_manifest(*whole) : read_manifest(path);
  const auto saved = [&](const std::string& key) { return manifest.get(key); };
  check_model_shape(saved, options.model, path);
  check_seed_and_batch(saved, options, path);
  const int64_t step = manifest.get("step");
  if (step >= options.steps) {
    throw FlagError(first + " is already at step " + std::to_string(step) + " of --steps " +
                     std::to_string(options.steps) + ": nothing to train (hint: raise --steps)");
  }
  if (verbose && manifest.layout != this_layout) {
    // one line each, so that each fits 100 columns behind the launcher's prefix
    std::printf("resharding: each rank reads its part out of the files that hold it\n  saved as: %s\n"
                "  this run: %s\n",
                manifest.layout.c_str(), this_layout.c_str());
  }
  *newest = first;
  return manifest;
}

bool checkpoint_due(const TrainOptions& options, int step) {
  die_if_told_after_step(step);  // the restart tests' crash between two steps
  if (options.checkpoint_dir.empty()) return false;
  return (options.checkpoint_every > 0 && step % options.checkpoint_every == 0) || step == options.steps;
}

bool replicas_identical(Comm& comm, const float* params, size_t count, Device device) {
  std::vector<float> host(count);  // (count)
  copy_bytes(host.data(), Device::CPU, params, device, count * sizeof(float));
  // FNV-1a over the bytes, folded to 24 bits so the float carrying it is exact
  uint64_t hash = 1469598103934665603ull;
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(host.data());
  for (size_t i = 0; i < count * sizeof(float); i++) hash = (hash ^ bytes[i]) * 1099511628211ull;
  float mine = static_cast<float>((hash ^ (hash >> 24) ^ (hash >> 48)) & 0xFFFFFF);
  std::vector<float> all(comm.size());
  comm.all_gather(&mine, all.data(), 1);
  return std::all_of(all.begin(), all.end(), [&](float other) { return other == all[0]; });
}

void check_copies_agree(Comm& comm, const float* params, size_t count, Device device, const std::string& what) {
  if (!replicas_identical(comm, params, count, device)) {
    throw CourseError("rank " + std::to_string(comm.rank()) + ": " + what + " differ between the ranks after " +
                      "training (a bug: every copy must apply the same gradients)");
  }
}

void finish_trace(Trace& trace, const std::string& path, Comm* world) {
  if (!trace.enabled()) return;
  trace.write();
  const int ranks = world == nullptr ? 1 : world->size();
  std::string file = path;
  if (ranks > 1) {
    world->barrier();  // every rank's file is complete before rank 0 merges them
    if (world->rank() != 0) return;
    file = merged_trace_path(path);
    merge_rank_traces(path, ranks, file);
  }
  std::printf("trace: %s (open it at https://ui.perfetto.dev)\n", file.c_str());
}

}  // namespace course
