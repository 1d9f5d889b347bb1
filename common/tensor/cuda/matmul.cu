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

// dbias[o] += sum_i dout[i, o], in two passes. One block per 32 columns alone gives
// C / 32 blocks (24 for C = 768, on a GPU with 132 SMs), so the rows are cut into
// chunks too: pass 1 runs a block per (32 columns, one chunk of rows) and writes each
// chunk's sums to a workspace; pass 2 adds a column's chunk sums, in chunk order,
// into dbias. No atomics: every sum is taken in the same order on every run.
constexpr int kColumnsPerBlock = 32;
constexpr int kRowLanes = 32;
// At least this many rows per chunk (below it a block has too little to read), and
// at most this many chunks (more rows per chunk above 256 x 256 rows instead).
constexpr int kMinRowsPerChunk = 256;
constexpr int kMaxChunks = 256;

struct RowChunks {
  int count;  // chunks of rows
  int rows;   // rows per chunk (the last one may have fewer)
};
// A function of N alone, so the order of the sums (and the result) never depends on the GPU.
RowChunks row_chunks(int N) {
  const int wanted = (N + kMinRowsPerChunk - 1) / kMinRowsPerChunk;
  const int count = std::max(1, std::min(wanted, kMaxChunks));
  return {count, (N + count - 1) / count};
}

// partial[chunk, o] = sum of dout[i, o] over the rows i of chunk blockIdx.y: threadIdx.x
// picks the column (so a warp reads 32 neighbouring floats of one row), threadIdx.y
// every kRowLanes-th row of the chunk; the lanes' sums meet in shared memory.
__global__ void column_sum_chunks_kernel(float* partial, const float* dout, int N, int OC, int rows_per_chunk) {
  __shared__ float lanes[kRowLanes][kColumnsPerBlock];
  const int column = blockIdx.x * kColumnsPerBlock + threadIdx.x;
  const int first_row = blockIdx.y * rows_per_chunk;
  const int end_row = min(N, first_row + rows_per_chunk);
  float sum = 0.0f;
  if (column < OC) {
    for (int row = first_row + threadIdx.y; row < end_row; row += kRowLanes) {
      sum += dout[static_cast<int64_t>(row) * OC + column];
    }
  }
  lanes[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && column < OC) {
    float total = 0.0f;
    for (int lane = 0; lane < kRowLanes; lane++) total += lanes[lane][threadIdx.x];
    partial[static_cast<int64_t>(blockIdx.y) * OC + column] = total;
  }
}

// dbias[o] += sum over chunks of partial[chunk, o], one thread per column
__global__ void add_chunk_sums_kernel(float* dbias, const float* partial, int chunks, int OC) {
  const int column = blockIdx.x * blockDim.x + threadIdx.x;
  if (column >= OC) return;
  float total = 0.0f;
  for (int chunk = 0; chunk < chunks; chunk++) total += partial[static_cast<int64_t>(chunk) * OC + column];
  dbias[column] += total;
}

void launch_column_sum(float* dbias, const float* dout, int N, int OC, cudaStream_t stream) {
  if (OC == 0 || N == 0) return;
  const RowChunks chunks = row_chunks(N);
  const cuda::DeviceScratch partial(static_cast<size_t>(chunks.count) * OC * sizeof(float));  // (chunks, OC)
  const dim3 grid((OC + kColumnsPerBlock - 1) / kColumnsPerBlock, chunks.count);
  const dim3 block(kColumnsPerBlock, kRowLanes);
  column_sum_chunks_kernel<<<grid, block, 0, stream>>>(partial.as<float>(), dout, N, OC, chunks.rows);
  CUDA_CHECK_LAUNCH("column_sum_chunks_kernel");
  add_chunk_sums_kernel<<<cuda::blocks_for(OC), cuda::kThreadsPerBlock, 0, stream>>>(dbias, partial.as<float>(),
                                                                                       chunks.count, OC);
  CUDA_CHECK_LAUNCH("add_chunk_sums_kernel");
}

}  // namespace

// ---- the ops ----------------------------------------------------------------

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int IC, int OC) {
  const GemmMode mode = gemm_mode(matmul_precision());
  const GemmInput inp_in(inp, static_cast<int64_t>(N) * IC, mode);
  const GemmInput weight_in(weight, static_cast<int64_t>(OC) * IC, mode);
  // out (N, OC) = inp (N, IC) @ weight^T (IC, OC); beta = 0 overwrites out without reading it
  gemm_row_major(mode, false, true, N, OC, IC, 1.0f, inp_in.at(0), IC, weight_in.at(0), IC, 0.0f, out, OC);
  if (bias != nullptr) launch_add_bias(out, bias, N, OC, cuda::compute_stream());
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
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
    const GemmInput inp_in(inp, static_cast<int64_t>(N) * IC, mode);
    // dweight (OC, IC) += dout^T (OC, N) @ inp (N, IC); beta = 1 accumulates
    gemm_row_major(mode, true, false, OC, IC, N, 1.0f, dout_in.at(0), OC, inp_in.at(0), IC, 1.0f, dweight, IC);
  }
  if (dbias != nullptr) launch_column_sum(dbias, dout, N, OC, cuda::compute_stream());
}

}  // namespace course::cuda_ops
