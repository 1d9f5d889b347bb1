// Activation recomputation (--recompute selective|full, common/model/model.h): backward runs
// again what forward did not keep, with the same ops in the same order, so every
// step's loss is bit-identical to keeping everything, in chapter 00 and in the
// chapters built on its block functions (02, 03, 05); and each rank's activation
// memory is exactly the formula of chapter 00's README:
//
//   none:      L x block
//   selective: L x (block - B NH T^2) + B NH T^2   (one attention matrix, shared)
//   full:      L x B T C + block                   (one whole block, shared)
//
// with block = 16 B T C + 4 B T + B NH T^2 floats (dense blocks), plus the embedding's
// output B T C and the head's B T C + 2 B T + 2 B T V + B T in every mode. Under
// --dtype bf16 the linear layers' saved inputs (model.h's LinearInput: ln1, ln2 and
// fch_gelu, 6 B T C of a block, and the head's lnf) take half: block = 13 B T C + ...,
// and the head's lnf B T C / 2; and every loss, parameter and gradient is bit for bit
// what storing them in fp32 gives.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "common/model/adamw.h"
#include "common/train/cli.h"
#include "common/tensor/memory.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "support/equivalence_model.h"
#include "support/gpu.h"
#include "support/process.h"
#include "support/random.h"
#include "support/runs.h"

using namespace course;
using course_test::concat;
using course_test::course_binary;
using course_test::number;
using course_test::RunLog;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 120;
const int kSteps = 3;
const std::vector<std::string> kModes = {"none", "selective", "full"};

GPTConfig with_mode(GPTConfig config, const std::string& mode) {
  config.recompute = parse_recompute(mode);
  return config;
}

// Activations floats of a dense GPT of micro-batch B under config.recompute and
// config.linear_inputs, spelled out (B T C even: a bf16 tensor takes exactly half)
size_t formula_floats(const GPTConfig& config, size_t B) {
  const size_t T = config.seq_len, C = config.d_model, L = config.n_layer, V = config.vocab_size,
               NH = config.n_head, BT = B * T;
  const bool bf16 = config.linear_inputs == DType::BF16;
  const size_t scores = B * NH * T * T, block = (bf16 ? 13 : 16) * BT * C + 4 * BT + scores;
  const size_t blocks = config.recompute == Recompute::Full        ? L * BT * C + block
                        : config.recompute == Recompute::Selective ? L * (block - scores) + scores
                                                                   : L * block;
  const size_t lnf = bf16 ? BT * C / 2 : BT * C;
  return BT * C + blocks + (lnf + 2 * BT + 2 * BT * V + BT);
}

GPTConfig with_bf16_inputs(GPTConfig config) {
  config.linear_inputs = DType::BF16;
  return config;
}

size_t current_activations() {
  return memory_totals(Device::CPU).current[static_cast<int>(MemCategory::Activations)];
}

// In-process training: `steps` steps of 2 micro-batches on fixed random tokens; every
// step's loss and the final parameters and gradients
struct Trained {
  std::vector<float> losses, params, grads;
};
Trained train_in_process(const GPTConfig& config, int B, int steps) {
  GPT model(config, B, 7);
  AdamW optimizer(AdamWConfig{}, model.params.size());
  StepLoss step_loss(2, Device::CPU);
  const size_t BT = static_cast<size_t>(B) * config.seq_len;
  Trained trained;
  for (int step = 1; step <= steps; step++) {
    model.zero_grad();
    for (int micro = 0; micro < 2; micro++) {
      const std::vector<int> tokens = course_test::random_ints(step, BT, 2 * micro, config.vocab_size);
      const std::vector<int> targets = course_test::random_ints(step, BT, 2 * micro + 1, config.vocab_size);
      model.forward(tokens.data(), targets.data(), step_loss);
      model.backward(1.0f / (2.0f * static_cast<float>(BT)));
    }
    trained.losses.push_back(step_loss.read());
    if (step < steps) optimizer.update(model.params.data(), model.grads.data(), step);
  }
  trained.params.assign(model.params.data(), model.params.data() + model.params.size());
  trained.grads.assign(model.grads.data(), model.grads.data() + model.grads.size());
  return trained;
}

void check_bit_identical(const Trained& run, const Trained& reference) {
  CHECK(run.losses == reference.losses);
  CHECK(run.params == reference.params);
  CHECK(run.grads == reference.grads);
}

