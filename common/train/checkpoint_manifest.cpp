#include "common/train/checkpoint_manifest.h"

#include "common/tensor/device.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/train/checkpoint.h"
#include "common/train/cli.h"
#include "common/tensor/error.h"

namespace course {

namespace fs = std::filesystem;

static const char kHeader[] = "course checkpoint manifest 1";
// the meta every manifest carries: the run's position and the model's shape
static const char* const kRequiredMeta[] = {"step",     "seed",    "global_batch", "world_size", "vocab_size",
                                            "seq_len", "n_layer", "d_model",      "n_head"};

size_t ManifestShard::floats() const {
  size_t total = 0;
  for (const ManifestPiece& piece : pieces) total += piece.floats();
  return total;
}

int64_t CheckpointManifest::get(const std::string& key) const {
  auto found = meta.find(key);
  if (found == meta.end() && absent_meta_value(key)) return *absent_meta_value(key);
  if (found == meta.end()) throw CourseError("checkpoint manifest has no '" + key + "' entry");
  return found->second;
}

std::vector<ManifestParam> manifest_params(const GPTConfig& config) {
  std::vector<ManifestParam> params;
  size_t stage_offset = 0;
  for (const StageLayout& stage : model_layout(config)) {
    for (const ParamSpec& spec : stage.params) params.push_back({spec.name, spec.shape, spec.numel, stage_offset + spec.offset});
    stage_offset += stage.numel;
  }
  return params;
}

std::vector<ManifestPiece> pieces_of_flat_range(const std::vector<ManifestParam>& params, size_t begin,
                                                size_t count) {
  std::vector<ManifestPiece> pieces;
  for (const ManifestParam& param : params) {
    const size_t first = std::max(begin, param.offset);
    const size_t end = std::min(begin + count, param.offset + param.numel);
    if (first < end) pieces.push_back({param.name, first - param.offset, end - first, 1, end - first});
  }
  return pieces;
}

std::vector<ManifestPiece> pieces_of_indices(const std::string& param, size_t count,
                                             const std::function<size_t(size_t)>& global_of) {
  std::vector<ManifestPiece> pieces;
  size_t i = 0;
  while (i < count) {
    // the run starting at i: as long as the indices go up by one
    const size_t first = global_of(i);
    size_t length = 1;
    while (i + length < count && global_of(i + length) == first + length) length++;
    i += length;
    ManifestPiece* last = pieces.empty() ? nullptr : &pieces.back();
    const bool same_length = last != nullptr && last->count == length && first >= last->first + last->count;
    if (same_length && last->rows == 1) {  // the second run fixes the stride
      last->stride = first - last->first;
      last->rows = 2;
    } else if (same_length && first == last->first + last->rows * last->stride) {
      last->rows++;
    } else {
      pieces.push_back({param, first, length, 1, length});
    }
  }
  return pieces;
}

std::string rank_file_name(int step, int rank) {
  return fs::path(checkpoint_path("", step, rank_suffix(rank))).filename().string();
}

std::string whole_file_name(int step) { return fs::path(checkpoint_path("", step)).filename().string(); }

// A manifest of the model `config` with the run's position and no shards yet.
static CheckpointManifest empty_manifest(const GPTConfig& config, int64_t step, int64_t seed, int64_t global_batch,
                                         int world_size, const std::string& layout) {
  CheckpointManifest manifest;
  manifest.layout = layout;
  manifest.meta = {{"step", step},
                   {"seed", seed},
                   {"global_batch", global_batch},
                   {"world_size", world_size},
                   {"vocab_size", config.vocab_size},
                   {"seq_len", config.seq_len},
                   {"n_layer", config.n_layer},
                   {"d_model", config.d_model},
                   {"n_head", config.n_head}};
  if (config.n_experts > 0) {
    manifest.meta["n_experts"] = config.n_experts;
    manifest.meta["top_k"] = config.top_k;
  }
  manifest.params = manifest_params(config);
  return manifest;
}

CheckpointManifest start_manifest(const TrainOptions& options, int step, int world_size, const std::string& layout) {
  return empty_manifest(options.model, step, static_cast<int64_t>(options.seed), options.batch, world_size, layout);
}

CheckpointManifest whole_checkpoint_manifest(const std::string& path) {
  const CheckpointReader reader(path);  // verified whole, or a CourseError naming it
  const auto saved = [&](const std::string& key) { return reader.meta(key); };
  const GPTConfig config = model_from_meta(saved);
  CheckpointManifest manifest = empty_manifest(config, saved("step"), saved("seed"), saved("global_batch"), 1,
                                               "one file of the whole model (chapter 00's format)");
  // the file's own name: load_pieces refuses it when its step says another (a renamed file)
  ManifestShard shard{fs::path(path).filename().string(), "params", "adam_m", "adam_v",
                      pieces_of_flat_range(manifest.params, 0, count_parameters(config))};
  manifest.shards.push_back(std::move(shard));
  return manifest;
}

GPTConfig manifest_config(const CheckpointManifest& manifest) {
  return model_from_meta([&](const std::string& key) { return manifest.get(key); });
}

std::string manifest_path(const std::string& dir, int step) {
  std::string path = checkpoint_path(dir, step);  // "<dir>/step_00000004.ckpt"
  return path.substr(0, path.size() - 5) + ".manifest";
}

// ----------------------------------------------------------------------------
// writing

void write_manifest(const std::string& path, const CheckpointManifest& manifest) {
  std::ostringstream text;
  text << kHeader << "\nlayout " << manifest.layout << "\n";
  for (const auto& [key, value] : manifest.meta) text << "meta " << key << " " << value << "\n";
  for (const ManifestParam& param : manifest.params) {
    text << "param " << param.name;
    for (int64_t size : param.shape) text << " " << size;
    text << "\n";
  }
  for (const ManifestShard& shard : manifest.shards) {
    text << "shard " << shard.file << " " << shard.params << " " << shard.adam_m << " " << shard.adam_v << "\n";
    for (const ManifestPiece& piece : shard.pieces) {
      text << "piece " << piece.param << " " << piece.first << " " << piece.count;
      if (piece.rows > 1) text << " " << piece.rows << " " << piece.stride;
      text << "\n";
    }
  }
  text << "end\n";

  write_file_atomically(path, "", text.str(), "checkpoint manifest");
}

void save_manifest(const std::string& dir, const CheckpointManifest& manifest) {
  write_manifest(manifest_path(dir, static_cast<int>(manifest.get("step"))), manifest);
  prune_checkpoints(dir, /*keep=*/2, "", ".manifest");
}

// ----------------------------------------------------------------------------
// reading

namespace {

// Reads a manifest line by line; every complaint names the file and the line.
class ManifestParser {
 public:
  explicit ManifestParser(const std::string& path) : path_(path) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw UsageError("checkpoint manifest '" + path_ + "'" + (line_ > 0 ? " line " + std::to_string(line_) : "") +
                     ": " + what + " (hint: the manifest is written by the trainer; use the checkpoint's own, " +
                     "or resume from an older step)");
  }

