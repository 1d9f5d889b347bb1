// The mixture-of-experts layer (common/model/moe.h): its output, choices and aux loss
// against a token-by-token double-precision reference (reference.h, reference_moe);
// its backward against central finite differences of that reference, for the input,
// the router and every expert parameter, through the gates and through the aux
// loss; and the rules by hand: a tie in the top-k, the choices capacity drops, the
// aux loss's value and gradient. Last, an MoE block's backward split in its input
// and weight halves equals the whole, bit for bit.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/model/moe.h"
#include "common/tensor/device.h"
#include "reference.h"
#include "support/equivalence_model.h"
#include "support/gpu.h"
#include "support/random.h"

using namespace course;
using course_test::random_floats;

namespace {

constexpr uint64_t kSeed = 7;
constexpr double kFiniteDifferenceStep = 1e-4;

// One MoE layer with random parameters at a generic point: router logits O(1)
// apart (no choice is near a tie, so finite differences never change one), expert
// weights large enough that GELU bends.
struct TestLayer {
  TestLayer(int N, int C, int E, int k, float capacity_factor)
      : sizes{N, C, E, k, moe_capacity(capacity_factor, N, E, k)},
        x(random_floats(kSeed, static_cast<size_t>(N) * C, 1, 1.0)),
        acts_storage(MoeActivations::floats(sizes), MemCategory::Activations),
        scratch_storage(MoeScratch::floats(sizes), MemCategory::Workspace) {
    const size_t E_ = E, C_ = C;
    const size_t counts[5] = {E_ * C_, E_ * 4 * C_ * C_, E_ * 4 * C_, E_ * C_ * 4 * C_, E_ * C_};
    const double scales[5] = {1.0, 0.5, 0.2, 0.3, 0.2};
    for (int p = 0; p < 5; p++) {
      offsets[p] = params.size();
      const std::vector<float> values = random_floats(kSeed, counts[p], 10 + p, scales[p]);
      params.insert(params.end(), values.begin(), values.end());
    }
    Carver acts_carver(acts_storage.data());
    acts.carve(acts_carver, sizes);
    Carver scratch_carver(scratch_storage.data());
    scratch.carve(scratch_carver, sizes);
  }

  // the five parameters' views into a buffer laid out as `params`
  MoeWeights weights(float* buffer) const {
    return {buffer + offsets[0], buffer + offsets[1], buffer + offsets[2], buffer + offsets[3], buffer + offsets[4]};
  }

  // the reference's layer at (x, params), given in double
  ReferenceMoe reference(const std::vector<double>& x_, const std::vector<double>& params_) const {
    const double* p = params_.data();
    return reference_moe(x_.data(), p + offsets[0], p + offsets[1], p + offsets[2], p + offsets[3], p + offsets[4],
                         sizes.tokens, sizes.channels, sizes.experts, sizes.top_k, sizes.capacity);
  }

