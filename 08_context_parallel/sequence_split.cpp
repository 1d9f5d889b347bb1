#include "08_context_parallel/sequence_split.h"

#include <algorithm>

#include "common/tensor/error.h"

namespace course {

SplitKind parse_split_kind(const std::string& name) {
  if (name == "contiguous") return SplitKind::Contiguous;
  if (name == "zigzag") return SplitKind::Zigzag;
  throw FlagError("--cp-split " + name + ": unknown split (hint: contiguous or zigzag)");
}

std::string split_kind_name(SplitKind kind) { return kind == SplitKind::Zigzag ? "zigzag" : "contiguous"; }

SequenceSplit::SequenceSplit(int seq_len, int cp, SplitKind kind) : seq_len_(seq_len), cp_(cp), kind_(kind) {
  if (cp < 1) throw FlagError("--cp " + std::to_string(cp) + ": must be at least 1");
  const int chunks = cp * chunks_per_rank();
  if (seq_len % chunks != 0) {
    throw FlagError("--seq " + std::to_string(seq_len) + " does not split into " + std::to_string(chunks) +
                     " equal chunks (" + split_kind_name(kind) + " at --cp " + std::to_string(cp) +
                     (kind == SplitKind::Zigzag ? " needs 2 x cp" : " needs cp") +
                     "; hint: a sequence length divisible by " + std::to_string(chunks) + ")");
  }
  chunk_len_ = seq_len / chunks;
}

std::vector<PositionChunk> SequenceSplit::chunks_of(int cp_rank) const {
  if (kind_ == SplitKind::Contiguous) return {{cp_rank * chunk_len_, chunk_len_}};
  return {{cp_rank * chunk_len_, chunk_len_}, {(2 * cp_ - 1 - cp_rank) * chunk_len_, chunk_len_}};
}

void SequenceSplit::take_local(const int* global, int* local, int B, int cp_rank) const {
  const std::vector<PositionChunk> chunks = chunks_of(cp_rank);
  for (size_t c = 0; c < chunks.size(); c++) {
    for (int b = 0; b < B; b++) {
      const int* from = global + static_cast<size_t>(b) * seq_len_ + chunks[c].start;
      std::copy(from, from + chunk_len_, local + (c * B + b) * static_cast<size_t>(chunk_len_));
    }
  }
}

}  // namespace course
