// The program every rank runs in the communication tests: each collective on
// rank-dependent data, checked against a hand-computed answer. Values are
// integer-valued floats, so sums are exact and the answers are exact.
//
//   comm_worker [--backend tcp|mpi] [--comm-timeout S] [--die-rank R]
//
// With --die-rank R, rank R kills itself (SIGKILL) in the middle of a loop of
// all_reduces, and the others must report the failure and exit non-zero within
// the timeout. Prints "rank R: all checks passed" and exits 0 when all is well.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "common/cli.h"
#include "common/comm/comm.h"

using namespace course;

namespace {

int failures = 0;

void expect_equal(const std::string& what, const std::vector<float>& actual, const std::vector<float>& expected,
                  int rank) {
  if (actual == expected) return;
  failures++;
  size_t first = 0;
  while (first < actual.size() && first < expected.size() && actual[first] == expected[first]) first++;
  std::fprintf(stderr, "rank %d: %s: wrong at element %zu of %zu (got %g, expected %g)\n", rank, what.c_str(), first,
               expected.size(), first < actual.size() ? actual[first] : -1.0f,
               first < expected.size() ? expected[first] : -1.0f);
}

// Sizes that hit the edge cases: empty, one element, fewer than ranks, not
// divisible by the world size, and large enough for many ring chunks.
std::vector<size_t> test_sizes(int n) { return {0, 1, 7, static_cast<size_t>(3 * n + 1), 100003}; }

void check_all_reduce(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  for (size_t count : test_sizes(n)) {
    std::vector<float> sum(count), average(count), expected_sum(count), expected_average(count);
    for (size_t i = 0; i < count; i++) {
      sum[i] = average[i] = static_cast<float>(rank * 1000 + static_cast<int>(i % 97));
      expected_sum[i] = static_cast<float>(1000 * n * (n - 1) / 2 + n * static_cast<int>(i % 97));
      expected_average[i] = expected_sum[i] / n;
    }
    comm.all_reduce(sum.data(), count, ReduceOp::Sum);
    comm.all_reduce(average.data(), count, ReduceOp::Average);
    expect_equal("all_reduce sum, count " + std::to_string(count), sum, expected_sum, rank);
    expect_equal("all_reduce average, count " + std::to_string(count), average, expected_average, rank);
  }
}

void check_reduce_scatter_and_all_gather(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  for (bool uneven : {false, true}) {
    // uneven: rank r owns r % 3 elements (some own none), as padded shards do not
    std::vector<size_t> counts(n), offsets(n);
    for (int r = 0; r < n; r++) counts[r] = uneven ? static_cast<size_t>(r % 3) : 5;
    std::exclusive_scan(counts.begin(), counts.end(), offsets.begin(), size_t{0});
    const size_t total = offsets[n - 1] + counts[n - 1];
    const std::string label = uneven ? " (uneven)" : "";

    // reduce_scatter: in[j] = rank + j on every rank; block r of the sum is kept by rank r
    std::vector<float> in(total), out(counts[rank]), expected_out(counts[rank]);
    for (size_t j = 0; j < total; j++) in[j] = static_cast<float>(rank + static_cast<int>(j));
    for (size_t k = 0; k < counts[rank]; k++) {
      expected_out[k] = static_cast<float>(n * (n - 1) / 2 + n * static_cast<int>(offsets[rank] + k));
    }
    comm.reduce_scatter(in.data(), out.data(), counts, ReduceOp::Sum);
    expect_equal("reduce_scatter" + label, out, expected_out, rank);

    // all_gather: rank r contributes counts[r] copies of 10 r + k
    std::vector<float> mine(counts[rank]), gathered(total), expected_gathered(total);
    for (size_t k = 0; k < counts[rank]; k++) mine[k] = static_cast<float>(10 * rank + static_cast<int>(k));
    for (int r = 0; r < n; r++) {
      for (size_t k = 0; k < counts[r]; k++) expected_gathered[offsets[r] + k] = static_cast<float>(10 * r + k);
    }
    comm.all_gather(mine.data(), gathered.data(), counts);
    expect_equal("all_gather" + label, gathered, expected_gathered, rank);
  }
}

void check_broadcast_and_point_to_point(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  for (int root = 0; root < n; root++) {
    for (size_t count : {size_t{1}, size_t{300001}}) {
      std::vector<float> data(count, static_cast<float>(rank)), expected(count, static_cast<float>(root));
      comm.broadcast(data.data(), count, root);
      expect_equal("broadcast from " + std::to_string(root), data, expected, rank);
    }
  }
  // a ring shift with send_recv, then the same with separate send and recv
  std::vector<float> outgoing(1000, static_cast<float>(rank)), incoming(1000, -1.0f);
  const int right = (rank + 1) % n, left = (rank + n - 1) % n;
  comm.send_recv(outgoing.data(), outgoing.size(), right, incoming.data(), incoming.size(), left);
  expect_equal("send_recv ring shift", incoming, std::vector<float>(1000, static_cast<float>(left)), rank);
  if (n > 1) {
    std::vector<float> value = {static_cast<float>(rank)};
    if (rank == 0) {
      comm.send(value.data(), 1, 1);
    } else if (rank == 1) {
      comm.recv(value.data(), 1, 0);
      expect_equal("send 0 -> recv 1", value, {0.0f}, rank);
    }
  }
  comm.barrier();
}

void check_split(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  // a grid of rows of 2: row = rank / 2, column = rank % 2 (a 2x2 grid at 4 ranks)
  std::unique_ptr<Comm> row = comm.split(rank / 2, rank);
  std::unique_ptr<Comm> column = comm.split(rank % 2, rank);
  std::vector<float> row_sum = {static_cast<float>(rank)}, column_sum = {static_cast<float>(rank)};
  row->all_reduce(row_sum.data(), 1);
  column->all_reduce(column_sum.data(), 1);
  float expected_row = 0, expected_column = 0;
  for (int r = 0; r < n; r++) {
    if (r / 2 == rank / 2) expected_row += static_cast<float>(r);
    if (r % 2 == rank % 2) expected_column += static_cast<float>(r);
  }
  expect_equal("split row all_reduce", row_sum, {expected_row}, rank);
  expect_equal("split column all_reduce", column_sum, {expected_column}, rank);
  if (row->rank() != rank % 2 || column->rank() != rank / 2) {
    failures++;
    std::fprintf(stderr, "rank %d: split ranks: row rank %d, column rank %d\n", rank, row->rank(), column->rank());
  }
  // a negative color joins no group
  std::unique_ptr<Comm> nobody = comm.split(rank == 0 ? -1 : 0, rank);
  if ((rank == 0) != (nobody == nullptr)) {
    failures++;
    std::fprintf(stderr, "rank %d: split with a negative color\n", rank);
  }
  if (nobody != nullptr) nobody->barrier();
}

void check_async_overlap(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  std::vector<float> gradients(1 << 20, static_cast<float>(rank + 1));
  Work pending = comm.all_reduce_async(gradients.data(), gradients.size());
  // meanwhile, "backward" goes on computing on this thread
  double busy = 0;
  for (int i = 0; i < 1000000; i++) busy += i * 0.5;
  pending.wait();
  expect_equal("async all_reduce", gradients, std::vector<float>(gradients.size(), n * (n + 1) / 2.0f), rank);
  if (busy < 0) std::printf("unreachable\n");
}

void check_stats(Comm& comm) {
  const int n = comm.size();
  if (n == 1 || comm.backend() == "mpi") return;  // mpi records the ring formula, not a measurement
  comm.reset_stats();
  const size_t count = 1200 * static_cast<size_t>(n);  // divisible by n: no chunk rounding
  std::vector<float> data(count, 1.0f);
  comm.all_reduce(data.data(), count);
  const uint64_t expected = 2 * (n - 1) * count * sizeof(float) / n;  // the ring's 2(n-1)/n x bytes
  OpStats stats = comm.stats().at("all_reduce");
  if (stats.bytes_sent != expected || stats.bytes_received != expected || stats.calls != 1) {
    failures++;
    std::fprintf(stderr, "rank %d: all_reduce sent %llu received %llu bytes, ring formula says %llu\n", comm.rank(),
                 static_cast<unsigned long long>(stats.bytes_sent),
                 static_cast<unsigned long long>(stats.bytes_received), static_cast<unsigned long long>(expected));
  }
}

void die_in_the_middle(Comm& comm, int die_rank) {
  std::vector<float> data(1000, 1.0f);
  for (int step = 0;; step++) {
    if (step == 3 && comm.rank() == die_rank) {
      std::fprintf(stderr, "rank %d: dying now\n", comm.rank());
      raise(SIGKILL);
    }
    comm.all_reduce(data.data(), data.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int run(int argc, char** argv) {
  CommOptions options;
  int die_rank = -1;
  ArgParser parser("comm_worker", "Checks every collective on every rank (the communication tests' worker).");
  add_comm_flags(parser, options);
  parser.add_int("--die-rank", &die_rank, -1, "this rank kills itself mid-run (tests peer failure)");
  parser.parse(argc, argv);

  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), options);
  if (die_rank >= 0) die_in_the_middle(*world, die_rank);
  check_all_reduce(*world);
  check_reduce_scatter_and_all_gather(*world);
  check_broadcast_and_point_to_point(*world);
  check_split(*world);
  check_async_overlap(*world);
  check_stats(*world);
  world->barrier();
  if (failures > 0) {
    std::fprintf(stderr, "rank %d: %d check(s) failed\n", world->rank(), failures);
    return 1;
  }
  std::printf("rank %d: all checks passed (%s, %d ranks)\n", world->rank(), world->backend().c_str(), world->size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("comm_worker", [&] { return run(argc, argv); });
}
