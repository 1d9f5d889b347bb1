// Chapter 01: `launch`, the course's torchrun.
//
//   launch --nproc-per-node 4 -- ./build/bin/collectives_tour --backend tcp
//
// A launcher turns one command into a group of cooperating processes. It
//   1. hosts the rendezvous store (on node 0), where the workers find each other:
//      at MASTER_ADDR:COURSE_STORE_PORT, leaving MASTER_PORT to the workers, so
//      that a PyTorch script's env:// rendezvous works under it too;
//   2. starts --nproc-per-node workers, telling each who it is through the
//      environment: the launch contract that common/comm/env.h reads;
//   3. forwards their output, each line tagged "[rank R] " (an error line
//      another rank already said word for word is said once);
//   4. watches them: when one fails it stops the others (a collective cannot
//      finish without every rank, so they would only hang) and, while
//      --max-restarts allows, starts the whole group again; with --restart-policy
//      worker it restarts the failed worker alone and leaves the others running,
//      for a program whose workers make their groups as they go (chapter 10);
//   5. passes Ctrl-C and SIGTERM on to the workers and stops them.
//
// Several machines: run one launcher per node with the same --nnodes,
// --master-addr and --master-port, and --node-rank 0 .. nnodes-1. Each launcher
// restarts only its own group, but a rank that dies makes its peers' collectives
// fail too, so every node sees a failure and restarts with the next attempt number.
// Every node needs the job's secret too: see job_secret.
//
// Process group: the workers stay in the launcher's process group. Ctrl-C in a
// terminal signals the whole foreground group, so they get SIGINT from the
// terminal itself (and once more from us: harmless, a stop request either way),
// and whatever kills the group (a job scheduler, the test harness's timeout)
// takes the workers down too. A group of their own would hide them from both.
//
// Workers die with their launcher: a launcher that is SIGKILLed alone (`kill -9
// <pid>`, the OOM killer) cannot stop anyone, so each worker asks the kernel for
// SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG, in become_worker). Without
// that they would run on as orphans, holding their ranks' ports and memory, and a
// rerun would meet them in its rendezvous.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/train/cli.h"
#include "common/comm/auth.h"
#include "common/comm/env.h"
#include "common/comm/socket.h"
#include "common/comm/store.h"
#include "common/tensor/error.h"

extern char** environ;

using namespace course;

namespace {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = -1;  // not given: any free one on one node, 29500 across nodes
  int max_restarts = 0;
  std::string restart_policy = "group";  // --restart-policy group|worker
  int grace_seconds = 5;
  std::string secret_file;  // --secret-file: where to read the job's secret ("": not given)
  std::string secret;       // the job's secret (common/comm/auth.h), never empty
  bool secret_made_here = false;  // node 0 made it: several nodes need it written for the others
  std::vector<std::string> command;  // the program and its arguments: everything after "--"
};

const std::string kUsage = "launch [flags] -- program [args...]";

[[noreturn]] void fail_system_call(const std::string& what, const std::string& hint) {
  throw CourseError(what + " failed: " + std::strerror(errno) + " (hint: " + hint + ")");
}

// ----------------------------------------------------------------------------
// the job's secret
//
// The store and the ranks ask every connection to prove it holds the job's secret
// (common/comm/auth.h), so every launcher of a job must hand its workers the same
// one. It comes from one of (both of the first two: refused, as a likely mix-up):
//   --secret-file PATH  a file only its owner can read, the same on every node
//                       (a shared directory, or a copy): what a script that starts
//                       every node at once uses;
//   COURSE_JOB_SECRET   exported alike on every node;
//   neither             node 0 makes a new one. One node keeps it in memory; several
//                       write it to a file of mode 0600 and print that file's path,
//                       never the secret: a launcher's output often ends in a log
//                       that others can read (a batch system's, a shared terminal
//                       session's), and whoever reads the secret can join the job.

// The most a secret file may hold: one line, such as `openssl rand -hex 32` writes.
const size_t kMaxSecretFileBytes = 1024;

