// The checkpoint manifest (common/train/checkpoint_manifest.h): shards written with one
// cut load into any other (resharding), strided pieces (a rank's columns) included,
// and every way a manifest can be damaged or disagree with its files is refused as a
// usage error (exit 2) naming the file and, where there is one, the line.
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "common/train/checkpoint.h"
#include "common/train/checkpoint_manifest.h"
#include "common/train/cli.h"
#include "common/tensor/error.h"
#include "support/matchers.h"
#include "support/process.h"

using course::CheckpointManifest;
using course::ManifestPiece;
using course_test::MessageContains;
using course_test::TempDir;

namespace {

// A model small enough to check element by element: 1 block, C = 8.
course::TrainOptions small_run() {
  course::TrainOptions options;
  options.model.vocab_size = 16;
  options.model.seq_len = 4;
  options.model.n_layer = 1;
  options.model.d_model = 8;
  options.model.n_head = 2;
  options.batch = 4;
  return options;
}

// Element i of chapter 00's flat buffer holds i in params, -i in adam_m, i/2 in adam_v.
float param_value(size_t i) { return static_cast<float>(i); }

// Writes step 3 of `options`'s model cut into `ranks` contiguous slices of the flat
// buffer (ZeRO-1's cut), files and manifest, into dir; returns the manifest.
CheckpointManifest write_flat_shards(const std::string& dir, const course::TrainOptions& options, int ranks) {
  CheckpointManifest manifest = course::start_manifest(options, 3, ranks, "test: flat cut");
  const size_t P = course::count_parameters(options.model), S = (P + ranks - 1) / ranks;
  for (int rank = 0; rank < ranks; rank++) {
    const size_t begin = std::min(P, rank * S), count = std::min(S, P - begin);
    std::vector<float> params(count), m(count), v(count);
    for (size_t i = 0; i < count; i++) {
      params[i] = param_value(begin + i);
      m[i] = -param_value(begin + i);
      v[i] = param_value(begin + i) / 2;
    }
    course::CheckpointWriter writer;
    course::write_rank_meta(writer, options, 3, ranks, rank);
    writer.add_section("params", params.data(), count);
    writer.add_section("adam_m", m.data(), count);
    writer.add_section("adam_v", v.data(), count);
    const std::string name = "step_00000003_rank" + std::to_string(rank) + ".ckpt";
    writer.write(dir + "/" + name);
    manifest.shards.push_back({name, "params", "adam_m", "adam_v",
                               course::pieces_of_flat_range(manifest.params, begin, count)});
  }
  course::write_manifest(course::manifest_path(dir, 3), manifest);
  return manifest;
}

// The manifest's text with `from` replaced by `to` (the first time it appears).
std::string edited(const std::string& text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.substr(0, at) + to + text.substr(at + from.size());
}

}  // namespace

TEST_CASE("a checkpoint cut one way loads cut another way: slices, strided columns, the whole model",
          "[unit]") {
  TempDir dir;
  const course::TrainOptions options = small_run();
  write_flat_shards(dir.path(), options, 3);
  const CheckpointManifest manifest = course::read_manifest(course::manifest_path(dir.path(), 3));
  REQUIRE(manifest.get("step") == 3);
  REQUIRE(manifest.shards.size() == 3);
  const size_t P = course::count_parameters(options.model);

  SECTION("the whole model: chapter 00's flat buffer, every element from the file that holds it") {
    std::vector<float> params(P), m(P), v(P);
    course::load_pieces(manifest, dir.path(), course::pieces_of_flat_range(manifest.params, 0, P), params.data(),
                        m.data(), v.data());
    for (size_t i = 0; i < P; i++) {
      INFO("element " << i);
      REQUIRE(params[i] == param_value(i));
      REQUIRE(m[i] == -param_value(i));
      REQUIRE(v[i] == param_value(i) / 2);
    }
  }
  SECTION("a slice across shard and parameter boundaries, as a rank of another world size wants it") {
    const size_t begin = P / 3 - 5, count = P / 3;
    std::vector<float> params(count);
    course::load_pieces(manifest, dir.path(), course::pieces_of_flat_range(manifest.params, begin, count),
                        params.data(), nullptr, nullptr);
    for (size_t i = 0; i < count; i++) REQUIRE(params[i] == param_value(begin + i));
  }
  SECTION("columns 2..5 of block0.fcproj_w (8 x 32): 8 runs of 4, 32 apart") {
    const ManifestPiece columns{"block0.fcproj_w", 2, 4, 8, 32};
    size_t offset = 0;
    for (const course::ManifestParam& param : manifest.params) {
      if (param.name == "block0.fcproj_w") offset = param.offset;
    }
    std::vector<float> params(columns.floats());
    course::load_pieces(manifest, dir.path(), {columns}, params.data(), nullptr, nullptr);
    for (size_t row = 0; row < 8; row++) {
      for (size_t col = 0; col < 4; col++) REQUIRE(params[row * 4 + col] == param_value(offset + row * 32 + 2 + col));
    }
  }
}

