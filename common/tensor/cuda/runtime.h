// The CUDA side of the course's runtime: error checks, the streams, the cuBLAS
// handle and the caching allocator behind Buffer(..., Device::CUDA).
//
// Only CUDA builds compile this (COURSE_HAVE_CUDA); the chapters never include it:
// they reach the GPU through Buffer, ops_for(Device::CUDA) and common/tensor/device.h.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// Every CUDA and cuBLAS call is checked: a failure throws CourseError naming the
// call, where it was made and a hint.
#define CUDA_CHECK(call) ::course::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define CUBLAS_CHECK(call) ::course::cuda::check_cublas((call), #call, __FILE__, __LINE__)
// After a kernel launch: a bad launch configuration shows up here, not later.
#define CUDA_CHECK_LAUNCH(kernel_name) ::course::cuda::check_cuda(cudaGetLastError(), kernel_name, __FILE__, __LINE__)

namespace course::cuda {

void check_cuda(cudaError_t status, const char* what, const char* file, int line);
void check_cublas(cublasStatus_t status, const char* what, const char* file, int line);

// ---- device and streams -------------------------------------------------------

// Makes GPU `index` this process's device (select_device passes gpu_for_rank's,
// common/comm/env.h). Call before any other function here.
void use_gpu(int index);
int current_gpu();

// Every op runs on the compute stream, in order: a kernel may read what the one
// before it wrote without any synchronisation. (Communication has its own stream;
// comm_nccl.cpp orders it against this one with events.)
cudaStream_t compute_stream();

// The cuBLAS handle, bound to the compute stream.
cublasHandle_t cublas_handle();

// ---- caching allocator ------------------------------------------------------
//
// cudaMalloc and cudaFree synchronise the whole device and cost tens of
// microseconds, too slow for buffers a training step creates and frees (FSDP's
// gathered stages, a GEMM's bf16 copies). Freed blocks are kept in a pool by
// size and handed out again; cudaMalloc is called only when the pool has no block
// of the size asked for. Sizes are rounded up (512 bytes, or 2 MiB above 1 MiB)
// so that blocks are reused across slightly different requests.

// `bytes` of device memory, not initialised. Throws CourseError when the GPU is full.
void* device_allocate(size_t bytes);
// Returns the block to the pool. Work queued on the compute stream that still uses
// it is fine: a block is reused only by later work on the same stream.
void device_free(void* pointer);

// Scratch for one op: `bytes` from the pool, given back when it goes out of scope,
// also when the op throws halfway.
class DeviceScratch {
 public:
  explicit DeviceScratch(size_t bytes) : data_(device_allocate(bytes)) {}
  ~DeviceScratch() { device_free(data_); }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_;
};

struct PoolStats {
  size_t reserved_bytes = 0;       // held from cudaMalloc: in use + cached
  size_t peak_reserved_bytes = 0;
  size_t cuda_malloc_calls = 0;    // how often the pool had to ask the driver
  size_t allocations = 0;          // how often device_allocate was called
};
PoolStats pool_stats();
// Starts a new high-water mark: peak_reserved_bytes becomes what is reserved now (a
// benchmark's next configuration then reports its own peak, not the run's).
void reset_peak_reserved();
// Gives every cached (free) block back to the driver, once the GPU has run the ops
// queued before (they may still use a freed block). Throws CourseError when it has
// not within timeout_seconds.
void empty_cache(double timeout_seconds = 300);

// ---- launch helpers ---------------------------------------------------------

constexpr int kThreadsPerBlock = 256;
// Blocks of `threads` threads to cover n elements, one element per thread.
inline unsigned int blocks_for(int64_t n, int threads = kThreadsPerBlock) {
  return static_cast<unsigned int>((n + threads - 1) / threads);
}

}  // namespace course::cuda
