// Small helpers the communication backends share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

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
inline bool overlaps(const float* a, size_t a_count, const float* b, size_t b_count) {
  std::less<const float*> before;
  return a_count > 0 && b_count > 0 && before(a, b + b_count) && before(b, a + a_count);
}

// ReduceOp::Average = sum, then this.
inline void divide(float* data, size_t count, int ranks) {
  const float divisor = static_cast<float>(ranks);
  for (size_t i = 0; i < count; i++) data[i] /= divisor;
}

}  // namespace course
