// Ring attention (Liu, Zaharia and Abbeel 2023): causal attention over a sequence
// whose tokens are split over the N ranks of a context-parallel (cp) group
// (sequence_split.h). Every rank keeps its own queries; the keys and values travel
// around the ring, and each rank attends to one rank's K/V block at a time.
//
// The block math (cp_ops.h, on the run's device): flash attention's online softmax. A query's softmax over all
// keys need not be taken at once. Keep, per query row, the output so far and the
// log-sum-exp (lse) of the scores seen so far; a new block of keys, with its own
// softmax output out_block and lse_block, merges in as
//
//   lse_new = log(exp(lse) + exp(lse_block))
//   out     = exp(lse - lse_new) out + exp(lse_block - lse_new) out_block
//
// After the last block, out is exactly softmax(all scores) @ V, in whatever order
// the blocks came. Backward keeps nothing T x T either: from the final out and lse
// (saved by forward), each block recomputes its probabilities P = exp(S - lse).
//
// Causality between a query chunk and a key chunk (of equal, aligned chunks):
//
//   hidden    every key is after every query: skipped, never computed
//   visible   every key is before every query: no mask
//   causal    the same positions (the diagonal): key j visible to query i iff j <= i
//
// The ring. Rank r packs its chunks' K and V into one block (chunks, B, Tc, 2C):
//
//   hop i = 0 .. N-1: rank r holds the K/V block of cp rank (r - i) mod N;
//     start sending it to r+1 while receiving the next one from r-1 (send_recv_async),
//     THEN attend to the block held, THEN wait: the transfer hides behind the compute.
//
// Backward sends the K/V blocks around again, and with each a dK/dV accumulator
// that collects the contribution of every rank the block visits: rank r adds its
// part, then passes the accumulator on while computing the next block, and after
// the last hop every accumulator is back home with its owner's whole dK/dV.
//
// Causality makes contiguous chunks unequal work: rank r computes r visible chunk
// pairs and one causal (half) pair, the last rank about 2N - 1 times the first's.
// Zigzag gives each rank an early and a late chunk: 2N - 1 visible pairs and two
// causal ones on every rank (tests/ring_worker.cpp --timing measures both).
//
// Bytes one rank sends per layer and micro-batch (B sequences, Tl = T/N tokens of
// each on a rank, C channels; none at N = 1):
//
//   forward   (N-1) K/V hops                     x 2 B Tl C x 4 bytes
//   backward  (N-1) K/V hops + N dK/dV hops      x 2 B Tl C x 4 bytes
//
// (ring_attention_bytes computes them; the cp Comm's counters equal them exactly.)
// Under --dtype bf16 the blocks travel as bf16, 2 bytes a value: half of these. K and
// V lose nothing by it (the block math rounds them to bf16 for its products anyway);
// a dK/dV accumulator is rounded at each hop, as a bf16 all-reduce's sums are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "08_context_parallel/context_attention.h"
#include "08_context_parallel/cp_ops.h"
#include "08_context_parallel/sequence_split.h"
#include "common/comm/comm.h"
#include "common/tensor/memory.h"
#include "common/model/model.h"
#include "common/train/trace.h"

namespace course {

// ----------------------------------------------------------------------------
// the ring

// The formula of the header comment; Tl = split.local_len().
AttentionBytes ring_attention_bytes(int B, int local_len, int C, int cp);

// A rank's floats for B sequences: saved, the lse (B NH Tl); comm buffers, the K/V
// block attended to and the one arriving, the dK/dV accumulator passed on and the one
// arriving (4 x B Tl 2C); workspace, this rank's dK/dV part of the block held
// (B Tl 2C), D (B NH Tl) and the block math's scratch for a chunk pair.
ContextAttentionFloats ring_attention_floats(const GPTConfig& config, const SequenceSplit& split, int B);

class RingAttention : public ContextAttention {
 public:
  // config: the model's, with the full sequence length T; split: how T is cut over
  // the cp group (split.cp() == cp.size()); cp: the group, rank = cp rank; device:
  // where the buffers live and the block ops run; message_type: what the hops carry.
  // UsageError when they do not fit together.
  RingAttention(const GPTConfig& config, const SequenceSplit& split, Comm& cp, Device device,
                DType message_type = DType::F32);

