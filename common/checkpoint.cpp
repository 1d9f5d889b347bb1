#include "common/checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <unistd.h>

#include "common/comm/env.h"
#include "common/device.h"
#include "common/error.h"

namespace course {

namespace fs = std::filesystem;

static const char kMagic[8] = {'G', 'P', 'T', 'C', 'K', 'P', 'T', '1'};

static uint64_t fnv1a(const char* data, size_t size) {
  uint64_t hash = 1469598103934665603ull;
  for (size_t i = 0; i < size; i++) {
    hash ^= static_cast<unsigned char>(data[i]);
    hash *= 1099511628211ull;
  }
  return hash;
}

template <typename T>
static void put(std::string& out, const T& value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// ----------------------------------------------------------------------------
// writing

void CheckpointWriter::set_meta(const std::string& key, int64_t value) { meta_[key] = value; }

void CheckpointWriter::add_section(const std::string& name, const float* data, size_t count, Device device) {
  std::vector<float> host(count);
  copy_bytes(host.data(), Device::CPU, data, device, count * sizeof(float));
  sections_.emplace_back(name, std::move(host));
}

void CheckpointWriter::write(const std::string& path) const {
  std::string payload;
  put(payload, static_cast<uint32_t>(meta_.size()));
  for (const auto& [key, value] : meta_) {
    put(payload, static_cast<uint32_t>(key.size()));
    payload += key;
    put(payload, value);
  }
  put(payload, static_cast<uint32_t>(sections_.size()));
  for (const auto& [name, values] : sections_) {
    put(payload, static_cast<uint32_t>(name.size()));
    payload += name;
    put(payload, static_cast<uint64_t>(values.size()));
    payload.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  }

  uint64_t payload_bytes = payload.size(), checksum = fnv1a(payload.data(), payload.size());
  std::string header(kMagic, sizeof(kMagic));
  put(header, payload_bytes);
  put(header, checksum);
  write_file_atomically(path, header, payload, "checkpoint");
}

// The test of a crash in the middle of a save (tests/test_restart.cpp): with
// COURSE_TEST_DIE_WRITING=<file name>, the process writing that file SIGKILLs itself
// once half of it is on disk, in a launcher's first attempt only (so the restarted
// group can save it).
static void die_mid_write_if_testing(const std::string& path, FILE* file) {
  const char* name = std::getenv("COURSE_TEST_DIE_WRITING");
  if (name == nullptr || fs::path(path).filename() != name || read_launch_env().restart_count != 0) return;
  std::fflush(file);
  ::raise(SIGKILL);
}

void write_file_atomically(const std::string& path, const std::string& head, const std::string& body,
                           const std::string& what) {
  // rename would fail only after the whole file was written, and leave it behind
  if (fs::is_directory(path)) {
    throw CourseError("cannot write " + what + " '" + path + "': a directory of that name is in the way " +
                      "(hint: move it, or write elsewhere)");
  }
  // the process id keeps two writers of the same step (say, several copies of a
  // trainer pointed at one directory) from clobbering each other's half-written file
  const std::string temp_path = path + ".tmp" + std::to_string(::getpid());
  FILE* file = std::fopen(temp_path.c_str(), "wb");
  if (file == nullptr) {
    throw CourseError("cannot write " + what + " '" + path + "' (its temporary file '" + temp_path +
                      "'): " + std::strerror(errno) + " (hint: does its directory exist, and is it writable?)");
  }
  const size_t half = body.size() / 2;
  bool ok = std::fwrite(head.data(), 1, head.size(), file) == head.size() &&
            std::fwrite(body.data(), 1, half, file) == half;
  die_mid_write_if_testing(path, file);
  ok = ok && std::fwrite(body.data() + half, 1, body.size() - half, file) == body.size() - half &&
       std::fflush(file) == 0;
  const int write_errno = errno;  // the failed write's reason, before fclose may set another
  const bool closed = std::fclose(file) == 0;
  if (!ok || !closed) {
    const std::string reason = std::strerror(ok ? errno : write_errno);
    std::remove(temp_path.c_str());
    throw CourseError("writing " + what + " '" + path + "' failed: " + reason + " (hint: is the disk full?)");
  }
  std::error_code error;
  fs::rename(temp_path, path, error);
  if (error) {
    std::remove(temp_path.c_str());
    throw CourseError("cannot rename '" + temp_path + "' to " + what + " '" + path + "': " + error.message());
  }
}

void check_output_path(const std::string& flag, const std::string& path) {
  const fs::path directory = fs::path(path).parent_path();
  if (!directory.empty() && !fs::is_directory(directory)) {
    throw UsageError(flag + ": cannot write '" + path + "': no directory '" + directory.string() +
                     "' (hint: create it first)");
  }
  // a directory that takes no new file (read-only, or not a real file system) too
  const std::string probe = path + ".probe" + std::to_string(::getpid());
  if (!std::ofstream(probe)) {
    throw UsageError(flag + ": cannot write '" + path + "': no file can be created next to it (hint: pick a " +
                     "directory you can write to)");
  }
  fs::remove(probe);
}

// ----------------------------------------------------------------------------
// reading

namespace {
// Reads fields from the payload, refusing to run past its end.
class PayloadCursor {
 public:
  PayloadCursor(const std::string& bytes, size_t position, const std::string& path)
      : bytes_(bytes), position_(position), path_(path) {}

  template <typename T>
  T get() {
    T value;
    std::memcpy(&value, take(sizeof(T)), sizeof(T));
    return value;
  }
  std::string get_string() {
    uint32_t length = get<uint32_t>();
    return std::string(take(length), length);
  }
  const char* take(size_t count) {
    if (count > bytes_.size() - position_) {
      throw CourseError("checkpoint '" + path_ + "' is malformed: a field runs past the end of the file");
    }
    const char* start = bytes_.data() + position_;
    position_ += count;
    return start;
  }

 private:
  const std::string& bytes_;
  size_t position_;
  const std::string& path_;
};
}  // namespace

CheckpointReader::CheckpointReader(const std::string& path) : path_(path) {
  // a directory opens as a stream; reading it then throws libstdc++'s own message,
  // which does not say which file
  if (fs::is_directory(path)) {
    throw CourseError("checkpoint '" + path + "' is a directory, not a checkpoint file " +
                      "(hint: move it out of the checkpoint directory)");
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) throw CourseError("cannot open checkpoint '" + path + "': " + std::strerror(errno));
  std::string bytes;
  try {
    bytes.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure&) {  // a failed read(2): EIO, a file that vanished on a network disk
    throw CourseError("cannot read checkpoint '" + path + "': " + std::strerror(errno));
  }

  const size_t header = sizeof(kMagic) + 2 * sizeof(uint64_t);
  if (bytes.size() < header || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    throw CourseError("'" + path + "' is not a course checkpoint (bad magic or shorter than the header)");
  }
  uint64_t payload_bytes, checksum;
  std::memcpy(&payload_bytes, bytes.data() + sizeof(kMagic), sizeof(payload_bytes));
  std::memcpy(&checksum, bytes.data() + sizeof(kMagic) + sizeof(payload_bytes), sizeof(checksum));
  if (bytes.size() - header != payload_bytes) {
    throw CourseError("checkpoint '" + path + "' is truncated or padded: header says " +
                      std::to_string(payload_bytes) + " payload bytes, file has " +
                      std::to_string(bytes.size() - header) + " (hint: delete it to resume from an older one)");
  }
  if (fnv1a(bytes.data() + header, payload_bytes) != checksum) {
    throw CourseError("checkpoint '" + path + "' is corrupt: checksum mismatch " +
                      "(hint: delete it to resume from an older one)");
  }

  PayloadCursor cursor(bytes, header, path);
  uint32_t meta_count = cursor.get<uint32_t>();
  for (uint32_t i = 0; i < meta_count; i++) {
    std::string key = cursor.get_string();
    meta_[key] = cursor.get<int64_t>();
  }
  uint32_t section_count = cursor.get<uint32_t>();
  for (uint32_t i = 0; i < section_count; i++) {
    std::string name = cursor.get_string();
    uint64_t count = cursor.get<uint64_t>();
    if (count > payload_bytes / sizeof(float)) {
      throw CourseError("checkpoint '" + path + "' is malformed: section '" + name + "' claims " +
                        std::to_string(count) + " floats");
    }
    const char* data = cursor.take(count * sizeof(float));
    std::vector<float>& values = sections_[name];
    values.resize(count);
    std::memcpy(values.data(), data, count * sizeof(float));
  }
}

int64_t CheckpointReader::meta(const std::string& key) const {
  auto found = meta_.find(key);
  if (found == meta_.end() && absent_meta_value(key)) return *absent_meta_value(key);
  if (found == meta_.end()) throw CourseError("checkpoint '" + path_ + "' has no '" + key + "' entry");
  return found->second;
}

bool CheckpointReader::has_meta(const std::string& key) const { return meta_.count(key) != 0; }

size_t CheckpointReader::section_size(const std::string& name) const {
  auto found = sections_.find(name);
  if (found == sections_.end()) throw CourseError("checkpoint '" + path_ + "' has no section '" + name + "'");
  return found->second.size();
}

void CheckpointReader::read_section(const std::string& name, float* dst, size_t count, Device device) const {
  auto found = sections_.find(name);
  if (found == sections_.end()) throw CourseError("checkpoint '" + path_ + "' has no section '" + name + "'");
  if (found->second.size() != count) {
    throw CourseError("checkpoint '" + path_ + "': section '" + name + "' holds " +
                      std::to_string(found->second.size()) + " values, this run expects " + std::to_string(count) +
                      " (hint: resume with the same model shape and world size)");
  }
  copy_bytes(dst, device, found->second.data(), Device::CPU, count * sizeof(float));
}

// ----------------------------------------------------------------------------
// model shape

void write_model_meta(CheckpointWriter& writer, const GPTConfig& config) {
  writer.set_meta("vocab_size", config.vocab_size);
  writer.set_meta("seq_len", config.seq_len);
  writer.set_meta("n_layer", config.n_layer);
  writer.set_meta("d_model", config.d_model);
  writer.set_meta("n_head", config.n_head);
  if (config.n_experts > 0) {
    writer.set_meta("n_experts", config.n_experts);
    writer.set_meta("top_k", config.top_k);
  }
}

std::optional<int64_t> absent_meta_value(const std::string& key) {
  if (key == "n_experts" || key == "top_k") return 0;
  return std::nullopt;
}

GPTConfig model_from_meta(const std::function<int64_t(const std::string&)>& saved) {
  GPTConfig config;
  config.vocab_size = static_cast<int>(saved("vocab_size"));
  config.seq_len = static_cast<int>(saved("seq_len"));
  config.n_layer = static_cast<int>(saved("n_layer"));
  config.d_model = static_cast<int>(saved("d_model"));
  config.n_head = static_cast<int>(saved("n_head"));
  config.n_experts = static_cast<int>(saved("n_experts"));
  if (config.n_experts > 0) config.top_k = static_cast<int>(saved("top_k"));
  return config;
}

void check_model_meta(const CheckpointReader& reader, const GPTConfig& config, const std::string& path) {
  check_model_shape([&](const std::string& key) { return reader.meta(key); }, config, path);
}

void check_model_shape(const std::function<int64_t(const std::string&)>& saved_meta, const GPTConfig& config,
                       const std::string& path) {
  const std::pair<const char*, std::pair<const char*, int>> fields[] = {
      {"vocab_size", {"vocabulary", config.vocab_size}}, {"seq_len", {"--seq", config.seq_len}},
      {"n_layer", {"--layers", config.n_layer}},          {"d_model", {"--d-model", config.d_model}},
      {"n_head", {"--heads", config.n_head}},
  };
  for (const auto& [key, flag_and_value] : fields) {
    int64_t saved = saved_meta(key);
    if (saved != flag_and_value.second) {
      throw UsageError("checkpoint '" + path + "' was written with " + flag_and_value.first + " " +
                        std::to_string(saved) + ", this run has " + flag_and_value.first + " " +
                        std::to_string(flag_and_value.second) +
                        " (hint: resume with the same model flags, or use a fresh --checkpoint-dir)");
    }
  }
  // dense or mixture of experts, and how many experts: the blocks' parameters
  const auto blocks = [](int64_t experts) {
    return experts == 0 ? std::string("dense blocks (no --experts)") : "--experts " + std::to_string(experts);
  };
  const int64_t saved_experts = saved_meta("n_experts");
  if (saved_experts != config.n_experts) {
    throw UsageError("checkpoint '" + path + "' was written with " + blocks(saved_experts) + ", this run has " +
                     blocks(config.n_experts) +
                     " (hint: resume with the same model flags, or use a fresh --checkpoint-dir)");
  }
  if (config.n_experts > 0 && saved_meta("top_k") != config.top_k) {
    throw UsageError("checkpoint '" + path + "' was written with --top-k " + std::to_string(saved_meta("top_k")) +
                     ", this run has --top-k " + std::to_string(config.top_k) +
                     " (hint: resume with the same model flags, or use a fresh --checkpoint-dir)");
  }
}

// ----------------------------------------------------------------------------
// files in a checkpoint directory

void ensure_checkpoint_dir(const std::string& dir) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error || !fs::is_directory(dir)) {
    throw UsageError("--checkpoint-dir: cannot create directory '" + dir + "'" +
                     (error ? ": " + error.message() : std::string()) + " (hint: pick a writable path)");
  }
}