  CheckpointManifest parse(std::istream& in) {
    CheckpointManifest manifest;
    std::string text;
    bool ended = false;
    while (std::getline(in, text)) {
      line_++;
      if (ended) fail("text after 'end'");
      std::istringstream words(text);
      std::string keyword;
      words >> keyword;
      if (line_ == 1) {
        if (text != kHeader) fail("not a course checkpoint manifest (the first line is not '" + std::string(kHeader) + "')");
      } else if (keyword == "layout") {
        manifest.layout = text.size() > 7 ? text.substr(7) : "";
      } else if (keyword == "meta") {
        std::string key = word(words, "a meta key");
        manifest.meta[key] = static_cast<int64_t>(number(words, "meta " + key));
        at_end(words);
      } else if (keyword == "param") {
        manifest.params.push_back(param(words));
      } else if (keyword == "shard") {
        manifest.shards.push_back(shard(words));
      } else if (keyword == "piece") {
        if (manifest.shards.empty()) fail("a piece before any shard");
        manifest.shards.back().pieces.push_back(piece(words));
      } else if (keyword == "end") {
        ended = true;
      } else {
        fail("unknown entry '" + keyword + "'");
      }
    }
    line_ = 0;  // from here on, the complaints are about the whole file
    if (!ended) fail("no 'end' line: the file is cut short");
    return manifest;
  }

