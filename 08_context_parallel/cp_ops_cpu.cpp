// Chapter 08's ops on the CPU (cp_ops.h): ring attention's block math.
//
// One (sequence, head) at a time, as ops_cpu.cpp's attention: q, k and v of head h
// are (T, hs) matrices with row stride q_stride or kv_stride, read by BLAS in place.
// The products go in tiles of kBlockTileRows query rows, and a tile multiplies only the
// keys its last row sees: a causal (diagonal) block costs about half a visible one,
// which is what makes contiguous chunks' imbalance the 2N - 1 of ring_attention.h.
#include "08_context_parallel/cp_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/tensor/gemm_cpu.h"
#include "common/tensor/vector_math.h"

namespace course::cp_ops {

static const float kNoKeysYet = -std::numeric_limits<float>::infinity();  // lse = log(0)

// how many of the block's keys (always the first ones) the query at `position` sees
static int visible_keys(const AttentionBlock& block, int position) {
  return std::clamp(position - block.k_start + 1, 0, block.Tk);
}

void attention_blocks_begin(float* out, float* lse, int B, int T, int C, int NH) {
  std::fill(out, out + static_cast<size_t>(B) * T * C, 0.0f);
  std::fill(lse, lse + static_cast<size_t>(B) * NH * T, kNoKeysYet);
}

// One query row's merge. p[0, visible) holds its scores S against the block's keys.
// On return p holds exp(S - lse_new) (0 past `visible`: the masked future), out_row
// is rescaled to the new normaliser and lse is lse_new; the tile's P @ V then adds
// the block's share: out = exp(lse - lse_new) out + exp(S - lse_new) V.
// The row's max, sum and exponentials are ops_cpu.cpp's softmax's (vector_math.h).
COURSE_VECTOR_CLONES static void online_softmax_row(float* p, float* out_row, float& lse, int visible, int keys,
                                                    int hs) {
  for (int j = visible; j < keys; j++) p[j] = 0.0f;
  if (visible == 0) return;
  const float row_max = lane_max(p, visible);
  for (int j = 0; j < visible; j++) p[j] = exp_approx(p[j] - row_max);
  const float lse_block = row_max + std::log(lane_sum(visible, [&](int j) { return p[j]; }));
  // lse_new = log(exp(lse) + exp(lse_block)), taken around the larger so nothing overflows
  const float larger = std::max(lse, lse_block);
  const float lse_new = larger + std::log(std::exp(lse - larger) + std::exp(lse_block - larger));
  const float keep = std::exp(lse - lse_new);  // 0 before the first block (lse = -inf)
  for (int c = 0; c < hs; c++) out_row[c] *= keep;
  const float share = std::exp(row_max - lse_new);  // exp(S - row_max) -> exp(S - lse_new)
  for (int j = 0; j < visible; j++) p[j] *= share;
  lse = lse_new;
}

void attention_block_forward(float* out, float* lse, float* scratch, const float* q, const float* k, const float* v,
                             const AttentionBlock& block) {
  if (block_mask(block) == BlockMask::Hidden) return;
  const int C = block.C, NH = block.NH, hs = C / NH, qs = block.q_stride, kvs = block.kv_stride;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int b = 0; b < block.B; b++) {
    for (int h = 0; h < NH; h++) {
      const float* q_bh = q + static_cast<int64_t>(b) * block.Tq * qs + h * hs;   // (Tq, hs), stride qs
      const float* k_bh = k + static_cast<int64_t>(b) * block.Tk * kvs + h * hs;  // (Tk, hs), stride kvs
      const float* v_bh = v + static_cast<int64_t>(b) * block.Tk * kvs + h * hs;  // (Tk, hs), stride kvs
      float* out_bh = out + static_cast<int64_t>(b) * block.Tq * C + h * hs;      // (Tq, hs), stride C
      float* lse_bh = lse + (static_cast<int64_t>(b) * NH + h) * block.Tq;         // (Tq)
      for (int r0 = 0; r0 < block.Tq; r0 += kBlockTileRows) {
        const int r1 = std::min(block.Tq, r0 + kBlockTileRows), rows = r1 - r0;
        const int keys = visible_keys(block, block.q_start + r1 - 1);  // the tile's last row sees the most
        if (keys == 0) continue;
        float* probs = scratch;  // (rows, keys)
        // S = q k^T / sqrt(hs)
        cpu::gemm(false, true, rows, keys, hs, scale, q_bh + static_cast<int64_t>(r0) * qs, qs, k_bh, kvs, 0.0f, probs,
                  keys);
        for (int i = r0; i < r1; i++) {
          online_softmax_row(probs + static_cast<int64_t>(i - r0) * keys, out_bh + static_cast<int64_t>(i) * C,
                             lse_bh[i], visible_keys(block, block.q_start + i), keys, hs);
        }
        // out += P V
        cpu::gemm(false, false, rows, hs, keys, 1.0f, probs, keys, v_bh, kvs, 1.0f,
                  out_bh + static_cast<int64_t>(r0) * C, C);
      }
    }
  }
}

