// The memory tracker, and the activation/parameter budget formulas that chapter
// 00's README states: the measured bytes must equal them exactly.
#include <catch2/catch.hpp>

#include "common/adamw.h"
#include "common/cli.h"
#include "common/memory.h"
#include "common/model.h"

using namespace course;

static size_t current(MemCategory category) {
  return memory_totals(Device::CPU).current[static_cast<int>(category)];
}
static size_t peak(MemCategory category) { return memory_totals(Device::CPU).peak[static_cast<int>(category)]; }

TEST_CASE("buffers are counted per category while alive, and peaks remember the high-water mark", "[memory]") {
  const size_t before = current(MemCategory::CommBuffers);
  reset_memory_peaks(Device::CPU);
  {
    Buffer a(1000, MemCategory::CommBuffers);
    Buffer b(500, MemCategory::CommBuffers);
    CHECK(current(MemCategory::CommBuffers) == before + 6000);
    Buffer moved = std::move(a);  // moving does not count twice
    CHECK(current(MemCategory::CommBuffers) == before + 6000);
    CHECK(moved.data()[999] == 0.0f);  // buffers start zeroed
  }
  CHECK(current(MemCategory::CommBuffers) == before);
  CHECK(peak(MemCategory::CommBuffers) == before + 6000);
}

TEST_CASE("a GPT and AdamW use exactly the bytes of the README's formulas", "[memory]") {
  GPTConfig config;
  config.seq_len = 32;
  config.n_layer = 3;
  config.d_model = 48;
  config.n_head = 4;
  const size_t B = 2, T = config.seq_len, C = config.d_model, L = config.n_layer, V = config.vocab_size,
               NH = config.n_head;
  const size_t before_params = current(MemCategory::Parameters), before_grads = current(MemCategory::Gradients),
               before_optimizer = current(MemCategory::OptimizerState),
               before_acts = current(MemCategory::Activations);

  GPT model(config, static_cast<int>(B), 1);
  AdamW optimizer(AdamWConfig{}, model.params.size());

  // P = V C + T C + L (12 C^2 + 13 C) + 2 C + V C
  const size_t P = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C + V * C;
  CHECK(count_parameters(config) == P);
  CHECK(current(MemCategory::Parameters) - before_params == 4 * P);
  CHECK(current(MemCategory::Gradients) - before_grads == 4 * P);
  CHECK(current(MemCategory::OptimizerState) - before_optimizer == 8 * P);
  // embedding output + L blocks (16 BTC + 4 BT + B NH T^2) + head (BTC + 2 BT + 2 BTV + BT), 4 bytes each
  const size_t BT = B * T;
  const size_t activation_floats = BT * C + L * (16 * BT * C + 4 * BT + B * NH * T * T) +
                                   (BT * C + 2 * BT + 2 * BT * V + BT);
  CHECK(current(MemCategory::Activations) - before_acts == 4 * activation_floats);

  // the flags' check counts the same bytes before anything exists (cli.h)
  TrainOptions options;
  options.model = config;
  options.batch = static_cast<int>(B) * 2;
  options.micro_batches = 2;
  const RequestedBytes requested = requested_bytes(options);
  CHECK(requested.parameters == static_cast<double>(P));
  CHECK(requested.activation_bytes == static_cast<double>(4 * activation_floats));
  CHECK(requested.total == static_cast<double>(16 * P + 4 * activation_floats));
}
