#include "common/adamw.h"

#include <cmath>

namespace course {

AdamW::AdamW(const AdamWConfig& config, size_t count)
    : m(count, MemCategory::OptimizerState), v(count, MemCategory::OptimizerState), config_(config) {}

void AdamW::update(float* params, const float* grads, int step) {
  const AdamWConfig& c = config_;
  const float m_correction = 1.0f - std::pow(c.beta1, static_cast<float>(step));
  const float v_correction = 1.0f - std::pow(c.beta2, static_cast<float>(step));
  float* m_data = m.data();
  float* v_data = v.data();
  for (size_t i = 0; i < m.size(); i++) {
    float g = grads[i];
    m_data[i] = c.beta1 * m_data[i] + (1.0f - c.beta1) * g;
    v_data[i] = c.beta2 * v_data[i] + (1.0f - c.beta2) * g * g;
    float m_hat = m_data[i] / m_correction;
    float v_hat = v_data[i] / v_correction;
    params[i] -= c.lr * (m_hat / (std::sqrt(v_hat) + c.eps) + c.weight_decay * params[i]);
  }
}

double grad_norm_squared(const float* grads, size_t count) {
  double sum = 0.0;
  for (size_t i = 0; i < count; i++) sum += static_cast<double>(grads[i]) * grads[i];
  return sum;
}

float clip_grads(float* grads, size_t count, double norm, float max_norm) {
  if (max_norm <= 0.0f || norm <= max_norm) return 1.0f;
  float scale = static_cast<float>(max_norm / (norm + 1e-6));
  for (size_t i = 0; i < count; i++) grads[i] *= scale;
  return scale;
}

}  // namespace course