std::string checkpoint_path(const std::string& dir, int step, const std::string& suffix) {
  char name[64];
  std::snprintf(name, sizeof(name), "step_%08d", step);
  return (fs::path(dir) / (std::string(name) + suffix + ".ckpt")).string();
}

// Steps of the files "step_<8 digits><suffix><extension>" in dir, sorted ascending.
static std::vector<int> checkpoint_steps(const std::string& dir, const std::string& suffix,
                                         const std::string& extension = ".ckpt") {
  std::vector<int> steps;
  std::error_code error;
  if (!fs::is_directory(dir, error)) return steps;
  const std::string tail = suffix + extension;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    std::string name = entry.path().filename().string();
    if (name.size() != 13 + tail.size() || name.rfind("step_", 0) != 0 ||
        name.compare(13, std::string::npos, tail) != 0) {
      continue;
    }
    std::string digits = name.substr(5, 8);
    if (digits.find_first_not_of("0123456789") == std::string::npos) steps.push_back(std::stoi(digits));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<std::string> latest_checkpoint(const std::string& dir, const std::string& suffix) {
  std::vector<int> steps = checkpoint_steps(dir, suffix);
  if (steps.empty()) return std::nullopt;
  return checkpoint_path(dir, steps.back(), suffix);
}

void prune_checkpoints(const std::string& dir, int keep, const std::string& suffix, const std::string& extension) {
  std::vector<int> steps = checkpoint_steps(dir, suffix, extension);
  for (size_t i = 0; i + keep < steps.size(); i++) {
    std::error_code ignored;  // a file that is already gone is fine
    const std::string path = checkpoint_path(dir, steps[i], suffix);  // "....ckpt"
    fs::remove(path.substr(0, path.size() - 5) + extension, ignored);
  }
}

std::string rank_suffix(int rank) { return "_rank" + std::to_string(rank); }

void remove_stale_checkpoint_files(const std::string& dir, bool per_rank) {
  // the steps rank 0 still keeps (prune_checkpoints has run): every other step is gone
  const std::vector<int> kept = checkpoint_steps(dir, rank_suffix(0));
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) != 0) continue;  // not a checkpoint's
    // "step_00000008_rank1.ckpt.tmp9648": a writer died before its rename
    const bool temporary = name.find(".tmp") != std::string::npos;
    // "step_00000004_rank5.ckpt" of a step rank 0 no longer keeps: a larger run's
    // rank, which no rank of this run prunes
    const bool pruned_step = per_rank && !temporary && name.find("_rank") != std::string::npos &&
                             std::find(kept.begin(), kept.end(), std::atoi(name.c_str() + 5)) == kept.end();
    std::error_code ignored;  // already gone is fine
    if (temporary || pruned_step) fs::remove(entry.path(), ignored);
  }
}