TEST_CASE("an MoE model's manifest lists its router and stacked experts, one expert a piece of rows", "[unit]") {
  TempDir dir;
  course::TrainOptions options = small_run();
  options.model.n_experts = 4;
  options.model.top_k = 2;
  write_flat_shards(dir.path(), options, 3);
  const std::string text = course_test::read_file(course::manifest_path(dir.path(), 3));
  CHECK_THAT(text, Catch::Contains("meta n_experts 4\n") && Catch::Contains("meta top_k 2\n") &&
                       Catch::Contains("param block0.router_w 4 8\n") &&
                       Catch::Contains("param block0.expert_fc_w 4 32 8\n") && !Catch::Contains("block0.fc_w"));
  const CheckpointManifest manifest = course::read_manifest(course::manifest_path(dir.path(), 3));
  CHECK(course::manifest_config(manifest).n_experts == 4);
  CHECK(course::manifest_config(manifest).top_k == 2);

  // expert 2's fc weight: rows [2 x 32, 3 x 32) of the (4 x 32, 8) stack, one contiguous run
  const ManifestPiece expert_2{"block0.expert_fc_w", 2 * 32 * 8, 32 * 8, 1, 32 * 8};
  size_t offset = 0;
  for (const course::ManifestParam& param : manifest.params) {
    if (param.name == "block0.expert_fc_w") offset = param.offset;
  }
  std::vector<float> params(expert_2.floats());
  course::load_pieces(manifest, dir.path(), {expert_2}, params.data(), nullptr, nullptr);
  for (size_t i = 0; i < params.size(); i++) REQUIRE(params[i] == param_value(offset + 2 * 32 * 8 + i));

  // a dense model's manifest says nothing of experts, and reads as n_experts 0
  TempDir dense_dir;
  write_flat_shards(dense_dir.path(), small_run(), 2);
  CHECK_THAT(course_test::read_file(course::manifest_path(dense_dir.path(), 3)), !Catch::Contains("n_experts"));
  CHECK(course::read_manifest(course::manifest_path(dense_dir.path(), 3)).get("n_experts") == 0);
}

