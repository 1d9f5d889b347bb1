// What the GPU tests (label `cuda`) share: skipping when there is no GPU, and
// moving test data between the host and the device.
//
// Skipping: require_gpu() at the top of a test case ends the process with exit code
// 77 when no CUDA GPU can be used. CTest runs every Catch2 test case as its own
// process and registers 77 as SKIP_RETURN_CODE (tests/CMakeLists.txt), so on a
// machine without a GPU each GPU test is reported "Skipped", never "Passed".
//
// Only CUDA builds compile the tests that include this (COURSE_HAVE_CUDA).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/tensor/device.h"
#include "common/tensor/memory.h"

namespace course_test {

// Exits with 77 ("SKIPPED: no CUDA GPU (<why>)" on stdout) unless a GPU is usable;
// when one is, makes it this process's device, as a trainer's --device cuda does.
inline void require_gpu() {
  std::string why;
  if (course::cuda_device_count(&why) == 0) {
    std::printf("SKIPPED: no CUDA GPU (%s)\n", why.c_str());
    std::fflush(stdout);
    std::exit(77);
  }
  course::select_device("cuda");
}

// A device Buffer holding a copy of `values`.
inline course::Buffer to_device(const std::vector<float>& values,
                                course::MemCategory category = course::MemCategory::Workspace) {
  course::Buffer buffer(values.size(), category, course::Device::CUDA);
  course::copy_bytes(buffer.data(), course::Device::CUDA, values.data(), course::Device::CPU, buffer.bytes());
  return buffer;
}

// Integers (tokens, targets) on the device, stored in a float Buffer's 4-byte slots
// as GPT does with its token buffer; read them through ints_on_device().
inline course::Buffer to_device(const std::vector<int>& values) {
  static_assert(sizeof(int) == sizeof(float), "ints are kept in float-sized slots");
  course::Buffer buffer(values.size(), course::MemCategory::Workspace, course::Device::CUDA);
  course::copy_bytes(buffer.data(), course::Device::CUDA, values.data(), course::Device::CPU, buffer.bytes());
  return buffer;
}
inline const int* ints_on_device(const course::Buffer& buffer) { return reinterpret_cast<const int*>(buffer.data()); }

// A host copy of `count` floats at device pointer `data` (waits for the ops queued before).
inline std::vector<float> to_host(const float* data, size_t count) {
  std::vector<float> values(count);
  course::copy_bytes(values.data(), course::Device::CPU, data, course::Device::CUDA, count * sizeof(float));
  return values;
}
inline std::vector<float> to_host(const course::Buffer& buffer) { return to_host(buffer.data(), buffer.size()); }

// ---- comparing the GPU with the CPU -----------------------------------------------

// max_i |actual_i - expected_i| / max_i |expected_i|: the worst deviation relative to the
// tensor's scale, so elements that happen to be near zero are not held to an impossible
// relative bound (the measure of tests/test_ops.cpp, with the CPU result as `expected`).
inline double error_relative_to_max(const std::vector<float>& actual, const std::vector<float>& expected) {
  if (actual.size() != expected.size()) throw std::invalid_argument("error_relative_to_max: sizes differ");
  double max_difference = 0.0, max_expected = 1e-30;
  for (size_t i = 0; i < actual.size(); i++) {
    max_difference = std::max(max_difference, std::abs(static_cast<double>(actual[i]) - expected[i]));
    max_expected = std::max(max_expected, std::abs(static_cast<double>(expected[i])));
  }
  return max_difference / max_expected;
}

// For an op that updates a tensor in place (a backward's +=, an optimizer step):
// max_i |actual_i - expected_i| / max_i |expected_i - before_i|, the deviation relative to
// what the op added. Measured against the whole value instead, random starting values
// larger than the change would hide an error in the change.
inline double error_relative_to_change(const std::vector<float>& actual, const std::vector<float>& expected,
                                       const std::vector<float>& before) {
  if (actual.size() != expected.size() || before.size() != expected.size()) {
    throw std::invalid_argument("error_relative_to_change: sizes differ");
  }
  double max_difference = 0.0, max_change = 1e-30;
  for (size_t i = 0; i < actual.size(); i++) {
    max_difference = std::max(max_difference, std::abs(static_cast<double>(actual[i]) - expected[i]));
    max_change = std::max(max_change, std::abs(static_cast<double>(expected[i]) - before[i]));
  }
  return max_difference / max_change;
}

// true when a and b hold the same floats bit for bit (NaNs and -0 included)
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Sets the GEMMs' precision for one scope and puts FP32, the default, back at
// its end, even when a failed REQUIRE leaves the scope early.
class MatmulPrecisionScope {
 public:
  explicit MatmulPrecisionScope(course::MatmulPrecision precision) { course::set_matmul_precision(precision); }
  ~MatmulPrecisionScope() { course::set_matmul_precision(course::MatmulPrecision::FP32); }
  MatmulPrecisionScope(const MatmulPrecisionScope&) = delete;
  MatmulPrecisionScope& operator=(const MatmulPrecisionScope&) = delete;
};

}  // namespace course_test
