// The collectives tour: every rank runs this, every collective runs once on
// rank-dependent data, rank 0 prints what each rank had before and after, and
// every rank checks its own result against the answer worked out by hand.
//
//   ./build/bin/launch --nproc-per-node 4 -- ./build/bin/collectives_tour
//   mpirun -np 4 ./build/bin/collectives_tour
//
// Both print the same thing: the launcher and mpirun only differ in how the
// processes find each other, not in what the collectives compute.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/comm/env.h"
#include "common/tensor/error.h"

using namespace course;

namespace {

// "[1 1 1]"
std::string show(const std::vector<float>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); i++) {
    char number[16];
    std::snprintf(number, sizeof(number), "%g", values[i]);
    text += (i ? " " : "") + std::string(number);
  }
  return text + "]";
}

class Tour {
 public:
  explicit Tour(Comm& world) : world_(world) {}

  // Prints, on rank 0, every rank's `values` under `label`. Uses all_gather, so
  // every rank must call it (it is a collective too).
  void print_all(const std::string& label, const std::vector<float>& values) {
    // Comm moves floats only; counts travel as floats, exact up to 2^24
    std::vector<size_t> counts(world_.size());
    float my_count = static_cast<float>(values.size());
    std::vector<float> all_counts(world_.size());
    world_.all_gather(&my_count, all_counts.data(), 1);
    size_t total = 0;
    for (int r = 0; r < world_.size(); r++) total += counts[r] = static_cast<size_t>(all_counts[r]);
    std::vector<float> everything(total);
    world_.all_gather(values.data(), everything.data(), counts);
    if (world_.rank() != 0) return;
    std::printf("  %-7s", label.c_str());
    size_t offset = 0;
    for (int r = 0; r < world_.size(); r++) {
      std::vector<float> part(everything.begin() + offset, everything.begin() + offset + counts[r]);
      std::printf("%s rank %d %s", r ? " |" : "", r, show(part).c_str());
      offset += counts[r];
    }
    std::printf("\n");
  }

  void title(const std::string& text) {
    if (world_.rank() == 0) std::printf("\n%s\n", text.c_str());
  }

  // Each rank compares its result with the expected one; the verdict is agreed on
  // by all ranks (an all_reduce of the failure count) and printed by rank 0.
  void check(const std::vector<float>& result, const std::vector<float>& expected) {
    float failed = result == expected ? 0.0f : 1.0f;
    if (failed != 0.0f) {
      std::fprintf(stderr, "rank %d: expected %s, got %s\n", world_.rank(), show(expected).c_str(),
                   show(result).c_str());
    }
    world_.all_reduce(&failed, 1);
    failures_ += failed != 0.0f ? 1 : 0;  // `failed` now counts the ranks that got it wrong
    checks_++;
    if (world_.rank() == 0) std::printf("  %s\n", failed == 0.0f ? "checked: correct on every rank" : "WRONG");
  }

  int failures() const { return failures_; }
  int checks() const { return checks_; }

 private:
  Comm& world_;
  int failures_ = 0;
  int checks_ = 0;
};

