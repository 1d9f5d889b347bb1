// The program every rank runs in the ring-attention tests: chapter 08's RingAttention
// on this rank's chunks of the sequence, checked against ops' causal attention over
// the whole sequence, computed on every rank from the same inputs.
//
//   ring_worker [--backend auto|tcp|mpi] [--comm-timeout S] [--split contiguous|zigzag] [--trace PATH]
//               [--timing]
//
// The world is the cp group. Checks, in three passes (2 sequences twice, then 1: the
// ring's buffers are made once and reused):
// - atty equals the reference's output at this rank's positions (chunk-major rows);
// - dqkv equals what it held before plus the reference's gradient at those positions;
// - the bytes this rank sent and received in forward, and in backward, equal
//   ring_attention_bytes exactly;
// - the ring's communication buffers are its four blocks (two K/V, two dK/dV),
//   allocated once (their peak is those four).
// Bound: 1e-5 of the largest magnitude of the reference's tensor (as
// tests/test_ring_attention.cpp argues). Prints "rank R: all checks passed".
// --trace: the ring's spans (common/train/trace.h), merged by rank 0 as the trainers do.
//
// --timing: no checks; T 1024, C 64, NH 4, B 2, for the contiguous and the zigzag
// split: every rank's attention compute seconds in forward and in backward (the
// fastest of 10 passes, one BLAS thread per rank), printed by rank 0 with the
// slowest rank's over the fastest's.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "08_context_parallel/ring_attention.h"
#include "08_context_parallel/sequence_split.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/tensor/memory.h"
#include "common/model/model.h"
#include "common/tensor/ops.h"
#include "common/train/trace.h"
#include "common/train/trainer_parts.h"
#include "support/random.h"
#include "support/sequence_rows.h"

using namespace course;
using course_test::local_rows;
using course_test::random_floats;

