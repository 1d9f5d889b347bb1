// What the bandwidth-optimal (ring) algorithms put on the wire, per rank.
//
// The mpi and nccl backends cannot count their bytes: MPI and NCCL do not say what
// they sent, and their algorithm (ring, tree, recursive doubling, NVLink SHARP ...)
// depends on the message size and the machine. So those backends record what the
// ring algorithm sends, the lower bound any algorithm needs, and every backend's
// counters can be compared against it. For n ranks and a buffer of B bytes:
//
//   all_reduce                  2(n-1)/n * B sent and received (reduce-scatter + all-gather)
//   reduce_scatter, all_gather   (n-1)/n * B sent and received (B = the whole buffer, all blocks)
//   all_to_all                  every block but this rank's own, sent and received once (the
//                               pairwise exchange: nothing is forwarded, so nothing less will do);
//                               (n-1)/n * B when the blocks are equal
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace course {

inline uint64_t ring_all_reduce_bytes(uint64_t bytes, int ranks) {
  return 2 * static_cast<uint64_t>(ranks - 1) * bytes / static_cast<uint64_t>(ranks);
}

inline uint64_t ring_gather_bytes(uint64_t total_bytes, int ranks) {
  return static_cast<uint64_t>(ranks - 1) * total_bytes / static_cast<uint64_t>(ranks);
}

// The ring all-gather of blocks of counts[r] floats: rank `rank` forwards every block
// but its right neighbour's, which reaches it last (uneven blocks: a shard's part of
// a range, chapter 07's FSDP)
inline uint64_t ring_gather_bytes(const std::vector<size_t>& counts, int rank) {
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  return static_cast<uint64_t>(total - counts[(rank + 1) % counts.size()]) * sizeof(float);
}

// The ring reduce-scatter of blocks of counts[r] floats: rank `rank` sends a partial
// sum of every block but its own, which it finishes
inline uint64_t ring_reduce_scatter_bytes(const std::vector<size_t>& counts, int rank) {
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  return static_cast<uint64_t>(total - counts[rank]) * sizeof(float);
}

// counts: send_counts for the bytes sent, recv_counts for the bytes received
inline uint64_t all_to_all_bytes(const std::vector<size_t>& counts, int rank, size_t element = sizeof(float)) {
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  return static_cast<uint64_t>(total - counts[rank]) * element;
}

}  // namespace course
