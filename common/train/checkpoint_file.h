// The checkpoint file: named float sections plus integer metadata, in one file that is
// written atomically and verified on load.
//
// File layout (little-endian):
//   "GPTCKPT1" | u64 payload bytes | u64 FNV-1a checksum of the payload | payload
//   payload = u32 #meta, {u32 key length, key, i64 value}...,
//             u32 #sections, {u32 name length, name, u64 count, float[count]}...
//
// Writing goes to "<path>.tmp<pid>", is flushed, then renamed over <path>: a crash
// mid-write leaves the previous checkpoint intact. Reading checks the magic, the
// length (truncation), the checksum (corruption) and every section's size
// (shape mismatch), and says which one failed.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/tensor/memory.h"

namespace course {

class CheckpointWriter {
 public:
  void set_meta(const std::string& key, int64_t value);
  // data: (count) floats on `device`; the file holds host bytes whatever the device,
  // so a checkpoint written from a GPU loads on the CPU and the other way round.
  void add_section(const std::string& name, const float* data, size_t count, Device device = Device::CPU);
  // Writes atomically; throws CourseError on any I/O failure.
  void write(const std::string& path) const;

 private:
  std::map<std::string, int64_t> meta_;
  std::vector<std::pair<std::string, std::vector<float>>> sections_;
};

// What a meta key means when a file lacks it: the keys added after the format's
// first files, n_experts 0 and top_k 0 (a dense model, as every file was before
// mixtures of experts); nullopt for every key a file must have.
std::optional<int64_t> absent_meta_value(const std::string& key);

class CheckpointReader {
 public:
  // Reads and verifies the whole file; throws CourseError naming the problem.
  explicit CheckpointReader(const std::string& path);

  int64_t meta(const std::string& key) const;
  // Whether the file has the key itself (meta() also answers absent_meta_value's keys).
  bool has_meta(const std::string& key) const;
  // How many floats section `name` holds (CourseError when there is none).
  size_t section_size(const std::string& name) const;
  // Copies section `name` into dst (on `device`); its element count must be exactly `count`.
  void read_section(const std::string& name, float* dst, size_t count, Device device = Device::CPU) const;

 private:
  std::string path_;
  std::map<std::string, int64_t> meta_;
  std::map<std::string, std::vector<float>> sections_;
};

// Writes head, then body, to "<path>.tmp<pid>", flushes, closes and renames it over
// path, so a crash or a write error mid-write leaves the previous file (or none),
// never half of one. `what` ("checkpoint", "trace", "timeline") names the file in
// errors: a CourseError (exit 1) naming path and the system's reason.
void write_file_atomically(const std::string& path, const std::string& head, const std::string& body,
                           const std::string& what);

// For an output the run writes at its end (--trace, --timeline): that
// write_file_atomically can create a file next to `path`, checked at the start
// rather than found after the whole run. UsageError naming `flag` otherwise.
void check_output_path(const std::string& flag, const std::string& path);

}  // namespace course
