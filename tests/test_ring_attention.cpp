// Ring attention's block math (08_context_parallel/cp_ops.h) alone, in one
// process: the ring of N ranks played out with the block functions, every query
// chunk against every key chunk in the order the hops bring them, against ops'
// causal attention over the whole sequence (forward and gradients).
//
// Bound: 1e-5 x the largest magnitude of the reference's tensor. The blocks change
// only the order of the sums (a softmax's sum cut into per-block sums merged by
// log-sum-exp; dK and dV summed over the ranks' query chunks), which in fp32 moves
// results by a few 1e-7 of their scale; a wrong mask or merge moves them by O(1).
// The block backward is also held against finite differences of the double
// reference (tests/reference.h) on a tiny case, to test_ops.cpp's 1e-4.
//
// tests/test_ring_ranks.cpp runs the RingAttention class itself in real processes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "08_context_parallel/cp_ops.h"
#include "08_context_parallel/ring_attention.h"
#include "08_context_parallel/sequence_split.h"
#include "common/tensor/ops.h"
#include "reference.h"
#include "support/finite_difference.h"
#include "support/random.h"
#include "support/sequence_rows.h"

using namespace course;
using course_test::add_chunk_rows;
using course_test::chunk_rows;
using course_test::random_floats;

namespace {

constexpr double kTolerance = 1e-5;
constexpr double kFiniteDifferenceTolerance = 1e-4;
constexpr uint64_t kSeed = 808;

struct Shape {
  int B, T, C, NH;
};

struct Attention {
  std::vector<float> out;   // (B, T, C)
  std::vector<float> dqkv;  // (B, T, 3C)
};

struct Inputs {
  std::vector<float> qkv;   // (B, T, 3C)
  std::vector<float> dout;  // (B, T, C)
};

// N(0, 1) entries: scores q.k/sqrt(hs) of order 1, neither uniform nor one-hot
Inputs random_inputs(const Shape& s, uint64_t stream) {
  const size_t rows = static_cast<size_t>(s.B) * s.T;
  return {random_floats(kSeed, rows * 3 * s.C, stream, 1.0), random_floats(kSeed, rows * s.C, stream + 1, 1.0)};
}

// the reference: ops' causal attention over the whole sequences
Attention whole_attention(const Inputs& in, const Shape& s) {
  const size_t rows = static_cast<size_t>(s.B) * s.T;
  Attention result{std::vector<float>(rows * s.C), std::vector<float>(rows * 3 * s.C, 0.0f)};
  std::vector<float> att(static_cast<size_t>(s.B) * s.NH * s.T * s.T), scratch(static_cast<size_t>(s.T) * s.T);
  ops::attention_forward(result.out.data(), att.data(), in.qkv.data(), s.B, s.T, s.C, s.NH);
  ops::attention_backward(result.dqkv.data(), scratch.data(), in.dout.data(), in.qkv.data(), att.data(), s.B, s.T,
                          s.C, s.NH);
  return result;
}

AttentionBlock block_of(const Shape& s, const PositionChunk& query, const PositionChunk& key) {
  return {s.B, s.C, s.NH, query.start, query.length, key.start, key.length, 3 * s.C, 3 * s.C};
}

// Each query chunk against every key chunk of key_order, in that order, with the
// block functions (hidden pairs included: the functions must skip them). Added
// into result: out at the query chunk's positions, dq there, dk and dv at each
// key chunk's.
void attend_blockwise(Attention& result, const Inputs& in, const Shape& s, const std::vector<PositionChunk>& queries,
                      const std::vector<PositionChunk>& key_order) {
  const int B = s.B, T = s.T, C = s.C, NH = s.NH;
  for (const PositionChunk& query : queries) {
    const size_t Tq = query.length;
    const std::vector<float> q_rows = chunk_rows(in.qkv, B, T, 3 * C, query);  // (B, Tq, 3C)
    const std::vector<float> dout_rows = chunk_rows(in.dout, B, T, C, query);   // (B, Tq, C)
    std::vector<float> out(B * Tq * C), lse(B * NH * Tq), row_dots(B * NH * Tq), dq_rows(B * Tq * 3 * C, 0.0f);
    cp_ops::attention_blocks_begin(out.data(), lse.data(), B, query.length, C, NH);
    for (const PositionChunk& key : key_order) {
      const std::vector<float> kv_rows = chunk_rows(in.qkv, B, T, 3 * C, key);  // (B, Tk, 3C)
      const AttentionBlock block = block_of(s, query, key);
      std::vector<float> scratch(attention_block_scratch_floats(block));
      cp_ops::attention_block_forward(out.data(), lse.data(), scratch.data(), q_rows.data(), kv_rows.data() + C,
                              kv_rows.data() + 2 * C, block);
    }
    add_chunk_rows(result.out, out, B, T, C, query);
    cp_ops::attention_row_dots(row_dots.data(), out.data(), dout_rows.data(), B, query.length, C, NH);
    for (const PositionChunk& key : key_order) {
      const std::vector<float> kv_rows = chunk_rows(in.qkv, B, T, 3 * C, key);
      std::vector<float> dkv_rows(kv_rows.size(), 0.0f);
      const AttentionBlock block = block_of(s, query, key);
      std::vector<float> scratch(attention_block_scratch_floats(block));
      cp_ops::attention_block_backward(dq_rows.data(), dkv_rows.data() + C, dkv_rows.data() + 2 * C, scratch.data(),
                               dout_rows.data(), lse.data(), row_dots.data(), q_rows.data(), kv_rows.data() + C,
                               kv_rows.data() + 2 * C, block);
      add_chunk_rows(result.dqkv, dkv_rows, B, T, 3 * C, key);
    }
    add_chunk_rows(result.dqkv, dq_rows, B, T, 3 * C, query);
  }
}

Attention zeros(const Shape& s) {
  const size_t rows = static_cast<size_t>(s.B) * s.T;
  return {std::vector<float>(rows * s.C, 0.0f), std::vector<float>(rows * 3 * s.C, 0.0f)};
}

// The ring of split.cp() ranks played in one process: rank r's query chunks against
// the key chunks of cp ranks r, r-1, ..., r+1, the order its hops bring them in.
Attention simulate_ring(const Inputs& in, const Shape& s, const SequenceSplit& split) {
  Attention result = zeros(s);
  const int N = split.cp();
  for (int r = 0; r < N; r++) {
    std::vector<PositionChunk> key_order;
    for (int hop = 0; hop < N; hop++) {
      for (const PositionChunk& chunk : split.chunks_of((r - hop + N) % N)) key_order.push_back(chunk);
    }
    attend_blockwise(result, in, s, split.chunks_of(r), key_order);
  }
  return result;
}

// actual within kTolerance x max |expected|
void check_close(const std::string& what, const std::vector<float>& actual, const std::vector<float>& expected) {
  REQUIRE(actual.size() == expected.size());
  double largest = 0.0, worst = 0.0;
  for (size_t i = 0; i < actual.size(); i++) {
    largest = std::max(largest, std::fabs(static_cast<double>(expected[i])));
    worst = std::max(worst, std::fabs(static_cast<double>(actual[i]) - expected[i]));
  }
  INFO(what << ": differs by " << worst << " of " << largest);
  CHECK(worst <= kTolerance * largest);
}

void check_ring(const Shape& s, int N, SplitKind kind, uint64_t stream) {
  const SequenceSplit split(s.T, N, kind);
  const Inputs in = random_inputs(s, stream);
  const Attention expected = whole_attention(in, s);
  const Attention ring = simulate_ring(in, s, split);
  INFO(N << " ranks, " << split_kind_name(kind) << ", T " << s.T << ", chunks of " << split.chunk_len());
  check_close("output", ring.out, expected.out);
  check_close("dqkv", ring.dqkv, expected.dqkv);
}

}  // namespace

