// Chapters 04 and 05 end to end: the model cut by layers over N ranks computes
// what chapter 00 computes. Every run is the real trainer, started by the course
// launcher (tcp) or mpirun (mpi), compared with the real 00_single_gpu:
//
// - against chapter 00 with the SAME micro-batches the results are bit-identical:
//   each stage accumulates the same micro-batch gradients in the same order, and
//   the last stage adds the micro-batch losses in chapter 00's order;
// - against chapter 00 on the whole batch at once they are equal within the
//   bounds tests/test_ddp.cpp justifies (only the summation order differs).
//
// Also: each rank's memory and bytes sent equal the formulas, a resumed run is
// bit-identical, a dead peer ends the run, and bad input is refused.
#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "05_pipeline/schedule.h"
#include "common/train/checkpoint.h"
#include "common/comm/socket.h"
#include "common/model/model.h"
#include "support/process.h"
#include "support/runs.h"
#include "support/trace_json.h"

using course_test::concat;
using course_test::course_binary;
using course_test::joined;
using course_test::number;
using course_test::ProcessResult;
using course_test::read_log;
using course_test::run_process;
using course_test::RunLog;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 180;
const int kSteps = 20;

// 4 blocks so that 4 ranks each get one; interleaved at 4 ranks x 2 chunks needs 8
course::GPTConfig pipeline_config(int layers) {
  course::GPTConfig config;
  config.n_layer = layers;
  config.d_model = 32;
  config.n_head = 2;
  config.seq_len = 32;
  return config;
}

std::vector<std::string> model_flags(int layers) {
  return {"--layers", std::to_string(layers), "--d-model", "32", "--heads", "2", "--seq", "32", "--lr", "3e-3"};
}

struct Run {
  RunLog log;
  std::vector<float> params;  // the whole model's final parameters, in chapter 00's flat order
  std::string out;
};

// Assembles the whole parameter buffer from the ranks' checkpoint files, each part
// at its stages' place in chapter 00's flat buffer.
std::vector<float> gather_parameters(const std::string& dir, int step, int ranks, const course::GPTConfig& config) {
  const std::vector<course::StageLayout> layout = course::model_layout(config);
  std::vector<size_t> stage_offset = {0};
  for (const course::StageLayout& stage : layout) stage_offset.push_back(stage_offset.back() + stage.numel);
  std::vector<float> params(stage_offset.back(), NAN);
  for (int rank = 0; rank < ranks; rank++) {
    course::CheckpointReader reader(course::checkpoint_path(dir, step, "_rank" + std::to_string(rank)));
    for (int part = 0; part < reader.meta("parts_per_rank"); part++) {
      const int first = reader.meta("part" + std::to_string(part) + "_first_stage");
      const int last = reader.meta("part" + std::to_string(part) + "_last_stage");
      reader.read_section("params" + std::to_string(part), params.data() + stage_offset[first],
                          stage_offset[last + 1] - stage_offset[first]);
    }
  }
  return params;
}

// Runs argv to completion; ranks = 0: chapter 00's single checkpoint file, else one per rank.
Run train(const std::vector<std::string>& argv, int ranks, int layers, int steps = kSteps) {
  TempDir dir;
  const course_test::CompletedRun completed = course_test::run_to_completion(argv, dir, steps, kTimeoutSeconds);
  Run run{completed.log, {}, completed.out};
  if (ranks == 0) {
    course::CheckpointReader reader(course::checkpoint_path(completed.checkpoint_dir, steps));
    run.params.resize(course::count_parameters(pipeline_config(layers)));
    reader.read_section("params", run.params.data(), run.params.size());
  } else {
    run.params = gather_parameters(completed.checkpoint_dir, steps, ranks, pipeline_config(layers));
  }
  return run;
}

// Chapter 00 with these flags, once per distinct set.
const Run& train_single(int layers, const std::vector<std::string>& args) {
  static std::map<std::string, Run> runs;
  const std::string key = std::to_string(layers) + " " + joined(args);
  auto found = runs.find(key);
  if (found == runs.end()) {
    std::vector<std::string> argv = {course_binary("00_single_gpu"), "--quiet"};
    found = runs.emplace(key, train(concat(argv, concat(model_flags(layers), args)), 0, layers)).first;
  }
  return found->second;
}

