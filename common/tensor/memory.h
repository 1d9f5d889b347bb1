// Tracked memory: every byte the course allocates is tagged with what it is for.
//
// This is how the chapters show what each technique costs and saves: ZeRO shrinks
// the optimizer-state line, pipeline parallelism the parameter line, and so on.
// The tracker keeps current and peak bytes per category and per device.
#pragma once

#include <array>
#include <cstddef>
#include <string>

namespace course {

// Guarded is the CPU posing as a GPU, for tests: CPU ops on memory host code cannot
// touch (common/tensor/guarded_device.h).
enum class Device { CPU, CUDA, Guarded };
constexpr int kNumDevices = 3;

enum class MemCategory {
  Parameters,      // model weights (fp32 master copy)
  Gradients,       // dL/dweights
  OptimizerState,  // AdamW first and second moments
  Activations,     // values saved by forward for backward
  CommBuffers,     // buckets, gathered shards, send/recv staging
  Workspace,       // scratch reused inside one op or one backward pass
};
constexpr int kNumMemCategories = 6;

const char* category_name(MemCategory category);
const char* device_name(Device device);

struct MemoryTotals {
  std::array<size_t, kNumMemCategories> current{};  // bytes alive now
  std::array<size_t, kNumMemCategories> peak{};     // high-water mark per category
  size_t peak_total = 0;                            // high-water mark of the sum
};

// Process-wide counters for one device. Not thread-safe: the course allocates
// from the main thread only.
MemoryTotals& memory_totals(Device device);
void reset_memory_peaks(Device device);

// An owned, tracked allocation of `count` floats (zero-initialised). Move-only.
// Hands out consecutive pieces of one buffer: an activation struct carves its
// named arrays out of one Buffer, so one allocation (and one tracker entry) holds them.
class Carver {
 public:
  explicit Carver(float* base) : base_(base) {}
  float* take(size_t count) {
    float* piece = base_ + used_;
    used_ += count;
    return piece;
  }

 private:
  float* base_;
  size_t used_ = 0;
};

class Buffer {
 public:
  Buffer() = default;
  Buffer(size_t count, MemCategory category, Device device = Device::CPU);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  float* data() { return data_; }
  const float* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(float); }
  MemCategory category() const { return category_; }
  Device device() const { return device_; }
  void zero();

 private:
  void release();
  float* data_ = nullptr;
  size_t count_ = 0;
  MemCategory category_ = MemCategory::Workspace;
  Device device_ = Device::CPU;
};

// A tracked allocation of `count` values of a 4-byte type that is not a float (token
// ids: int32): a Buffer's memory, tracked the same way, seen as T. The one place the
// course keeps non-float data on a device.
template <typename T>
class TypedBuffer {
  static_assert(sizeof(T) == sizeof(float) && alignof(T) <= alignof(float), "a TypedBuffer holds 4-byte values");

 public:
  TypedBuffer() = default;
  TypedBuffer(size_t count, MemCategory category, Device device = Device::CPU) : floats_(count, category, device) {}

  T* data() { return reinterpret_cast<T*>(floats_.data()); }
  const T* data() const { return reinterpret_cast<const T*>(floats_.data()); }
  size_t size() const { return floats_.size(); }
  Device device() const { return floats_.device(); }

 private:
  Buffer floats_;
};

}  // namespace course
