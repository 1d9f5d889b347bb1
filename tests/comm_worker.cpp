// The program every rank runs in the communication tests: each collective on
// rank-dependent data, checked against a hand-computed answer. Values are
// integer-valued floats, so sums are exact and the answers are exact.
//
//   comm_worker [--backend auto|tcp|mpi|nccl] [--device cpu|cuda] [--comm-timeout S] [--die-rank R]
//
// With --device cuda every collective runs on device buffers (Buffer on
// Device::CUDA): the inputs are copied in, the results copied out, and the same
// checks made. nccl takes them as they are; tcp and mpi stage them through the host
// (create_world_comm with CommOptions::buffers = Device::CUDA picks which). Then
// also: an operation issued behind compute still queued on the GPU must see that
// compute's result (no synchronisation by the caller), a staged Comm passes host
// pointers through, and nccl refuses host pointers with a clear error.
//
// With --die-rank R, rank R kills itself (SIGKILL) in the middle of a loop of
// all_reduces, and the others must report the failure and exit non-zero within
// the timeout. Prints "rank R: all checks passed" and exits 0 when all is well.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/tensor/bf16.h"
#include "common/tensor/device.h"
#include "common/tensor/memory.h"
#include "07_3d/process_grid.h"
#ifdef COURSE_HAVE_CUDA
#include "common/tensor/cuda/runtime.h"
#endif

using namespace course;

namespace {

int failures = 0;
Device buffers_on = Device::CPU;  // --device: where the collectives' buffers live

// Where a check's vector goes through a collective: the vector itself with --device
// cpu; with --device cuda a device copy of it, read back by to_host().
class Place {
 public:
  explicit Place(std::vector<float>& values) : values_(values) {
    if (buffers_on == Device::CUDA) {
      device_ = Buffer(values.size(), MemCategory::CommBuffers, Device::CUDA);
      copy_bytes(device_.data(), Device::CUDA, values.data(), Device::CPU, values.size() * sizeof(float));
    }
  }
  float* data() { return buffers_on == Device::CUDA ? device_.data() : values_.data(); }
  // the collective's results, back in the vector
  void to_host() {
    if (buffers_on == Device::CUDA) {
      copy_bytes(values_.data(), Device::CPU, device_.data(), Device::CUDA, values_.size() * sizeof(float));
    }
  }

 private:
  std::vector<float>& values_;
  Buffer device_;
};

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
    std::vector<float> sum(count), average(count), maximum(count), expected_sum(count), expected_average(count),
        expected_maximum(count);
    for (size_t i = 0; i < count; i++) {
      sum[i] = average[i] = static_cast<float>(rank * 1000 + static_cast<int>(i % 97));
      expected_sum[i] = static_cast<float>(1000 * n * (n - 1) / 2 + n * static_cast<int>(i % 97));
      expected_average[i] = expected_sum[i] / n;
      // the largest value sits on a different rank for each element, and is negative on some
      const int owner = static_cast<int>(i % n);
      maximum[i] = rank == owner ? 5.0f - static_cast<float>(i % 11) : -100.0f - static_cast<float>(rank);
      expected_maximum[i] = 5.0f - static_cast<float>(i % 11);
    }
    Place sum_place(sum), average_place(average), maximum_place(maximum);
    comm.all_reduce(sum_place.data(), count, ReduceOp::Sum);
    comm.all_reduce(average_place.data(), count, ReduceOp::Average);
    comm.all_reduce(maximum_place.data(), count, ReduceOp::Max);
    sum_place.to_host();
    average_place.to_host();
    maximum_place.to_host();
    expect_equal("all_reduce sum, count " + std::to_string(count), sum, expected_sum, rank);
    expect_equal("all_reduce average, count " + std::to_string(count), average, expected_average, rank);
    expect_equal("all_reduce max, count " + std::to_string(count), maximum, expected_maximum, rank);
  }
}

