// A tensor is a view: a pointer, a shape, a dtype and a device. It owns nothing;
// the memory belongs to a tracked Buffer (common/memory.h).
#pragma once

#include <cstdint>
#include <vector>

#include "common/memory.h"

namespace course {

enum class DType { F32, BF16 };

struct Tensor {
  float* data = nullptr;
  std::vector<int64_t> shape;
  DType dtype = DType::F32;
  Device device = Device::CPU;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

}  // namespace course
