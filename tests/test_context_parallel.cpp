// Chapter 08 end to end: context parallelism on N ranks computes what chapter 00
// computes on the whole batch; each rank sends the formula's bytes and keeps the
// formula's activations; bad input is refused; a checkpoint resumes at any cp.
// Every run is the real 08_context_parallel binary, started by the course launcher
// (tcp) or by mpirun (mpi), compared against the real 00_single_gpu.
//
// Bounds: tests/test_ddp.cpp's (support/runs.h). Splitting a sequence changes the
// order of additions in three places: the softmax's sums (the ring merges per-block
// partial sums with the online-softmax rule; all-to-all attention sums in chapter
// 00's order), the parameter gradients (summed per rank over its tokens, then
// averaged over ranks) and the loss (per-rank means, averaged).
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "common/train/checkpoint.h"
#include "common/model/model.h"
#include "support/equivalence_model.h"
#include "support/process.h"
#include "support/runs.h"

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

// 4 heads (a2a divides them over 1, 2 and 4 ranks), seq 32 (zigzag at cp 4: 8 chunks of 4)
course::GPTConfig cp_config() {
  course::GPTConfig config = course_test::model_config();
  config.n_head = 4;
  return config;
}
const std::vector<std::string> kModelFlags = course_test::model_flags(cp_config());
const int kBatch = 4;

struct Run {
  RunLog log;
  std::vector<float> params;  // the last step's checkpoint: chapter 00's flat order
  std::string out;
};

Run train(std::vector<std::string> argv) {
  TempDir dir;
  const course_test::CompletedRun completed = course_test::run_to_completion(argv, dir, kSteps, kTimeoutSeconds);
  course::CheckpointReader reader(course::checkpoint_path(completed.checkpoint_dir, kSteps));
  std::vector<float> params(course::count_parameters(cp_config()));
  reader.read_section("params", params.data(), params.size());
  return {completed.log, params, completed.out};
}

std::vector<std::string> cp_command(const std::string& backend, int ranks, const std::vector<std::string>& args) {
  std::vector<std::string> argv =
      backend == "mpi" ? course_test::mpirun_command(ranks) : course_test::launcher_command(ranks);
  argv.insert(argv.end(), {course_binary("08_context_parallel"), "--quiet", "--backend", backend, "--comm-timeout",
                           "60", "--batch", std::to_string(kBatch)});
  return concat(concat(argv, kModelFlags), args);
}

const Run& train_single(const std::vector<std::string>& args) {
  static Run run = train(concat(concat({course_binary("00_single_gpu"), "--quiet", "--batch", std::to_string(kBatch)},
                                       kModelFlags),
                                args));
  return run;
}

// ----------------------------------------------------------------------------
// the formulas the chapter README states

// Bytes one rank sends to its cp group per step: per layer and micro-batch of B
// sequences, a K/V block is 2 B Tl C floats (Tl = T/N); the ring sends it N-1 times
// in forward, and in backward N-1 times again plus its dK/dV N times (the gradients
// come home); all-to-all sends (N-1)/N of q, k, v and the output forward, and of
// their gradients backward.
double cp_bytes_per_step(const std::string& mode, int N, int B, int micro_batches) {
  const course::GPTConfig config = cp_config();
  if (N == 1) return 0.0;
  const double Tl = config.seq_len / N, C = config.d_model, block = 2.0 * B * Tl * C;
  const double per_layer = mode == "ring" ? block * (N - 1) + block * (N - 1) + block * N
                                          : 2.0 * (N - 1) / N * B * Tl * 4 * C;
  return 4.0 * per_layer * config.n_layer * micro_batches;
}

// Activations one rank keeps per micro-batch of B sequences, in bytes: chapter 00's
// per-token buffers for its Tl = T/N tokens (embedding output; per block 16 C + 4
// floats per token; the head's C + 2 + 2 V + 1), and what attention saves: the ring
// a log-sum-exp per head and token, all-to-all its heads' q, k, v at every position
// and their (T, T) softmax. Chapter 00 saves B NH T^2 for attention.
double cp_activation_bytes(const std::string& mode, int N, int B) {
  const course::GPTConfig config = cp_config();
  const double T = config.seq_len, Tl = T / N, C = config.d_model, V = config.vocab_size, NH = config.n_head;
  const double attention_saved = mode == "ring" ? B * NH * Tl : B * T * 3 * C / N + B * (NH / N) * T * T;
  const double block = B * Tl * (16 * C + 4) + attention_saved;
  const double head = B * Tl * (C + 2 + 2 * V + 1);
  return 4.0 * (B * Tl * C + config.n_layer * block + head);
}

}  // namespace

// ----------------------------------------------------------------------------
// equivalence with chapter 00