// A NaN on one rank and a number on another: every rank must end with the same
// bits (a max that took its own copy first would give NaN on one rank, the number on
// the other), at a small count (two ranks: the one-exchange all-reduce) and a large
// one (the ring). Checked by gathering every rank's result. The course's tcp
// collectives only: Open MPI and NCCL pick their own algorithms.
void check_all_reduce_agrees_on_nan(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  if (n == 1 || comm.backend().rfind("tcp", 0) != 0) return;
  for (size_t count : {size_t{5}, size_t{100003}}) {
    std::vector<float> values(count);
    for (size_t i = 0; i < count; i++) {
      values[i] = static_cast<int>(i % n) == rank ? std::nanf("") : static_cast<float>(rank + 1);
    }
    Place values_place(values);
    comm.all_reduce(values_place.data(), count, ReduceOp::Max);
    std::vector<float> everyone(count * n);
    Place everyone_place(everyone);
    comm.all_gather(values_place.data(), everyone_place.data(), count);
    everyone_place.to_host();
    for (int r = 0; r < n; r++) {
      if (std::memcmp(everyone.data() + r * count, everyone.data(), count * sizeof(float)) != 0) {
        failures++;
        std::fprintf(stderr, "rank %d: all_reduce max with NaNs, count %zu: rank %d's bits differ from rank 0's\n",
                     rank, count, r);
      }
    }
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
    Place in_place(in), out_place(out);
    comm.reduce_scatter(in_place.data(), out_place.data(), counts, ReduceOp::Sum);
    out_place.to_host();
    expect_equal("reduce_scatter" + label, out, expected_out, rank);
    // the same with Average (divided by the number of ranks, not n - 1) and Max (rank n-1's value)
    std::vector<float> averaged(counts[rank]), expected_averaged(counts[rank]), largest(counts[rank]),
        expected_largest(counts[rank]);
    for (size_t k = 0; k < counts[rank]; k++) {
      expected_averaged[k] = expected_out[k] / static_cast<float>(n);
      expected_largest[k] = static_cast<float>(n - 1 + static_cast<int>(offsets[rank] + k));
    }
    Place averaged_place(averaged), largest_place(largest);
    comm.reduce_scatter(in_place.data(), averaged_place.data(), counts, ReduceOp::Average);
    comm.reduce_scatter(in_place.data(), largest_place.data(), counts, ReduceOp::Max);
    averaged_place.to_host();
    largest_place.to_host();
    expect_equal("reduce_scatter average" + label, averaged, expected_averaged, rank);
    expect_equal("reduce_scatter max" + label, largest, expected_largest, rank);

    // all_gather: rank r contributes counts[r] copies of 10 r + k
    std::vector<float> mine(counts[rank]), gathered(total), expected_gathered(total);
    for (size_t k = 0; k < counts[rank]; k++) mine[k] = static_cast<float>(10 * rank + static_cast<int>(k));
    for (int r = 0; r < n; r++) {
      for (size_t k = 0; k < counts[r]; k++) expected_gathered[offsets[r] + k] = static_cast<float>(10 * r + k);
    }
    Place mine_place(mine), gathered_place(gathered);
    comm.all_gather(mine_place.data(), gathered_place.data(), counts);
    gathered_place.to_host();
    expect_equal("all_gather" + label, gathered, expected_gathered, rank);
  }
}

// The reductions in bf16 (half the bytes). Values are small integers, so every sum is
// exact in bf16's 8 significant bits and the answers are exact; Average's division
// rounds once, to bf16(sum / n). Each operation sends half the bytes of the same one
// in fp32. With --device cuda the buffers are device memory, as --grad-comm-dtype
// bf16's buckets are.
class Bf16Place {
 public:
  explicit Bf16Place(std::vector<bf16>& values)
      : values_(values), device_(values.size(), MemCategory::CommBuffers, buffers_on) {
    copy_bytes(device_.data(), buffers_on, values.data(), Device::CPU, values.size() * sizeof(bf16));
  }
  bf16* data() { return device_.data(); }
  void to_host() { copy_bytes(values_.data(), Device::CPU, device_.data(), buffers_on, values_.size() * sizeof(bf16)); }

 private:
  std::vector<bf16>& values_;
  TypedBuffer<bf16> device_;
};

void expect_equal(const std::string& what, const std::vector<bf16>& actual, const std::vector<float>& expected,
                  int rank) {
  std::vector<float> widened(actual.size());
  for (size_t i = 0; i < actual.size(); i++) widened[i] = to_float(actual[i]);
  expect_equal(what + " (bf16)", widened, expected, rank);
}

uint64_t bytes_sent(const Comm& comm, const std::string& operation) {
  const auto stats = comm.stats();
  return stats.count(operation) != 0 ? stats.at(operation).bytes_sent : 0;
}

