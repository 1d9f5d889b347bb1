// Chapter 08's RingAttention in real processes: ring_worker (tests/ring_worker.cpp)
// at 1 to 4 ranks, over tcp (the course launcher) and mpi (mpirun), with the
// contiguous and the zigzag split. Every rank checks its atty and dqkv against ops'
// attention over the whole sequence, and its bytes sent and received against the
// formula of ring_attention.h. tests/test_ring_attention.cpp checks the block math alone.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "support/process.h"
#include "support/runs.h"

using course_test::concat;
using course_test::course_binary;
using course_test::joined;
using course_test::ProcessResult;
using course_test::run_process;

namespace {

const double kTimeoutSeconds = 120;

}  // namespace

TEST_CASE("ring attention at 1 to 4 ranks, contiguous and zigzag, equals ops' attention and sends the formula's bytes",
          "[equivalence]") {
  const int ranks = GENERATE(1, 2, 3, 4);
  const std::string backend = GENERATE(as<std::string>(), "tcp", "mpi");
  const std::string split = GENERATE(as<std::string>(), "contiguous", "zigzag");
  const std::vector<std::string> argv =
      concat(backend == "mpi" ? course_test::mpirun_command(ranks) : course_test::launcher_command(ranks),
             {course_binary("ring_worker"), "--backend", backend, "--split", split, "--comm-timeout", "60"});
  const ProcessResult result = run_process(argv, kTimeoutSeconds);
  INFO(joined(argv) << "\n" << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  for (int rank = 0; rank < ranks; rank++) {
    CHECK_THAT(result.out, Catch::Contains("rank " + std::to_string(rank) + ": all checks passed"));
  }
}
