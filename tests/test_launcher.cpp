// The course's launcher, `launch`, run for real on a stand-in worker
// (launcher_worker.cpp) that prints the contract it was given and misbehaves on
// request: exits, crashes, ignores SIGTERM, fails only on the first attempt.
//
// Every run uses --master-port 0 unless the test needs a port of its own, so that
// the test cases can run in parallel (ctest -j) without fighting over one port.
// Workers that must be shown gone afterwards write their pids (--pid-dir); a test
// that leaves one running fails.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/comm/socket.h"
#include "support/process.h"

using course_test::ProcessResult;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 30;

std::string launch_binary() { return course_test::course_binary("launch"); }
std::string worker_binary() { return course_test::course_binary("launcher_worker"); }

// A --secret-file: `text` in a file of mode `mode` (0600 is what the launcher accepts).
std::string secret_file(const TempDir& dir, const std::string& text, mode_t mode = 0600) {
  const std::string path = dir.file("secret");
  course_test::write_file(path, text);
  REQUIRE(::chmod(path.c_str(), mode) == 0);
  return path;
}

struct TimedResult {
  ProcessResult result;
  double seconds = 0;
};

TimedResult timed_run(const std::vector<std::string>& argv) {
  const auto start = std::chrono::steady_clock::now();
  TimedResult timed;
  timed.result = course_test::run_process(argv, kTimeoutSeconds);
  timed.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return timed;
}

// launch --master-port 0 <launch_args> -- launcher_worker <worker_args>
// (a --master-port in launch_args comes later and wins)
std::vector<std::string> launch_command(const std::vector<std::string>& launch_args,
                                        const std::vector<std::string>& worker_args) {
  std::vector<std::string> argv = {launch_binary(), "--master-port", "0"};
  argv.insert(argv.end(), launch_args.begin(), launch_args.end());
  argv.push_back("--");
  argv.push_back(worker_binary());
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  return argv;
}

TimedResult run_launch(const std::vector<std::string>& launch_args, const std::vector<std::string>& worker_args) {
  return timed_run(launch_command(launch_args, worker_args));
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

size_t count(const std::string& text, const std::string& piece) {
  size_t found = 0;
  for (size_t at = text.find(piece); at != std::string::npos; at = text.find(piece, at + 1)) found++;
  return found;
}

// The "key=value" pairs of each rank's "[rank R] env ..." line, by the R of the prefix.
std::map<int, std::map<std::string, std::string>> contracts(const std::string& out) {
  std::map<int, std::map<std::string, std::string>> by_rank;
  for (const std::string& line : lines_of(out)) {
    int rank = -1;
    if (std::sscanf(line.c_str(), "[rank %d] env ", &rank) != 1) continue;
    std::istringstream words(line.substr(line.find("] env ") + 6));
    for (std::string word; words >> word;) {
      const size_t equals = word.find('=');
      by_rank[rank][word.substr(0, equals)] = word.substr(equals + 1);
    }
  }
  return by_rank;
}

// The port in the launcher's "[launch] hosting the store on port P; ..." line, -1 when absent.
int announced_port(const std::string& err) {
  const std::string marker = "[launch] hosting the store on port ";
  const size_t at = err.find(marker);
  return at == std::string::npos ? -1 : std::atoi(err.c_str() + at + marker.size());
}

// A port that was free a moment ago: bound to port 0, read back, released.
int free_port() {
  int port = 0;
  course::listen_on("0.0.0.0", 0, &port);
  return port;
}

pid_t read_pid(const TempDir& dir, int rank) {
  return static_cast<pid_t>(std::stol(course_test::read_file(dir.file("rank" + std::to_string(rank) + ".pid"))));
}

// Running, or stopped: anything but gone or a zombie (exited, waiting for its parent to collect it).
bool process_alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t name_end = text.rfind(')');  // the state follows "(command) "
  return name_end == std::string::npos || text.size() < name_end + 3 || text[name_end + 2] != 'Z';
}