// A chapter's command line on `ranks` processes under the backend's own launcher.
std::vector<std::string> parallel_command(const std::string& program, const std::string& backend, int ranks,
                                          int layers, const std::vector<std::string>& args) {
  std::vector<std::string> argv =
      backend == "mpi" ? course_test::mpirun_command(ranks) : course_test::launcher_command(ranks);
  argv = concat(argv, {course_binary(program), "--quiet", "--backend", backend, "--comm-timeout", "60"});
  return concat(argv, concat(model_flags(layers), args));
}

Run train_parallel(const std::string& program, const std::string& backend, int ranks, int layers,
                   const std::vector<std::string>& args) {
  return train(parallel_command(program, backend, ranks, layers, args), ranks, layers);
}

void check_bit_identical(const Run& run, const Run& reference) {
  for (size_t i = 0; i < run.log.steps.size(); i++) {
    INFO("step " << i + 1);
    CHECK(run.log.steps[i].at("loss") == reference.log.steps[i].at("loss"));
  }
  size_t differing = 0;
  for (size_t i = 0; i < run.params.size(); i++) differing += run.params[i] != reference.params[i];
  CHECK(differing == 0);
}

void check_equivalent(const Run& run, const Run& reference) {
  course_test::check_losses_and_parameters(run.log, run.params, reference.log, reference.params);
}

// Chapter 04 or 05 against chapter 00: bit-identical with the same micro-batches
// (without clipping, whose norm is summed across ranks in another order), and
// within the bounds against the whole batch at once.
void check_against_chapter_00(const Run& run, int layers, int batch, int micro_batches, bool clip) {
  std::vector<std::string> flags = {"--batch", std::to_string(batch)};
  if (clip) flags = concat(flags, {"--grad-clip", "0.5"});
  if (!clip) {
    INFO("against chapter 00 with --micro-batches " << micro_batches);
    check_bit_identical(run, train_single(layers, concat(flags, {"--micro-batches", std::to_string(micro_batches)})));
  }
  INFO("against chapter 00 on the whole batch");
  check_equivalent(run, train_single(layers, flags));
}

// ----------------------------------------------------------------------------
// formulas

// Bytes rank r sends per step: B T C floats per micro-batch for each of its stages
// that has a next stage (activations) and each that has a previous one (gradients).
double pipeline_bytes_per_rank(int rank, int ranks, int chunks, int batch, const course::GPTConfig& config) {
  const int stages = ranks * chunks;
  double per_step = 0.0;
  for (int c = 0; c < chunks; c++) {
    const int stage = c * ranks + rank;
    per_step += (stage < stages - 1) + (stage > 0);
  }
  return per_step * batch * config.seq_len * config.d_model * 4.0;
}

}  // namespace

// ----------------------------------------------------------------------------
// chapter 04

TEST_CASE("naive model parallelism on 1 to 4 ranks computes chapter 00's training (tcp and mpi)", "[equivalence]") {
  const int ranks = GENERATE(1, 2, 3, 4);
  const std::string backend = GENERATE(as<std::string>(), "tcp", "mpi");
  INFO(ranks << " rank(s), " << backend);
  const Run run = train_parallel("04_naive_model_parallel", backend, ranks, 4, {"--batch", "8"});
  check_against_chapter_00(run, 4, 8, 1, false);
  // each rank sends its activations forward and its gradients back, and idles while the others compute
  for (int r = 0; r < ranks; r++) {
    INFO("rank " << r);
    CHECK(number(run.log.summary, "rank" + std::to_string(r) + "_sent_per_step") ==
          pipeline_bytes_per_rank(r, ranks, 1, 8, pipeline_config(4)));
  }
}

TEST_CASE("naive model parallelism with gradient accumulation and clipping", "[equivalence]") {
  check_against_chapter_00(
      train_parallel("04_naive_model_parallel", "tcp", 2, 4, {"--batch", "8", "--micro-batches", "4"}), 4, 8, 4,
      false);
  check_against_chapter_00(train_parallel("04_naive_model_parallel", "tcp", 3, 4,
                                          {"--batch", "8", "--micro-batches", "2", "--grad-clip", "0.5"}),
                           4, 8, 2, true);
}

TEST_CASE("with --trace, chapter 04's forward, backward, send and receive spans per rank (waits: idle time)",
          "[equivalence]") {
  TempDir dir;
  const std::string trace = course_test::run_traced(
      parallel_command("04_naive_model_parallel", "tcp", 2, 4, {"--micro-batches", "2"}), 2, dir, kTimeoutSeconds);
  course_test::check_chapter_trace(trace, 2,
                                   {{"forward", 0}, {"backward", 0}, {"optimizer step", 0},
                                    {"send activation", 1, 0}, {"recv gradient", 1, 0},
                                    {"recv activation", 1, 1}, {"send gradient", 1, 1}});
}