TEST_CASE("ring attention's blocks, played for 1 to 4 ranks in one process, give ops' attention and gradients",
          "[unit]") {
  const int N = GENERATE(1, 2, 3, 4);
  const SplitKind kind = GENERATE(SplitKind::Contiguous, SplitKind::Zigzag);
  check_ring({2, 24, 16, 2}, N, kind, 1);  // 24 splits into N and 2N chunks for every N here
}

TEST_CASE("ring attention's blocks across the 64-row query tiles: chunks of 136 and 68 positions", "[unit]") {
  // the products go in tiles of 64 query rows: 136 = 64 + 64 + 8 and 68 = 64 + 4 end in a
  // partial tile, and a causal block's tiles each see a different number of keys
  const SplitKind kind = GENERATE(SplitKind::Contiguous, SplitKind::Zigzag);
  check_ring({1, 272, 8, 2}, 2, kind, 3);
}

TEST_CASE("any cut of the queries and of the keys into blocks, merged in any order, gives the same attention",
          "[unit]") {
  // unequal, unaligned chunks: a block can hold query rows that see none of its keys,
  // some, or all of them; the keys come latest first
  const Shape s{2, 24, 8, 2};
  const Inputs in = random_inputs(s, 5);
  const std::vector<PositionChunk> queries{{0, 5}, {5, 3}, {8, 7}, {15, 9}};
  const std::vector<PositionChunk> keys{{20, 4}, {9, 11}, {7, 2}, {0, 7}};
  Attention blockwise = zeros(s);
  attend_blockwise(blockwise, in, s, queries, keys);
  const Attention expected = whole_attention(in, s);
  check_close("output", blockwise.out, expected.out);
  check_close("dqkv", blockwise.dqkv, expected.dqkv);
}

