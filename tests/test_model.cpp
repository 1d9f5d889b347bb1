// The whole GPT (common/model/model.h) against the double-precision reference_gpt_loss in
// reference.h: the forward loss, the gradients of every parameter tensor (dense, and
// with mixture-of-experts blocks: dropless and dropping over capacity), gradient
// accumulation over micro-batches, the loss at initialisation, and the backward walk
// of a model part (common/model/part_backward.h).
//
// Errors are measured as in test_ops.cpp: max |actual - expected| / max(max |expected|, 1e-6).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/model/part_backward.h"
#include "common/model/rng.h"
#include "reference.h"
#include "support/forward_loss.h"

using namespace course;
using course_test::forward_loss;

namespace {

constexpr uint64_t kSeed = 42;
constexpr double kFiniteDifferenceStep = 1e-4;
constexpr int kSamplesPerParam = 3;

// tiny but complete: two blocks, two heads, every stage present
GPTConfig tiny_config() {
  GPTConfig config;
  config.vocab_size = 64;
  config.seq_len = 8;
  config.n_layer = 2;
  config.d_model = 16;
  config.n_head = 2;
  return config;
}

// the same with MoE blocks: E = 4, top-2, and a capacity factor (0: dropless)
GPTConfig tiny_moe_config(float capacity_factor) {
  GPTConfig config = tiny_config();
  config.n_experts = 4;
  config.top_k = 2;
  config.capacity_factor = capacity_factor;
  config.aux_loss_coef = 0.1f;  // ten times the default, so that a wrong aux gradient shows
  return config;
}

// B sequences of seq_len random tokens (stream selects which)
std::vector<int> random_tokens(const GPTConfig& config, int B, uint64_t stream) {
  CounterRng rng(kSeed, stream);
  std::vector<int> tokens(static_cast<size_t>(B) * config.seq_len);
  for (size_t i = 0; i < tokens.size(); i++) tokens[i] = static_cast<int>(rng.below(i, config.vocab_size));
  return tokens;
}

std::vector<double> to_double(const Buffer& buffer) { return {buffer.data(), buffer.data() + buffer.size()}; }

// Moves every parameter by N(0, 0.2^2) away from its initial value. At initialisation the
// weights are N(0, 0.02), biases 0 and LayerNorm weights 1: attention is nearly uniform and
// many gradients nearly vanish, so a wrong term could hide. At this generic point every
// path through the model carries a gradient of its own.
void move_to_generic_point(GPT& model) {
  CounterRng rng(kSeed, hash_name("generic point"));
  for (size_t i = 0; i < model.params.size(); i++) model.params.data()[i] += static_cast<float>(0.2 * rng.normal(i));
}

// The model's loss against the reference's. forward adds the cross-entropy; with
// MoE blocks the reference's loss also holds coef x the blocks' mean aux loss, which
// the routing statistics give.
void check_forward_against_reference(const GPTConfig& config) {
  const int B = 2;
  RoutingStats routing;
  GPT model(config, B, kSeed, Device::CPU, &routing);
  move_to_generic_point(model);
  const std::vector<int> tokens = random_tokens(config, B, 1), targets = random_tokens(config, B, 2);

  const double loss =
      forward_loss(model, Device::CPU, tokens.data(), targets.data()) + config.aux_loss_coef * routing.aux_loss();
  const double expected = reference_gpt_loss(config, to_double(model.params), tokens, targets, B);
  // fp32 through two blocks and the head: each op adds ~1e-6 relative, the mean loss stays within 1e-5
  CHECK(std::abs(loss - expected) / expected <= 1e-5);
}

// With MoE blocks the loss is continuous only while no choice changes: the generic
// point's router logits are O(1) apart, far more than a step of 1e-4 moves them.
void check_backward_against_reference(const GPTConfig& config) {
  const int B = 2, T = config.seq_len;
  GPT model(config, B, kSeed);
  move_to_generic_point(model);
  const std::vector<int> tokens = random_tokens(config, B, 1), targets = random_tokens(config, B, 2);

  // the gradient of the mean loss, as the trainer computes it
  forward_loss(model, Device::CPU, tokens.data(), targets.data());
  model.zero_grad();
  model.backward(1.0f / (B * T));

  std::vector<double> point = to_double(model.params);
  auto finite_difference = [&](size_t index) {
    const double original = point[index];
    point[index] = original + kFiniteDifferenceStep;
    const double loss_plus = reference_gpt_loss(config, point, tokens, targets, B);
    point[index] = original - kFiniteDifferenceStep;
    const double loss_minus = reference_gpt_loss(config, point, tokens, targets, B);
    point[index] = original;
    return (loss_plus - loss_minus) / (2 * kFiniteDifferenceStep);
  };

  // A few elements from every parameter tensor of every stage, chosen by a seeded RNG.
  // wte is the exception: only the rows of tokens in the batch have a non-zero gradient,
  // so its samples are drawn from those rows (the end of this test checks the other rows).
  const std::vector<StageLayout>& stages = model.layout();
  for (size_t s = 0; s < stages.size(); s++) {
    for (const ParamSpec& spec : stages[s].params) {
      CounterRng rng(kSeed, hash_name(spec.name));
      std::vector<double> analytic, numerical;
      for (int sample = 0; sample < kSamplesPerParam; sample++) {
        size_t element = rng.below(sample, spec.numel);
        if (spec.name == "wte") {  // the same channel, in the row of a random position's token
          const int token = tokens[rng.below(sample, tokens.size())];
          element = static_cast<size_t>(token) * config.d_model + element % config.d_model;
        }
        const size_t index = model.stage_offset(static_cast<int>(s)) + spec.offset + element;
        analytic.push_back(model.grads.data()[index]);
        numerical.push_back(finite_difference(index));
      }
      // fp32 rounding accumulated through forward and backward of the whole model is ~1e-6
      // relative; the finite differences in double are good to ~1e-8. 1e-4 is a wide margin
      // over both, while a wrong or missing term in any gradient gives errors of order 1.
      CAPTURE(spec.name);
      CHECK(relative_error(analytic, numerical) <= 1e-4);
    }
  }

  // rows of wte for tokens absent from the batch are never read, so their gradient is exactly zero
  const ParamSpec& wte = stages[0].params[0];
  REQUIRE(wte.name == "wte");
  for (int token = 0; token < config.vocab_size; token++) {
    if (std::find(tokens.begin(), tokens.end(), token) != tokens.end()) continue;
    for (int c = 0; c < config.d_model; c++) {
      CAPTURE(token, c);
      CHECK(model.grads.data()[model.stage_offset(0) + wte.offset + token * config.d_model + c] == 0.0f);
    }
  }
}

}  // namespace