void check_bf16_reductions(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  for (size_t count : test_sizes(n)) {
    std::vector<bf16> sum(count), average(count), maximum(count);
    std::vector<float> as_fp32(count), expected_sum(count), expected_average(count), expected_maximum(count);
    for (size_t i = 0; i < count; i++) {
      as_fp32[i] = static_cast<float>(10 * rank + static_cast<int>(i % 7));
      sum[i] = average[i] = to_bf16(as_fp32[i]);
      maximum[i] = to_bf16(static_cast<float>(static_cast<int>(i % n) == rank ? 50 : -rank));
      expected_sum[i] = static_cast<float>(10 * n * (n - 1) / 2 + n * static_cast<int>(i % 7));
      expected_average[i] = to_float(to_bf16(expected_sum[i] / static_cast<float>(n)));
      expected_maximum[i] = 50.0f;
    }
    Bf16Place sum_place(sum), average_place(average), maximum_place(maximum);
    const uint64_t before = bytes_sent(comm, "all_reduce");
    comm.all_reduce(sum_place.data(), count, ReduceOp::Sum);
    const uint64_t bf16_bytes = bytes_sent(comm, "all_reduce") - before;
    comm.all_reduce(average_place.data(), count, ReduceOp::Average);
    comm.all_reduce(maximum_place.data(), count, ReduceOp::Max);
    sum_place.to_host();
    average_place.to_host();
    maximum_place.to_host();
    const std::string label = ", count " + std::to_string(count);
    expect_equal("all_reduce sum" + label, sum, expected_sum, rank);
    expect_equal("all_reduce average" + label, average, expected_average, rank);
    expect_equal("all_reduce max" + label, maximum, expected_maximum, rank);
    Place fp32_place(as_fp32);
    const uint64_t fp32_before = bytes_sent(comm, "all_reduce");
    comm.all_reduce(fp32_place.data(), count, ReduceOp::Sum);
    const uint64_t fp32_bytes = bytes_sent(comm, "all_reduce") - fp32_before;
    // tcp counts what it sent; mpi and nccl count ring_volume.h's formula, whose
    // division by n rounds down once per operation: half within a byte
    const bool counted = comm.backend().rfind("tcp", 0) == 0;
    const uint64_t twice = 2 * bf16_bytes;
    if (counted ? twice != fp32_bytes : twice > fp32_bytes || twice + 1 < fp32_bytes) {
      failures++;
      std::fprintf(stderr, "rank %d: bf16 all_reduce%s sent %llu bytes, fp32 %llu: not half\n", rank, label.c_str(),
                   static_cast<unsigned long long>(bf16_bytes), static_cast<unsigned long long>(fp32_bytes));
    }

    // reduce_scatter and all_gather over uneven blocks (rank r's block: r + count % 3 values)
    std::vector<size_t> counts(n), offsets(n);
    for (int r = 0; r < n; r++) counts[r] = static_cast<size_t>(r) + count % 3;
    std::exclusive_scan(counts.begin(), counts.end(), offsets.begin(), size_t{0});
    const size_t total = offsets[n - 1] + counts[n - 1];
    std::vector<bf16> in(total), out(counts[rank]);
    std::vector<float> expected_out(counts[rank]);
    for (size_t j = 0; j < total; j++) in[j] = to_bf16(static_cast<float>(rank + static_cast<int>(j % 5)));
    for (size_t k = 0; k < counts[rank]; k++) {
      expected_out[k] = static_cast<float>(n * (n - 1) / 2 + n * static_cast<int>((offsets[rank] + k) % 5));
    }
    Bf16Place in_place(in), out_place(out);
    comm.reduce_scatter(in_place.data(), out_place.data(), counts, ReduceOp::Sum);
    out_place.to_host();
    expect_equal("reduce_scatter" + label, out, expected_out, rank);
    std::vector<bf16> gathered(total);
    std::vector<float> expected_gathered(total);
    for (int r = 0; r < n; r++) {
      for (size_t k = 0; k < counts[r]; k++) {
        const int j = static_cast<int>((offsets[r] + k) % 5);
        expected_gathered[offsets[r] + k] = static_cast<float>(n * (n - 1) / 2 + n * j);
      }
    }
    Bf16Place gathered_place(gathered);
    comm.all_gather(out_place.data(), gathered_place.data(), counts);
    gathered_place.to_host();
    expect_equal("all_gather" + label, gathered, expected_gathered, rank);
  }
}

