// Chapter 09's expert-parallel MoE layer in real processes: ep_worker
// (tests/ep_worker.cpp) at 1, 2 and 4 ranks, over tcp (the course launcher) and mpi
// (mpirun), with 4 and 8 experts, top-1 and top-2, dropless and with a capacity that
// drops choices. Every rank checks its outputs, input gradient and its experts'
// gradients against moe.h's layer over the whole batch in one process (chapter 00's),
// the router's averaged over the ranks, and its all-to-all bytes against the formula.
// And the refusals: experts that do not divide over the ranks, k > E, a negative
// capacity factor.
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

ProcessResult run_worker(int ranks, const std::string& backend, const std::vector<std::string>& flags) {
  const std::vector<std::string> argv =
      concat(backend == "mpi" ? course_test::mpirun_command(ranks) : course_test::launcher_command(ranks),
             concat({course_binary("ep_worker"), "--backend", backend, "--comm-timeout", "60"}, flags));
  const ProcessResult result = run_process(argv, kTimeoutSeconds);
  UNSCOPED_INFO(joined(argv) << "\n" << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n"
                             << result.err);
  return result;
}

}  // namespace

TEST_CASE("the expert-parallel layer at 1, 2 and 4 ranks equals moe.h's over the whole batch, drops included",
          "[equivalence]") {
  const int ranks = GENERATE(1, 2, 4);
  const std::string backend = GENERATE(as<std::string>(), "tcp", "mpi");
  const std::string experts = GENERATE(as<std::string>(), "4", "8");
  const std::string top_k = GENERATE(as<std::string>(), "1", "2");
  const std::string capacity = GENERATE(as<std::string>(), "0", "1");
  const ProcessResult result = run_worker(
      ranks, backend, {"--experts", experts, "--top-k", top_k, "--capacity-factor", capacity});
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  for (int rank = 0; rank < ranks; rank++) {
    CHECK_THAT(result.out, Catch::Contains("rank " + std::to_string(rank) + ": all checks passed"));
  }
}

TEST_CASE("expert parallelism refuses experts that do not divide over the ranks, k > E and a negative capacity",
          "[equivalence]") {
  struct Refusal {
    int ranks;
    std::vector<std::string> flags;
    std::string message;
  };
  const std::vector<Refusal> refusals{
      {4, {"--experts", "6"}, "--experts 6 is not divisible by --ep 4"},
      {2, {"--experts", "2", "--top-k", "3"}, "--top-k 3 is more than --experts 2"},
      {2, {"--capacity-factor", "-1"}, "--capacity-factor"}};
  for (const Refusal& refusal : refusals) {
    const ProcessResult result = run_worker(refusal.ranks, "tcp", refusal.flags);
    REQUIRE_FALSE(result.timed_out);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.err, Catch::Contains(refusal.message));
    // one message: said by rank 0 alone
    CHECK(result.err.find("error:") == result.err.rfind("error:"));
  }
}
