#include "common/model/step_loss.h"

#include "common/tensor/device.h"
#include "common/tensor/ops.h"

namespace course {

StepLoss::StepLoss(int micro_batches, Device device)
    : micro_batches_(static_cast<float>(micro_batches)), total_(1, MemCategory::Workspace, device) {}

void StepLoss::add(const float* losses, int64_t n) {
  ops_for(total_.device()).add_mean(total_.data(), losses, n, micro_batches_);
}

float StepLoss::read() {
  float total = 0.0f;
  copy_bytes(&total, Device::CPU, total_.data(), total_.device(), sizeof(float));
  total_.zero();
  return total;
}

}  // namespace course
