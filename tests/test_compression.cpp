// Chapter 10's pieces alone, in one process: int8's rounding bound, error feedback's
// promise (the messages' sum follows the true sum within one message's rounding), the
// fragments and their schedule. (The bf16 conversion: test_bf16.cpp. Real runs:
// test_slow_links.cpp.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "10_slow_links/compression.h"
#include "10_slow_links/diloco.h"
#include "support/equivalence_model.h"
#include "support/random.h"

namespace {

TEST_CASE("int8: each value within half a step of its block's scale, the block's largest exact", "[slow_links]") {
  using course::Compression;
  const size_t count = 3 * course::kInt8Block + 17;  // a short last block
  std::vector<float> values = course_test::random_floats(3, count, 0, 2.0);
  values[5] = 40.0f;  // one large value sets its block's scale
  std::vector<uint8_t> message(course::encoded_bytes(Compression::Int8, count));
  CHECK(message.size() == count + 4 * 4);
  course::encode(Compression::Int8, values.data(), count, message.data());
  std::vector<float> decoded(count);
  course::decode(Compression::Int8, message.data(), count, decoded.data());
  for (size_t block = 0; block * course::kInt8Block < count; block++) {
    const size_t begin = block * course::kInt8Block, end = std::min(count, begin + course::kInt8Block);
    float max_abs = 0.0f;
    for (size_t i = begin; i < end; i++) max_abs = std::max(max_abs, std::fabs(values[i]));
    const float scale = max_abs / 127.0f;
    for (size_t i = begin; i < end; i++) {
      INFO("value " << i);
      REQUIRE(std::fabs(decoded[i] - values[i]) <= 0.5f * scale * (1 + 1e-5f));
      if (std::fabs(values[i]) == max_abs) CHECK(std::fabs(decoded[i] - values[i]) <= 1e-6f * max_abs);
    }
  }
}

TEST_CASE("error feedback: the messages' sum follows the true sum within one message's rounding", "[slow_links]") {
  using course::Compression;
  const size_t count = 2 * course::kInt8Block;
  const int steps = 200;
  for (Compression compression : {Compression::Int8, Compression::BF16}) {
    INFO(course::compression_name(compression));
    course::ErrorFeedback with(compression, count, true), without(compression, count, false);
    std::vector<double> true_sum(count, 0.0), sent_with(count, 0.0), sent_without(count, 0.0);
    std::vector<uint8_t> message(course::encoded_bytes(compression, count));
    std::vector<float> decoded(count);
    double last_rounding = 0.0;  // the last message's largest possible rounding
    for (int step = 0; step < steps; step++) {
      // gradients with a small steady part that int8 rounds away without feedback
      std::vector<float> gradient = course_test::random_floats(11, count, step, 1.0);
      for (float& g : gradient) g = 0.001f + 0.01f * g;
      gradient[0] = 1.0f;  // a large value in each block sets a coarse scale
      gradient[course::kInt8Block] = 1.0f;
      for (size_t i = 0; i < count; i++) true_sum[i] += gradient[i];
      for (auto [feedback, sent] : {std::pair{&with, &sent_with}, std::pair{&without, &sent_without}}) {
        std::vector<float> values = gradient;
        feedback->encode_with_feedback(values.data(), count, 0, message.data());
        course::decode(compression, message.data(), count, decoded.data());
        for (size_t i = 0; i < count; i++) (*sent)[i] += decoded[i];
      }
      last_rounding = compression == Compression::Int8 ? 0.5 * (1.0 + 0.01) / 127.0 : 0.01;
    }
    double worst_with = 0.0, worst_without = 0.0;
    for (size_t i = 0; i < count; i++) {
      worst_with = std::max(worst_with, std::fabs(sent_with[i] - true_sum[i]));
      worst_without = std::max(worst_without, std::fabs(sent_without[i] - true_sum[i]));
    }
    INFO("with feedback " << worst_with << ", without " << worst_without);
    CHECK(worst_with <= last_rounding + 1e-4);  // the residual: one message's rounding, and fp32's sums
    if (compression == Compression::Int8) CHECK(worst_without > 10 * last_rounding);  // the steady part, lost
  }
}

TEST_CASE("streaming: fragments cover the model in block order, each synced every H steps, staggered",
          "[slow_links]") {
  course::GPTConfig config = course_test::model_config();
  config.n_layer = 4;
  course::GPT model(config, 1, 1);
  const std::vector<course::Fragment> fragments = course::cut_fragments(model, 2);
  REQUIRE(fragments.size() == 2);
  CHECK(fragments[0].begin == 0);
  CHECK(fragments[0].end == model.stage_offset(3));  // the embedding and blocks 0, 1
  CHECK(fragments[1].begin == fragments[0].end);
  CHECK(fragments[1].end == model.params.size());  // blocks 2, 3 and the head
  // H 8, P 4: fragment p at the steps where step + 2p is a multiple of 8 (diloco.h's picture)
  const std::vector<std::vector<int>> expected = {{8, 16}, {6, 14}, {4, 12}, {2, 10}};
  for (int p = 0; p < 4; p++) {
    std::vector<int> due;
    for (int step = 1; step <= 16; step++) {
      if (course::fragment_due(p, 4, 8, step)) due.push_back(step);
    }
    CHECK(due == expected[p]);
  }
}

}  // namespace