TEST_CASE("a damaged manifest is refused as a usage error naming the file and the line", "[unit]") {
  TempDir dir;
  write_flat_shards(dir.path(), small_run(), 2);
  const std::string path = course::manifest_path(dir.path(), 3);
  const std::string good = course_test::read_file(path);
  struct Damage {
    std::string text, message;
  };
  const std::vector<Damage> damages = {
      {edited(good, "end\n", ""), "no 'end' line: the file is cut short"},
      {edited(good, "course checkpoint manifest 1", "course checkpoint manifest 9"),
       "line 1: not a course checkpoint manifest"},
      {edited(good, "meta step 3", "meta step x3"), "line 9: meta step: 'x3' is not a count"},
      {edited(good, "meta n_layer 1", "meta n_layer 2"), "lists 17 parameters, a model of n_layer 2 has 29"},
      {edited(good, "param wpe 4 8", "param wpe 8 4"), "parameter 1 is wpe, the model's is wpe (or its shape differs)"},
      {edited(good, "piece wte 0 128", "piece wte 0 120"), "8 of the 128 elements of wte are in no shard"},
      {edited(good, "piece wte 0 128", "piece wte 0 129"), "a piece of wte runs past its 128 elements"},
      // a bound computed naively wraps around: (rows - 1) x stride = 2^64
      {edited(good, "piece wte 0 128", "piece wte 0 1 4294967297 4294967296"),
       "a piece of wte runs past its 128 elements"},
      {edited(good, "piece wte 0 128", "piece wtf 0 128"), "holds unknown parameter wtf"},
      {edited(good, "shard step_00000003_rank0.ckpt", "shard ../step_00000003_rank0.ckpt"),
       "is not a plain file name"},
      {edited(good, "piece wte 0 128", "slice wte 0 128"), "unknown entry 'slice'"},
  };
  const size_t index = GENERATE(range(0, 11));
  REQUIRE(index < damages.size());
  course_test::write_file(path, damages[index].text);
  try {
    course::read_manifest(path);
    FAIL("the damaged manifest was accepted: " << damages[index].message);
  } catch (const course::UsageError& error) {
    CHECK(error.exit_code() == 2);
    CHECK_THAT(error.what(), Catch::Contains("checkpoint manifest '" + path + "'") &&
                                 Catch::Contains(damages[index].message) && Catch::Contains("hint:"));
  }
}

TEST_CASE("a missing manifest, or a shard file that disagrees with it, is a usage error naming it", "[unit]") {
  TempDir dir;
  const course::TrainOptions options = small_run();
  CheckpointManifest manifest = write_flat_shards(dir.path(), options, 2);
  const size_t P = course::count_parameters(options.model);
  std::vector<float> params(P);
  const std::vector<ManifestPiece> whole = course::pieces_of_flat_range(manifest.params, 0, P);

  CHECK_THROWS_MATCHES(course::read_manifest(course::manifest_path(dir.path(), 7)), course::UsageError,
                       MessageContains("step_00000007.manifest': cannot be opened"));
  // the manifest says rank 1's file holds one float fewer than it does
  manifest.shards[1].pieces.back().count -= 1;
  CHECK_THROWS_MATCHES(course::load_pieces(manifest, dir.path(), whole, params.data(), nullptr, nullptr),
                       course::UsageError, MessageContains("step_00000003_rank1.ckpt': section 'params' holds"));
  manifest.shards[1].pieces.back().count += 1;
  manifest.meta["step"] = 4;  // a manifest of another step than its files
  CHECK_THROWS_MATCHES(course::load_pieces(manifest, dir.path(), whole, params.data(), nullptr, nullptr),
                       course::UsageError, MessageContains("was written with step 3, its manifest says step 4"));
  manifest.meta["step"] = 3;
  manifest.meta["seed"] = 7;  // or of another run
  CHECK_THROWS_MATCHES(course::load_pieces(manifest, dir.path(), whole, params.data(), nullptr, nullptr),
                       course::UsageError, MessageContains("was written with --seed 1337, its manifest says --seed 7"));
  manifest.meta["seed"] = 1337;
  // the two ranks' files swapped: each is the other's
  const std::string rank0 = dir.file("step_00000003_rank0.ckpt"), rank1 = dir.file("step_00000003_rank1.ckpt");
  std::filesystem::rename(rank0, dir.file("swap"));
  std::filesystem::rename(rank1, rank0);
  std::filesystem::rename(dir.file("swap"), rank1);
  CHECK_THROWS_MATCHES(course::load_pieces(manifest, dir.path(), whole, params.data(), nullptr, nullptr),
                       course::UsageError,
                       MessageContains("step_00000003_rank0.ckpt' is rank 1's file of a 2-rank run, but the manifest "
                                       "lists it as step_00000003_rank0.ckpt of 2 ranks"));
}

