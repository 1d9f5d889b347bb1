// Test support: run a program and capture what it says, and scratch directories.
//
//   ProcessResult result = run_process({course_binary("00_single_gpu"), "--steps", "5"}, 120);
//   REQUIRE_FALSE(result.timed_out);
//   CHECK(result.exit_code == 0);
//
// run_process starts the program with fork/execvp, reads its stdout and stderr
// through two pipes (with poll, so neither pipe can fill up and block the child
// while we wait on the other) and waits for it to end. A program that runs past
// its timeout is killed with SIGKILL and reported as timed out, so a hanging
// trainer fails its test instead of hanging the test suite.
//
// The child runs in a process group of its own and the timeout kills the whole
// group: a launcher that starts workers (mpirun, a multi-process chapter) takes
// its workers down with it.
//
// Every system call is checked; a failure of the harness itself (no pipes left,
// fork refused) throws std::system_error, which Catch2 reports as a test failure.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace course_test {

struct ProcessResult {
  int exit_code = -1;      // the exit status when the program exited, else -1
  int signal = 0;          // the signal that ended it, 0 when it exited
  bool timed_out = false;  // it ran past the timeout and was killed
  std::string out;         // everything it wrote to stdout
  std::string err;         // everything it wrote to stderr

  // "exit code 2", "killed by signal 11", "timed out": for failure messages.
  std::string describe() const {
    if (timed_out) return "timed out (killed)";
    if (signal != 0) return "killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
    return "exit code " + std::to_string(exit_code);
  }
};

namespace detail {

[[noreturn]] inline void fail_system_call(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), "run_process: " + what);
}

// Closes a file descriptor when it goes out of scope.
class Fd {
 public:
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  // Closes the descriptor held so far and takes ownership of `fd`.
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Both ends are close-on-exec, so they never leak into a program we start: the
// child's dup2 onto stdout/stderr makes the copies it keeps.
struct Pipe {
  Fd read_end, write_end;
  Pipe() {
    int fds[2];
    if (::pipe(fds) != 0) fail_system_call("pipe");
    read_end.reset(fds[0]);
    write_end.reset(fds[1]);
    if (::fcntl(fds[0], F_SETFD, FD_CLOEXEC) != 0 || ::fcntl(fds[1], F_SETFD, FD_CLOEXEC) != 0) {
      fail_system_call("fcntl(FD_CLOEXEC)");
    }
  }
};

// Only async-signal-safe calls between fork and exec: the child writes a fixed
// message with write(2) and leaves with _exit, never through C++ cleanup.
[[noreturn]] inline void child_fail(const char* what, const char* program) {
  const char* parts[] = {"run_process: ", what, " failed for '", program, "'\n"};
  for (const char* part : parts) {
    ssize_t ignored = ::write(STDERR_FILENO, part, std::strlen(part));
    (void)ignored;  // nothing more can be done about a failed write here
  }
  ::_exit(127);  // the shell's "command not found" status
}

// Starts argv[0] (looked up in PATH when it has no '/') in a process group of its
// own, stdin from /dev/null, stdout and stderr onto the given descriptors.
inline pid_t start_child(const std::vector<std::string>& argv, int out_fd, int err_fd) {
  if (argv.empty()) throw std::invalid_argument("run_process: argv is empty");
  // everything the child needs is prepared before fork
  std::vector<char*> c_argv;
  for (const std::string& arg : argv) c_argv.push_back(const_cast<char*>(arg.c_str()));
  c_argv.push_back(nullptr);
  Fd dev_null;
  dev_null.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (dev_null.get() < 0) fail_system_call("open /dev/null");

  const pid_t pid = ::fork();
  if (pid < 0) fail_system_call("fork");
  if (pid == 0) {
    const char* program = c_argv[0];
    if (::setpgid(0, 0) != 0) child_fail("setpgid", program);
    if (::dup2(dev_null.get(), STDIN_FILENO) < 0) child_fail("dup2(stdin)", program);
    if (::dup2(out_fd, STDOUT_FILENO) < 0) child_fail("dup2(stdout)", program);
    if (::dup2(err_fd, STDERR_FILENO) < 0) child_fail("dup2(stderr)", program);
    ::execvp(program, c_argv.data());
    child_fail("execvp", program);
  }
  // Also set the group from the parent: whichever of the two runs first, the group
  // exists before we might need to kill it. EACCES means the child already exec'd,
  // after having set it itself.
  if (::setpgid(pid, pid) != 0 && errno != EACCES) fail_system_call("setpgid");
  return pid;
}

}  // namespace detail

