// A stand-in worker for the launcher's tests: it prints the launch contract it was
// given, then misbehaves on request.
//
//   launcher_worker [--target-rank R] [--exit CODE] [--exit-first-attempt CODE]
//                   [--kill-self SIGNAL] [--partial TEXT] [--long-line BYTES] [--ignore-sigterm]
//                   [--connect-store] [--store-request] [--pid-dir DIR] [--sleep SECONDS]
//                   [--others-exit CODE] [--kill-delay SECONDS]
//
// In order, every worker:
//   1. prints "env rank=.. world_size=.. ..." on stdout and "hello from stderr" on stderr;
//   2. with --connect-store, connects to MASTER_ADDR:COURSE_STORE_PORT and prints
//      "store reachable (attempt C)" (exit 1 when it cannot); with --store-request,
//      sends the store a SET as a stranger would (no answer to the job-secret
//      challenge) and prints "store took the request" or "store refused the request";
//   3. if it is the target (--target-rank, default: every rank), ignores SIGTERM
//      when asked (--ignore-sigterm);
//   4. with --pid-dir, writes DIR/rank<R>.pid (its pid) and waits until every
//      local rank has written its own: from then on the whole group is up;
//   5. if it is the target: prints TEXT without a newline (--partial), BYTES 'x's
//      and then one newline (--long-line, written 64 KiB at a time), exits with
//      CODE (--exit; --exit-first-attempt only when TORCHELASTIC_RESTART_COUNT is 0),
//      or kills itself with SIGNAL (--kill-self, after --kill-delay SECONDS); the
//      others exit with CODE at once (--others-exit: peers that find it gone);
//   6. sleeps SECONDS (--sleep, default 0) and exits 0.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

namespace {

struct Options {
  int target_rank = -1;  // -1: every rank
  int exit_code = -1;    // -1: none of these three
  int exit_first_attempt = -1;
  int kill_self = -1;
  std::string partial;
  long long long_line = 0;
  bool ignore_sigterm = false;
  bool connect_store = false;
  bool store_request = false;
  std::string pid_dir;
  double sleep_seconds = 0;
  int others_exit = -1;
  double kill_delay = 0;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "launcher_worker: error: %s\n", message.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; i++) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(flag + " expects a value");
      return argv[++i];
    };
    if (flag == "--target-rank") options.target_rank = std::atoi(value().c_str());
    else if (flag == "--exit") options.exit_code = std::atoi(value().c_str());
    else if (flag == "--exit-first-attempt") options.exit_first_attempt = std::atoi(value().c_str());
    else if (flag == "--kill-self") options.kill_self = std::atoi(value().c_str());
    else if (flag == "--partial") options.partial = value();
    else if (flag == "--long-line") options.long_line = std::atoll(value().c_str());
    else if (flag == "--ignore-sigterm") options.ignore_sigterm = true;
    else if (flag == "--connect-store") options.connect_store = true;
    else if (flag == "--store-request") options.store_request = true;
    else if (flag == "--pid-dir") options.pid_dir = value();
    else if (flag == "--sleep") options.sleep_seconds = std::atof(value().c_str());
    else if (flag == "--others-exit") options.others_exit = std::atoi(value().c_str());
    else if (flag == "--kill-delay") options.kill_delay = std::atof(value().c_str());
    else usage_error("unknown flag '" + flag + "'");
  }
  return options;
}

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "(unset)";
}

int env_int(const char* name) { return std::atoi(env(name).c_str()); }

// A connection to MASTER_ADDR:COURSE_STORE_PORT, the store; exits 1 when there is none.
int open_store_connection() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(env_int("COURSE_STORE_PORT")));
  if (fd < 0 || ::inet_pton(AF_INET, env("MASTER_ADDR").c_str(), &address.sin_addr) != 1 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    std::printf("store unreachable: %s\n", std::strerror(errno));
    std::exit(1);
  }
  return fd;
}

void connect_to_store(int attempt) {
  ::close(open_store_connection());
  std::printf("store reachable (attempt %d)\n", attempt);
  std::fflush(stdout);
}