namespace {

const double kTolerance = 1e-5;
const int kTimingRepeats = 10;
int failures = 0;
int my_rank = 0;

void expect_close(const std::string& what, const std::vector<float>& actual, const std::vector<float>& expected) {
  double largest = 0.0, worst = 0.0;
  for (size_t i = 0; i < expected.size(); i++) {
    largest = std::max(largest, std::fabs(static_cast<double>(expected[i])));
    worst = std::max(worst, std::fabs(static_cast<double>(actual[i]) - expected[i]));
  }
  if (actual.size() != expected.size() || !(worst <= kTolerance * std::max(largest, 1e-30))) {
    failures++;
    std::fprintf(stderr, "rank %d: %s: differs by %g of %g (bound %g)\n", my_rank, what.c_str(), worst, largest,
                 kTolerance * largest);
  }
}

void expect_bytes(const std::string& what, uint64_t actual, uint64_t expected) {
  if (actual != expected) {
    failures++;
    std::fprintf(stderr, "rank %d: %s: %llu bytes, the formula says %llu\n", my_rank, what.c_str(),
                 static_cast<unsigned long long>(actual), static_cast<unsigned long long>(expected));
  }
}

struct Problem {
  GPTConfig config;
  int B;
  std::vector<float> qkv;    // (B, T, 3C)  the same on every rank
  std::vector<float> datty;  // (B, T, C)
};

Problem random_problem(int T, int C, int NH, int B) {
  GPTConfig config;
  config.seq_len = T;
  config.d_model = C;
  config.n_head = NH;
  const size_t rows = static_cast<size_t>(B) * T;
  return {config, B, random_floats(42, rows * 3 * C, 1, 1.0), random_floats(42, rows * C, 2, 1.0)};
}

// What one rank computes and expects for the first `batch` sequences of the problem
struct RankCase {
  int batch;
  std::vector<float> qkv;            // (chunks, batch, Tc, 3C)
  std::vector<float> datty;          // (chunks, batch, Tc, C)
  std::vector<float> before;         // (chunks, batch, Tc, 3C)  what dqkv holds before backward
  std::vector<float> atty_expected;  // (chunks, batch, Tc, C)
  std::vector<float> dqkv_expected;  // (chunks, batch, Tc, 3C)  before + the reference's gradient
};

// the reference (ops' attention over the whole sequences) at rank r's positions
RankCase rank_case(const Problem& p, const SequenceSplit& split, int r, int batch) {
  const int T = p.config.seq_len, C = p.config.d_model, NH = p.config.n_head;
  const auto first = [&](const std::vector<float>& whole, int width) {  // (batch, T, width) of (B, T, width)
    return std::vector<float>(whole.begin(), whole.begin() + static_cast<size_t>(batch) * T * width);
  };
  const std::vector<float> qkv = first(p.qkv, 3 * C), datty = first(p.datty, C);
  std::vector<float> out(static_cast<size_t>(batch) * T * C), att(static_cast<size_t>(batch) * NH * T * T),
      dqkv(qkv.size(), 0.0f), scores(static_cast<size_t>(T) * T);
  ops::attention_forward(out.data(), att.data(), qkv.data(), batch, T, C, NH);
  ops::attention_backward(dqkv.data(), scores.data(), datty.data(), qkv.data(), att.data(), batch, T, C, NH);
  RankCase result{batch,
                  local_rows(qkv, batch, 3 * C, split, r),
                  local_rows(datty, batch, C, split, r),
                  random_floats(42, static_cast<size_t>(batch) * split.local_len() * 3 * C, 3 + r, 1.0),
                  local_rows(out, batch, C, split, r),
                  local_rows(dqkv, batch, 3 * C, split, r)};
  for (size_t i = 0; i < result.before.size(); i++) result.dqkv_expected[i] += result.before[i];
  return result;
}

// Passes 1 and 2 with the problem's 2 sequences, pass 3 with 1: the buffers made for
// the first pass serve them all.
void check_ring(Comm& cp, SplitKind kind, Trace* trace) {
  const Problem p = random_problem(/*T=*/24, /*C=*/16, /*NH=*/2, /*B=*/2);
  const int C = p.config.d_model, comm_buffers = static_cast<int>(MemCategory::CommBuffers);
  const SequenceSplit split(p.config.seq_len, cp.size(), kind);
  const RankCase cases[2] = {rank_case(p, split, cp.rank(), p.B), rank_case(p, split, cp.rank(), 1)};
  const uint64_t buffer_bytes = 4 * 2ull * p.B * split.local_len() * C * sizeof(float);  // 2 K/V + 2 dK/dV blocks
  RingAttention ring(p.config, split, cp, Device::CPU);
  ring.set_trace(trace);
  for (int pass = 1; pass <= 3; pass++) {
    const RankCase& c = cases[pass == 3 ? 1 : 0];
    const std::string name = split_kind_name(kind) + " pass " + std::to_string(pass) + ": ";
    std::vector<float> atty(c.atty_expected.size()), saved(ring.saved_floats(c.batch)), dqkv = c.before;
    cp.reset_stats();
    ring.forward(atty.data(), saved.data(), c.qkv.data(), c.batch);
    const OpStats forward = cp.total_stats();
    cp.reset_stats();
    ring.backward(dqkv.data(), c.datty.data(), c.qkv.data(), atty.data(), saved.data(), c.batch);
    const OpStats backward = cp.total_stats();
    expect_close(name + "atty", atty, c.atty_expected);
    expect_close(name + "dqkv", dqkv, c.dqkv_expected);
    const AttentionBytes bytes = ring_attention_bytes(c.batch, split.local_len(), C, cp.size());
    expect_bytes(name + "forward bytes sent", forward.bytes_sent, bytes.forward);
    expect_bytes(name + "forward bytes received", forward.bytes_received, bytes.forward);
    expect_bytes(name + "backward bytes sent", backward.bytes_sent, bytes.backward);
    expect_bytes(name + "backward bytes received", backward.bytes_received, bytes.backward);
    const MemoryTotals& memory = memory_totals(Device::CPU);
    expect_bytes(name + "communication buffers", memory.current[comm_buffers], buffer_bytes);
    // a buffer made again for a call would exist next to the old one for a moment
    expect_bytes(name + "communication buffers at their peak", memory.peak[comm_buffers], buffer_bytes);
  }
}

// every rank's forward and backward attention seconds per pass, printed by rank 0
void report_timing(Comm& cp, SplitKind kind) {
  const Problem p = random_problem(/*T=*/1024, /*C=*/64, /*NH=*/4, /*B=*/2);
  const int B = p.B, C = p.config.d_model, r = cp.rank();
  const SequenceSplit split(p.config.seq_len, cp.size(), kind);
  const std::vector<float> qkv = local_rows(p.qkv, B, 3 * C, split, r), datty = local_rows(p.datty, B, C, split, r);
  std::vector<float> atty(datty.size()), dqkv(qkv.size(), 0.0f);
  RingAttention ring(p.config, split, cp, Device::CPU);
  std::vector<float> saved(ring.saved_floats(B));
  // the fastest of the passes after a warm-up one: on a shared machine the others
  // wait for a core now and then
  float mine[2] = {1e30f, 1e30f};  // forward, backward seconds
  for (int pass = 0; pass <= kTimingRepeats; pass++) {
    ring.reset_counters();
    ring.forward(atty.data(), saved.data(), qkv.data(), B);
    ring.backward(dqkv.data(), datty.data(), qkv.data(), atty.data(), saved.data(), B);
    if (pass == 0) continue;
    mine[0] = std::min(mine[0], static_cast<float>(ring.forward_compute_seconds()));
    mine[1] = std::min(mine[1], static_cast<float>(ring.backward_compute_seconds()));
  }
  std::vector<float> all(2 * cp.size());
  cp.all_gather(mine, all.data(), 2);
  if (r != 0) return;
  double slowest = 0.0, fastest = 1e300;
  std::printf("%s, T %d, %d ranks: attention compute per pass\n", split_kind_name(kind).c_str(),
              p.config.seq_len, cp.size());
  for (int rank = 0; rank < cp.size(); rank++) {
    const double forward = all[2 * rank], backward = all[2 * rank + 1];
    std::printf("  rank %d: forward %.2f ms, backward %.2f ms\n", rank, 1e3 * forward, 1e3 * backward);
    slowest = std::max(slowest, forward + backward);
    fastest = std::min(fastest, forward + backward);
  }
  std::printf("  slowest / fastest rank (forward + backward): %.2fx\n", slowest / fastest);
}

int run(int argc, char** argv) {
  CommOptions options;
  std::string split_name = "contiguous", trace_path;
  bool timing = false;
  ArgParser parser("ring_worker",
                   "Checks chapter 08's ring attention against ops' attention (the ring tests' worker).");
  add_comm_flags(parser, options);
  parser.add_choice("--split", &split_name, {"contiguous", "zigzag"}, "how the sequence is cut over the ranks");
  parser.add_string("--trace", &trace_path, "write the ring's spans as a Chrome trace");
  parser.add_switch("--timing", &timing, "print each rank's attention seconds, contiguous and zigzag, T 1024");
  parser.parse(argc, argv);
  std::unique_ptr<Comm> cp = create_world_comm(read_launch_env(), options);
  my_rank = cp->rank();
  if (timing) {
    openblas_set_num_threads(1);  // one core per rank, as the trainers' default --threads
    report_timing(*cp, SplitKind::Contiguous);
    report_timing(*cp, SplitKind::Zigzag);
    return 0;
  }
  Trace trace(trace_path, cp->rank(), cp->size());
  check_ring(*cp, parse_split_kind(split_name), trace.enabled() ? &trace : nullptr);
  finish_trace(trace, trace_path, cp.get());
  cp->barrier();
  if (failures > 0) {
    std::fprintf(stderr, "rank %d: %d check(s) failed\n", cp->rank(), failures);
    return 1;
  }
  std::printf("rank %d: all checks passed (%s, %d ranks, %s)\n", cp->rank(), cp->backend().c_str(), cp->size(),
              split_name.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("ring_worker", [&] { return run(argc, argv); });
}
