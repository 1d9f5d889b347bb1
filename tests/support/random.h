// Random test inputs from the course's counter-based RNG: the same values on every
// machine and in every run, so a failing case can be replayed exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/model/rng.h"

namespace course_test {

// n values shift + scale * N(0, 1), stream `stream` of `seed`
inline std::vector<float> random_floats(uint64_t seed, size_t n, uint64_t stream, double scale, double shift = 0.0) {
  course::CounterRng rng(seed, stream);
  std::vector<float> values(n);
  for (size_t i = 0; i < n; i++) values[i] = static_cast<float>(shift + scale * rng.normal(i));
  return values;
}

// n integers uniform in [0, bound), stream `stream` of `seed`
inline std::vector<int> random_ints(uint64_t seed, size_t n, uint64_t stream, int bound) {
  course::CounterRng rng(seed, stream);
  std::vector<int> values(n);
  for (size_t i = 0; i < n; i++) values[i] = static_cast<int>(rng.below(i, bound));
  return values;
}

}  // namespace course_test
