// Tracked memory: every byte the course allocates is tagged with what it is for.
//
// This is how the chapters show what each technique costs and saves: ZeRO shrinks
// the optimizer-state line, pipeline parallelism the parameter line, and so on.
// The tracker keeps current and peak bytes per category and per device.
#pragma once

#include <array>
#include <cstddef>
#include <string>

#include "common/tensor/bf16.h"

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
  // `count` bf16 values: half as many floats, rounded up (the next piece stays 4-byte aligned)
  bf16* take_bf16(size_t count) { return reinterpret_cast<bf16*>(take((count + 1) / 2)); }

 private:
  float* base_;
  size_t used_ = 0;
};

// An owned, tracked allocation of `count` floats (zero-initialised). Move-only.
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
  size_t size() const { return bytes_ / sizeof(float); }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }
  Device device() const { return device_; }
  void zero();

 private:
  template <typename T>
  friend class TypedBuffer;
  struct Bytes {};  // the constructor below counts bytes, not floats
  Buffer(size_t bytes, MemCategory category, Device device, Bytes);
  void release();
  float* data_ = nullptr;
  size_t bytes_ = 0;
  MemCategory category_ = MemCategory::Workspace;
  Device device_ = Device::CPU;
};

// A tracked allocation of `count` values of another type: token ids (int32), bf16
// copies of fp32 values (common/tensor/bf16.h), the CPU GEMM's fp32 copies of rounded
// values (common/tensor/gemm_cpu.cpp). A Buffer's memory,
// tracked the same way, by its true bytes (a bf16 counts 2), seen as T.
template <typename T>
class TypedBuffer {
  static_assert(sizeof(T) <= sizeof(float) && alignof(T) <= alignof(float),
                "a TypedBuffer holds values of up to 4 bytes");

 public:
  TypedBuffer() = default;
  TypedBuffer(size_t count, MemCategory category, Device device = Device::CPU)
      : memory_(count * sizeof(T), category, device, Buffer::Bytes{}) {}

  T* data() { return reinterpret_cast<T*>(memory_.data()); }
  const T* data() const { return reinterpret_cast<const T*>(memory_.data()); }
  size_t size() const { return memory_.bytes() / sizeof(T); }
  size_t bytes() const { return memory_.bytes(); }
  Device device() const { return memory_.device(); }

 private:
  Buffer memory_;
};

}  // namespace course