// SET "stranger" = "was here" in the store's protocol (common/comm/store.h), with no
// answer to a challenge, then no more requests (shutdown). An open store sends 0
// ("no challenge", common/comm/auth.h) and takes it: 0 again; a store that wants
// the job's secret sends 1 and its 32-byte challenge, reads the request (38
// bytes) as a wrong answer and closes the connection. Either way the store closes
// it then: the reply is all it sends.
void stranger_request() {
  const int fd = open_store_connection();
  const std::string key = "stranger-key-long", value = "was here";
  const uint32_t key_length = key.size();
  const uint64_t value_length = value.size();
  std::string request(1, '\x01');
  request.append(reinterpret_cast<const char*>(&key_length), sizeof(key_length)).append(key);
  request.append(reinterpret_cast<const char*>(&value_length), sizeof(value_length)).append(value);
  if (::write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) usage_error("write");
  ::shutdown(fd, SHUT_WR);
  std::string reply;
  char buffer[64];
  for (ssize_t got; (got = ::read(fd, buffer, sizeof(buffer))) > 0;) reply.append(buffer, static_cast<size_t>(got));
  ::close(fd);
  std::printf("store %s the request\n", reply == std::string(2, '\0') ? "took" : "refused");
  std::fflush(stdout);
}

// Written under a temporary name and renamed, so a reader never sees half a pid.
void write_pid_and_wait_for_the_others(const std::string& dir, int rank, int local_world_size) {
  const std::string path = dir + "/rank" + std::to_string(rank) + ".pid";
  std::ofstream(path + ".tmp") << ::getpid() << "\n";
  if (std::rename((path + ".tmp").c_str(), path.c_str()) != 0) usage_error("cannot write " + path);
  const int first_rank = rank - env_int("LOCAL_RANK");
  for (int other = first_rank; other < first_rank + local_world_size; other++) {
    const std::string other_path = dir + "/rank" + std::to_string(other) + ".pid";
    while (::access(other_path.c_str(), F_OK) != 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// `bytes` 'x's and a newline, from one small buffer: the worker's own memory stays
// small, so the launcher's is what a test of the relay measures.
void write_long_line(long long bytes) {
  const std::string chunk(64 * 1024, 'x');
  for (long long left = bytes; left > 0; left -= static_cast<long long>(chunk.size())) {
    std::fwrite(chunk.data(), 1, static_cast<size_t>(std::min<long long>(left, chunk.size())), stdout);
  }
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  const int rank = env_int("RANK");
  const int attempt = env_int("TORCHELASTIC_RESTART_COUNT");
  const bool targeted = options.target_rank < 0 || options.target_rank == rank;

  std::printf("env rank=%s world_size=%s local_rank=%s local_world_size=%s master_addr=%s master_port=%s "
              "restart_count=%s store_port=%s job_secret=%s\n",
              env("RANK").c_str(), env("WORLD_SIZE").c_str(), env("LOCAL_RANK").c_str(),
              env("LOCAL_WORLD_SIZE").c_str(), env("MASTER_ADDR").c_str(), env("MASTER_PORT").c_str(),
              env("TORCHELASTIC_RESTART_COUNT").c_str(), env("COURSE_STORE_PORT").c_str(),
              env("COURSE_JOB_SECRET").c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "hello from stderr\n");

  if (options.connect_store) connect_to_store(attempt);
  if (options.store_request) stranger_request();
  if (targeted && options.ignore_sigterm) ::signal(SIGTERM, SIG_IGN);
  if (!options.pid_dir.empty()) write_pid_and_wait_for_the_others(options.pid_dir, rank, env_int("LOCAL_WORLD_SIZE"));

  if (targeted) {
    if (!options.partial.empty()) {
      std::printf("%s", options.partial.c_str());
      std::fflush(stdout);
    }
    if (options.long_line > 0) write_long_line(options.long_line);
    if (options.exit_code >= 0) return options.exit_code;
    if (options.exit_first_attempt >= 0 && attempt == 0) return options.exit_first_attempt;
    if (options.kill_self > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(options.kill_delay));
      ::raise(options.kill_self);
    }
  } else if (options.others_exit >= 0) {
    return options.others_exit;
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(options.sleep_seconds));
  return 0;
}