// bf16 point to point (a pipeline's activations under --dtype bf16): a ring shift with
// send_recv, then send and recv between neighbours. Nothing is added, so every value
// arrives with its bits, whatever they are (NaN and Inf included), in 2 bytes a value.
void check_bf16_point_to_point(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  const int next = (rank + 1) % n, previous = (rank - 1 + n) % n;
  // rank r's value i: bits that name r and i, odd counts included
  auto bits_of = [](int r, size_t i) { return static_cast<uint16_t>((r * 7919 + i * 31) & 0xffff); };
  for (size_t count : {size_t{1}, size_t{7}, size_t{1001}, size_t{70001}}) {
    std::vector<bf16> mine(count), received(count);
    for (size_t i = 0; i < count; i++) mine[i].bits = bits_of(rank, i);
    Bf16Place mine_place(mine), received_place(received);
    const uint64_t before = bytes_sent(comm, "send_recv");
    comm.send_recv(mine_place.data(), count, next, received_place.data(), count, previous);
    const uint64_t sent = bytes_sent(comm, "send_recv") - before;
    received_place.to_host();
    size_t wrong = 0;
    for (size_t i = 0; i < count; i++) wrong += received[i].bits != bits_of(previous, i);
    if (n > 1 && sent != 2 * count) wrong++;
    // send and recv: even ranks send to the next, odd ranks receive from the previous
    if (n % 2 == 0) {
      std::vector<bf16> one_way(count);
      Bf16Place one_way_place(rank % 2 == 0 ? mine : one_way);
      if (rank % 2 == 0) {
        comm.send(one_way_place.data(), count, next);
      } else {
        comm.recv(one_way_place.data(), count, previous);
        one_way_place.to_host();
        for (size_t i = 0; i < count; i++) wrong += one_way[i].bits != bits_of(previous, i);
      }
    }
    if (wrong > 0) {
      failures++;
      std::fprintf(stderr, "rank %d: bf16 send_recv/send/recv of %zu values: %zu wrong (sent %llu bytes)\n", rank,
                   count, wrong, static_cast<unsigned long long>(sent));
    }
  }
}