TEST_CASE("the GPT forward loss equals the double-precision reference", "[model]") {
  check_forward_against_reference(tiny_config());
}

TEST_CASE("GPT backward matches finite differences of the reference for every parameter tensor", "[model]") {
  check_backward_against_reference(tiny_config());
}

TEST_CASE("an MoE GPT's loss, cross-entropy plus the aux loss, equals the reference", "[model]") {
  SECTION("dropless") { check_forward_against_reference(tiny_moe_config(0.0f)); }
  SECTION("capacity factor 0.75: choices dropped") { check_forward_against_reference(tiny_moe_config(0.75f)); }
}

TEST_CASE("an MoE GPT's backward matches finite differences of the reference for every parameter tensor",
          "[model]") {
  SECTION("dropless") { check_backward_against_reference(tiny_moe_config(0.0f)); }
  SECTION("capacity factor 0.75: choices dropped") {
    // the point of this section: some choices of the batch are dropped
    RoutingStats routing;
    GPT model(tiny_moe_config(0.75f), 2, kSeed, Device::CPU, &routing);
    move_to_generic_point(model);
    const std::vector<int> tokens = random_tokens(model.config(), 2, 1), targets = random_tokens(model.config(), 2, 2);
    forward_loss(model, Device::CPU, tokens.data(), targets.data());
    REQUIRE(routing.dropped > 0);
    check_backward_against_reference(tiny_moe_config(0.75f));
  }
}