void require_all_gone(const TempDir& dir, const std::vector<int>& ranks) {
  for (int rank : ranks) {
    INFO("rank " << rank);
    CHECK_FALSE(process_alive(read_pid(dir, rank)));
  }
}

#define REQUIRE_RAN(timed)                                                                                  \
  INFO("result: " << (timed).result.describe() << " after " << (timed).seconds << " s\nstdout:\n"         \
                  << (timed).result.out << "stderr:\n"                                                    \
                  << (timed).result.err);                                                                 \
  REQUIRE_FALSE((timed).result.timed_out)

// Checks `launch <args>` is refused as a usage error: exit code 2, and stderr is one
// line "launch: error: ..." containing every string in `expected`.
void expect_usage_error(const std::vector<std::string>& args, const std::vector<std::string>& expected) {
  std::vector<std::string> argv = {launch_binary()};
  argv.insert(argv.end(), args.begin(), args.end());
  const TimedResult timed = timed_run(argv);
  REQUIRE_RAN(timed);
  const ProcessResult& result = timed.result;
  CHECK(result.exit_code == 2);
  CHECK_THAT(result.err, Catch::StartsWith("launch: error: "));
  CHECK(count(result.err, "\n") == 1);
  for (const std::string& text : expected) CHECK_THAT(result.err, Catch::Contains(text));
}

}  // namespace

TEST_CASE("every line of every worker carries its rank, stdout to stdout and stderr to stderr", "[launcher]") {
  const int nproc = GENERATE(2, 4);
  INFO("--nproc-per-node " << nproc);
  const TimedResult timed = run_launch({"--nproc-per-node", std::to_string(nproc)}, {});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 0);

  const std::vector<std::string> out_lines = lines_of(timed.result.out);
  CHECK(static_cast<int>(out_lines.size()) == nproc);
  for (const std::string& line : out_lines) CHECK_THAT(line, Catch::StartsWith("[rank "));
  for (int rank = 0; rank < nproc; rank++) {
    const std::string prefix = "[rank " + std::to_string(rank) + "] ";
    CHECK(count(timed.result.out, prefix + "env rank=" + std::to_string(rank) + " ") == 1);
    CHECK(count(timed.result.err, prefix + "hello from stderr\n") == 1);
  }
  CHECK(count(timed.result.out, "hello from stderr") == 0);
  for (const std::string& line : lines_of(timed.result.err)) {
    const bool tagged = line.rfind("[rank ", 0) == 0 || line.rfind("[launch] ", 0) == 0;
    CHECK(tagged);
  }
}

TEST_CASE("a last line without a newline is still printed, with its prefix, when the worker exits", "[launcher]") {
  const TimedResult timed = run_launch({"--nproc-per-node", "2"}, {"--partial", "no newline at the end"});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 0);
  CHECK(count(timed.result.out, "[rank 0] no newline at the end\n") == 1);
  CHECK(count(timed.result.out, "[rank 1] no newline at the end\n") == 1);
}

