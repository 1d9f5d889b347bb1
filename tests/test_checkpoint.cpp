// Checkpoint files: what goes in comes back bit for bit, and every way a file can
// be damaged (cut short, a flipped byte, not a checkpoint at all, the wrong shape)
// is refused with a message that says which.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

#include "common/train/checkpoint.h"
#include "common/tensor/error.h"
#include "support/matchers.h"
#include "support/process.h"

namespace fs = std::filesystem;
using course::CheckpointReader;
using course::CheckpointWriter;
using course::CourseError;
using course::UsageError;
using course_test::MessageContains;
using course_test::TempDir;

namespace {

// A small checkpoint with two sections, as a trainer would write one.
void write_example(const std::string& path) {
  const std::vector<float> params = {0.5f, -1.25f, 3.0f};
  const std::vector<float> moments = {1e-8f, 2e-8f};
  CheckpointWriter writer;
  writer.set_meta("step", 42);
  writer.add_section("params", params.data(), params.size());
  writer.add_section("adam_m", moments.data(), moments.size());
  writer.write(path);
}

// Creates an empty file: latest_checkpoint and prune_checkpoints go by names only.
void touch(const std::string& path) { course_test::write_file(path, ""); }

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("a checkpoint gives back its metadata and sections bit for bit", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("state.ckpt");
  // values that a careless format would lose: -0, a denormal, infinities, a NaN, extremes
  const std::vector<float> weights = {0.0f,
                                      -0.0f,
                                      1.0f / 3.0f,
                                      std::numeric_limits<float>::denorm_min(),
                                      std::numeric_limits<float>::max(),
                                      -std::numeric_limits<float>::infinity(),
                                      std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> biases(1000);
  for (size_t i = 0; i < biases.size(); i++) biases[i] = static_cast<float>(i) * 1e-3f - 0.5f;

  CheckpointWriter writer;
  writer.set_meta("step", 120);
  writer.set_meta("negative", -7);
  writer.set_meta("large", int64_t{1} << 40);
  writer.add_section("weights", weights.data(), weights.size());
  writer.add_section("biases", biases.data(), biases.size());
  writer.write(path);

  CheckpointReader reader(path);
  CHECK(reader.meta("step") == 120);
  CHECK(reader.meta("negative") == -7);
  CHECK(reader.meta("large") == (int64_t{1} << 40));
  std::vector<float> weights_back(weights.size()), biases_back(biases.size());
  reader.read_section("weights", weights_back.data(), weights_back.size());
  reader.read_section("biases", biases_back.data(), biases_back.size());
  CHECK(same_bits(weights_back, weights));
  CHECK(same_bits(biases_back, biases));
}

TEST_CASE("write() leaves only the checkpoint behind, no temporary file", "[unit]") {
  // the writer goes through "<path>.tmp" and renames it, so a crash mid-write
  // never leaves a half-written file under the real name
  TempDir dir;
  const std::string path = dir.file("state.ckpt");
  write_example(path);
  CHECK(fs::exists(path));
  CHECK_FALSE(fs::exists(path + ".tmp"));
  CHECK(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()) == 1);
}

TEST_CASE("a truncated checkpoint is refused as truncated", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("state.ckpt");
  write_example(path);
  fs::resize_file(path, fs::file_size(path) - 4);
  REQUIRE_THROWS_MATCHES(CheckpointReader(path), CourseError, MessageContains("truncated"));
}

TEST_CASE("a checkpoint with one flipped byte is refused as corrupt", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("state.ckpt");
  write_example(path);
  std::string bytes = course_test::read_file(path);
  bytes[bytes.size() - 2] ^= 0x01;  // one bit inside the last float of the payload
  course_test::write_file(path, bytes);
  REQUIRE_THROWS_MATCHES(CheckpointReader(path), CourseError, MessageContains("corrupt"));
}

TEST_CASE("a file that is not a checkpoint is refused as such", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("state.ckpt");
  SECTION("an empty file") { course_test::write_file(path, ""); }
  SECTION("random bytes") {
    std::string bytes;
    uint32_t state = 12345;
    for (int i = 0; i < 256; i++) {
      state = state * 1664525u + 1013904223u;  // a small LCG: the same "random" bytes every run
      bytes += static_cast<char>(state >> 24);
    }
    course_test::write_file(path, bytes);
  }
  REQUIRE_THROWS_MATCHES(CheckpointReader(path), CourseError, MessageContains("not a course checkpoint"));
}

TEST_CASE("reading a section with the wrong number of values is refused, naming the section", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("state.ckpt");
  write_example(path);  // "params" holds 3 values
  CheckpointReader reader(path);
  std::vector<float> too_big(4);
  REQUIRE_THROWS_MATCHES(reader.read_section("params", too_big.data(), too_big.size()), CourseError,
                         MessageContains("section 'params' holds 3 values, this run expects 4"));
  REQUIRE_THROWS_MATCHES(reader.read_section("adam_v", too_big.data(), too_big.size()), CourseError,
                         MessageContains("no section 'adam_v'"));
}

TEST_CASE("loading a checkpoint into a different model shape names the flag that differs", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("state.ckpt");
  course::GPTConfig saved;
  saved.d_model = 64;
  CheckpointWriter writer;
  course::write_model_meta(writer, saved);
  writer.write(path);

  CheckpointReader reader(path);
  CHECK_NOTHROW(course::check_model_meta(reader, saved, path));
  course::GPTConfig wider = saved;
  wider.d_model = 128;
  REQUIRE_THROWS_MATCHES(course::check_model_meta(reader, wider, path), CourseError,
                         MessageContains("--d-model 64, this run has --d-model 128"));
}

TEST_CASE("writing a checkpoint into a directory that does not exist is a CourseError", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("missing/state.ckpt");
  CheckpointWriter writer;
  writer.set_meta("step", 1);
  REQUIRE_THROWS_MATCHES(writer.write(path), CourseError, MessageContains("cannot write checkpoint"));
}

TEST_CASE("reading a checkpoint that does not exist is a usage error naming it, with a hint", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("step_00000200.ckpt");
  REQUIRE_THROWS_MATCHES(CheckpointReader(path), UsageError,
                         MessageContains("no checkpoint file '" + path + "' (hint:"));
}

TEST_CASE("a checkpoint path that is a directory is refused with a message naming it", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("step_00000004.ckpt");
  fs::create_directory(path);
  REQUIRE_THROWS_MATCHES(CheckpointReader(path), CourseError,
                         MessageContains("checkpoint '" + path + "' is a directory, not a checkpoint file"));
  CheckpointWriter writer;
  writer.set_meta("step", 4);
  REQUIRE_THROWS_MATCHES(writer.write(path), CourseError,
                         MessageContains("cannot write checkpoint '" + path + "': a directory of that name"));
  // nothing written beside it: the directory is the only entry
  CHECK(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()) == 1);
}

