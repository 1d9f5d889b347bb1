#include "common/model/adamw.h"

#include <cmath>

#include "common/comm/test_faults.h"
#include "common/tensor/ops.h"

namespace course {

AdamW::AdamW(const AdamWConfig& config, size_t count, Device device)
    : m(count, MemCategory::OptimizerState, device), v(count, MemCategory::OptimizerState, device), config_(config) {}

void AdamW::update(float* params, const float* grads, int step) {
  const AdamWConfig& c = config_;
  const float m_correction = 1.0f - std::pow(c.beta1, static_cast<float>(step));
  const float v_correction = 1.0f - std::pow(c.beta2, static_cast<float>(step));
  ops_for(m.device()).adamw_update(params, grads, m.data(), v.data(), static_cast<int64_t>(m.size()), c.lr, c.beta1,
                                   c.beta2, c.eps, c.weight_decay, m_correction, v_correction);
}

double grad_norm_squared(const float* grads, size_t count, Device device) {
  return ops_for(device).sum_squares(grads, static_cast<int64_t>(count));
}

float clip_grads(float* grads, size_t count, double norm, float max_norm, Device device) {
  if (gradient_norm_told_infinite()) norm = INFINITY;
  if (!std::isfinite(norm)) throw NonFiniteGradientNorm(norm);
  if (max_norm <= 0.0f || norm <= max_norm) return 1.0f;
  float scale = static_cast<float>(max_norm / (norm + 1e-6));
  ops_for(device).scale(grads, static_cast<int64_t>(count), scale);
  return scale;
}

}  // namespace course
