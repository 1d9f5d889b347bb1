// The loss a training step reports: the mean over its micro-batches of each one's
// mean per-position loss, added up on the device that computes the losses.
//
// Why on the device: reading a number the GPU computed stops the CPU until the GPU
// has run everything queued before it, and leaves the GPU idle until the CPU queues
// more. Read once per micro-batch, the loss would do that M times a step; here each
// forward only queues an add (ops add_mean), and the step reads the total once.
#pragma once

#include <cstdint>

#include "common/tensor/memory.h"

namespace course {

class StepLoss {
 public:
  StepLoss(int micro_batches, Device device);
  // total += mean(losses) / micro_batches, queued on the device (no wait). losses:
  // one micro-batch's per-position losses, on the same device.
  void add(const float* losses, int64_t n);  // (n)
  // The total on the host (waits for the device to compute it), then 0 again for
  // the next step. The same bits as `loss += mean / micro_batches` added on the host.
  float read();

 private:
  float micro_batches_;
  Buffer total_;  // (1)  on the device
};

}  // namespace course
