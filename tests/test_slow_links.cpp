// Chapter 10 in real processes (the course launcher, tcp; its pieces alone are in
// test_compression.cpp): DiLoCo at H 1 with plain SGD inside and out is DDP with SGD;
// streaming with one fragment is DiLoCo; --algorithm ddp is chapter 02 bit for bit;
// every algorithm's bytes are its formula's; a resumed run is bit-identical (outer
// momentum and error feedback included); bad input is refused; a killed worker rejoins,
// or the others go on without it, and nobody else restarts.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "10_slow_links/compression.h"
#include "common/train/checkpoint.h"
#include "support/equivalence_model.h"
#include "support/process.h"
#include "support/runs.h"

using course_test::concat;
using course_test::course_binary;
using course_test::kModel;
using course_test::launcher_command;
using course_test::number;
using course_test::parameter_count;
using course_test::RunLog;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 120;
const int kSteps = 20;

// ----------------------------------------------------------------------------
// real runs

struct Trained {
  RunLog log;
  std::map<std::string, std::vector<float>> rank0;  // rank 0's checkpoint sections of the last step
  std::string out;
};

std::vector<float> section(const std::string& path, const std::string& name) {
  const course::CheckpointReader reader(path);
  std::vector<float> values(reader.section_size(name));
  reader.read_section(name, values.data(), values.size());
  return values;
}

// 10_slow_links on `ranks` workers for `steps` steps, its log and rank 0's last checkpoint
Trained train_slow(int ranks, const std::vector<std::string>& args, int steps = kSteps) {
  TempDir dir;
  std::vector<std::string> argv = concat(launcher_command(ranks), {course_binary("10_slow_links"), "--quiet",
                                                                   "--batch", "8", "--comm-timeout", "60"});
  const course_test::CompletedRun run =
      course_test::run_to_completion(concat(concat(argv, kModel), args), dir, steps, kTimeoutSeconds);
  Trained trained{run.log, {}, run.out};
  const std::string path = course::checkpoint_path(run.checkpoint_dir, steps, course::rank_suffix(0));
  const course::CheckpointReader reader(path);
  for (const char* name : {"params", "global", "momentum", "adam_m", "adam_v"}) {
    try {
      std::vector<float> values(reader.section_size(name));
      reader.read_section(name, values.data(), values.size());
      trained.rank0[name] = values;
    } catch (const course::CourseError&) {
      // a section this algorithm does not have (DDP: no global weights; SGD: no moments)
    }
  }
  return trained;
}

double max_relative_loss_difference(const RunLog& a, const RunLog& b) {
  REQUIRE(a.steps.size() == b.steps.size());
  double worst = 0.0;
  for (size_t i = 0; i < a.steps.size(); i++) {
    const double x = number(a.steps[i], "loss"), y = number(b.steps[i], "loss");
    REQUIRE(std::isfinite(x));
    worst = std::max(worst, std::fabs(x - y) / std::fabs(y));
  }
  return worst;
}

TEST_CASE("DiLoCo at H 1 with SGD inside and outer SGD at lr 1 is DDP with SGD, step for step", "[slow_links]") {
  for (int ranks : {2, 4}) {
    INFO(ranks << " workers");
    const std::vector<std::string> sgd = {"--inner-optimizer", "sgd", "--lr", "0.1"};
    const Trained ddp = train_slow(ranks, concat({"--algorithm", "ddp"}, sgd));
    const Trained diloco =
        train_slow(ranks, concat({"--inner-steps", "1", "--outer-lr", "1", "--outer-momentum", "0"}, sgd));
    // the pseudo-gradient global - (global - lr g) is lr g up to one rounding per step
    CHECK(max_relative_loss_difference(diloco.log, ddp.log) <= 1e-6);
    CHECK(number(diloco.log.steps.back(), "loss") < number(diloco.log.steps.front(), "loss") - 1.0);  // it learned
    CHECK(number(diloco.log.summary, "outer_syncs") == kSteps);
  }
}