// all_to_all: rank s's block for rank r holds (s n + r) 1000 + k % 1000 (exact in a
// float), so every block says where it came from and where it was going. Equal blocks,
// through the equal-size form and the vector form, then uneven ones where rank s sends
// (s + 2r + s r) % 3 floats to rank r, or 20000 times that (blocks larger than the
// shared-memory rings): some blocks are empty, own blocks included on some ranks. The
// bytes counted are every block but the own.
void check_all_to_all(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  struct Case {
    std::string label;
    bool equal_form;  // all_to_all(in, out, count_per_rank)
    std::function<size_t(int from, int to)> count;
  };
  const auto uneven = [](int from, int to) { return static_cast<size_t>((from + 2 * to + from * to) % 3); };
  const std::vector<Case> cases = {
      {"equal 5", true, [](int, int) { return size_t{5}; }},
      {"equal 70001", false, [](int, int) { return size_t{70001}; }},
      {"uneven", false, uneven},
      {"uneven large", false, [&](int from, int to) { return uneven(from, to) * 20000; }},
      // rank 0's blocks all alike, the others' not (routed tokens): a backend that picks its
      // algorithm from its own blocks alone calls two different collectives and hangs
      {"equal on rank 0 only", false,
       [](int from, int to) { return static_cast<size_t>(from == 0 || to == 0 ? 3 : 1 + to); }},
  };
  for (const Case& test : cases) {
    std::vector<size_t> send_counts(n), recv_counts(n);
    for (int r = 0; r < n; r++) {
      send_counts[r] = test.count(rank, r);
      recv_counts[r] = test.count(r, rank);
    }
    std::vector<float> in, out(std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0}), -1.0f), expected;
    for (int r = 0; r < n; r++) {
      for (size_t k = 0; k < send_counts[r]; k++) in.push_back(static_cast<float>((rank * n + r) * 1000 + k % 1000));
      for (size_t k = 0; k < recv_counts[r]; k++) {
        expected.push_back(static_cast<float>((r * n + rank) * 1000 + k % 1000));
      }
    }
    Place in_place(in), out_place(out);
    const OpStats before = comm.stats()["all_to_all"];
    if (test.equal_form) {
      comm.all_to_all(in_place.data(), out_place.data(), send_counts[0]);
    } else {
      comm.all_to_all(in_place.data(), send_counts, out_place.data(), recv_counts);
    }
    const OpStats used = comm.stats()["all_to_all"] - before;
    out_place.to_host();
    expect_equal("all_to_all " + test.label, out, expected, rank);
    const uint64_t sent = (in.size() - send_counts[rank]) * sizeof(float);
    const uint64_t received = (out.size() - recv_counts[rank]) * sizeof(float);
    if (used.bytes_sent != sent || used.bytes_received != received || used.calls != 1) {
      failures++;
      std::fprintf(stderr, "rank %d: all_to_all %s sent %llu received %llu bytes in %llu call(s), expected %llu and "
                   "%llu in 1\n", rank, test.label.c_str(), static_cast<unsigned long long>(used.bytes_sent),
                   static_cast<unsigned long long>(used.bytes_received), static_cast<unsigned long long>(used.calls),
                   static_cast<unsigned long long>(sent), static_cast<unsigned long long>(received));
    }

    // the same blocks in bf16: every value's bits arrive as sent, in 2 bytes a value
    auto bits_of = [n](int from, int to, size_t k) {
      return static_cast<uint16_t>(((from * n + to) * 131 + k) & 0xffff);
    };
    std::vector<bf16> in16, out16(out.size());
    std::vector<uint16_t> expected16;
    for (int r = 0; r < n; r++) {
      for (size_t k = 0; k < send_counts[r]; k++) in16.push_back(bf16{bits_of(rank, r, k)});
      for (size_t k = 0; k < recv_counts[r]; k++) expected16.push_back(bits_of(r, rank, k));
    }
    Bf16Place in16_place(in16), out16_place(out16);
    const OpStats before16 = comm.stats()["all_to_all"];
    comm.all_to_all(in16_place.data(), send_counts, out16_place.data(), recv_counts);
    const OpStats used16 = comm.stats()["all_to_all"] - before16;
    out16_place.to_host();
    size_t wrong = 0;
    for (size_t i = 0; i < out16.size(); i++) wrong += out16[i].bits != expected16[i];
    if (wrong > 0 || used16.bytes_sent != sent / 2 || used16.bytes_received != received / 2) {
      failures++;
      std::fprintf(stderr, "rank %d: bf16 all_to_all %s: %zu values wrong, sent %llu received %llu bytes\n", rank,
                   test.label.c_str(), wrong, static_cast<unsigned long long>(used16.bytes_sent),
                   static_cast<unsigned long long>(used16.bytes_received));
    }
  }
}

// `call` must throw a CommError whose message holds every one of `needles`.
void expect_refused(const std::string& what, const std::function<void()>& call,
                    const std::vector<std::string>& needles, int rank) {
  try {
    call();
  } catch (const CommError& error) {
    for (const std::string& needle : needles) {
      if (std::string(error.what()).find(needle) == std::string::npos) {
        failures++;
        std::fprintf(stderr, "rank %d: %s: the error does not say '%s': %s\n", rank, what.c_str(), needle.c_str(),
                     error.what());
      }
    }
    return;
  }
  failures++;
  std::fprintf(stderr, "rank %d: %s was not refused\n", rank, what.c_str());
}

// Arguments every rank can see are wrong are refused as the call is made, before
// anything is sent, so the Comm stays usable: a counts vector of the wrong size, a
// block to itself that it would receive at another size, overlapping buffers. Counts
// that disagree between two ranks only the receiver can see: tcp sends each block's
// length first and names both counts (on a group split off for it, which the
// failure breaks).
void check_all_to_all_refusals(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  std::vector<float> in(4 * (n + 1), 1.0f), out(4 * (n + 1), 0.0f);
  Place in_place(in), out_place(out);
  const std::vector<size_t> ones(n, 1), too_many(n + 1, 1);
  expect_refused("all_to_all with n + 1 send counts",
                 [&] { comm.all_to_all(in_place.data(), too_many, out_place.data(), ones); },
                 {"all_to_all", std::to_string(n + 1) + " counts for a group of " + std::to_string(n)}, rank);
  expect_refused("all_to_all with n + 1 receive counts",
                 [&] { comm.all_to_all(in_place.data(), ones, out_place.data(), too_many); },
                 {"all_to_all (recv_counts)"}, rank);
  std::vector<size_t> two_to_self = ones;
  two_to_self[rank] = 2;
  expect_refused("all_to_all sending itself 2 floats and receiving 1",
                 [&] { comm.all_to_all(in_place.data(), two_to_self, out_place.data(), ones); },
                 {"sends itself 2 values", "receives 1"}, rank);
  expect_refused("all_to_all in place", [&] { comm.all_to_all(in_place.data(), in_place.data(), 1); },
                 {"overlap"}, rank);

  if (n == 1 || comm.backend().rfind("tcp", 0) != 0) return;
  std::unique_ptr<Comm> scratch = comm.split(0, rank);
  std::vector<size_t> send_counts = ones;
  if (rank == 0) send_counts[1] = 2;  // rank 1 expects 1
  const std::vector<std::string> needles =
      rank == 1 ? std::vector<std::string>{"all_to_all", "rank 0 sends 2 values but this rank expects 1"}
                : std::vector<std::string>{};
  expect_refused("all_to_all with counts that disagree",
                 [&] { scratch->all_to_all(in_place.data(), send_counts, out_place.data(), ones); }, needles, rank);
}

