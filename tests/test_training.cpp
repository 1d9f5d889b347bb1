// Chapter 00 end to end: the trainer learns, a resumed run is bit-identical to an
// uninterrupted one, a damaged or mismatched checkpoint is refused, and gradient
// accumulation does not change the result; the same for a mixture of experts. Each test runs the real 00_single_gpu
// binary and reads the JSON lines it writes with --log. Then what stops a run with exit 1: a gradient norm that
// is not finite (00, and 02 at 2 ranks), and an output that cannot be written (the log, a trace, a checkpoint,
// chapter 05's timeline), with nothing of the step or the file left half done.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/train/checkpoint.h"
#include "common/train/metrics.h"
#include "support/process.h"
#include "support/runs.h"
#include "support/trace_json.h"

namespace fs = std::filesystem;
using course_test::ProcessResult;
using course_test::run_process;
using course_test::concat;
using course_test::read_log;
using course_test::RunLog;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 120;

// Small enough that ten steps take milliseconds; the tests below compare runs,
// they do not need a good model.
const std::vector<std::string> kSmallModel = {"--layers", "1", "--d-model", "32", "--heads", "2",
                                              "--seq",    "32", "--batch",   "4"};
// the same with MoE blocks: 4 experts, top-2, and a capacity that drops some choices
const std::vector<std::string> kSmallMoeModel = concat(kSmallModel, {"--experts", "4", "--top-k", "2",
                                                                     "--capacity-factor", "1.0"});

ProcessResult run_trainer(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {course_test::course_binary("00_single_gpu"), "--quiet"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, kTimeoutSeconds);
}

// Runs the trainer, requires it to succeed, and returns what it logged.
RunLog train(const std::string& log_path, std::vector<std::string> args) {
  args.insert(args.end(), {"--log", log_path});
  const ProcessResult result = run_trainer(args);
  INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  REQUIRE(result.exit_code == 0);
  return read_log(log_path);
}

// Trains the small model (or `model`) for 5 steps with a checkpoint at the end, and
// returns the checkpoint directory, as the starting point for the resume tests.
std::string checkpointed_run(const TempDir& dir, const std::vector<std::string>& model = kSmallModel) {
  const std::string checkpoint_dir = dir.file("checkpoints");
  fs::create_directory(checkpoint_dir);
  train(dir.file("first_half.jsonl"),
        concat(model, {"--steps", "5", "--checkpoint-dir", checkpoint_dir, "--checkpoint-every", "5"}));
  REQUIRE(course::latest_checkpoint(checkpoint_dir) == course::checkpoint_path(checkpoint_dir, 5));
  return checkpoint_dir;
}

// Trains `model` for 10 steps straight, and for 5 then 5 more resumed from the
// checkpoint in a new process (all it has is what the checkpoint holds): the
// second half's step lines must equal the straight run's `fields`.
void check_resume_is_bit_identical(const std::vector<std::string>& model, const std::vector<std::string>& fields) {
  TempDir dir;
  const RunLog straight = train(dir.file("straight.jsonl"), concat(model, {"--steps", "10"}));
  REQUIRE(straight.steps.size() == 10);

  const std::string checkpoint_dir = checkpointed_run(dir, model);
  const RunLog resumed =
      train(dir.file("resumed.jsonl"), concat(model, {"--steps", "10", "--resume", "--checkpoint-dir", checkpoint_dir}));

  // Losses are logged with %.9g, which round-trips a float, so equal text means
  // equal bits. Step numbers are checked too: a run that silently started over
  // from step 1 would also reproduce these losses.
  REQUIRE(resumed.steps.size() == 5);
  for (size_t i = 0; i < resumed.steps.size(); i++) {
    const auto& expected = straight.steps[5 + i];
    INFO("step " << expected.at("step"));
    CHECK(resumed.steps[i].at("step") == expected.at("step"));
    for (const std::string& field : fields) CHECK(resumed.steps[i].at(field) == expected.at(field));
  }
  CHECK(resumed.summary.at("final_loss") == straight.summary.at("final_loss"));
}

}  // namespace

