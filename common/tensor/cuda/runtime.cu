// The CUDA runtime behind runtime.h: checked calls, this process's GPU, the
// compute stream, the cuBLAS handle and the caching allocator.
#include "common/tensor/cuda/runtime.h"

#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/tensor/device.h"
#include "common/tensor/error.h"

namespace course {

// ---- what device.cpp asks of a CUDA build -----------------------------------

int cuda_probe_device_count(std::string* why) {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (why != nullptr) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(status);
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "the CUDA driver reports 0 devices";
  return count;
}

namespace {
// Whether the GPU reads `host` itself, after cudaMemcpyAsync has returned: pinned
// (cudaMallocHost) or managed memory. Not pageable memory: see cuda_copy_bytes.
bool gpu_reads_host_memory_later(const void* host) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, host) != cudaSuccess) {
    (void)cudaGetLastError();  // a pointer CUDA cannot judge: assume the worst
    return true;
  }
  return attributes.type != cudaMemoryTypeUnregistered;
}
}  // namespace

// Every copy is queued on the compute stream, so it sees every op queued before it
// and every op queued after it sees its result. The host waits only where it must:
//   - device to host: the host reads dst next, so wait for the compute stream.
//   - device to device: the host never touches either buffer: no wait.
//   - host to device: src may be reused once this returns. Pageable memory (a
//     std::vector, a CPU Buffer) the copy engines cannot read: the driver copies src
//     into pinned memory of its own before the call returns ("If pageable memory
//     must first be staged to pinned memory, the driver may synchronize with the
//     stream and stage the copy into pinned memory", the CUDA runtime API's "API
//     synchronization behavior"): the GPU then reads the driver's copy, and no wait
//     is needed. (For a large copy the staging may wait for the stream to reach it.)
//     From pinned memory the GPU reads src itself, later: wait for it.
void cuda_copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  const bool to_host = dst_device != Device::CUDA;
  const bool from_host = src_device != Device::CUDA;
  const cudaMemcpyKind kind = to_host     ? cudaMemcpyDeviceToHost
                              : from_host ? cudaMemcpyHostToDevice
                                          : cudaMemcpyDeviceToDevice;
  cudaStream_t stream = cuda::compute_stream();
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream));
  if (to_host || (from_host && gpu_reads_host_memory_later(src))) CUDA_CHECK(cudaStreamSynchronize(stream));
}

std::string cuda_describe_gpu() {
  int count = 0;
  CUDA_CHECK(cudaGetDeviceCount(&count));
  cudaDeviceProp properties{};
  const int gpu = cuda::current_gpu();
  CUDA_CHECK(cudaGetDeviceProperties(&properties, gpu));
  char memory[32];
  std::snprintf(memory, sizeof(memory), "%.1f GiB", properties.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
  return "GPU " + std::to_string(gpu) + " of " + std::to_string(count) + ", " + properties.name + " (sm_" +
         std::to_string(properties.major) + std::to_string(properties.minor) + ", " + memory + ")";
}

int cuda_gpu_compute_capability() {
  cudaDeviceProp properties{};
  CUDA_CHECK(cudaGetDeviceProperties(&properties, cuda::current_gpu()));
  return properties.major * 10 + properties.minor;
}

void cuda_synchronize() { CUDA_CHECK(cudaStreamSynchronize(cuda::compute_stream())); }

namespace cuda {

// ---- errors --------------------------------------------------------------------

void check_cuda(cudaError_t status, const char* what, const char* file, int line) {
  if (status == cudaSuccess) return;
  std::string hint = status == cudaErrorMemoryAllocation
                         ? "the GPU is out of memory: use a smaller --batch (or --micro-batches), --seq or model"
                         : "run with CUDA_LAUNCH_BLOCKING=1 to find the op that failed, or compute-sanitizer";
  throw CourseError(std::string("CUDA error in ") + what + " (" + file + ":" + std::to_string(line) +
                    "): " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status) + " (hint: " + hint + ")");
}

void check_cublas(cublasStatus_t status, const char* what, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw CourseError(std::string("cuBLAS error in ") + what + " (" + file + ":" + std::to_string(line) +
                    "): " + cublasGetStatusName(status) + ": " + cublasGetStatusString(status) +
                    " (hint: check the GEMM's shapes and leading dimensions)");
}

// ---- device, stream, cuBLAS ----------------------------------------------------

namespace {
struct Context {
  int gpu = -1;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  std::mutex mutex;  // a comm thread may ask for the stream while the main thread makes it
};
Context& context() {
  static Context instance;
  return instance;
}
// Lazily, on the first op: a process that never touches the GPU never creates a context.
Context& ready_context() {
  Context& c = context();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.stream == nullptr) {
    if (c.gpu < 0) c.gpu = 0;
    // the stream and the handle belong to the GPU current on this thread: make it ours
    CUDA_CHECK(cudaSetDevice(c.gpu));
    CUDA_CHECK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&c.cublas));
    CUBLAS_CHECK(cublasSetStream(c.cublas, c.stream));
  }
  return c;
}
}  // namespace

void use_gpu(int index) {
  Context& c = context();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.stream != nullptr && index != c.gpu) {
    throw CourseError("use_gpu(" + std::to_string(index) + "): this process already computes on GPU " +
                      std::to_string(c.gpu) + " (a bug: pick the GPU before the first op)");
  }
  CUDA_CHECK(cudaSetDevice(index));
  c.gpu = index;
}