TEST_CASE("streaming DiLoCo with one fragment is DiLoCo, and more fragments send the same bytes in smaller peaks",
          "[slow_links]") {
  const Trained diloco = train_slow(2, {"--inner-steps", "5"});
  const Trained one_fragment = train_slow(2, {"--inner-steps", "5", "--fragments", "1", "--overlap-steps", "0"});
  CHECK(one_fragment.log.steps.back().at("loss") == diloco.log.steps.back().at("loss"));
  CHECK(one_fragment.rank0.at("params") == diloco.rank0.at("params"));
  const Trained two = train_slow(2, {"--inner-steps", "5", "--fragments", "2", "--overlap-steps", "1"});
  double peak_one = 0, peak_two = 0;
  for (const auto& step : diloco.log.steps) peak_one = std::max(peak_one, number(step, "bytes_sent"));
  for (const auto& step : two.log.steps) {
    if (number(step, "step") < kSteps) peak_two = std::max(peak_two, number(step, "bytes_sent"));  // the last syncs all
  }
  INFO("peak bytes in a step: 1 fragment " << peak_one << ", 2 fragments " << peak_two);
  CHECK(peak_two < 0.75 * peak_one);
  CHECK(number(two.log.summary, "eval_loss") < number(two.log.steps.front(), "loss") - 1.0);  // it learned
}

// The last step drains every sync in flight, with or without a checkpoint to write: an
// overlapped fragment started in the last tau steps is applied to the final outer model
// too, and its bytes are counted once it is over.
TEST_CASE("an overlapped streaming run ends with every sync applied, with or without checkpoints", "[slow_links]") {
  const std::vector<std::string> args = {"--inner-steps", "4", "--fragments", "2", "--overlap-steps", "1"};
  const Trained checkpointed = train_slow(2, args, 10);  // fragment 1 starts a sync after step 10, the last
  TempDir dir;
  const std::string log = dir.file("no_checkpoints.jsonl");
  course_test::run_ok(concat(concat(launcher_command(2), {course_binary("10_slow_links"), "--quiet", "--batch", "8",
                                                           "--comm-timeout", "60", "--steps", "10", "--log", log}),
                             concat(kModel, args)),
                      kTimeoutSeconds);
  const RunLog plain = course_test::read_log(log);
  for (const char* field : {"outer_syncs", "sync_bytes_sent", "sync_bytes_formula", "eval_loss"}) {
    INFO(field);
    CHECK(plain.summary.at(field) == checkpointed.log.summary.at(field));
  }
  CHECK(number(plain.summary, "sync_bytes_sent") == number(plain.summary, "sync_bytes_formula"));
}

TEST_CASE("DDP without compression is chapter 02, bit for bit (--algorithm ddp)", "[slow_links]") {
  const Trained ours = train_slow(2, {"--algorithm", "ddp"});
  TempDir dir;
  const std::vector<std::string> argv =
      concat(concat(launcher_command(2), {course_binary("02_ddp"), "--quiet", "--batch", "8"}), kModel);
  const course_test::CompletedRun chapter02 = course_test::run_to_completion(argv, dir, kSteps, kTimeoutSeconds);
  const std::string whole = course::checkpoint_path(chapter02.checkpoint_dir, kSteps);
  for (const char* name : {"params", "adam_m", "adam_v"}) {
    INFO(name);
    CHECK(ours.rank0.at(name) == section(whole, name));
  }
}

TEST_CASE("every algorithm sends what its formula says", "[slow_links]") {
  const std::vector<std::vector<std::string>> variants = {
      {"--algorithm", "ddp"},
      {"--algorithm", "ddp", "--grad-compression", "int8"},
      {"--algorithm", "ddp", "--grad-compression", "bf16"},
      {"--inner-steps", "5"},
      {"--inner-steps", "5", "--grad-compression", "int8"},
      {"--inner-steps", "4", "--fragments", "2", "--overlap-steps", "1"}};
  for (int ranks : {2, 4}) {
    for (const auto& args : variants) {
      INFO(ranks << " workers, " << course_test::joined(args));
      const Trained run = train_slow(ranks, args, 10);
      CHECK(number(run.log.summary, "sync_bytes_sent") == number(run.log.summary, "sync_bytes_formula"));
      CHECK(number(run.log.summary, "sync_bytes_sent") > 0);
    }
  }
  // int8 sends a quarter of fp32's bytes and a scale per 256 values; DiLoCo at H 5 a fifth of DDP's
  const Trained ddp = train_slow(4, {"--algorithm", "ddp"}, 10);
  const Trained int8 = train_slow(4, {"--algorithm", "ddp", "--grad-compression", "int8"}, 10);
  const Trained diloco = train_slow(4, {"--inner-steps", "5"}, 10);
  const double fp32 = number(ddp.log.summary, "sync_bytes_sent");
  CHECK(number(int8.log.summary, "sync_bytes_sent") / fp32 == Approx(0.25 * (1 + 4.0 / course::kInt8Block)).epsilon(0.01));
  CHECK(number(diloco.log.summary, "sync_bytes_sent") / fp32 == Approx(0.2).epsilon(0.01));
}