  MoeSizes sizes;
  std::vector<float> x;       // (N, C)
  std::vector<float> params;  // router_w, expert_fc_w, expert_fc_b, expert_fcproj_w, expert_fcproj_b
  size_t offsets[5] = {};
  Buffer acts_storage;
  MoeActivations acts;
  Buffer scratch_storage;
  MoeScratch scratch;
};

std::vector<double> to_double(const std::vector<float>& values) { return {values.begin(), values.end()}; }

void check_forward(int N, int C, int E, int k, float capacity_factor) {
  TestLayer layer(N, C, E, k, capacity_factor);
  std::vector<float> out(static_cast<size_t>(N) * C);
  moe_forward(out.data(), layer.x.data(), layer.weights(layer.params.data()), layer.acts, layer.sizes, Device::CPU);
  const ReferenceMoe expected = layer.reference(to_double(layer.x), to_double(layer.params));

  CHECK(std::vector<int>(layer.acts.expert, layer.acts.expert + N * k) == expected.expert);
  std::vector<int> kept(N * k);
  for (int i = 0; i < N * k; i++) kept[i] = layer.acts.row[i] >= 0 ? 1 : 0;
  CHECK(kept == expected.kept);
  CHECK(layer.acts.dropped == std::count(expected.kept.begin(), expected.kept.end(), 0));
  // fp32 through a softmax, two GEMMs and GELU: ~1e-6 relative
  CHECK(relative_error(out, expected.out) <= 1e-5);
  CHECK(std::abs(layer.acts.aux_loss - expected.aux) <= 1e-6 * expected.aux);
}

// L = sum(weights_out * out) + daux aux: the analytic gradient of every input and
// parameter element against central differences of the reference's L.
void check_backward(int N, int C, int E, int k, float capacity_factor) {
  TestLayer layer(N, C, E, k, capacity_factor);
  const float daux = 0.7f;
  const std::vector<float> dout = random_floats(kSeed, static_cast<size_t>(N) * C, 2, 1.0);
  std::vector<float> out(static_cast<size_t>(N) * C);
  moe_forward(out.data(), layer.x.data(), layer.weights(layer.params.data()), layer.acts, layer.sizes, Device::CPU);
  if (capacity_factor > 0.0f) REQUIRE(layer.acts.dropped > 0);

  // backward adds: the gradients start at 0.5, which is taken off again below
  std::vector<float> dx(layer.x.size(), 0.5f), grads(layer.params.size(), 0.5f);
  moe_backward(dx.data(), layer.weights(grads.data()), layer.scratch, dout.data(), daux, layer.x.data(),
               layer.weights(layer.params.data()), layer.acts, layer.sizes, Device::CPU);

  std::vector<double> x = to_double(layer.x), params = to_double(layer.params);
  const auto loss = [&] {
    const ReferenceMoe moe = layer.reference(x, params);
    double sum = daux * moe.aux;
    for (size_t i = 0; i < moe.out.size(); i++) sum += dout[i] * moe.out[i];
    return sum;
  };
  const auto numerical_gradient = [&](std::vector<double>& point, size_t begin, size_t end) {
    std::vector<double> gradient;
    for (size_t i = begin; i < end; i++) {
      const double original = point[i];
      point[i] = original + kFiniteDifferenceStep;
      const double plus = loss();
      point[i] = original - kFiniteDifferenceStep;
      const double minus = loss();
      point[i] = original;
      gradient.push_back((plus - minus) / (2 * kFiniteDifferenceStep));
    }
    return gradient;
  };
  const auto analytic = [](const std::vector<float>& g, size_t begin, size_t end) {
    std::vector<float> gradient;
    for (size_t i = begin; i < end; i++) gradient.push_back(g[i] - 0.5f);
    return gradient;
  };

  // fp32 rounding ~1e-6 relative, the differences in double ~1e-8: 1e-4 is a wide
  // margin, and a wrong or missing term gives errors of order 1
  CHECK(relative_error(analytic(dx, 0, dx.size()), numerical_gradient(x, 0, x.size())) <= 1e-4);
  const char* names[5] = {"router_w", "expert_fc_w", "expert_fc_b", "expert_fcproj_w", "expert_fcproj_b"};
  for (int p = 0; p < 5; p++) {
    const size_t begin = layer.offsets[p], end = p < 4 ? layer.offsets[p + 1] : params.size();
    CAPTURE(names[p]);
    CHECK(relative_error(analytic(grads, begin, end), numerical_gradient(params, begin, end)) <= 1e-4);
  }
}

}  // namespace

TEST_CASE("the MoE layer's output, choices, drops and aux loss equal a token-by-token reference", "[moe]") {
  SECTION("E 4, top-2, dropless") { check_forward(16, 8, 4, 2, 0.0f); }
  SECTION("E 4, top-1, dropless") { check_forward(16, 8, 4, 1, 0.0f); }
  SECTION("E 8, top-2, dropless") { check_forward(16, 8, 8, 2, 0.0f); }
  SECTION("E 4, top-2, capacity factor 0.5: half the choices have a place") { check_forward(16, 8, 4, 2, 0.5f); }
  SECTION("E 4, top-1, capacity factor 1.0") { check_forward(16, 8, 4, 1, 1.0f); }
}

TEST_CASE("the MoE layer's backward matches finite differences of the reference, gates and aux loss included",
          "[moe]") {
  // top-1's gate is p itself: its router learns from the outputs too, not from the aux loss alone
  SECTION("E 4, top-2, dropless") { check_backward(6, 4, 4, 2, 0.0f); }
  SECTION("E 4, top-1, dropless") { check_backward(6, 4, 4, 1, 0.0f); }
  SECTION("E 3, top-3: every expert chosen, the gates are the router's probabilities") {
    check_backward(6, 4, 3, 3, 0.0f);
  }
  SECTION("E 4, top-2, capacity factor 0.5: dropped choices add nothing") { check_backward(6, 4, 4, 2, 0.5f); }
}

TEST_CASE("top-k takes the k most probable experts, a tie going to the lower index, and renormalises the gates",
          "[moe]") {
  // (top-1 does not renormalise: the next test)
  const MoeSizes sizes{4, 1, 4, 2, 4};
  const std::vector<float> probs = {0.25f, 0.25f, 0.25f, 0.25f,   // a four-way tie: experts 0 and 1
                                    0.1f,  0.3f,  0.3f,  0.3f,    // a three-way tie below nothing: 1 and 2
                                    0.4f,  0.1f,  0.1f,  0.4f,    // tied first place: 0 before 3
                                    0.1f,  0.2f,  0.6f,  0.1f};   // no tie: 2, then 1
  std::vector<int> expert(8);
  std::vector<float> gate(8);
  moe_ops::route_top_k(expert.data(), gate.data(), probs.data(), sizes);
  CHECK(expert == std::vector<int>{0, 1, 1, 2, 0, 3, 2, 1});
  CHECK(gate[0] == 0.5f);
  CHECK(gate[1] == 0.5f);
  CHECK(gate[6] == Approx(0.6 / 0.8));
  CHECK(gate[7] == Approx(0.2 / 0.8));
}

