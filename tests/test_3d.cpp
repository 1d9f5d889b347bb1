// Chapter 07 end to end: 3D parallelism against chapter 00, and the planner
// against chapter 07.
//
// - every layout of the list (1x1x1, 2x1x1 with ZeRO-1, 1x2x1, 1x1x2,
//   2x2x1, 1x2x2, 2x1x2, 2x2x2; dp x pp x tp) on tcp, 2x2x2 with its ranks in the
//   other grid order (pp-dp-tp), and 2x2x2 on mpi, with SP,
//   the interleaved and zb-h1 schedules, ZeRO-1 and clipping at 2x2x2: every step's loss and
//   the final parameters (assembled from every rank's checkpoint) equal the real
//   00_single_gpu's within the bounds of tests/test_ddp.cpp (only the order of
//   additions differs: DP averages partial gradients, TP sums partial products);
// - in the same runs the planner (planner/planner.h) predicts every rank's
//   parameters, gradients, optimizer state, activations and bytes sent per step on
//   each axis exactly, and its communication buffers as an upper bound; across
//   nodes, it names the link each grid order puts each axis on;
// - the planner's cp axis against chapter 08's runs (dp x cp, ring and a2a): every
//   rank's memory by category and its cp and dp bytes per step, exactly;
// - bad layouts: one message, exit 2; resume is bit-identical.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "05_pipeline/schedule.h"
#include "06_tensor_parallel/tensor_parallel.h"
#include "planner/planner.h"
#include "common/train/checkpoint.h"
#include "common/train/checkpoint_manifest.h"
#include "common/model/model.h"
#include "07_3d/process_grid.h"
#include "common/train/trace.h"
#include "support/equivalence_model.h"
#include "support/process.h"
#include "support/runs.h"
#include "support/trace_json.h"

using course_test::concat;
using course_test::course_binary;
using course_test::joined;
using course_test::number;
using course_test::ProcessResult;
using course_test::run_process;
using course_test::RunLog;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 240;
const int kSteps = 12;
const int kBatch = 8, kMicroBatches = 4;

// 4 blocks (2 pipeline ranks x 2 interleaved chunks), 4 heads, d-model 32, vocabulary
// 256 and seq 16: 2 divides all of them; the batch of 8 in 4 micro-batches over 2 replicas
course::GPTConfig model_config() {
  course::GPTConfig config;
  config.n_layer = 4;
  config.d_model = 32;
  config.n_head = 4;
  config.seq_len = 16;
  return config;
}

const std::vector<std::string> kModelFlags =
    concat(course_test::model_flags(model_config()), {"--batch", std::to_string(kBatch)});

struct Run {
  RunLog log;
  std::vector<float> params;  // chapter 00's flat order
  std::string out;            // rank 0's lines
};

// Chapter 00's flat parameter buffer from every rank's files, through the step's
// manifest (which says what each file holds): the checkpoint format is checked too.
std::vector<float> assemble_parameters(const std::string& dir) {
  const course::CheckpointManifest manifest = course::read_manifest(course::manifest_path(dir, kSteps));
  const size_t P = course::count_parameters(model_config());
  std::vector<float> params(P, NAN);
  course::load_pieces(manifest, dir, course::pieces_of_flat_range(manifest.params, 0, P), params.data(), nullptr,
                      nullptr);
  for (float value : params) REQUIRE_FALSE(std::isnan(value));  // every element held somewhere
  return params;
}

const Run& train_single(const std::vector<std::string>& args) {
  static std::map<std::string, Run> runs;
  const std::string key = joined(args);
  auto found = runs.find(key);
  if (found == runs.end()) {
    TempDir dir;
    const std::vector<std::string> argv =
        concat({course_binary("00_single_gpu"), "--quiet", "--micro-batches", std::to_string(kMicroBatches)},
               concat(kModelFlags, args));
    const course_test::CompletedRun completed = course_test::run_to_completion(argv, dir, kSteps, kTimeoutSeconds);
    Run run{completed.log, std::vector<float>(course::count_parameters(model_config())), completed.out};
    course::CheckpointReader reader(course::checkpoint_path(completed.checkpoint_dir, kSteps));
    reader.read_section("params", run.params.data(), run.params.size());
    found = runs.emplace(key, run).first;
  }
  return found->second;
}

std::vector<std::string> layout_flags(const course::Layout& layout) {
  std::vector<std::string> flags = {"--dp", std::to_string(layout.dp), "--pp", std::to_string(layout.pp),
                                    "--tp", std::to_string(layout.tp), "--zero-stage",
                                    std::to_string(layout.zero_stage), "--schedule",
                                    course::schedule_name(layout.schedule), "--grid-order",
                                    course::grid_order_name(layout.order)};
  if (layout.sequence_parallel) flags.push_back("--sp");
  if (layout.reshard_after_forward) flags.push_back("--reshard-after-forward");
  return flags;
}

Run train_3d(const std::string& backend, const course::Layout& layout, const std::vector<std::string>& args) {
  const int ranks = layout.dp * layout.pp * layout.tp;
  std::vector<std::string> argv =
      concat(backend == "mpi" ? course_test::mpirun_command(ranks) : course_test::launcher_command(ranks),
             {course_binary("07_3d"), "--quiet", "--backend", backend, "--comm-timeout", "60", "--micro-batches",
              std::to_string(kMicroBatches)});
  argv = concat(argv, concat(kModelFlags, concat(layout_flags(layout), args)));
  TempDir dir;
  const course_test::CompletedRun completed = course_test::run_to_completion(argv, dir, kSteps, kTimeoutSeconds);
  return {completed.log, assemble_parameters(completed.checkpoint_dir), completed.out};
}

// The planner's job for this file's model: `batch` sequences in 4 micro-batches
course::PlanJob planner_job(int batch) {
  course::PlanJob job;
  job.model = model_config();
  job.global_batch = batch;
  job.micro_batches = kMicroBatches;
  return job;
}

