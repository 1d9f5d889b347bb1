#include "common/train/checkpoint_file.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/comm/test_faults.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"

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

namespace {

// Refuses a target the course must not replace: a symbolic link (whoever planted it
// would pick the file written, or later read), and anything but a regular file (a
// device node, a FIFO, a socket, a directory). Nothing there yet is fine.
void check_replaceable(const std::string& path, const std::string& what) {
  struct stat info;
  if (::lstat(path.c_str(), &info) != 0) return;
  if (S_ISLNK(info.st_mode)) {
    throw CourseError("cannot write " + what + " '" + path + "': it is a symbolic link, and the course never " +
                      "writes through one (hint: remove the link, or write elsewhere)");
  }
  if (S_ISDIR(info.st_mode)) {
    throw CourseError("cannot write " + what + " '" + path + "': a directory of that name is in the way " +
                      "(hint: move it, or write elsewhere)");
  }
  if (!S_ISREG(info.st_mode)) {
    throw CourseError("cannot write " + what + " '" + path + "': it is not a regular file (a device, a FIFO or a " +
                      "socket), which the course does not replace (hint: name a file)");
  }
}

// A new file next to `path`, made by this call and no one else: O_EXCL fails on
// whatever is already at the name (a planted symlink too), and the name is random,
// so no one can plant one in advance. Returns its descriptor (-1 and errno on failure).
int create_new_file(const std::string& path, const std::string& tag, std::string* made) {
  std::random_device random;
  for (int attempt = 0; attempt < 16; attempt++) {
    char suffix[48];
    std::snprintf(suffix, sizeof(suffix), ".%s%d.%08x%08x", tag.c_str(), static_cast<int>(::getpid()), random(),
                  random());
    *made = path + suffix;
    const int fd = ::open(made->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;
}

}  // namespace

void write_file_atomically(const std::string& path, const std::string& head, const std::string& body,
                           const std::string& what) {
  // rename would fail only after the whole file was written, and leave it behind
  check_replaceable(path, what);
  // the temporary file's random name keeps two writers of the same step (say, several
  // copies of a trainer pointed at one directory) apart, and anyone else out
  std::string temp_path;
  const int fd = create_new_file(path, "tmp", &temp_path);
  FILE* file = fd < 0 ? nullptr : ::fdopen(fd, "wb");
  if (file == nullptr) {
    const std::string reason = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    throw CourseError("cannot write " + what + " '" + path + "' (its temporary file '" + temp_path +
                      "'): " + reason + " (hint: does its directory exist, and is it writable?)");
  }
  const size_t half = body.size() / 2;
  bool ok = std::fwrite(head.data(), 1, head.size(), file) == head.size() &&
            std::fwrite(body.data(), 1, half, file) == half;
  die_if_told_mid_write(path, file);  // a test's crash in the middle of a save
  ok = ok && std::fwrite(body.data() + half, 1, body.size() - half, file) == body.size() - half &&
       std::fflush(file) == 0;
  const int write_errno = errno;  // the failed write's reason, before fclose may set another
  const bool closed = std::fclose(file) == 0;
  if (!ok || !closed) {
    const std::string reason = std::strerror(ok ? errno : write_errno);
    std::remove(temp_path.c_str());
    throw CourseError("writing " + what + " '" + path + "' failed: " + reason + " (hint: is the disk full?)");
  }
  // rename replaces whatever is at `path` now, a link itself rather than its target
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
  try {
    check_replaceable(path, "the file");
  } catch (const CourseError& refused) {
    throw UsageError(flag + ": " + refused.what());
  }
  // a directory that takes no new file (read-only, or not a real file system) too
  std::string probe;
  const int fd = create_new_file(path, "probe", &probe);
  if (fd < 0) {
    throw UsageError(flag + ": cannot write '" + path + "': no file can be created next to it (hint: pick a " +
                     "directory you can write to)");
  }
  ::close(fd);
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
  // one planted by someone else would choose what this run loads
  if (fs::is_symlink(path)) {
    throw CourseError("checkpoint '" + path + "' is a symbolic link: the course loads only the files it wrote " +
                      "(hint: copy the file there instead of linking it)");
  }
  // a path that names nothing is the command line's mistake (exit 2), not the file's
  if (!fs::exists(path)) {
    throw UsageError("no checkpoint file '" + path + "' (hint: a trainer writes step_NNNNNNNN.ckpt files, or a " +
                     "sharded checkpoint's manifest and shard files, into its --checkpoint-dir: list it)");
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

std::optional<int64_t> absent_meta_value(const std::string& key) {
  if (key == "n_experts" || key == "top_k") return 0;
  return std::nullopt;
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

}  // namespace course
