// Expert parallelism's own ops: the steps of the layer that depend on every rank's counts
// (expert_parallel.h), each with a CPU and a CUDA version of one signature, in an op table of
// this chapter's own (ep_ops_for), as moe_ops_for is the single-process layer's. counts is the
// all-gathered (R, 2E) table: each rank's routed choices per expert (exact integers in
// floats), then its router probability sums per expert.
#pragma once

#include "common/model/moe_ops.h"
#include "common/tensor/memory.h"

namespace course::ep_ops {

// mine[e] = this rank's choices of expert e, mine[E + e] = sum_n probs[n, e] (in double)
void routing_counts(float* mine,         // (2E)  this rank's row of counts
                    const int* expert,   // (N, k)
                    const float* probs,  // (N, E)
                    const MoeSizes& s);

// This rank's choices' rows in the send buffer: grouped by expert (so by owner), expert e
// keeping its first kept[e] choices in token order, kept[e] = min(routed here,
// capacity - what the ranks before this one routed to e); -1 for the others.
void assign_send_rows(int* row,             // (N, k)
                      const int* expert,    // (N, k)
                      const float* counts,  // (R, 2E)
                      int rank, const MoeSizes& s);

// The aux loss through this rank's tokens: dprobs[n, e] += daux E f_e / N, f_e = all ranks'
// choices of e over all ranks' R N k (the header comment's scaling)
void aux_loss_backward(float* dprobs,        // (N, E)
                       const float* counts,  // (R, 2E)
                       float daux, int ranks, const MoeSizes& s);

}  // namespace course::ep_ops

namespace course {

// One device's implementations of the ops above (ep_ops_cpu.cpp; ep_ops_cuda.cu, compiled,
// never run on a GPU yet), with the same signatures.
struct EPOpTable {
  decltype(&ep_ops::routing_counts) routing_counts;
  decltype(&ep_ops::assign_send_rows) assign_send_rows;
  decltype(&ep_ops::aux_loss_backward) aux_loss_backward;
};

#ifdef COURSE_HAVE_CUDA
// The CUDA versions (ep_ops_cuda.cu).
namespace ep_cuda_ops {
decltype(ep_ops::routing_counts) routing_counts;
decltype(ep_ops::assign_send_rows) assign_send_rows;
decltype(ep_ops::aux_loss_backward) aux_loss_backward;
}  // namespace ep_cuda_ops
#endif

// The ops for data on `device`: the CPU's, the guarded device's (the CPU's with its arena
// open) or CUDA's. CourseError for CUDA in a CPU-only build.
const EPOpTable& ep_ops_for(Device device);

}  // namespace course