TEST_CASE("50 MB without a newline go out in 64 KiB pieces, each with the prefix, in bounded memory",
          "[launcher]") {
  // A launcher that waited for the newline would hold all 50 MB (and rescan them
  // at every read). The worker writes from a 64 KiB buffer, so the largest of this
  // test's child processes, the launcher included, shows what the relay keeps.
  const long long bytes = 50'000'000, piece = 64 * 1024;
  // Under the asan preset, AddressSanitizer keeps freed memory in a quarantine
  // that would count as the launcher's own: none for this run.
  const char* asan_options = std::getenv("ASAN_OPTIONS");
  std::vector<std::string> argv = {"env", std::string("ASAN_OPTIONS=") + (asan_options ? asan_options : "") +
                                              (asan_options ? ":" : "") + "quarantine_size_mb=0"};
  const std::vector<std::string> launch =
      launch_command({"--nproc-per-node", "2"}, {"--target-rank", "0", "--long-line", std::to_string(bytes)});
  argv.insert(argv.end(), launch.begin(), launch.end());
  const TimedResult timed = timed_run(argv);
  // not REQUIRE_RAN: a failure message with 50 MB of stdout in it would bury the rest
  INFO("result: " << timed.result.describe() << " after " << timed.seconds << " s\nstderr:\n" << timed.result.err);
  REQUIRE_FALSE(timed.result.timed_out);
  CHECK(timed.result.exit_code == 0);

  long long xs = 0, pieces = 0, malformed = 0;
  const std::string prefix = "[rank 0] x";
  for (const std::string& line : lines_of(timed.result.out)) {
    if (line.compare(0, prefix.size(), prefix) != 0) continue;
    const size_t length = line.size() - (prefix.size() - 1);
    const bool only_xs = line.find_first_not_of('x', prefix.size() - 1) == std::string::npos;
    if (!only_xs || static_cast<long long>(length) > piece) malformed++;
    xs += static_cast<long long>(length);
    pieces++;
  }
  CHECK(malformed == 0);
  CHECK(xs == bytes);
  CHECK(pieces == (bytes + piece - 1) / piece);

  struct rusage usage {};
  REQUIRE(::getrusage(RUSAGE_CHILDREN, &usage) == 0);
  const double peak_mb = static_cast<double>(usage.ru_maxrss) * 1024 / 1e6;  // ru_maxrss is in KiB
  INFO("largest child's peak resident memory: " << peak_mb << " MB");
  CHECK(peak_mb < 25);
}

TEST_CASE("each worker gets the launch contract: its rank, the world, the store", "[launcher]") {
  const int port = free_port();
  const TimedResult timed = run_launch({"--nproc-per-node", "4", "--master-port", std::to_string(port)}, {});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 0);
  CHECK(announced_port(timed.result.err) == port);

  const auto by_rank = contracts(timed.result.out);
  REQUIRE(by_rank.size() == 4);
  for (int rank = 0; rank < 4; rank++) {
    INFO("rank " << rank);
    REQUIRE(by_rank.count(rank) == 1);
    const auto& vars = by_rank.at(rank);
    CHECK(vars.at("rank") == std::to_string(rank));
    CHECK(vars.at("world_size") == "4");
    CHECK(vars.at("local_rank") == std::to_string(rank));
    CHECK(vars.at("local_world_size") == "4");
    CHECK(vars.at("master_addr") == "127.0.0.1");
    // the store on its own port; MASTER_PORT left to the workers (a PyTorch script's env://)
    CHECK(vars.at("store_port") == std::to_string(port));
    CHECK(vars.at("master_port") != std::to_string(port));
    CHECK(vars.at("master_port") == by_rank.at(0).at("master_port"));
    CHECK(vars.at("restart_count") == "0");
    // the job's secret: 64 hex digits, the same for every rank of the job
    CHECK(vars.at("job_secret").size() == 64);
    CHECK(vars.at("job_secret").find_first_not_of("0123456789abcdef") == std::string::npos);
    CHECK(vars.at("job_secret") == by_rank.at(0).at("job_secret"));
  }
  // and another one for the next job
  const TimedResult next = run_launch({"--nproc-per-node", "1"}, {});
  REQUIRE_RAN(next);
  CHECK(contracts(next.result.out).at(0).at("job_secret") != by_rank.at(0).at("job_secret"));
}

