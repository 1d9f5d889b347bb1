// Collective bandwidth, in the manner of nccl-tests: for each collective and
// message size, the time per call, the algorithm bandwidth (bytes / time) and the
// bus bandwidth, which rescales algbw by how much each rank must really move so
// that one number can be compared across world sizes and with the link speed:
//   all_reduce:                  busbw = algbw x 2(n-1)/n
//   all_gather, reduce_scatter:  busbw = algbw x (n-1)/n
//   all_to_all:                  busbw = algbw x (n-1)/n  (every block but the own crosses a link)
//   broadcast:                   busbw = algbw
// Every rank runs it; rank 0 prints the table.
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/bench_collectives --backend tcp
//   mpirun -np 2 ./build/bin/bench_collectives --backend mpi
//   ./benchmarks/run_collectives.sh      # both backends at 2 and 4 ranks
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/train/metrics.h"  // now_seconds

using namespace course;

namespace {

struct Collective {
  std::string name;
  double bus_factor;  // busbw / algbw
};

// Seconds per call of `collective` on `bytes` (the full buffer size), the
// slowest rank's average: a collective is only as fast as its last rank.
double time_collective(Comm& comm, const std::string& collective, size_t bytes, int iterations) {
  const int n = comm.size();
  const size_t count = bytes / sizeof(float);
  const size_t block = count / n;  // for reduce_scatter / all_gather / all_to_all: each rank's share
  std::vector<float> buffer(count, 1.0f), other(count, 0.0f);
  auto once = [&] {
    if (collective == "all_reduce") comm.all_reduce(buffer.data(), count);
    if (collective == "all_gather") comm.all_gather(buffer.data(), other.data(), block);
    if (collective == "reduce_scatter") comm.reduce_scatter(buffer.data(), other.data(), block);
    if (collective == "all_to_all") comm.all_to_all(buffer.data(), other.data(), block);
    if (collective == "broadcast") comm.broadcast(buffer.data(), count, 0);
  };
  once();  // warm-up: connections, page faults, caches
  comm.barrier();
  const double start = now_seconds();
  for (int i = 0; i < iterations; i++) once();
  float seconds = static_cast<float>((now_seconds() - start) / iterations);
  std::vector<float> all(n);
  comm.all_gather(&seconds, all.data(), 1);
  return *std::max_element(all.begin(), all.end());
}

// "4 KiB", "16 MiB": message sizes are powers of two, so they get binary units
// (KiB = 2^10, MiB = 2^20 bytes); KB and MB mean 10^3 and 10^6 bytes in the course.
std::string size_label(size_t bytes) {
  return bytes >= (1u << 20) ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes >> 10) + " KiB";
}

int run(int argc, char** argv) {
  CommOptions options;
  int max_megabytes = 64;
  std::string only = "all";
  ArgParser parser("bench_collectives", "Bandwidth of each collective from 4 KiB up (run under launch or mpirun).");
  add_comm_flags(parser, options);
  parser.add_int("--max-mb", &max_megabytes, 1, "largest message, in MiB");
  parser.add_choice("--collective", &only,
                    {"all", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"},
                    "measure only this one");
  parser.parse(argc, argv);

  std::unique_ptr<Comm> comm = create_world_comm(read_launch_env(), options);
  const int n = comm->size();
  const double ring = n > 1 ? static_cast<double>(n - 1) / n : 1.0;
  const std::vector<Collective> collectives = {
      {"all_reduce", 2 * ring}, {"all_gather", ring}, {"reduce_scatter", ring}, {"all_to_all", ring},
      {"broadcast", 1.0}};

  if (comm->rank() == 0) {
    std::printf("backend %s, %d ranks\n", comm->backend().c_str(), n);
    std::printf("%-15s %10s %12s %12s %12s\n", "collective", "size", "time (us)", "algbw GB/s", "busbw GB/s");
  }
  for (const Collective& collective : collectives) {
    if (only != "all" && only != collective.name) continue;
    for (size_t bytes = 4096; bytes <= static_cast<size_t>(max_megabytes) << 20; bytes *= 4) {
      // about 64 MiB of traffic per measurement, at least 3 calls
      const int iterations = static_cast<int>(std::max<size_t>(3, (64u << 20) / bytes));
      const double seconds = time_collective(*comm, collective.name, bytes, std::min(iterations, 200));
      const double algbw = bytes / seconds / 1e9;
      if (comm->rank() == 0) {
        std::printf("%-15s %10s %12.1f %12.3f %12.3f\n", collective.name.c_str(), size_label(bytes).c_str(),
                    seconds * 1e6, algbw, algbw * collective.bus_factor);
        std::fflush(stdout);  // under the launcher stdout is a pipe: show each row as it comes
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("bench_collectives", [&] { return run(argc, argv); });
}
