#include "benchmarks/step_timer.h"

#include <algorithm>
#include <vector>

#include "common/model/adamw.h"
#include "common/model/data.h"
#include "common/tensor/device.h"
#include "common/train/metrics.h"
#include "common/model/step_loss.h"

namespace course {

static double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

StepTimes time_training_steps(const GPTConfig& config, int batch, int warmup, int steps, Device device) {
  const int T = config.seq_len, B = batch;
  const uint64_t seed = 1337;  // chapter 00's default --seed

  // the same data, model and optimizer as 00_single_gpu (one micro-batch, default lr)
  TextData data = load_text_data("", T);  // the built-in corpus
  BatchSampler sampler(data, T, B, seed);
  GPT model(config, B, seed, device);
  AdamW optimizer({1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f}, model.params.size(), device);
  std::vector<int> tokens(static_cast<size_t>(B) * T), targets(static_cast<size_t>(B) * T);
  const float dloss = 1.0f / (static_cast<float>(B) * T);  // mean loss over the batch's tokens
  StepLoss loss(/*micro_batches=*/1, device);

  // Each step is timed as a whole (what chapter 00 reports) and phase by phase.
  // Reading the clock costs tens of nanoseconds, nothing next to a step.
  // zero_grad is counted with the optimizer: like AdamW it is one pass over a
  // parameter-sized buffer, whatever the batch size.
  std::vector<double> step_s, forward_s, backward_s, optimizer_s;
  for (int step = 1; step <= warmup + steps; step++) {
    const double t0 = now_seconds();
    model.zero_grad();
    sampler.fill(step, 0, B, tokens.data(), targets.data());
    synchronize(device);
    const double t1 = now_seconds();
    model.forward(tokens.data(), targets.data(), loss);
    synchronize(device);
    const double t2 = now_seconds();
    model.backward(dloss);
    loss.read();  // as chapter 00's step reads its loss: waits for the GPU
    const double t3 = now_seconds();
    optimizer.update(model.params.data(), model.grads.data(), step);
    synchronize(device);
    const double t4 = now_seconds();

    // warmup steps touch every buffer once (page faults, caches, BLAS's and
    // cuBLAS's own buffers, the caching pool) and are not recorded
    if (step <= warmup) continue;
    step_s.push_back(t4 - t0);
    forward_s.push_back(t2 - t1);
    backward_s.push_back(t3 - t2);
    optimizer_s.push_back((t1 - t0) + (t4 - t3));  // zero_grad (+ sampling, negligible) + AdamW
  }
  return {model.params.size(), B * T, 1e3 * median(step_s), 1e3 * median(forward_s), 1e3 * median(backward_s),
          1e3 * median(optimizer_s)};
}

}  // namespace course