TEST_CASE("a resumed run is bit-identical: outer momentum, global weights and error feedback are saved", "[slow_links]") {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--inner-steps", "4", "--grad-compression", "int8"},
        std::vector<std::string>{"--inner-steps", "4", "--fragments", "2", "--overlap-steps", "1"},
        std::vector<std::string>{"--algorithm", "ddp", "--grad-compression", "int8"}}) {
    INFO(course_test::joined(args));
    TempDir dir;
    const std::string checkpoints = dir.file("checkpoints");
    const std::vector<std::string> base = concat(
        concat(launcher_command(2), {course_binary("10_slow_links"), "--quiet", "--batch", "8", "--checkpoint-dir",
                                     checkpoints, "--checkpoint-every", "6"}),
        concat(kModel, args));
    course_test::run_ok(concat(base, {"--steps", "6"}), kTimeoutSeconds);
    const std::string log = dir.file("resumed.jsonl");
    course_test::run_ok(concat(base, {"--steps", "12", "--resume", "--log", log}), kTimeoutSeconds);
    const RunLog resumed = course_test::read_log(log);
    const Trained straight = train_slow(2, concat(args, {"--checkpoint-every", "6"}), 12);
    course_test::check_same_losses(resumed, straight.log, 7);
    CHECK(section(course::checkpoint_path(checkpoints, 12, course::rank_suffix(0)), "params") ==
          straight.rank0.at("params"));
    CHECK(resumed.summary.at("eval_loss") == straight.log.summary.at("eval_loss"));
  }
}

TEST_CASE("bad input: one message and exit 2", "[slow_links]") {
  course_test::check_refusals(
      course_binary("10_slow_links"), kModel,
      {{{"--inner-steps", "0"}, 2, "--inner-steps"},
       {{"--fragments", "3"}, 2, "does not divide the 2 layers"},
       {{"--fragments", "2", "--algorithm", "ddp"}, 2, "streaming DiLoCo's"},
       {{"--inner-steps", "5", "--algorithm", "ddp"}, 2, "--algorithm ddp has none"},
       {{"--outer-lr", "1", "--algorithm", "ddp"}, 2, "--algorithm ddp has none"},
       {{"--mixing", "0.3"}, 2, "overlaps none"},
       {{"--mixing", "0.3", "--algorithm", "ddp"}, 2, "--algorithm ddp has none"},
       {{"--quorum-timeout", "2"}, 2, "this run has none (hint: add --fault-tolerant"},
       // given their default values: still flags that change nothing
       {{"--inner-steps", "10", "--algorithm", "ddp"}, 2, "--algorithm ddp has none"},
       {{"--fragments", "1", "--algorithm", "ddp"}, 2, "streaming DiLoCo's"},
       {{"--mixing", "0.5"}, 2, "overlaps none"},
       {{"--quorum-timeout", "5"}, 2, "this run has none (hint: add --fault-tolerant"},
       {{"--inner-steps", "4", "--overlap-steps", "4"}, 2, "must be below --inner-steps"},
       {{"--overlap-steps", "1", "--grad-compression", "int8"}, 2, "--overlap-steps needs --grad-compression none"},
       {{"--no-error-feedback"}, 2, "nothing is rounded away"},
       {{"--grad-compression", "int4"}, 2, "--grad-compression"},
       {{"--sites", "2", "--wan-bandwidth", "0Mbit"}, 2, "--wan-bandwidth"},
       {{"--sites", "3"}, 2, "--sites 3 does not divide"}},
      kTimeoutSeconds);
}

