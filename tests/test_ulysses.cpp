// Chapter 08's Ulysses (all-to-all) attention:
// - ulysses_worker (tests/ulysses_worker.cpp) at 1 to 4 ranks, tcp and mpi, with the
//   contiguous and the zigzag split: forward and backward on each rank's positions
//   against ops' causal attention over the whole sequence, the bytes each all_to_all
//   sends against the formula, and at 3 ranks a head count that 3 does not divide;
// - the bytes formula itself against the header's expression.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

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