  // The saved lse, (chunks, B, NH, Tc): B NH Tl floats (the output itself is atty,
  // handed back to backward). ops' attention saves B NH T^2.
  size_t saved_floats(int B) const override;
  // qkv, atty: this rank's tokens, chunk-major: (chunks, B, Tc, 3C) and (chunks, B, Tc, C)
  void forward(float* atty, float* saved, const float* qkv, int B) override;
  void backward(float* dqkv, const float* datty, const float* qkv, const float* atty, const float* saved,
                int B) override;

  // --trace: each hop's send_recv on the communication lane (when it really ran),
  // each block's compute on the compute lane. nullptr (the default): none.
  void set_trace(Trace* trace) override { trace_ = trace; }
  double bytes_per_layer(int B) const override;

  // Since construction or reset_counters(): seconds this rank spent computing
  // attention (the per-rank time shows contiguous's imbalance), and waiting for a
  // hop that the compute did not hide.
  double forward_compute_seconds() const { return forward_compute_seconds_; }
  double backward_compute_seconds() const { return backward_compute_seconds_; }
  double compute_seconds() const override { return forward_compute_seconds_ + backward_compute_seconds_; }
  void reset_counters();

 private:
  void allocate(int B);
  // this rank's K and V out of its qkv into one block: kv (chunks, B, Tc, 2C)
  void pack_kv(float* kv, const float* qkv, int B);
  // attend(query chunk index, key chunk index, block) for each pair of this rank's
  // query chunks and cp rank `owner`'s key chunks that is not hidden
  void visible_pairs(int owner, int B, const std::function<void(int, int, const AttentionBlock&)>& attend) const;
  // One stream of hops (the K/V blocks, or the dK/dV accumulators) as bf16 messages:
  // what goes out, what comes in, and where finish_hop widens it to (empty for fp32)
  struct HopMessages {
    TypedBuffer<bf16> send;  // (chunks, B, Tc, 2C)
    TypedBuffer<bf16> recv;  // (chunks, B, Tc, 2C)
    float* widen_into = nullptr;
  };
  // a block of `count` values to the next rank, another from the previous into `recv`
  // (bf16 messages: through `messages`, widened into `recv` by finish_hop)
  Work start_hop(const float* send, float* recv, size_t count, HopMessages& messages);
  void finish_hop(Work& hop, const std::string& name, size_t count, HopMessages& messages);
  AttentionBlock chunk_pair(const PositionChunk& query, const PositionChunk& key, int B) const;

  GPTConfig config_;
  SequenceSplit split_;
  Comm& cp_;
  Device device_;
  DType message_type_;
  const OpTable& ops_;       // the library's ops on device_ (zero, copies, sums)
  const CPOpTable& cp_ops_;  // the block math on device_
  Trace* trace_ = nullptr;
  int allocated_batch_ = 0;  // B the buffers below hold; they grow if a larger B comes
  Buffer kv_[2];             // (chunks, B, Tc, 2C)  the K/V block attended to now, the next one arriving
  Buffer dkv_[2];            // (chunks, B, Tc, 2C)  dK/dV accumulators: the one passed on, the one arriving
  Buffer dkv_hop_;           // (chunks, B, Tc, 2C)  this rank's part of the block held now
  HopMessages kv_messages_;  // the K/V blocks' hops, bf16 messages only
  HopMessages dkv_messages_;  // the dK/dV accumulators' hops, bf16 messages only
  Buffer row_dots_;          // (chunks, B, NH, Tc)  D = rowsum(datty * atty)
  Buffer scratch_;           // attention_block_scratch_floats
  double forward_compute_seconds_ = 0.0;
  double backward_compute_seconds_ = 0.0;
};

}  // namespace course