// The planner's figures for every rank against what the run's summary logged.
void check_planner(const RunLog& log, const course::Layout& layout,
                   course::Recompute recompute = course::Recompute::None,
                   course::DType grad_comm_dtype = course::DType::F32,
                   course::Precision precision = course::Precision::FP32) {
  course::PlanJob job = planner_job(kBatch);
  job.recompute = recompute;
  job.grad_comm_dtype = grad_comm_dtype;
  job.precision = precision;
  const course::ProcessGrid grid(layout.dp * layout.pp * layout.tp, layout.dp, layout.pp, layout.tp, layout.order);
  for (int rank = 0; rank < grid.world_size(); rank++) {
    const course::RankPlan plan = course::plan_rank(job, layout, grid.coords_of(rank));
    const std::string r = "rank" + std::to_string(rank) + "_";
    INFO(grid.describe(rank));
    CHECK(number(log.summary, r + "peak_parameters") == plan.parameters);
    CHECK(number(log.summary, r + "peak_gradients") == plan.gradients);
    CHECK(number(log.summary, r + "peak_optimizer_state") == plan.optimizer_state);
    CHECK(number(log.summary, r + "peak_activations") == plan.activations);
    CHECK(number(log.summary, r + "peak_comm_buffers") <= plan.comm_buffers);
    CHECK(number(log.summary, r + "tp_sent_per_step") == plan.tp_bytes);
    CHECK(number(log.summary, r + "pp_sent_per_step") == plan.pp_bytes);
    CHECK(number(log.summary, r + "dp_sent_per_step") == plan.dp_bytes);
    // ZeRO-2/3: the whole buffers lent at once, part of the comm buffers
    if (layout.zero_stage >= 2) CHECK(number(log.summary, r + "lent_chunk_buffers") == plan.lent);
  }
}

// 07 at the layout with `args`, against chapter 00 with the same args, and the planner
void check_against_single(const std::string& backend, const course::Layout& layout,
                          const std::vector<std::string>& args) {
  const Run run = train_3d(backend, layout, args);
  const Run& single = train_single(args);
  course_test::check_losses_and_parameters(run.log, run.params, single.log, single.params);
  check_planner(run.log, layout);
}

course::Layout layout_of(int dp, int pp, int tp, int zero_stage = 0, bool sp = false,
                         course::ScheduleKind kind = course::ScheduleKind::OneFOneB) {
  return {dp, pp, tp, zero_stage, kind, kind == course::ScheduleKind::Interleaved ? 2 : 1, sp};
}

// ZeRO-3 gathering each chunk around every forward and backward
course::Layout resharded(course::Layout layout) {
  layout.reshard_after_forward = true;
  return layout;
}

// chapter 08's dp x cp
course::Layout cp_layout(int dp, int cp, course::CPMode mode = course::CPMode::Ring,
                         course::SplitKind split = course::SplitKind::Zigzag) {
  course::Layout layout;
  layout.dp = dp;
  layout.cp = cp;
  layout.cp_mode = mode;
  layout.cp_split = split;
  return layout;
}

// 08_context_parallel at the layout, on this file's model and batch, for a few steps
RunLog train_cp(const std::string& backend, const course::Layout& layout, const std::vector<std::string>& args = {}) {
  const int ranks = layout.dp * layout.cp;
  const std::vector<std::string> argv = concat(
      concat(backend == "mpi" ? course_test::mpirun_command(ranks) : course_test::launcher_command(ranks),
             {course_binary("08_context_parallel"), "--quiet", "--backend", backend, "--comm-timeout", "60",
              "--micro-batches", std::to_string(kMicroBatches), "--dp", std::to_string(layout.dp), "--cp",
              std::to_string(layout.cp), "--cp-mode", course::cp_mode_name(layout.cp_mode), "--cp-split",
              course::split_kind_name(layout.cp_split)}),
      concat(kModelFlags, args));
  TempDir dir;
  return course_test::run_to_completion(argv, dir, 3, kTimeoutSeconds).log;
}

// The planner's figures for a chapter 08 run: every rank holds and sends the same, so
// one plan_rank against each rank's logged peaks and bytes (the summary has rank 0's
// workspace only). At bf16 the workspace also holds the GEMMs' rounding copies, which
// the planner does not count (their size depends on the CPU's bf16 instructions).
void check_cp_planner(const RunLog& log, const course::Layout& layout,
                      course::Precision precision = course::Precision::FP32,
                      course::DType grad_comm_dtype = course::DType::F32) {
  course::PlanJob job = planner_job(kBatch);
  job.precision = precision;
  job.grad_comm_dtype = grad_comm_dtype;
  const course::RankPlan plan = course::plan_rank(job, layout, {0, 0, 0});
  if (precision == course::Precision::FP32) {
    CHECK(number(log.summary, "peak_workspace") == plan.workspace);
  } else {
    CHECK(number(log.summary, "peak_workspace") > plan.workspace);
  }
  for (int rank = 0; rank < layout.dp * layout.cp; rank++) {
    const std::string r = "rank" + std::to_string(rank) + "_";
    INFO("rank " << rank);
    CHECK(number(log.summary, r + "peak_parameters") == plan.parameters);
    CHECK(number(log.summary, r + "peak_gradients") == plan.gradients);
    CHECK(number(log.summary, r + "peak_optimizer_state") == plan.optimizer_state);
    CHECK(number(log.summary, r + "peak_activations") == plan.activations);
    CHECK(number(log.summary, r + "peak_comm_buffers") == plan.comm_buffers);
    CHECK(number(log.summary, r + "cp_sent_per_step") == plan.cp_bytes);
    CHECK(number(log.summary, r + "dp_sent_per_step") == plan.dp_bytes);
    // ZeRO-2/3: the whole buffers lent at once, part of the comm buffers
    if (layout.zero_stage >= 2) CHECK(number(log.summary, r + "lent_chunk_buffers") == plan.lent);
  }
}

}  // namespace

TEST_CASE("every dp x pp x tp layout computes chapter 00's training, and the planner predicts its figures",
          "[equivalence]") {
  const course::Layout layout = GENERATE(layout_of(1, 1, 1), layout_of(2, 1, 1, 1), layout_of(1, 2, 1),
                                         layout_of(1, 1, 2), layout_of(2, 2, 1), layout_of(1, 2, 2),
                                         layout_of(2, 1, 2), layout_of(2, 2, 2));
  INFO("layout " << course::describe(layout) << " on tcp");
  const Run run = train_3d("tcp", layout, {});
  course_test::check_losses_and_parameters(run.log, run.params, train_single({}).log, train_single({}).params);
  check_planner(run.log, layout);
}

TEST_CASE("pp outermost (pp-dp-tp, as Megatron-LM and torchtitan number ranks) computes chapter 00's training",
          "[equivalence]") {
  // the README's 2x2x2 (the orders differ from 2x2x1 on; tp comes along as the
  // innermost axis of both): rank 2 is (dp 1, pp 0, tp 0) here and (dp 0, pp 1, tp 0)
  // in dp-pp-tp, so the planner's per-rank figures tell the orders apart too
  course::Layout layout = layout_of(2, 2, 2);
  layout.order = course::GridOrder::PpDpTp;
  const Run run = train_3d("tcp", layout, {});
  course_test::check_losses_and_parameters(run.log, run.params, train_single({}).log, train_single({}).params);
  check_planner(run.log, layout);
  CHECK_THAT(run.out, Catch::Contains("grid: dp 2 x pp 2 x tp 2, rank = (pp x 2 + dp) x 2 + tp"));
  CHECK_THAT(run.out, Catch::Contains("pipelines: 0,4 | 1,5 | 2,6 | 3,7"));
  CHECK_THAT(run.out, Catch::Contains("dp groups: 0,2 | 1,3 | 4,6 | 5,7"));
}

