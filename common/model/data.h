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

#include <cstdint>
#include <string>
#include <vector>

namespace course {

struct TextData {
  std::vector<uint8_t> bytes;
  std::string source;  // the file name, or "built-in corpus"
};

// A deterministic English-like corpus of about `size` bytes: simple sentences from a
// small grammar, facts, counting and sums. Always the same text.
std::string generated_corpus(size_t size);

// Reads `path` as bytes; an empty path gives the built-in corpus. A missing or
// too-short file is a UsageError naming the file.
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
