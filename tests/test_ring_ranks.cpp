// Chapter 08's RingAttention in real processes: ring_worker (tests/ring_worker.cpp)
// at 1 to 4 ranks, over tcp (the course launcher) and mpi (mpirun), with the
// contiguous and the zigzag split. Every rank checks its atty and dqkv against ops'
// attention over the whole sequence, and its bytes sent and received against the
// formula of ring_attention.h; with --trace, the hops and the blocks' compute are
// spans. tests/test_ring_attention.cpp checks the block math alone.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "support/process.h"
#include "support/runs.h"
#include "support/trace_json.h"

using course_test::concat;
using course_test::course_binary;
using course_test::joined;
using course_test::ProcessResult;
using course_test::run_process;
using course_test::TempDir;

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

TEST_CASE("with --trace, each hop is a communication span and each block's compute a compute span", "[equivalence]") {
  const int ranks = 3;
  TempDir dir;
  const std::vector<std::string> argv =
      concat(course_test::launcher_command(ranks), {course_binary("ring_worker"), "--backend", "tcp", "--split",
                                                    "zigzag", "--trace", dir.file("trace.json")});
  const ProcessResult result = run_process(argv, kTimeoutSeconds);
  INFO(joined(argv) << "\n" << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE(result.exit_code == 0);
  // every rank attends to every rank's K/V block; 2 K/V hops and 3 dK/dV hops
  std::vector<course_test::ExpectedSpan> expected{{"K/V hop 1 of 2", 1},
                                                  {"K/V hop 2 of 2", 1},
                                                  {"dK/dV hop 1 of 3", 1},
                                                  {"dK/dV hop 2 of 3", 1},
                                                  {"dK/dV hop 3 of 3 (home)", 1}};
  for (int owner = 0; owner < ranks; owner++) {
    expected.push_back({"forward attention, K/V of cp rank " + std::to_string(owner), 0});
    expected.push_back({"backward attention, K/V of cp rank " + std::to_string(owner), 0});
  }
  course_test::check_chapter_trace(dir.file("trace.merged.json"), ranks, expected);
}