TEST_CASE("2x2x2 with SP, interleaving, zero bubble, ZeRO-1, clipping, and on mpi", "[equivalence]") {
  SECTION("the distributed optimizer (ZeRO-1) clips by the norm of its shards, interleaved with SP (tcp)") {
    // 0.05 clips every step: each dp rank counts its shard of each chunk, the
    // replicated range on tp 0 only; counted twice or missed, the norm and the losses move
    check_against_single("tcp", layout_of(2, 2, 2, 1, true, course::ScheduleKind::Interleaved),
                         {"--grad-clip", "0.05"});
  }
  SECTION("sequence parallel, interleaved, ZeRO-1 (tcp)") {
    check_against_single("tcp", layout_of(2, 2, 2, 1, true, course::ScheduleKind::Interleaved), {});
  }
  SECTION("zero bubble (zb-h1): tensor-parallel backward in two halves, with and without SP (tcp)") {
    for (const bool sp : {false, true}) {
      const course::Layout layout = layout_of(2, 2, 2, 0, sp, course::ScheduleKind::ZeroBubbleH1);
      INFO(course::describe(layout));
      check_against_single("tcp", layout, {});
    }
  }
  SECTION("clipping, gpipe (tcp)") {
    check_against_single("tcp", layout_of(2, 2, 2, 0, false, course::ScheduleKind::GPipe), {"--grad-clip", "0.5"});
  }
  SECTION("mpi") { check_against_single("mpi", layout_of(2, 2, 2), {}); }
}

TEST_CASE("ZeRO-2 and ZeRO-3 (FSDP) over dp at 2x2x2, with and without SP, compute chapter 00's training, and "
          "the planner predicts their memory and bytes",
          "[equivalence]") {
  struct Case {
    course::Layout layout;
    std::vector<std::string> args;
  };
  const auto interleaved = course::ScheduleKind::Interleaved;
  // clipping: each dp rank counts its shard of the gradients, as ZeRO-1's; interleaved:
  // two chunks gathered at once, or (resharded) a stage and the next at a time; zb-h1
  // resharded: the weight halves read no parameters and gather nothing
  const Case c = GENERATE_COPY(Case{layout_of(2, 2, 2, 2), {}}, Case{layout_of(2, 2, 2, 2, true), {}},
                               Case{layout_of(2, 2, 2, 3), {}},
                               Case{layout_of(2, 2, 2, 3, true, interleaved), {"--grad-clip", "0.05"}},
                               Case{resharded(layout_of(2, 2, 2, 3, false, interleaved)), {}},
                               Case{resharded(layout_of(2, 2, 2, 3, false, course::ScheduleKind::ZeroBubbleH1)), {}});
  INFO(course::describe(c.layout) << " " << joined(c.args));
  check_against_single("tcp", c.layout, c.args);
}

// --grad-comm-dtype bf16 on the dp axis (chapter 02's idea, test_ddp.cpp; chapter 03's,
// test_fsdp.cpp): DDP's buckets, ZeRO-1's and ZeRO-2/3's reduce-scatters move a bf16
// copy of the gradients, half their bytes; ZeRO's parameter all-gathers stay fp32 (at
// --dtype fp32). The planner, told the same, predicts every rank's bytes and memory.
TEST_CASE("bf16 gradients over dp at 2x2x2 send half the gradient bytes, stay within 1e-3 of chapter 00, and "
          "the planner predicts them",
          "[equivalence]") {
  const int zero_stage = GENERATE(0, 1, 2, 3);
  INFO("ZeRO-" << zero_stage);
  const course::Layout layout = layout_of(2, 2, 2, zero_stage, true);
  const Run fp32 = train_3d("tcp", layout, {});
  const Run bf16 = train_3d("tcp", layout, {"--grad-comm-dtype", "bf16"});
  const Run& single = train_single({});
  REQUIRE(bf16.log.steps.size() == single.log.steps.size());
  for (size_t i = 0; i < bf16.log.steps.size(); i++) {
    INFO("step " << i + 1);
    const double loss = number(bf16.log.steps[i], "loss"), expected = number(single.log.steps[i], "loss");
    CHECK(std::fabs(loss - expected) <= 1e-3 * std::fabs(expected));
  }
  // the gradients' bytes halve; ZeRO-1 and 3 also all-gather the parameters, in fp32:
  // their (dp-1)/dp x 4 P_chunk, the same as the reduce-scatter's fp32 bytes
  const double fp32_bytes = number(fp32.log.summary, "dp_bytes_sent_per_step");
  const double bf16_bytes = number(bf16.log.summary, "dp_bytes_sent_per_step");
  const double gradient_share = zero_stage == 0 ? 1.0 : 0.5;  // of fp32's dp bytes
  CHECK(bf16_bytes == Approx(fp32_bytes * (1.0 - gradient_share / 2)).epsilon(1e-12));
  check_planner(bf16.log, layout, course::Recompute::None, course::DType::BF16);
}

// Under --dtype bf16 the activations and their gradients cross tp (f and g) and pp (the
// stage boundary) as bf16, the cross-entropy's statistics staying fp32, and ZeRO's
// parameter all-gathers move bf16 (03's ReplicatedParams and GatheredStage); with
// --grad-comm-dtype bf16 the gradients cross dp as bf16 too. That is every byte
// 07_plan --precision bf16 counts, and it predicts every rank's, exactly, at every ZeRO
// stage (ZeRO-3 resharded: its gathers before every forward and backward). Its memory
// too: this trainer stores fp32 at bf16 but the linear layers' saved inputs (bf16:
// model.h's LinearInput), and ZeRO-1/2 keep their shard's fp32 master values as
// optimizer state (the replicas hold the bf16 values gathered).
TEST_CASE("under --dtype bf16 every rank's memory and tp pp dp bytes at 2x2x2 are the planner's at bf16",
          "[equivalence]") {
  // (2x1x2: no pipeline, whose buffers' bound would hide a miscounted TP message copy)
  const course::Layout layout = GENERATE(layout_of(2, 2, 2, 0), layout_of(2, 2, 2, 1), layout_of(2, 2, 2, 1, true),
                                         layout_of(2, 2, 2, 2), resharded(layout_of(2, 2, 2, 3)),
                                         layout_of(2, 1, 2, 1, true));
  INFO(course::describe(layout));
  const Run run = train_3d("tcp", layout, {"--dtype", "bf16", "--grad-comm-dtype", "bf16"});
  const Run fp32 = train_3d("tcp", layout, {});
  check_planner(run.log, layout, course::Recompute::None, course::DType::BF16, course::Precision::BF16);
  const course::ProcessGrid grid(layout.dp * layout.pp * layout.tp, layout.dp, layout.pp, layout.tp, layout.order);
  for (int rank = 0; rank < grid.world_size(); rank++) {
    const std::string r = "rank" + std::to_string(rank) + "_";
    INFO(grid.describe(rank));
    // the pipeline's and the gradients' bytes are exactly half of fp32's
    CHECK(number(run.log.summary, r + "pp_sent_per_step") * 2 == number(fp32.log.summary, r + "pp_sent_per_step"));
    CHECK(number(run.log.summary, r + "dp_sent_per_step") * 2 == number(fp32.log.summary, r + "dp_sent_per_step"));
  }
}