// What --secret-file holds, less one final newline. Refuses a file that another user
// owns, one that anyone but its owner can read, one that is not a regular file, and
// one that is not one line of a strong enough secret (job_secret_weakness): each a
// UsageError naming the file.
std::string read_secret_file(const std::string& path) {
  const std::string hint = " (hint: `(umask 077; openssl rand -hex 32 > " + path + ")` makes a good one)";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO must not block us
  if (fd < 0) throw UsageError("--secret-file '" + path + "': " + std::strerror(errno) + hint);
  struct stat info;
  const bool stated = ::fstat(fd, &info) == 0;
  std::string secret(kMaxSecretFileBytes + 1, '\0');  // one byte more, to find a longer file
  const ssize_t count = stated && S_ISREG(info.st_mode) ? ::read(fd, secret.data(), secret.size()) : 0;
  const int read_errno = errno;
  ::close(fd);
  if (!stated || count < 0) {
    throw UsageError("--secret-file '" + path + "': cannot read it: " + std::strerror(read_errno) + hint);
  }
  if (!S_ISREG(info.st_mode)) {
    throw UsageError("--secret-file '" + path + "' is not a regular file (hint: give the file that holds the secret)");
  }
  // another user's file, even of mode 0600, is that user's secret: whoever swapped it
  // into a shared directory would be let into the job
  if (info.st_uid != ::geteuid()) {
    throw UsageError("--secret-file '" + path + "' belongs to uid " + std::to_string(info.st_uid) +
                     ", not to this user (uid " + std::to_string(::geteuid()) + "): someone else's file cannot " +
                     "hold this job's secret (hint: make your own, in a directory only you can write to: `(umask 077; " +
                     "openssl rand -hex 32 > FILE)`)");
  }
  if ((info.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(info.st_mode & 07777));
    throw UsageError("--secret-file '" + path + "' has mode " + mode + ": anyone but its owner can read the job's " +
                     "secret (hint: chmod 600 " + path + ")");
  }
  secret.resize(static_cast<size_t>(count));
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (!secret.empty() && secret.back() == '\r') secret.pop_back();
  if (secret.empty()) throw UsageError("--secret-file '" + path + "' is empty" + hint);
  if (secret.size() > kMaxSecretFileBytes || secret.find_first_of(std::string("\n\0", 2)) != std::string::npos) {
    throw UsageError("--secret-file '" + path + "' is not one line of at most " + std::to_string(kMaxSecretFileBytes) +
                     " bytes" + hint);
  }
  const std::string weakness = job_secret_weakness(secret);
  if (!weakness.empty()) throw UsageError("--secret-file '" + path + "' holds " + weakness + hint);
  return secret;
}

std::string job_secret(const LaunchOptions& options) {
  const char* exported = std::getenv("COURSE_JOB_SECRET");
  if (!options.secret_file.empty() && exported != nullptr) {
    throw UsageError("the job's secret is given twice, by --secret-file and by COURSE_JOB_SECRET (hint: unset "
                     "COURSE_JOB_SECRET, or leave out --secret-file)");
  }
  if (!options.secret_file.empty()) return read_secret_file(options.secret_file);
  if (exported != nullptr) {
    check_job_secret(exported);
    return exported;
  }
  if (options.node_rank != 0) {
    throw UsageError("node " + std::to_string(options.node_rank) + " has no job secret, and only node 0 makes " +
                     "one (hint: --secret-file with the file node 0's launcher wrote, or a copy of it; or export " +
                     "the same COURSE_JOB_SECRET on every node)");
  }
  return make_job_secret();
}

// Several nodes, a secret made here: written to ./course_job_secret.<port>, mode
// 0600, for the other nodes' --secret-file. mkstemp creates the file with mode 0600
// whatever the umask, and the rename replaces an older job's file in one step, so
// nobody ever reads half a secret or a file others could read.
std::string write_secret_for_other_nodes(const std::string& secret, int port) {
  const std::string path = std::filesystem::absolute("course_job_secret." + std::to_string(port)).string();
  const std::string hint = "run launch in a directory you can write to, or give every node --secret-file";
  std::string temp_path = path + ".XXXXXX";
  const int fd = ::mkstemp(temp_path.data());
  if (fd < 0) fail_system_call("creating '" + temp_path + "' for the job's secret", hint);
  const std::string line = secret + "\n";
  const bool written = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  if (::close(fd) != 0 || !written || ::rename(temp_path.c_str(), path.c_str()) != 0) {
    const int failure = errno;
    ::unlink(temp_path.c_str());
    errno = failure;
    fail_system_call("writing the job's secret to '" + path + "'", hint);
  }
  return path;
}

// ----------------------------------------------------------------------------
// flags

