// The mixture of experts' ops on the GPU (moe_ops.h).
// Reference: the functions of the same names in moe_ops_cpu.cpp (same formulas, same order
// of the sums within a thread). Compiled, never run on a GPU yet (test_cuda holds every one
// against the CPU's).
//
// Shape: one thread per token for the router's softmax and top-k (E and k are small), one
// per element for the row copies, one per token and channel where a token's k choices are
// summed (in choice order), and one per expert for the aux loss's column sums. No two
// threads add into the same value, so the results are the same bits on every run.
// assign_rows is one thread: expert e's rows go to its first choices in token order, a
// scan over the N k choices that is sequential by definition; N k is a few thousand here.
// (A fast version counts per block and scans the counts, as Megatron's token dispatcher
// does.)
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/model/moe_ops.h"
#include "common/tensor/cuda/launch.h"
#include "common/tensor/cuda/runtime.h"

namespace course::moe_cuda_ops {
namespace {

using cuda::item_index;
using cuda::launch_per_item;

// ---- kernels ----------------------------------------------------------------

// probs[n] = softmax(logits[n]) in place      (one thread per token)
__global__ void router_softmax_kernel(float* probs, int N, int E) {
  const int64_t n = item_index();
  if (n >= N) return;
  float* p = probs + n * E;
  float max_logit = p[0];
  for (int e = 1; e < E; e++) max_logit = fmaxf(max_logit, p[e]);
  float sum = 0.0f;
  for (int e = 0; e < E; e++) {
    p[e] = expf(p[e] - max_logit);
    sum += p[e];
  }
  for (int e = 0; e < E; e++) p[e] /= sum;
}

// dlogits[n, e] = p_e (dp_e - sum_i p_i dp_i)      (one thread per token)
__global__ void router_softmax_backward_kernel(float* dlogits, const float* dprobs, const float* probs, int N, int E) {
  const int64_t n = item_index();
  if (n >= N) return;
  const float* p = probs + n * E;
  const float* dp = dprobs + n * E;
  float p_dot_dp = 0.0f;
  for (int e = 0; e < E; e++) p_dot_dp += p[e] * dp[e];
  for (int e = 0; e < E; e++) dlogits[n * E + e] = p[e] * (dp[e] - p_dot_dp);
}

// the k largest probs of token n, ties to the lower index, and their gates      (one thread per token)
__global__ void route_top_k_kernel(int* expert, float* gate, const float* probs, MoeSizes s) {
  const int64_t n = item_index();
  if (n >= s.tokens) return;
  const int E = s.experts, k = s.top_k;
  const float* p = probs + n * E;
  int* chosen = expert + n * k;
  float chosen_sum = 0.0f;
  for (int j = 0; j < k; j++) {
    int best = -1;
    for (int e = 0; e < E; e++) {
      bool taken = false;
      for (int i = 0; i < j; i++) taken = taken || chosen[i] == e;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    chosen[j] = best;
    chosen_sum += p[best];
  }
  const float divisor = k == 1 ? 1.0f : chosen_sum;
  for (int j = 0; j < k; j++) gate[n * k + j] = p[chosen[j]] / divisor;
}

// dprobs of token n's chosen experts, through its gates      (one thread per token)
__global__ void route_top_k_backward_kernel(float* dprobs, const float* dgate, const int* expert, const float* gate,
                                            const float* probs, MoeSizes s) {
  const int64_t n = item_index();
  if (n >= s.tokens) return;
  const int E = s.experts, k = s.top_k;
  const int* chosen = expert + n * k;
  const float* g = gate + n * k;
  const float* dg = dgate + n * k;
  if (k == 1) {
    dprobs[n * E + chosen[0]] += dg[0];
    return;
  }
  float chosen_sum = 0.0f, dg_dot_g = 0.0f;
  for (int j = 0; j < k; j++) {
    chosen_sum += probs[n * E + chosen[j]];
    dg_dot_g += dg[j] * g[j];
  }
  for (int j = 0; j < k; j++) dprobs[n * E + chosen[j]] += (dg[j] - dg_dot_g) / chosen_sum;
}

// routed, expert_begin and every choice's row, in token order      (one thread: a scan)
__global__ void assign_rows_kernel(int* row, int* expert_begin, int* routed, const int* expert, MoeSizes s) {
  const int E = s.experts, choices = s.tokens * s.top_k;
  for (int e = 0; e < E; e++) routed[e] = 0;
  for (int i = 0; i < choices; i++) routed[expert[i]]++;
  expert_begin[0] = 0;
  for (int e = 0; e < E; e++) expert_begin[e + 1] = expert_begin[e] + min(routed[e], s.capacity);
  // routed[e] counts again from 0 as the rows are handed out, then ends where it was
  for (int e = 0; e < E; e++) routed[e] = 0;
  for (int i = 0; i < choices; i++) {
    const int e = expert[i];
    row[i] = routed[e] < s.capacity ? expert_begin[e] + routed[e] : -1;
    routed[e]++;
  }
}

// expert_in[row[i], c] = x[i / k, c] for every kept choice i      (one thread per choice and channel)
__global__ void dispatch_forward_kernel(float* expert_in, const float* x, const int* row, MoeSizes s) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(s.tokens) * s.top_k * s.channels) return;
  const int64_t choice = index / s.channels, c = index % s.channels;
  const int r = row[choice];
  if (r >= 0) expert_in[static_cast<int64_t>(r) * s.channels + c] = x[(choice / s.top_k) * s.channels + c];
}

// dx[n, c] += dexpert_in[row[n, j], c] over n's kept choices, in order      (one thread per token and channel)
__global__ void dispatch_backward_kernel(float* dx, const float* dexpert_in, const int* row, MoeSizes s) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(s.tokens) * s.channels) return;
  const int64_t n = index / s.channels, c = index % s.channels;
  float sum = dx[index];
  for (int j = 0; j < s.top_k; j++) {
    const int r = row[n * s.top_k + j];
    if (r >= 0) sum += dexpert_in[static_cast<int64_t>(r) * s.channels + c];
  }
  dx[index] = sum;
}