TEST_CASE("top-1 gates by the router's probability itself (Switch), and passes dgate to that probability",
          "[moe]") {
  const MoeSizes sizes{3, 1, 4, 1, 3};
  const std::vector<float> probs = {0.25f, 0.25f, 0.25f, 0.25f,   // a tie: expert 0
                                    0.1f,  0.2f,  0.6f,  0.1f,
                                    0.1f,  0.4f,  0.1f,  0.4f};   // a tie: 1 before 3
  std::vector<int> expert(3);
  std::vector<float> gate(3);
  moe_ops::route_top_k(expert.data(), gate.data(), probs.data(), sizes);
  CHECK(expert == std::vector<int>{0, 2, 1});
  CHECK(gate == std::vector<float>{0.25f, 0.6f, 0.4f});  // not p / p = 1

  // backward adds dgate to the chosen expert's probability and nothing elsewhere
  const std::vector<float> dgate = {2.0f, -1.0f, 0.5f};
  std::vector<float> dprobs(12, 1.0f);
  moe_ops::route_top_k_backward(dprobs.data(), dgate.data(), expert.data(), gate.data(), probs.data(), sizes);
  CHECK(dprobs == std::vector<float>{3.0f, 1.0f, 1.0f, 1.0f,    // token 0: expert 0 += 2
                                     1.0f, 1.0f, 0.0f, 1.0f,    // token 1: expert 2 += -1
                                     1.0f, 1.5f, 1.0f, 1.0f});  // token 2: expert 1 += 0.5
}

