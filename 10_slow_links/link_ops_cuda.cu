// Chapter 10's ops on the GPU (link_ops.h).
// Reference: the functions of the same names in link_ops_cpu.cpp (same formulas). Compiled,
// never run on a GPU yet (test_cuda holds every one against the CPU's).
//
// Shape: one thread per int8 block for the encoding (a block's max, then its values: the
// scale needs the whole block first), one thread per value for everything else. The int8
// messages are the CPU's bits (a max, one division and one product per value, rounded to
// nearest even by rintf as std::nearbyint does); the outer step and SGD may differ from the
// CPU's in the last bit, where nvcc fuses a product and a sum into one FMA.
#include <cuda_runtime.h>

#include <cstdint>

#include "10_slow_links/link_ops.h"
#include "common/tensor/cuda/launch.h"
#include "common/tensor/cuda/runtime.h"

namespace course::link_cuda_ops {
namespace {

using cuda::item_index;
using cuda::launch_per_item;
using link_ops::kInt8Block;

// scale = max|x| / 127, q = rint(x / scale)      (one thread per block of kInt8Block values)
__global__ void encode_int8_kernel(uint8_t* message, const float* values, int64_t count) {
  const int64_t b = item_index();
  const int64_t blocks = (count + kInt8Block - 1) / kInt8Block;
  if (b >= blocks) return;
  const int64_t begin = b * kInt8Block, end = min(count, begin + kInt8Block);
  float max_abs = 0.0f;
  for (int64_t i = begin; i < end; i++) max_abs = fmaxf(max_abs, fabsf(values[i]));
  const float scale = max_abs / 127.0f;
  reinterpret_cast<float*>(message)[b] = scale;
  const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
  int8_t* quantized = reinterpret_cast<int8_t*>(message + 4 * blocks);
  for (int64_t i = begin; i < end; i++) {
    const float q = rintf(values[i] * inverse);
    quantized[i] = static_cast<int8_t>(fmaxf(-127.0f, fminf(127.0f, q)));
  }
}

// x = q * scale      (one thread per value)
__global__ void decode_int8_kernel(float* values, const uint8_t* message, int64_t count) {
  const int64_t i = item_index();
  if (i >= count) return;
  const int64_t blocks = (count + kInt8Block - 1) / kInt8Block;
  const float scale = reinterpret_cast<const float*>(message)[i / kInt8Block];
  values[i] = static_cast<float>(reinterpret_cast<const int8_t*>(message + 4 * blocks)[i]) * scale;
}

// out = a - b      (one thread per value)
__global__ void difference_kernel(float* out, const float* a, const float* b, int64_t n) {
  const int64_t i = item_index();
  if (i < n) out[i] = a[i] - b[i];
}

// x /= divisor      (one thread per value)
__global__ void divide_kernel(float* x, int64_t n, float divisor) {
  const int64_t i = item_index();
  if (i < n) x[i] /= divisor;
}

// m = mu m + delta;  global -= lr (delta + mu m);  local = keep local + (1 - keep) global
// (one thread per value)
__global__ void outer_step_kernel(float* global, float* momentum, float* local, const float* delta, int64_t n, float lr,
                                  float mu, float keep) {
  const int64_t i = item_index();
  if (i >= n) return;
  momentum[i] = mu * momentum[i] + delta[i];
  global[i] -= lr * (delta[i] + mu * momentum[i]);
  local[i] = keep > 0.0f ? keep * local[i] + (1.0f - keep) * global[i] : global[i];
}

// p -= lr g      (one thread per value)
__global__ void sgd_update_kernel(float* params, const float* grads, int64_t n, float lr) {
  const int64_t i = item_index();
  if (i < n) params[i] -= lr * grads[i];
}

}  // namespace

void encode_int8(uint8_t* message, const float* values, int64_t count) {
  launch_per_item(encode_int8_kernel, "encode_int8", (count + kInt8Block - 1) / kInt8Block, message, values, count);
}

void decode_int8(float* values, const uint8_t* message, int64_t count) {
  launch_per_item(decode_int8_kernel, "decode_int8", count, values, message, count);
}

void difference(float* out, const float* a, const float* b, int64_t n) {
  launch_per_item(difference_kernel, "difference", n, out, a, b, n);
}

void divide(float* x, int64_t n, float divisor) { launch_per_item(divide_kernel, "divide", n, x, n, divisor); }

void outer_step(float* global, float* momentum, float* local, const float* delta, int64_t n, float lr, float mu,
                float keep) {
  launch_per_item(outer_step_kernel, "outer_step", n, global, momentum, local, delta, n, lr, mu, keep);
}

void sgd_update(float* params, const float* grads, int64_t n, float lr) {
  launch_per_item(sgd_update_kernel, "sgd_update", n, params, grads, n, lr);
}

}  // namespace course::link_cuda_ops
