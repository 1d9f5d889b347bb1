// --dtype bf16 through whole runs: every GEMM's inputs rounded to bf16, products summed
// in fp32 (gemm_cpu.h), the weights, gradients and AdamW in fp32.
//
// 1. Chapter 00 at bf16 follows chapter 00 at fp32. bf16 rounds each product's inputs
//    to about 3 digits, so the two trajectories part slowly; measured on the default
//    model (200 steps, seed 1337): within 0.7% of each other through step 100, at most
//    2.2% (step 196) after, and the mean loss of the last 20 steps within 0.12%.
//    Neither is biased: the fp32 forward of weights trained at bf16 gives bf16's loss
//    to 5 digits, and bf16 ends lower as often as higher. The bounds: 2% through step
//    100, 5% after, 1% on the last 20 steps' mean.
// 2. Every parallel chapter at bf16 computes chapter 00's bf16 training: the rounding
//    is per element, so a layout changes the order of the fp32 sums, as at fp32, and a
//    pipeline's stage boundary rounds the activation and its gradient to bf16 once more
//    (3. below). Per-step loss within 1e-2 relative over 20 steps (chapter 09: 10 steps,
//    before a routing choice may flip, as its fp32 test says). Measured: at most 9.2e-4
//    (09, whose experts' outputs come back rounded), 1.8e-4 (06's bf16 sums), 1.3e-4
//    (07), 4.2e-5 (04, 05), 2.6e-5 (08).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/tensor/gemm_cpu.h"
#include "support/equivalence_model.h"
#include "support/process.h"
#include "support/runs.h"

using course_test::concat;
using course_test::course_binary;
using course_test::joined;
using course_test::number;
using course_test::RunLog;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 240;

RunLog train(const std::vector<std::string>& argv, int steps) {
  TempDir dir;
  return course_test::run_to_completion(argv, dir, steps, kTimeoutSeconds).log;
}

RunLog single(const std::vector<std::string>& flags, int steps) {
  return train(concat({course_binary("00_single_gpu"), "--quiet"}, flags), steps);
}

double relative(double value, double reference) { return std::fabs(value - reference) / std::fabs(reference); }

}  // namespace

TEST_CASE("chapter 00 at bf16 follows chapter 00 at fp32 over 200 steps", "[equivalence]") {
  const int steps = 200;
  const std::vector<std::string> flags = {"--steps", std::to_string(steps)};  // the default model
  const RunLog fp32 = single(flags, steps);
  const RunLog bf16 = single(concat(flags, {"--dtype", "bf16"}), steps);
  REQUIRE(bf16.steps.size() == static_cast<size_t>(steps));
  CHECK(bf16.summary.at("matmul_precision") == "bf16");
  CHECK(fp32.summary.at("matmul_precision") == "fp32");
  double early = 0.0, late = 0.0, fp32_tail = 0.0, bf16_tail = 0.0;
  for (int i = 20; i < steps; i++) {
    const double difference = relative(number(bf16.steps[i], "loss"), number(fp32.steps[i], "loss"));
    (i < 100 ? early : late) = std::max(i < 100 ? early : late, difference);
    if (i >= steps - 20) {
      fp32_tail += number(fp32.steps[i], "loss") / 20;
      bf16_tail += number(bf16.steps[i], "loss") / 20;
    }
  }
  INFO("steps 21-100 within " << early << ", steps 101-200 within " << late << ", last 20 steps' means "
                              << bf16_tail << " (bf16) and " << fp32_tail << " (fp32)");
  CHECK(early <= 0.02);
  CHECK(late <= 0.05);
  CHECK(relative(bf16_tail, fp32_tail) <= 0.01);
  // bf16 rounds: it is not fp32 under another name
  CHECK(number(bf16.steps[1], "loss") != number(fp32.steps[1], "loss"));
}