TEST_CASE("a chunk pair is hidden, visible or causal, and a hidden one is never computed", "[unit]") {
  const Shape s{1, 16, 4, 1};
  CHECK(block_mask(block_of(s, {0, 4}, {4, 4})) == BlockMask::Hidden);   // keys all after the queries
  CHECK(block_mask(block_of(s, {4, 4}, {0, 4})) == BlockMask::Visible);  // keys all before
  CHECK(block_mask(block_of(s, {4, 4}, {4, 4})) == BlockMask::Causal);   // the diagonal
  CHECK(block_mask(block_of(s, {4, 4}, {3, 4})) == BlockMask::Causal);   // unaligned: part of the keys after
  CHECK(block_mask(block_of(s, {4, 4}, {1, 4})) == BlockMask::Visible);  // the last key is the first query

  // a hidden block leaves out, lse and every gradient as they were, NaN inputs included
  const AttentionBlock hidden = block_of(s, {0, 4}, {8, 4});
  std::vector<float> qkv(4 * 3 * 4, NAN), dout(4 * 4, NAN), out(4 * 4, 1.0f), lse(4, 2.0f), grads(4 * 3 * 4, 3.0f);
  std::vector<float> scratch(attention_block_scratch_floats(hidden), NAN);
  cp_ops::attention_block_forward(out.data(), lse.data(), scratch.data(), qkv.data(), qkv.data() + 4, qkv.data() + 8, hidden);
  cp_ops::attention_block_backward(grads.data(), grads.data() + 4, grads.data() + 8, scratch.data(), dout.data(), lse.data(),
                           lse.data(), qkv.data(), qkv.data() + 4, qkv.data() + 8, hidden);
  CHECK(out == std::vector<float>(4 * 4, 1.0f));
  CHECK(lse == std::vector<float>(4, 2.0f));
  CHECK(grads == std::vector<float>(4 * 3 * 4, 3.0f));
}

TEST_CASE("the block backward matches finite differences of the double reference and accumulates", "[unit]") {
  // zigzag over 2 ranks: chunks of 2 positions, every kind of pair (hidden, visible, causal)
  const Shape s{2, 8, 4, 2};
  const SequenceSplit split(s.T, 2, SplitKind::Zigzag);
  const Inputs in = random_inputs(s, 7);
  const auto loss = [&](const std::vector<double>& x) {  // L = sum(out * dout), in double
    return course_test::weighted_sum(reference_attention(x.data(), s.B, s.T, s.C, s.NH), in.dout);
  };
  const std::vector<double> expected = course_test::finite_difference_gradient(in.qkv, loss);
  const Attention once = simulate_ring(in, s, split);
  CHECK(relative_error(once.dqkv, expected) <= kFiniteDifferenceTolerance);


  // the gradients are +=: the whole sequence as one causal block, its backward run
  // twice into the same buffers, gives twice one run
  const AttentionBlock whole = block_of(s, {0, s.T}, {0, s.T});
  std::vector<float> out(once.out.size()), lse(s.B * s.NH * s.T), row_dots(lse.size()),
      scratch(attention_block_scratch_floats(whole));
  const float* q = in.qkv.data();
  cp_ops::attention_blocks_begin(out.data(), lse.data(), s.B, s.T, s.C, s.NH);
  cp_ops::attention_block_forward(out.data(), lse.data(), scratch.data(), q, q + s.C, q + 2 * s.C, whole);
  cp_ops::attention_row_dots(row_dots.data(), out.data(), in.dout.data(), s.B, s.T, s.C, s.NH);
  const auto backward = [&](int runs) {
    std::vector<float> dqkv(in.qkv.size(), 0.0f);
    for (int run = 0; run < runs; run++) {
      cp_ops::attention_block_backward(dqkv.data(), dqkv.data() + s.C, dqkv.data() + 2 * s.C, scratch.data(),
                               in.dout.data(), lse.data(), row_dots.data(), q, q + s.C, q + 2 * s.C, whole);
    }
    return dqkv;
  };
  std::vector<float> doubled = backward(1);
  for (float& value : doubled) value *= 2.0f;
  check_close("two runs", backward(2), doubled);
}

TEST_CASE("the bytes one rank sends per layer follow the header's formula", "[unit]") {
  // B 2, Tl 8, C 16: one rank's K and V are 2 x 2 x 8 x 16 floats = 2048 bytes
  CHECK(ring_attention_bytes(2, 8, 16, 1).forward == 0);
  CHECK(ring_attention_bytes(2, 8, 16, 1).backward == 0);
  CHECK(ring_attention_bytes(2, 8, 16, 2).forward == 2048);
  CHECK(ring_attention_bytes(2, 8, 16, 2).backward == 3 * 2048);
  CHECK(ring_attention_bytes(2, 8, 16, 4).forward == 3 * 2048);
  CHECK(ring_attention_bytes(2, 8, 16, 4).backward == 7 * 2048);
}