// out[n, c] = sum over n's kept choices of gate x expert_out[row, c]      (one thread per token and channel)
__global__ void combine_forward_kernel(float* out, const float* expert_out, const float* gate, const int* row,
                                       MoeSizes s) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(s.tokens) * s.channels) return;
  const int64_t n = index / s.channels, c = index % s.channels;
  float sum = 0.0f;
  for (int j = 0; j < s.top_k; j++) {
    const int r = row[n * s.top_k + j];
    if (r >= 0) sum += gate[n * s.top_k + j] * expert_out[static_cast<int64_t>(r) * s.channels + c];
  }
  out[index] = sum;
}

// dexpert_out[row[i], c] += gate[i] dout[i / k, c]      (one thread per choice and channel: a row is one choice's)
__global__ void combine_backward_rows_kernel(float* dexpert_out, const float* dout, const float* gate, const int* row,
                                             MoeSizes s) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(s.tokens) * s.top_k * s.channels) return;
  const int64_t choice = index / s.channels, c = index % s.channels;
  const int r = row[choice];
  if (r >= 0) {
    dexpert_out[static_cast<int64_t>(r) * s.channels + c] += gate[choice] * dout[(choice / s.top_k) * s.channels + c];
  }
}

// dgate[i] += dout[i / k] . expert_out[row[i]]      (one thread per choice)
__global__ void combine_backward_gates_kernel(float* dgate, const float* dout, const float* expert_out, const int* row,
                                              MoeSizes s) {
  const int64_t choice = item_index();
  if (choice >= s.tokens * s.top_k) return;
  const int r = row[choice];
  if (r < 0) return;
  const float* dy = dout + (choice / s.top_k) * s.channels;
  const float* o = expert_out + static_cast<int64_t>(r) * s.channels;
  float dot = 0.0f;
  for (int c = 0; c < s.channels; c++) dot += dy[c] * o[c];
  dgate[choice] += dot;
}

// prob_sums[e] = sum_n probs[n, e], in double      (one thread per expert)
__global__ void prob_sums_kernel(double* prob_sums, const float* probs, int N, int E) {
  const int64_t e = item_index();
  if (e >= E) return;
  double sum = 0.0;
  for (int64_t n = 0; n < N; n++) sum += probs[n * E + e];
  prob_sums[e] = sum;
}