TEST_CASE("a resume with another algorithm is refused, naming what differs", "[slow_links]") {
  TempDir dir;
  const std::string checkpoints = dir.file("checkpoints");
  const std::vector<std::string> base =
      concat(concat(launcher_command(2), {course_binary("10_slow_links"), "--quiet", "--batch", "8",
                                          "--checkpoint-dir", checkpoints}),
             kModel);
  course_test::run_ok(concat(base, {"--steps", "4", "--inner-steps", "2"}), kTimeoutSeconds);
  const course_test::ProcessResult refused =
      course_test::run_process(concat(base, {"--steps", "8", "--inner-steps", "4", "--resume"}), kTimeoutSeconds);
  CHECK(refused.exit_code == 2);
  CHECK_THAT(refused.err, Catch::Contains("another inner_steps (2, this run 4)"));
}

// ----------------------------------------------------------------------------
// fault tolerance

size_t count_of(const std::string& text, const std::string& what) {
  size_t count = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) count++;
  return count;
}

// 10_slow_links --fault-tolerant on 4 workers under the launcher's worker policy, 30
// steps; rank `dying` SIGKILLs itself after step `die_after` (in its first life only)
course_test::ProcessResult fault_tolerant_run(const std::vector<std::string>& launcher_flags,
                                              const std::vector<std::string>& flags, const std::string& log,
                                              int die_after = 13, int dying = 2) {
  std::vector<std::string> argv = {course_binary("launch"), "--nproc-per-node", "4", "--master-port", "0",
                                   "--restart-policy", "worker"};
  argv = concat(argv, launcher_flags);
  argv = concat(argv, {"--", "env",
                       "COURSE_TEST_FAULT=die_at_step=" + std::to_string(die_after) + ",rank=" + std::to_string(dying),
                       course_binary("10_slow_links"),
                       "--fault-tolerant", "--inner-steps", "5", "--steps", "30", "--batch", "8", "--print-every",
                       "1", "--comm-timeout", "60", "--log", log});
  return course_test::run_process(concat(concat(argv, kModel), flags), kTimeoutSeconds);
}

// the 16 hex digits after `marker` in `text` ("" when absent)
std::string checksum_after(const std::string& text, const std::string& marker) {
  const size_t at = text.find(marker);
  return at == std::string::npos ? "" : text.substr(at + marker.size(), 16);
}

TEST_CASE("a killed worker: the others go on, it alone restarts once and rejoins with the global weights",
          "[slow_links]") {
  TempDir dir;
  const course_test::ProcessResult result = fault_tolerant_run({"--max-restarts", "1"}, {}, dir.file("log.jsonl"));
  const std::string all = result.out + result.err;
  INFO(result.describe() << "\n" << all);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(count_of(all, "restarting rank 2 alone") == 1);
  CHECK(count_of(all, "restarting") == 1);  // nobody else, and no group restart
  CHECK(count_of(all, "hosting the store") == 1);
  // the worker that came back holds the global weights the others made at that outer step
  const std::string joined = checksum_after(all, "with the global weights (");
  const std::string made = checksum_after(all, "(global weights ");
  CHECK(joined.size() == 16);
  CHECK(joined == made);
  // rank 0 trained every step, its loss falling through the failure, and the models agree at the end
  // (the summary's check over the last outer step's group, the rejoined worker in it)
  const RunLog log = course_test::read_log(dir.file("log.jsonl"));
  REQUIRE(log.steps.size() == 30);
  CHECK(number(log.steps.back(), "loss") < number(log.steps[12], "loss"));
  CHECK(number(log.steps[12], "loss") < number(log.steps.front(), "loss") - 1.0);
  CHECK_FALSE(log.summary.empty());
}

TEST_CASE("a worker lost for good: the others finish every outer step without it, naming it", "[slow_links]") {
  TempDir dir;
  const course_test::ProcessResult result =
      fault_tolerant_run({}, {"--quorum-timeout", "2"}, dir.file("log.jsonl"));
  const std::string all = result.out + result.err;
  INFO(result.describe() << "\n" << all);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 128 + 9);  // the launcher's exit says a worker was lost: SIGKILL's
  CHECK_THAT(all, Catch::Contains("no restarts left (--max-restarts 0): the others go on without it"));
  // outer steps 3 to 6 (steps 15 to 30) without worker 2
  CHECK(count_of(all, "averaged over workers 0,1,3; lost: 2") == 4);
  const RunLog log = course_test::read_log(dir.file("log.jsonl"));
  CHECK(log.steps.size() == 30);
  CHECK_FALSE(log.summary.empty());
}