TEST_CASE("on node 1 of 2 the workers are ranks 2 and 3 and use node 0's store, with --secret-file's secret",
          "[launcher]") {
  const int port = free_port();
  TempDir dir;
  const std::string secret = "0123456789abcdef0123456789abcdef";
  const TimedResult timed = run_launch({"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-port",
                                        std::to_string(port), "--secret-file", secret_file(dir, secret + "\n")},
                                       {});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 0);
  CHECK_THAT(timed.result.err, Catch::Contains("using the store at 127.0.0.1:" + std::to_string(port)));

  const auto by_rank = contracts(timed.result.out);
  REQUIRE(by_rank.size() == 2);
  for (int local_rank = 0; local_rank < 2; local_rank++) {
    const int rank = 2 + local_rank;
    INFO("rank " << rank);
    REQUIRE(by_rank.count(rank) == 1);
    CHECK(by_rank.at(rank).at("rank") == std::to_string(rank));
    CHECK(by_rank.at(rank).at("world_size") == "4");
    CHECK(by_rank.at(rank).at("local_rank") == std::to_string(local_rank));
    CHECK(by_rank.at(rank).at("store_port") == std::to_string(port));
    CHECK(by_rank.at(rank).at("master_port") == std::to_string(port + 1));  // across nodes: the next port
    CHECK(by_rank.at(rank).at("job_secret") == secret);  // the file's line, without its newline
  }
}