// `program` with the equivalence model at `ranks` ranks (1: alone) for kSteps steps
RunLog train(const std::string& program, int ranks, const std::vector<std::string>& flags) {
  std::vector<std::string> argv = ranks > 1 ? course_test::launcher_command(ranks) : std::vector<std::string>{};
  argv = concat(argv, {course_binary(program), "--quiet"});
  if (ranks > 1) argv = concat(argv, {"--comm-timeout", "60"});
  TempDir dir;
  return course_test::run_to_completion(concat(argv, concat(course_test::kModel, flags)), dir, kSteps,
                                        kTimeoutSeconds)
      .log;
}

void check_same_losses(const RunLog& run, const RunLog& reference) {
  for (int s = 0; s < kSteps; s++) {
    INFO("step " << s + 1);
    CHECK(run.steps[s].at("loss") == reference.steps[s].at("loss"));
  }
}

// Chapter 00 on the same global batch, once
const RunLog& chapter_00(const std::vector<std::string>& batch_flags) {
  static std::map<std::vector<std::string>, RunLog> runs;
  if (runs.count(batch_flags) == 0) runs[batch_flags] = train("00_single_gpu", 1, batch_flags);
  return runs[batch_flags];
}

// Every mode of a data-parallel chapter (micro-batch b per rank): losses bit-identical to
// --recompute none's, within the equivalence bound of chapter 00's, and the activations
// of rank 0 the formula
void check_data_parallel(const std::string& program, const std::vector<std::string>& flags, int b) {
  const std::vector<std::string> batch = {"--batch", "4"};
  const RunLog none = train(program, 2, concat(batch, flags));
  for (const std::string& mode : kModes) {
    INFO(program << " --recompute " << mode);
    const RunLog run = mode == "none" ? none : train(program, 2, concat(batch, concat(flags, {"--recompute", mode})));
    check_same_losses(run, none);
    for (int s = 0; s < kSteps; s++) {
      const double loss = number(run.steps[s], "loss"), expected = number(chapter_00(batch).steps[s], "loss");
      CHECK(std::fabs(loss - expected) <= course_test::kLossTolerance * std::fabs(expected));
    }
    const GPTConfig config = with_mode(course_test::model_config(), mode);
    CHECK(number(run.summary, "peak_activations") == 4.0 * formula_floats(config, b));
  }
}

}  // namespace

TEST_CASE("a GPT keeps exactly the formula's activations under each --recompute, at fp32 and bf16", "[recompute]") {
  for (const std::string& mode : kModes) {
    for (const std::string dtype : {"fp32", "bf16"}) {
      INFO("--recompute " << mode << " --dtype " << dtype);
      GPTConfig config = with_mode(course_test::model_config(), mode);
      if (dtype == "bf16") config = with_bf16_inputs(config);
      const size_t B = 2, before = current_activations();
      GPT model(config, static_cast<int>(B), 1);
      CHECK(current_activations() - before == 4 * formula_floats(config, B));
      // the flags' check counts the same bytes before anything exists (cli.h)
      TrainOptions options;
      options.model = config;
      options.dtype = dtype;
      options.batch = static_cast<int>(B);
      CHECK(requested_bytes(options).activation_bytes == static_cast<double>(4 * formula_floats(config, B)));
    }
  }
  // at this shape: selective saves the L - 1 attention matrices, full all but one block
  const GPTConfig none = course_test::model_config();
  CHECK(formula_floats(with_mode(none, "selective"), 2) < formula_floats(none, 2));
  CHECK(formula_floats(with_mode(none, "full"), 2) < formula_floats(with_mode(none, "selective"), 2));
}

TEST_CASE("recomputation gives bit for bit the losses, parameters and gradients of keeping everything",
          "[recompute]") {
  GPTConfig config = course_test::model_config();
  config.n_layer = 3;
  const Trained reference = train_in_process(config, 2, 3);
  for (const std::string mode : {"selective", "full"}) {
    INFO("--recompute " << mode);
    check_bit_identical(train_in_process(with_mode(config, mode), 2, 3), reference);
  }
  // mixture-of-experts blocks: full recomputation routes the tokens again, to the same experts
  config.n_experts = 4;
  const Trained moe_reference = train_in_process(config, 2, 3);
  for (const std::string mode : {"selective", "full"}) {
    INFO("--experts 4 --recompute " << mode);
    check_bit_identical(train_in_process(with_mode(config, mode), 2, 3), moe_reference);
  }
}

