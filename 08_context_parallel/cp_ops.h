// Ring attention's block math as ops: one query chunk against one key/value chunk
// (ring_attention.h tells the ring around them), each with a CPU and a CUDA version of
// one signature, in an op table of this chapter's own (cp_ops_for), as ops_for is the
// library's and tp_ops_for is chapter 06's. Every pointer lives on the device whose
// table is used.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/tensor/memory.h"

namespace course {

// B sequences of NH heads of hs = C/NH channels; the query chunk covers positions
// [q_start, q_start + Tq) of each sequence, the key/value chunk [k_start, k_start + Tk).
// A chunk's rows are (B, Tq or Tk, stride): row t of sequence b starts (b Tq + t) stride
// floats after the pointer, and head h's q (k, v) is its channels [h hs, (h+1) hs).
struct AttentionBlock {
  int B = 0, C = 0, NH = 0;
  int q_start = 0, Tq = 0;
  int k_start = 0, Tk = 0;
  int q_stride = 0;   // floats between rows of q and dq (3C in packed qkv)
  int kv_stride = 0;  // floats between rows of k, v, dk and dv
};

enum class BlockMask { Hidden, Visible, Causal };
BlockMask block_mask(const AttentionBlock& block);

// The CPU's block ops compute kBlockTileRows query rows at a time; a tile multiplies only
// the keys its last row sees, so a causal (diagonal) block costs about half a visible one.
inline constexpr int kBlockTileRows = 64;

// floats of the scratch the block ops need: two (min(Tq, 64), Tk) tiles (the CPU's
// tiles of scores and their gradients; the CUDA kernels recompute scores per thread
// and leave it unused, so that every device holds the same memory)
size_t attention_block_scratch_floats(const AttentionBlock& block);

}  // namespace course

namespace course::cp_ops {

// Before the first block: out = 0, lse = -inf (no key seen yet).
void attention_blocks_begin(float* out,  // (B, T, C)
                            float* lse,  // (B, NH, T)
                            int B, int T, int C, int NH);

// Merges the block into the running out and lse (the online softmax):
// S = q k^T / sqrt(hs), masked where key position > query position;
// lse_new = log(exp(lse) + exp(lse_block)),  out = exp(lse - lse_new) out + exp(S - lse_new) V
// Does nothing for a hidden block.
void attention_block_forward(float* out,        // (B, Tq, C)   running output of the query chunk
                             float* lse,        // (B, NH, Tq)  running log-sum-exp of its scores
                             float* scratch,    // attention_block_scratch_floats(block)
                             const float* q,    // (B, Tq, q_stride)
                             const float* k,    // (B, Tk, kv_stride)
                             const float* v,    // (B, Tk, kv_stride)
                             const AttentionBlock& block);

// D = rowsum(dout * out) per head: backward's softmax term for every query row
void attention_row_dots(float* row_dots,    // (B, NH, T)
                        const float* out,   // (B, T, C)  the final output
                        const float* dout,  // (B, T, C)
                        int B, int T, int C, int NH);

// The block's share of the gradients, given the final out's lse and D:
// P = exp(S - lse), dV += P^T dout, dP = dout V^T, dS = P * (dP - D),
// dQ += dS K / sqrt(hs), dK += dS^T Q / sqrt(hs). Does nothing for a hidden block.
void attention_block_backward(float* dq,             // (B, Tq, q_stride)
                              float* dk,             // (B, Tk, kv_stride)
                              float* dv,             // (B, Tk, kv_stride)
                              float* scratch,        // attention_block_scratch_floats(block)
                              const float* dout,     // (B, Tq, C)
                              const float* lse,      // (B, NH, Tq)  forward's final log-sum-exp
                              const float* row_dots, // (B, NH, Tq)  attention_row_dots
                              const float* q,        // (B, Tq, q_stride)
                              const float* k,        // (B, Tk, kv_stride)
                              const float* v,        // (B, Tk, kv_stride)
                              const AttentionBlock& block);

// dst[r, c] += src[r, c] for the first `width` columns of `rows` rows: the dK/dV that
// came home added into the K and V columns of dqkv
void add_strided(float* dst,        // (rows, dst_stride)
                 int64_t dst_stride,
                 const float* src,  // (rows, src_stride)
                 int64_t src_stride, int64_t rows, int64_t width);

}  // namespace course::cp_ops

namespace course {

// One device's implementations of the ops above (cp_ops_cpu.cpp; cp_ops_cuda.cu, compiled,
// never run on a GPU yet), with the same signatures.
struct CPOpTable {
  decltype(&cp_ops::attention_blocks_begin) attention_blocks_begin;
  decltype(&cp_ops::attention_block_forward) attention_block_forward;
  decltype(&cp_ops::attention_row_dots) attention_row_dots;
  decltype(&cp_ops::attention_block_backward) attention_block_backward;
  decltype(&cp_ops::add_strided) add_strided;
};

#ifdef COURSE_HAVE_CUDA
// The CUDA versions (cp_ops_cuda.cu).
namespace cp_cuda_ops {
decltype(cp_ops::attention_blocks_begin) attention_blocks_begin;
decltype(cp_ops::attention_block_forward) attention_block_forward;
decltype(cp_ops::attention_row_dots) attention_row_dots;
decltype(cp_ops::attention_block_backward) attention_block_backward;
decltype(cp_ops::add_strided) add_strided;
}  // namespace cp_cuda_ops
#endif

// The ops for data on `device`: the CPU's, the guarded device's (the CPU's with its arena
// open) or CUDA's. CourseError for CUDA in a CPU-only build.
const CPOpTable& cp_ops_for(Device device);

}  // namespace course