TEST_CASE("two nodes with no secret given: node 0 makes one and writes it to a file of mode 0600, named but never "
          "printed, which node 1 reads with --secret-file, and both nodes' ranks pass the challenges",
          "[launcher]") {
  // Two launchers on this machine stand for two nodes. collectives_tour's ranks meet
  // through node 0's store and connect to each other: every connection is challenged.
  TempDir dir;
  const int port = free_port();
  const std::string written = dir.file("course_job_secret." + std::to_string(port));  // in node 0's directory
  auto node = [&](int node_rank, const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {"env", "-C", dir.path(), launch_binary(), "--nnodes", "2", "--node-rank",
                                     std::to_string(node_rank), "--master-port", std::to_string(port)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), {"--", course_test::course_binary("collectives_tour"), "--backend", "tcp",
                             "--comm-timeout", "20"});
    return argv;
  };
  TimedResult node0;
  std::thread first_node([&] { node0 = timed_run(node(0, {})); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (::access(written.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // run even without the file (it is refused at once), so that node 0 ends before the checks
  const TimedResult node1 = timed_run(node(1, {"--secret-file", written}));
  first_node.join();
  INFO("node 1: " << node1.result.describe() << "\nstdout:\n" << node1.result.out << "stderr:\n" << node1.result.err);
  REQUIRE_RAN(node0);
  REQUIRE_FALSE(node1.result.timed_out);
  CHECK(node0.result.exit_code == 0);
  CHECK(node1.result.exit_code == 0);
  CHECK(count(node0.result.out, "[rank 0] 8 of 8 collectives correct on all 2 rank(s)") == 1);
  CHECK_THAT(node0.result.err, Catch::Contains("start the other nodes with --secret-file " + written));

  struct stat info {};
  REQUIRE(::stat(written.c_str(), &info) == 0);
  CHECK((info.st_mode & 0777) == 0600);
  const std::string line = course_test::read_file(written);
  REQUIRE(line.size() == 65);  // 64 hex digits and a newline
  const std::string secret = line.substr(0, 64);
  CHECK(secret.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(line.back() == '\n');
  const TimedResult* nodes[] = {&node0, &node1};
  for (const TimedResult* timed : nodes) {
    CHECK(timed->result.out.find(secret) == std::string::npos);
    CHECK(timed->result.err.find(secret) == std::string::npos);
  }
}

TEST_CASE("a secret file is refused when others can read or own it, missing, empty, short or repetitive, and node 1 "
          "needs a secret",
          "[launcher]") {
  const std::string worker = worker_binary();
  TempDir dir;
  const std::string good = "0123456789abcdef0123456789abcdef\n";
  SECTION("readable by group and others") {
    const std::string path = secret_file(dir, good, 0644);
    expect_usage_error({"--secret-file", path, "--", worker},
                       {"--secret-file '" + path + "' has mode 0644", "hint: chmod 600 " + path});
  }
  SECTION("readable by its group") {
    const std::string path = secret_file(dir, good, 0640);
    expect_usage_error({"--secret-file", path, "--", worker}, {"has mode 0640"});
  }
  SECTION("missing") {
    expect_usage_error({"--secret-file", dir.file("none"), "--", worker},
                       {"--secret-file '" + dir.file("none") + "': No such file or directory"});
  }
  SECTION("empty") {
    const std::string path = secret_file(dir, "\n");
    expect_usage_error({"--secret-file", path, "--", worker}, {"--secret-file '" + path + "' is empty"});
  }
  SECTION("shorter than 16 bytes") {
    const std::string path = secret_file(dir, "0123456789abcde\n");
    expect_usage_error({"--secret-file", path, "--", worker},
                       {"'" + path + "' holds 15 bytes: a job's secret needs at least 16"});
  }
  SECTION("not a regular file") {
    expect_usage_error({"--secret-file", "/dev/null", "--", worker}, {"'/dev/null' is not a regular file"});
  }
  SECTION("long enough, but sixteen spaces or one letter repeated") {
    const std::vector<std::string> weak_secrets = {std::string(16, ' ') + "\n", std::string(40, 'a') + "\n",
                                                   "abababababababab\n"};
    for (const std::string& weak : weak_secrets) {
      const std::string path = secret_file(dir, weak);
      expect_usage_error({"--secret-file", path, "--", worker}, {"different ones: a job's secret needs at least 8"});
    }
  }
  SECTION("of mode 0600, but another user's") {
    // a file swapped into a shared directory by someone else: its secret is theirs
    const std::string path = secret_file(dir, good);
    if (::geteuid() != 0) {
      WARN("not root: cannot give a file to another user; this section needs root (CI runs as root)");
      return;
    }
    REQUIRE(::chown(path.c_str(), 65534, 65534) == 0);
    expect_usage_error({"--secret-file", path, "--", worker}, {"belongs to uid 65534, not to this user"});
  }
  SECTION("node 1 with no secret: only node 0 makes one") {
    expect_usage_error({"--nnodes", "2", "--node-rank", "1", "--master-port", "29500", "--", worker},
                       {"node 1 has no job secret", "--secret-file"});
  }
}

TEST_CASE("with --master-port 0 the store gets a free port and every worker is told which", "[launcher]") {
  const TimedResult timed = run_launch({"--nproc-per-node", "2", "--master-port", "0"}, {"--connect-store"});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 0);
  const int port = announced_port(timed.result.err);
  CHECK(port > 0);
  const auto by_rank = contracts(timed.result.out);
  REQUIRE(by_rank.size() == 2);
  for (const auto& [rank, vars] : by_rank) CHECK(vars.at("store_port") == std::to_string(port));
  CHECK(count(timed.result.out, "store reachable (attempt 0)") == 2);
}

TEST_CASE("the launcher's store refuses a request that does not prove the job's secret", "[launcher]") {
  // The worker has the secret in its environment, but talks to the store as a
  // stranger would, answering no challenge: the store must not take its SET.
  const TimedResult timed = run_launch({"--nproc-per-node", "1"}, {"--store-request"});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 0);
  CHECK(count(timed.result.out, "[rank 0] store refused the request\n") == 1);
}

TEST_CASE("a rank that fails stops the others, and its exit code becomes the launcher's", "[launcher]") {
  // The others would sleep a minute: finishing in seconds shows they were stopped.
  TempDir dir;
  const TimedResult timed = run_launch({"--nproc-per-node", "3", "--grace-seconds", "5"},
                                       {"--target-rank", "1", "--exit", "3", "--sleep", "60", "--pid-dir", dir.path()});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 3);
  CHECK(timed.seconds < 5);
  CHECK(count(timed.result.err, "[launch] rank 1 exited with code 3; stopping ranks 0, 2 (a group cannot go on "
                                "without one of its ranks)\n") == 1);
  CHECK(count(timed.result.err, "restarting") == 0);
  require_all_gone(dir, {0, 1, 2});
}

TEST_CASE("a rank killed by a signal makes the launcher exit with 128 + the signal, naming the ranks it stops",
          "[launcher]") {
  TempDir dir;
  const TimedResult timed = run_launch({"--nproc-per-node", "6"}, {"--target-rank", "1", "--kill-self", "9", "--sleep",
                                                                   "60", "--pid-dir", dir.path()});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 128 + 9);
  CHECK(timed.seconds < 5);
  // a run of three or more ranks is written as a range
  CHECK_THAT(timed.result.err, Catch::Contains("[launch] rank 1 was killed by signal 9 (Killed); stopping ranks 0, 2-5 ("));
  require_all_gone(dir, {0, 1, 2, 3, 4, 5});
}