std::optional<std::string> latest_complete_rank_checkpoint(const std::string& dir) {
  const std::vector<int> steps = checkpoint_steps(dir, rank_suffix(0));
  for (auto step = steps.rbegin(); step != steps.rend(); ++step) {
    const std::string first = checkpoint_path(dir, *step, rank_suffix(0));
    const int64_t ranks = CheckpointReader(first).meta("world_size");
    bool complete = true;
    for (int64_t rank = 1; rank < ranks && complete; rank++) {
      complete = fs::exists(checkpoint_path(dir, *step, rank_suffix(static_cast<int>(rank))));
    }
    if (complete) return first;
  }
  return std::nullopt;
}

}  // namespace course

// ----------------------------------------------------------------------------
// a replicated model's training state

#include "common/adamw.h"
#include "common/cli.h"

namespace course {

void write_run_meta(CheckpointWriter& writer, const TrainOptions& options, int step) {
  write_model_meta(writer, options.model);
  writer.set_meta("step", step);
  writer.set_meta("seed", static_cast<int64_t>(options.seed));
  writer.set_meta("global_batch", options.batch);
}

void write_rank_meta(CheckpointWriter& writer, const TrainOptions& options, int step, int world_size, int rank) {
  write_run_meta(writer, options, step);
  // a rank's file means nothing without the cut that made it
  writer.set_meta("world_size", world_size);
  writer.set_meta("rank", rank);
}

void save_training_state(const std::string& path, const TrainOptions& options, int step, const float* params,
                         const AdamW& optimizer) {
  CheckpointWriter writer;
  write_run_meta(writer, options, step);
  const Device device = optimizer.m.device();  // the parameters live with their optimizer state
  writer.add_section("params", params, optimizer.count(), device);
  writer.add_section("adam_m", optimizer.m.data(), optimizer.count(), device);
  writer.add_section("adam_v", optimizer.v.data(), optimizer.count(), device);
  writer.write(path);
}

int load_training_state(const std::string& path, const TrainOptions& options, float* params, AdamW& optimizer) {
  CheckpointReader reader(path);
  check_model_meta(reader, options.model, path);
  check_seed_and_batch([&](const std::string& key) { return reader.meta(key); }, options, path);
  const Device device = optimizer.m.device();
  reader.read_section("params", params, optimizer.count(), device);
  reader.read_section("adam_m", optimizer.m.data(), optimizer.count(), device);
  reader.read_section("adam_v", optimizer.v.data(), optimizer.count(), device);
  return static_cast<int>(reader.meta("step"));
}

void check_seed_and_batch(const std::function<int64_t(const std::string&)>& saved, const TrainOptions& options,
                          const std::string& path) {
  if (saved("seed") != static_cast<int64_t>(options.seed) || saved("global_batch") != options.batch) {
    throw UsageError("checkpoint '" + path + "' was written with --seed " + std::to_string(saved("seed")) +
                     " --batch " + std::to_string(saved("global_batch")) + ", this run has --seed " +
                     std::to_string(options.seed) + " --batch " + std::to_string(options.batch) +
                     " (hint: resume with the same flags, or use a fresh --checkpoint-dir)");
  }
}

}  // namespace course
