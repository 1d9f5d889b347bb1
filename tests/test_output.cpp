// What a reader sees of a multi-rank run, under the course launcher and under
// mpirun: progress that arrives line by line through a pipe (as with `| tee`), a
// mistake in the flags said once rather than once per rank, an error that only
// one rank finds still said, and step lines that fit an ordinary terminal.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/train/checkpoint.h"
#include "common/train/metrics.h"
#include "support/equivalence_model.h"
#include "support/process.h"
#include "support/runs.h"

using course_test::concat;
using course_test::course_binary;
using course_test::joined;
using course_test::launcher_command;
using course_test::mpirun_command;
using course_test::ProcessResult;
using course_test::run_process;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 120;

// The same trainer command under the course launcher (tcp) or mpirun (mpi).
std::vector<std::string> ranks_command(const std::string& launcher, int ranks, const std::vector<std::string>& program) {
  return concat(launcher == "mpirun" ? mpirun_command(ranks) : launcher_command(ranks), program);
}

size_t count(const std::string& text, const std::string& what) {
  size_t found = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) found++;
  return found;
}

}  // namespace

TEST_CASE("progress reaches a pipe line by line: the first step line arrives while the run goes on", "[cli]") {
  const std::string launcher = GENERATE(as<std::string>{}, "launch", "mpirun");
  INFO("under " << launcher);
  // The default model for 20 steps writes under 4 KB in all, about a second or
  // more of training: block-buffered, nothing would arrive before the end.
  const std::vector<std::string> argv = ranks_command(launcher, 2, {course_binary("02_ddp"), "--steps", "20"});
  const course_test::LineWait wait = course_test::read_until_line(argv, "| loss ", kTimeoutSeconds);
  INFO(joined(argv) << "\noutput so far:\n" << wait.output);
  REQUIRE(wait.found);
  CHECK(wait.running_then);
}

TEST_CASE("with --print-every past the run, a progress line still comes at least every 3 s", "[cli]") {
  // 10 s of chapter 00, stopped by SIGINT: step 1's line, then one whenever 3 s have
  // passed since the last, so at least 3 lines however fast or slow the machine is
  const std::vector<std::string> argv = {"timeout", "--signal=INT", "10", course_binary("00_single_gpu"), "--steps",
                                         "1000000", "--print-every", "1000000"};
  const ProcessResult result = run_process(argv, kTimeoutSeconds);
  INFO(joined(argv) << "\nresult: " << result.describe() << "\nstdout:\n" << result.out);
  REQUIRE_FALSE(result.timed_out);
  CHECK(count(result.out, "| loss ") >= 3);
  CHECK(count(result.out, "| loss ") <= 5);  // not every step: about one per 3 s
}

TEST_CASE("a mistake in the flags of a multi-rank run is said once, by rank 0", "[cli]") {
  const std::string launcher = GENERATE(as<std::string>{}, "launch", "mpirun");
  INFO("under " << launcher);
  const std::vector<std::string> argv =
      ranks_command(launcher, 4, {course_binary("02_ddp"), "--step", "3"});  // --steps, misspelled
  const ProcessResult result = run_process(argv, kTimeoutSeconds);
  INFO(joined(argv) << "\nresult: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 2);
  CHECK(count(result.err, "02_ddp: error: unknown flag '--step' (did you mean --steps?)") == 1);
  if (launcher == "launch") {
    CHECK(count(result.err, "[rank 0] 02_ddp: error: ") == 1);
    // the launcher names the ranks it stopped, and why
    CHECK_THAT(result.err, Catch::Contains("[launch] rank 0 exited with code 2; stopping ranks 1-3 (a group cannot "
                                           "go on without one of its ranks)"));
  }
}

TEST_CASE("an error that only one rank finds is said by that rank", "[cli]") {
  // Two 2-rank runs that differ in --seed, then rank 1's checkpoint of the second
  // in place of the first's: resuming, only rank 1 finds a checkpoint that does
  // not fit its flags.
  TempDir dir;
  auto train = [&](const std::string& seed, const std::string& checkpoints, const std::vector<std::string>& extra) {
    const std::vector<std::string> argv = concat(
        launcher_command(2), concat({course_binary("03_fsdp"), "--quiet", "--batch", "4", "--seed", seed,
                                     "--checkpoint-dir", dir.file(checkpoints), "--comm-timeout", "60"},
                                    concat(course_test::kModel, extra)));
    return run_process(argv, kTimeoutSeconds);
  };
  REQUIRE(train("1", "first", {"--steps", "2"}).exit_code == 0);
  REQUIRE(train("2", "second", {"--steps", "2"}).exit_code == 0);
  std::filesystem::copy_file(course::checkpoint_path(dir.file("second"), 2, "_rank1"),
                             course::checkpoint_path(dir.file("first"), 2, "_rank1"),
                             std::filesystem::copy_options::overwrite_existing);

  const ProcessResult result = train("1", "first", {"--steps", "4", "--resume"});
  INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code != 0);
  CHECK_THAT(result.err, Catch::Contains("[rank 1] 03_fsdp: error: checkpoint '") &&
                             Catch::Contains("' was written with --seed 2"));
}