TEST_CASE("the launcher's own flags get a suggestion too, a prefix included", "[launcher]") {
  const TimedResult timed = timed_run({course_test::course_binary("launch"), "--nproc", "2", "--", worker_binary()});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 2);
  CHECK_THAT(timed.result.err, Catch::Contains("unknown flag '--nproc' (did you mean --nproc-per-node?)"));
}

TEST_CASE("one node's launcher takes any free port by default: a job holding 29500 is no obstacle", "[launcher]") {
  // another job's store (here: a socket) holds the old default port
  const int holder = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(holder >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(29500);
  const int one = 1;
  ::setsockopt(holder, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool holding = ::bind(holder, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                       ::listen(holder, 1) == 0;
  const TimedResult timed = timed_run({course_test::course_binary("launch"), "--nproc-per-node", "2", "--", worker_binary(),
                                       "--connect-store"});
  ::close(holder);
  REQUIRE_RAN(timed);
  INFO("29500 held by this test: " << holding << "\nstderr:\n" << timed.result.err);
  CHECK(timed.result.exit_code == 0);
  CHECK_THAT(timed.result.err, Catch::Contains("[launch] hosting the store on port "));
  CHECK_THAT(timed.result.err, !Catch::Contains("port 29500;"));
  CHECK(count(timed.result.out, "store reachable") == 2);
}

TEST_CASE("the launcher refuses a short COURSE_JOB_SECRET before it starts anything", "[launcher]") {
  std::vector<std::string> argv = {"env", "COURSE_JOB_SECRET=abc"};
  const std::vector<std::string> launch = launch_command({"--nproc-per-node", "2"}, {});
  argv.insert(argv.end(), launch.begin(), launch.end());
  const TimedResult timed = timed_run(argv);
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 2);
  CHECK_THAT(timed.result.err, Catch::Contains("COURSE_JOB_SECRET is 3 bytes: a job's secret needs at least 16"));
  CHECK(timed.result.out.find("env rank=") == std::string::npos);  // no worker started
}

TEST_CASE("a rank killed by a signal is named as the cause even when a peer's error exit is seen first",
          "[launcher]") {
  // rank 0 exits with an error at once, as a peer does when it finds a rank gone; rank 1
  // is killed 50 ms later: the launcher sees rank 0's exit first, but the kill is the cause
  TempDir dir;
  const TimedResult timed =
      run_launch({"--nproc-per-node", "2"}, {"--target-rank", "1", "--kill-self", "9", "--kill-delay", "0.05",
                                             "--others-exit", "1", "--pid-dir", dir.path()});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 128 + 9);
  CHECK_THAT(timed.result.err, Catch::Contains("[launch] rank 1 was killed by signal 9 (Killed)\n"));
  CHECK_THAT(timed.result.err, Catch::Contains("[launch] rank 0 exited with code 1 too\n"));
}

TEST_CASE("a failed group is restarted while --max-restarts allows, with the attempt number", "[launcher]") {
  SECTION("fails on the first attempt, succeeds after one restart: exit 0") {
    const TimedResult timed =
        run_launch({"--nproc-per-node", "2", "--max-restarts", "1"},
                   {"--target-rank", "1", "--exit-first-attempt", "5", "--connect-store"});
    REQUIRE_RAN(timed);
    CHECK(timed.result.exit_code == 0);
    CHECK(count(timed.result.err, "[launch] rank 1 exited with code 5") == 1);
    CHECK(count(timed.result.err, "[launch] restarting the group (attempt 2 of 2)\n") == 1);
    const auto by_rank = contracts(timed.result.out);  // the last line of each rank wins: attempt 1's
    for (int rank = 0; rank < 2; rank++) {
      INFO("rank " << rank);
      REQUIRE(by_rank.count(rank) == 1);
      CHECK(by_rank.at(rank).at("restart_count") == "1");
      // the store that node 0 hosted for attempt 0 is still there for attempt 1
      CHECK(count(timed.result.out, "[rank " + std::to_string(rank) + "] store reachable (attempt 1)\n") == 1);
    }
  }
  SECTION("--max-restarts 0 gives up at once") {
    const TimedResult timed =
        run_launch({"--nproc-per-node", "2", "--max-restarts", "0"}, {"--target-rank", "1", "--exit-first-attempt", "5"});
    REQUIRE_RAN(timed);
    CHECK(timed.result.exit_code == 5);
    CHECK(count(timed.result.err, "restarting") == 0);
    CHECK(count(timed.result.out, "restart_count=1") == 0);
  }
  SECTION("a rank that always fails uses up the restarts, then its code is the launcher's") {
    const TimedResult timed =
        run_launch({"--nproc-per-node", "2", "--max-restarts", "2"}, {"--target-rank", "0", "--exit", "4"});
    REQUIRE_RAN(timed);
    CHECK(timed.result.exit_code == 4);
    // rank 1 may have finished already or be stopped: the line may go on with "; stopping rank 1"
    CHECK(count(timed.result.err, "[launch] rank 0 exited with code 4") == 3);
    CHECK(count(timed.result.err, "[launch] restarting the group (attempt 2 of 3)\n") == 1);
    CHECK(count(timed.result.err, "[launch] restarting the group (attempt 3 of 3)\n") == 1);
    CHECK(count(timed.result.err, "[launch] no restarts left (--max-restarts 2)\n") == 1);
  }
}

TEST_CASE("SIGTERM or SIGINT to the launcher stops every worker, within the grace period", "[launcher]") {
  // A shell starts the launcher, waits until all workers are up (their pid files),
  // signals the launcher alone, and exits with the launcher's status. Rank 1
  // ignores SIGTERM, so under SIGTERM it lasts until the SIGKILL after the grace.
  const std::string signal = GENERATE(std::string("TERM"), std::string("INT"));
  INFO("SIG" << signal);
  TempDir dir;
  const std::string script =
      "signal=$1; dir=$2; shift 2\n"
      "\"$@\" &\n"
      "launcher=$!\n"
      "until [ -e \"$dir/rank0.pid\" ] && [ -e \"$dir/rank1.pid\" ]; do sleep 0.02; done\n"
      "kill -s \"$signal\" \"$launcher\"\n"
      "wait \"$launcher\"\n";
  std::vector<std::string> argv = {"sh", "-c", script, "sh", signal, dir.path()};
  const std::vector<std::string> launch =
      launch_command({"--nproc-per-node", "2", "--grace-seconds", "1"},
                     {"--target-rank", "1", "--ignore-sigterm", "--sleep", "60", "--pid-dir", dir.path()});
  argv.insert(argv.end(), launch.begin(), launch.end());

  const TimedResult timed = timed_run(argv);
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == (signal == "TERM" ? 128 + SIGTERM : 128 + SIGINT));
  CHECK_THAT(timed.result.err, Catch::Contains("[launch] got SIG" + signal + ": stopping the workers"));
  if (signal == "TERM") CHECK(timed.seconds >= 1.0);  // it did wait the grace period for rank 1
  CHECK(timed.seconds < 4);
  require_all_gone(dir, {0, 1});
}

