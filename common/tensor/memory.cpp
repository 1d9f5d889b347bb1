#include "common/tensor/memory.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "common/tensor/error.h"
#include "common/tensor/guarded_device.h"
#ifdef COURSE_HAVE_CUDA
#include "common/tensor/cuda/runtime.h"
#endif

namespace course {

const char* category_name(MemCategory category) {
  switch (category) {
    case MemCategory::Parameters: return "parameters";
    case MemCategory::Gradients: return "gradients";
    case MemCategory::OptimizerState: return "optimizer_state";
    case MemCategory::Activations: return "activations";
    case MemCategory::CommBuffers: return "comm_buffers";
    case MemCategory::Workspace: return "workspace";
  }
  return "unknown";
}

const char* device_name(Device device) {
  switch (device) {
    case Device::CPU: return "cpu";
    case Device::CUDA: return "cuda";
    case Device::Guarded: return "guarded";
  }
  return "unknown";
}

MemoryTotals& memory_totals(Device device) {
  static MemoryTotals totals[kNumDevices];
  return totals[static_cast<int>(device)];
}

void reset_memory_peaks(Device device) {
  MemoryTotals& totals = memory_totals(device);
  totals.peak = totals.current;
  totals.peak_total = 0;
  for (size_t bytes : totals.current) totals.peak_total += bytes;
}

static void track(Device device, MemCategory category, size_t bytes, bool allocate) {
  MemoryTotals& totals = memory_totals(device);
  size_t& current = totals.current[static_cast<int>(category)];
  current = allocate ? current + bytes : current - bytes;
  if (current > totals.peak[static_cast<int>(category)]) {
    totals.peak[static_cast<int>(category)] = current;
  }
  size_t total = 0;
  for (size_t b : totals.current) total += b;
  if (total > totals.peak_total) totals.peak_total = total;
}

Buffer::Buffer(size_t count, MemCategory category, Device device)
    : Buffer(count * sizeof(float), category, device, Bytes{}) {}

Buffer::Buffer(size_t bytes, MemCategory category, Device device, Bytes)
    : bytes_(bytes), category_(category), device_(device) {
  if (bytes == 0) return;
  if (device == Device::CUDA) {
#ifdef COURSE_HAVE_CUDA
    data_ = static_cast<float*>(cuda::device_allocate(bytes));
    zero();
    track(device_, category_, bytes_, true);
    return;
#else
    throw CourseError("a CUDA buffer was asked for in a build without CUDA (hint: use --device cpu)");
#endif
  }
  if (device == Device::Guarded) {
    data_ = static_cast<float*>(guarded::allocate(bytes));  // zeroed
    track(device_, category_, bytes_, true);
    return;
  }
  // 64-byte alignment keeps every row that BLAS sees cache-line aligned.
  const size_t padded = (bytes + 63) / 64 * 64;
  data_ = static_cast<float*>(std::aligned_alloc(64, padded));
  if (data_ == nullptr) {
    throw CourseError("out of host memory allocating " + std::to_string(bytes) + " bytes of " +
                      category_name(category) + " (hint: use a smaller --batch, --seq or model)");
  }
  std::memset(data_, 0, bytes);
  track(device_, category_, bytes_, true);
}

Buffer::~Buffer() { release(); }

void Buffer::release() {
  if (data_ != nullptr) {
    track(device_, category_, bytes_, false);
    if (device_ == Device::Guarded) {
      guarded::release(data_);
    } else if (device_ == Device::CUDA) {
#ifdef COURSE_HAVE_CUDA
      cuda::device_free(data_);
#endif
    } else {
      std::free(data_);
    }
  }
  data_ = nullptr;
  bytes_ = 0;
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_), category_(other.category_), device_(other.device_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    category_ = other.category_;
    device_ = other.device_;
  }
  return *this;
}

void Buffer::zero() {
  if (data_ == nullptr) return;
#ifdef COURSE_HAVE_CUDA
  if (device_ == Device::CUDA) {
    CUDA_CHECK(cudaMemsetAsync(data_, 0, bytes_, cuda::compute_stream()));
    return;
  }
#endif
  if (device_ == Device::Guarded) {
    guarded::Open open;
    std::memset(data_, 0, bytes_);
    return;
  }
  std::memset(data_, 0, bytes_);
}

}  // namespace course