LaunchOptions parse_options(int argc, char** argv) {
  LaunchOptions options;
  ArgParser parser("launch", "Runs the program after `--` as a group of workers, the course's torchrun:\n  " + kUsage);
  parser.add_int("--nproc-per-node", &options.nproc_per_node, 1, "workers to start on this node");
  parser.add_int("--nnodes", &options.nnodes, 1, "nodes in the job, one launcher on each");
  parser.add_int("--node-rank", &options.node_rank, 0, "this node, 0 .. nnodes-1 (node 0 hosts the store)");
  parser.add_string("--master-addr", &options.master_addr,
                    "the address of node 0, where workers find the store (one node: always 127.0.0.1)");
  parser.add_int("--master-port", &options.master_port, 0,
                 "the store's port (0: any free one, node 0 only; by default any free one on a single node, as "
                 "torchrun --standalone, and 29500 across nodes); the workers' MASTER_PORT is the next one "
                 "across nodes, any free one on a single node");
  parser.add_int("--max-restarts", &options.max_restarts, 0, "times to restart the group after a worker fails");
  parser.add_choice("--restart-policy", &options.restart_policy, {"group", "worker"},
                    "group: a failed worker stops the others and the group restarts; worker: only the failed "
                    "worker restarts, and the others go on (for a program that survives a lost peer itself)");
  parser.add_int("--grace-seconds", &options.grace_seconds, 0, "seconds from SIGTERM to SIGKILL when stopping workers");
  parser.add_string("--secret-file", &options.secret_file,
                    "read the job's secret from this file, which only its owner may read (mode 0600): the same "
                    "file on every node (none: node 0 makes one)");

  // Everything after "--" belongs to the program, its flags included.
  int separator = 1;
  while (separator < argc && std::strcmp(argv[separator], "--") != 0) separator++;
  const bool asks_for_help = std::any_of(argv + 1, argv + separator, [](const char* arg) {
    return std::strcmp(arg, "--help") == 0 || std::strcmp(arg, "-h") == 0;
  });
  if (separator == argc && !asks_for_help) {
    throw UsageError("no `--` before the program to run (usage: " + kUsage + ")");
  }
  parser.parse(separator, argv);  // --help prints the usage and exits 0
  if (separator + 1 >= argc) throw UsageError("no program after `--` (usage: " + kUsage + ")");
  options.command.assign(argv + separator + 1, argv + argc);

  if (options.node_rank >= options.nnodes) {
    throw UsageError("--node-rank " + std::to_string(options.node_rank) + " is not below --nnodes " +
                     std::to_string(options.nnodes) + " (hint: nodes are numbered 0 .. nnodes-1)");
  }
  // one node hands its port to its own workers: any free one, so that two jobs on one
  // machine never meet at 29500; several nodes must agree on one beforehand
  if (options.master_port < 0) options.master_port = options.nnodes == 1 ? 0 : 29500;
  if (options.master_port > 65535) {
    throw UsageError("--master-port must be at most 65535, got " + std::to_string(options.master_port));
  }
  if (options.master_port == 0 && options.node_rank != 0) {
    throw UsageError("--master-port 0 (any free port) works only on node 0 (hint: give this node the port that "
                     "node 0's launcher printed)");
  }
  options.secret = job_secret(options);
  options.secret_made_here = options.secret_file.empty() && std::getenv("COURSE_JOB_SECRET") == nullptr;
  return options;
}

// Finds the program the way execvp would, but before any worker starts, so that a
// typo is one usage error instead of a group of workers that all fail.
std::string find_program(const std::string& name) {
  auto runnable = [](const std::string& path) {
    struct stat info;
    return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) && ::access(path.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    if (runnable(name)) return name;
    throw UsageError("cannot run '" + name + "': no such executable file (hint: check the path; is it built?)");
  }
  const char* path = std::getenv("PATH");
  const std::string directories = path != nullptr ? path : "/bin:/usr/bin";  // execvp's default
  size_t start = 0;
  for (;;) {
    const size_t colon = directories.find(':', start);
    std::string directory = directories.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    if (directory.empty()) directory = ".";  // an empty PATH entry means the current directory
    if (runnable(directory + "/" + name)) return directory + "/" + name;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  throw UsageError("program '" + name + "' not found in PATH (hint: give its path, as in ./" + name + ")");
}

// ----------------------------------------------------------------------------
// signals
//
// A signal handler may only make async-signal-safe calls, so ours does two things:
// it records a stop request (SIGINT, SIGTERM) in atomics, and writes one byte to a
// pipe that the main loop polls (the "self-pipe trick"), so a signal wakes the
// poll instead of racing it. SIGCHLD (a worker exited) only wakes it.

std::atomic<int> g_stop_signal{0};    // the last SIGINT or SIGTERM received, 0 for none
std::atomic<int> g_stop_requests{0};  // how many: another one while stopping skips the grace period
int g_wake_write_fd = -1;
const int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

void on_signal(int signal) {
  const int saved_errno = errno;  // the interrupted code may be about to read errno
  if (signal != SIGCHLD) {
    g_stop_signal = signal;
    g_stop_requests++;
  }
  const char byte = 0;
  const ssize_t ignored = ::write(g_wake_write_fd, &byte, 1);  // a full pipe already holds a wake-up
  (void)ignored;
  errno = saved_errno;
}

// Installs the handlers; returns the read end of the wake-up pipe.
int install_signal_handlers() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) fail_system_call("pipe2 (signal wake-up)", "raise `ulimit -n`");
  g_wake_write_fd = fds[1];
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;  // SA_NOCLDSTOP: a stopped worker is not an exited one
  for (int signal : kHandledSignals) {
    if (::sigaction(signal, &action, nullptr) != 0) fail_system_call("sigaction", "this is a bug in launch");
  }
  // `launch ... | head` closes our stdout early: the write must fail with EPIPE (and
  // the launcher stop its workers), not kill the launcher and orphan them
  if (::signal(SIGPIPE, SIG_IGN) == SIG_ERR) fail_system_call("signal(SIGPIPE)", "this is a bug in launch");
  return fds[0];
}

