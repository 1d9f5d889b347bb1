#include "common/model/tokens.h"

#include <algorithm>

#include "common/tensor/device.h"

namespace course {

MicroBatchTokens::MicroBatchTokens(size_t BT, Device device, bool read_on_device)
    : BT_(BT),
      device_(device),
      host_(2 * BT),
      on_device_(device != Device::CPU && read_on_device ? 2 * BT : 0, MemCategory::Workspace, device) {}

// From pageable memory on purpose: copy_bytes returns once CUDA has staged the bytes in
// pinned memory of its own, so the next micro-batch may refill the host copy while the
// GPU has not yet run this one (nothing waits for the GPU between micro-batches). From
// pinned memory the GPU would read the host copy itself, later: that takes a buffer per
// micro-batch in flight and an event to wait for before refilling one, to save the
// driver's copy of a few KiB.
void MicroBatchTokens::upload() {
  if (on_device_.size() == 0) return;  // the CPU's ops read host_ itself
  copy_bytes(on_device_.data(), device_, host_.data(), Device::CPU, host_.size() * sizeof(int));
}

void MicroBatchTokens::fill(const int* tokens, const int* targets) {
  std::copy(tokens, tokens + BT_, host_.begin());
  std::copy(targets, targets + BT_, host_.begin() + BT_);
}

const int* MicroBatchTokens::device_tokens() const { return device_ == Device::CPU ? host_.data() : on_device_.data(); }

const int* MicroBatchTokens::device_targets() const { return device_tokens() + BT_; }

}  // namespace course