int current_gpu() { return ready_context().gpu; }
cudaStream_t compute_stream() { return ready_context().stream; }
cublasHandle_t cublas_handle() { return ready_context().cublas; }

// ---- caching allocator -----------------------------------------------------------

namespace {
struct Pool {
  std::mutex mutex;  // the NCCL comm thread may free a staging buffer
  std::multimap<size_t, void*> free_blocks;        // size -> cached block
  std::unordered_map<void*, size_t> block_size;    // every block held, in use or cached
  std::unordered_set<void*> in_use;                // handed out and not yet freed
  PoolStats stats;
};
Pool& pool() {
  static Pool instance;
  return instance;
}
size_t rounded_size(size_t bytes) {
  const size_t small = 512, large = 2u << 20;
  if (bytes <= (1u << 20)) return (bytes + small - 1) / small * small;
  return (bytes + large - 1) / large * large;
}
}  // namespace

void* device_allocate(size_t bytes) {
  ready_context();
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.stats.allocations++;
  const size_t size = rounded_size(bytes == 0 ? 1 : bytes);
  // an exact size match only: a bigger block handed out would count as less than it holds
  auto cached = p.free_blocks.find(size);
  if (cached != p.free_blocks.end()) {
    void* block = cached->second;
    p.free_blocks.erase(cached);
    p.in_use.insert(block);
    return block;
  }
  void* block = nullptr;
  cudaError_t status = cudaMalloc(&block, size);
  if (status == cudaErrorMemoryAllocation && !p.free_blocks.empty()) {
    // the cache may hold the memory we need in blocks of other sizes: give them back and retry
    (void)cudaGetLastError();
    CUDA_CHECK(cudaStreamSynchronize(context().stream));
    for (auto& [cached_size, cached_block] : p.free_blocks) {
      CUDA_CHECK(cudaFree(cached_block));
      p.block_size.erase(cached_block);
      p.stats.reserved_bytes -= cached_size;
    }
    p.free_blocks.clear();
    status = cudaMalloc(&block, size);
  }
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw CourseError("CUDA out of memory allocating " + std::to_string(bytes) + " bytes (" +
                      std::to_string(p.stats.reserved_bytes) + " bytes already held by the course; hint: use a " +
                      "smaller --batch (or more --micro-batches), --seq or model)");
  }
  check_cuda(status, "cudaMalloc", __FILE__, __LINE__);  // any other failure: an earlier kernel's fault
  p.stats.cuda_malloc_calls++;
  p.stats.reserved_bytes += size;
  if (p.stats.reserved_bytes > p.stats.peak_reserved_bytes) p.stats.peak_reserved_bytes = p.stats.reserved_bytes;
  p.block_size[block] = size;
  p.in_use.insert(block);
  return block;
}

void device_free(void* pointer) {
  if (pointer == nullptr) return;
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  auto held = p.block_size.find(pointer);
  if (held == p.block_size.end()) {
    throw CourseError("device_free: this pointer did not come from device_allocate (a bug)");
  }
  // a second free would hand the same block to two later allocations
  if (p.in_use.erase(pointer) == 0) throw CourseError("device_free: this block was already freed (a bug)");
  p.free_blocks.emplace(held->second, pointer);
}

PoolStats pool_stats() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  return p.stats;
}

void reset_peak_reserved() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.stats.peak_reserved_bytes = p.stats.reserved_bytes;
}

namespace {
// Takes every cached block out of the pool: from here on no allocation hands them out.
std::vector<void*> take_cached_blocks() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  std::vector<void*> blocks;
  for (auto& [size, block] : p.free_blocks) {
    blocks.push_back(block);
    p.block_size.erase(block);
    p.stats.reserved_bytes -= size;
  }
  p.free_blocks.clear();
  return blocks;
}

// Returns once the GPU has run every op queued on the compute stream. Polls
// cudaStreamQuery instead of calling cudaStreamSynchronize, which has no deadline.
void wait_for_compute_stream(double timeout_seconds, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  cudaStream_t stream = compute_stream();
  for (;;) {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) check_cuda(status, "cudaStreamQuery", __FILE__, __LINE__);
    if (std::chrono::steady_clock::now() >= deadline) {
      throw CourseError(what + ": the GPU did not finish the ops queued before it within " +
                        std::to_string(static_cast<int>(timeout_seconds)) + " s (hint: a kernel, or a collective " +
                        "the compute stream waits for, is stuck; CUDA_LAUNCH_BLOCKING=1 names the op)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}
}  // namespace

void empty_cache(double timeout_seconds) {
  const std::vector<void*> blocks = take_cached_blocks();
  if (blocks.empty()) return;
  // Ops queued before a block was freed may still use it (device_free allows that; all
  // of them on the compute stream): the driver gets it back once the GPU is past them.
  // The wait is outside the pool's lock, so a comm thread that allocates or frees
  // meanwhile is not held up, and it has a deadline, so a stuck GPU is an error, not a
  // hang. (After a timeout the blocks stay unfreed: the GPU is unusable anyway.)
  // cudaFree itself may wait for the whole device, communication streams included;
  // that wait cannot be bounded, but by then the compute stream is idle.
  wait_for_compute_stream(timeout_seconds, "empty_cache");
  for (void* block : blocks) CUDA_CHECK(cudaFree(block));
}

}  // namespace cuda
}  // namespace course
