// Layout-independent initialisation: every weight element is a function of
// (seed, parameter name, element index) only. This is what lets a rank that owns
// a slice or a stage build exactly its part of chapter 00's model.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "common/model/model.h"
#include "common/model/rng.h"

using namespace course;

TEST_CASE("Philox4x32-10 matches the Random123 known-answer vectors", "[init]") {
  // from Random123's kat_vectors: a wrong round or key schedule fails here first
  auto zeros = philox4x32({0, 0, 0, 0}, {0, 0});
  CHECK(zeros == std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  auto ones = philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  CHECK(ones == std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
  auto pi = philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u});
  CHECK(pi == std::array<uint32_t, 4>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});
}

TEST_CASE("any slice of a stage initialises to the same values as the whole stage", "[init]") {
  GPTConfig config;
  config.seq_len = 16;
  config.n_layer = 2;
  config.d_model = 24;
  config.n_head = 3;
  for (const StageLayout& stage : model_layout(config)) {
    std::vector<float> whole(stage.numel);
    init_stage_slice(stage, 7, whole.data(), 0, stage.numel);
    // slices that start and end inside parameters and span several of them
    const size_t cuts[][2] = {{0, 1}, {5, 77}, {stage.numel / 3, stage.numel / 2}, {1, stage.numel}};
    for (const auto& cut : cuts) {
      std::vector<float> part(cut[1] - cut[0]);
      init_stage_slice(stage, 7, part.data(), cut[0], cut[1]);
      for (size_t i = 0; i < part.size(); i++) REQUIRE(part[i] == whole[cut[0] + i]);
    }
  }
}

TEST_CASE("weights are N(0, 0.02), biases 0, LayerNorm weights 1", "[init]") {
  GPTConfig config;
  config.d_model = 64;
  StageLayout block = block_layout(config, 0);
  std::vector<float> values(block.numel);
  init_stage_slice(block, 1, values.data(), 0, block.numel);
  for (const ParamSpec& spec : block.params) {
    double sum = 0, sum_sq = 0;
    for (size_t i = 0; i < spec.numel; i++) {
      sum += values[spec.offset + i];
      sum_sq += values[spec.offset + i] * values[spec.offset + i];
    }
    double mean = sum / spec.numel, std = std::sqrt(sum_sq / spec.numel - mean * mean);
    INFO(spec.name);
    if (spec.init == InitKind::Normal002) {
      // at least 4096 samples: the sample std is within a few percent of 0.02
      CHECK(std::abs(mean) < 0.002);
      CHECK(std == Approx(0.02).epsilon(0.05));
    } else {
      CHECK(std == 0.0);
      CHECK(mean == (spec.init == InitKind::Ones ? 1.0 : 0.0));
    }
  }
}

TEST_CASE("each parameter has its own random stream, and the seed changes all of them", "[init]") {
  GPTConfig config;
  StageLayout block0 = block_layout(config, 0), block1 = block_layout(config, 1);
  const ParamSpec& qkv0 = block0.params[2];
  const ParamSpec& qkv1 = block1.params[2];
  REQUIRE(qkv0.name == "block0.qkv_w");
  REQUIRE(qkv1.name == "block1.qkv_w");
  int same_name = 0, same_seed = 0;
  for (size_t i = 0; i < 100; i++) {
    same_name += init_value(qkv0, 1, i) == init_value(qkv1, 1, i);
    same_seed += init_value(qkv0, 1, i) == init_value(qkv0, 2, i);
  }
  CHECK(same_name == 0);
  CHECK(same_seed == 0);
}

TEST_CASE("the GPT's flat buffer is its stages' initialisations laid end to end", "[init]") {
  GPTConfig config;
  config.seq_len = 8;
  config.n_layer = 3;
  config.d_model = 16;
  config.n_head = 2;
  GPT model(config, 1, 42);
  REQUIRE(model.params.size() == count_parameters(config));
  for (size_t s = 0; s < model.layout().size(); s++) {
    const StageLayout& stage = model.layout()[s];
    std::vector<float> expected(stage.numel);
    init_stage_slice(stage, 42, expected.data(), 0, stage.numel);
    for (size_t i = 0; i < stage.numel; i++) REQUIRE(model.params.data()[model.stage_offset(s) + i] == expected[i]);
  }
}