void check_broadcast_and_point_to_point(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  for (int root = 0; root < n; root++) {
    for (size_t count : {size_t{1}, size_t{300001}}) {
      std::vector<float> data(count, static_cast<float>(rank)), expected(count, static_cast<float>(root));
      Place place(data);
      comm.broadcast(place.data(), count, root);
      place.to_host();
      expect_equal("broadcast from " + std::to_string(root), data, expected, rank);
    }
  }
  // a ring shift with send_recv, then the same with separate send and recv
  std::vector<float> outgoing(1000, static_cast<float>(rank)), incoming(1000, -1.0f);
  const int right = (rank + 1) % n, left = (rank + n - 1) % n;
  Place outgoing_place(outgoing), incoming_place(incoming);
  comm.send_recv(outgoing_place.data(), outgoing.size(), right, incoming_place.data(), incoming.size(), left);
  incoming_place.to_host();
  expect_equal("send_recv ring shift", incoming, std::vector<float>(1000, static_cast<float>(left)), rank);
  if (n > 1) {
    std::vector<float> value = {static_cast<float>(rank)};
    Place place(value);
    if (rank == 0) {
      comm.send(place.data(), 1, 1);
    } else if (rank == 1) {
      comm.recv(place.data(), 1, 0);
      place.to_host();
      expect_equal("send 0 -> recv 1", value, {0.0f}, rank);
    }
  }
  comm.barrier();
}

// One process grid's sub-communicators (07_3d/process_grid.h): each has its axis's
// size, this rank's coordinate as its rank, and sums over exactly the ranks that
// share the other two coordinates.
void check_grid(Comm& comm, const ProcessGrid& grid) {
  const int n = comm.size(), rank = comm.rank();
  const GridComms comms = split_grid(comm, grid);
  const GridCoords me = grid.coords_of(rank);
  const std::string name = std::string(grid_order_name(grid.order())) + " grid dp " + std::to_string(grid.dp_size()) +
                           " pp " + std::to_string(grid.pp_size()) + " tp " + std::to_string(grid.tp_size());
  struct Axis {
    const char* what;
    Comm* group;
    int size, coordinate;
    bool (*same_group)(GridCoords, GridCoords);
  };
  const Axis axes[] = {
      {"tp", comms.tp.get(), grid.tp_size(), me.tp,
       [](GridCoords a, GridCoords b) { return a.dp == b.dp && a.pp == b.pp; }},
      {"pp", comms.pp.get(), grid.pp_size(), me.pp,
       [](GridCoords a, GridCoords b) { return a.dp == b.dp && a.tp == b.tp; }},
      {"dp", comms.dp.get(), grid.dp_size(), me.dp,
       [](GridCoords a, GridCoords b) { return a.pp == b.pp && a.tp == b.tp; }},
  };
  for (const Axis& axis : axes) {
    std::vector<float> sum = {static_cast<float>(rank)};
    Place place(sum);
    axis.group->all_reduce(place.data(), 1);
    place.to_host();
    float expected = 0;
    for (int r = 0; r < n; r++) expected += axis.same_group(grid.coords_of(r), me) ? static_cast<float>(r) : 0.0f;
    expect_equal(name + ": " + axis.what + " group all_reduce of world ranks", sum, {expected}, rank);
    if (axis.group->size() != axis.size || axis.group->rank() != axis.coordinate) {
      failures++;
      std::fprintf(stderr, "rank %d: %s: %s group has size %d and rank %d, expected %d and %d\n", rank,
                   name.c_str(), axis.what, axis.group->size(), axis.group->rank(), axis.size, axis.coordinate);
    }
  }
}