int run(int argc, char** argv) {
  CommOptions comm_options;
  ArgParser parser("collectives_tour", "Runs every collective once on every rank and checks the results.");
  add_comm_flags(parser, comm_options);
  parser.parse(argc, argv);
  if (comm_options.backend == "nccl") {
    throw FlagError("the tour's buffers live on the CPU: use --backend tcp or mpi (nccl needs GPU buffers)");
  }

  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), comm_options);
  const int n = world->size(), rank = world->rank();
  const float r = static_cast<float>(rank);
  Tour tour(*world);
  if (rank == 0) std::printf("collectives tour: %d rank(s), backend %s\n", n, world->backend().c_str());

  // ---- all_reduce: everyone ends with the sum of everyone's data -------------
  tour.title("all_reduce (sum): each rank starts with [r+1, 10(r+1)]");
  std::vector<float> data = {r + 1, 10 * (r + 1)};
  tour.print_all("before", data);
  world->all_reduce(data.data(), data.size(), ReduceOp::Sum);
  tour.print_all("after", data);
  const float sum_of_r_plus_1 = n * (n + 1) / 2.0f;
  tour.check(data, {sum_of_r_plus_1, 10 * sum_of_r_plus_1});

  // ---- all_reduce average: how DDP averages gradients -------------------------
  tour.title("all_reduce (average): each rank starts with [2r]");
  data = {2 * r};
  tour.print_all("before", data);
  world->all_reduce(data.data(), data.size(), ReduceOp::Average);
  tour.print_all("after", data);
  tour.check(data, {static_cast<float>(n - 1)});

  // ---- reduce_scatter: the sum, but each rank keeps only its block -------------
  tour.title("reduce_scatter (sum): each rank starts with [0, 1, ..., n-1] + r; rank i keeps block i");
  std::vector<float> full(n);
  for (int i = 0; i < n; i++) full[i] = static_cast<float>(i) + r;
  tour.print_all("before", full);
  std::vector<float> block(1);
  world->reduce_scatter(full.data(), block.data(), 1, ReduceOp::Sum);
  tour.print_all("after", block);
  tour.check(block, {static_cast<float>(n * rank) + n * (n - 1) / 2.0f});

  // ---- all_gather: everyone ends with everyone's block, in rank order ----------
  tour.title("all_gather: each rank contributes [100 + r]");
  std::vector<float> mine = {100 + r};
  std::vector<float> gathered(n);
  world->all_gather(mine.data(), gathered.data(), 1);
  tour.print_all("after", gathered);
  std::vector<float> expected(n);
  for (int i = 0; i < n; i++) expected[i] = 100.0f + i;
  tour.check(gathered, expected);

  // ---- all_gather with uneven sizes: rank r contributes r+1 values ------------
  tour.title("all_gather (uneven): rank r contributes r+1 copies of r");
  std::vector<size_t> counts(n);
  std::vector<float> uneven_expected;
  for (int i = 0; i < n; i++) {
    counts[i] = static_cast<size_t>(i) + 1;
    uneven_expected.insert(uneven_expected.end(), counts[i], static_cast<float>(i));
  }
  std::vector<float> my_values(counts[rank], r);
  std::vector<float> uneven(uneven_expected.size());
  world->all_gather(my_values.data(), uneven.data(), counts);
  tour.print_all("after", uneven);
  tour.check(uneven, uneven_expected);

  // ---- broadcast: the root's data everywhere -----------------------------------
  const int root = n - 1;
  tour.title("broadcast from rank " + std::to_string(root) + ": each rank starts with [r, r]");
  data = {r, r};
  tour.print_all("before", data);
  world->broadcast(data.data(), data.size(), root);
  tour.print_all("after", data);
  tour.check(data, {static_cast<float>(root), static_cast<float>(root)});

  // ---- send/recv: a ring shift, every rank passes its value to the right -------
  tour.title("send/recv ring shift: rank r sends [r] to rank r+1 and receives from rank r-1");
  std::vector<float> outgoing = {r}, incoming = {-1};
  world->send_recv(outgoing.data(), 1, (rank + 1) % n, incoming.data(), 1, (rank + n - 1) % n);
  tour.print_all("after", incoming);
  tour.check(incoming, {static_cast<float>((rank + n - 1) % n)});

  // ---- split: sub-groups, the building block of 2D and 3D parallelism ----------
  tour.title("split into even and odd ranks, then all_reduce (sum) of [r] inside each group");
  std::unique_ptr<Comm> group = world->split(rank % 2, rank);
  data = {r};
  group->all_reduce(data.data(), 1, ReduceOp::Sum);
  tour.print_all("after", data);
  float group_sum = 0;
  for (int i = rank % 2; i < n; i += 2) group_sum += static_cast<float>(i);
  tour.check(data, {group_sum});

  world->barrier();
  if (rank == 0) {
    std::printf("\n%d of %d collectives correct on all %d rank(s)\n", tour.checks() - tour.failures(), tour.checks(),
                n);
  }
  return tour.failures() == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("collectives_tour", [&] { return run(argc, argv); });
}
