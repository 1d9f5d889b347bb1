// Checkpoints across cuts, through the manifest (common/train/checkpoint_manifest.h) that
// chapters 03 to 06 write. tools/consolidate_checkpoint on chapter 03 (ZeRO-1 here;
// ZeRO-3 in test_fsdp.cpp), 04's model parts, 05's pipeline chunks (two per rank,
// interleaved) and 06's tensor-parallel slices (rows, strided columns, replicated
// parameters), each trained 4 steps at 2 ranks (tcp, under the course launcher),
// consolidated, and resumed by chapter 00; and chapters 04 to 06 resumed at another
// --pp, schedule or --tp (resharding on load). Every resumed run's losses for steps
// 5 to 8 are the uninterrupted parallel run's within the equivalence bound.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "common/train/checkpoint.h"
#include "support/equivalence_model.h"
#include "support/process.h"
#include "support/runs.h"

using course_test::concat;
using course_test::course_binary;
using course_test::read_log;
using course_test::TempDir;

namespace {

const double kTimeoutSeconds = 120;

void run_ok(const std::vector<std::string>& argv) { course_test::run_ok(argv, kTimeoutSeconds); }

// The chapter at `ranks` ranks with the small model (4 layers, so that 05 can
// interleave 2 chunks per rank) and its technique's flags, then `args`.
std::vector<std::string> chapter_command(const std::string& chapter, int ranks, const std::vector<std::string>& technique,
                                         const std::vector<std::string>& args) {
  std::vector<std::string> argv = concat(course_test::launcher_command(ranks),
                                         {course_binary(chapter), "--quiet", "--backend", "tcp", "--comm-timeout", "60"});
  return concat(concat(concat(argv, course_test::kModel), concat({"--layers", "4", "--batch", "8"}, technique)), args);
}

}  // namespace

TEST_CASE("consolidate_checkpoint turns every manifest-writing chapter's checkpoint into one chapter 00 resumes",
          "[equivalence]") {
  struct Chapter {
    std::string name;
    std::vector<std::string> technique;
  };
  const Chapter chapter = GENERATE(Chapter{"03_fsdp", {"--zero-stage", "1"}}, Chapter{"04_naive_model_parallel", {}},
                                   Chapter{"05_pipeline", {"--schedule", "interleaved", "--micro-batches", "2"}},
                                   Chapter{"06_tensor_parallel", {}});
  INFO(chapter.name);
  TempDir dir;
  run_ok(chapter_command(chapter.name, 2, chapter.technique, {"--steps", "8", "--log", dir.file("straight.jsonl")}));
  run_ok(chapter_command(chapter.name, 2, chapter.technique, {"--steps", "4", "--checkpoint-dir", dir.file("ck")}));
  const course_test::ProcessResult consolidated = course_test::run_ok(
      {course_binary("consolidate_checkpoint"), "--checkpoint-dir", dir.file("ck"), "--out-dir", dir.file("whole")},
      kTimeoutSeconds);
  // the command it suggests names the model: chapter 00's defaults would refuse the checkpoint
  CHECK_THAT(consolidated.out, Catch::Contains("--resume --d-model 32 --heads 2 --seq 32\n"));  // 4 layers: the default
  // chapter 00 on the same batch, in as many micro-batches as the pipeline used
  const std::string micro_batches = chapter.name == "05_pipeline" ? "2" : "1";
  run_ok(concat(concat({course_binary("00_single_gpu"), "--quiet"}, course_test::kModel),
                {"--layers", "4", "--batch", "8", "--micro-batches", micro_batches, "--steps", "8", "--checkpoint-dir",
                 dir.file("whole"), "--resume", "--log", dir.file("resumed.jsonl")}));
  course_test::check_losses_close(read_log(dir.file("resumed.jsonl")), read_log(dir.file("straight.jsonl")), 5);
}

TEST_CASE("a checkpoint of chapters 04 to 06 resumes at another --pp, schedule or --tp with the straight run's losses",
          "[equivalence]") {
  struct Change {
    std::string chapter;
    std::vector<std::string> written;  // technique flags of the run that saved step 4
    std::vector<std::string> resumed;  // and of the one that resumes it
    int resumed_ranks;
  };
  const Change change =
      GENERATE(Change{"04_naive_model_parallel", {}, {}, 3},
               Change{"05_pipeline", {"--micro-batches", "2"}, {"--micro-batches", "2", "--schedule", "interleaved"}, 2},
               Change{"06_tensor_parallel", {}, {}, 1});
  INFO(change.chapter << " resumed at " << change.resumed_ranks << " ranks");
  TempDir dir;
  run_ok(chapter_command(change.chapter, 2, change.written, {"--steps", "8", "--log", dir.file("straight.jsonl")}));
  run_ok(chapter_command(change.chapter, 2, change.written, {"--steps", "4", "--checkpoint-dir", dir.file("ck")}));
  const course_test::ProcessResult result = course_test::run_ok(
      chapter_command(change.chapter, change.resumed_ranks, change.resumed,
                      {"--steps", "8", "--checkpoint-dir", dir.file("ck"), "--resume", "--log", dir.file("resumed.jsonl")}),
      kTimeoutSeconds);
  CHECK_THAT(result.out, Catch::Contains("[rank 0] resharding: each rank reads its part out of the files that hold it\n"
                                         "[rank 0]   saved as: "));
  course_test::check_losses_close(read_log(dir.file("resumed.jsonl")), read_log(dir.file("straight.jsonl")), 5);
}

// Before, 00, 02 and 08 said "no checkpoint in DIR yet: starting from step 1" and
// trained from scratch with exit 0: a resume that looked as if it had worked.
TEST_CASE("a chapter that reads whole-model checkpoints names a sharded one it cannot read, and how to consolidate it",
          "[equivalence]") {
  TempDir dir;
  run_ok(chapter_command("03_fsdp", 2, {"--zero-stage", "3"}, {"--steps", "2", "--checkpoint-dir", dir.file("ck")}));
  for (const char* chapter : {"00_single_gpu", "02_ddp"}) {
    INFO(chapter);
    const int ranks = std::string(chapter) == "00_single_gpu" ? 1 : 2;
    const course_test::ProcessResult result = course_test::run_process(
        ranks == 1 ? concat(concat({course_binary(chapter), "--quiet"}, course_test::kModel),
                            {"--layers", "4", "--batch", "8", "--steps", "4", "--checkpoint-dir", dir.file("ck"),
                             "--resume"})
                   : chapter_command(chapter, 2, {}, {"--steps", "4", "--checkpoint-dir", dir.file("ck"), "--resume"}),
        kTimeoutSeconds);
    INFO(result.describe() << "\n" << result.err);
    CHECK(result.exit_code == 2);
    CHECK_THAT(result.err, Catch::Contains("holds a sharded checkpoint"));
    CHECK_THAT(result.err, Catch::Contains("consolidate_checkpoint --checkpoint-dir " + dir.file("ck")));
    CHECK_THAT(result.out, !Catch::Contains("starting from step 1"));
  }
}
