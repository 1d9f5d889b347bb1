// The program every rank runs in the Ulysses tests: 08_context_parallel's
// UlyssesAttention on this rank's positions, checked against ops' causal attention
// over the whole sequence, computed on every rank from the same inputs.
//
//   ulysses_worker [--backend auto|tcp|mpi] [--comm-timeout S]
//
// For both splits (contiguous, zigzag) and two batch sizes (the second larger, so
// the buffers grow): every rank makes the same random qkv (B, T, 3C) and datty
// (B, T, C), runs ops::attention_forward and attention_backward on all of it, takes
// its own positions of each (chunk-major, as sequence_split.h lays them out), and
// runs UlyssesAttention's forward and backward on those. atty and dqkv must be the
// reference's rows of this rank within 1e-5 x max |reference| (each head's math is
// ops' own on the same numbers, so they should even be bit-identical: the worker
// says whether they are); backward must add into dqkv; and the cp Comm's bytes
// sent and received must equal ulysses_attention_bytes exactly. At 3 ranks also: a
// head count 3 does not divide is refused with the flag's message.
// Prints "rank R: all checks passed" and exits 0 when all is well.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "08_context_parallel/sequence_split.h"
#include "08_context_parallel/ulysses_attention.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/tensor/error.h"
#include "common/model/model.h"
#include "common/tensor/ops.h"
#include "support/random.h"

using namespace course;