TEST_CASE("chapter 00 learns: the loss falls far below where it starts", "[training]") {
  TempDir dir;
  const RunLog log = train(dir.file("log.jsonl"), {"--layers", "2", "--d-model", "64", "--heads", "4", "--seq", "64",
                                                   "--batch", "8", "--steps", "200", "--lr", "3e-3"});
  REQUIRE(log.steps.size() == 200);

  // small initial weights give near-uniform predictions over 256 bytes: loss ln(256)
  const double uniform_loss = std::log(256.0);
  const double first_loss = std::stod(log.steps.front().at("loss"));
  CHECK(first_loss == Approx(uniform_loss).margin(0.1));

  double last_ten = 0.0;
  for (size_t i = log.steps.size() - 10; i < log.steps.size(); i++) last_ten += std::stod(log.steps[i].at("loss"));
  last_ten /= 10;
  INFO("first loss " << first_loss << ", mean of the last 10 " << last_ten);
  CHECK(last_ten < 0.6 * first_loss);
  CHECK(last_ten < uniform_loss);

  CHECK(log.summary.at("final_step") == "200");
  CHECK(log.summary.at("final_loss") == log.steps.back().at("loss"));
}

TEST_CASE("a run resumed from a checkpoint continues bit-identically to one that never stopped", "[training]") {
  check_resume_is_bit_identical(kSmallModel, {"loss"});
}

TEST_CASE("chapter 00 trains a mixture of experts: the loss falls, the step lines carry the routers' figures",
          "[training]") {
  TempDir dir;
  const RunLog log = train(dir.file("log.jsonl"), concat(kSmallMoeModel, {"--steps", "30", "--lr", "3e-3"}));
  REQUIRE(log.steps.size() == 30);
  const double first_loss = std::stod(log.steps.front().at("loss")), last_loss = std::stod(log.steps.back().at("loss"));
  INFO("first loss " << first_loss << ", last " << last_loss);
  CHECK(first_loss == Approx(std::log(256.0)).margin(0.1));
  CHECK(last_loss < 0.75 * first_loss);
  for (const auto& step : log.steps) {
    // the aux loss is 1 when the routers balance perfectly, E = 4 when every choice goes to one expert
    CHECK(std::stod(step.at("aux_loss")) >= 0.99);
    CHECK(std::stod(step.at("aux_loss")) < 2.0);
    CHECK(std::stod(step.at("dropped_fraction")) < 0.5);
    // every token of the step chose k experts in every layer: the per-expert counts add up to that
    int64_t choices = 0;
    for (int e = 0; e < 4; e++) choices += std::stoll(step.at("expert_choices_" + std::to_string(e)));
    CHECK(choices == std::stoll(log.summary.at("global_batch")) * std::stoll(log.summary.at("seq_len")) *
                         std::stoll(log.summary.at("layers")) * 2);
    CHECK(step.count("expert_choices_4") == 0);
  }
  // capacity factor 1 with routers that are never perfectly balanced: some choices dropped
  CHECK(std::stod(log.summary.at("dropped_fraction")) > 0.0);
  CHECK(log.summary.at("experts") == "4");
  CHECK(log.summary.at("top_k") == "2");
}

TEST_CASE("a mixture of experts resumed from a checkpoint continues bit-identically, drops included", "[training]") {
  check_resume_is_bit_identical(kSmallMoeModel, {"loss", "aux_loss", "dropped"});
}

TEST_CASE("a dense checkpoint does not load into a mixture of experts, nor the reverse, nor another E or k",
          "[training]") {
  const auto refused = [](const std::vector<std::string>& saved, const std::vector<std::string>& resumed,
                          const std::string& expected) {
    TempDir dir;
    const std::string checkpoint_dir = checkpointed_run(dir, saved);
    const ProcessResult result =
        run_trainer(concat(resumed, {"--steps", "10", "--resume", "--checkpoint-dir", checkpoint_dir}));
    INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
    REQUIRE_FALSE(result.timed_out);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.err, Catch::Contains(expected));
  };
  refused(kSmallModel, kSmallMoeModel, "written with dense blocks (no --experts), this run has --experts 4");
  refused(kSmallMoeModel, kSmallModel, "written with --experts 4, this run has dense blocks (no --experts)");
  refused(kSmallMoeModel, concat(kSmallMoeModel, {"--experts", "8"}), "written with --experts 4, this run has --experts 8");
  refused(kSmallMoeModel, concat(kSmallMoeModel, {"--top-k", "1"}), "written with --top-k 2, this run has --top-k 1");
}


