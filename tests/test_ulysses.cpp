// Chapter 08's Ulysses (all-to-all) attention:
// - ulysses_worker (tests/ulysses_worker.cpp) at 1 to 4 ranks, tcp and mpi, with the
//   contiguous and the zigzag split: forward and backward on each rank's positions
//   against ops' causal attention over the whole sequence, the bytes each all_to_all
//   sends against the formula, and at 3 ranks a head count that 3 does not divide;
// - the bytes formula itself against the header's expression.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "08_context_parallel/sequence_split.h"
#include "08_context_parallel/ulysses_attention.h"
#include "support/process.h"
#include "support/runs.h"

using course_test::concat;
using course_test::course_binary;
using course_test::joined;
using course_test::ProcessResult;
using course_test::run_process;

namespace {

const double kTimeoutSeconds = 180;

int count_of(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) count++;
  return count;
}

}  // namespace

TEST_CASE("Ulysses attention equals the unsplit attention at 1 to 4 ranks, contiguous and zigzag, tcp and mpi",
          "[equivalence]") {
  const int ranks = GENERATE(1, 2, 3, 4);
  const std::string backend = GENERATE(as<std::string>(), "tcp", "mpi");
  const std::vector<std::string> launcher =
      backend == "mpi" ? course_test::mpirun_command(ranks) : course_test::launcher_command(ranks);
  const std::vector<std::string> argv =
      concat(launcher, {course_binary("ulysses_worker"), "--backend", backend, "--comm-timeout", "60"});
  const ProcessResult result = run_process(argv, kTimeoutSeconds);
  INFO(joined(argv) << "\n" << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(count_of(result.out, "all checks passed (" + backend) == ranks);
  // the bound above is what is promised; bit for bit is what ops' per-head math gives
  if (count_of(result.out, "bit-identical to the unsplit attention") != ranks) WARN("not bit-identical");
}

TEST_CASE("Ulysses' bytes per layer are 4 B T C (N-1) / N^2 floats each way, none at one rank", "[unit]") {
  struct Case {
    int B, T, C, N;
  };
  for (const Case c : {Case{2, 24, 48, 1}, Case{2, 24, 48, 2}, Case{3, 24, 48, 3}, Case{4, 1024, 768, 8}}) {
    INFO("B " << c.B << " T " << c.T << " C " << c.C << " N " << c.N);
    const course::AttentionBytes bytes = course::ulysses_attention_bytes(c.B, c.T, c.C, c.N);
    const double floats = 4.0 * c.B * c.T * c.C * (c.N - 1) / (static_cast<double>(c.N) * c.N);
    CHECK(bytes.forward == static_cast<uint64_t>(4 * floats));
    CHECK(bytes.backward == bytes.forward);
  }
}

// Zigzag's reason to exist is balance: with causal attention a query at position q
// scores q + 1 keys, so a rank's work is the sum of q + 1 over the positions it
// holds. Counted here, not timed: a split that put the second chunk at cp + r
// instead of 2cp-1-r trains the same losses, and only this notices (at cp 4 and
// T = 64 its ranks' counts are 328, 456, 584, 712, against 520 each).
TEST_CASE("zigzag gives every cp rank the same number of causal score pairs, and contiguous does not", "[unit]") {
  for (const int cp : {2, 4, 8}) {
    const int T = 16 * cp;
    INFO("cp " << cp << ", T " << T);
    const auto pairs_of = [&](const course::SequenceSplit& split, int rank) {
      long long pairs = 0;
      int positions = 0;
      for (const course::PositionChunk& chunk : split.chunks_of(rank)) {
        for (int q = chunk.start; q < chunk.start + chunk.length; q++) pairs += q + 1;
        positions += chunk.length;
      }
      CHECK(positions == T / cp);  // every rank holds T / cp positions either way
      return pairs;
    };
    const course::SequenceSplit zigzag(T, cp, course::SplitKind::Zigzag);
    const course::SequenceSplit contiguous(T, cp, course::SplitKind::Contiguous);
    long long total = 0;
    for (int rank = 0; rank < cp; rank++) {
      CHECK(pairs_of(zigzag, rank) == pairs_of(zigzag, 0));
      total += pairs_of(zigzag, rank);
    }
    CHECK(total == static_cast<long long>(T) * (T + 1) / 2);  // every position, once
    CHECK(pairs_of(contiguous, cp - 1) > pairs_of(contiguous, 0));
  }
}