TEST_CASE("the planner's ZeRO-3: resharding after forward holds two stages' parameters, not every chunk's, for "
          "2 M gathers a step",
          "[unit]") {
  const course::PlanJob job = planner_job(kBatch);
  const course::Layout kept = layout_of(2, 2, 2, 3, false, course::ScheduleKind::Interleaved);
  const course::RankPlan once = course::plan_rank(job, kept, {0, 0, 0});
  const course::RankPlan around = course::plan_rank(job, resharded(kept), {0, 0, 0});
  // the rank's two chunks: the whole gradients of both at the step's end, and the
  // parameters of every stage of both (kept), or of the stage computing and the next
  // one, prefetched (resharded)
  CHECK(around.lent < once.lent);
  CHECK(around.dp_gather_bytes == (2 * kMicroBatches) * once.dp_gather_bytes);
  CHECK(around.parameters == once.parameters);
  CHECK(once.parameters == once.gradients);  // both the shard
  // kept, the whole chunks are there at the peak besides the shards: more than ZeRO-1
  // holds (why plan_all ranks ZeRO-3 resharded only)
  const course::RankPlan z1 = course::plan_rank(job, layout_of(2, 2, 2, 1, false, course::ScheduleKind::Interleaved),
                                                {0, 0, 0});
  CHECK(once.memory() > z1.memory());
}

TEST_CASE("recomputation at 2x2x2 (selective, full) trains as without it bit for bit, and the planner predicts "
          "its activations and bytes",
          "[equivalence]") {
  struct Case {
    std::string recompute;
    course::Layout layout;
  };
  // selective with zb-h1: the deferred weight half finds what it needs (all but the
  // probabilities, which it does not read)
  const Case c = GENERATE(Case{"selective", layout_of(2, 2, 2)},
                          Case{"full", layout_of(2, 2, 2, 0, true, course::ScheduleKind::Interleaved)},
                          Case{"selective", layout_of(2, 2, 2, 0, true, course::ScheduleKind::ZeroBubbleH1)});
  INFO(course::describe(c.layout) << ", --recompute " << c.recompute);
  const Run none = train_3d("tcp", c.layout, {});
  const Run run = train_3d("tcp", c.layout, {"--recompute", c.recompute});
  REQUIRE(run.log.steps.size() == none.log.steps.size());
  for (size_t i = 0; i < none.log.steps.size(); i++) {
    INFO("step " << i + 1);
    CHECK(number(run.log.steps[i], "loss") == number(none.log.steps[i], "loss"));
  }
  CHECK(run.params == none.params);
  course_test::check_losses_and_parameters(run.log, run.params, train_single({}).log, train_single({}).params);
  check_planner(run.log, c.layout, course::parse_recompute(c.recompute));
  for (int r = 0; r < 8; r++) {  // the executor's prediction counts the recomputation buffer too
    const std::string rank = "rank" + std::to_string(r);
    INFO(rank);
    CHECK(number(run.log.summary, rank + "_predicted_activations") ==
          number(run.log.summary, rank + "_peak_activations"));
  }
}

TEST_CASE("full recomputation with zb-h1 is refused, by 07_3d and by the planner", "[equivalence][cli]") {
  const std::string message = "--recompute full keeps only the block's input";
  const std::vector<std::string> argv =
      concat(course_test::launcher_command(2), concat({course_binary("07_3d"), "--quiet", "--pp", "2", "--schedule",
                                                       "zb-h1", "--recompute", "full", "--steps", "1"},
                                                      kModelFlags));
  const ProcessResult result = run_process(argv, kTimeoutSeconds);
  INFO(result.describe() << "\nstderr:\n" << result.err);
  REQUIRE_FALSE(result.timed_out);
  CHECK(result.exit_code == 2);
  CHECK_THAT(result.err, Catch::Contains(message));
  const ProcessResult plan = run_process(
      {course_binary("07_plan"), "--layout", "1x2x1", "--schedule", "zb-h1", "--recompute", "full"}, 60);
  CHECK(plan.exit_code == 2);
  CHECK_THAT(plan.err, Catch::Contains(message));
}

TEST_CASE("the planner's cp axis predicts chapter 08's memory and bytes on every rank", "[equivalence]") {
  // seq 16, 4 heads: zigzag at cp 4 is 8 chunks of 2, a2a at cp 4 one head per rank;
  // 8 sequences in 4 micro-batches: 2 per micro-batch at dp 1, 1 at dp 2
  struct Case {
    std::string backend;
    course::Layout layout;
  };
  const std::vector<Case> cases = {
      {"tcp", cp_layout(1, 2)},
      {"tcp", cp_layout(1, 4)},
      {"tcp", cp_layout(2, 2)},
      {"tcp", cp_layout(1, 4, course::CPMode::Ring, course::SplitKind::Contiguous)},
      {"tcp", cp_layout(1, 2, course::CPMode::AllToAll)},
      {"tcp", cp_layout(1, 4, course::CPMode::AllToAll)},
      {"tcp", cp_layout(2, 2, course::CPMode::AllToAll)},
      {"mpi", cp_layout(2, 2)},
  };
  const size_t index = GENERATE(range(0, 8));
  REQUIRE(index < cases.size());
  const Case& c = cases[index];
  INFO(course::describe(c.layout) << " on " << c.backend);
  check_cp_planner(train_cp(c.backend, c.layout), c.layout);
}

