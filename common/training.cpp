#include "common/training.h"

#include <cstdio>

#include "common/checkpoint.h"
#include "common/error.h"

namespace course {

Device setup_device(const TrainOptions& options, bool gpu_ready) {
  const Device device = select_device(options.device);
  if (device == Device::CUDA && !gpu_ready) {
    throw UsageError(std::string("--device cuda: this chapter runs on the CPU only in this version of the course ") +
                     "(its GPU path needs device-side communication; hint: use --device cpu, or chapter 00 on the GPU)");
  }
  set_matmul_precision(options.dtype == "bf16" ? MatmulPrecision::BF16
                       : options.tf32          ? MatmulPrecision::TF32
                                               : MatmulPrecision::FP32);
  return device;
}

void print_run_header(const TrainOptions& options, const TextData& data, size_t parameters, int micro_batch,
                      int ranks) {
  const GPTConfig& config = options.model;
  std::printf("model: %d layers, d_model %d, %d heads, seq %d, vocab %d: %zu parameters\n", config.n_layer,
              config.d_model, config.n_head, config.seq_len, config.vocab_size, parameters);
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
  }
}

JsonLine run_configuration(const TrainOptions& options, const std::string& backend) {
  return JsonLine()
      .add("steps", options.steps)
      .add("micro_batches", options.micro_batches)
      .add("lr", static_cast<double>(options.lr))
      .add("weight_decay", static_cast<double>(options.weight_decay))
      .add("grad_clip", static_cast<double>(options.grad_clip))
      .add("seed", static_cast<int64_t>(options.seed))
      .add("threads", options.threads)
      .add("data", options.data.empty() ? "built-in corpus" : options.data)
      .add("backend", backend);
}

int resume_if_asked(const TrainOptions& options, float* params, AdamW& optimizer, bool verbose) {
  if (!options.resume) return 1;
  auto path = latest_checkpoint(options.checkpoint_dir);
  if (!path) {
    if (verbose) std::printf("no checkpoint in %s yet: starting from step 1\n", options.checkpoint_dir.c_str());
    return 1;
  }
  const int first_step = load_training_state(*path, options, params, optimizer) + 1;
  if (first_step > options.steps) {
    throw UsageError(*path + " is already at step " + std::to_string(first_step - 1) + " of --steps " +
                     std::to_string(options.steps) + ": nothing to train (hint: raise --steps)");
  }
  if (verbose) std::printf("resumed from %s: continuing at step %d\n", path->c_str(), first_step);
  return first_step;
}

bool checkpoint_due(const TrainOptions& options, int step) {
  if (options.checkpoint_dir.empty()) return false;
  return (options.checkpoint_every > 0 && step % options.checkpoint_every == 0) || step == options.steps;
}

}  // namespace course
