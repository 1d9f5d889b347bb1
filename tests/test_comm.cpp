// The communication library with real processes: every collective at world sizes
// 1 to 4, on the tcp backend (started by the course launcher) and the mpi backend
// (started by mpirun), through the same worker and the same checks; and a peer
// that dies mid-run, which the others must report instead of hanging.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "support/process.h"
#include "support/runs.h"

using course_test::course_binary;
using course_test::ProcessResult;
using course_test::run_process;
using course_test::launcher_command;
using course_test::mpirun_command;

namespace {

const double kTimeoutSeconds = 180;

// Runs comm_worker on `ranks` processes with the backend's own launcher. For tcp,
// `transport` forces how same-machine peers talk (COURSE_TCP_TRANSPORT: shm or socket).
ProcessResult run_workers(const std::string& backend, int ranks, const std::vector<std::string>& extra = {},
                          const std::string& transport = "") {
  std::vector<std::string> argv = {"env", "COURSE_TCP_TRANSPORT=" + (transport.empty() ? "auto" : transport)};
  std::vector<std::string> launcher = backend == "mpi" ? mpirun_command(ranks) : launcher_command(ranks);
  argv.insert(argv.end(), launcher.begin(), launcher.end());
  argv.insert(argv.end(), {course_binary("comm_worker"), "--backend", backend, "--comm-timeout", "60"});
  argv.insert(argv.end(), extra.begin(), extra.end());
  return run_process(argv, kTimeoutSeconds);
}

// Rank 0's lines of a run, without the launcher's "[rank 0] " prefix.
std::string rank0_lines(const std::string& output) {
  std::string lines;
  size_t start = 0;
  while (start < output.size()) {
    size_t end = output.find('\n', start);
    std::string line = output.substr(start, end == std::string::npos ? std::string::npos : end - start);
    const std::string prefix = "[rank 0] ";
    if (line.rfind("[rank ", 0) != 0) {
      lines += line + "\n";
    } else if (line.rfind(prefix, 0) == 0) {
      lines += line.substr(prefix.size()) + "\n";
    }
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return lines;
}

int count_of(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) count++;
  return count;
}

// A port nobody listens on right now (the kernel picks it; we release it at once).
int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

}  // namespace