TEST_CASE("under --dtype bf16 the planner's cp axis predicts chapter 08's memory and bytes on every rank",
          "[equivalence]") {
  // fp32 storage; the ring's and the all-to-all's bf16 messages beside their fp32
  // buffers, and DDP's bf16 copy of the gradients (--grad-comm-dtype bf16)
  const course::Layout layout = GENERATE(cp_layout(1, 2), cp_layout(1, 2, course::CPMode::AllToAll));
  INFO(course::describe(layout));
  const RunLog log = train_cp("tcp", layout, {"--dtype", "bf16", "--grad-comm-dtype", "bf16"});
  check_cp_planner(log, layout, course::Precision::BF16, course::DType::BF16);
}

// At --dtype bf16, ZeRO-1 and 2 resume their master copies (the checkpoint's fp32
// values) and round the replica they load whole, as a run that never stopped has it.
TEST_CASE("a resumed 3D run continues bit for bit (ZeRO-1, ZeRO-3's parameter shards, ZeRO-1 and 2 at bf16)",
          "[equivalence]") {
  struct Case {
    course::Layout layout;
    std::string dtype;
  };
  const Case c = GENERATE(Case{layout_of(2, 2, 2, 1, true), "fp32"}, Case{layout_of(2, 2, 2, 3, true), "fp32"},
                          Case{layout_of(2, 2, 2, 1, true), "bf16"}, Case{layout_of(2, 2, 2, 2, true), "bf16"});
  const course::Layout& layout = c.layout;
  INFO(course::describe(layout) << ", --dtype " << c.dtype);
  TempDir dir;
  const std::vector<std::string> argv =
      concat(concat(course_test::launcher_command(8),
                    {course_binary("07_3d"), "--quiet", "--backend", "tcp", "--comm-timeout", "60", "--micro-batches",
                     "4", "--checkpoint-every", "5", "--checkpoint-dir", dir.file("checkpoints"), "--dtype", c.dtype}),
             concat(kModelFlags, layout_flags(layout)));
  const auto run = [&](const std::string& log, int steps, bool resume) {
    std::vector<std::string> args = concat(argv, {"--steps", std::to_string(steps), "--log", dir.file(log)});
    if (resume) args.push_back("--resume");
    const ProcessResult result = run_process(args, kTimeoutSeconds);
    INFO(joined(args) << "\n" << result.describe() << "\n" << result.out << result.err);
    REQUIRE(result.exit_code == 0);
    return course_test::read_log(dir.file(log));
  };
  run("first.jsonl", 5, false);                           // leaves the checkpoint of step 5
  const RunLog resumed = run("resumed.jsonl", 8, true);  // steps 6-8 from it
  const RunLog straight = run("straight.jsonl", 8, false);
  REQUIRE(resumed.steps.size() == 3);
  for (size_t i = 0; i < 3; i++) CHECK(resumed.steps[i].at("loss") == straight.steps[i + 5].at("loss"));
}

TEST_CASE("a 3D checkpoint resumes at another layout, and chapter 00 resumes it consolidated", "[equivalence]") {
  TempDir dir;
  const auto command = [&](const course::Layout& layout, const std::vector<std::string>& args) {
    return concat(concat(course_test::launcher_command(layout.dp * layout.pp * layout.tp),
                         {course_binary("07_3d"), "--quiet", "--backend", "tcp", "--comm-timeout", "60",
                          "--micro-batches", std::to_string(kMicroBatches)}),
                  concat(concat(kModelFlags, layout_flags(layout)), args));
  };
  const course::Layout written = layout_of(2, 2, 2, 1, true);  // ZeRO-1, SP
  course_test::run_ok(command(written, {"--steps", "8", "--log", dir.file("straight.jsonl")}), kTimeoutSeconds);
  course_test::run_ok(command(written, {"--steps", "4", "--checkpoint-dir", dir.file("ck")}), kTimeoutSeconds);
  const course_test::RunLog straight = course_test::read_log(dir.file("straight.jsonl"));
  SECTION("at 1x2x2 with zb-h1, at 2x1x2 without ZeRO, and with ZeRO-3: resharded on load") {
    for (const course::Layout& resumed : {layout_of(1, 2, 2, 0, false, course::ScheduleKind::ZeroBubbleH1),
                                          layout_of(2, 1, 2), layout_of(2, 1, 2, 3)}) {
      INFO("resumed as " << course::describe(resumed));
      const std::string log = dir.file(course::describe(resumed) + ".jsonl");
      const std::string copy = dir.file("ck " + course::describe(resumed));  // each resume saves its own step 8
      std::filesystem::copy(dir.file("ck"), copy);
      const ProcessResult result = course_test::run_ok(
          command(resumed, {"--steps", "8", "--checkpoint-dir", copy, "--resume", "--log", log}), kTimeoutSeconds);
      CHECK_THAT(result.out, Catch::Contains("07_3d at dp 2 x pp 2 x tp 2"));  // says it reshards, and from what
      course_test::check_losses_close(course_test::read_log(log), straight, 5);
    }
  }
  SECTION("consolidated into chapter 00") {
    course_test::run_ok({course_binary("consolidate_checkpoint"), "--checkpoint-dir", dir.file("ck"), "--out-dir",
                         dir.file("whole")},
                        kTimeoutSeconds);
    course_test::run_ok(concat(concat({course_binary("00_single_gpu"), "--quiet", "--micro-batches",
                                       std::to_string(kMicroBatches)},
                                      kModelFlags),
                               {"--steps", "8", "--checkpoint-dir", dir.file("whole"), "--resume", "--log",
                                dir.file("single.jsonl")}),
                        kTimeoutSeconds);
    course_test::check_losses_close(course_test::read_log(dir.file("single.jsonl")), straight, 5);
  }
}