 private:
  std::string word(std::istringstream& words, const std::string& what) {
    std::string value;
    if (!(words >> value)) fail("missing " + what);
    return value;
  }
  uint64_t number(std::istringstream& words, const std::string& what) {
    const std::string text = word(words, what);
    if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos) {
      fail(what + ": '" + text + "' is not a count");
    }
    return std::stoull(text);
  }
  void at_end(std::istringstream& words) {
    std::string extra;
    if (words >> extra) fail("unexpected '" + extra + "'");
  }
  ManifestParam param(std::istringstream& words) {
    ManifestParam param;
    param.name = word(words, "a parameter name");
    param.numel = 1;
    std::string size;
    while (words >> size) {
      std::istringstream one(size);
      param.shape.push_back(static_cast<int64_t>(number(one, "the size of " + param.name)));
      param.numel *= static_cast<size_t>(param.shape.back());
    }
    if (param.shape.empty()) fail("parameter " + param.name + " has no shape");
    return param;
  }
  ManifestShard shard(std::istringstream& words) {
    ManifestShard shard;
    shard.file = word(words, "a file name");
    if (shard.file.find('/') != std::string::npos || shard.file == "..") {
      fail("shard file '" + shard.file + "' is not a plain file name in the checkpoint's directory");
    }
    shard.params = word(words, "the params section");
    shard.adam_m = word(words, "the adam_m section");
    shard.adam_v = word(words, "the adam_v section");
    at_end(words);
    return shard;
  }
  ManifestPiece piece(std::istringstream& words) {
    ManifestPiece piece;
    piece.param = word(words, "a parameter name");
    piece.first = number(words, "first");
    piece.count = number(words, "count");
    std::string rows;
    if (words >> rows) {
      std::istringstream one(rows);
      piece.rows = number(one, "rows");
      piece.stride = number(words, "stride");
    } else {
      piece.stride = piece.count;
    }
    at_end(words);
    if (piece.count == 0 || piece.rows == 0) fail("an empty piece of " + piece.param);
    if (piece.rows > 1 && piece.stride < piece.count) fail("a piece of " + piece.param + " whose runs overlap");
    return piece;
  }

  const std::string& path_;
  int line_ = 0;
};

// Whether a piece lies inside a parameter of `numel` elements. A manifest comes from
// disk, so its numbers are not trusted: the bound is computed so that no sum or
// product can wrap around, and a piece has at most one run per element.
bool piece_fits(const ManifestPiece& piece, size_t numel) {
  if (piece.count == 0 || piece.rows == 0 || piece.rows > numel) return false;
  if (piece.count > numel || piece.first > numel - piece.count) return false;
  if (piece.rows == 1 || piece.stride == 0) return true;
  const size_t room = numel - piece.count - piece.first;  // how far past `first` the last run may start
  return piece.rows - 1 <= room / piece.stride;
}

// Every element of every parameter held by at least one shard, and nothing outside them.
void check_coverage(const CheckpointManifest& manifest, const ManifestParser& parser) {
  std::map<std::string, const ManifestParam*> by_name;
  size_t total = 0;
  for (const ManifestParam& param : manifest.params) {
    by_name[param.name] = &param;
    total += param.numel;
  }
  std::vector<char> held(total, 0);  // (P)  whether some shard holds chapter 00's element i
  for (const ManifestShard& shard : manifest.shards) {
    for (const ManifestPiece& piece : shard.pieces) {
      auto found = by_name.find(piece.param);
      if (found == by_name.end()) parser.fail("shard " + shard.file + " holds unknown parameter " + piece.param);
      const ManifestParam& param = *found->second;
      if (!piece_fits(piece, param.numel)) {
        parser.fail("shard " + shard.file + ": a piece of " + piece.param + " runs past its " +
                    std::to_string(param.numel) + " elements");
      }
      for (size_t row = 0; row < piece.rows; row++) {
        char* start = held.data() + param.offset + piece.first + row * piece.stride;
        std::fill(start, start + piece.count, 1);
      }
    }
  }
  for (const ManifestParam& param : manifest.params) {
    const char* start = held.data() + param.offset;
    const size_t missing = static_cast<size_t>(std::count(start, start + param.numel, 0));
    if (missing > 0) {
      parser.fail(std::to_string(missing) + " of the " + std::to_string(param.numel) + " elements of " + param.name +
                  " are in no shard");
    }
  }
}

}  // namespace