// What --dtype bf16 stores, by category, against fp32 (the default model, B 8, T 128,
// C 128, V 256, L 4): the same parameters, gradients and optimizer state (fp32); the
// activations less 2 bytes for each value of the linear layers' saved inputs, stored in
// bf16 (model.h's LinearInput: ln1, ln2 and fch_gelu, 6 B T C a block, and lnf, B T C);
// and in workspace the rounded copies of a GEMM's two inputs, kept at the largest of
// each. On the fp32-copy path (4 bytes a value, gemm_cpu.h): A's, dL/dlogits or dL/dfch,
// (B T) x max(V, 4C); B's, the MLP's activation, (B T) x 4C (fch_gelu, widened from
// bf16). On oneDNN's bf16 matmul (2 bytes a value), which reads the stored inputs as they
// are: A's the same; B's the largest fp32 one, atty (B T) x C or a weight, 4C x C or V x C.
TEST_CASE("chapter 00 at bf16 stores fp32's categories but the linear inputs, and in workspace two GEMM inputs",
          "[equivalence]") {
  const int steps = 3;
  const RunLog fp32 = single({"--steps", std::to_string(steps)}, steps);
  const RunLog bf16 = single({"--steps", std::to_string(steps), "--dtype", "bf16"}, steps);
  for (const char* category : {"peak_parameters", "peak_gradients", "peak_optimizer_state", "peak_comm_buffers"}) {
    INFO(category);
    CHECK(number(bf16.summary, category) == number(fp32.summary, category));
  }
  const double BT = 8.0 * 128, C = 128, V = 256, L = 4;
  CHECK(number(bf16.summary, "peak_activations") == number(fp32.summary, "peak_activations") - 2 * (L * 6 + 1) * BT * C);
  const double copies = course::cpu::onednn_bf16_available()
                            ? 2 * (BT * std::max(V, 4 * C) + std::max({BT * C, 4 * C * C, V * C}))
                            : 4 * (BT * std::max(V, 4 * C) + BT * 4 * C);
  CHECK(number(bf16.summary, "peak_workspace") == number(fp32.summary, "peak_workspace") + copies);
}

TEST_CASE("every parallel chapter at bf16 computes chapter 00's bf16 training", "[equivalence]") {
  struct Layout {
    std::string program;
    int ranks;
    std::vector<std::string> flags;   // the chapter's own
    std::vector<std::string> shared;  // its model, batch and micro-batches, which chapter 00 runs too
    int steps;
  };
  const std::vector<std::string> dense = concat(course_test::kModel, {"--batch", "8"});
  const std::vector<std::string> piped = concat(course_test::kModel, {"--batch", "8", "--micro-batches", "4"});
  const std::vector<std::string> four_heads = concat(course_test::kModel, {"--heads", "4", "--batch", "4"});
  const std::vector<std::string> experts = concat(course_test::kModel, {"--batch", "4", "--experts", "4"});
  const std::vector<Layout> layouts = {
      {"02_ddp", 2, {"--grad-comm-dtype", "bf16"}, dense, 20},
      {"03_fsdp", 2, {"--zero-stage", "1"}, dense, 20},
      {"03_fsdp", 2, {"--zero-stage", "2"}, dense, 20},
      {"03_fsdp", 2, {"--zero-stage", "3"}, dense, 20},
      {"04_naive_model_parallel", 2, {}, dense, 20},
      {"05_pipeline", 2, {"--schedule", "1f1b"}, piped, 20},
      {"05_pipeline", 2, {"--schedule", "zb-h1"}, piped, 20},
      {"06_tensor_parallel", 2, {}, dense, 20},
      {"06_tensor_parallel", 2, {"--sp"}, dense, 20},
      {"07_3d", 8, {"--dp", "2", "--pp", "2", "--tp", "2"}, piped, 20},
      {"08_context_parallel", 2, {"--cp-mode", "ring"}, four_heads, 20},
      {"08_context_parallel", 2, {"--cp-mode", "a2a"}, four_heads, 20},
      {"09_expert_parallel", 2, {}, experts, 10},
  };
  const size_t index = GENERATE(range(0, 13));
  REQUIRE(index < layouts.size());
  const Layout& layout = layouts[index];
  const std::vector<std::string> run_flags = concat(layout.shared, {"--dtype", "bf16", "--steps",
                                                                    std::to_string(layout.steps)});
  std::vector<std::string> argv = concat(course_test::launcher_command(layout.ranks),
                                         {course_binary(layout.program), "--quiet", "--comm-timeout", "60"});
  argv = concat(concat(argv, run_flags), layout.flags);
  INFO(joined(argv));
  const RunLog run = train(argv, layout.steps);
  const RunLog reference = single(run_flags, layout.steps);
  REQUIRE(run.steps.size() == reference.steps.size());
  CHECK(run.summary.at("matmul_precision") == "bf16");
  double worst = 0.0;
  for (size_t i = 0; i < run.steps.size(); i++) {
    worst = std::max(worst, relative(number(run.steps[i], "loss"), number(reference.steps[i], "loss")));
  }
  INFO(layout.program << " " << joined(layout.flags) << ": max relative loss difference " << worst);
  CHECK(worst <= 1e-2);
}