TEST_CASE("at bf16, the linear layers' inputs stored in bf16 give bit for bit the run that stores them in fp32",
          "[recompute]") {
  const course_test::MatmulPrecisionScope bf16(MatmulPrecision::BF16);
  GPTConfig config = course_test::model_config();
  config.n_layer = 3;
  // (test_bf16's case on the ops covers the large GEMMs, which take oneDNN's f32 matmul where it has AVX-512)
  for (const int experts : {0, 4}) {
    config.n_experts = experts;
    for (const std::string& mode : kModes) {
      INFO("--experts " << experts << " --recompute " << mode);
      const GPTConfig fp32_inputs = with_mode(config, mode);
      check_bit_identical(train_in_process(with_bf16_inputs(fp32_inputs), 4, 3), train_in_process(fp32_inputs, 4, 3));
    }
  }
}

TEST_CASE("chapter 00: --recompute changes no loss, and the activations are the formula", "[recompute]") {
  const std::vector<std::string> batch = {"--batch", "4", "--micro-batches", "2"};
  const RunLog none = train("00_single_gpu", 1, batch);
  for (const std::string mode : {"selective", "full"}) {
    INFO("--recompute " << mode);
    const RunLog run = train("00_single_gpu", 1, concat(batch, {"--recompute", mode}));
    check_same_losses(run, none);
    CHECK(run.summary.at("recompute") == mode);
    CHECK(number(run.summary, "peak_activations") ==
          4.0 * formula_floats(with_mode(course_test::model_config(), mode), 2));
  }
}

TEST_CASE("chapter 02 at 2 ranks: --recompute changes no loss, and the activations are the formula",
          "[recompute]") {
  check_data_parallel("02_ddp", {}, 2);
}

TEST_CASE("chapter 03 ZeRO-3 at 2 ranks: --recompute changes no loss, and the activations are the formula",
          "[recompute]") {
  check_data_parallel("03_fsdp", {"--zero-stage", "3"}, 2);
}

TEST_CASE("chapter 05 at 2 ranks, 1F1B and zb-h1: --recompute changes no loss, and the activations are the formula",
          "[recompute]") {
  const int ranks = 2, micro_batch = 1;
  const std::vector<std::string> batch = {"--batch", "4", "--micro-batches", "4"};
  const std::vector<StageRange> cut = split_stages(course_test::model_config(), ranks);
  for (const std::string schedule : {"1f1b", "zb-h1"}) {
    const std::vector<std::string> flags = concat(batch, {"--schedule", schedule});
    const RunLog none = train("05_pipeline", ranks, flags);
    // the same micro-batches as chapter 00's: bit-identical to it (tests/test_pipeline.cpp)
    check_same_losses(none, chapter_00(batch));
    for (const std::string mode : {"selective", "full"}) {
      if (schedule == "zb-h1" && mode == "full") continue;  // refused, below
      INFO("--schedule " << schedule << " --recompute " << mode);
      const RunLog run = train("05_pipeline", ranks, concat(flags, {"--recompute", mode}));
      check_same_losses(run, none);
      const GPTConfig config = with_mode(course_test::model_config(), mode);
      for (int r = 0; r < ranks; r++) {
        // 1F1B keeps N - r micro-batches on rank r, zb-h1 N; the recompute buffer once
        const int live = schedule == "1f1b" ? ranks - r : ranks;
        const double expected = 4.0 * (live * PartActivations::floats(config, cut[r], micro_batch) +
                                       RecomputeWorkspace::floats(config, micro_batch));
        const std::string rank = "rank" + std::to_string(r);
        INFO(rank);
        CHECK(number(run.summary, rank + "_peak_activations") == expected);
        CHECK(number(run.summary, rank + "_predicted_activations") == expected);
      }
    }
  }
}

TEST_CASE("recomputation is refused where it cannot run", "[recompute]") {
  course_test::check_refusals(
      course_binary("05_pipeline"), course_test::kModel,
      {{{"--batch", "4", "--micro-batches", "4", "--schedule", "zb-h1", "--recompute", "full"}, 2,
        "--schedule zb-h1 defers each block's weight gradients"}},
      kTimeoutSeconds);
  course_test::check_refusals(course_binary("08_context_parallel"), course_test::kModel,
                              {{{"--batch", "2", "--recompute", "selective"}, 2,
                                "chapter 08 does not recompute activations"}},
                              kTimeoutSeconds);
  course_test::check_refusals(course_binary("09_expert_parallel"), course_test::kModel,
                              {{{"--batch", "2", "--experts", "2", "--recompute", "full"}, 2,
                                "chapter 09 does not recompute activations"}},
                              kTimeoutSeconds);
}