TEST_CASE("tokens per second take 5 characters however fast the machine is", "[cli]") {
  for (const double rate : {0.0, 7.0, 18791.0, 99999.0, 99999.6, 123456.0, 1234567.0, 9999499.0, 9999600.0, 1.5e9}) {
    INFO(rate << " -> '" << course::format_tokens_per_second(rate) << "'");
    CHECK(course::format_tokens_per_second(rate).size() == 5);
  }
  CHECK(course::format_tokens_per_second(18791.2) == "18791");
  CHECK(course::format_tokens_per_second(1234567.0) == "1235k");
  CHECK(course::format_tokens_per_second(1.5e9) == "1500M");
}

// A 99-column step line (07's) reached 100 when one step took a second: "1234.5 ms".
TEST_CASE("a step's time takes 8 characters however long the step took", "[cli]") {
  for (const double seconds : {0.0, 0.0004, 0.1374, 0.99994, 0.99996, 1.2345, 9.9994, 9.9996, 42.0, 123.45, 999.96,
                               12345.0, 999999.0}) {
    INFO(seconds << " -> '" << course::format_step_time(seconds) << "'");
    CHECK(course::format_step_time(seconds).size() == 8);
  }
  CHECK(course::format_step_time(0.1374) == "137.4 ms");
  CHECK(course::format_step_time(1.2345) == " 1.234 s");  // 1.2345 is 1.23449... in binary
  CHECK(course::format_step_time(12345.0) == " 12345 s");
}

TEST_CASE("the machine is busy when the job's ranks and the others' work want more than its cores", "[cli]") {
  // 10 s of wall time; the machine's clock advances 26 s, the job's ranks spend 18 s
  const course::CpuClock start{100.0, 1.0, 50.0}, end{126.0, 10.0, 60.0};
  const double tick = 0.01;
  const course::MachineLoad two_ranks = course::machine_load(start, end, 18.0, 2, 1, 4, tick);
  CHECK(two_ranks.other_cores == Approx(0.8));  // (26 - 18) / 10: the job's own time is not the others'
  CHECK(two_ranks.job_cores == 2);
  CHECK(two_ranks.slack == Approx(0.5 + 2 * 4 * 0.01 / 10));  // a tick on each core at each end
  CHECK_FALSE(two_ranks.busy());                                   // 2.8 of 4 cores wanted
  CHECK(course::machine_load(start, end, 18.0, 2, 1, 2, tick).busy());  // 2.8 of 2
  CHECK(course::machine_load(start, end, 18.0, 2, 2, 4, tick).busy());  // 4.8 of 4: two BLAS threads a rank
  const course::MachineLoad alone = course::machine_load(start, end, 9.0, 1, 1, 2, tick);
  CHECK(alone.other_cores == Approx(1.7));
  CHECK(alone.busy());  // 2.7 of 2
  const course::CpuClock quieter_end{123.0, 10.0, 60.0};
  CHECK_FALSE(course::machine_load(start, quieter_end, 9.0, 1, 1, 2, tick).busy());  // 2.4 of 2: within the slack
  CHECK(course::machine_load(start, end, 18.0, 8, 1, 2, tick).busy());  // the job alone oversubscribes
  // a short run on many cores: the ticks' uncertainty widens the slack instead of saying busy
  const course::CpuClock short_end{104.0, 1.3, 50.3};
  const course::MachineLoad short_run = course::machine_load(start, short_end, 0.3, 1, 1, 32, tick);
  CHECK(short_run.slack == Approx(0.5 + 2 * 32 * 0.01 / 0.3));
  CHECK_FALSE(short_run.busy());
  // no /proc/stat: nothing known of the others
  const course::CpuClock unknown_start{0.0, 1.0, 50.0}, unknown_end{0.0, 10.0, 60.0};
  CHECK(course::machine_load(unknown_start, unknown_end, 9.0, 1, 1, 2, tick).other_cores == 0.0);
}

TEST_CASE("the CPU clocks move as a spinning process makes them", "[cli]") {
  // this thread spins 0.3 s: the process's CPU time grows with the wall clock (less when
  // the machine is shared), and the cores' clock, which counts it too, at least as much
  // (less what its ticks miss)
  const course::CpuClock start = course::read_cpu_clock();
  double spun = 0.0;
  while (course::read_cpu_clock().wall_seconds - start.wall_seconds < 0.3) spun += 1.0;
  const course::CpuClock end = course::read_cpu_clock();
  const double wall = end.wall_seconds - start.wall_seconds, process = end.process_seconds - start.process_seconds;
  INFO("wall " << wall << " s, process " << process << " s, cores' clock "
               << end.machine_seconds - start.machine_seconds << " s, " << spun << " readings");
  CHECK(process > 0.2 * wall);  // (and more than the wall time where the process has other threads busy: BLAS's)
  if (std::ifstream("/proc/stat").good()) {
    CHECK(start.machine_seconds > 0.0);
    const double tick = 1.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
    CHECK(end.machine_seconds - start.machine_seconds >= process - 2 * course::machine_cores() * tick);
  }
  CHECK(course::machine_cores() >= 1);
}

