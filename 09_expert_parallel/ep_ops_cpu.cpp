// Chapter 09's ops on the CPU (ep_ops.h): plain loops over the tokens and experts.
#include "09_expert_parallel/ep_ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace course::ep_ops {

void routing_counts(float* mine, const int* expert, const float* probs, const MoeSizes& s) {
  const int E = s.experts;
  std::vector<double> prob_sum(E, 0.0);  // in double, as moe_ops.h's aux loss
  for (int e = 0; e < E; e++) mine[e] = 0.0f;
  for (int i = 0; i < s.rows(); i++) mine[expert[i]] += 1.0f;
  for (int n = 0; n < s.tokens; n++) {
    for (int e = 0; e < E; e++) prob_sum[e] += probs[static_cast<int64_t>(n) * E + e];
  }
  for (int e = 0; e < E; e++) mine[E + e] = static_cast<float>(prob_sum[e]);
}

void assign_send_rows(int* row, const int* expert, const float* counts, int rank, const MoeSizes& s) {
  const int E = s.experts;
  std::vector<int> next(E, 0), limit(E, 0);
  for (int e = 0, begin = 0; e < E; e++) {
    // expert e takes rank 0's choices first, then rank 1's, ...: what capacity leaves for this rank
    int before = 0;
    for (int source = 0; source < rank; source++) before += static_cast<int>(counts[source * 2 * E + e]);
    const int kept = std::min(static_cast<int>(counts[rank * 2 * E + e]), std::max(0, s.capacity - before));
    next[e] = begin;
    limit[e] = begin + kept;
    begin = limit[e];
  }
  for (int i = 0; i < s.rows(); i++) row[i] = next[expert[i]] < limit[expert[i]] ? next[expert[i]]++ : -1;
}

void aux_loss_backward(float* dprobs, const float* counts, float daux, int ranks, const MoeSizes& s) {
  const int E = s.experts;
  const int64_t N = s.tokens;
  const double all_choices = static_cast<double>(ranks) * s.rows();
  for (int e = 0; e < E; e++) {
    int routed = 0;
    for (int source = 0; source < ranks; source++) routed += static_cast<int>(counts[source * 2 * E + e]);
    const float d = static_cast<float>(daux * E * (routed / all_choices) / N);
    for (int64_t n = 0; n < N; n++) dprobs[n * E + e] += d;
  }
}

}  // namespace course::ep_ops
