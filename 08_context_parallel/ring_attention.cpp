#include "08_context_parallel/ring_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/tensor/error.h"
#include "common/tensor/gemm_cpu.h"
#include "common/train/metrics.h"
#include "common/tensor/vector_math.h"

namespace course {

// ----------------------------------------------------------------------------
// the block math
//
// One (sequence, head) at a time, as ops_cpu.cpp's attention: q, k and v of head h
// are (T, hs) matrices with row stride q_stride or kv_stride, read by BLAS in place.
// The products go in tiles of kTileRows query rows, and a tile multiplies only the
// keys its last row sees: a causal (diagonal) block costs about half a visible one,
// which is what makes contiguous chunks' imbalance the 2N - 1 of the header.

static const int kTileRows = 64;
static const float kNoKeysYet = -std::numeric_limits<float>::infinity();  // lse = log(0)

BlockMask block_mask(const AttentionBlock& block) {
  const int last_query = block.q_start + block.Tq - 1, last_key = block.k_start + block.Tk - 1;
  if (block.k_start > last_query) return BlockMask::Hidden;
  if (last_key <= block.q_start) return BlockMask::Visible;
  return BlockMask::Causal;
}

// how many of the block's keys (always the first ones) the query at `position` sees
static int visible_keys(const AttentionBlock& block, int position) {
  return std::clamp(position - block.k_start + 1, 0, block.Tk);
}

size_t attention_block_scratch_floats(const AttentionBlock& block) {
  return 2 * static_cast<size_t>(std::min(block.Tq, kTileRows)) * block.Tk;
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
      for (int r0 = 0; r0 < block.Tq; r0 += kTileRows) {
        const int r1 = std::min(block.Tq, r0 + kTileRows), rows = r1 - r0;
        const int keys = visible_keys(block, block.q_start + r1 - 1);  // the tile's last row sees the most
        if (keys == 0) continue;
        float* probs = scratch;  // (rows, keys)
        // S = q k^T / sqrt(hs)
        cpu::gemm(false, true, rows, keys, hs, scale,
                    q_bh + static_cast<int64_t>(r0) * qs, qs, k_bh, kvs, 0.0f, probs, keys);
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
  cpu::gemm(false, true, rows, keys, hs, 1.0f, t.dout, C, t.v, kvs, 0.0f, dscores,
              keys);
  // dS = P * (dP - D)
  for (int i = 0; i < rows; i++) {
    score_gradient_row(dscores + static_cast<int64_t>(i) * keys, probs + static_cast<int64_t>(i) * keys,
                       t.row_dots[i], keys);
  }
  // dQ += dS K / sqrt(hs),  dK += dS^T Q / sqrt(hs)
  cpu::gemm(false, false, rows, hs, keys, scale, dscores, keys, t.k, kvs, 1.0f, t.dq,
              qs);
  cpu::gemm(true, false, keys, hs, rows, scale, dscores, keys, t.q, qs, 1.0f, t.dk,
              kvs);
}

void attention_block_backward(float* dq, float* dk, float* dv, float* scratch, const float* dout, const float* lse,
                              const float* row_dots, const float* q, const float* k, const float* v,
                              const AttentionBlock& block) {
  if (block_mask(block) == BlockMask::Hidden) return;
  const int C = block.C, NH = block.NH, hs = C / NH, qs = block.q_stride, kvs = block.kv_stride;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* probs = scratch;  // (rows, keys)
  float* dscores = probs + static_cast<size_t>(std::min(block.Tq, kTileRows)) * block.Tk;  // (rows, keys)
  for (int b = 0; b < block.B; b++) {
    for (int h = 0; h < NH; h++) {
      const int64_t q_row0 = static_cast<int64_t>(b) * block.Tq * qs + h * hs;   // q, dq: (Tq, hs), stride qs
      const int64_t k_row0 = static_cast<int64_t>(b) * block.Tk * kvs + h * hs;  // k, v, dk, dv: (Tk, hs)
      const int64_t out_row0 = static_cast<int64_t>(b) * block.Tq * C + h * hs;  // dout: (Tq, hs), stride C
      const int64_t lse_row0 = (static_cast<int64_t>(b) * NH + h) * block.Tq;     // lse, row_dots: (Tq)
      for (int r0 = 0; r0 < block.Tq; r0 += kTileRows) {
        const int rows = std::min(block.Tq, r0 + kTileRows) - r0;
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

// ----------------------------------------------------------------------------
// the ring

double RingAttention::bytes_per_layer(int B) const {
  const AttentionBytes bytes = ring_attention_bytes(B, split_.local_len(), config_.d_model, split_.cp());
  return static_cast<double>(bytes.forward + bytes.backward);
}

AttentionBytes ring_attention_bytes(int B, int local_len, int C, int cp) {
  if (cp <= 1) return {};
  const uint64_t block = 2ull * B * local_len * C * sizeof(float);  // one rank's K and V, or dK and dV
  return {static_cast<uint64_t>(cp - 1) * block, static_cast<uint64_t>(2 * cp - 1) * block};
}

RingAttention::RingAttention(const GPTConfig& config, const SequenceSplit& split, Comm& cp)
    : config_(config), split_(split), cp_(cp) {
  if (split.seq_len() != config.seq_len) {
    throw UsageError("ring attention: the split cuts " + std::to_string(split.seq_len()) + " positions but the " +
                     "model's sequence has " + std::to_string(config.seq_len) +
                     " (hint: split the model's full --seq)");
  }
  if (split.cp() != cp.size()) {
    throw UsageError("ring attention: the split is for " + std::to_string(split.cp()) + " cp ranks but the cp group " +
                     "has " + std::to_string(cp.size()) + " (hint: build the split with the cp group's size)");
  }
  if (config.n_head < 1 || config.d_model % config.n_head != 0) {
    throw UsageError("ring attention: --heads " + std::to_string(config.n_head) + " does not divide --d-model " +
                     std::to_string(config.d_model));
  }
}

ContextAttentionFloats ring_attention_floats(const GPTConfig& config, const SequenceSplit& split, int B) {
  const size_t block = static_cast<size_t>(B) * split.local_len() * 2 * config.d_model;  // (chunks, B, Tc, 2C)
  const size_t lse = static_cast<size_t>(B) * config.n_head * split.local_len();         // (chunks, B, NH, Tc)
  AttentionBlock pair;  // the scratch is sized for one chunk against one chunk
  pair.Tq = pair.Tk = split.chunk_len();
  return {lse, 4 * block, block + lse + attention_block_scratch_floats(pair)};
}

size_t RingAttention::saved_floats(int B) const { return ring_attention_floats(config_, split_, B).saved; }

void RingAttention::reset_counters() {
  forward_compute_seconds_ = 0.0;
  backward_compute_seconds_ = 0.0;
  reset_exposed();
}

void RingAttention::allocate(int B) {
  if (B <= allocated_batch_) return;
  const int Tc = split_.chunk_len();
  const size_t block = static_cast<size_t>(B) * split_.local_len() * 2 * config_.d_model;
  for (int i = 0; i < 2; i++) {
    kv_[i] = Buffer(block, MemCategory::CommBuffers);
    dkv_[i] = Buffer(block, MemCategory::CommBuffers);
  }
  dkv_hop_ = Buffer(block, MemCategory::Workspace);
  row_dots_ = Buffer(saved_floats(B), MemCategory::Workspace);
  scratch_ = Buffer(attention_block_scratch_floats(chunk_pair({0, Tc}, {0, Tc}, B)), MemCategory::Workspace);
  allocated_batch_ = B;
}

void RingAttention::pack_kv(float* kv, const float* qkv, int B) const {
  const int C = config_.d_model;
  const int64_t rows = static_cast<int64_t>(B) * split_.local_len();
  for (int64_t row = 0; row < rows; row++) {
    std::copy(qkv + row * 3 * C + C, qkv + (row + 1) * 3 * C, kv + row * 2 * C);
  }
}

AttentionBlock RingAttention::chunk_pair(const PositionChunk& query, const PositionChunk& key, int B) const {
  const int C = config_.d_model;
  return {B, C, config_.n_head, query.start, query.length, key.start, key.length, 3 * C, 2 * C};
}

Work RingAttention::start_hop(const float* send, float* recv, size_t count) {
  const int N = cp_.size(), r = cp_.rank();
  return cp_.send_recv_async(send, count, (r + 1) % N, recv, count, (r - 1 + N) % N);
}

void RingAttention::finish_hop(Work& hop, const std::string& name, size_t count) {
  const double wait_start = now_seconds();
  const OpInterval ran = hop.wait();
  count_exposed(now_seconds() - wait_start);
  trace_collective(trace_, name, ran, JsonLine().add("bytes", count * sizeof(float)));
}

void RingAttention::visible_pairs(int owner, int B,
                                  const std::function<void(int, int, const AttentionBlock&)>& attend) const {
  const std::vector<PositionChunk> queries = split_.chunks_of(cp_.rank()), keys = split_.chunks_of(owner);
  for (size_t cq = 0; cq < queries.size(); cq++) {
    for (size_t ck = 0; ck < keys.size(); ck++) {
      const AttentionBlock block = chunk_pair(queries[cq], keys[ck], B);
      if (block_mask(block) != BlockMask::Hidden) attend(static_cast<int>(cq), static_cast<int>(ck), block);
    }
  }
}

// Forward: N - 1 hops of the K/V blocks. At hop i this rank attends to the block of
// cp rank (r - i) mod N while the next block travels.
void RingAttention::forward(float* atty, float* saved, const float* qkv, int B) {
  allocate(B);
  const int N = cp_.size(), r = cp_.rank(), C = config_.d_model, NH = config_.n_head;
  const int chunks = split_.chunks_per_rank(), Tc = split_.chunk_len();
  const int64_t chunk_rows = static_cast<int64_t>(B) * Tc;  // a chunk's rows in every local buffer
  const size_t block_floats = static_cast<size_t>(chunks) * chunk_rows * 2 * C;  // (chunks, B, Tc, 2C)
  float* lse = saved;  // (chunks, B, NH, Tc)
  attention_blocks_begin(atty, lse, chunks * B, Tc, C, NH);
  pack_kv(kv_[0].data(), qkv, B);
  for (int hop = 0; hop < N; hop++) {
    const int owner = (r - hop + N) % N;
    const float* kv = kv_[hop % 2].data();  // (chunks, B, Tc, 2C): owner's K and V
    Work next;                              // the next block, arriving while this one is attended to
    if (hop + 1 < N) next = start_hop(kv, kv_[(hop + 1) % 2].data(), block_floats);
    const double start = now_seconds();
    visible_pairs(owner, B, [&](int cq, int ck, const AttentionBlock& pair) {
      const float* kv_chunk = kv + ck * chunk_rows * 2 * C;
      attention_block_forward(atty + cq * chunk_rows * C, lse + cq * chunk_rows * NH, scratch_.data(),
                              qkv + cq * chunk_rows * 3 * C, kv_chunk, kv_chunk + C, pair);
    });
    forward_compute_seconds_ += now_seconds() - start;
    trace_compute(trace_, "forward attention, K/V of cp rank " + std::to_string(owner), start);
    finish_hop(next, "K/V hop " + std::to_string(hop + 1) + " of " + std::to_string(N - 1), block_floats);
  }
}

// Backward: the K/V blocks go around again (N - 1 hops), each followed by its dK/dV
// accumulator (N hops: the last one brings it home). Rank r computes its part of a
// block's dK/dV while the accumulator it adds to is still on the way; dQ is local.
void RingAttention::backward(float* dqkv, const float* datty, const float* qkv, const float* atty,
                             const float* saved, int B) {
  allocate(B);
  const int N = cp_.size(), r = cp_.rank(), C = config_.d_model, NH = config_.n_head;
  const int chunks = split_.chunks_per_rank(), Tc = split_.chunk_len();
  const int64_t chunk_rows = static_cast<int64_t>(B) * Tc;
  const size_t block_floats = static_cast<size_t>(chunks) * chunk_rows * 2 * C;  // (chunks, B, Tc, 2C)
  const float* lse = saved;  // (chunks, B, NH, Tc)
  attention_row_dots(row_dots_.data(), atty, datty, chunks * B, Tc, C, NH);
  pack_kv(kv_[0].data(), qkv, B);
  std::fill(dkv_[0].data(), dkv_[0].data() + block_floats, 0.0f);  // hop 0's accumulator "arrives" empty
  int arriving = 0;  // dkv_[arriving]: the accumulator of the block held now
  Work accumulator;  // the dK/dV hop in flight
  for (int hop = 0; hop < N; hop++) {
    const int owner = (r - hop + N) % N;
    const float* kv = kv_[hop % 2].data();
    Work next;
    if (hop + 1 < N) next = start_hop(kv, kv_[(hop + 1) % 2].data(), block_floats);
    const double start = now_seconds();
    std::fill(dkv_hop_.data(), dkv_hop_.data() + block_floats, 0.0f);
    visible_pairs(owner, B, [&](int cq, int ck, const AttentionBlock& pair) {
      const int64_t k_offset = ck * chunk_rows * 2 * C;
      float* dkv_chunk = dkv_hop_.data() + k_offset;
      attention_block_backward(dqkv + cq * chunk_rows * 3 * C, dkv_chunk, dkv_chunk + C, scratch_.data(),
                               datty + cq * chunk_rows * C, lse + cq * chunk_rows * NH,
                               row_dots_.data() + cq * chunk_rows * NH, qkv + cq * chunk_rows * 3 * C,
                               kv + k_offset, kv + k_offset + C, pair);
    });
    backward_compute_seconds_ += now_seconds() - start;
    trace_compute(trace_, "backward attention, K/V of cp rank " + std::to_string(owner), start);
    finish_hop(accumulator, "dK/dV hop " + std::to_string(hop) + " of " + std::to_string(N), block_floats);
    // owner's dK/dV += this rank's part, then on to the next rank
    float* sum = dkv_[arriving].data();
    for (size_t i = 0; i < block_floats; i++) sum[i] += dkv_hop_.data()[i];
    if (N > 1) {
      accumulator = start_hop(sum, dkv_[1 - arriving].data(), block_floats);
      arriving = 1 - arriving;
    }
    finish_hop(next, "K/V hop " + std::to_string(hop + 1) + " of " + std::to_string(N - 1), block_floats);
  }
  finish_hop(accumulator, "dK/dV hop " + std::to_string(N) + " of " + std::to_string(N) + " (home)", block_floats);
  // dkv_[arriving] now holds this rank's own dK and dV, summed over every rank's queries
  const float* dkv = dkv_[arriving].data();
  for (int64_t row = 0; row < chunks * chunk_rows; row++) {
    float* dkv_row = dqkv + row * 3 * C + C;
    for (int c = 0; c < 2 * C; c++) dkv_row[c] += dkv[row * 2 * C + c];
  }
}

}  // namespace course