TEST_CASE("latest_checkpoint picks the highest step and ignores every other file", "[unit]") {
  TempDir dir;
  CHECK_FALSE(course::latest_checkpoint(dir.path()).has_value());
  CHECK_FALSE(course::latest_checkpoint(dir.file("missing")).has_value());

  for (int step : {5, 120, 30}) touch(course::checkpoint_path(dir.path(), step));
  touch(course::checkpoint_path(dir.path(), 999, "_rank1"));  // another rank's file
  touch(dir.file("step_00000500.ckpt.tmp"));                 // a write that never finished
  touch(dir.file("step_abcdefgh.ckpt"));
  touch(dir.file("notes.txt"));

  CHECK(course::checkpoint_path(dir.path(), 120) == dir.file("step_00000120.ckpt"));
  CHECK(course::latest_checkpoint(dir.path()) == dir.file("step_00000120.ckpt"));
  CHECK(course::latest_checkpoint(dir.path(), "_rank1") == dir.file("step_00000999_rank1.ckpt"));
}

TEST_CASE("prune_checkpoints keeps the newest N and touches nothing else", "[unit]") {
  TempDir dir;
  for (int step = 1; step <= 5; step++) touch(course::checkpoint_path(dir.path(), step));
  touch(course::checkpoint_path(dir.path(), 1, "_rank1"));
  touch(dir.file("notes.txt"));

  course::prune_checkpoints(dir.path(), 2);

  for (int step = 1; step <= 3; step++) CHECK_FALSE(fs::exists(course::checkpoint_path(dir.path(), step)));
  CHECK(fs::exists(course::checkpoint_path(dir.path(), 4)));
  CHECK(fs::exists(course::checkpoint_path(dir.path(), 5)));
  CHECK(fs::exists(course::checkpoint_path(dir.path(), 1, "_rank1")));
  CHECK(fs::exists(dir.file("notes.txt")));
}