// Every process grid of this world size, in both orders.
void check_process_grids(Comm& comm) {
  const int n = comm.size();
  for (const GridOrder order : {GridOrder::DpPpTp, GridOrder::PpDpTp}) {
    for (int dp = 1; dp <= n; dp++) {
      for (int pp = 1; dp * pp <= n; pp++) {
        if (n % (dp * pp) == 0) check_grid(comm, ProcessGrid(n, dp, pp, n / (dp * pp), order));
      }
    }
  }
}

void check_split(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  // a grid of rows of 2: row = rank / 2, column = rank % 2 (a 2x2 grid at 4 ranks)
  std::unique_ptr<Comm> row = comm.split(rank / 2, rank);
  std::unique_ptr<Comm> column = comm.split(rank % 2, rank);
  std::vector<float> row_sum = {static_cast<float>(rank)}, column_sum = {static_cast<float>(rank)};
  Place row_place(row_sum), column_place(column_sum);
  row->all_reduce(row_place.data(), 1);
  column->all_reduce(column_place.data(), 1);
  row_place.to_host();
  column_place.to_host();
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
  std::vector<float> more(1000, static_cast<float>(rank));
  Place place(gradients), more_place(more);
  Work pending = comm.all_reduce_async(place.data(), gradients.size());
  Work second = comm.all_reduce_async(more_place.data(), more.size());  // two in flight, done in issue order
  // meanwhile, "backward" goes on computing on this thread
  double busy = 0;
  for (int i = 0; i < 1000000; i++) busy += i * 0.5;
  pending.wait();
  second.wait();
  place.to_host();
  more_place.to_host();
  expect_equal("async all_reduce", gradients, std::vector<float>(gradients.size(), n * (n + 1) / 2.0f), rank);
  expect_equal("second async all_reduce", more, std::vector<float>(more.size(), n * (n - 1) / 2.0f), rank);
  if (busy < 0) std::printf("unreachable\n");
}

void check_stats(Comm& comm) {
  const int n = comm.size();
  // mpi records the ring formula, not a measurement ("mpi+staged" too: staging counts the host backend's bytes)
  if (n == 1 || comm.backend().rfind("mpi", 0) == 0) return;
  comm.reset_stats();
  const size_t count = 1200 * static_cast<size_t>(n);  // divisible by n: no chunk rounding
  std::vector<float> data(count, 1.0f);
  Place place(data);
  comm.all_reduce(place.data(), count);
  const uint64_t expected = 2 * (n - 1) * count * sizeof(float) / n;  // the ring's 2(n-1)/n x bytes
  OpStats stats = comm.stats().at("all_reduce");
  if (stats.bytes_sent != expected || stats.bytes_received != expected || stats.calls != 1) {
    failures++;
    std::fprintf(stderr, "rank %d: all_reduce sent %llu received %llu bytes, ring formula says %llu\n", comm.rank(),
                 static_cast<unsigned long long>(stats.bytes_sent),
                 static_cast<unsigned long long>(stats.bytes_received), static_cast<unsigned long long>(expected));
  }
}

