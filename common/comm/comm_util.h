// Small helpers the communication backends share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common/comm/comm.h"  // ReduceOp
#include "common/tensor/bf16.h"
#include "common/tensor/vector_math.h"

namespace course {

// "5", "0.5", "300": a timeout as the reader typed it, for messages.
inline std::string seconds_text(double seconds) {
  std::ostringstream text;
  text << seconds;
  return text.str();
}

// "MPI_Iallreduce(...)" -> "MPI_Iallreduce": the name of a checked call, for messages.
inline std::string call_name(const char* call) {
  std::string text(call);
  return text.substr(0, text.find('('));
}

// Whether every rank's block has the same size (then the library's plain, faster
// collective applies instead of its uneven "v" form).
inline bool all_equal(const std::vector<size_t>& counts) {
  return std::all_of(counts.begin(), counts.end(), [&](size_t count) { return count == counts[0]; });
}

// Whether [a, a + a_count) and [b, b + b_count) share memory. std::less orders any
// two pointers, where < is only defined within one array.
template <typename T>
bool overlaps(const T* a, size_t a_count, const T* b, size_t b_count) {
  std::less<const T*> before;
  return a_count > 0 && b_count > 0 && before(a, b + b_count) && before(b, a + a_count);
}

// dest[i] = a[i] + b[i] (Sum, Average) or max(a[i], b[i]) (Max). dest may be a or b
// itself. Plain indexed loops: the compiler turns them into SIMD instructions, so
// reducing costs far less than moving the bytes.
inline void combine(ReduceOp op, float* dest, const float* a, const float* b, size_t count) {
  if (op == ReduceOp::Max) {
    for (size_t i = 0; i < count; i++) dest[i] = a[i] > b[i] ? a[i] : b[i];
  } else {
    for (size_t i = 0; i < count; i++) dest[i] = a[i] + b[i];
  }
}
// bf16: each pair added (or compared) in fp32, the result rounded once to bf16. In
// vector clones (vector_math.h): the widening, adding and rounding cost more than the
// fp32 loop's add, and AVX-512 does them 16 values at a time.
COURSE_VECTOR_CLONES inline void combine(ReduceOp op, bf16* dest, const bf16* a, const bf16* b, size_t count) {
  for (size_t i = 0; i < count; i++) {
    const float x = to_float(a[i]), y = to_float(b[i]);
    dest[i] = op == ReduceOp::Max ? (x > y ? a[i] : b[i]) : to_bf16(x + y);
  }
}

// ReduceOp::Average = sum, then this.
inline void divide(float* data, size_t count, int ranks) {
  const float divisor = static_cast<float>(ranks);
  for (size_t i = 0; i < count; i++) data[i] /= divisor;
}
COURSE_VECTOR_CLONES inline void divide(bf16* data, size_t count, int ranks) {
  const float divisor = static_cast<float>(ranks);
  for (size_t i = 0; i < count; i++) data[i] = to_bf16(to_float(data[i]) / divisor);
}

}  // namespace course