TEST_CASE("a worker killed after the last outer step: the others end without it, and its restart has nothing to "
          "rejoin",
          "[slow_links]") {
  TempDir dir;
  const course_test::ProcessResult result =
      fault_tolerant_run({"--max-restarts", "1"}, {"--quorum-timeout", "2"}, dir.file("log.jsonl"), 30);
  const std::string all = result.out + result.err;
  INFO(result.describe() << "\n" << all);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 0);
  CHECK(count_of(all, "restarting rank 2 alone") == 1);
  CHECK_THAT(all, Catch::Contains("[worker 2] restarted after the run's last outer step: the others have finished "
                                  "without it, nothing is left to rejoin"));
  // the survivors' end: the models checked equal and the eval loss averaged among them
  const RunLog log = course_test::read_log(dir.file("log.jsonl"));
  CHECK(log.steps.size() == 30);
  REQUIRE_FALSE(log.summary.empty());
  CHECK(number(log.summary, "eval_loss") > 0);
}

TEST_CASE("worker 0 killed after the last outer step: the others end, and its restart fails saying the summary "
          "is lost",
          "[slow_links]") {
  TempDir dir;
  const course_test::ProcessResult result =
      fault_tolerant_run({"--max-restarts", "1"}, {"--quorum-timeout", "2"}, dir.file("log.jsonl"), 30, 0);
  const std::string all = result.out + result.err;
  INFO(result.describe() << "\n" << all);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 1);
  CHECK(count_of(all, "restarting rank 0 alone") == 1);
  CHECK_THAT(all, Catch::Contains("worker 0 died after the run's last outer step") &&
                      Catch::Contains("the run's summary and log, which are lost"));
  CHECK(course_test::read_log(dir.file("log.jsonl")).summary.empty());
}

TEST_CASE("a fault-tolerant run ends with an outer step, even one shorter than H", "[slow_links]") {
  TempDir dir;
  const std::vector<std::string> argv =
      concat(concat(launcher_command(2), {course_binary("10_slow_links"), "--fault-tolerant", "--inner-steps", "5",
                                          "--steps", "3", "--batch", "8", "--quiet", "--log", dir.file("log.jsonl")}),
             kModel);
  course_test::run_ok(argv, kTimeoutSeconds);
  const RunLog log = course_test::read_log(dir.file("log.jsonl"));
  CHECK(number(log.summary, "outer_syncs") == 1);
  CHECK(number(log.summary, "eval_loss") > 0);
}

TEST_CASE("fault tolerance: bad combinations are refused", "[slow_links]") {
  course_test::check_refusals(
      course_binary("10_slow_links"), kModel,
      {{{"--fault-tolerant", "--algorithm", "ddp"}, 2, "--fault-tolerant is DiLoCo's"},
       {{"--fault-tolerant", "--grad-compression", "int8"}, 2, "--fault-tolerant is DiLoCo's"},
       {{"--fault-tolerant", "--checkpoint-dir", "x"}, 2, "not from a file"},
       {{"--fault-tolerant", "--backend", "mpi"}, 2, "--backend tcp"}},
      kTimeoutSeconds);
  // under mpirun rank 0 would host the store, and its death would end everyone's
  const course_test::ProcessResult result = course_test::run_process(
      concat(concat(course_test::mpirun_command(2), {course_binary("10_slow_links"), "--fault-tolerant", "--steps", "2"}),
             kModel),
      kTimeoutSeconds);
  INFO(result.describe() << "\n" << result.err);
  CHECK(result.exit_code == 2);
  CHECK_THAT(result.err, Catch::Contains("needs a store that outlives every worker"));
  CHECK(course_test::error_lines(result.err) == 1);
  // without a launcher at all: refused before the first step, not at the first outer step
  const course_test::ProcessResult alone = course_test::run_process(
      concat({course_binary("10_slow_links"), "--fault-tolerant", "--steps", "2"}, kModel), kTimeoutSeconds);
  INFO(alone.describe() << "\n" << alone.err);
  CHECK(alone.exit_code == 2);
  CHECK_THAT(alone.err, Catch::Contains("needs a store that outlives every worker") &&
                            Catch::Contains("--nproc-per-node 2 --restart-policy worker"));
  CHECK(course_test::error_lines(alone.err) == 1);
}

}  // namespace
