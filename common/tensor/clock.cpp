#include "common/tensor/clock.h"

#include <chrono>

namespace course {

double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

}  // namespace course