void drain_wake_pipe(int wake_fd) {
  char bytes[64];
  while (::read(wake_fd, bytes, sizeof(bytes)) > 0) {
  }
}

const char* signal_name(int signal) { return signal == SIGINT ? "SIGINT" : "SIGTERM"; }

// ----------------------------------------------------------------------------
// output

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t count = ::write(fd, text.data() + done, text.size() - done);
    if (count < 0) {
      if (errno == EINTR) continue;
      fail_system_call(fd == STDOUT_FILENO ? "write to stdout" : "write to stderr", "is the terminal or pipe still open?");
    }
    done += static_cast<size_t>(count);
  }
}

// The launcher's own messages: one line on stderr, tagged so they stand out from the workers'.
void say(const std::string& message) { write_all(STDERR_FILENO, "[launch] " + message + "\n"); }

// One of a worker's two output streams, as it reaches us through a pipe.
struct OutputStream {
  int fd = -1;            // our (non-blocking) read end; -1 once closed
  int destination = -1;   // STDOUT_FILENO or STDERR_FILENO
  int rank = 0;
  std::string prefix;     // "[rank R] "
  std::string partial;    // bytes after the last newline: the start of a line still being written
  size_t scanned = 0;     // how much of `partial` is known to hold no newline
  // stderr's: the error lines the group's workers have said so far (Group::errors_said)
  std::map<std::string, int>* errors_said = nullptr;
};

// The longest piece of a line held back waiting for its newline. A worker may
// print megabytes without one (a progress bar drawn with '\r', binary data by
// mistake): past this, the line goes out in pieces of this size, each with the
// prefix and a newline, so the launcher's memory stays bounded and each byte is
// looked at once, not once per read.
const size_t kMaxLinePiece = 64 * 1024;

// Whether `line` is an error that another worker has already said, word for word. Every
// rank that finds the same mistake (a --data file that is missing) says it, and the
// reader needs it once: the launcher's own summary still names every rank that failed.
// A worker restarted alone that fails the same way again says it again.
bool repeats_an_error(OutputStream& stream, const std::string& line) {
  if (stream.errors_said == nullptr || line.find(": error: ") == std::string::npos) return false;
  const auto [said, first] = stream.errors_said->emplace(line, stream.rank);
  return !first && said->second != stream.rank;
}

// Writes every complete line of stream.partial, each with the prefix, in one write
// so that another rank's line cannot land in the middle of it. `whole`: also the
// unfinished last line (its worker has exited, the rest will never come), ended
// with a newline so that the next prefix starts a line of its own.
void emit_lines(OutputStream& stream, bool whole) {
  std::string text;
  size_t start = 0;
  for (size_t newline; (newline = stream.partial.find('\n', std::max(start, stream.scanned))) != std::string::npos;
       start = newline + 1) {
    const std::string line = stream.partial.substr(start, newline + 1 - start);
    if (!repeats_an_error(stream, line)) text += stream.prefix + line;
  }
  for (; stream.partial.size() - start >= kMaxLinePiece; start += kMaxLinePiece) {
    text += stream.prefix + stream.partial.substr(start, kMaxLinePiece) + "\n";
  }
  stream.partial.erase(0, start);
  if (whole && !stream.partial.empty()) {
    text += stream.prefix + stream.partial + "\n";
    stream.partial.clear();
  }
  stream.scanned = stream.partial.size();
  if (!text.empty()) write_all(stream.destination, text);
}

void close_stream(OutputStream& stream) {
  emit_lines(stream, /*whole=*/true);
  ::close(stream.fd);
  stream.fd = -1;
}

// Reads what the pipe holds now (one read when `until_empty` is false, else until
// it is empty) and forwards the complete lines. End-of-file closes the stream.
void forward_output(OutputStream& stream, bool until_empty) {
  char buffer[65536];
  do {
    const ssize_t count = ::read(stream.fd, buffer, sizeof(buffer));
    if (count < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return;  // nothing more for now
      fail_system_call("read from a worker's output pipe", "this is a bug in launch");
    }
    if (count == 0) {
      close_stream(stream);
      return;
    }
    stream.partial.append(buffer, static_cast<size_t>(count));
    emit_lines(stream, /*whole=*/false);
  } while (until_empty);
}

// ----------------------------------------------------------------------------
// workers

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;  // the waitpid status, once it has exited
  OutputStream out, err;
};

