// The memory tracker, and the activation/parameter budget formulas that chapter
// 00's README states: the measured bytes must equal them exactly.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdlib>

#include "common/model/adamw.h"
#include "common/train/cli.h"
#include "common/tensor/error.h"
#include "common/tensor/memory.h"
#include "common/model/model.h"
#include "support/equivalence_model.h"

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

TEST_CASE("an MoE GPT and AdamW use exactly the bytes of the README's formulas", "[memory]") {
  // the equivalence tests' small model, with 4 experts per block, top-2
  GPTConfig config = course_test::model_config();
  config.n_experts = 4;
  config.top_k = 2;
  const size_t B = 2, T = config.seq_len, C = config.d_model, L = config.n_layer, V = config.vocab_size,
               NH = config.n_head, E = config.n_experts, k = config.top_k;
  const size_t before_params = current(MemCategory::Parameters), before_acts = current(MemCategory::Activations),
               before_workspace = current(MemCategory::Workspace);

  GPT model(config, static_cast<int>(B), 1);

  // P = V C + T C + L (4 C^2 + 8 C + E C + E (8 C^2 + 5 C)) + 2 C + V C: the router and E expert MLPs
  const size_t P = V * C + T * C + L * (4 * C * C + 8 * C + E * C + E * (8 * C * C + 5 * C)) + 2 * C + V * C;
  CHECK(count_parameters(config) == P);
  CHECK(current(MemCategory::Parameters) - before_params == 4 * P);
  // a token's forward uses k of the E experts, and its FLOPs count those GEMM weights:
  // qkv and proj (4 C^2), the router (E C), k experts (8 C^2 each) per block, the LM head
  CHECK(count_active_parameters(config) == P - L * (E - k) * (8 * C * C + 5 * C));
  const double gemm_weights = static_cast<double>(L * (4 * C * C + E * C + k * 8 * C * C) + V * C);
  CHECK(training_flops_per_token(config) == 6 * gemm_weights + 12.0 * L * T * C);
  // per block 8 BTC + 4 BT + B NH T^2, and the MoE layer's BT (E + 3k + 10 k C) + 2E + 1
  const size_t BT = B * T;
  const size_t activation_floats = BT * C +
                                   L * (8 * BT * C + 4 * BT + B * NH * T * T + BT * (E + 3 * k + 10 * k * C) + 2 * E + 1) +
                                   (BT * C + 2 * BT + 2 * BT * V + BT);
  CHECK(current(MemCategory::Activations) - before_acts == 4 * activation_floats);
  // backward scratch 8 BTC + the MoE layer's BT (10 k C + k + 2E) + T^2 + BTV, the residual gradients 2 BTC
  const size_t workspace_floats = 8 * BT * C + BT * (10 * k * C + k + 2 * E) + T * T + BT * V + 2 * BT * C;
  CHECK(current(MemCategory::Workspace) - before_workspace == 4 * workspace_floats);

  TrainOptions options;
  options.model = config;
  options.batch = static_cast<int>(B);
  const RequestedBytes requested = requested_bytes(options);
  CHECK(requested.parameters == static_cast<double>(P));
  CHECK(requested.activation_bytes == static_cast<double>(4 * activation_floats));
}

TEST_CASE("the ranks on one machine must fit its memory together, not the job's machines' memory", "[memory]") {
  // a model between 1x and 2x this machine's memory: too big for 2 ranks on it, not
  // for 2 ranks on 2 machines (each holds half at best)
  const double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  TrainOptions options;
  int low = 1, high = 1;  // layers: too few, then enough
  const auto bytes_at = [&](int layers) {
    options.model.n_layer = layers;
    return requested_bytes(options, 2).total;
  };
  while (bytes_at(high) < 1.5 * memory) high *= 2;
  while (high - low > 1) {
    const int middle = low + (high - low) / 2;
    (bytes_at(middle) < 1.5 * memory ? low : high) = middle;
  }
  REQUIRE(bytes_at(high) < 2.0 * memory);
  const auto under_launcher = [&](const char* local_world_size) {
    ::setenv("RANK", "0", 1);
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("LOCAL_RANK", "0", 1);
    ::setenv("LOCAL_WORLD_SIZE", local_world_size, 1);
    bool refused = false;
    try {
      validate_common(options, 2);
    } catch (const FlagError& error) {
      refused = true;
      CHECK_THAT(error.what(), Catch::Contains("its 2 rank(s) on this machine need 2/2 of that at least"));
    }
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) ::unsetenv(name);
    return refused;
  };
  INFO(options.model.n_layer << " layers: " << requested_bytes(options, 2).total << " bytes, " << memory
                             << " bytes of memory");
  CHECK(under_launcher("2"));         // two ranks here
  CHECK_FALSE(under_launcher("1"));   // one rank here, the other on another machine
}