// ----------------------------------------------------------------------------
// chapter 05

TEST_CASE("with --trace, chapter 05's schedule, every action of every micro-batch", "[equivalence]") {
  TempDir dir;
  const std::string trace = course_test::run_traced(
      parallel_command("05_pipeline", "tcp", 2, 4, {"--micro-batches", "2"}), 2, dir, kTimeoutSeconds);
  course_test::check_chapter_trace(trace, 2,
                                   {{"F0", 0}, {"F1", 0}, {"B0", 0}, {"B1", 0},
                                    {"send activation 1", 1, 0}, {"recv gradient 1", 1, 0},
                                    {"recv activation 1", 1, 1}, {"send gradient 1", 1, 1}});
  // a receive lasts as long as the rank waited: rank 1's first one waits for rank 0's
  // whole first forward, so the longest is longer than nothing
  double longest_wait = 0.0;
  for (const course_test::Json& span : course_test::events_of_phase(course_test::read_json(trace), "X")) {
    if (span.at("pid").number == 1 && span.at("name").text.rfind("recv activation", 0) == 0) {
      longest_wait = std::max(longest_wait, span.at("dur").number);
    }
  }
  CHECK(longest_wait > 0.0);
}

TEST_CASE("every pipeline schedule at 2 and 4 ranks computes chapter 00's training", "[equivalence]") {
  const std::string schedule = GENERATE(as<std::string>(), "gpipe", "1f1b", "zb-h1");
  const int ranks = GENERATE(2, 4);
  // M = 1, N, 2N, and one M that N does not divide (with a batch it divides)
  const int micro_batches = GENERATE_COPY(values({1, ranks, 2 * ranks, ranks + 1}));
  const int batch = micro_batches == ranks + 1 ? 2 * micro_batches : 8;
  INFO(schedule << ", " << ranks << " ranks, " << micro_batches << " micro-batches, batch " << batch);
  const Run run = train_parallel("05_pipeline", "tcp", ranks, 4,
                                 {"--schedule", schedule, "--batch", std::to_string(batch), "--micro-batches",
                                  std::to_string(micro_batches)});
  check_against_chapter_00(run, 4, batch, micro_batches, false);
  for (int r = 0; r < ranks; r++) {
    INFO("rank " << r);
    CHECK(number(run.log.summary, "rank" + std::to_string(r) + "_sent_per_step") ==
          pipeline_bytes_per_rank(r, ranks, 1, batch, pipeline_config(4)));
  }
}

TEST_CASE("the interleaved schedule (2 chunks per rank) computes chapter 00's training", "[equivalence]") {
  const int ranks = GENERATE(2, 4);
  const int micro_batches = GENERATE_COPY(values({ranks, 2 * ranks}));
  const int layers = 2 * ranks;  // one block per chunk
  INFO(ranks << " ranks, " << micro_batches << " micro-batches");
  const Run run = train_parallel("05_pipeline", "tcp", ranks, layers,
                                 {"--schedule", "interleaved", "--batch", "8", "--micro-batches",
                                  std::to_string(micro_batches)});
  check_against_chapter_00(run, layers, 8, micro_batches, false);
  for (int r = 0; r < ranks; r++) {
    INFO("rank " << r);
    CHECK(number(run.log.summary, "rank" + std::to_string(r) + "_sent_per_step") ==
          pipeline_bytes_per_rank(r, ranks, 2, 8, pipeline_config(layers)));
  }
}

TEST_CASE("pipelines with clipping, and on mpi, compute chapter 00's training", "[equivalence]") {
  SECTION("clipping, every schedule") {
    const std::string schedule = GENERATE(as<std::string>(), "gpipe", "1f1b", "zb-h1", "interleaved");
    INFO(schedule);
    const Run run = train_parallel("05_pipeline", "tcp", 2, 4,
                                   {"--schedule", schedule, "--batch", "8", "--micro-batches", "4", "--grad-clip",
                                    "0.5"});
    check_against_chapter_00(run, 4, 8, 4, true);
  }
  SECTION("mpi") {
    const std::string schedule = GENERATE(as<std::string>(), "1f1b", "zb-h1", "interleaved");
    INFO(schedule);
    const Run run = train_parallel("05_pipeline", "mpi", 2, 4,
                                   {"--schedule", schedule, "--batch", "8", "--micro-batches", "4"});
    check_against_chapter_00(run, 4, 8, 4, false);
  }
}

