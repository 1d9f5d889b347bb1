// Starting the course's programs the way a reader does, and reading what they log:
// shared by the tests that run trainers and ranks.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/train/metrics.h"
#include "support/process.h"

namespace course_test {

inline std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Open MPI refuses to run as root unless told it is fine (CI runs as root), and
// more ranks than cores unless told to oversubscribe. Its components keep memory
// until the process ends, which LeakSanitizer (the asan preset) would report as
// leaks of ours; leak checking stays on for every other program. The test target
// defines COURSE_MPIEXEC (CMake's MPIEXEC_EXECUTABLE).
inline std::vector<std::string> mpirun_command(int ranks) {
  return {"env",
          "OMPI_ALLOW_RUN_AS_ROOT=1",
          "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
          "OMPI_MCA_rmaps_base_oversubscribe=1",
          "ASAN_OPTIONS=detect_leaks=0",
          COURSE_MPIEXEC,
          "-np",
          std::to_string(ranks)};
}

// The course launcher on a free port, ready for the program after "--".
inline std::vector<std::string> launcher_command(int ranks) {
  return {course_binary("launch"), "--nproc-per-node", std::to_string(ranks), "--master-port", "0", "--"};
}

// "a b c": a command line, for failure messages.
inline std::string joined(const std::vector<std::string>& args) {
  std::string text;
  for (const std::string& arg : args) text += (text.empty() ? "" : " ") + arg;
  return text;
}

// A number field of a JSON line; the test fails if the field is missing.
inline double number(const std::map<std::string, std::string>& fields, const std::string& key) {
  INFO("JSON field " << key);
  REQUIRE(fields.count(key) == 1);
  return std::stod(fields.at(key));
}

// A trainer's --log: one JSON object per line, {"step": 1, "loss": ...} for every
// step, then {"summary": 1, ...}.
struct RunLog {
  std::vector<std::map<std::string, std::string>> steps;
  std::map<std::string, std::string> summary;
};

inline RunLog read_log(const std::string& path) {
  RunLog log;
  std::istringstream lines(read_file(path));
  for (std::string line; std::getline(lines, line);) {
    std::map<std::string, std::string> fields = course::parse_json_line(line);
    if (fields.count("summary") != 0) {
      log.summary = fields;
    } else {
      log.steps.push_back(fields);
    }
  }
  return log;
}

// Runs argv, requiring that it ends in time with exit code 0 (its output in the
// failure message otherwise).
inline ProcessResult run_ok(const std::vector<std::string>& argv, double timeout_seconds) {
  const ProcessResult result = run_process(argv, timeout_seconds);
  INFO(joined(argv) << "\nresult: " << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  REQUIRE(result.exit_code == 0);
  return result;
}

// A finished training run: its log, its stdout, and where its checkpoints are.
struct CompletedRun {
  RunLog log;
  std::string out;             // stdout (under a launcher, rank 0's lines are the only ones there)
  std::string checkpoint_dir;  // holds the checkpoint of the last step
};

// Runs argv (a trainer plus its flags) for `steps` steps with --log and
// --checkpoint-dir inside `dir`; requires it to succeed and to log every step and a
// summary.
inline CompletedRun run_to_completion(std::vector<std::string> argv, const TempDir& dir, int steps,
                                      double timeout_seconds) {
  CompletedRun run;
  const std::string log_path = dir.file("log.jsonl");
  run.checkpoint_dir = dir.file("checkpoints");
  argv = concat(argv, {"--steps", std::to_string(steps), "--log", log_path, "--checkpoint-dir", run.checkpoint_dir});
  const ProcessResult result = run_process(argv, timeout_seconds);
  INFO(joined(argv) << "\nresult: " << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  REQUIRE(result.exit_code == 0);
  run.log = read_log(log_path);
  REQUIRE(run.log.steps.size() == static_cast<size_t>(steps));
  REQUIRE_FALSE(run.log.summary.empty());
  run.out = result.out;
  return run;
}

// A trainer's refusals of bad input: each case's flags (after `common`) at `ranks` ranks
// under the course launcher exits 2 and says `says` on stderr.
// How many times a run said "error: ": once for an error, however many ranks found it.
inline size_t error_lines(const std::string& err) {
  size_t said = 0;
  for (size_t at = err.find("error: "); at != std::string::npos; at = err.find("error: ", at + 1)) said++;
  return said;
}

struct Refusal {
  std::vector<std::string> args;
  int ranks;
  std::string says;
};
inline void check_refusals(const std::string& program, const std::vector<std::string>& common,
                           const std::vector<Refusal>& cases, double timeout_seconds) {
  for (const Refusal& bad : cases) {
    const std::vector<std::string> argv =
        concat(concat(concat(launcher_command(bad.ranks), {program, "--steps", "2"}), common), bad.args);
    const ProcessResult result = run_process(argv, timeout_seconds);
    INFO(joined(bad.args) << "\n" << result.describe() << "\n" << result.err);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.err, Catch::Contains(bad.says));
    CHECK(error_lines(result.err) == 1);  // said once, by one rank: however many ranks found it
  }
}

// The bounds of a parallel run against chapter 00 on the same batch, where only the
// order of floating-point additions differs (tests/test_ddp.cpp says why these):
inline constexpr double kLossTolerance = 1e-5;   // relative, per step
inline constexpr double kStateTolerance = 1e-4;  // x max |parameter|, final parameters

// Every step's loss and every final parameter (chapter 00's flat order) within the
// bounds above, and the run learned something.
inline void check_losses_and_parameters(const RunLog& log, const std::vector<float>& params,
                                        const RunLog& reference_log, const std::vector<float>& reference_params) {
  REQUIRE(log.steps.size() == reference_log.steps.size());
  REQUIRE(params.size() == reference_params.size());
  double worst_loss = 0.0, worst_param = 0.0, largest = 0.0;
  for (size_t i = 0; i < log.steps.size(); i++) {
    const double loss = number(log.steps[i], "loss"), expected = number(reference_log.steps[i], "loss");
    REQUIRE(std::isfinite(loss));
    worst_loss = std::max(worst_loss, std::fabs(loss - expected) / std::fabs(expected));
  }
  for (size_t i = 0; i < params.size(); i++) {
    REQUIRE(std::isfinite(params[i]));
    worst_param = std::max(worst_param, std::fabs(static_cast<double>(params[i]) - reference_params[i]));
    largest = std::max(largest, std::fabs(static_cast<double>(reference_params[i])));
  }
  INFO("max relative loss difference " << worst_loss << ", max parameter difference " << worst_param << " of "
                                       << largest);
  CHECK(worst_loss <= kLossTolerance);
  CHECK(worst_param <= kStateTolerance * largest);
  CHECK(number(log.steps.back(), "loss") < number(log.steps.front(), "loss") - 1.0);  // it learned
}

// A run logged steps first..N of the reference's N, each the same text as the
// reference's (%.9g, so the same bits): a restart, or another launcher, changed nothing.
inline void check_same_losses(const RunLog& run, const RunLog& reference, int first) {
  REQUIRE(run.steps.size() == reference.steps.size() - static_cast<size_t>(first - 1));
  for (size_t i = 0; i < run.steps.size(); i++) {
    const auto& expected = reference.steps[static_cast<size_t>(first - 1) + i];
    INFO("step " << expected.at("step"));
    CHECK(run.steps[i].at("step") == expected.at("step"));
    CHECK(run.steps[i].at("loss") == expected.at("loss"));
  }
  CHECK(run.summary.at("final_loss") == reference.summary.at("final_loss"));
}

// A resumed run logged steps first..N; each within kLossTolerance of the run that
// never stopped (resumed at another world size, or in chapter 00, it sums the
// gradients in another order).
inline void check_losses_close(const RunLog& resumed, const RunLog& straight, int first) {
  REQUIRE(resumed.steps.size() == straight.steps.size() - static_cast<size_t>(first - 1));
  double worst = 0.0;
  for (size_t i = 0; i < resumed.steps.size(); i++) {
    const auto& expected = straight.steps[static_cast<size_t>(first - 1) + i];
    REQUIRE(resumed.steps[i].at("step") == expected.at("step"));
    const double loss = number(resumed.steps[i], "loss"), reference = number(expected, "loss");
    worst = std::max(worst, std::fabs(loss - reference) / std::fabs(reference));
  }
  INFO("max relative loss difference " << worst);
  CHECK(worst <= kLossTolerance);
}

}  // namespace course_test
