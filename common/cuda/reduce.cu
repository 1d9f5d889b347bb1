// Reductions that return a number to the host: mean (the mean loss) and sum_squares (a gradient norm^2).
// Reference: mean / sum_squares in common/ops_cpu.cpp (both accumulate in double).
// Shape: two passes in a fixed order, so the same input always gives the same bits: each block sums its
// grid-stride share in double into one partial, then a single block sums the partials; the one double
// that results is copied to the host on the compute stream, which the op then waits for.
#include <algorithm>
#include <cstdint>

#include "common/cuda/ops_cuda.h"
#include "common/cuda/runtime.h"

namespace course::cuda_ops {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = cuda::kThreadsPerBlock / kWarpSize;
// how many partial sums the first pass leaves: enough blocks to keep every SM busy
constexpr int64_t kMaxPartials = 1024;

__device__ double warp_sum(double v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over a block of cuda::kThreadsPerBlock threads; the result is valid in thread 0.
__device__ double block_sum(double v) {
  __shared__ double warp_sums[kWarpsPerBlock];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  // the first warp adds up the warps' sums
  v = (threadIdx.x < kWarpsPerBlock) ? warp_sums[threadIdx.x] : 0.0;
  if (warp == 0) v = warp_sum(v);
  return v;
}

// partials[block] = sum of x[i] (or of x[i]^2 when square) over this block's grid-stride share, in double
template <bool kSquare>
__global__ void partial_sums_kernel(double* partials, const float* x, int64_t n) {
  double sum = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double value = x[i];
    sum += kSquare ? value * value : value;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// total = sum of the count partials (one block)
__global__ void sum_partials_kernel(double* total, const double* partials, int count) {
  double sum = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *total = sum;
}

void launch_partial_sums(double* partials, unsigned int blocks, const float* x, int64_t n, bool square,
                         cudaStream_t stream) {
  if (square) {
    partial_sums_kernel<true><<<blocks, cuda::kThreadsPerBlock, 0, stream>>>(partials, x, n);
  } else {
    partial_sums_kernel<false><<<blocks, cuda::kThreadsPerBlock, 0, stream>>>(partials, x, n);
  }
  CUDA_CHECK_LAUNCH("partial_sums_kernel");
}

void launch_sum_partials(double* total, const double* partials, int count, cudaStream_t stream) {
  sum_partials_kernel<<<1, cuda::kThreadsPerBlock, 0, stream>>>(total, partials, count);
  CUDA_CHECK_LAUNCH("sum_partials_kernel");
}

// sum(x) or sum(x^2) in double, computed on the GPU and returned to the host (waits for the stream)
double device_sum(const float* x, int64_t n, bool square, cudaStream_t stream) {
  if (n == 0) return 0.0;
  const unsigned int blocks = static_cast<unsigned int>(std::min<int64_t>(cuda::blocks_for(n), kMaxPartials));
  // scratch from the caching pool: the partials, then the total
  const cuda::DeviceScratch scratch((blocks + 1) * sizeof(double));
  double* partials = scratch.as<double>();
  double* total = partials + blocks;
  launch_partial_sums(partials, blocks, x, n, square, stream);
  launch_sum_partials(total, partials, static_cast<int>(blocks), stream);

  double result = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&result, total, sizeof(double), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // result is on the host only once the stream gets here
  return result;
}

}  // namespace

// n == 0 gives 0/0 = NaN, as on the CPU
float mean(const float* x, int64_t n) {
  return static_cast<float>(device_sum(x, n, /*square=*/false, cuda::compute_stream()) / n);
}

double sum_squares(const float* x, int64_t n) { return device_sum(x, n, /*square=*/true, cuda::compute_stream()); }

}  // namespace course::cuda_ops