#ifdef COURSE_HAVE_CUDA
// Operations issued while the compute that writes their input is still queued on
// the GPU (behind a chain of device copies), with no synchronisation by the caller:
// the Comm must make its own work wait for that compute (an event recorded on the
// compute stream as the operation is issued). Without the wait it would read the
// buffer before the last copy writes it. The all_gather is out of place, so it
// tells even at world size 1 (where an in-place all_reduce has nothing to do).
void check_compute_ordering(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  const size_t count = size_t{1} << 24;  // 64 MB
  const size_t bytes = count * sizeof(float);
  Buffer data(count, MemCategory::CommBuffers, Device::CUDA);
  Buffer gathered(count * n, MemCategory::CommBuffers, Device::CUDA);
  Buffer slow_a(count, MemCategory::Workspace, Device::CUDA), slow_b(count, MemCategory::Workspace, Device::CUDA);
  float* pinned = nullptr;
  CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned), bytes));
  for (size_t i = 0; i < count; i++) pinned[i] = static_cast<float>(rank + 1);
  // queues a few milliseconds of GPU work, then the copy that writes `data`, and returns at once
  auto queue_values_behind_slow_work = [&] {
    const cudaStream_t compute = cuda::compute_stream();
    for (int i = 0; i < 20; i++) {
      float* to = i % 2 == 0 ? slow_a.data() : slow_b.data();
      const float* from = i % 2 == 0 ? slow_b.data() : slow_a.data();
      CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, compute));
    }
    CUDA_CHECK(cudaMemcpyAsync(data.data(), pinned, bytes, cudaMemcpyHostToDevice, compute));
  };

  synchronize(Device::CUDA);  // the buffers' zeroing is done: only what follows is queued
  queue_values_behind_slow_work();
  Work gather = comm.all_gather_async(data.data(), gathered.data(), std::vector<size_t>(n, count));  // no sync first
  gather.wait();
  // queued on the compute stream after wait(): it reads the result
  std::vector<float> all(count * n), expected_all(count * n);
  copy_bytes(all.data(), Device::CPU, gathered.data(), Device::CUDA, all.size() * sizeof(float));
  for (int r = 0; r < n; r++) std::fill_n(expected_all.begin() + r * count, count, static_cast<float>(r + 1));
  expect_equal("all_gather issued behind queued compute", all, expected_all, rank);

  CUDA_CHECK(cudaMemsetAsync(data.data(), 0, bytes, cuda::compute_stream()));
  queue_values_behind_slow_work();
  Work reduce = comm.all_reduce_async(data.data(), count);
  reduce.wait();
  std::vector<float> result(count);
  copy_bytes(result.data(), Device::CPU, data.data(), Device::CUDA, bytes);
  expect_equal("all_reduce issued behind queued compute", result, std::vector<float>(count, n * (n + 1) / 2.0f),
               rank);
  CUDA_CHECK(cudaFreeHost(pinned));
}
#endif

// Host pointers next to device ones: a staged Comm passes them through (a loss kept
// on the CPU); nccl refuses them with an error that says why. The refusal breaks the
// Comm it happens on, so it is tried on a group split off for it.
void check_host_pointers(Comm& comm) {
  const int n = comm.size(), rank = comm.rank();
  std::vector<float> loss = {static_cast<float>(rank)};
  if (comm.backend() != "nccl") {
    comm.all_reduce(loss.data(), 1);
    expect_equal("all_reduce of a host pointer", loss, {n * (n - 1) / 2.0f}, rank);
    return;
  }
  std::unique_ptr<Comm> scratch = comm.split(0, rank);
  try {
    scratch->all_reduce(loss.data(), 1);
    failures++;
    std::fprintf(stderr, "rank %d: nccl took a host pointer without complaint\n", rank);
  } catch (const CommError& error) {
    const std::string message = error.what();
    if (message.find("host memory") == std::string::npos || message.find("all_reduce") == std::string::npos) {
      failures++;
      std::fprintf(stderr, "rank %d: nccl's error for a host pointer does not say so: %s\n", rank, error.what());
    }
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
  std::string device = "cpu";
  ArgParser parser("comm_worker", "Checks every collective on every rank (the communication tests' worker).");
  add_comm_flags(parser, options);
  parser.add_choice("--device", &device, {"cpu", "cuda"}, "where the buffers live (cuda: nccl, or tcp/mpi staged)");
  parser.add_int("--die-rank", &die_rank, -1, "this rank kills itself mid-run (tests peer failure)");
  parser.parse(argc, argv);
  // cuda: this rank's GPU, as a trainer picks it
  buffers_on = select_device(device, [](int gpus) { return gpu_for_rank(read_launch_env(), gpus); });
  options.buffers = buffers_on;

  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), options);
  if (die_rank >= 0) die_in_the_middle(*world, die_rank);
  check_all_reduce(*world);
  check_all_reduce_agrees_on_nan(*world);
  check_reduce_scatter_and_all_gather(*world);
  check_bf16_reductions(*world);
  check_bf16_point_to_point(*world);
  check_all_to_all(*world);
  check_all_to_all_refusals(*world);
  check_broadcast_and_point_to_point(*world);
  check_split(*world);
  check_process_grids(*world);
  check_async_overlap(*world);
  check_stats(*world);
  if (buffers_on == Device::CUDA) {
#ifdef COURSE_HAVE_CUDA
    check_compute_ordering(*world);
#endif
    check_host_pointers(*world);
  }
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