TEST_CASE("every collective gives the hand-computed answer at world sizes 1 to 4", "[comm]") {
  // tcp twice: over shared memory between same-machine peers (the default) and over sockets only
  const std::string variant = GENERATE(as<std::string>{}, "tcp/shm", "tcp/socket", "mpi");
  const std::string backend = variant.substr(0, variant.find('/'));
  const std::string transport = variant.find('/') == std::string::npos ? "" : variant.substr(variant.find('/') + 1);
  const int ranks = GENERATE(1, 2, 3, 4);
  INFO(variant << " backend, " << ranks << " rank(s)");
  const ProcessResult result = run_workers(backend, ranks, {}, transport);
  INFO(result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(count_of(result.out, "all checks passed (" + backend) == ranks);
}

TEST_CASE("when a peer dies, the others report it and exit instead of hanging (tcp)", "[comm]") {
  // started without the launcher, which would stop the survivors itself: here
  // they must notice on their own, through the closed connection or the timeout
  const int ranks = 3, port = free_port();
  std::vector<ProcessResult> results(ranks);
  std::vector<std::thread> processes;
  for (int rank = 0; rank < ranks; rank++) {
    processes.emplace_back([&, rank] {
      results[rank] = run_process({"env", "RANK=" + std::to_string(rank), "WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1",
                                   "MASTER_PORT=" + std::to_string(port), course_binary("comm_worker"), "--backend",
                                   "tcp", "--comm-timeout", "10", "--die-rank", "1"},
                                  60);
    });
  }
  for (std::thread& process : processes) process.join();
  std::string said;  // the survivors' error lines: the first to see the death reports it
  for (int rank = 0; rank < ranks; rank++) {
    INFO("rank " << rank << ": " << results[rank].describe() << "\nstderr:\n" << results[rank].err);
    REQUIRE_FALSE(results[rank].timed_out);
    if (rank == 1) {
      CHECK(results[rank].signal == SIGKILL);
    } else {
      CHECK(results[rank].exit_code == 1);
      said += results[rank].err;
    }
  }
  CHECK_THAT(said, Catch::Contains("comm_worker: error: rank "));
  CHECK_THAT(said, Catch::Contains("all_reduce"));
}

TEST_CASE("when a peer dies, one survivor names it, not the neighbour that stopped because of it, and the others "
          "exit quietly (tcp)",
          "[comm]") {
  // 4 ranks in a ring: rank 0 is not a neighbour of rank 2, and learns of its death
  // only when rank 1 or 3 stops
  const std::string transport = GENERATE("socket", "shm");
  INFO("COURSE_TCP_TRANSPORT=" << transport);
  const int ranks = 4, port = free_port();
  std::vector<ProcessResult> results(ranks);
  std::vector<std::thread> processes;
  for (int rank = 0; rank < ranks; rank++) {
    processes.emplace_back([&, rank] {
      results[rank] = run_process({"env", "COURSE_TCP_TRANSPORT=" + transport, "RANK=" + std::to_string(rank),
                                   "WORLD_SIZE=4", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port),
                                   course_binary("comm_worker"), "--backend", "tcp", "--comm-timeout", "20",
                                   "--die-rank", "2"},
                                  60);
    });
  }
  for (std::thread& process : processes) process.join();
  std::string said;  // every survivor's error lines
  for (int rank : {0, 1, 3}) {
    INFO("rank " << rank << ": " << results[rank].describe() << "\nstderr:\n" << results[rank].err);
    REQUIRE_FALSE(results[rank].timed_out);
    CHECK(results[rank].exit_code == 1);
    CHECK_THAT(results[rank].err, !Catch::Contains("never waited on"));
    said += results[rank].err;
  }
  INFO("what the survivors said:\n" << said);
  CHECK(count_of(said, "error:") == 1);
  CHECK_THAT(said, Catch::Contains("rank 2 closed the connection (hint: rank 2 probably crashed; see its output)"));
}

TEST_CASE("when a peer dies under mpirun, the job ends with an error instead of hanging (mpi)", "[comm]") {
  const ProcessResult result = run_workers("mpi", 3, {"--die-rank", "1"});
  INFO(result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code != 0);
}

TEST_CASE("the collectives tour prints the same checked results under the launcher and under mpirun", "[comm]") {
  std::vector<std::string> launched = launcher_command(4), with_mpirun = mpirun_command(4);
  launched.push_back(course_binary("collectives_tour"));
  with_mpirun.push_back(course_binary("collectives_tour"));
  const ProcessResult tcp = run_process(launched, kTimeoutSeconds);
  const ProcessResult mpi = run_process(with_mpirun, kTimeoutSeconds);
  INFO("launch: " << tcp.describe() << "\n" << tcp.out << tcp.err << "\nmpirun: " << mpi.describe() << "\n"
                  << mpi.out << mpi.err);
  REQUIRE_FALSE(tcp.timed_out);
  REQUIRE_FALSE(mpi.timed_out);
  REQUIRE(tcp.exit_code == 0);
  REQUIRE(mpi.exit_code == 0);
  const std::string tcp_lines = rank0_lines(tcp.out), mpi_lines = rank0_lines(mpi.out);
  CHECK_THAT(tcp_lines, Catch::Contains("collectives tour: 4 rank(s), backend tcp"));
  CHECK_THAT(mpi_lines, Catch::Contains("collectives tour: 4 rank(s), backend mpi"));
  CHECK_THAT(tcp_lines, Catch::Contains("8 of 8 collectives correct on all 4 rank(s)"));
  // everything after the header line (which names the backend) is identical
  CHECK(tcp_lines.substr(tcp_lines.find('\n')) == mpi_lines.substr(mpi_lines.find('\n')));
}