// 3. Under --dtype bf16 activations and their gradients cross ranks as bf16: rounded
//    by the sender, widened by the receiver, 2 bytes a value. A pipeline's stage
//    boundary (04, 05, 07's pp axis) and context parallelism's blocks (08, ring and
//    all-to-all) send exactly half of fp32's bytes; expert parallelism's rows (09)
//    send what its formula says at 2 bytes a value (its routing, and so its counts,
//    differ between the two runs); tensor parallelism's f and g (06) about half, the
//    cross-entropy's statistics staying fp32 (test_3d.cpp holds every rank's tp bytes
//    to the planner's at bf16 exactly).
TEST_CASE("under --dtype bf16 activations cross ranks as bf16: half the bytes of fp32", "[equivalence]") {
  struct Layout {
    std::string program;
    int ranks;
    std::vector<std::string> flags;
    std::string bytes_field;  // the summary's bytes on the axis the activations cross
    enum Check { Half, AboutHalf, Formula } check;
  };
  const std::vector<std::string> piped = concat(course_test::kModel, {"--batch", "8", "--micro-batches", "4"});
  const std::vector<std::string> dense = concat(course_test::kModel, {"--batch", "8"});
  const std::vector<std::string> four_heads = concat(course_test::kModel, {"--heads", "4", "--batch", "4"});
  const std::vector<Layout> layouts = {
      {"04_naive_model_parallel", 2, dense, "bytes_sent_per_step", Layout::Half},
      {"05_pipeline", 2, concat(piped, {"--schedule", "1f1b"}), "bytes_sent_per_step", Layout::Half},
      {"05_pipeline", 2, concat(piped, {"--schedule", "zb-h1"}), "bytes_sent_per_step", Layout::Half},
      {"07_3d", 4, concat(piped, {"--dp", "1", "--pp", "2", "--tp", "2"}), "pp_bytes_sent_per_step", Layout::Half},
      {"08_context_parallel", 2, concat(four_heads, {"--cp-mode", "ring"}), "cp_bytes_sent_per_step", Layout::Half},
      {"08_context_parallel", 2, concat(four_heads, {"--cp-mode", "a2a"}), "cp_bytes_sent_per_step", Layout::Half},
      {"06_tensor_parallel", 2, dense, "bytes_sent_per_step", Layout::AboutHalf},
      {"06_tensor_parallel", 2, concat(dense, {"--sp"}), "bytes_sent_per_step", Layout::AboutHalf},
      {"09_expert_parallel", 2, concat(course_test::kModel, {"--batch", "4", "--experts", "4"}),
       "rank0_ep_sent_per_step", Layout::Formula},
  };
  for (const Layout& layout : layouts) {
    std::vector<std::string> argv = concat(course_test::launcher_command(layout.ranks),
                                           {course_binary(layout.program), "--quiet", "--comm-timeout", "60",
                                            "--steps", "3"});
    argv = concat(argv, layout.flags);
    INFO(joined(argv));
    const RunLog fp32 = train(argv, 3);
    const RunLog bf16 = train(concat(argv, {"--dtype", "bf16"}), 3);
    const double fp32_bytes = number(fp32.summary, layout.bytes_field);
    const double bf16_bytes = number(bf16.summary, layout.bytes_field);
    CHECK(fp32_bytes > 0);
    switch (layout.check) {
      case Layout::Half:
        CHECK(bf16_bytes == fp32_bytes / 2);
        break;
      case Layout::AboutHalf:
        CHECK(bf16_bytes > 0.45 * fp32_bytes);
        CHECK(bf16_bytes < 0.55 * fp32_bytes);
        break;
      case Layout::Formula:  // rank 0's, from its routed counts, at each run's bytes a value
        CHECK(bf16_bytes == number(bf16.summary, "rank0_ep_formula_per_step"));
        CHECK(fp32_bytes == number(fp32.summary, "rank0_ep_formula_per_step"));
        CHECK(bf16_bytes < 0.6 * fp32_bytes);
        break;
    }
    if (layout.program == "08_context_parallel") {
      CHECK(bf16_bytes == number(bf16.summary, "cp_bytes_formula_per_step"));
    }
  }
}
