// Linear layers on the GPU: linear_forward and linear_backward through cuBLAS.
//
// The reference is ops_cpu.cpp: the same three cblas_sgemm calls (forward, dinp,
// dweight) with the same arguments, so each GEMM below can be read against its CPU
// twin line for line. That is why every call goes through gemm_row_major, which
// takes cblas-style row-major arguments and does the column-major translation for
// cuBLAS in one place (gemm.h). The bias add and the bias gradient are small kernels.
//
// Precision (common/tensor/device.h, read on every call; gemm.h): FP32, TF32, or BF16, where
// both inputs are first copied to bf16 scratch and cuBLAS multiplies them with fp32
// accumulation into the fp32 output. Weights and gradients stay fp32: only each
// product's inputs are rounded. Scratch: under BF16 only, 2 bytes per element of
// the two inputs of one GEMM; and the bias gradient's chunk sums, at most 256 x OC floats.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/tensor/cuda/column_sums.h"
#include "common/tensor/cuda/gemm.h"
#include "common/tensor/cuda/ops_cuda.h"
#include "common/tensor/cuda/runtime.h"
#include "common/tensor/device.h"

namespace course::cuda_ops {
namespace {

using cuda::gemm_mode;
using cuda::gemm_row_major;
using cuda::GemmInput;
using cuda::GemmMode;

// ---- bias -------------------------------------------------------------------

// out[i, o] += bias[o], one thread per element
__global__ void add_bias_kernel(float* out, const float* bias, int64_t n, int OC) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] += bias[i % OC];
}

void launch_add_bias(float* out, const float* bias, int N, int OC, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(N) * OC;
  if (n == 0) return;
  add_bias_kernel<<<cuda::blocks_for(n), cuda::kThreadsPerBlock, 0, stream>>>(out, bias, n, OC);
  CUDA_CHECK_LAUNCH("add_bias_kernel");
}

}  // namespace

// ---- the ops ----------------------------------------------------------------

namespace {

// GEMM input x of count values: a bf16 copy under BF16 (fp32 values), or the values as
// they are (fp32 in fp32 modes; bf16-stored ones, which need no copy)
GemmInput gemm_input(const float* x, int64_t count, const GemmMode& mode) { return GemmInput(x, count, mode); }
GemmInput gemm_input(const bf16* x, int64_t, const GemmMode&) { return GemmInput(x); }

// linear_forward and linear_backward, their input fp32 or bf16 (In)
template <typename In>
void linear_forward_of(float* out, const In* inp, const float* weight, const float* bias, int N, int IC, int OC) {
  const GemmMode mode = gemm_mode(matmul_precision());
  const GemmInput inp_in = gemm_input(inp, static_cast<int64_t>(N) * IC, mode);
  const GemmInput weight_in(weight, static_cast<int64_t>(OC) * IC, mode);
  // out (N, OC) = inp (N, IC) @ weight^T (IC, OC); beta = 0 overwrites out without reading it
  gemm_row_major(mode, false, true, N, OC, IC, 1.0f, inp_in.at(0), IC, weight_in.at(0), IC, 0.0f, out, OC);
  if (bias != nullptr) launch_add_bias(out, bias, N, OC, cuda::compute_stream());
}

template <typename In>
void linear_backward_of(float* dinp, float* dweight, float* dbias, const float* dout, const In* inp,
                        const float* weight, int N, int IC, int OC) {
  const GemmMode mode = gemm_mode(matmul_precision());
  // dout feeds both GEMMs: under BF16 it is converted once
  const GemmInput dout_in(dout, static_cast<int64_t>(N) * OC, mode);
  if (dinp != nullptr) {
    const GemmInput weight_in(weight, static_cast<int64_t>(OC) * IC, mode);
    // dinp (N, IC) += dout (N, OC) @ weight (OC, IC); beta = 1 accumulates
    gemm_row_major(mode, false, false, N, IC, OC, 1.0f, dout_in.at(0), OC, weight_in.at(0), IC, 1.0f, dinp, IC);
  }
  if (dweight != nullptr) {
    const GemmInput inp_in = gemm_input(inp, static_cast<int64_t>(N) * IC, mode);
    // dweight (OC, IC) += dout^T (OC, N) @ inp (N, IC); beta = 1 accumulates
    gemm_row_major(mode, true, false, OC, IC, N, 1.0f, dout_in.at(0), OC, inp_in.at(0), IC, 1.0f, dweight, IC);
  }
  // dbias[o] += sum_i dout[i, o], in a fixed order (column_sums.h)
  if (dbias != nullptr) launch_column_sum(dbias, MatrixElement{dout, OC}, N, OC, cuda::compute_stream());
}

}  // namespace

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int IC, int OC) {
  linear_forward_of(out, inp, weight, bias, N, IC, OC);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC) {
  linear_backward_of(dinp, dweight, dbias, dout, inp, weight, N, IC, OC);
}

// (compiled, never run on a GPU yet)
void linear_forward_bf16(float* out, const bf16* inp, const float* weight, const float* bias, int N, int IC, int OC) {
  linear_forward_of(out, inp, weight, bias, N, IC, OC);
}

void linear_backward_bf16(float* dinp, float* dweight, float* dbias, const float* dout, const bf16* inp,
                          const float* weight, int N, int IC, int OC) {
  linear_backward_of(dinp, dweight, dbias, dout, inp, weight, N, IC, OC);
}

}  // namespace course::cuda_ops
