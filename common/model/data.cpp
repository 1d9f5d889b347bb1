#include "common/model/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/tensor/error.h"
#include "common/model/rng.h"

namespace course {

// ----------------------------------------------------------------------------
// the built-in corpus

namespace {
const std::vector<std::string> kNames = {"alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"};
const std::vector<std::string> kAnimals = {"cat", "dog", "fox", "owl", "horse", "mouse", "rabbit", "bird"};
const std::vector<std::string> kColours = {"red", "blue", "green", "small", "big", "old", "quick", "lazy"};
const std::vector<std::string> kVerbs = {"sees", "finds", "likes", "follows", "feeds", "draws"};
const std::vector<std::string> kPlaces = {"garden", "forest", "river", "house", "market", "field"};
const std::vector<std::string> kCountries = {"france", "italy", "spain", "japan", "egypt", "peru"};
const std::vector<std::string> kCapitals = {"paris", "rome", "madrid", "tokyo", "cairo", "lima"};
const std::vector<std::string> kNumbers = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"};
}  // namespace

std::string generated_corpus(size_t size) {
  // a fixed stream, independent of --seed: the data is the same for every run
  const CounterRng rng(20241123, hash_name("corpus"));
  uint64_t draw = 0;
  auto pick = [&](const std::vector<std::string>& words) -> const std::string& {
    return words[rng.below(draw++, words.size())];
  };
  std::string text;
  text.reserve(size + 128);
  while (text.size() < size) {
    switch (rng.below(draw++, 5)) {
      case 0:
        text += pick(kNames) + " " + pick(kVerbs) + " the " + pick(kColours) + " " + pick(kAnimals) + " in the " +
                pick(kPlaces) + ".\n";
        break;
      case 1: {
        size_t country = rng.below(draw++, kCountries.size());
        text += "the capital of " + kCountries[country] + " is " + kCapitals[country] + ".\n";
        break;
      }
      case 2: {
        uint64_t a = rng.below(draw++, 50), b = rng.below(draw++, 50);
        text += std::to_string(a) + " + " + std::to_string(b) + " = " + std::to_string(a + b) + ".\n";
        break;
      }
      case 3: {
        size_t start = rng.below(draw++, 6);
        text += "count:";
        for (size_t i = start; i < start + 5; i++) text += " " + kNumbers[i];
        text += ".\n";
        break;
      }
      default:
        text += "the " + pick(kAnimals) + " and the " + pick(kAnimals) + " go to the " + pick(kPlaces) + ".\n";
        break;
    }
  }
  return text;
}

// The whole file, mapped read-only (an empty one: no bytes, refused below as too short).
static ByteView map_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat info;
  if (fd < 0 || ::fstat(fd, &info) != 0) {
    if (fd >= 0) ::close(fd);
    throw UsageError("--data: cannot open '" + path + "' (hint: check the path, or leave --data out to " +
                     "train on the built-in corpus)");
  }
  const size_t size = static_cast<size_t>(info.st_size);
  if (size == 0) {
    ::close(fd);
    return ByteView();
  }
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file
  if (mapped == MAP_FAILED) {
    throw UsageError("--data: cannot map '" + path + "' (" + std::strerror(errno) + "; hint: is it on a file " +
                     "system that supports mmap?)");
  }
  return ByteView(std::shared_ptr<const uint8_t>(static_cast<const uint8_t*>(mapped),
                                                 [size](const uint8_t* bytes) {
                                                   ::munmap(const_cast<uint8_t*>(bytes), size);
                                                 }),
                  size);
}

TextData load_text_data(const std::string& path, int seq_len) {
  TextData data;
  if (path.empty()) {
    auto text = std::make_shared<const std::string>(generated_corpus(1 << 21));
    const size_t size = text->size();
    data.bytes = ByteView(std::shared_ptr<const uint8_t>(text, reinterpret_cast<const uint8_t*>(text->data())), size);
    data.source = "built-in corpus";
  } else {
    std::error_code error;
    if (std::filesystem::is_directory(path, error)) {
      throw UsageError("--data: '" + path + "' is a directory (hint: give a file, read as bytes)");
    }
    // a device or a pipe has no end to read to (/dev/zero grows without bound, a FIFO
    // with no writer blocks forever): only a regular file is data
    const std::filesystem::file_status status = std::filesystem::status(path, error);
    if (!error && std::filesystem::exists(status) && !std::filesystem::is_regular_file(status)) {
      throw UsageError("--data: '" + path + "' is not a regular file (a device, a pipe or a socket) " +
                       "(hint: copy what you want to train on into a file)");
    }
    data.bytes = map_file(path);
    data.source = path;
  }
  if (data.bytes.size() < static_cast<size_t>(seq_len) + 1) {
    throw UsageError((path.empty() ? "the built-in corpus" : "--data: '" + data.source + "'") + " has " +
                     std::to_string(data.bytes.size()) + " bytes, fewer than --seq + 1 = " +
                     std::to_string(seq_len + 1) + " (hint: use a larger file or a smaller --seq)");
  }
  return data;
}

// ----------------------------------------------------------------------------
// sampler

BatchSampler::BatchSampler(const TextData& data, int seq_len, int global_batch, uint64_t seed)
    : data_(data), seq_len_(seq_len), global_batch_(global_batch), seed_(seed) {}

void BatchSampler::fill(int step, int first_row, int rows, int* tokens, int* targets) {
  const CounterRng rng(seed_, hash_name("batch"));
  const uint64_t windows = data_.bytes.size() - seq_len_;  // valid start offsets
  for (int r = 0; r < rows; r++) {
    // draw number = position in the sequence of all rows of all steps
    uint64_t draw = static_cast<uint64_t>(step) * global_batch_ + first_row + r;
    uint64_t offset = rng.below(draw, windows);
    for (int t = 0; t < seq_len_; t++) {
      tokens[r * seq_len_ + t] = data_.bytes[offset + t];
      targets[r * seq_len_ + t] = data_.bytes[offset + t + 1];
    }
  }
}

RowSlice data_parallel_slice(int global_batch, int dp_rank, int dp_size) {
  if (dp_size <= 0 || global_batch % dp_size != 0) {
    throw UsageError("--batch " + std::to_string(global_batch) + " does not divide evenly over " +
                     std::to_string(dp_size) + " data-parallel ranks (hint: pick a multiple of " +
                     std::to_string(dp_size) + ")");
  }
  int rows = global_batch / dp_size;
  return {dp_rank * rows, rows};
}

}  // namespace course