namespace {

// On every rank, in its own clock: some DP reduction of the last step (on the
// data-parallel lane) was issued before that rank's last backward of the step began.
// The training thread issues a chunk's reduction right after the chunk's last
// backward (PipelineExecutor::on_gradients_done), so with two chunks a rank the first
// chunk to finish has its reduction issued while the other still has backwards to
// run. Issue order is program order on one thread: this does not depend on when the
// OS runs the communication thread.
// A rank's reductions of the step are those issued after its first compute of the
// step (the trace's last step, so none of a later one).
void check_reduction_issued_before_last_backward(const std::string& merged_path, int ranks, int last_step) {
  const std::vector<course_test::Json> spans =
      course_test::events_of_phase(course_test::read_json(merged_path), "X");
  for (int rank = 0; rank < ranks; rank++) {
    double step_start = INFINITY, last_backward_start = 0.0;  // microseconds
    for (const course_test::Json& span : spans) {
      if (span.at("pid").number != rank || span.at("tid").number != course::Trace::kComputeLane) continue;
      if (!span.at("args").has("step") || span.at("args").at("step").number != last_step) continue;
      const double start = span.at("ts").number;
      step_start = std::min(step_start, start);
      // the executor's "backward", or zb-h1's halves "backward input" and "backward weight"
      const course_test::Json& args = span.at("args");
      if (args.has("action") && args.at("action").text.rfind("backward", 0) == 0) {
        last_backward_start = std::max(last_backward_start, start);
      }
    }
    double first_issued = INFINITY;
    for (const course_test::Json& span : spans) {
      if (span.at("pid").number != rank || span.at("tid").number != course::Trace::kDataParallelLane) continue;
      if (span.at("name").text == "all-gather parameters") continue;  // ZeRO's, before or after: no reduction
      const double issued = course_test::issued_us(span);
      if (issued >= step_start) first_issued = std::min(first_issued, issued);
    }
    INFO("rank " << rank << ", step " << last_step << ", from its first compute: its last backward starts at "
                 << last_backward_start - step_start << " us, its first DP reduction is issued at "
                 << first_issued - step_start << " us");
    REQUIRE(last_backward_start > 0.0);
    CHECK(first_issued < last_backward_start);
  }
}

}  // namespace

// Interleaved: each rank holds two chunks, so its first chunk's reduction is issued
// while its other chunk still has backwards to run (with one chunk a rank, 1F1B's,
// the chunk's last backward is the rank's last compute of the step).
TEST_CASE("the 3D trace shows TP collectives inside micro-batches, pipeline sends, and each rank's DP reduction "
          "issued before its last backward",
          "[equivalence]") {
  const int zero_stage = GENERATE(0, 1, 3);
  INFO("--zero-stage " << zero_stage);
  TempDir dir;
  const std::vector<std::string> argv = concat(
      concat(course_test::launcher_command(8),
             {course_binary("07_3d"), "--quiet", "--backend", "tcp", "--comm-timeout", "60"}),
      concat(kModelFlags, layout_flags(layout_of(2, 2, 2, zero_stage, false, course::ScheduleKind::Interleaved))));
  const std::string trace = course_test::run_traced(argv, 8, dir, kTimeoutSeconds);
  // a compute span's name: its micro-batch and chunk (a, b)
  std::vector<course_test::ExpectedSpan> expected = {
      {"F0a", 0},
      {"B0b", 0},
      {"f all-reduce", 1},
      {"g all-reduce", 1},
      {"send activation 0a", 1},  // stages 0 and 1 (each rank's chunk a) send on
      {"send gradient 0b", 1},    // stages 2 and 3 (each rank's chunk b) send back
      {zero_stage == 0 ? "all-reduce bucket 0" : "reduce-scatter gradients", course::Trace::kDataParallelLane}};
  // ZeRO-1's after the update, ZeRO-3's before each chunk's first forward
  if (zero_stage > 0) expected.push_back({"all-gather parameters", course::Trace::kDataParallelLane});
  for (int rank = 0; rank < 8; rank++) {
    if (course::ProcessGrid(8, 2, 2, 2).coords_of(rank).pp == 1) {
      expected.push_back({"cross-entropy sum all-reduce", 1, rank});  // the last stage's
    }
  }
  course_test::check_chapter_trace(trace, 8, expected);
  check_reduction_issued_before_last_backward(trace, 8, 2);
}

TEST_CASE("bad layouts are refused with one message and exit 2", "[cli]") {
  struct Case {
    int ranks;
    std::vector<std::string> flags;
    std::string message;
  };
  const std::vector<Case> cases = {
      {4, {"--dp", "3", "--pp", "1", "--tp", "1"}, "dp x pp x tp must be 4"},
      {2, {"--dp", "1", "--tp", "2", "--heads", "3", "--d-model", "24"}, "--tp 2 does not divide"},
      {4, {"--dp", "1", "--pp", "4", "--layers", "2"}, "pipeline parts"},
      {2, {"--pp", "2", "--schedule", "interleaved", "--layers", "3"}, "chunks of equal size"},
      {2, {"--dp", "2", "--zero-stage", "4"}, "--zero-stage 4"},
      {2, {"--dp", "2", "--zero-stage", "1", "--reshard-after-forward"}, "only ZeRO-3 gathers parameters"},
      {4, {"--dp", "2", "--pp", "0", "--tp", "0"}, "at most one of them may be left out"},
  };
  for (const Case& c : cases) {
    const std::vector<std::string> argv =
        concat(concat(course_test::launcher_command(c.ranks), {course_binary("07_3d"), "--steps", "1"}), c.flags);
    const ProcessResult result = run_process(argv, 60);
    INFO(joined(argv) << "\n" << result.describe() << "\nstdout:\n" << result.out << "\nstderr:\n" << result.err);
    REQUIRE_FALSE(result.timed_out);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.err, Catch::Contains(c.message));
    CHECK(course_test::error_lines(result.err) == 1);
  }
  // one axis left out (0) is inferred, whichever it is
  for (const char* axis : {"--dp", "--pp", "--tp"}) {
    std::vector<std::string> flags = {"--dp", "1", "--pp", "2", "--tp", "1"};
    for (size_t i = 0; i < flags.size(); i += 2) {
      if (flags[i] == axis) flags[i + 1] = "0";
    }
    const std::vector<std::string> argv =
        concat(concat(course_test::launcher_command(2), {course_binary("07_3d"), "--steps", "1"}), flags);
    const ProcessResult result = run_process(argv, 60);
    INFO(joined(argv) << "\n" << result.describe() << "\nstderr:\n" << result.err);
    CHECK(result.exit_code == 0);
  }
  // the planner's program refuses the same way
  const ProcessResult plan = run_process({course_binary("07_plan"), "--layout", "2x1x3"}, 60);
  CHECK(plan.exit_code == 2);
  CHECK_THAT(plan.err, Catch::Contains("--tp 3 does not divide"));
  const ProcessResult cp_plan = run_process({course_binary("07_plan"), "--layout", "1x2x1", "--cp", "2"}, 60);
  CHECK(cp_plan.exit_code == 2);
  CHECK_THAT(cp_plan.err, Catch::Contains("cp > 1 runs in chapter 08, with dp only"));
}