TEST_CASE("context parallelism at cp 1, 2 and 4, ring (contiguous, zigzag) and a2a, and dp 2 x cp 2 computes chapter 00's training",
          "[equivalence]") {
  struct Layout {
    std::string backend;
    int ranks;
    std::vector<std::string> args;
  };
  const std::vector<Layout> layouts = {
      {"tcp", 1, {"--cp", "1"}},
      {"tcp", 2, {"--cp-split", "contiguous"}},
      {"tcp", 2, {"--cp-split", "zigzag"}},
      {"tcp", 4, {"--cp-split", "zigzag"}},
      {"tcp", 4, {"--cp-split", "contiguous", "--micro-batches", "2"}},
      {"tcp", 2, {"--cp-mode", "a2a"}},
      {"tcp", 4, {"--cp-mode", "a2a", "--cp-split", "contiguous"}},
      {"tcp", 4, {"--dp", "2", "--cp", "2"}},
      {"mpi", 2, {"--cp-split", "zigzag"}},
      {"mpi", 4, {"--cp-mode", "a2a"}},
  };
  const size_t index = GENERATE(range(0, 10));
  REQUIRE(index < layouts.size());
  const Layout& layout = layouts[index];
  INFO(layout.backend << ", " << layout.ranks << " ranks, " << joined(layout.args));
  const Run run = train(cp_command(layout.backend, layout.ranks, layout.args));
  const Run& single = train_single({});
  course_test::check_losses_and_parameters(run.log, run.params, single.log, single.params);
}

TEST_CASE("each rank sends the formula's bytes to its cp group, and keeps the formula's activations",
          "[equivalence]") {
  struct Layout {
    std::string mode;
    int cp;
    int micro_batches;
  };
  for (const Layout& layout : std::vector<Layout>{{"ring", 2, 1}, {"ring", 4, 2}, {"a2a", 2, 1}, {"a2a", 4, 1}}) {
    INFO(layout.mode << " at cp " << layout.cp << ", " << layout.micro_batches << " micro-batch(es)");
    const Run run = train(cp_command("tcp", layout.cp,
                                     {"--cp-mode", layout.mode, "--micro-batches", std::to_string(layout.micro_batches)}));
    const int B = kBatch / layout.micro_batches;
    CHECK(number(run.log.summary, "cp_bytes_sent_per_step") ==
          cp_bytes_per_step(layout.mode, layout.cp, B, layout.micro_batches));
    CHECK(number(run.log.summary, "cp_bytes_formula_per_step") ==
          cp_bytes_per_step(layout.mode, layout.cp, B, layout.micro_batches));
    CHECK(number(run.log.summary, "peak_activations") == cp_activation_bytes(layout.mode, layout.cp, B));
  }
}

TEST_CASE("bad context-parallel input exits 2 with one message", "[equivalence][cli]") {
  course_test::check_refusals(
      course_binary("08_context_parallel"), kModelFlags,
      {{{"--seq", "36"}, 4, "--seq 36 does not split into 8 equal chunks (zigzag at --cp 4 needs 2 x cp"},
       {{"--seq", "30", "--cp-split", "contiguous"}, 4, "--seq 30 does not split into 4 equal chunks"},
       {{"--cp-mode", "a2a", "--seq", "24"}, 3, "--cp-mode a2a needs the heads divisible by --cp: 4 heads over 3"},
       {{"--dp", "2", "--cp", "2"}, 2, "--dp 2 x --cp 2 is not this run's 2 ranks"},
       {{"--cp", "3"}, 2, "--cp 3 does not divide this run's 2 ranks (hint: launch with --nproc-per-node 3, or a"},
       {{"--cp-split", "spiral"}, 2, "--cp-split"}},
      kTimeoutSeconds);
}

TEST_CASE("the hint for a --cp that does not divide the ranks is a run that works", "[equivalence][cli]") {
  course_test::check_refusals(course_binary("08_context_parallel"), kModelFlags,
                              {{{"--cp", "3", "--seq", "24"}, 2, "(hint: launch with --nproc-per-node 3, or a"}},
                              kTimeoutSeconds);
  course_test::run_ok(cp_command("tcp", 3, {"--cp", "3", "--seq", "24", "--steps", "1"}), kTimeoutSeconds);
}

TEST_CASE("a context-parallel checkpoint resumes bit-identically, and at another cp", "[equivalence]") {
  TempDir dir;
  const auto run_to = [&](int ranks, int steps, const std::string& name, bool resume) {
    std::vector<std::string> args =
        cp_command("tcp", ranks, {"--steps", std::to_string(steps), "--log", dir.file(name + ".jsonl"),
                                  "--checkpoint-dir", dir.file(name.substr(0, 1))});
    if (resume) args.push_back("--resume");
    const ProcessResult result = run_process(args, kTimeoutSeconds);
    INFO(joined(args) << "\n" << result.describe() << "\n" << result.out << result.err);
    REQUIRE(result.exit_code == 0);
    return read_log(dir.file(name + ".jsonl"));
  };
  const RunLog straight = train(cp_command("tcp", 2, {})).log;
  run_to(2, 10, "a_first", false);
  const RunLog resumed = run_to(2, 20, "a_second", true);
  REQUIRE(resumed.steps.size() == 10);
  for (size_t i = 0; i < resumed.steps.size(); i++) {
    CHECK(resumed.steps[i].at("loss") == straight.steps[10 + i].at("loss"));
  }
  // the checkpoint is chapter 00's replicated format: any cp reads it
  run_to(2, 10, "b_first", false);
  const RunLog at_cp4 = run_to(4, 20, "b_at_cp4", true);
  course_test::check_losses_close(at_cp4, straight, 11);
}