TEST_CASE("latest_complete_rank_checkpoint skips a step that not every rank finished saving", "[unit]") {
  TempDir dir;
  // a rank's file as a sharded chapter writes it: the world size is what matters here
  auto save = [&](int step, int rank, int world_size) {
    CheckpointWriter writer;
    writer.set_meta("step", step);
    writer.set_meta("world_size", world_size);
    writer.write(course::checkpoint_path(dir.path(), step, course::rank_suffix(rank)));
  };
  CHECK_FALSE(course::latest_complete_rank_checkpoint(dir.path()).has_value());

  for (int rank = 0; rank < 3; rank++) save(4, rank, 3);
  save(8, 0, 3);  // a crash during step 8's save: rank 0 wrote its file, ranks 1 and 2 did not
  save(8, 2, 3);
  CHECK(course::latest_complete_rank_checkpoint(dir.path()) ==
        course::checkpoint_path(dir.path(), 4, course::rank_suffix(0)));

  save(8, 1, 3);  // now every rank's file of step 8 is there
  CHECK(course::latest_complete_rank_checkpoint(dir.path()) ==
        course::checkpoint_path(dir.path(), 8, course::rank_suffix(0)));

  // only rank 0's files: incomplete at every step, so nothing to resume
  TempDir lone;
  CheckpointWriter writer;
  writer.set_meta("world_size", 2);
  writer.write(course::checkpoint_path(lone.path(), 4, course::rank_suffix(0)));
  CHECK_FALSE(course::latest_complete_rank_checkpoint(lone.path()).has_value());
}

TEST_CASE("an atomic write never goes through a symbolic link, and its temporary name cannot be planted", "[unit]") {
  TempDir dir;
  const std::string victim = dir.file("victim");
  std::ofstream(victim) << "precious\n";
  // at the final name: refused, and the link's target untouched
  const std::string planted = dir.file("t.json");
  REQUIRE(::symlink(victim.c_str(), planted.c_str()) == 0);
  REQUIRE_THROWS_MATCHES(course::write_file_atomically(planted, "", "{}", "trace"), CourseError,
                         MessageContains("'" + planted + "': it is a symbolic link"));
  std::ifstream in(victim);
  CHECK(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()) == "precious\n");
  // the old temporary name (path.tmp<pid>) planted as a link: the writer does not use it
  const std::string path = dir.file("state.json");
  const std::string old_temporary = path + ".tmp" + std::to_string(::getpid());
  REQUIRE(::symlink(victim.c_str(), old_temporary.c_str()) == 0);
  course::write_file_atomically(path, "", "{}", "trace");
  std::ifstream written(path);
  CHECK(std::string(std::istreambuf_iterator<char>(written), std::istreambuf_iterator<char>()) == "{}");
  std::ifstream again(victim);
  CHECK(std::string(std::istreambuf_iterator<char>(again), std::istreambuf_iterator<char>()) == "precious\n");
}

TEST_CASE("a checkpoint that is a symbolic link is refused: the course loads only the files it wrote", "[unit]") {
  TempDir dir;
  const std::string real = dir.file("elsewhere.ckpt");
  write_example(real);
  const std::string linked = dir.file("step_00000002.ckpt");
  REQUIRE(::symlink(real.c_str(), linked.c_str()) == 0);
  REQUIRE_THROWS_MATCHES(CheckpointReader(linked), CourseError, MessageContains("is a symbolic link"));
}