TEST_CASE("every chapter's step line fits 100 columns behind the launcher's rank prefix", "[cli]") {
  struct Chapter {
    std::string program;
    int ranks;
    std::vector<std::string> flags;
  };
  // --steps 1000, so that the step counter is as wide as a long run's ("step    2/1000"
  // is as wide as step 1000's line); the tiny model makes tokens/s as wide as it gets on
  // a CPU. Every step prints, and the run is stopped (SIGINT, as Ctrl-C) after 20 s:
  // 1000 steps of 8 ranks on a loaded 2-core machine once took past the timeout.
  const std::vector<Chapter> chapters = {
      {"00_single_gpu", 1, {}},
      {"02_ddp", 2, {}},
      {"03_fsdp", 2, {}},
      {"04_naive_model_parallel", 2, {}},
      {"05_pipeline", 2, {"--micro-batches", "4"}},
      {"06_tensor_parallel", 2, {}},
      {"06_tensor_parallel", 2, {"--sp"}},
      {"07_3d", 8, {"--dp", "2", "--pp", "2", "--tp", "2"}},
      {"08_context_parallel", 2, {}},
      {"09_expert_parallel", 2, {"--experts", "4", "--top-k", "2"}},
  };
  const size_t index = GENERATE(range(0, 10));
  REQUIRE(index < chapters.size());
  const Chapter& chapter = chapters[index];
  const std::vector<std::string> argv = concat(
      {"timeout", "--preserve-status", "--signal=INT", "20"},  // the launcher's own exit code
      ranks_command("launch", chapter.ranks,
                    concat({course_binary(chapter.program), "--layers", "2", "--d-model", "16", "--heads", "2",
                            "--seq", "16", "--batch", "8", "--steps", "1000", "--print-every", "1"},
                           chapter.flags)));
  const ProcessResult result = run_process(argv, kTimeoutSeconds);
  INFO(joined(argv) << "\nresult: " << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n"
                    << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK((result.exit_code == 0 || result.exit_code == 128 + SIGINT));  // done within 20 s, or stopped
  std::istringstream lines(result.out);
  int step_lines = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.find("| loss ") == std::string::npos) continue;
    step_lines++;
    INFO(line.size() << " columns: " << line);
    CHECK(line.size() <= 100);
  }
  CHECK(step_lines >= 2);
}

// A small model, so that a run that diverges does it at once.
const std::vector<std::string> kTinyModel = {"--layers", "1", "--d-model", "16", "--heads", "2", "--batch", "2"};

TEST_CASE("a loss or gradient norm that is no longer finite stops the run with exit 1, said once, before its "
          "checkpoint",
          "[cli]") {
  // --lr 1e30: the step after the first update has NaN gradients and loss; the norm, checked before the
  // update, is found first (with clipping off too), the loss when the gradients stay finite
  const auto says_diverged = [](const std::string& err, const std::string& program) {
    const auto has = [&](const std::string& piece) { return err.find(piece) != std::string::npos; };
    const bool named = has(program + ": error: the loss of step ") ||
                       has(program + ": error: the global gradient norm of step ");
    return named && has(": training diverged (hint: lower --lr");
  };
  TempDir dir;
  const std::string checkpoints = dir.file("checkpoints");
  SECTION("one device") {
    const ProcessResult result =
        run_process(concat({course_binary("00_single_gpu"), "--lr", "1e30", "--steps", "6", "--checkpoint-dir",
                            checkpoints, "--checkpoint-every", "1"},
                           kTinyModel),
                    kTimeoutSeconds);
    INFO("result: " << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
    REQUIRE_FALSE(result.timed_out);
    CHECK(result.exit_code == 1);
    CHECK_THAT(result.err, Catch::StartsWith("00_single_gpu: error: the "));
    CHECK(says_diverged(result.err, "00_single_gpu"));
    CHECK(std::count(result.err.begin(), result.err.end(), '\n') == 1);
    // the step that diverged saved nothing: the newest checkpoint is the step before it
    const size_t at = result.err.find(" of step ");
    REQUIRE(at != std::string::npos);
    const int step = std::stoi(result.err.substr(at + std::string(" of step ").size()));
    CHECK_FALSE(std::filesystem::exists(course::checkpoint_path(checkpoints, step)));
    if (step > 1) CHECK(std::filesystem::exists(course::checkpoint_path(checkpoints, step - 1)));
  }
  SECTION("two ranks: rank 0 says it") {
    const std::vector<std::string> argv = concat(
        launcher_command(2),
        concat({course_binary("02_ddp"), "--lr", "1e30", "--steps", "6"}, kTinyModel));
    const ProcessResult result = run_process(argv, kTimeoutSeconds);
    INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
    REQUIRE_FALSE(result.timed_out);
    CHECK(result.exit_code == 1);
    CHECK(says_diverged(result.err, "02_ddp"));
    CHECK(count(result.err, "02_ddp: error: ") == 1);
    CHECK(count(result.err, "[rank 0] 02_ddp: error: ") == 1);
  }
}