TEST_CASE("each rank's activation memory is what its schedule keeps: GPipe M micro-batches, 1F1B N - r, zb-h1 N",
          "[equivalence]") {
  const int ranks = 2, micro_batches = 8, micro_batch = 1;
  const course::GPTConfig config = pipeline_config(4);
  const std::vector<course::StageRange> cut = course::split_stages(config, ranks);
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"}) {
    INFO(schedule);
    const Run run = train_parallel("05_pipeline", "tcp", ranks, 4,
                                   {"--schedule", schedule, "--batch", "8", "--micro-batches", "8"});
    for (int r = 0; r < ranks; r++) {
      const int live = schedule == std::string("gpipe") ? micro_batches
                       : schedule == std::string("1f1b") ? ranks - r
                                                          : ranks;
      const double slot_bytes = 4.0 * course::PartActivations::floats(config, cut[r], micro_batch);
      INFO("rank " << r << ": " << live << " micro-batches of " << slot_bytes << " bytes");
      CHECK(number(run.log.summary, "rank" + std::to_string(r) + "_peak_activations") == live * slot_bytes);
      CHECK(number(run.log.summary, "rank" + std::to_string(r) + "_live_micro_batches") == live);
    }
  }
}

TEST_CASE("interleaved: each chunk's pool holds the most micro-batches that chunk keeps at once", "[equivalence]") {
  const int ranks = 2, chunks = 2, micro_batches = 4, micro_batch = 2;
  const course::GPTConfig config = pipeline_config(4);
  const course::Schedule schedule =
      course::make_schedule(course::ScheduleKind::Interleaved, ranks, micro_batches, chunks);
  const std::vector<course::StageRange> cut = course::split_stages(config, schedule.stages());
  const Run run = train_parallel("05_pipeline", "tcp", ranks, 4,
                                 {"--schedule", "interleaved", "--batch", "8", "--micro-batches", "4"});
  for (int r = 0; r < ranks; r++) {
    double expected = 0.0;
    for (int c = 0; c < chunks; c++) {
      expected += course::peak_live_slots(schedule, r, c) * 4.0 *
                  course::PartActivations::floats(config, cut[schedule.stage(r, c)], micro_batch);
    }
    INFO("rank " << r);
    CHECK(number(run.log.summary, "rank" + std::to_string(r) + "_peak_activations") == expected);
  }
}

TEST_CASE("a pipeline resumed from its checkpoints continues bit-identically", "[equivalence]") {
  TempDir dir;
  const std::string checkpoints = dir.file("checkpoints");
  std::vector<std::string> argv = concat(course_test::launcher_command(2),
                                         {course_binary("05_pipeline"), "--quiet", "--schedule", "zb-h1",
                                          "--batch", "8", "--micro-batches", "4", "--checkpoint-dir", checkpoints});
  argv = concat(argv, model_flags(4));
  const auto run_to = [&](int steps, const std::string& log, bool resume) {
    std::vector<std::string> args = concat(argv, {"--steps", std::to_string(steps), "--log", dir.file(log)});
    if (resume) args.push_back("--resume");
    const ProcessResult result = run_process(args, kTimeoutSeconds);
    INFO(result.describe() << "\n" << result.out << result.err);
    REQUIRE(result.exit_code == 0);
    return read_log(dir.file(log));
  };
  run_to(10, "first.jsonl", false);
  const RunLog resumed = run_to(20, "second.jsonl", true);
  const RunLog straight = train_parallel("05_pipeline", "tcp", 2, 4,
                                         {"--schedule", "zb-h1", "--batch", "8", "--micro-batches", "4"})
                              .log;
  REQUIRE(resumed.steps.size() == 10);
  for (size_t i = 0; i < resumed.steps.size(); i++) CHECK(resumed.steps[i].at("loss") == straight.steps[10 + i].at("loss"));

  // another cut of the same model (interleaved: two chunks per rank) reshards it on
  // load (its losses: tests/test_consolidate.cpp)
  std::vector<std::string> other = concat(course_test::launcher_command(2),
                                          {course_binary("05_pipeline"), "--schedule", "interleaved",
                                           "--batch", "8", "--micro-batches", "4", "--checkpoint-dir", checkpoints,
                                           "--steps", "22", "--resume"});
  const ProcessResult resharded = run_process(concat(other, model_flags(4)), kTimeoutSeconds);
  INFO(resharded.describe() << "\n" << resharded.out << resharded.err);
  CHECK(resharded.exit_code == 0);
  CHECK_THAT(resharded.out, Catch::Contains("[rank 0]   saved as: model parts at 2 ranks (model stages: rank 0 0-2; "
                                            "rank 1 3-5)\n[rank 0]   this run: model parts at 2 ranks (model stages: "
                                            "rank 0 0-1, 3; rank 1 2, 4-5)"));
}