TEST_CASE("resuming from a corrupt checkpoint fails, says so, and leaves the file as it was", "[training]") {
  TempDir dir;
  const std::string checkpoint_dir = checkpointed_run(dir);
  const std::string checkpoint = course::checkpoint_path(checkpoint_dir, 5);
  std::string bytes = course_test::read_file(checkpoint);
  bytes[bytes.size() / 2] ^= 0x20;
  course_test::write_file(checkpoint, bytes);

  const ProcessResult result =
      run_trainer(concat(kSmallModel, {"--steps", "10", "--resume", "--checkpoint-dir", checkpoint_dir}));
  INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 1);
  CHECK_THAT(result.err, Catch::StartsWith("00_single_gpu: error: ") && Catch::Contains("corrupt"));
  // the damaged file is the evidence: nothing may overwrite it or train past it
  CHECK(course_test::read_file(checkpoint) == bytes);
  CHECK(course::latest_checkpoint(checkpoint_dir) == checkpoint);
}

TEST_CASE("resuming when the newest checkpoint is a directory fails with one line naming it", "[training]") {
  TempDir dir;
  const std::string checkpoint_dir = checkpointed_run(dir);
  const std::string in_the_way = course::checkpoint_path(checkpoint_dir, 6);
  fs::create_directory(in_the_way);

  const ProcessResult result =
      run_trainer(concat(kSmallModel, {"--steps", "10", "--resume", "--checkpoint-dir", checkpoint_dir}));
  INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 1);
  CHECK(result.err == "00_single_gpu: error: checkpoint '" + in_the_way +
                          "' is a directory, not a checkpoint file (hint: move it out of the checkpoint directory)\n");
}

TEST_CASE("resuming with a different model shape is refused, naming the flag that differs", "[training]") {
  TempDir dir;
  const std::string checkpoint_dir = checkpointed_run(dir);
  std::vector<std::string> args = concat(kSmallModel, {"--steps", "10", "--resume", "--checkpoint-dir", checkpoint_dir});
  args.insert(args.end(), {"--d-model", "64"});  // the later flag wins over kSmallModel's 32

  const ProcessResult result = run_trainer(args);
  INFO("result: " << result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 2);  // the reader's mistake, like a bad flag
  CHECK_THAT(result.err, Catch::Contains("--d-model 32, this run has --d-model 64"));
}

TEST_CASE("resuming from an empty checkpoint directory starts from step 1", "[training]") {
  TempDir dir;
  const std::string checkpoint_dir = dir.file("checkpoints");
  fs::create_directory(checkpoint_dir);
  const RunLog log = train(dir.file("log.jsonl"),
                           concat(kSmallModel, {"--steps", "2", "--resume", "--checkpoint-dir", checkpoint_dir}));
  REQUIRE(log.steps.size() == 2);
  CHECK(log.steps.front().at("step") == "1");
  CHECK(course::latest_checkpoint(checkpoint_dir) == course::checkpoint_path(checkpoint_dir, 2));
}

