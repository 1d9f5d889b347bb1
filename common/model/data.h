// Training data: bytes in, (tokens, targets) batches out.
//
// Every byte is a token (vocabulary 256), so any file is a dataset. Without
// --data the course trains on a built-in generated corpus, so nothing needs to be
// downloaded.
//
// The sampler is stateless: the global batch of step s is a pure function of
// (seed, s), the same at every world size. A data-parallel rank takes a
// contiguous slice of its rows; micro-batches are contiguous slices of that.
// Resuming from a checkpoint only needs the step number.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace course {

// The training bytes, read-only: the built-in corpus in memory, or a --data file
// mapped (mmap): its pages are read as the sampler touches them, and the kernel may
// drop them again, so a file larger than the machine's memory trains too, and the
// per-node memory check need not count it. Cheap to copy (the bytes are shared).
class ByteView {
 public:
  ByteView() = default;
  ByteView(std::shared_ptr<const uint8_t> owner, size_t size) : owner_(std::move(owner)), size_(size) {}
  size_t size() const { return size_; }
  uint8_t operator[](size_t i) const { return owner_.get()[i]; }
  uint8_t back() const { return owner_.get()[size_ - 1]; }

 private:
  std::shared_ptr<const uint8_t> owner_;
  size_t size_ = 0;
};

struct TextData {
  ByteView bytes;
  std::string source;  // the file name, or "built-in corpus"
};

// A deterministic English-like corpus of about `size` bytes: simple sentences from a
// small grammar, facts, counting and sums. Always the same text.
std::string generated_corpus(size_t size);

// Maps `path` as bytes; an empty path gives the built-in corpus. A missing, too-short
// or non-regular file is a UsageError naming the file.
TextData load_text_data(const std::string& path, int seq_len);

class BatchSampler {
 public:
  BatchSampler(const TextData& data, int seq_len, int global_batch, uint64_t seed);

  // Rows [first_row, first_row + rows) of step `step`'s global batch.
  // Row r is the window of T+1 bytes at a random offset: tokens = bytes[o .. o+T),
  // targets = bytes[o+1 .. o+T+1).
  void fill(int step, int first_row, int rows,
            int* tokens,    // (rows, T)
            int* targets);  // (rows, T)

  int global_batch() const { return global_batch_; }

 private:
  const TextData& data_;
  int seq_len_;
  int global_batch_;
  uint64_t seed_;
};

// The contiguous rows of a global batch that data-parallel rank `dp_rank` of
// `dp_size` processes. The global batch must divide evenly.
struct RowSlice {
  int first_row;
  int rows;
};
RowSlice data_parallel_slice(int global_batch, int dp_rank, int dp_size);

}  // namespace course
