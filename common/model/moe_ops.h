// The mixture-of-experts layer's own ops (common/model/moe.h tells the layer): the router's
// softmax, top-k and capacity, the dispatch and combine permutations, and the aux loss, each
// with its backward. Each has a CPU and a CUDA version of one signature, in an op table of
// their own (moe_ops_for), as ops_for is the library's. Every pointer lives on the device
// whose table is used; the int arrays are int32.
#pragma once

#include <cstdint>

#include "common/tensor/memory.h"

namespace course {

// The sizes of one MoE layer in one forward call.
struct MoeSizes {
  int tokens;    // N: the forward call's tokens (B x T)
  int channels;  // C
  int experts;   // E
  int top_k;     // k: experts per token
  int capacity;  // the most token-choices one expert takes (moe_capacity); N: no limit
  int rows() const { return tokens * top_k; }  // the expert buffers' rows: every choice kept
};

}  // namespace course

namespace course::moe_ops {

// probs = exp(logits - max) / sum exp(logits - max), per token, in place over the logits
void router_softmax(float* probs,  // (N, E)  logits in, probabilities out
                    int N, int E);
// dlogits = probs * (dprobs - sum_e probs dprobs), per token (overwritten)
void router_softmax_backward(float* dlogits,       // (N, E)
                             const float* dprobs,  // (N, E)
                             const float* probs,   // (N, E)
                             int N, int E);

// expert[n, :] = the k largest probs[n, :] in descending order (a tie: lower index
// first); k = 1: gate[n, 0] = probs[n, expert[n, 0]];
// k >= 2: gate[n, j] = probs[n, expert[n, j]] / sum_i probs[n, expert[n, i]]
void route_top_k(int* expert,         // (N, k)
                 float* gate,         // (N, k)
                 const float* probs,  // (N, E)
                 const MoeSizes& s);
// k = 1: dprobs[n, expert[n, 0]] += dgate[n, 0];
// k >= 2, through the renormalisation, S = sum of the chosen probs:
// dprobs[n, expert[n, j]] += (dgate[n, j] - sum_i dgate[n, i] gate[n, i]) / S
void route_top_k_backward(float* dprobs,       // (N, E)
                          const float* dgate,  // (N, k)
                          const int* expert,   // (N, k)
                          const float* gate,   // (N, k)
                          const float* probs,  // (N, E)
                          const MoeSizes& s);

// Rows for the choices: routed[e] = choices of e; expert e keeps its first
// `capacity` choices in token order, at rows expert_begin[e] + 0, 1, ...; row = -1
// for the others.
void assign_rows(int* row,           // (N, k)
                 int* expert_begin,  // (E + 1)
                 int* routed,        // (E)
                 const int* expert,  // (N, k)
                 const MoeSizes& s);

// expert_in[row[n, j]] = x[n] for every kept choice
void dispatch_forward(float* expert_in,  // (N k, C)
                      const float* x,    // (N, C)
                      const int* row,    // (N, k)
                      const MoeSizes& s);
// dx[n] += dexpert_in[row[n, j]] for every kept choice
void dispatch_backward(float* dx,                // (N, C)
                       const float* dexpert_in,  // (N k, C)
                       const int* row,           // (N, k)
                       const MoeSizes& s);

// out[n] = sum over kept choices j of gate[n, j] expert_out[row[n, j]] (overwritten)
void combine_forward(float* out,               // (N, C)
                     const float* expert_out,  // (N k, C)
                     const float* gate,        // (N, k)
                     const int* row,           // (N, k)
                     const MoeSizes& s);
// dexpert_out[row[n, j]] += gate[n, j] dout[n], dgate[n, j] += dout[n] . expert_out[row[n, j]]
void combine_backward(float* dexpert_out,       // (N k, C)
                      float* dgate,             // (N, k)
                      const float* dout,        // (N, C)
                      const float* expert_out,  // (N k, C)
                      const float* gate,        // (N, k)
                      const int* row,           // (N, k)
                      const MoeSizes& s);

// aux = E sum_e f_e P_e, f_e = routed[e] / (N k), P_e = sum_n probs[n, e] / N, in double
// (on a GPU, copied to the host, which waits for it: a figure for the step line)
float aux_loss_forward(const float* probs,  // (N, E)
                       const int* routed,   // (E)
                       const MoeSizes& s);
// dprobs[n, e] += daux E f_e / N  (f_e is a count: no gradient flows through it)
void aux_loss_backward(float* dprobs,       // (N, E)
                       const int* routed,   // (E)
                       float daux, const MoeSizes& s);

}  // namespace course::moe_ops

namespace course {

// One device's implementations of the ops above (moe_ops_cpu.cpp; moe_ops_cuda.cu, compiled,
// never run on a GPU yet), with the same signatures.
struct MoeOpTable {
  decltype(&moe_ops::router_softmax) router_softmax;
  decltype(&moe_ops::router_softmax_backward) router_softmax_backward;
  decltype(&moe_ops::route_top_k) route_top_k;
  decltype(&moe_ops::route_top_k_backward) route_top_k_backward;
  decltype(&moe_ops::assign_rows) assign_rows;
  decltype(&moe_ops::dispatch_forward) dispatch_forward;
  decltype(&moe_ops::dispatch_backward) dispatch_backward;
  decltype(&moe_ops::combine_forward) combine_forward;
  decltype(&moe_ops::combine_backward) combine_backward;
  decltype(&moe_ops::aux_loss_forward) aux_loss_forward;
  decltype(&moe_ops::aux_loss_backward) aux_loss_backward;
};

#ifdef COURSE_HAVE_CUDA
// The CUDA versions (moe_ops_cuda.cu).
namespace moe_cuda_ops {
decltype(moe_ops::router_softmax) router_softmax;
decltype(moe_ops::router_softmax_backward) router_softmax_backward;
decltype(moe_ops::route_top_k) route_top_k;
decltype(moe_ops::route_top_k_backward) route_top_k_backward;
decltype(moe_ops::assign_rows) assign_rows;
decltype(moe_ops::dispatch_forward) dispatch_forward;
decltype(moe_ops::dispatch_backward) dispatch_backward;
decltype(moe_ops::combine_forward) combine_forward;
decltype(moe_ops::combine_backward) combine_backward;
decltype(moe_ops::aux_loss_forward) aux_loss_forward;
decltype(moe_ops::aux_loss_backward) aux_loss_backward;
}  // namespace moe_cuda_ops
#endif

// The ops for data on `device`: the CPU's, the guarded device's (the CPU's with its arena
// open) or CUDA's. CourseError for CUDA in a CPU-only build.
const MoeOpTable& moe_ops_for(Device device);

}  // namespace course
