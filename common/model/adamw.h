// AdamW (Loshchilov & Hutter) on a contiguous slice of parameters.
//
// The update of element i reads only params[i], grads[i], m[i] and v[i], so the
// same function updates the whole model (chapter 00), or just the shard a rank
// owns (ZeRO, chapter 03): a sharded optimizer is this code on a smaller range.
#pragma once

#include <cstddef>
#include <string>

#include "common/tensor/error.h"
#include "common/tensor/memory.h"

namespace course {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

class AdamW {
 public:
  // Allocates the two moment buffers for `count` parameters (optimizer state) on
  // `device`, where the parameters and gradients it updates must live too.
  AdamW(const AdamWConfig& config, size_t count, Device device = Device::CPU);

  // One update of params[0..count) with grads[0..count); `step` counts from 1.
  // m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
  // p -= lr * (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps) + lr * wd * p
  void update(float* params, const float* grads, int step);

  const AdamWConfig& config() const { return config_; }
  size_t count() const { return m.size(); }

  Buffer m;  // (count)  first moment
  Buffer v;  // (count)  second moment

 private:
  AdamWConfig config_;
};

// Sum of squares of grads[0..count), in double so the norm does not depend on
// how the elements are split into shards (to rounding). grads live on `device`.
double grad_norm_squared(const float* grads, size_t count, Device device = Device::CPU);

// What clip_grads throws when the global gradient norm is not finite (a gradient
// overflowed, or holds a NaN): the update would write it into every weight, and the
// next save into a checkpoint. Every rank computes the same global norm, so every
// rank throws it, before its update; the training loop adds the step and the rank.
class NonFiniteGradientNorm : public Diverged {
 public:
  explicit NonFiniteGradientNorm(double value)
      : Diverged("the global gradient norm is " + std::to_string(value)), norm(value) {}
  double norm;
};

// Scales grads so that a global norm `norm` becomes at most `max_norm`; returns the
// factor applied (1 when no clipping was needed). Every chapter's clipping ends
// here, so this is where a non-finite norm stops the run: NonFiniteGradientNorm.
// With max_norm 0 (--grad-clip 0) nothing is scaled, and the chapters call it all the
// same: without the check, a NaN gradient would reach the weights and the next save.
// (The tests overflow a gradient here: inf_gradient_at_step, common/comm/test_faults.h.)
float clip_grads(float* grads, size_t count, double norm, float max_norm, Device device = Device::CPU);

}  // namespace course