TEST_CASE("gradient accumulation over micro-batches gives the gradients and losses of the whole batch at once",
          "[training]") {
  // The same global batch of 4 sequences, as one batch or as 2 micro-batches of 2:
  // the gradients are the same sums, only added in a different order, so they
  // agree to float rounding. The losses alone would not show a wrong scale (AdamW
  // divides each gradient by its own RMS, so 2x the gradient is nearly the same
  // step): the gradient itself is compared, through the checkpoint after step 1,
  // where AdamW's first moment is exactly 0.1 x the gradient and the second
  // 0.05 x its square.
  TempDir dir;
  auto run = [&](const std::string& name, const std::string& micro_batches, const std::string& steps) {
    const std::vector<std::string> args = {"--steps", steps, "--micro-batches", micro_batches, "--checkpoint-dir",
                                           dir.file(name)};
    return train(dir.file(name + ".jsonl"), concat(kSmallModel, args));
  };
  const RunLog whole = run("whole", "1", "10");
  const RunLog split = run("split", "2", "10");
  REQUIRE(whole.steps.size() == 10);
  REQUIRE(split.steps.size() == 10);
  for (size_t i = 0; i < whole.steps.size(); i++) {
    INFO("step " << whole.steps[i].at("step"));
    CHECK(std::stod(split.steps[i].at("loss")) == Approx(std::stod(whole.steps[i].at("loss"))).epsilon(1e-5));
  }

  run("whole_step1", "1", "1");
  run("split_step1", "2", "1");
  course::GPTConfig config;
  config.n_layer = 1;
  config.d_model = 32;
  config.n_head = 2;
  config.seq_len = 32;
  const size_t count = course::count_parameters(config);
  for (const std::string section : {"adam_m", "adam_v"}) {
    std::vector<float> a(count), b(count);
    course::CheckpointReader(course::checkpoint_path(dir.file("whole_step1"), 1)).read_section(section, a.data(), count);
    course::CheckpointReader(course::checkpoint_path(dir.file("split_step1"), 1)).read_section(section, b.data(), count);
    double largest = 0.0, worst = 0.0;
    for (size_t i = 0; i < count; i++) {
      largest = std::max(largest, std::fabs(static_cast<double>(a[i])));
      worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
    }
    INFO(section << " after step 1: max |difference| " << worst << " of a largest |value| " << largest);
    CHECK(largest > 0.0);
    CHECK(worst <= 1e-5 * largest);
  }
}

TEST_CASE("with --trace, one file holds each micro-batch's forward and backward and each optimizer step",
          "[training]") {
  TempDir dir;
  const std::vector<std::string> argv =
      concat({course_test::course_binary("00_single_gpu"), "--quiet", "--micro-batches", "2"}, kSmallModel);
  const std::string trace = course_test::run_traced(argv, 1, dir, kTimeoutSeconds);
  course_test::check_chapter_trace(trace, 1, {{"forward", 0}, {"backward", 0}, {"optimizer step", 0}});
}

TEST_CASE("a checkpoint directory that does not exist yet is created before training starts", "[training]") {
  TempDir dir;
  const std::string checkpoint_dir = dir.file("new/nested/checkpoints");
  train(dir.file("log.jsonl"), concat(kSmallModel, {"--steps", "2", "--checkpoint-dir", checkpoint_dir}));
  CHECK(course::latest_checkpoint(checkpoint_dir) == course::checkpoint_path(checkpoint_dir, 2));
}

TEST_CASE("resuming a run that already reached --steps is refused instead of silently doing nothing",
          "[training]") {
  TempDir dir;
  const std::string checkpoint_dir = dir.file("checkpoints");
  train(dir.file("first.jsonl"), concat(kSmallModel, {"--steps", "4", "--checkpoint-dir", checkpoint_dir}));
  const ProcessResult result =
      run_trainer(concat(kSmallModel, {"--steps", "3", "--resume", "--checkpoint-dir", checkpoint_dir}));
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 2);
  CHECK_THAT(result.err, Catch::Contains("already at step 4 of --steps 3"));
}

TEST_CASE("a run on a busy machine says that its times are not reliable, and a quiet one says nothing",
          "[training]") {
  // COURSE_TEST_FAULT=busy_cores=X stands in for what other processes took: far more than any machine's cores, then 0
  for (const std::string others : {"1000", "0"}) {
    INFO("other processes' cores " << others);
    TempDir dir;
    const std::vector<std::string> argv = {"env", "COURSE_TEST_FAULT=busy_cores=" + others,
                                           course_test::course_binary("00_single_gpu"), "--layers", "1",
                                           "--d-model", "16", "--heads", "2", "--seq", "16", "--batch", "2",
                                           "--steps", "2", "--log", dir.file("log.jsonl")};
    const ProcessResult result = run_process(argv, 60);
    REQUIRE(result.exit_code == 0);
    const RunLog log = read_log(dir.file("log.jsonl"));
    const bool busy = others == "1000";
    CHECK(std::stoi(log.summary.at("machine_busy")) == (busy ? 1 : 0));
    CHECK(std::stod(log.summary.at("other_processes_cores")) == std::stod(others));
    CHECK(std::stoi(log.summary.at("job_cores")) == 1);
    CHECK(std::stoi(log.summary.at("cores")) >= 1);
    const bool said = result.out.find("note: the machine was busy (other processes kept 1000.0 of its ") !=
                      std::string::npos;
    CHECK(said == busy);
  }
}

