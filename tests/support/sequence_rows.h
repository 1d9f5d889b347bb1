// Moving rows between a whole sequence's layout and a context-parallel rank's
// (08_context_parallel/sequence_split.h), for the tests that hold a split
// computation against the unsplit one.
#pragma once

#include <vector>

#include "08_context_parallel/sequence_split.h"

namespace course_test {

// One chunk of B sequences: global (B, T, width) -> (B, chunk.length, width)
inline std::vector<float> chunk_rows(const std::vector<float>& global, int B, int T, int width,
                                     const course::PositionChunk& chunk) {
  std::vector<float> rows;
  for (int b = 0; b < B; b++) {
    const auto first = global.begin() + (static_cast<size_t>(b) * T + chunk.start) * width;
    rows.insert(rows.end(), first, first + static_cast<size_t>(chunk.length) * width);
  }
  return rows;
}

// global (B, T, width) += rows (B, chunk.length, width) at the chunk's positions
inline void add_chunk_rows(std::vector<float>& global, const std::vector<float>& rows, int B, int T, int width,
                           const course::PositionChunk& chunk) {
  const size_t chunk_floats = static_cast<size_t>(chunk.length) * width;
  for (int b = 0; b < B; b++) {
    float* first = global.data() + (static_cast<size_t>(b) * T + chunk.start) * width;
    for (size_t i = 0; i < chunk_floats; i++) first[i] += rows[b * chunk_floats + i];
  }
}

// cp rank `rank`'s rows, chunk-major: global (B, T, width) -> (chunks, B, Tc, width)
inline std::vector<float> local_rows(const std::vector<float>& global, int B, int width,
                                     const course::SequenceSplit& split, int rank) {
  std::vector<float> local;
  for (const course::PositionChunk& chunk : split.chunks_of(rank)) {
    const std::vector<float> rows = chunk_rows(global, B, split.seq_len(), width, chunk);
    local.insert(local.end(), rows.begin(), rows.end());
  }
  return local;
}

}  // namespace course_test