bool succeeded(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

// What a worker's end says to the shell: its exit code, or 128 + the signal that killed it.
int exit_code_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
}

// "rank 3", "ranks 0, 2, 3", "ranks 1-15": `ranks` ascending, a run of three or
// more written as a range, so that stopping 16 ranks is one short line.
std::string name_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size();) {
    size_t end = i + 1;  // one past the run of consecutive ranks that starts at i
    while (end < ranks.size() && ranks[end] == ranks[end - 1] + 1) end++;
    text += (text.empty() ? "" : ", ") + std::to_string(ranks[i]);
    if (end - i >= 3) {
      text += "-" + std::to_string(ranks[end - 1]);
    } else if (end - i == 2) {
      text += ", " + std::to_string(ranks[i + 1]);
    }
    i = end;
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + text;
}

// The workers of one attempt. Whatever way the launcher leaves (an error included),
// the destructor makes sure no worker outlives it.
struct Group {
  std::vector<Worker> workers;
  int first_failure = -1;  // index of the first worker that failed, -1 while none has
  std::map<std::string, int> errors_said;  // the "error: " lines of the workers' stderr, by the rank that said it first

  explicit Group(int size) : workers(static_cast<size_t>(size)) {}
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  ~Group() {
    for (Worker& worker : workers) {
      // errors are ignored: this runs while unwinding from another error, and must not throw
      if (worker.running) {
        ::kill(worker.pid, SIGKILL);
        ::waitpid(worker.pid, nullptr, 0);
      }
      for (OutputStream* stream : {&worker.out, &worker.err}) {
        if (stream->fd >= 0) ::close(stream->fd);
      }
    }
  }

  int running_count() const {
    return static_cast<int>(std::count_if(workers.begin(), workers.end(), [](const Worker& w) { return w.running; }));
  }

  std::vector<int> running_ranks() const {
    std::vector<int> ranks;
    for (const Worker& worker : workers) {
      if (worker.running) ranks.push_back(worker.rank);
    }
    return ranks;
  }

  void signal_running(int signal) {
    for (Worker& worker : workers) {
      // an exited worker not yet reaped still takes a signal, so this cannot miss
      if (worker.running && ::kill(worker.pid, signal) != 0) fail_system_call("kill", "this is a bug in launch");
    }
  }
};

// Where the course's store listens, and the port left to the workers as MASTER_PORT.
struct Ports {
  int store;
  int workers;
};

// The environment a worker starts with: the launcher's own, with the launch contract set for this worker.
std::vector<std::string> worker_environment(const LaunchOptions& options, int local_rank, const Ports& ports,
                                            int attempt) {
  const std::vector<std::pair<std::string, std::string>> contract = {
      {"RANK", std::to_string(options.node_rank * options.nproc_per_node + local_rank)},
      {"WORLD_SIZE", std::to_string(options.nnodes * options.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      // one machine: the store listens on loopback only (host_store)
      {"MASTER_ADDR", options.nnodes == 1 ? "127.0.0.1" : options.master_addr},
      // MASTER_PORT is the workers' own: rank 0 of a PyTorch script opens its store
      // there (init_process_group's env://). The course's store is on a port of its own.
      {"MASTER_PORT", std::to_string(ports.workers)},
      {"COURSE_STORE_PORT", std::to_string(ports.store)},
      // The store outlives an attempt, so the keys a failed group wrote are still
      // there when the next one meets. The backends scope their rendezvous keys by
      // the attempt number, so a restarted rank never reads a dead rank's address.
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(attempt)},
      {"COURSE_JOB_SECRET", options.secret},
  };
  std::vector<std::string> environment;
  for (char** entry = environ; *entry != nullptr; entry++) {
    const std::string text = *entry;
    const std::string name = text.substr(0, text.find('='));
    const bool replaced = std::any_of(contract.begin(), contract.end(), [&](const auto& var) { return var.first == name; });
    if (!replaced) environment.push_back(text);
  }
  for (const auto& [name, value] : contract) environment.push_back(name + "=" + value);
  return environment;
}

// A null-terminated array of pointers into `strings`, as execve wants.
std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (std::string& text : strings) pointers.push_back(text.data());
  pointers.push_back(nullptr);
  return pointers;
}

// A pipe for one output stream: the worker writes, we read. Both ends are
// close-on-exec so no other worker inherits them (dup2 gives this worker its own
// copy of the write end). Only our end is non-blocking: we must never wait on one
// worker while others have output, but the worker's writes should block as usual.
void open_output_pipe(OutputStream& stream, int destination, int rank, int* write_end) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) fail_system_call("pipe2 (worker output)", "raise `ulimit -n`");
  stream.fd = fds[0];
  *write_end = fds[1];
  stream.destination = destination;
  stream.rank = rank;
  stream.prefix = "[rank " + std::to_string(rank) + "] ";
  if (::fcntl(fds[0], F_SETFL, O_NONBLOCK) != 0) fail_system_call("fcntl(O_NONBLOCK)", "this is a bug in launch");
}

