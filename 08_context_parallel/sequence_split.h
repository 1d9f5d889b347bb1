// Which tokens of every sequence a context-parallel rank holds.
//
// --cp N cuts each sequence of T tokens into chunks of equal length and gives each
// rank of the cp group some of them:
//
//   contiguous   N chunks of T/N; rank r holds chunk r. Causal attention makes the
//                last rank's queries see every key and the first rank's only its
//                own: about 2N-1 times the work on the last rank than the first.
//   zigzag       2N chunks of T/(2N); rank r holds chunks r and 2N-1-r (a cheap
//                early chunk with an expensive late one), so every rank does the
//                same attention work (torchtitan's and Megatron-LM's split).
//
//   T = 16, N = 2      positions 0 ........................ 15
//   contiguous         [ rank 0: 0-7          | rank 1: 8-15          ]
//   zigzag             [ r0: 0-3 | r1: 4-7 | r1: 8-11 | r0: 12-15 ]
//
// On a rank, every per-token buffer is laid out chunk by chunk: (chunks, B, Tc, ...),
// a rank's first chunk of all B sequences, then its second. Everything but attention
// works on rows and does not care; attention and the embedding's positions read the
// chunks' starts from here.
#pragma once

#include <string>
#include <vector>

#include "common/model/model.h"  // PositionChunk

namespace course {

enum class SplitKind { Contiguous, Zigzag };
SplitKind parse_split_kind(const std::string& name);  // "contiguous" | "zigzag", else UsageError
std::string split_kind_name(SplitKind kind);

class SequenceSplit {
 public:
  // UsageError when T does not divide into the chunks (N, or 2N for zigzag)
  SequenceSplit(int seq_len, int cp, SplitKind kind);

  int seq_len() const { return seq_len_; }
  int cp() const { return cp_; }
  SplitKind kind() const { return kind_; }
  int chunk_len() const { return chunk_len_; }                               // Tc
  int chunks_per_rank() const { return kind_ == SplitKind::Zigzag ? 2 : 1; }  // 1 or 2
  int local_len() const { return seq_len_ / cp_; }                            // T/N tokens per sequence per rank
  // cp rank r's chunks, in its local order (ascending positions)
  std::vector<PositionChunk> chunks_of(int cp_rank) const;

  // This rank's tokens of B sequences: global (B, T) -> local (chunks, B, Tc).
  void take_local(const int* global, int* local, int B, int cp_rank) const;

 private:
  int seq_len_;
  int cp_;
  SplitKind kind_;
  int chunk_len_;
};

}  // namespace course