TEST_CASE("the planner reproduces the ZeRO paper's per-device model states for 7.5B parameters on 64 GPUs",
          "[unit]") {
  // Rajbhandari et al. 2020, Figure 1: 7.5B parameters, mixed precision (2 + 2 + 12
  // bytes per parameter), 64-way data parallel: 120 GB without ZeRO, 31.4 GB with
  // the optimizer state partitioned (P_os, our ZeRO-1)
  course::PlanJob job;
  job.model = {51200, 1024, 35, 4096, 32};  // a GPT-2 shape with about 7.5B parameters
  job.global_batch = 64;
  job.micro_batches = 1;
  job.precision = course::Precision::BF16Stored;
  const double P = static_cast<double>(course::count_parameters(job.model));
  REQUIRE(P == Approx(7.5e9).epsilon(0.02));
  for (int zero = 0; zero <= 1; zero++) {
    const course::RankPlan plan = course::plan_rank(job, layout_of(64, 1, 1, zero), {0, 0, 0});
    const double states = plan.parameters + plan.gradients + plan.optimizer_state;
    const double paper = zero == 0 ? 16 * P : 4 * P + 12 * P / 64;  // 120 GB and 31.4 GB at P = 7.5e9
    CHECK(states == Approx(paper).epsilon(1e-6));
  }
}

TEST_CASE("across nodes the grid's order decides which axis stays inside a node", "[unit]") {
  // 4 nodes of 8: rank = (dp x PP + pp) x TP + tp puts a pipeline of pp x tp <= 8
  // neighbours in one node and DP across nodes; (pp x DP + dp) x TP + tp does the
  // opposite when dp x tp <= 8. TP, innermost in both, stays on NVLink either way.
  course::PlanJob job = planner_job(32);
  course::Cluster cluster;
  cluster.nodes = 4;
  course::Layout layout = layout_of(2, 4, 4);  // 32 devices: pp x tp = 16, dp x tp = 8
  const course::LayoutPlan dp_outer = course::plan_layout(job, layout, cluster);
  CHECK(dp_outer.tp_link == "NVLink");
  CHECK(dp_outer.pp_link == "IB");  // a pipeline spans 16 ranks: two nodes
  CHECK(dp_outer.dp_link == "IB");  // a DP group spans all 32
  layout.order = course::GridOrder::PpDpTp;
  const course::LayoutPlan pp_outer = course::plan_layout(job, layout, cluster);
  CHECK(pp_outer.tp_link == "NVLink");
  CHECK(pp_outer.pp_link == "IB");
  CHECK(pp_outer.dp_link == "NVLink");  // a DP group spans 8 ranks: one node
  // the order renumbers ranks, nothing else: the same bytes and memory, and DP's bytes
  // move from the network to NVLink
  CHECK(pp_outer.worst.dp_bytes == dp_outer.worst.dp_bytes);
  CHECK(pp_outer.peak_memory == dp_outer.peak_memory);
  CHECK(dp_outer.step_seconds - pp_outer.step_seconds ==
        Approx(dp_outer.worst.dp_bytes / cluster.inter_node_bandwidth -
               dp_outer.worst.dp_bytes / cluster.intra_node_bandwidth));

  layout = layout_of(8, 2, 2);  // pp x tp = 4 fits a node, dp x tp = 16 does not
  const course::LayoutPlan pipeline_inside = course::plan_layout(job, layout, cluster);
  CHECK(pipeline_inside.pp_link == "NVLink");
  CHECK(pipeline_inside.dp_link == "IB");
  layout.order = course::GridOrder::PpDpTp;
  const course::LayoutPlan pipeline_across = course::plan_layout(job, layout, cluster);
  CHECK(pipeline_across.pp_link == "IB");
  CHECK(pipeline_across.dp_link == "IB");

  // the table shows both orders side by side: a row's links under dp-pp-tp, then pp-dp-tp
  const std::string table = course::format_grid_orders({dp_outer, pipeline_inside}, 2, job, cluster);
  INFO(table);
  CHECK_THAT(table, Catch::Contains("dp-pp-tp: tp pp dp") && Catch::Contains("pp-dp-tp: tp pp dp"));
  CHECK_THAT(table, Catch::Matches("[\\s\\S]*\\n  2x4x4 +NV IB IB +[0-9.]+ s +NV IB NV +[0-9.]+ s\\n[\\s\\S]*"));
  CHECK_THAT(table, Catch::Matches("[\\s\\S]*\\n  8x2x2 +NV NV IB +[0-9.]+ s +NV IB IB +[0-9.]+ s\\n[\\s\\S]*"));
}

TEST_CASE("the planner's cp axis: chapter 08's refusals, the cp link, and the layouts that fit only with cp",
          "[unit]") {
  course::PlanJob job = planner_job(32);  // seq 16, 4 heads
  SECTION("what chapter 08 does not run is refused with its own message") {
    const auto refusal = [&](const course::Layout& layout) {
      try {
        course::check_layout(job, layout);
      } catch (const course::FlagError& error) {
        return std::string(error.what());
      }
      return std::string("accepted");
    };
    course::Layout with_pp = cp_layout(1, 2);
    with_pp.pp = 2;
    CHECK_THAT(refusal(with_pp), Catch::Contains("cp > 1 runs in chapter 08, with dp only"));
    course::Layout with_zero = cp_layout(2, 2);
    with_zero.zero_stage = 1;
    CHECK_THAT(refusal(with_zero), Catch::Contains("cp > 1 runs in chapter 08, with dp only"));
    CHECK_THAT(refusal(cp_layout(1, 3)), Catch::Contains("--seq 16 does not split into 6 equal chunks"));
    CHECK_THAT(refusal(cp_layout(1, 8, course::CPMode::AllToAll)),
               Catch::Contains("--cp-mode a2a needs the heads divisible by --cp: 4 heads over 8"));
    CHECK(refusal(cp_layout(1, 8)) == "accepted");  // the ring: 16 chunks of one position
  }
  SECTION("a cp group is consecutive ranks; DDP's group is the whole dp x cp world") {
    course::Cluster cluster;
    cluster.nodes = 2;
    job.model.seq_len = 32;  // zigzag over 16 ranks: 32 chunks
    const course::LayoutPlan inside = course::plan_layout(job, cp_layout(2, 8), cluster);
    CHECK(inside.cp_link == "NVLink");
    CHECK(inside.dp_link == "IB");
    CHECK(inside.tp_link == "-");
    const course::LayoutPlan across = course::plan_layout(job, cp_layout(1, 16), cluster);
    CHECK(across.cp_link == "IB");
    // a2a's all-to-alls are exposed whole; DDP's average beyond the last micro-batch's
    // backward (two thirds of its compute)
    const course::LayoutPlan a2a = course::plan_layout(job, cp_layout(4, 4, course::CPMode::AllToAll), cluster);
    const double last_backward = a2a.compute_seconds * 2.0 / 3.0 / job.micro_batches;
    CHECK(a2a.exposed_comm_seconds ==
          Approx(a2a.worst.cp_bytes / cluster.intra_node_bandwidth +
                 std::max(0.0, a2a.worst.dp_bytes / cluster.inter_node_bandwidth - last_backward)));
  }
  SECTION("a long sequence: gpt2-1.5b's shape at seq 32768 on one node fits only with cp (the README's table)") {
    course::PlanJob long_job;
    long_job.model = {50304, 32768, 48, 1600, 25};  // 25 heads: no TP, no a2a
    long_job.global_batch = 16;
    long_job.micro_batches = 4;
    long_job.precision = course::Precision::BF16Stored;  // 07_plan's default
    const course::Cluster node;
    for (const course::LayoutPlan& p : course::plan_all(long_job, node)) CHECK_FALSE(p.fits);
    size_t fitting = 0;
    for (const course::LayoutPlan& p : course::plan_all(long_job, node, /*with_cp=*/true)) {
      INFO(course::describe(p.layout));
      if (p.fits) CHECK(p.layout.cp > 1);
      if (p.layout.cp > 1) CHECK(p.layout.cp_mode == course::CPMode::Ring);
      fitting += p.fits ? 1 : 0;
    }
    CHECK(fitting == 3);  // dp x cp = 4x2, 2x4, 1x8
    const std::string table = course::format_plans(course::plan_all(long_job, node, true), 3);
    INFO(table);
    CHECK_THAT(table, Catch::Contains("tp|cp/step"));
    CHECK_THAT(table, Catch::Matches("[\\s\\S]*\\n  4x1x1 cp2 +[0-9.]+ GB +[0-9.]+ GB +yes  [0-9.]+ GB NV[\\s\\S]*"));
    CHECK_THAT(course::format_plans(course::plan_all(long_job, node), 3), !Catch::Contains("cp"));
    // the grid-order table plans its cp rows again as plan_all does: without recomputation
    long_job.recompute = course::Recompute::Selective;
    course::Cluster two_nodes;
    two_nodes.nodes = 2;
    const std::vector<course::LayoutPlan> ranked = course::plan_all(long_job, two_nodes, true);
    REQUIRE(ranked.front().layout.cp > 1);
    CHECK_NOTHROW(course::format_grid_orders(ranked, 3, long_job, two_nodes));
  }
}