TEST_CASE("a misspelled test fault is refused with one line naming the switch, before any step", "[training]") {
  TempDir dir;
  const ProcessResult result =
      run_process({"env", "COURSE_TEST_FAULT=die_at_stp=2", course_test::course_binary("00_single_gpu"), "--layers",
                   "1", "--d-model", "16", "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "2"},
                  60);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 2);
  CHECK_THAT(result.err, Catch::Contains("COURSE_TEST_FAULT='die_at_stp=2'") && Catch::Contains("die_at_step=S"));
  CHECK_THAT(result.out, !Catch::Contains("step "));
}

// ---- a gradient norm that is not finite, and outputs that cannot be written ----------

namespace {

// The small model with a block for each of chapter 05's 2 ranks and a micro-batch for each.
const std::vector<std::string> kTwoRankModel = {"--layers", "2", "--d-model", "32", "--heads", "2", "--seq",
                                                "32", "--batch", "4", "--micro-batches", "2"};

// `program` (a binary's name) with `args`: alone for one rank, under the launcher for
// more, after `env` with `variables`.
std::vector<std::string> chapter_command(const std::string& program, int ranks,
                                         const std::vector<std::string>& variables,
                                         const std::vector<std::string>& args) {
  std::vector<std::string> argv = concat({"env"}, variables);
  if (ranks > 1) argv = concat(argv, course_test::launcher_command(ranks));
  return concat(concat(argv, {course_test::course_binary(program), "--quiet"}), args);
}

// argv with no file allowed to grow past 0 bytes (RLIMIT_FSIZE, `ulimit -f 0`): every
// write to a file fails with EFBIG, while creating one and writing to pipes still
// work. SIGXFSZ, which such a write would send, is ignored (an ignored signal stays
// ignored across exec), so the program sees the error instead of being killed by it.
// The ranks' shared-memory rings are files too: the socket transport instead.
std::vector<std::string> with_no_room_in_files(const std::vector<std::string>& argv) {
  return concat({"sh", "-c", "trap '' XFSZ; ulimit -f 0; exec env COURSE_TCP_TRANSPORT=socket \"$@\"", "sh"}, argv);
}

#define REQUIRE_ENDED(result)                                                                             \
  INFO("result: " << (result).describe() << "\nstdout:\n" << (result).out << "\nstderr:\n" << (result).err); \
  REQUIRE_FALSE((result).timed_out)

// The lines of `text` that contain `piece`.
size_t lines_containing(const std::string& text, const std::string& piece) {
  std::istringstream lines(text);
  size_t found = 0;
  for (std::string line; std::getline(lines, line);) found += line.find(piece) != std::string::npos ? 1 : 0;
  return found;
}

}  // namespace

