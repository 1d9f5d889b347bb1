// tools/consolidate_checkpoint on every chapter that writes a checkpoint manifest
// (common/checkpoint_manifest.h): chapter 03 (ZeRO-1 here; ZeRO-3 in test_fsdp.cpp),
// 04's model parts, 05's pipeline chunks (two per rank, interleaved) and 06's
// tensor-parallel slices (rows, strided columns, replicated parameters), each trained
// 4 steps at 2 ranks (tcp, under the course launcher), consolidated, and resumed by
// chapter 00: its losses for steps 5 to 8 are the uninterrupted parallel run's
// within the equivalence bound.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "common/checkpoint.h"
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

// The chapter at 2 ranks with the small model (4 layers, so that 05 can interleave
// 2 chunks per rank) and its technique's flags, then `args`.
std::vector<std::string> chapter_command(const std::string& chapter, const std::vector<std::string>& technique,
                                         const std::vector<std::string>& args) {
  std::vector<std::string> argv = concat(course_test::launcher_command(2),
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
  run_ok(chapter_command(chapter.name, chapter.technique, {"--steps", "8", "--log", dir.file("straight.jsonl")}));
  run_ok(chapter_command(chapter.name, chapter.technique, {"--steps", "4", "--checkpoint-dir", dir.file("ck")}));
  run_ok({course_binary("consolidate_checkpoint"), "--checkpoint-dir", dir.file("ck"), "--out-dir", dir.file("whole")});
  // chapter 00 on the same batch, in as many micro-batches as the pipeline used
  const std::string micro_batches = chapter.name == "05_pipeline" ? "2" : "1";
  run_ok(concat(concat({course_binary("00_single_gpu"), "--quiet"}, course_test::kModel),
                {"--layers", "4", "--batch", "8", "--micro-batches", micro_batches, "--steps", "8", "--checkpoint-dir",
                 dir.file("whole"), "--resume", "--log", dir.file("resumed.jsonl")}));
  course_test::check_losses_close(read_log(dir.file("resumed.jsonl")), read_log(dir.file("straight.jsonl")), 5);
}
