// The checkpoint manifest: one text file that says what a sharded checkpoint
// holds, so that any number of ranks, cut any way, can load it (resharding), and a
// tool can put it back together as one chapter-00 checkpoint.
//
// Every chapter that saves one file per rank cuts the same model differently:
// ZeRO-1/2 a contiguous slice of chapter 00's flat buffer, ZeRO-3 a slice of every
// model stage, pipelines whole stages, tensor parallelism rows or columns of each
// matrix. The manifest describes all of them the same way: the model's parameters
// (chapter 00's names, shapes and order, common/model/model.h), and for every shard (a
// file's params/adam_m/adam_v sections) the pieces of parameters it holds, in the
// order they lie in the sections.
//
// A piece is `rows` runs of `count` elements of one parameter, the first at
// element `first` (row-major index within the parameter), each next one `stride`
// elements further: a contiguous slice has rows = 1; a rank's columns of a
// (R, K) matrix are rows = R, stride = K.
//
// The file ("step_00000004.manifest", written by rank 0 before its shard):
//
//   course checkpoint manifest 1
//   layout 03_fsdp ZeRO-3, 4 ranks             (free text, for people)
//   meta step 4                                 (also seed, global_batch, world_size and
//   meta seed 1337                               the model: vocab_size, seq_len, n_layer,
//   ...                                          d_model, n_head)
//   param wte 256 32                            (every parameter, chapter 00's order)
//   ...
//   shard step_00000004_rank0.ckpt params adam_m adam_v    (the file, its three sections)
//   piece wte 0 2048                            (name, first, count)
//   piece block0.proj_w 0 8 32 32               (name, first, count, rows, stride)
//   ...
//   end
//
// Reading checks every line, that the meta describe the parameters listed, that
// every piece lies inside its parameter, that every element of every parameter is
// held by some shard (replicated ones by several), and the final "end" (a file cut
// short). A problem is a UsageError (exit 2) naming the file and the line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/model/model.h"

namespace course {

struct TrainOptions;

struct ManifestParam {
  std::string name;            // chapter 00's, e.g. "block0.qkv_w"
  std::vector<int64_t> shape;  // the whole parameter's
  size_t numel = 0;
  size_t offset = 0;           // where it starts in chapter 00's flat buffer
};

struct ManifestPiece {
  std::string param;
  size_t first = 0;   // element index within the parameter (row-major)
  size_t count = 0;   // elements per run
  size_t rows = 1;    // runs
  size_t stride = 0;  // elements from one run's start to the next's (rows > 1)
  size_t floats() const { return count * rows; }
};

struct ManifestShard {
  std::string file;                 // a file name in the checkpoint's directory
  std::string params, adam_m, adam_v;  // its section names holding the pieces
  std::vector<ManifestPiece> pieces;   // in section order
  size_t floats() const;
};

struct CheckpointManifest {
  std::string layout;                    // how the writer cut the model, for people
  std::map<std::string, int64_t> meta;   // step, seed, global_batch, world_size, the model shape
  std::vector<ManifestParam> params;     // chapter 00's order
  std::vector<ManifestShard> shards;
  int64_t get(const std::string& key) const;  // CourseError when absent
};

// Chapter 00's parameters: names, shapes, flat offsets.
std::vector<ManifestParam> manifest_params(const GPTConfig& config);
// The pieces of elements [begin, begin + count) of chapter 00's flat buffer: one
// per parameter the range touches.
std::vector<ManifestPiece> pieces_of_flat_range(const std::vector<ManifestParam>& params, size_t begin,
                                                size_t count);
// The pieces holding `count` elements of parameter `param` when element i of the
// holder is element global_of(i) of the parameter: consecutive indices make a run,
// and runs of one length at one distance make one strided piece (a rank's columns).
std::vector<ManifestPiece> pieces_of_indices(const std::string& param, size_t count,
                                             const std::function<size_t(size_t)>& global_of);
// "step_00000004_rank3.ckpt": rank 3's file of step 4, as a manifest names it.
std::string rank_file_name(int step, int rank);
// "step_00000004.ckpt": the file of step 4 that holds the whole model (chapter 00's).
std::string whole_file_name(int step);
// A manifest for this run's step with the model's parameters and meta, no shards yet.
CheckpointManifest start_manifest(const TrainOptions& options, int step, int world_size, const std::string& layout);
// The manifest of one file holding the whole model in chapter 00's format (chapter 00's
// and 02's checkpoints, and what consolidate_checkpoint and import_safetensors write):
// one shard with every parameter in flat order, its meta read from the file. With it,
// a sharded chapter loads its pieces out of that file as out of its own.
CheckpointManifest whole_checkpoint_manifest(const std::string& path);

// "<dir>/step_00000004.manifest"
std::string manifest_path(const std::string& dir, int step);
// Written atomically (temporary file, then rename); CourseError on I/O failure.
void write_manifest(const std::string& path, const CheckpointManifest& manifest);
// Rank 0's part of a per-rank save, before its own file (so a step whose every file
// exists has its manifest): writes the step's manifest into dir and deletes all but
// the newest 2, as the trainers prune their files.
void save_manifest(const std::string& dir, const CheckpointManifest& manifest);
// Reads and checks a manifest (see above); UsageError naming the file and line.
CheckpointManifest read_manifest(const std::string& path);
// The model shape the manifest's meta give.
GPTConfig manifest_config(const CheckpointManifest& manifest);

// Resharding: fills this run's buffers, laid out as `wanted` (its pieces end to
// end), from the shards of the checkpoint in `dir` that `manifest` describes.
// Only the files holding a wanted element are read. Any buffer may be null (not
// wanted). A file whose step, seed, batch or section sizes disagree with the
// manifest is a UsageError naming it.
// The three buffers are on `device` (each piece is copied there from the file's values).
void load_pieces(const CheckpointManifest& manifest, const std::string& dir, const std::vector<ManifestPiece>& wanted,
                 float* params, float* adam_m, float* adam_v, Device device = Device::CPU);

}  // namespace course