TEST_CASE("a gradient norm that is not finite stops the run with exit 1 at that step, naming it and the rank, "
          "and the step before's checkpoint stays the newest and loads",
          "[training]") {
  // COURSE_TEST_FAULT=inf_gradient_at_step=3 makes step 3's global norm infinite in
  // clip_grads (common/model/adamw.h), where every chapter's clipping ends
  const auto [program, ranks] = GENERATE(std::make_pair(std::string("00_single_gpu"), 1),
                                         std::make_pair(std::string("02_ddp"), 2));
  // clipping off computes the norm all the same, for this check (test_restart: every chapter)
  const std::string clip = GENERATE(as<std::string>{}, "1", "0");
  INFO(program << " at " << ranks << " rank(s), --grad-clip " << clip);
  TempDir dir;
  const std::string checkpoints = dir.file("checkpoints");
  const std::vector<std::string> args =
      concat(kSmallModel, {"--grad-clip", clip, "--checkpoint-dir", checkpoints, "--checkpoint-every", "1"});
  const ProcessResult result = run_process(
      chapter_command(program, ranks, {"COURSE_TEST_FAULT=inf_gradient_at_step=3"}, concat(args, {"--steps", "6"})),
      kTimeoutSeconds);
  REQUIRE_ENDED(result);
  CHECK(result.exit_code == 1);
  const std::string said = program + ": error: the global gradient norm of step 3 is inf on rank 0: training diverged";
  CHECK(lines_containing(result.err, said) == 1);  // said once, by rank 0
  CHECK(lines_containing(result.err, ": error: ") == 1);
  CHECK(course::latest_checkpoint(checkpoints) == course::checkpoint_path(checkpoints, 2));

  const ProcessResult resumed =
      run_process(chapter_command(program, ranks, {}, concat(args, {"--steps", "4", "--resume"})), kTimeoutSeconds);
  REQUIRE_ENDED(resumed);
  CHECK(resumed.exit_code == 0);
  CHECK(lines_containing(resumed.out, "resumed from " + course::checkpoint_path(checkpoints, 2)) == 1);
}

TEST_CASE("an output that cannot be written at the end of the run is exit 1 with one line naming its path, and "
          "leaves no half file",
          "[training]") {
  struct Output {
    std::string program;
    int ranks;
    std::string flag;    // its value: a path in the test's directory
    std::string name;    // the path's last part
    std::string said;    // "<said> '<the file>'" in the error line
  };
  const Output output = GENERATE(Output{"00_single_gpu", 1, "--log", "log.jsonl", "--log: writing"},
                                 Output{"00_single_gpu", 1, "--trace", "t.json", "writing trace"},
                                 Output{"00_single_gpu", 1, "--checkpoint-dir", "checkpoints", "writing checkpoint"},
                                 Output{"05_pipeline", 2, "--timeline", "t.svg", "writing timeline"});
  INFO(output.program << " at " << output.ranks << " rank(s), " << output.flag);
  TempDir dir;
  const std::string path = dir.file(output.name);
  // the checkpoint of the last step, 2, is the one file written to that directory
  const std::string written = output.flag == "--checkpoint-dir" ? course::checkpoint_path(path, 2) : path;
  const ProcessResult result = run_process(
      with_no_room_in_files(chapter_command(output.program, output.ranks, {},
                                            concat(kTwoRankModel, {"--steps", "2", output.flag, path}))),
      kTimeoutSeconds);
  REQUIRE_ENDED(result);
  CHECK(result.exit_code == 1);
  CHECK(lines_containing(result.err, output.program + ": error: " + output.said + " '" + written + "' failed") == 1);
  CHECK(lines_containing(result.err, written) == 1);  // said once, with no warning before it
  CHECK(lines_containing(result.err, "error: ") == 1);
  // nothing but the log (opened at the start) is left: no half-written file, no temporary one
  std::vector<std::string> left;
  for (const auto& entry : fs::recursive_directory_iterator(dir.path())) {
    if (entry.is_regular_file() && entry.path().filename() != "log.jsonl") left.push_back(entry.path().string());
  }
  INFO("left: " << course_test::joined(left));
  CHECK(left.empty());
}

TEST_CASE("a --timeline in a directory that does not exist is refused at the start, not after the run",
          "[training]") {
  TempDir dir;
  const std::string timeline = dir.file("missing/t.svg");
  const ProcessResult result = run_process(
      chapter_command("05_pipeline", 2, {}, concat(kTwoRankModel, {"--steps", "2", "--timeline", timeline})),
      kTimeoutSeconds);
  REQUIRE_ENDED(result);
  CHECK(result.exit_code == 2);
  CHECK(lines_containing(result.err, "--timeline: cannot write '" + timeline + "'") >= 1);
  CHECK(lines_containing(result.out, "---- summary") == 0);  // refused before training
}
