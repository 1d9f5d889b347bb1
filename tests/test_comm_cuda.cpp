// The communication library on GPU buffers (label cuda): comm_worker --device cuda
// runs every collective of test_comm.cpp on device buffers, plus the ordering
// against compute still queued on the GPU, through both GPU paths:
//
//   nccl                  device buffers handed to NCCL, one GPU per rank: world size
//                         1 (a one-GPU machine has room for one nccl rank)
//   tcp, mpi + staging    the ranks share the GPU; every operation copies its device
//                         buffers to the host and back: world size 2 on one GPU
//
// and what --backend auto picks for device buffers, and nccl at two ranks (which
// runs on a machine with two GPUs and fails with a clear error, not a hang, on one).
//
// Every test needs a GPU: without one it prints "SKIPPED: no CUDA GPU (...)" and
// exits 77, which CTest reports as skipped (SKIP_RETURN_CODE, tests/CMakeLists.txt).
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/tensor/device.h"
#include "support/process.h"
#include "support/runs.h"

using course_test::course_binary;
using course_test::launcher_command;
using course_test::mpirun_command;
using course_test::ProcessResult;
using course_test::run_process;

namespace {

const double kTimeoutSeconds = 180;

// The GPUs this machine has; without one the test process ends here with 77. (Only
// counted: the workers use the GPU, this process never makes a context on it.)
int gpus_or_skip() {
  std::string why;
  const int gpus = course::cuda_device_count(&why);
  if (gpus == 0) {
    std::printf("SKIPPED: no CUDA GPU (%s)\n", why.c_str());
    std::fflush(stdout);
    std::exit(77);
  }
  return gpus;
}

// comm_worker --device cuda on `ranks` processes, under mpirun for mpi and the
// course launcher otherwise.
ProcessResult run_gpu_workers(const std::string& backend, int ranks, const std::string& timeout = "60") {
  std::vector<std::string> argv = backend == "mpi" ? mpirun_command(ranks) : launcher_command(ranks);
  argv.insert(argv.end(), {course_binary("comm_worker"), "--backend", backend, "--device", "cuda", "--comm-timeout",
                           timeout});
  return run_process(argv, kTimeoutSeconds);
}

int count_of(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) count++;
  return count;
}

}  // namespace

TEST_CASE("nccl: every collective on device buffers at world size 1", "[cuda][comm]") {
  gpus_or_skip();
  const ProcessResult result = run_gpu_workers("nccl", 1);
  INFO(result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(count_of(result.out, "all checks passed (nccl, 1 ranks)") == 1);
}

TEST_CASE("tcp and mpi staged through the host: every collective on device buffers, 2 ranks on one GPU",
          "[cuda][comm]") {
  gpus_or_skip();
  const std::string backend = GENERATE(as<std::string>{}, "tcp", "mpi");
  INFO(backend << " backend, staged");
  const ProcessResult result = run_gpu_workers(backend, 2);
  INFO(result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(count_of(result.out, "all checks passed (" + backend + "+staged, 2 ranks)") == 2);
}

TEST_CASE("auto with device buffers: nccl when each rank has a GPU, else tcp staged through the host",
          "[cuda][comm]") {
  const int gpus = gpus_or_skip();
  const int ranks = GENERATE(1, 2);
  INFO(ranks << " rank(s) on " << gpus << " GPU(s)");
  const ProcessResult result = run_gpu_workers("auto", ranks);
  INFO(result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  const std::string expected = ranks <= gpus ? "nccl" : "tcp+staged";
  CHECK(count_of(result.out, "all checks passed (" + expected + ", " + std::to_string(ranks) + " ranks)") == ranks);
}

TEST_CASE("nccl at 2 ranks: runs with a GPU per rank, else a clear error instead of a hang", "[cuda][comm]") {
  const int gpus = gpus_or_skip();
  const ProcessResult result = run_gpu_workers("nccl", 2, "20");
  INFO(gpus << " GPU(s); " << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  if (gpus >= 2) {
    CHECK(result.exit_code == 0);
    CHECK(count_of(result.out, "all checks passed (nccl, 2 ranks)") == 2);
  } else {
    // both ranks compute on GPU 0 (gpu_for_rank): NCCL refuses two ranks on one GPU
    // ("Duplicate GPU detected", ncclInvalidUsage), with the hint
    CHECK(result.exit_code != 0);
    CHECK_THAT(result.err, Catch::Contains("rank 1 nccl init"));
    CHECK_THAT(result.err, Catch::Contains("GPU of its own"));
  }
}