TEST_CASE("two micro-batches of 2 accumulate the same gradients as one micro-batch of 4", "[model]") {
  // Gradient accumulation, the basis of every data-parallel chapter: the gradient of the mean
  // loss over 4 sequences is the sum of the two halves' gradients when each half is scaled
  // by 1/(4T), the number of tokens averaged over in total.
  const GPTConfig config = tiny_config();
  const int T = config.seq_len;
  const std::vector<int> tokens = random_tokens(config, 4, 1), targets = random_tokens(config, 4, 2);
  const float dloss = 1.0f / (4 * T);

  GPT whole(config, 4, kSeed);
  GPT halves(config, 2, kSeed);
  // the same seed gives the same initial parameters, whatever the micro-batch
  REQUIRE(std::equal(whole.params.data(), whole.params.data() + whole.params.size(), halves.params.data()));

  const double whole_loss = forward_loss(whole, Device::CPU, tokens.data(), targets.data());
  whole.backward(dloss);

  const size_t half = tokens.size() / 2;
  double halves_loss_sum = forward_loss(halves, Device::CPU, tokens.data(), targets.data());
  halves.backward(dloss);
  halves_loss_sum += forward_loss(halves, Device::CPU, tokens.data() + half, targets.data() + half);
  halves.backward(dloss);

  // the same sums of the same fp32 terms, grouped differently: only the last bits may differ
  // (the halves are equally long, so the whole batch's mean loss is the mean of their two means)
  CHECK(std::abs(halves_loss_sum / 2 - whole_loss) / whole_loss <= 1e-6);
  CHECK(relative_error(to_double(halves.grads), to_double(whole.grads)) <= 1e-6);
}

TEST_CASE("the loss at initialisation is close to ln(vocab_size)", "[model]") {
  // Weights N(0, 0.02) make the logits ~N(0, 0.02^2 C) = N(0, 0.08^2) for C = 16: the
  // prediction is nearly uniform and each position's loss is ln V plus O(0.08) noise.
  // Averaged over 16 positions the noise is ~0.02; 0.1 is five times that. A loss far from
  // ln V at step 0 means a broken initialisation or a broken loss.
  const GPTConfig config = tiny_config();
  const int B = 2;
  GPT model(config, B, kSeed);
  const std::vector<int> tokens = random_tokens(config, B, 1), targets = random_tokens(config, B, 2);

  const double loss = forward_loss(model, Device::CPU, tokens.data(), targets.data());
  CHECK(loss == Approx(std::log(static_cast<double>(config.vocab_size))).margin(0.1));
}

TEST_CASE("a part's backward walk: head, blocks in reverse, embedding, through the ping-pong pair", "[model]") {
  // Each stage adds a number into its dx (the walk zeroed it) and records what it read,
  // so the routing of dL/d(residual stream) between the stages is visible in one float.
  const int64_t NC = 1;
  std::vector<float> residual_grad(2 * NC);
  std::vector<std::string> calls;
  PartBackwardStages stages;
  stages.blocks = 2;
  stages.block = [&](int b, const float* dout, float* dx) {
    calls.push_back("block " + std::to_string(b) + " read " + std::to_string(static_cast<int>(dout[0])));
    dx[0] += dout[0] + 10.0f * (b + 1);
  };

  SECTION("the whole model: every stage, nothing received or sent") {
    stages.head = [&](float* dx) {
      calls.push_back("head");
      dx[0] += 1.0f;
    };
    float embedding_read = -1.0f;
    stages.embedding = [&](const float* dout) { embedding_read = dout[0]; };
    walk_part_backward(stages, nullptr, nullptr, residual_grad.data(), NC, Device::CPU);
    CHECK(calls == std::vector<std::string>{"head", "block 1 read 1", "block 0 read 21"});
    CHECK(embedding_read == 31.0f);  // 1 + 20, then + 10
  }
  SECTION("a middle part: starts from the received dout, adds its input's gradient into dinput") {
    const float dout = 5.0f;
    float dinput = 100.0f;  // the walk adds, it does not overwrite
    walk_part_backward(stages, &dout, &dinput, residual_grad.data(), NC, Device::CPU);
    CHECK(calls == std::vector<std::string>{"block 1 read 5", "block 0 read 25"});
    CHECK(dinput == 135.0f);
  }
}
