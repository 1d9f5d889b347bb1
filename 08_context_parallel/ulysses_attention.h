// Ulysses attention (DeepSpeed-Ulysses, Jacobs et al. 2023): causal attention over a
// sequence whose tokens are split over the N ranks of a context-parallel (cp) group
// (sequence_split.h), by trading the sequence split for a head split.
//
// Attention mixes positions but never heads: each head's output needs every position
// of that head's q, k and v, and nothing of the other heads. So one all_to_all hands
// each rank all T positions of NH/N of the heads, the rank runs ops' ordinary causal
// attention on them, and a second all_to_all hands the outputs back to the sequence
// split. Rank r gets heads [r NH/N, (r+1) NH/N), the channels [r C/N, (r+1) C/N) of
// each of q, k and v:
//
//   qkv     (chunks, B, Tc, 3C)   this rank's positions, every head
//       pack: block j = the columns of rank j's heads        (chunks, B, Tc, 3C/N) x N
//       all_to_all: block i = rank i's positions, this rank's heads
//       unpack: each chunk to its place in the sequence
//   qkv_r   (B, T, 3C/N)          every position in order, this rank's heads: [q | k | v]
//       ops attention_forward with C/N channels and NH/N heads (the head size is C/NH)
//   y_r     (B, T, C/N)
//       pack: block i = rank i's positions                   (chunks, B, Tc, C/N) x N
//       all_to_all: block j = this rank's positions, rank j's heads
//       unpack: block j to the columns of rank j's heads
//   atty    (chunks, B, Tc, C)    this rank's positions, every head
//
// Backward is the same path in reverse: datty to the head split, ops
// attention_backward, dqkv back to the sequence split and added into the caller's.
// Per head the math is ops' own on the same numbers, so the result is the unsplit
// attention's (the test finds it bit for bit).
//
// Bytes one rank sends per layer and micro-batch (as many received; B sequences, C
// channels, fp32; none at N = 1). An all_to_all keeps 1/N of its buffer, the blocks
// for itself, and sends the rest; a rank's buffers hold its T/N positions:
//
//   forward   qkv  3 B T C / N x (N-1)/N  +  atty  B T C / N x (N-1)/N  =  4 B T C (N-1) / N^2 floats
//   backward  datty  B T C / N x (N-1)/N  +  dqkv 3 B T C / N x (N-1)/N  =  4 B T C (N-1) / N^2 floats
//
// x 4 bytes each (ulysses_attention_bytes; the cp Comm's counters equal it exactly).
// It shrinks as N grows, where a ring that passes K and V around sends 2 B T C (N-1) / N
// floats per forward, N/2 times more. The price: N must divide the heads, and each
// rank still holds attention's (T, T) probabilities for its NH/N heads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "08_context_parallel/context_attention.h"
#include "08_context_parallel/sequence_split.h"
#include "common/comm/comm.h"
#include "common/tensor/memory.h"
#include "common/model/model.h"
#include "common/train/trace.h"

namespace course {

// The formula of the header comment (T the full sequence length).
AttentionBytes ulysses_attention_bytes(int B, int T, int C, int cp);

// Each rank takes NH/N whole heads: FlagError unless N divides the heads.
void check_ulysses_heads(int heads, int cp);

// A rank's floats for B sequences: saved, its heads' qkv at every position and their
// softmax (B T 3C/N + B NH/N T^2); comm buffers, the blocks going out and coming in
// (2 x B Tl 3C); workspace, its heads' output and gradient (B T C/N + B T 3C/N) and
// attention_backward's (T, T) scratch.
ContextAttentionFloats ulysses_attention_floats(const GPTConfig& config, const SequenceSplit& split, int B);

class UlyssesAttention : public ContextAttention {
 public:
  // config: the model's, with the full sequence length T; split: how T is cut over
  // the cp group (split.cp() == cp.size()); cp: the group, rank = cp rank; device:
  // where qkv, atty and every buffer here live; message_type: what the all-to-alls move
  // (bf16: half the bytes, rounded before and widened after). FlagError when N does
  // not divide NH.
  UlyssesAttention(const GPTConfig& config, const SequenceSplit& split, Comm& cp, Device device,
                   DType message_type = DType::F32);

  // What forward saves: this rank's heads of qkv at every position, (B, T, 3C/N), then
  // their softmax probabilities, (B, NH/N, T, T).
  size_t saved_floats(int B) const override;
  // qkv, atty: this rank's tokens, chunk-major: (chunks, B, Tc, 3C) and (chunks, B, Tc, C)
  void forward(float* atty, float* saved, const float* qkv, int B) override;
  // dqkv (chunks, B, Tc, 3C) += the gradient; qkv and atty are not needed (saved has it all)
  void backward(float* dqkv, const float* datty, const float* qkv, const float* atty, const float* saved,
                int B) override;

  // --trace: each all_to_all on the communication lane, when it really ran. nullptr
  // (the default): none.
  void set_trace(Trace* trace) override { trace_ = trace; }
  double bytes_per_layer(int B) const override;
  // Since construction: seconds in ops' attention on this rank's heads, and in the
  // all-to-alls (nothing overlaps them: attention needs their results at once).
  double compute_seconds() const override { return compute_seconds_; }

 private:
  void allocate(int B);
  // matrix (rows, C) -> blocks (N, rows, C/N): block j = the columns of rank j's heads
  void split_heads(float* blocks, const float* matrix, size_t rows) const;
  // the reverse: blocks (N, rows, C/N) -> matrix (rows, C)
  void join_heads(float* matrix, const float* blocks, size_t rows) const;
  // cp rank `owner`'s positions: local (chunks, B, Tc, width) -> whole (B, T, width)
  void place_positions(float* whole, const float* local, int owner, int width, int B) const;
  // the reverse: whole (B, T, width) -> local (chunks, B, Tc, width)
  void take_positions(float* local, const float* whole, int owner, int width, int B) const;
  // blocks of `block` floats, one to and one from every rank of the cp group
  void exchange(const float* send, float* recv, size_t block, const char* name);

  GPTConfig config_;
  SequenceSplit split_;
  Comm& cp_;
  Device device_;
  DType message_type_;
  Trace* trace_ = nullptr;
  int head_channels_;        // C/N: the channels of one rank's heads in each of q, k, v
  int allocated_batch_ = 0;  // B the buffers below hold; they grow if a larger B comes
  Buffer send_;              // (chunks, B, Tc, 3C)  the blocks going out (also backward's dqkv, rejoined)
  Buffer receive_;           // (chunks, B, Tc, 3C)  the blocks coming in
  TypedBuffer<bf16> send_message_;     // (chunks, B, Tc, 3C)  bf16 messages: send_ as it goes out
  TypedBuffer<bf16> receive_message_;  // (chunks, B, Tc, 3C)  bf16 messages: receive_ as it comes in
  Buffer y_;                 // (B, T, C/N)          this rank's heads' output, and backward's datty of them
  Buffer dqkv_heads_;        // (B, T, 3C/N)         backward's gradient of this rank's heads
  Buffer dscores_;           // (T, T)               attention_backward's scratch
  double compute_seconds_ = 0.0;
};

}  // namespace course