TEST_CASE("when a pipeline rank dies mid-step, the others fail naming the peer instead of hanging", "[equivalence]") {
  // started without the launcher, which would stop the survivors itself
  int port = 0;
  course::listen_on("127.0.0.1", 0, &port);
  TempDir dir;
  std::vector<ProcessResult> results(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; rank++) {
    ranks.emplace_back([&, rank] {
      std::vector<std::string> argv = {"env", "RANK=" + std::to_string(rank), "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                                       "MASTER_PORT=" + std::to_string(port), course_binary("05_pipeline"),
                                       "--backend", "tcp", "--comm-timeout", "10", "--steps", "100000",
                                       // a distinct flag value marks the rank this test kills
                                       "--log", dir.file("rank" + std::to_string(rank) + "-victim.jsonl")};
      results[rank] = run_process(concat(argv, model_flags(4)), 120);
    });
  }
  // once rank 0 has logged a step, the pipeline is running: kill rank 1
  const auto logged = [&] {
    std::error_code ignored;
    return std::filesystem::file_size(dir.file("rank0-victim.jsonl"), ignored) > 0 && !ignored;
  };
  for (int i = 0; i < 300 && !logged(); i++) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::system(("pkill -KILL -f " + dir.file("rank1-victim.jsonl")).c_str());
  for (std::thread& rank : ranks) rank.join();
  INFO("rank 0: " << results[0].describe() << "\n" << results[0].err);
  REQUIRE_FALSE(results[0].timed_out);
  CHECK(results[1].signal == SIGKILL);
  CHECK(results[0].exit_code == 1);
  // rank 0 notices in a channel to rank 1 (a two-rank Comm: "rank 1 (world rank 0) recv:
  // ... from rank 0 (world rank 1)") or in a collective over the world
  CHECK_THAT(results[0].err, Catch::StartsWith("05_pipeline: error: rank "));
  CHECK_THAT(results[0].err, Catch::Contains("world rank 0") || Catch::StartsWith("05_pipeline: error: rank 0 "));
}

TEST_CASE("bad pipeline input exits 2 with one message", "[equivalence][cli]") {
  struct Case {
    std::vector<std::string> args;
    int ranks;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--layers", "2"}, 4, "cannot cut 2 blocks into 4 pipeline parts"},
      {{"--schedule", "pipedream"}, 2, "--schedule must be one of"},
      {{"--batch", "8", "--micro-batches", "3"}, 2,
       "(--batch 8 over 1 data-parallel rank(s)) does not divide into --micro-batches 3"},
      {{"--schedule", "interleaved", "--layers", "6"}, 2, "does not cut into 2 ranks x 2 chunks"},
      {{"--schedule", "interleaved", "--batch", "6", "--micro-batches", "3"}, 2, "not a multiple of --pp 2"},
      {{"--pp", "3"}, 2, "--pp 3 needs 3 ranks"},
  };
  for (const Case& bad : cases) {
    std::vector<std::string> argv =
        concat(course_test::launcher_command(bad.ranks), {course_binary("05_pipeline"), "--steps", "2"});
    const ProcessResult result = run_process(concat(argv, bad.args), kTimeoutSeconds);
    INFO(joined(bad.args) << "\n" << result.describe() << "\n" << result.err);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.err, Catch::Contains(bad.says));
    CHECK(course_test::error_lines(result.err) == 1);
  }
  const ProcessResult too_many = run_process(
      concat(course_test::launcher_command(3), {course_binary("04_naive_model_parallel"), "--layers", "2"}),
      kTimeoutSeconds);
  CHECK(too_many.exit_code == 2);
  CHECK_THAT(too_many.err, Catch::Contains("cannot cut 2 blocks into 3 pipeline parts"));
}
