// The data pipeline: a sampler whose global batch depends only on (seed, step),
// never on how many ranks consume it.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <vector>

#include "common/model/data.h"
#include "common/tensor/error.h"

using namespace course;

TEST_CASE("the built-in corpus is fixed, printable text", "[data]") {
  std::string first = generated_corpus(100000), second = generated_corpus(100000);
  REQUIRE(first == second);
  REQUIRE(first.size() >= 100000);
  for (char c : first) REQUIRE((c == '\n' || (c >= ' ' && c <= '~')));
  // it is made of sentences, not noise: every line ends with a full stop
  CHECK(first.find(".\n") != std::string::npos);
}

TEST_CASE("the sampler is deterministic and targets are tokens shifted by one", "[data]") {
  TextData data = load_text_data("", 32);
  const int T = 32, B = 6;
  BatchSampler sampler(data, T, B, 1234);
  std::vector<int> tokens(B * T), targets(B * T), tokens_again(B * T), targets_again(B * T);
  sampler.fill(3, 0, B, tokens.data(), targets.data());
  sampler.fill(3, 0, B, tokens_again.data(), targets_again.data());
  REQUIRE(tokens == tokens_again);
  REQUIRE(targets == targets_again);
  for (int r = 0; r < B; r++) {
    for (int t = 0; t + 1 < T; t++) REQUIRE(targets[r * T + t] == tokens[r * T + t + 1]);
  }
  // another step or another seed draws other windows
  sampler.fill(4, 0, B, tokens_again.data(), targets_again.data());
  CHECK(tokens != tokens_again);
  BatchSampler other_seed(data, T, B, 99);
  other_seed.fill(3, 0, B, tokens_again.data(), targets_again.data());
  CHECK(tokens != tokens_again);
}

TEST_CASE("data-parallel slices tile the global batch whatever the world size", "[data]") {
  TextData data = load_text_data("", 16);
  const int T = 16, B = 12;
  BatchSampler sampler(data, T, B, 5);
  std::vector<int> global_tokens(B * T), global_targets(B * T);
  sampler.fill(7, 0, B, global_tokens.data(), global_targets.data());
  for (int dp_size : {1, 2, 3, 4, 6, 12}) {
    std::vector<int> joined;
    for (int dp_rank = 0; dp_rank < dp_size; dp_rank++) {
      RowSlice slice = data_parallel_slice(B, dp_rank, dp_size);
      REQUIRE(slice.first_row == dp_rank * (B / dp_size));
      REQUIRE(slice.rows == B / dp_size);
      std::vector<int> tokens(slice.rows * T), targets(slice.rows * T);
      sampler.fill(7, slice.first_row, slice.rows, tokens.data(), targets.data());
      joined.insert(joined.end(), tokens.begin(), tokens.end());
    }
    INFO("dp_size " << dp_size);
    REQUIRE(joined == global_tokens);
  }
  CHECK_THROWS_AS(data_parallel_slice(B, 0, 5), UsageError);
}

TEST_CASE("a data file is read byte for byte, and a missing or short one is a usage error", "[data]") {
  char path[] = "/tmp/course_data_XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  {
    std::ofstream file(path, std::ios::binary);
    file << "hello, bytes\x01\xff";
  }
  TextData data = load_text_data(path, 4);
  CHECK(data.bytes.size() == 14);
  CHECK(data.bytes.back() == 0xff);
  CHECK_THROWS_AS(load_text_data(path, 20), UsageError);
  std::remove(path);
  CHECK_THROWS_AS(load_text_data(path, 4), UsageError);
}
