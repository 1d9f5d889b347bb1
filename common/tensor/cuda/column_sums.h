// out[o] += sum over rows i of term(i, o), in a fixed order: no atomics, so every run
// adds the same numbers in the same order and gets the same bits (a bias gradient,
// LayerNorm's dweight and dbias). Two passes. One block per 32 columns alone gives
// C / 32 blocks (24 for C = 768, on a GPU with 132 SMs), so the rows are cut into
// chunks too: pass 1 runs a block per (32 columns, one chunk of rows) and writes each
// chunk's sums to a workspace (at most 256 x OC floats); pass 2 adds a column's chunk
// sums, in chunk order, into out. Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/tensor/cuda/runtime.h"

namespace course::cuda_ops {

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
inline RowChunks row_chunks(int N) {
  const int wanted = (N + kMinRowsPerChunk - 1) / kMinRowsPerChunk;
  const int count = std::max(1, std::min(wanted, kMaxChunks));
  return {count, (N + count - 1) / count};
}

// partial[chunk, o] = sum of term(i, o) over the rows i of chunk blockIdx.y: threadIdx.x
// picks the column (so a warp reads 32 neighbouring floats of one row), threadIdx.y
// every kRowLanes-th row of the chunk; the lanes' sums meet in shared memory.
template <typename Term>
__global__ void column_sum_chunks_kernel(float* partial, Term term, int N, int OC, int rows_per_chunk) {
  __shared__ float lanes[kRowLanes][kColumnsPerBlock];
  const int column = blockIdx.x * kColumnsPerBlock + threadIdx.x;
  const int first_row = blockIdx.y * rows_per_chunk;
  const int end_row = min(N, first_row + rows_per_chunk);
  float sum = 0.0f;
  if (column < OC) {
    for (int row = first_row + threadIdx.y; row < end_row; row += kRowLanes) sum += term(row, column);
  }
  lanes[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && column < OC) {
    float total = 0.0f;
    for (int lane = 0; lane < kRowLanes; lane++) total += lanes[lane][threadIdx.x];
    partial[static_cast<int64_t>(blockIdx.y) * OC + column] = total;
  }
}

// out[o] += sum over chunks of partial[chunk, o], one thread per column (static: each .cu its own)
static __global__ void add_chunk_sums_kernel(float* out, const float* partial, int chunks, int OC) {
  const int column = blockIdx.x * blockDim.x + threadIdx.x;
  if (column >= OC) return;
  float total = 0.0f;
  for (int chunk = 0; chunk < chunks; chunk++) total += partial[static_cast<int64_t>(chunk) * OC + column];
  out[column] += total;
}

// out[o] += sum_i term(i, o) for i < N, o < OC; term: a struct with
// __device__ float operator()(int row, int column) const
template <typename Term>
void launch_column_sum(float* out, Term term, int N, int OC, cudaStream_t stream) {
  if (OC == 0 || N == 0) return;
  const RowChunks chunks = row_chunks(N);
  const cuda::DeviceScratch partial(static_cast<size_t>(chunks.count) * OC * sizeof(float));  // (chunks, OC)
  const dim3 grid((OC + kColumnsPerBlock - 1) / kColumnsPerBlock, chunks.count);
  const dim3 block(kColumnsPerBlock, kRowLanes);
  column_sum_chunks_kernel<<<grid, block, 0, stream>>>(partial.as<float>(), term, N, OC, chunks.rows);
  CUDA_CHECK_LAUNCH("column_sum_chunks_kernel");
  add_chunk_sums_kernel<<<cuda::blocks_for(OC), cuda::kThreadsPerBlock, 0, stream>>>(out, partial.as<float>(),
                                                                                       chunks.count, OC);
  CUDA_CHECK_LAUNCH("add_chunk_sums_kernel");
}

// term(i, o) = matrix[i, o] of a row-major (N, OC) matrix: its column sums
struct MatrixElement {
  const float* matrix;
  int OC;
  __device__ float operator()(int row, int column) const { return matrix[static_cast<int64_t>(row) * OC + column]; }
};

}  // namespace course::cuda_ops
