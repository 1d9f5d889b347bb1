// Chapter 00: training a GPT on one device.
//
// Everything the parallel chapters split up is here in one piece: a batch of
// byte sequences, a forward pass to a loss, a backward pass to gradients, and an
// AdamW step. With --micro-batches M the batch is processed in M slices whose
// gradients add up before the single optimizer step (gradient accumulation).
//
// With --device cuda the same code trains on a GPU: the model's and the
// optimizer's buffers are device memory, and every op runs through
// ops_for(Device::CUDA) (common/ops.h) instead of the CPU's. --dtype bf16 runs the
// matmuls in bf16 with fp32 master weights (mixed precision, common/device.h).
#include <cblas.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "common/adamw.h"
#include "common/checkpoint.h"
#include "common/cli.h"
#include "common/data.h"
#include "common/device.h"
#include "common/metrics.h"
#include "common/model.h"
#include "common/trace.h"
#include "common/training.h"

using namespace course;

static int train(int argc, char** argv) {
  // ---- flags -----------------------------------------------------------------
  TrainOptions options;
  ArgParser parser("00_single_gpu", "Chapter 00: train a small GPT on a single device.");
  add_common_flags(parser, options);
  parser.parse(argc, argv);
  validate_common(options);
  const Device device = setup_device(options);
  openblas_set_num_threads(options.threads);
  MetricsLog log(options.log);
  Trace trace(options.trace, /*rank=*/0, /*world_size=*/1);
  if (!options.checkpoint_dir.empty()) ensure_checkpoint_dir(options.checkpoint_dir);

  const GPTConfig& config = options.model;
  const int T = config.seq_len;
  const int micro_batch = options.batch / options.micro_batches;  // sequences per forward/backward

  // ---- data ------------------------------------------------------------------
  TextData data = load_text_data(options.data, T);
  BatchSampler sampler(data, T, options.batch, options.seed);

  // ---- model and optimizer -----------------------------------------------------
  GPT model(config, micro_batch, options.seed, device);
  AdamW optimizer({options.lr, 0.9f, 0.95f, 1e-8f, options.weight_decay}, model.params.size(), device);
  print_run_header(options, data, model.params.size(), micro_batch);
  const int first_step = resume_if_asked(options, model.params.data(), optimizer, /*verbose=*/true);

  // ---- training loop -------------------------------------------------------------
  RunReport report("00_single_gpu", config, options.batch, /*world_size=*/1, device);
  std::vector<int> tokens(static_cast<size_t>(micro_batch) * T);   // (micro_batch, T)
  std::vector<int> targets(static_cast<size_t>(micro_batch) * T);  // (micro_batch, T)
  // the loss is the mean over every token of the global batch, so each token's
  // gradient is scaled by 1 / (batch * T), whichever micro-batch it falls in
  const float dloss = 1.0f / (static_cast<float>(options.batch) * T);

  // --trace: a span ends when the GPU has finished its work, not when it was queued
  const auto traced = [&](const char* name, double start, int step) {
    if (!trace.enabled()) return;
    synchronize(device);
    trace.span_since(name, start, Trace::kComputeLane, JsonLine().add("step", step));
  };

  for (int step = first_step; step <= options.steps; step++) {
    const double start = now_seconds();
    model.zero_grad();
    float loss = 0.0f;
    for (int micro = 0; micro < options.micro_batches; micro++) {
      sampler.fill(step, micro * micro_batch, micro_batch, tokens.data(), targets.data());
      double span_start = now_seconds();
      loss += model.forward(tokens.data(), targets.data()) / options.micro_batches;
      traced("forward", span_start, step);
      span_start = now_seconds();
      model.backward(dloss);
      traced("backward", span_start, step);
    }
    const double step_start = now_seconds();
    if (options.grad_clip > 0.0f) {
      double norm = std::sqrt(grad_norm_squared(model.grads.data(), model.grads.size(), device));
      clip_grads(model.grads.data(), model.grads.size(), norm, options.grad_clip, device);
    }
    optimizer.update(model.params.data(), model.grads.data(), step);
    traced("optimizer step", step_start, step);
    synchronize(device);  // the step's time is the GPU's, not just the time to queue its work
    const int print_every = options.quiet ? 0 : options.print_every;
    report.step(step, options.steps, loss, now_seconds() - start, print_every, log);

    // ---- checkpoint ----------------------------------------------------------------
    if (checkpoint_due(options, step)) {
      save_training_state(checkpoint_path(options.checkpoint_dir, step), options, step, model.params.data(),
                          optimizer);
      prune_checkpoints(options.checkpoint_dir, /*keep=*/2);
    }
  }

  // one device: no backend, nothing to send
  report.finish(log, run_configuration(options, "none").add("bytes_sent_per_step", 0));
  finish_trace(trace, options.trace, /*world=*/nullptr);
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("00_single_gpu", [&] { return train(argc, argv); });
}