TEST_CASE("the planner at real sizes: Llama-3-8B's shape fits one node of 8 x 80 GB only with full recomputation",
          "[unit]") {
  course::PlanJob job;  // 07_plan --model llama-8b --nodes 1 --recompute ...
  job.model = {128256, 8192, 32, 4096, 32};
  job.global_batch = 512;
  job.micro_batches = 32;
  job.precision = course::Precision::BF16Stored;
  const course::Cluster node;
  const auto fitting = [&](course::Recompute recompute) {
    job.recompute = recompute;
    std::vector<std::string> names;
    for (const course::LayoutPlan& p : course::plan_all(job, node)) {
      if (p.fits) names.push_back(course::describe(p.layout));
    }
    return names;
  };
  CHECK(fitting(course::Recompute::None).empty());
  // selective keeps one (b, heads/N, T, T) matrix and every block's other tensors:
  // at 8,192 tokens the blocks' own 32 x 2.1 GB of a micro-batch of 2 sequences are too much
  CHECK(fitting(course::Recompute::Selective).empty());
  const std::vector<std::string> full = fitting(course::Recompute::Full);
  INFO(joined(full));
  CHECK(full.size() == 13);
  CHECK(full.front() == "8x1x1 z1");  // pure DP with ZeRO-1 ranks first: its DP traffic hides behind backward
  // FSDP resharded one block at a time holds less than ZeRO-1's whole parameters, for a
  // gather per block per micro-batch (2 M of them a step)
  job.recompute = course::Recompute::Full;
  const course::RankPlan z1 = course::plan_rank(job, {8, 1, 1, 1}, {0, 0, 0});
  course::Layout fsdp{8, 1, 1, 3};
  const course::RankPlan z3 = course::plan_rank(job, fsdp, {0, 0, 0});
  fsdp.reshard_after_forward = true;
  const course::RankPlan z3r = course::plan_rank(job, fsdp, {0, 0, 0});
  CHECK(z3r.memory() < z1.memory() - 9e9);
  CHECK(z3.memory() > z1.memory());  // kept over the step: the whole model besides the shards
  CHECK(z3r.dp_gather_bytes == 2 * job.micro_batches * z3.dp_gather_bytes);
}

TEST_CASE("the planner counts DP's average as exposed only beyond the last micro-batch's backward", "[unit]") {
  course::PlanJob job = planner_job(32);
  course::Cluster cluster;
  cluster.devices_per_node = 8;
  for (const double flops : {1e9, 4e14}) {  // a slow device hides the average, a fast one does not
    cluster.device_flops = flops;
    for (const course::Recompute recompute :
         {course::Recompute::None, course::Recompute::Selective, course::Recompute::Full}) {
      job.recompute = recompute;
      const course::LayoutPlan p = course::plan_layout(job, layout_of(8, 1, 1), cluster);
      // the forward's FLOPs: a third of chapter 00's count; recomputation adds to backward's
      const double tokens = 32.0 * model_config().seq_len;
      const double forward = course::training_flops_per_token(model_config()) / 3.0 * tokens / 8 / flops;
      const double last_backward = (p.compute_seconds - forward) / job.micro_batches;
      const double dp_seconds = p.worst.dp_bytes / cluster.intra_node_bandwidth;
      INFO("FLOP/s " << flops << ", --recompute " << course::recompute_name(recompute));
      CHECK(p.exposed_comm_seconds == Approx(std::max(0.0, dp_seconds - last_backward)));
      if (flops == 1e9) CHECK(p.exposed_comm_seconds == 0.0);
      if (flops == 4e14) CHECK(p.exposed_comm_seconds > 0.0);
    }
  }
  // recomputation's FLOPs: full adds the blocks' forward (24 L C^2 + 4 L T C per token),
  // selective attention's (T, T) products (4 L T C)
  const course::GPTConfig m = model_config();
  const double L = m.n_layer, C = m.d_model, T = m.seq_len;
  const auto compute = [&](course::Recompute recompute) {
    job.recompute = recompute;
    return course::plan_layout(job, layout_of(8, 1, 1), cluster).compute_seconds;
  };
  const double per_token = compute(course::Recompute::None) / course::training_flops_per_token(m);
  CHECK(compute(course::Recompute::Selective) ==
        Approx(per_token * (course::training_flops_per_token(m) + 4 * L * T * C)));
  CHECK(compute(course::Recompute::Full) ==
        Approx(per_token * (course::training_flops_per_token(m) + 24 * L * C * C + 4 * L * T * C)));
}