TEST_CASE("a launcher killed by SIGKILL takes its workers with it", "[launcher]") {
  // SIGKILL leaves the launcher no chance to stop anyone: the workers must go by
  // themselves (PR_SET_PDEATHSIG). The shell kills the launcher alone, not the
  // process group, once every worker is up; rank 1 ignores SIGTERM, so only a
  // SIGKILL ends it; all would otherwise sleep a minute.
  TempDir dir;
  const std::string script =
      "dir=$1; shift\n"
      "\"$@\" &\n"
      "launcher=$!\n"
      "until [ -e \"$dir/rank0.pid\" ] && [ -e \"$dir/rank1.pid\" ]; do sleep 0.02; done\n"
      "kill -s KILL \"$launcher\"\n"
      "wait \"$launcher\"\n";
  std::vector<std::string> argv = {"sh", "-c", script, "sh", dir.path()};
  const std::vector<std::string> launch = launch_command(
      {"--nproc-per-node", "2"}, {"--target-rank", "1", "--ignore-sigterm", "--sleep", "60", "--pid-dir", dir.path()});
  argv.insert(argv.end(), launch.begin(), launch.end());

  const TimedResult timed = timed_run(argv);
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 128 + SIGKILL);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  const auto any_alive = [&] { return process_alive(read_pid(dir, 0)) || process_alive(read_pid(dir, 1)); };
  while (any_alive() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  require_all_gone(dir, {0, 1});
}