// Between fork and exec the child may only make async-signal-safe calls: the
// launcher has threads (the store's), and one of them may hold a lock (malloc's)
// that would never be released in the child. So the message is fixed text.
[[noreturn]] void child_fail(const char* call) {
  const char* parts[] = {"launch: error: ", call, " failed while starting the worker\n"};
  for (const char* part : parts) {
    const ssize_t ignored = ::write(STDERR_FILENO, part, std::strlen(part));
    (void)ignored;  // nothing more can be done about a failed write here
  }
  ::_exit(127);  // the shell's "could not run the command"
}

[[noreturn]] void become_worker(const std::string& program, char** argv, char** envp, int out_fd, int err_fd,
                                const sigset_t& mask, pid_t launcher) {
  // SIGKILL, not SIGTERM: a worker may ignore SIGTERM, and with its launcher gone
  // nobody is left to follow up. The setting survives exec. The kernel watches the
  // thread that forked, our main thread, which lives as long as the launcher. If
  // the launcher died before prctl ran, the child was already handed to another
  // parent and no signal will come: getppid() tells.
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) child_fail("prctl(PR_SET_PDEATHSIG)");
  if (::getppid() != launcher) ::_exit(128 + SIGKILL);
  // Our handlers would write to the launcher's wake-up pipe. A signal that arrives
  // now must do to the worker what it would do to the program, so the handlers go
  // back to the defaults before the signals are unblocked (the mask survives exec).
  for (int signal : kHandledSignals) {
    if (::signal(signal, SIG_DFL) == SIG_ERR) child_fail("signal");
  }
  if (::signal(SIGPIPE, SIG_DFL) == SIG_ERR) child_fail("signal");  // an ignored signal stays ignored across exec
  if (::sigprocmask(SIG_SETMASK, &mask, nullptr) != 0) child_fail("sigprocmask");
  if (::dup2(out_fd, STDOUT_FILENO) < 0) child_fail("dup2(stdout)");
  if (::dup2(err_fd, STDERR_FILENO) < 0) child_fail("dup2(stderr)");
  // Only stdin, stdout and stderr pass to the program (torchrun does the same): the
  // store's sockets must not live on in a worker. A kernel older than 5.9 has no
  // close_range; the worker then merely inherits a few sockets it never uses.
  if (::close_range(3, ~0U, 0) != 0 && errno != ENOSYS) child_fail("close_range");
  ::execve(program.c_str(), argv, envp);
  child_fail("execve");
}

void start_worker(Worker& worker, const std::string& program, std::vector<std::string> arguments,
                  std::vector<std::string> environment) {
  // everything the child needs is built before fork (see child_fail)
  std::vector<char*> argv = c_strings(arguments);
  std::vector<char*> envp = c_strings(environment);
  int out_write = -1, err_write = -1;
  open_output_pipe(worker.out, STDOUT_FILENO, worker.rank, &out_write);
  open_output_pipe(worker.err, STDERR_FILENO, worker.rank, &err_write);

  // Blocked until the child has reset its handlers (see become_worker).
  sigset_t handled, previous;
  sigemptyset(&handled);
  for (int signal : kHandledSignals) sigaddset(&handled, signal);
  if (::pthread_sigmask(SIG_BLOCK, &handled, &previous) != 0) fail_system_call("pthread_sigmask", "this is a bug in launch");
  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) become_worker(program, argv.data(), envp.data(), out_write, err_write, previous, launcher);
  const int fork_errno = errno;
  ::close(out_write);  // the worker holds its own copies; ours would keep the pipes from ever ending
  ::close(err_write);
  if (::pthread_sigmask(SIG_SETMASK, &previous, nullptr) != 0) fail_system_call("pthread_sigmask", "this is a bug in launch");
  if (pid < 0) {
    errno = fork_errno;
    fail_system_call("fork", "too many processes? check `ulimit -u` and --nproc-per-node");
  }
  worker.pid = pid;
  worker.running = true;
}

void start_group(Group& group, const LaunchOptions& options, const std::string& program, const Ports& ports,
                 int attempt) {
  for (int local_rank = 0; local_rank < options.nproc_per_node; local_rank++) {
    Worker& worker = group.workers[static_cast<size_t>(local_rank)];
    worker.rank = options.node_rank * options.nproc_per_node + local_rank;
    worker.err.errors_said = &group.errors_said;
    start_worker(worker, program, options.command, worker_environment(options, local_rank, ports, attempt));
  }
}