void attention_row_dots(float* row_dots, const float* out, const float* dout, int B, int T, int C, int NH) {
  const int hs = C / NH;
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const int64_t row = (static_cast<int64_t>(b) * T + t) * C;
      for (int h = 0; h < NH; h++) {
        double dot = 0.0;
        for (int c = h * hs; c < (h + 1) * hs; c++) dot += static_cast<double>(dout[row + c]) * out[row + c];
        row_dots[(static_cast<int64_t>(b) * NH + h) * T + t] = static_cast<float>(dot);
      }
    }
  }
}

// One tile of query rows of one (sequence, head) against the first `keys` keys: every
// pointer is at the tile's first row (q, dq, dout, lse, row_dots) or the block's first key.
struct TileGrads {
  float* dq;
  float* dk;
  float* dv;
  const float* dout;
  const float* lse;
  const float* row_dots;
  const float* q;
  const float* k;
  const float* v;
};

// p[0, visible) = exp(S - lse) from the scores S, p[visible, keys) = 0 (masked)
COURSE_VECTOR_CLONES static void probabilities_row(float* p, float lse, int visible, int keys) {
  for (int j = 0; j < visible; j++) p[j] = exp_approx(p[j] - lse);
  for (int j = visible; j < keys; j++) p[j] = 0.0f;
}

// ds = p * (dp - D) in place of dp
COURSE_VECTOR_CLONES static void score_gradient_row(float* ds, const float* p, float row_dot, int keys) {
  for (int j = 0; j < keys; j++) ds[j] = p[j] * (ds[j] - row_dot);
}

static void tile_backward(const TileGrads& t, float* probs, float* dscores, int first_row, int rows, int keys,
                          int hs, float scale, const AttentionBlock& block) {
  const int C = block.C, qs = block.q_stride, kvs = block.kv_stride;
  // P = exp(S - lse), with S = q k^T / sqrt(hs); 0 where masked
  cpu::gemm(false, true, rows, keys, hs, scale, t.q, qs, t.k, kvs, 0.0f, probs, keys);
  for (int i = 0; i < rows; i++) {
    probabilities_row(probs + static_cast<int64_t>(i) * keys, t.lse[i],
                      visible_keys(block, block.q_start + first_row + i), keys);
  }
  // dV += P^T dout
  cpu::gemm(true, false, keys, hs, rows, 1.0f, probs, keys, t.dout, C, 1.0f, t.dv, kvs);
  // dP = dout V^T
  cpu::gemm(false, true, rows, keys, hs, 1.0f, t.dout, C, t.v, kvs, 0.0f, dscores, keys);
  // dS = P * (dP - D)
  for (int i = 0; i < rows; i++) {
    score_gradient_row(dscores + static_cast<int64_t>(i) * keys, probs + static_cast<int64_t>(i) * keys,
                       t.row_dots[i], keys);
  }
  // dQ += dS K / sqrt(hs),  dK += dS^T Q / sqrt(hs)
  cpu::gemm(false, false, rows, hs, keys, scale, dscores, keys, t.k, kvs, 1.0f, t.dq, qs);
  cpu::gemm(true, false, keys, hs, rows, scale, dscores, keys, t.q, qs, 1.0f, t.dk, kvs);
}

void attention_block_backward(float* dq, float* dk, float* dv, float* scratch, const float* dout, const float* lse,
                              const float* row_dots, const float* q, const float* k, const float* v,
                              const AttentionBlock& block) {
  if (block_mask(block) == BlockMask::Hidden) return;
  const int C = block.C, NH = block.NH, hs = C / NH, qs = block.q_stride, kvs = block.kv_stride;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* probs = scratch;  // (rows, keys)
  float* dscores = probs + static_cast<size_t>(std::min(block.Tq, kBlockTileRows)) * block.Tk;  // (rows, keys)
  for (int b = 0; b < block.B; b++) {
    for (int h = 0; h < NH; h++) {
      const int64_t q_row0 = static_cast<int64_t>(b) * block.Tq * qs + h * hs;   // q, dq: (Tq, hs), stride qs
      const int64_t k_row0 = static_cast<int64_t>(b) * block.Tk * kvs + h * hs;  // k, v, dk, dv: (Tk, hs)
      const int64_t out_row0 = static_cast<int64_t>(b) * block.Tq * C + h * hs;  // dout: (Tq, hs), stride C
      const int64_t lse_row0 = (static_cast<int64_t>(b) * NH + h) * block.Tq;     // lse, row_dots: (Tq)
      for (int r0 = 0; r0 < block.Tq; r0 += kBlockTileRows) {
        const int rows = std::min(block.Tq, r0 + kBlockTileRows) - r0;
        const int keys = visible_keys(block, block.q_start + r0 + rows - 1);
        if (keys == 0) continue;
        const TileGrads tile{dq + q_row0 + static_cast<int64_t>(r0) * qs,
                             dk + k_row0,
                             dv + k_row0,
                             dout + out_row0 + static_cast<int64_t>(r0) * C,
                             lse + lse_row0 + r0,
                             row_dots + lse_row0 + r0,
                             q + q_row0 + static_cast<int64_t>(r0) * qs,
                             k + k_row0,
                             v + k_row0};
        tile_backward(tile, probs, dscores, r0, rows, keys, hs, scale, block);
      }
    }
  }
}

void add_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t c = 0; c < width; c++) dst[r * dst_stride + c] += src[r * src_stride + c];
  }
}

}  // namespace course::cp_ops