TEST_CASE("a chapter-00 file reads as a one-shard manifest that any cut loads, and is refused renamed", "[unit]") {
  TempDir dir;
  const course::TrainOptions options = small_run();
  const size_t P = course::count_parameters(options.model);
  std::vector<float> params(P), m(P), v(P);  // (P) each: chapter 00's flat buffers
  for (size_t i = 0; i < P; i++) {
    params[i] = param_value(i);
    m[i] = -param_value(i);
    v[i] = param_value(i) / 2;
  }
  course::CheckpointWriter writer;  // what save_training_state writes: no rank, no world size
  course::write_run_meta(writer, options, 3);
  writer.add_section("params", params.data(), P);
  writer.add_section("adam_m", m.data(), P);
  writer.add_section("adam_v", v.data(), P);
  writer.write(course::checkpoint_path(dir.path(), 3));

  const CheckpointManifest manifest = course::whole_checkpoint_manifest(course::checkpoint_path(dir.path(), 3));
  CHECK(manifest.get("step") == 3);
  CHECK(manifest.get("world_size") == 1);
  REQUIRE(manifest.shards.size() == 1);
  CHECK(manifest.shards[0].file == "step_00000003.ckpt");
  CHECK(manifest.shards[0].floats() == P);
  // a rank's slice across parameter boundaries, as ZeRO wants it
  const size_t begin = P / 3 - 5, count = P / 3;
  std::vector<float> slice(count), slice_m(count);  // (count) each
  course::load_pieces(manifest, dir.path(), course::pieces_of_flat_range(manifest.params, begin, count), slice.data(),
                      slice_m.data(), nullptr);
  for (size_t i = 0; i < count; i++) {
    REQUIRE(slice[i] == param_value(begin + i));
    REQUIRE(slice_m[i] == -param_value(begin + i));
  }
  // the file renamed to another step's name: its own step says which it is
  std::filesystem::rename(course::checkpoint_path(dir.path(), 3), course::checkpoint_path(dir.path(), 5));
  const CheckpointManifest renamed = course::whole_checkpoint_manifest(course::checkpoint_path(dir.path(), 5));
  CHECK_THROWS_MATCHES(course::load_pieces(renamed, dir.path(), course::pieces_of_flat_range(renamed.params, 0, P),
                                           params.data(), nullptr, nullptr),
                       course::UsageError,
                       MessageContains("step_00000005.ckpt' is the whole model's file of step 3 "
                                       "(step_00000003.ckpt), but the manifest lists it as step_00000005.ckpt (hint"));
}

TEST_CASE("pieces_of_indices makes runs of consecutive indices and strided pieces of equal runs", "[unit]") {
  // a rank's 2 of 8 columns of a (3, 8) matrix: one piece of 3 runs of 2, 8 apart
  const auto columns = course::pieces_of_indices("w", 6, [](size_t i) { return (i / 2) * 8 + 4 + i % 2; });
  REQUIRE(columns.size() == 1);
  CHECK((columns[0].first == 4 && columns[0].count == 2 && columns[0].rows == 3 && columns[0].stride == 8));
  // contiguous: one run
  const auto whole = course::pieces_of_indices("b", 5, [](size_t i) { return 10 + i; });
  REQUIRE(whole.size() == 1);
  CHECK((whole[0].first == 10 && whole[0].count == 5 && whole[0].rows == 1));
  // runs of another length, or at another distance, start a new piece
  const std::vector<size_t> indices = {0, 1, 4, 5, 8, 20, 21};
  const auto mixed = course::pieces_of_indices("m", indices.size(), [&](size_t i) { return indices[i]; });
  REQUIRE(mixed.size() == 3);
  CHECK((mixed[0].first == 0 && mixed[0].count == 2 && mixed[0].rows == 2 && mixed[0].stride == 4));
  CHECK((mixed[1].first == 8 && mixed[1].count == 1 && mixed[1].rows == 1));
  CHECK((mixed[2].first == 20 && mixed[2].count == 2 && mixed[2].rows == 1));
}