// Collects the workers that have exited. What a worker wrote before it exited is
// already in its pipes, so it is forwarded now, before anyone reports the exit.
void reap(Group& group) {
  for (size_t i = 0; i < group.workers.size(); i++) {
    Worker& worker = group.workers[i];
    if (!worker.running) continue;
    const pid_t done = ::waitpid(worker.pid, &worker.status, WNOHANG);
    if (done < 0) fail_system_call("waitpid", "this is a bug in launch");
    if (done == 0) continue;  // still running
    worker.running = false;
    for (OutputStream* stream : {&worker.out, &worker.err}) {
      if (stream->fd >= 0) forward_output(*stream, /*until_empty=*/true);
      if (stream->fd >= 0) close_stream(*stream);
    }
    if (!succeeded(worker.status) && group.first_failure < 0) group.first_failure = static_cast<int>(i);
  }
}

// Waits up to timeout_ms (-1: as long as it takes) for output, a worker's exit or
// a signal; forwards the output and collects the exits.
void pump(Group& group, int wake_fd, int timeout_ms) {
  std::vector<pollfd> fds = {{wake_fd, POLLIN, 0}};
  std::vector<OutputStream*> streams;
  for (Worker& worker : group.workers) {
    for (OutputStream* stream : {&worker.out, &worker.err}) {
      if (stream->fd < 0) continue;
      fds.push_back({stream->fd, POLLIN, 0});
      streams.push_back(stream);
    }
  }
  if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
    fail_system_call("poll", "this is a bug in launch");
  }
  if (fds[0].revents != 0) drain_wake_pipe(wake_fd);
  for (size_t i = 0; i < streams.size(); i++) {
    if (fds[i + 1].revents != 0) forward_output(*streams[i], /*until_empty=*/false);
  }
  reap(group);
}

// After the first failure: collects, for up to `milliseconds`, the workers already on
// their way out. A rank that dies takes its peers down a moment later (they find it
// gone and exit with an error), and the launcher may see their exits first; waiting
// this long lets the report name the rank that started it.
void settle(Group& group, int wake_fd, int milliseconds) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(milliseconds);
  while (group.running_count() > 0 && g_stop_signal == 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    pump(group, wake_fd, static_cast<int>(left));
  }
}

// The failed workers, the likeliest cause first: one killed by a signal (its peers
// exit with an error after it), then by rank.
std::vector<const Worker*> failures_by_cause(const Group& group) {
  std::vector<const Worker*> failed;
  for (const Worker& worker : group.workers) {
    if (!worker.running && !succeeded(worker.status)) failed.push_back(&worker);
  }
  std::stable_sort(failed.begin(), failed.end(), [](const Worker* a, const Worker* b) {
    return WIFSIGNALED(a->status) && !WIFSIGNALED(b->status);
  });
  return failed;
}

enum class Ending { kAllSucceeded, kWorkerFailed, kStopRequested };

Ending supervise(Group& group, int wake_fd) {
  for (;;) {
    if (g_stop_signal != 0) return Ending::kStopRequested;
    if (group.first_failure >= 0) return Ending::kWorkerFailed;
    if (group.running_count() == 0) return Ending::kAllSucceeded;
    pump(group, wake_fd, -1);
  }
}

// Stops the workers still running: `signal` to each, up to --grace-seconds for them
// to finish (saving a checkpoint, printing why), forwarding what they print on the
// way out, then SIGKILL for any still there. Another SIGINT or SIGTERM meanwhile
// means "now": it skips the rest of the grace period.
void stop_workers(Group& group, int wake_fd, int signal, int grace_seconds) {
  using Clock = std::chrono::steady_clock;
  const int requests = g_stop_requests;
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(grace_seconds);
  group.signal_running(signal);
  while (group.running_count() > 0 && g_stop_requests == requests) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    pump(group, wake_fd, static_cast<int>(std::min<long long>(left, INT_MAX)));  // poll takes an int
  }
  group.signal_running(SIGKILL);
  while (group.running_count() > 0) pump(group, wake_fd, -1);
}

// ----------------------------------------------------------------------------
// the launcher

// Node 0 hosts the store for the whole job: on the loopback interface when the job
// is this machine alone, so that nothing outside it can even connect; else on
// every interface, for the other nodes. It lives as long as the launcher, across
// restarts.
std::unique_ptr<StoreServer> host_store(const LaunchOptions& options) {
  if (options.node_rank != 0) return nullptr;
  try {
    return std::make_unique<StoreServer>(options.nnodes == 1 ? "127.0.0.1" : "0.0.0.0", options.master_port,
                                         options.secret);
  } catch (const CommError& error) {
    // a port we cannot have (taken by another job, or reserved) is the reader's to change
    throw UsageError(error.what());
  }
}

