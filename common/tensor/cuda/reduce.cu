// Reductions: mean and sum_squares (a gradient norm^2), which return a number to the
// host, and add_mean (a micro-batch's mean loss added to its step's), which leaves it on the GPU.
// Reference: mean / sum_squares / add_mean in common/tensor/ops_cpu.cpp (all accumulate in double).
// Shape: two passes in a fixed order, so the same input always gives the same bits: each block sums its
// grid-stride share in double into one partial, then a single block sums the partials. mean and
// sum_squares copy the one double that results to the host on the compute stream, and wait for it;
// add_mean adds it into its total with one more thread, and returns at once.
#include <algorithm>
#include <cstdint>

#include "common/tensor/cuda/ops_cuda.h"
#include "common/tensor/cuda/runtime.h"

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

// total[0] += float(sum[0] / n) / divisor: the CPU's roundings in the CPU's order (one thread). The
// divisions are IEEE-rounded as on the CPU: the course builds without --use_fast_math.
__global__ void add_mean_kernel(float* total, const double* sum, int64_t n, float divisor) {
  total[0] += static_cast<float>(sum[0] / static_cast<double>(n)) / divisor;
}

// Scratch for one reduction from the caching pool: the partials, then the sum. Its blocks go back to
// the pool when the op returns; later work on the same stream is all that reuses them.
struct SumScratch {
  explicit SumScratch(int64_t n)
      : blocks(static_cast<unsigned int>(std::min<int64_t>(cuda::blocks_for(n), kMaxPartials))),
        memory((blocks + 1) * sizeof(double)) {}
  double* partials() const { return memory.as<double>(); }
  double* sum() const { return partials() + blocks; }
  unsigned int blocks;
  cuda::DeviceScratch memory;
};

// *scratch.sum() = sum(x) or sum(x^2) in double, queued on the stream (n > 0)
void queue_sum(const SumScratch& scratch, const float* x, int64_t n, bool square, cudaStream_t stream) {
  launch_partial_sums(scratch.partials(), scratch.blocks, x, n, square, stream);
  launch_sum_partials(scratch.sum(), scratch.partials(), static_cast<int>(scratch.blocks), stream);
}

// sum(x) or sum(x^2) in double, computed on the GPU and returned to the host (waits for the stream)
double device_sum(const float* x, int64_t n, bool square, cudaStream_t stream) {
  if (n == 0) return 0.0;
  const SumScratch scratch(n);
  queue_sum(scratch, x, n, square, stream);

  double result = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&result, scratch.sum(), sizeof(double), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // result is on the host only once the stream gets here
  return result;
}

}  // namespace

// n == 0 gives 0/0 = NaN, as on the CPU
float mean(const float* x, int64_t n) {
  return static_cast<float>(device_sum(x, n, /*square=*/false, cuda::compute_stream()) / n);
}

// n == 0 adds 0/0 = NaN, as on the CPU
void add_mean(float* total, const float* x, int64_t n, float divisor) {
  cudaStream_t stream = cuda::compute_stream();
  const SumScratch scratch(std::max<int64_t>(n, 1));
  if (n == 0) {
    CUDA_CHECK(cudaMemsetAsync(scratch.sum(), 0, sizeof(double), stream));
  } else {
    queue_sum(scratch, x, n, /*square=*/false, stream);
  }
  add_mean_kernel<<<1, 1, 0, stream>>>(total, scratch.sum(), n, divisor);
  CUDA_CHECK_LAUNCH("add_mean_kernel");
}

double sum_squares(const float* x, int64_t n) { return device_sum(x, n, /*square=*/true, cuda::compute_stream()); }

}  // namespace course::cuda_ops