namespace {

const double kTolerance = 1e-5;
const uint64_t kSeed = 8;
int failures = 0;
int my_rank = 0;
bool all_bit_identical = true;

// actual against expected within kTolerance x max |expected|; notes whether they are equal bit for bit
void expect_close(const std::string& what, const std::vector<float>& actual, const std::vector<float>& expected) {
  double largest = 0.0, worst = 0.0;
  for (float value : expected) largest = std::max(largest, std::fabs(static_cast<double>(value)));
  for (size_t i = 0; i < actual.size(); i++) {
    worst = std::max(worst, std::fabs(static_cast<double>(actual[i]) - expected[i]));
  }
  if (actual.size() != expected.size() || !(worst <= kTolerance * std::max(largest, 1e-30))) {
    failures++;
    std::fprintf(stderr, "rank %d: %s: differs by %g of %g (bound %g)\n", my_rank, what.c_str(), worst, largest,
                 kTolerance * largest);
  }
  if (actual != expected) all_bit_identical = false;
}

// This rank's positions of (B, T, width) rows: global -> local (chunks, B, Tc, width),
// as SequenceSplit::take_local does for tokens.
std::vector<float> local_rows(const SequenceSplit& split, const std::vector<float>& global, int B, int width) {
  const size_t T = split.seq_len(), Tc = split.chunk_len();
  std::vector<float> local;
  for (const PositionChunk& chunk : split.chunks_of(my_rank)) {
    for (int b = 0; b < B; b++) {
      const auto from = global.begin() + (b * T + chunk.start) * width;
      local.insert(local.end(), from, from + Tc * width);
    }
  }
  return local;
}

OpStats all_to_all_stats(const Comm& cp) {
  const std::map<std::string, OpStats> stats = cp.stats();
  return stats.count("all_to_all") ? stats.at("all_to_all") : OpStats{};
}

void expect_bytes(const std::string& what, const OpStats& used, uint64_t expected) {
  if (used.bytes_sent != expected || used.bytes_received != expected) {
    failures++;
    std::fprintf(stderr, "rank %d: %s sent %llu and received %llu bytes, the formula says %llu\n", my_rank,
                 what.c_str(), static_cast<unsigned long long>(used.bytes_sent),
                 static_cast<unsigned long long>(used.bytes_received), static_cast<unsigned long long>(expected));
  }
}

// One forward and backward of B sequences through `attention`, against the unsplit ops.
void check_pass(UlyssesAttention& attention, const SequenceSplit& split, Comm& cp, const GPTConfig& config, int B) {
  const int T = config.seq_len, C = config.d_model, NH = config.n_head;
  const std::string name = split_kind_name(split.kind()) + ", B " + std::to_string(B);
  const size_t rows = static_cast<size_t>(B) * T;
  const std::vector<float> qkv = course_test::random_floats(kSeed, rows * 3 * C, B, 1.0);      // (B, T, 3C)
  const std::vector<float> datty = course_test::random_floats(kSeed, rows * C, 10 + B, 1.0);   // (B, T, C)

  // the reference: causal attention over the whole sequence
  std::vector<float> atty(rows * C), att(static_cast<size_t>(B) * NH * T * T), dqkv(rows * 3 * C, 0.0f),
      scratch(static_cast<size_t>(T) * T);
  ops::attention_forward(atty.data(), att.data(), qkv.data(), B, T, C, NH);
  ops::attention_backward(dqkv.data(), scratch.data(), datty.data(), qkv.data(), att.data(), B, T, C, NH);

  // this rank's positions through UlyssesAttention; dqkv starts non-zero, to see it add
  const std::vector<float> local_qkv = local_rows(split, qkv, B, 3 * C);
  const std::vector<float> local_datty = local_rows(split, datty, B, C);
  const std::vector<float> dqkv_before = course_test::random_floats(kSeed, local_qkv.size(), 20 + B, 1.0);
  std::vector<float> local_atty(local_datty.size()), local_dqkv = dqkv_before,
      saved(attention.saved_floats(B), 0.0f);
  cp.reset_stats();
  attention.forward(local_atty.data(), saved.data(), local_qkv.data(), B);
  const OpStats after_forward = all_to_all_stats(cp);
  attention.backward(local_dqkv.data(), local_datty.data(), local_qkv.data(), local_atty.data(), saved.data(), B);
  const OpStats after_backward = all_to_all_stats(cp);

  expect_close("forward (" + name + ")", local_atty, local_rows(split, atty, B, C));
  std::vector<float> expected_dqkv = local_rows(split, dqkv, B, 3 * C);
  for (size_t i = 0; i < expected_dqkv.size(); i++) expected_dqkv[i] += dqkv_before[i];
  expect_close("backward, added into dqkv (" + name + ")", local_dqkv, expected_dqkv);
  const AttentionBytes formula = ulysses_attention_bytes(B, T, C, cp.size());
  expect_bytes("forward (" + name + ")", after_forward, formula.forward);
  expect_bytes("backward (" + name + ")", after_backward - after_forward, formula.backward);
}

// NH = 4 at 3 ranks: refused before anything is sent, with the flag's message
void check_heads_refused(Comm& cp) {
  GPTConfig config;
  config.n_head = 4;
  config.d_model = 48;
  config.seq_len = 6;
  try {
    UlyssesAttention attention(config, SequenceSplit(config.seq_len, cp.size(), SplitKind::Contiguous), cp,
                               Device::CPU);
    failures++;
    std::fprintf(stderr, "rank %d: NH 4 at 3 ranks was not refused\n", my_rank);
  } catch (const UsageError& error) {
    if (std::string(error.what()).find("--cp-mode a2a needs the heads divisible by --cp: 4 heads over 3") ==
        std::string::npos) {
      failures++;
      std::fprintf(stderr, "rank %d: the refusal of NH 4 at 3 ranks says: %s\n", my_rank, error.what());
    }
  }
}

// 12 heads divide over 1, 2, 3 and 4 ranks; T = 24 into 2N chunks for each; head size 4
GPTConfig attention_config() {
  GPTConfig config;
  config.n_head = 12;
  config.d_model = 48;
  config.seq_len = 24;
  return config;
}

int run(int argc, char** argv) {
  CommOptions options;
  ArgParser parser("ulysses_worker", "Checks Ulysses attention against the unsplit ops (the Ulysses tests' worker).");
  add_comm_flags(parser, options);
  parser.parse(argc, argv);
  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), options);
  my_rank = world->rank();
  const GPTConfig config = attention_config();
  for (const SplitKind kind : {SplitKind::Contiguous, SplitKind::Zigzag}) {
    const SequenceSplit split(config.seq_len, world->size(), kind);
    UlyssesAttention attention(config, split, *world, Device::CPU);
    for (const int B : {1, 3}) check_pass(attention, split, *world, config, B);
  }
  if (world->size() == 3) check_heads_refused(*world);
  world->barrier();
  if (failures > 0) {
    std::fprintf(stderr, "rank %d: %d check(s) failed\n", world->rank(), failures);
    return 1;
  }
  std::printf("rank %d: all checks passed (%s, %d ranks; %s)\n", world->rank(), world->backend().c_str(),
              world->size(), all_bit_identical ? "bit-identical to the unsplit attention" : "not bit-identical");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("ulysses_worker", [&] { return run(argc, argv); });
}
