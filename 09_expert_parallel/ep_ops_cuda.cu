// Chapter 09's ops on the GPU (ep_ops.h).
// Reference: the functions of the same names in ep_ops_cpu.cpp (same formulas, same order of
// the sums). Compiled, never run on a GPU yet (test_cuda holds every one against the CPU's).
//
// Shape: one thread per expert for the counts (a column sum over the tokens, in double),
// one thread for the send rows (a scan over the choices in token order, sequential by
// definition, as moe_ops_cuda.cu's assign_rows), one per element for the aux gradient.
#include <cuda_runtime.h>

#include <cstdint>

#include "09_expert_parallel/ep_ops.h"
#include "common/tensor/cuda/launch.h"
#include "common/tensor/cuda/runtime.h"

namespace course::ep_cuda_ops {
namespace {

using cuda::item_index;
using cuda::launch_per_item;

// mine[e] = choices of e, mine[E + e] = sum_n probs[n, e]      (one thread per expert)
__global__ void routing_counts_kernel(float* mine, const int* expert, const float* probs, MoeSizes s) {
  const int64_t e = item_index();
  if (e >= s.experts) return;
  float chosen = 0.0f;
  for (int i = 0; i < s.tokens * s.top_k; i++) chosen += expert[i] == e ? 1.0f : 0.0f;
  double prob_sum = 0.0;
  for (int64_t n = 0; n < s.tokens; n++) prob_sum += probs[n * s.experts + e];
  mine[e] = chosen;
  mine[s.experts + e] = static_cast<float>(prob_sum);
}

// every choice's send row, expert by expert, each keeping its first kept[e]      (one thread: a scan)
__global__ void assign_send_rows_kernel(int* row, const int* expert, const float* counts, int rank, MoeSizes s) {
  const int E = s.experts;
  int begin = 0;
  // expert by expert (E passes over the choices, with no per-expert arrays): the rows the CPU's one pass gives
  for (int e = 0; e < E; e++) {
    int before = 0;
    for (int source = 0; source < rank; source++) before += static_cast<int>(counts[source * 2 * E + e]);
    const int kept = min(static_cast<int>(counts[rank * 2 * E + e]), max(0, s.capacity - before));
    int taken = 0;
    for (int i = 0; i < s.tokens * s.top_k; i++) {
      if (expert[i] != e) continue;
      row[i] = taken < kept ? begin + taken : -1;
      taken++;
    }
    begin += kept;
  }
}

// dprobs[n, e] += daux E (routed_e / (R N k)) / N      (one thread per element)
__global__ void aux_loss_backward_kernel(float* dprobs, const float* counts, float daux, int ranks, MoeSizes s) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(s.tokens) * s.experts) return;
  const int E = s.experts, e = index % E;
  int routed = 0;
  for (int source = 0; source < ranks; source++) routed += static_cast<int>(counts[source * 2 * E + e]);
  const double all_choices = static_cast<double>(ranks) * s.tokens * s.top_k;
  dprobs[index] += static_cast<float>(daux * E * (routed / all_choices) / static_cast<int64_t>(s.tokens));
}

}  // namespace

// ---- the ops (ep_ops.h), on the compute stream ----------------------------------------

void routing_counts(float* mine, const int* expert, const float* probs, const MoeSizes& s) {
  launch_per_item(routing_counts_kernel, "routing_counts_kernel", s.experts, mine, expert, probs, s);
}

void assign_send_rows(int* row, const int* expert, const float* counts, int rank, const MoeSizes& s) {
  assign_send_rows_kernel<<<1, 1, 0, cuda::compute_stream()>>>(row, expert, counts, rank, s);
  CUDA_CHECK_LAUNCH("assign_send_rows_kernel");
}

void aux_loss_backward(float* dprobs, const float* counts, float daux, int ranks, const MoeSizes& s) {
  launch_per_item(aux_loss_backward_kernel, "aux_loss_backward_kernel", static_cast<int64_t>(s.tokens) * s.experts,
                  dprobs, counts, daux, ranks, s);
}

}  // namespace course::ep_cuda_ops