TEST_CASE("capacity: each expert keeps its first choices in token order, the others are dropped and counted",
          "[moe]") {
  CHECK(moe_capacity(0.0f, 8, 4, 2) == 8);     // dropless: no expert can get more than every token
  CHECK(moe_capacity(1.25f, 8, 4, 2) == 5);    // ceil(1.25 x 8 x 2 / 4)
  CHECK(moe_capacity(1.0f, 10, 4, 1) == 3);    // ceil(2.5)
  CHECK(moe_capacity(100.0f, 8, 4, 2) == 8);   // at most N
  CHECK(moe_capacity(0.01f, 8, 4, 1) == 1);

  // 5 tokens, top-2 of 3 experts, 2 places each
  const MoeSizes sizes{5, 1, 3, 2, 2};
  const std::vector<int> expert = {0, 1,    // token 0
                                   0, 2,    // token 1
                                   1, 0,    // token 2: expert 0 is full (tokens 0 and 1)
                                   0, 1,    // token 3: both full (expert 1 has tokens 0 and 2)
                                   2, 1};   // token 4: expert 2 has room, expert 1 not
  std::vector<int> row(10), expert_begin(4), routed(3);
  moe_ops::assign_rows(row.data(), expert_begin.data(), routed.data(), expert.data(), sizes);
  CHECK(dropped_choices(routed.data(), sizes) == 4);
  CHECK(routed == std::vector<int>{4, 4, 2});
  CHECK(expert_begin == std::vector<int>{0, 2, 4, 6});
  // expert 0: rows 0, 1 = tokens 0, 1; expert 1: rows 2, 3 = tokens 0, 2; expert 2: rows 4, 5 = tokens 1, 4
  CHECK(row == std::vector<int>{0, 2, 1, 4, 3, -1, -1, -1, 5, -1});

  // a dropped choice adds nothing: token 3 lost both and gets zeros (the residual carries it)
  const std::vector<float> expert_out = {1, 2, 3, 4, 5, 6};  // (6 rows, C = 1)
  const std::vector<float> gate = {0.5f, 0.5f, 0.25f, 0.75f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  std::vector<float> out(5, -1.0f);
  moe_ops::combine_forward(out.data(), expert_out.data(), gate.data(), row.data(), sizes);
  CHECK(out == std::vector<float>{0.5f * 1 + 0.5f * 3, 0.25f * 2 + 0.75f * 5, 0.5f * 4, 0.0f, 0.5f * 6});
}

TEST_CASE("the aux loss is 1 when balanced, E sum f_e P_e otherwise, with gradient E f_e / N per token", "[moe]") {
  SECTION("uniform probabilities and choices: 1") {
    const MoeSizes sizes{4, 1, 4, 1, 4};
    const std::vector<float> probs(16, 0.25f);
    const std::vector<int> routed = {1, 1, 1, 1};
    CHECK(moe_ops::aux_loss_forward(probs.data(), routed.data(), sizes) == Approx(1.0));
  }
  SECTION("every choice to expert 0") {
    // f = (1, 0), P = (0.625, 0.375): aux = 2 (1 x 0.625) = 1.25
    const MoeSizes sizes{2, 1, 2, 1, 2};
    const std::vector<float> probs = {0.75f, 0.25f, 0.5f, 0.5f};
    const std::vector<int> routed = {2, 0};
    CHECK(moe_ops::aux_loss_forward(probs.data(), routed.data(), sizes) == Approx(1.25));
    std::vector<float> dprobs(4, 1.0f);  // backward adds
    moe_ops::aux_loss_backward(dprobs.data(), routed.data(), 0.5f, sizes);
    // daux E f_e / N = 0.5 x 2 x 1 / 2 for expert 0, 0 for expert 1
    CHECK(dprobs == std::vector<float>{1.5f, 1.0f, 1.5f, 1.0f});
  }
}

TEST_CASE("an MoE block's backward in two halves, input then weight, equals the whole bit for bit", "[moe]") {
  // chapter 05's zero-bubble split: the experts' and router's gradients come with the
  // input half, the attention's two weight GEMMs with the weight half
  // the equivalence tests' small model, with 4 experts per block, top-2, and drops
  GPTConfig config = course_test::model_config();
  config.n_experts = 4;
  config.top_k = 2;
  config.capacity_factor = 1.0f;
  const int B = 2;
  const size_t NC = static_cast<size_t>(B) * config.seq_len * config.d_model;
  const StageLayout layout = block_layout(config, 0);
  std::vector<float> params = random_floats(kSeed, layout.numel, 3, 0.3);
  const std::vector<float> x = random_floats(kSeed, NC, 4, 1.0), dout = random_floats(kSeed, NC, 5, 1.0);
  BlockActivations acts(config, B);
  block_forward(config, block_weights(params.data(), config), acts, x.data(), B);

  std::vector<float> whole_grads(layout.numel), split_grads(layout.numel), whole_dx(NC), split_dx(NC);
  BackwardScratch scratch(config, B);
  const float daux = moe_aux_grad(config, 1.0f / (B * config.seq_len), B);
  block_backward(config, block_weights(params.data(), config), block_weights(whole_grads.data(), config), acts,
                 scratch, x.data(), dout.data(), whole_dx.data(), B, nullptr, daux);
  const BlockWeights split = block_weights(split_grads.data(), config);
  block_backward_input(config, block_weights(params.data(), config), split, acts, scratch, x.data(), dout.data(),
                       split_dx.data(), B, nullptr, daux);
  block_backward_weight(config, split, acts, {scratch.dqkv, scratch.dres2, nullptr, nullptr}, B);
  CHECK(whole_dx == split_dx);
  CHECK(whole_grads == split_grads);
}

TEST_CASE("a dense block's backward in two halves, input then weight, equals the whole bit for bit, at fp32 and bf16",
          "[model]") {
  // block_backward makes each linear layer's dinp and dweight in one call, which under
  // bf16 rounds dout once for both GEMMs (gemm_cpu.h, prepare_a); the zero-bubble split
  // makes them in two calls, rounding it twice: the same values, the same bits
  const GPTConfig config = course_test::model_config();
  const int B = 2;
  const size_t NC = static_cast<size_t>(B) * config.seq_len * config.d_model;
  const StageLayout layout = block_layout(config, 0);
  std::vector<float> params = random_floats(kSeed, layout.numel, 3, 0.3);
  const std::vector<float> x = random_floats(kSeed, NC, 4, 1.0), dout = random_floats(kSeed, NC, 5, 1.0);
  for (const MatmulPrecision precision : {MatmulPrecision::FP32, MatmulPrecision::BF16}) {
    INFO((precision == MatmulPrecision::BF16 ? "bf16" : "fp32"));
    const course_test::MatmulPrecisionScope scope(precision);
    BlockActivations acts(config, B);
    block_forward(config, block_weights(params.data(), config), acts, x.data(), B);
    std::vector<float> whole_grads(layout.numel), split_grads(layout.numel), whole_dx(NC), split_dx(NC);
    BackwardScratch scratch(config, B);
    block_backward(config, block_weights(params.data(), config), block_weights(whole_grads.data(), config), acts,
                   scratch, x.data(), dout.data(), whole_dx.data(), B);
    const BlockWeights split = block_weights(split_grads.data(), config);
    block_backward_input(config, block_weights(params.data(), config), split, acts, scratch, x.data(), dout.data(),
                         split_dx.data(), B);
    block_backward_weight(config, split, acts, {scratch.dqkv, scratch.dres2, scratch.dfch, dout.data()}, B);
    CHECK(whole_dx == split_dx);
    CHECK(whole_grads == split_grads);
  }
}