// The workers' MASTER_PORT: across nodes the one after the store's, which every node
// can work out; on one node any free one (free now: a program that does not open it
// soon may find it taken, as under torchrun before its agent's store).
int workers_port(const LaunchOptions& options, int store_port) {
  if (options.nnodes > 1) return store_port + 1;
  int port = 0;
  listen_on("127.0.0.1", 0, &port);
  return port;
}

int launch(int argc, char** argv) {
  const LaunchOptions options = parse_options(argc, argv);
  const std::string program = find_program(options.command[0]);
  const int wake_fd = install_signal_handlers();
  const std::unique_ptr<StoreServer> store = host_store(options);
  const int port = store ? store->port() : options.master_port;
  const Ports ports{port, workers_port(options, port)};

  // one line that says where the store is: the other nodes need the port when it was picked here (0)
  const int first_rank = options.node_rank * options.nproc_per_node;
  const int last_rank = first_rank + options.nproc_per_node - 1;
  say((store ? "hosting the store on port " + std::to_string(port)
             : "using the store at " + options.master_addr + ":" + std::to_string(port)) +
      "; starting " + (first_rank == last_rank ? "rank " : "ranks " + std::to_string(first_rank) + "-") +
      std::to_string(last_rank) + " of " + std::to_string(options.nnodes * options.nproc_per_node));
  if (options.nnodes > 1 && options.secret_made_here) {
    const std::string path = write_secret_for_other_nodes(options.secret, port);
    say("the job's secret is in " + path + " (mode 0600; not printed, logs are often readable by others): start " +
        "the other nodes with --secret-file " + path + " (a copy of it where they do not share this directory)");
  }

  for (int attempt = 0;; attempt++) {
    Group group(options.nproc_per_node);
    start_group(group, options, program, ports, attempt);
    Ending ending = supervise(group, wake_fd);
    // --restart-policy worker: the failed worker alone, again, with the next restart count;
    // with no restarts left the others go on without it, and the launcher's exit says so
    int lost_exit_code = 0;
    while (ending == Ending::kWorkerFailed && options.restart_policy == "worker") {
      Worker& failed = group.workers[static_cast<size_t>(group.first_failure)];
      group.first_failure = -1;
      if (attempt == options.max_restarts) {
        say("rank " + std::to_string(failed.rank) + " " + describe(failed.status) + "; no restarts left (" +
            "--max-restarts " + std::to_string(options.max_restarts) + "): the others go on without it");
        lost_exit_code = exit_code_of(failed.status);
      } else {
        attempt++;
        say("rank " + std::to_string(failed.rank) + " " + describe(failed.status) + "; restarting rank " +
            std::to_string(failed.rank) + " alone (restart " + std::to_string(attempt) + " of " +
            std::to_string(options.max_restarts) + "; --restart-policy worker: the others go on)");
        start_worker(failed, program, options.command,
                     worker_environment(options, failed.rank - options.node_rank * options.nproc_per_node, ports,
                                        attempt));
      }
      ending = supervise(group, wake_fd);
    }
    if (ending == Ending::kAllSucceeded) return lost_exit_code;

    if (ending == Ending::kStopRequested) {
      const int signal = g_stop_signal;
      say(std::string("got ") + signal_name(signal) + ": stopping the workers");
      stop_workers(group, wake_fd, signal, options.grace_seconds);
      return 128 + signal;
    }

    settle(group, wake_fd, /*milliseconds=*/500);
    const std::vector<const Worker*> failed = failures_by_cause(group);
    const int exit_code = exit_code_of(failed[0]->status);
    const std::vector<int> still_running = group.running_ranks();
    say("rank " + std::to_string(failed[0]->rank) + " " + describe(failed[0]->status) +
        (still_running.empty() ? ""
                               : "; stopping " + name_ranks(still_running) +
                                     " (a group cannot go on without one of its ranks)"));
    // the others, one line per way they ended: "ranks 0, 1, 3 exited with code 1 too"
    std::map<std::string, std::vector<int>> ranks_by_ending;
    for (size_t i = 1; i < failed.size(); i++) ranks_by_ending[describe(failed[i]->status)].push_back(failed[i]->rank);
    for (auto& [ending, ranks] : ranks_by_ending) {
      std::sort(ranks.begin(), ranks.end());
      say(name_ranks(ranks) + " " + ending + " too");
    }
    stop_workers(group, wake_fd, SIGTERM, options.grace_seconds);
    if (const int signal = g_stop_signal; signal != 0) return 128 + signal;  // Ctrl-C while we were stopping them
    if (attempt == options.max_restarts) {
      if (options.max_restarts > 0) say("no restarts left (--max-restarts " + std::to_string(options.max_restarts) + ")");
      return exit_code;
    }
    say("restarting the group (attempt " + std::to_string(attempt + 2) + " of " +
        std::to_string(options.max_restarts + 1) + ")");
  }
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("launch", [&] { return launch(argc, argv); });
}