// dprobs[n, e] += daux E (routed[e] / (N k)) / N      (one thread per element)
__global__ void aux_loss_backward_kernel(float* dprobs, const int* routed, float daux, MoeSizes s) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(s.tokens) * s.experts) return;
  const int e = index % s.experts;
  dprobs[index] += daux * s.experts * (static_cast<float>(routed[e]) / (s.tokens * s.top_k)) / s.tokens;
}

}  // namespace

// ---- the ops (moe_ops.h), on the compute stream ---------------------------------------

void router_softmax(float* probs, int N, int E) {
  launch_per_item(router_softmax_kernel, "router_softmax_kernel", N, probs, N, E);
}

void router_softmax_backward(float* dlogits, const float* dprobs, const float* probs, int N, int E) {
  launch_per_item(router_softmax_backward_kernel, "router_softmax_backward_kernel", N, dlogits, dprobs, probs, N, E);
}

void route_top_k(int* expert, float* gate, const float* probs, const MoeSizes& s) {
  launch_per_item(route_top_k_kernel, "route_top_k_kernel", s.tokens, expert, gate, probs, s);
}

void route_top_k_backward(float* dprobs, const float* dgate, const int* expert, const float* gate, const float* probs,
                          const MoeSizes& s) {
  launch_per_item(route_top_k_backward_kernel, "route_top_k_backward_kernel", s.tokens, dprobs, dgate, expert, gate,
                  probs, s);
}

void assign_rows(int* row, int* expert_begin, int* routed, const int* expert, const MoeSizes& s) {
  assign_rows_kernel<<<1, 1, 0, cuda::compute_stream()>>>(row, expert_begin, routed, expert, s);
  CUDA_CHECK_LAUNCH("assign_rows_kernel");
}

void dispatch_forward(float* expert_in, const float* x, const int* row, const MoeSizes& s) {
  launch_per_item(dispatch_forward_kernel, "dispatch_forward_kernel", static_cast<int64_t>(s.rows()) * s.channels,
                  expert_in, x, row, s);
}

void dispatch_backward(float* dx, const float* dexpert_in, const int* row, const MoeSizes& s) {
  launch_per_item(dispatch_backward_kernel, "dispatch_backward_kernel", static_cast<int64_t>(s.tokens) * s.channels, dx,
                  dexpert_in, row, s);
}

void combine_forward(float* out, const float* expert_out, const float* gate, const int* row, const MoeSizes& s) {
  launch_per_item(combine_forward_kernel, "combine_forward_kernel", static_cast<int64_t>(s.tokens) * s.channels, out,
                  expert_out, gate, row, s);
}

void combine_backward(float* dexpert_out, float* dgate, const float* dout, const float* expert_out, const float* gate,
                      const int* row, const MoeSizes& s) {
  launch_per_item(combine_backward_rows_kernel, "combine_backward_rows_kernel",
                  static_cast<int64_t>(s.rows()) * s.channels, dexpert_out, dout, gate, row, s);
  launch_per_item(combine_backward_gates_kernel, "combine_backward_gates_kernel", s.rows(), dgate, dout, expert_out,
                  row, s);
}

float aux_loss_forward(const float* probs, const int* routed, const MoeSizes& s) {
  const int E = s.experts;
  cuda::DeviceScratch prob_sums(E * sizeof(double));
  launch_per_item(prob_sums_kernel, "prob_sums_kernel", E, prob_sums.as<double>(), probs, s.tokens, E);
  std::vector<double> sums(E);
  std::vector<int> counts(E);
  cudaStream_t stream = cuda::compute_stream();
  CUDA_CHECK(cudaMemcpyAsync(sums.data(), prob_sums.as<double>(), E * sizeof(double), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(counts.data(), routed, E * sizeof(int), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // the numbers are on the host only once the stream gets here
  // the CPU's sum, term by term
  double aux = 0.0;
  for (int e = 0; e < E; e++) {
    const double routed_fraction = static_cast<double>(counts[e]) / s.rows();
    aux += routed_fraction * (sums[e] / s.tokens);
  }
  return static_cast<float>(E * aux);
}

void aux_loss_backward(float* dprobs, const int* routed, float daux, const MoeSizes& s) {
  launch_per_item(aux_loss_backward_kernel, "aux_loss_backward_kernel", static_cast<int64_t>(s.tokens) * s.experts,
                  dprobs, routed, daux, s);
}

}  // namespace course::moe_cuda_ops