// Runs argv[0] (looked up in PATH when it has no '/') with arguments argv[1..],
// stdin from /dev/null, and returns its exit status and output. Kills it (and its
// process group) after timeout_seconds.
inline ProcessResult run_process(const std::vector<std::string>& argv, double timeout_seconds) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds));
  detail::Pipe out_pipe, err_pipe;
  const pid_t pid = detail::start_child(argv, out_pipe.write_end.get(), err_pipe.write_end.get());

  // the child holds its own copies of the write ends; ours must close or no EOF comes
  out_pipe.write_end.reset();
  err_pipe.write_end.reset();

  ProcessResult result;
  auto remaining_ms = [&] {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return left > 0 ? static_cast<int>(left) : 0;
  };
  auto kill_group = [&] {
    if (::kill(-pid, SIGKILL) != 0 && errno != ESRCH) detail::fail_system_call("kill");
    result.timed_out = true;
  };

  // ---- read both pipes until both reach end-of-file, or the deadline passes ----
  struct Stream {
    detail::Fd& fd;
    std::string& text;
  };
  Stream streams[2] = {{out_pipe.read_end, result.out}, {err_pipe.read_end, result.err}};
  while (streams[0].fd.get() >= 0 || streams[1].fd.get() >= 0) {
    pollfd fds[2];
    for (int i = 0; i < 2; i++) fds[i] = {streams[i].fd.get(), POLLIN, 0};  // fd -1 is ignored by poll
    const int ready = ::poll(fds, 2, remaining_ms());
    if (ready < 0) {
      if (errno == EINTR) continue;
      detail::fail_system_call("poll");
    }
    if (ready == 0) {
      kill_group();
      break;
    }
    for (int i = 0; i < 2; i++) {
      if (fds[i].revents == 0) continue;
      char buffer[4096];
      const ssize_t count = ::read(fds[i].fd, buffer, sizeof(buffer));
      if (count < 0) {
        if (errno == EINTR) continue;
        detail::fail_system_call("read");
      }
      if (count == 0) {
        streams[i].fd.reset();  // end-of-file: the program closed this stream
      } else {
        streams[i].text.append(buffer, static_cast<size_t>(count));
      }
    }
  }

  // ---- wait for the exit status (a program may close its output and keep running) ----
  int status = 0;
  for (;;) {
    const pid_t waited = ::waitpid(pid, &status, result.timed_out ? 0 : WNOHANG);
    if (waited == pid) break;
    if (waited < 0) {
      if (errno == EINTR) continue;
      detail::fail_system_call("waitpid");
    }
    if (remaining_ms() == 0) {
      kill_group();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.signal = WTERMSIG(status);
  }
  return result;
}

// What read_until_line saw of a program's output.
struct LineWait {
  bool found = false;         // a whole line containing the text arrived
  bool running_then = false;  // and the program had not exited yet when it did
  std::string output;         // stdout and stderr as they arrived, up to that line
};

// Starts argv with stdout and stderr in one pipe (what `program | tee` gives it),
// reads until a whole line containing `text` arrives, the output ends or the
// timeout passes, then kills the program's process group. It shows whether output
// arrives while a program runs, rather than all at once when it exits.
inline LineWait read_until_line(const std::vector<std::string>& argv, const std::string& text,
                                double timeout_seconds) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds));
  detail::Pipe pipe;
  const pid_t pid = detail::start_child(argv, pipe.write_end.get(), pipe.write_end.get());
  pipe.write_end.reset();  // or no EOF comes when the program ends

  LineWait wait;
  size_t line_start = 0;  // the first byte of output not yet part of a checked line
  while (!wait.found) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd fd = {pipe.read_end.get(), POLLIN, 0};
    const int ready = ::poll(&fd, 1, left > 0 ? static_cast<int>(left) : 0);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) detail::fail_system_call("poll");
    if (ready == 0) break;  // timed out
    char buffer[4096];
    const ssize_t count = ::read(pipe.read_end.get(), buffer, sizeof(buffer));
    if (count < 0 && errno == EINTR) continue;
    if (count < 0) detail::fail_system_call("read");
    if (count == 0) break;  // the program closed its output
    wait.output.append(buffer, static_cast<size_t>(count));
    for (size_t newline; !wait.found && (newline = wait.output.find('\n', line_start)) != std::string::npos;
         line_start = newline + 1) {
      wait.found = wait.output.substr(line_start, newline - line_start).find(text) != std::string::npos;
    }
  }
  int status = 0;
  const pid_t exited = ::waitpid(pid, &status, WNOHANG);
  wait.running_then = wait.found && exited == 0;
  if (::kill(-pid, SIGKILL) != 0 && errno != ESRCH) detail::fail_system_call("kill");
  if (exited == 0 && ::waitpid(pid, &status, 0) < 0) detail::fail_system_call("waitpid");
  return wait;
}

// The path of a program built with the course (a trainer, a tool), next to the tests.
// The course's programs: in the build's bin/, or in $COURSE_BIN_DIR when it is set (the
// GPU kit, scripts/make_gpu_kit.sh, runs its tests on a machine where the build's path
// does not exist).
inline std::string course_binary(const std::string& name) {
  const char* moved = std::getenv("COURSE_BIN_DIR");
  return std::string(moved != nullptr && moved[0] != '\0' ? moved : COURSE_BIN_DIR) + "/" + name;
}

// ----------------------------------------------------------------------------
// scratch files

// A fresh, empty directory (mkdtemp under $TMPDIR or /tmp), removed with
// everything in it when the object goes out of scope.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/course_test_XXXXXX";
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    if (::mkdtemp(buffer.data()) == nullptr) {
      throw std::system_error(errno, std::generic_category(), "mkdtemp " + pattern);
    }
    path_ = buffer.data();
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;  // a destructor must not throw; a leftover temp dir is harmless
    std::filesystem::remove_all(path_, ignored);
  }

  const std::string& path() const { return path_; }
  // "<dir>/<name>"
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The whole file as bytes; throws when it cannot be read.
inline std::string read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot read '" + path + "'");
  return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

// Replaces the file's contents with `bytes`; throws when it cannot be written.
inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!file.flush()) throw std::runtime_error("cannot write '" + path + "'");
}

}  // namespace course_test
