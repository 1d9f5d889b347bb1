// Chapter 10's ops on the CPU (link_ops.h): plain loops over the values.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "10_slow_links/link_ops.h"

namespace course::link_ops {

void encode_int8(uint8_t* message, const float* values, int64_t count) {
  const int64_t blocks = (count + kInt8Block - 1) / kInt8Block;
  int8_t* quantized = reinterpret_cast<int8_t*>(message + 4 * blocks);
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t begin = b * kInt8Block, end = std::min(count, begin + kInt8Block);
    float max_abs = 0.0f;
    for (int64_t i = begin; i < end; i++) max_abs = std::max(max_abs, std::fabs(values[i]));
    // scale = max|x| / 127: the block's largest value is sent exactly as +-127
    const float scale = max_abs / 127.0f;
    std::memcpy(message + 4 * b, &scale, 4);
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t i = begin; i < end; i++) {
      const float q = std::nearbyint(values[i] * inverse);
      quantized[i] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, q)));
    }
  }
}

void decode_int8(float* values, const uint8_t* message, int64_t count) {
  const int64_t blocks = (count + kInt8Block - 1) / kInt8Block;
  const int8_t* quantized = reinterpret_cast<const int8_t*>(message + 4 * blocks);
  for (int64_t b = 0; b < blocks; b++) {
    float scale;
    std::memcpy(&scale, message + 4 * b, 4);
    const int64_t begin = b * kInt8Block, end = std::min(count, begin + kInt8Block);
    for (int64_t i = begin; i < end; i++) values[i] = static_cast<float>(quantized[i]) * scale;
  }
}

void difference(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = a[i] - b[i];
}

void divide(float* x, int64_t n, float divisor) {
  for (int64_t i = 0; i < n; i++) x[i] /= divisor;
}

void outer_step(float* global, float* momentum, float* local, const float* delta, int64_t n, float lr, float mu,
                float keep) {
  for (int64_t i = 0; i < n; i++) {
    momentum[i] = mu * momentum[i] + delta[i];
    global[i] -= lr * (delta[i] + mu * momentum[i]);
    local[i] = keep > 0.0f ? keep * local[i] + (1.0f - keep) * global[i] : global[i];
  }
}

void sgd_update(float* params, const float* grads, int64_t n, float lr) {
  for (int64_t i = 0; i < n; i++) params[i] -= lr * grads[i];
}

}  // namespace course::link_ops