CheckpointManifest read_manifest(const std::string& path) {
  ManifestParser parser(path);
  if (fs::is_directory(path)) parser.fail("is a directory");
  std::ifstream file(path);
  if (!file) parser.fail("cannot be opened (is the checkpoint complete? every sharded save writes one)");
  CheckpointManifest manifest = parser.parse(file);
  for (const char* key : kRequiredMeta) {
    if (manifest.meta.count(key) == 0) parser.fail(std::string("no 'meta ") + key + "' line");
  }
  // the parameters must be the model the meta describe, in chapter 00's order;
  // counted first (12 per block, 13 with experts, 2 in the embedding, 3 in the
  // head), so that a corrupt n_layer cannot make a huge layout
  const int64_t layers = manifest.get("n_layer"), per_block = manifest.get("n_experts") > 0 ? 13 : 12;
  if (layers < 1 || static_cast<size_t>(layers) > manifest.params.size() ||
      manifest.params.size() != per_block * static_cast<size_t>(layers) + 5) {
    parser.fail("lists " + std::to_string(manifest.params.size()) + " parameters, a model of n_layer " +
                std::to_string(layers) + " has " + std::to_string(per_block * layers + 5));
  }
  const std::vector<ManifestParam> expected = manifest_params(manifest_config(manifest));
  for (size_t i = 0; i < expected.size(); i++) {
    if (manifest.params[i].name != expected[i].name || manifest.params[i].shape != expected[i].shape) {
      parser.fail("parameter " + std::to_string(i) + " is " + manifest.params[i].name + ", the model's is " +
                  expected[i].name + " (or its shape differs)");
    }
    manifest.params[i].offset = expected[i].offset;
  }
  if (manifest.shards.empty()) parser.fail("lists no shard");
  check_coverage(manifest, parser);
  return manifest;
}

// ----------------------------------------------------------------------------
// resharding

namespace {

// One run of a piece: `count` floats at `global` in chapter 00's flat buffer and at
// `local` in a shard's (or this run's) buffer.
struct Run {
  size_t global, local, count;
};

std::vector<Run> runs_of(const std::vector<ManifestPiece>& pieces, const std::map<std::string, size_t>& offsets) {
  std::vector<Run> runs;
  size_t local = 0;
  for (const ManifestPiece& piece : pieces) {
    const size_t start = offsets.at(piece.param) + piece.first;
    for (size_t row = 0; row < piece.rows; row++) {
      runs.push_back({start + row * piece.stride, local, piece.count});
      local += piece.count;
    }
  }
  std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.global < b.global; });
  return runs;
}

// `count` floats to copy from a shard's buffer at `from` to this run's at `to`.
struct Copy {
  size_t from, to, count;
};

// Where the runs a shard holds and the runs this run wants overlap. Both lists are
// sorted and neither overlaps itself, so one sweep finds every overlap.
std::vector<Copy> overlaps(const std::vector<Run>& held, const std::vector<Run>& wanted) {
  std::vector<Copy> copies;
  size_t h = 0, w = 0;
  while (h < held.size() && w < wanted.size()) {
    const size_t begin = std::max(held[h].global, wanted[w].global);
    const size_t held_end = held[h].global + held[h].count, wanted_end = wanted[w].global + wanted[w].count;
    const size_t end = std::min(held_end, wanted_end);
    if (begin < end) {
      copies.push_back({held[h].local + (begin - held[h].global), wanted[w].local + (begin - wanted[w].global),
                        end - begin});
    }
    if (held_end < wanted_end) {
      h++;
    } else {
      w++;
    }
  }
  return copies;
}

}  // namespace

