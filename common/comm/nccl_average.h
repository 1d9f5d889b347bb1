// ReduceOp::Average on the nccl backend (comm_nccl.cpp), as every backend computes it:
// NCCL's sum, then each value divided in fp32 and rounded once to the buffer's type
// (comm_util.h's divide, the tcp ring's and mpi's). NCCL's own ncclAvg multiplies each
// rank's input by 1/ranks before the sum, and for ncclBfloat16 that factor is itself
// rounded to bf16: bf16(1/3) = 0.333984, so an average over 3, 5, 6 or 7 ranks would
// come out 0.2-0.4% too large. Builds with CUDA and NCCL only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "common/tensor/bf16.h"

namespace course {

// data[i] = data[i] / ranks for `count` values of `type` in device memory, queued on `stream`
void launch_divide(void* data, size_t count, DType type, int ranks, cudaStream_t stream);

}  // namespace course