TEST_CASE("asking for --help lists every flag and exits 0", "[launcher]") {
  const TimedResult timed = timed_run({launch_binary(), "--help"});
  REQUIRE_RAN(timed);
  CHECK(timed.result.exit_code == 0);
  CHECK(timed.result.err.empty());
  CHECK_THAT(timed.result.out, Catch::StartsWith("usage: launch"));
  CHECK_THAT(timed.result.out, Catch::Contains("-- program [args...]"));
  for (const char* flag : {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                           "--max-restarts", "--grace-seconds", "--secret-file"}) {
    CHECK_THAT(timed.result.out, Catch::Contains(std::string("  ") + flag + " "));
  }
}

TEST_CASE("bad usage is refused with exit code 2 and one line saying what is wrong", "[launcher]") {
  const std::string worker = worker_binary();
  SECTION("no --") { expect_usage_error({"--nproc-per-node", "2"}, {"no `--` before the program"}); }
  SECTION("nothing after --") { expect_usage_error({"--nproc-per-node", "2", "--"}, {"no program after `--`"}); }
  SECTION("not a number") {
    expect_usage_error({"--nproc-per-node", "two", "--", worker}, {"--nproc-per-node expects a whole number", "'two'"});
  }
  SECTION("no workers") {
    expect_usage_error({"--nproc-per-node", "0", "--", worker}, {"--nproc-per-node must be at least 1, got 0"});
  }
  SECTION("a node rank outside the nodes") {
    expect_usage_error({"--nnodes", "2", "--node-rank", "2", "--", worker}, {"--node-rank 2 is not below --nnodes 2"});
  }
  SECTION("an unknown flag") {
    expect_usage_error({"--nprocs", "2", "--", worker}, {"unknown flag '--nprocs'", "--help"});
  }
  SECTION("a port that does not exist") {
    expect_usage_error({"--master-port", "70000", "--", worker}, {"--master-port must be at most 65535"});
  }
  SECTION("--master-port 0 on a node other than 0") {
    expect_usage_error({"--nnodes", "2", "--node-rank", "1", "--master-port", "0", "--", worker},
                       {"--master-port 0", "only on node 0"});
  }
  SECTION("a program not in PATH") {
    expect_usage_error({"--", "no_such_program_for_launch"}, {"program 'no_such_program_for_launch' not found"});
  }
  SECTION("a program path that does not exist") {
    expect_usage_error({"--", "/no/such/worker"}, {"cannot run '/no/such/worker'"});
  }
  SECTION("a port that is taken") {
    int port = 0;
    const course::Socket taken = course::listen_on("0.0.0.0", 0, &port);
    expect_usage_error({"--master-port", std::to_string(port), "--", worker}, {"already in use", std::to_string(port)});
  }
}