void load_pieces(const CheckpointManifest& manifest, const std::string& dir, const std::vector<ManifestPiece>& wanted,
                 float* params, float* adam_m, float* adam_v, Device device) {
  std::map<std::string, size_t> offsets;
  for (const ManifestParam& param : manifest.params) offsets[param.name] = param.offset;
  for (const ManifestPiece& piece : wanted) {
    if (offsets.count(piece.param) == 0) {
      throw UsageError("the checkpoint in '" + dir + "' has no parameter " + piece.param +
                       " (hint: resume with the model flags it was written with)");
    }
  }
  const std::vector<Run> wanted_runs = runs_of(wanted, offsets);
  for (const ManifestShard& shard : manifest.shards) {
    const std::vector<Copy> copies = overlaps(runs_of(shard.pieces, offsets), wanted_runs);
    if (copies.empty()) continue;  // nothing this run needs: the file is not read
    const std::string path = (fs::path(dir) / shard.file).string();
    CheckpointReader reader(path);  // verified whole, or a CourseError naming it
    // a file of another run (another step, seed or batch) with the same name and sizes
    // must not slip in
    const std::pair<const char*, const char*> run_meta[] = {
        {"step", "step"}, {"seed", "--seed"}, {"global_batch", "--batch"}};
    for (const auto& [key, flag] : run_meta) {
      if (reader.meta(key) != manifest.get(key)) {
        throw UsageError("checkpoint '" + path + "' was written with " + flag + " " +
                         std::to_string(reader.meta(key)) + ", its manifest says " + flag + " " +
                         std::to_string(manifest.get(key)) +
                         " (hint: the directory mixes files of two runs; use a fresh --checkpoint-dir)");
      }
    }
    // the file must be the one the manifest names: its own rank and world size say
    // which (two ranks' files swapped would otherwise load each other's elements); a
    // file of the whole model has neither, and is its step's only file
    const bool per_rank = reader.has_meta("rank");
    const int step = static_cast<int>(manifest.get("step"));
    const int64_t file_rank = per_rank ? reader.meta("rank") : 0;
    const int64_t file_ranks = per_rank ? reader.meta("world_size") : 1;
    const std::string own_name = per_rank ? rank_file_name(step, static_cast<int>(file_rank)) : whole_file_name(step);
    if (file_ranks != manifest.get("world_size") || own_name != shard.file) {
      const int64_t ranks = manifest.get("world_size");
      const std::string file_is =
          per_rank ? "rank " + std::to_string(file_rank) + "'s file of a " + std::to_string(file_ranks) + "-rank run"
                   : "the whole model's file of step " + std::to_string(step) + " (" + own_name + ")";
      throw UsageError("checkpoint '" + path + "' is " + file_is + ", but the manifest lists it as " + shard.file +
                       (ranks > 1 || per_rank ? " of " + std::to_string(ranks) + " ranks" : "") +
                       " (hint: the files were renamed or swapped; put each back under its own name)");
    }
    const std::pair<const std::string*, float*> sections[] = {
        {&shard.params, params}, {&shard.adam_m, adam_m}, {&shard.adam_v, adam_v}};
    for (const auto& [name, destination] : sections) {
      if (destination == nullptr) continue;
      if (reader.section_size(*name) != shard.floats()) {
        throw UsageError("checkpoint '" + path + "': section '" + *name + "' holds " +
                         std::to_string(reader.section_size(*name)) + " floats, its manifest says " +
                         std::to_string(shard.floats()) + " (hint: the manifest is not this file's)");
      }
      std::vector<float> held(shard.floats());  // (the shard's floats)
      reader.read_section(*name, held.data(), held.size());
      for (const Copy& copy : copies) {
        copy_bytes(destination + copy.to, device, held.data() + copy.from, Device::CPU, copy.count * sizeof(float));
      }
    }
  }
}

}  // namespace course
