// One micro-batch's tokens and targets, (B, T) each: the sampler fills them on the host,
// the embedding reads the tokens and the loss the targets, on the run's device.
//
// On the CPU the ops read the host copy itself. On any other device upload() copies
// both, once per micro-batch, into one (2, B, T) int32 buffer there (Workspace memory),
// which stays until the next micro-batch's upload, so backward reads it too. Chapter
// 00's GPT, chapter 03's sharded model, chapter 04's model part (and 05's, one per
// micro-batch in flight) and chapter 06's tensor-parallel part (and 07's) each keep one.
#pragma once

#include <cstddef>
#include <vector>

#include "common/tensor/memory.h"

namespace course {

class MicroBatchTokens {
 public:
  // BT: the micro-batch's B x T. With `read_on_device` false (a pipeline part that has neither
  // the embedding nor the head: chapter 04's and 06's parts) no device buffer is kept:
  // nothing there reads tokens, and upload() copies nothing.
  MicroBatchTokens(size_t BT, Device device, bool read_on_device = true);

  int* tokens() { return host_.data(); }        // (B, T)  on the host, for the sampler
  int* targets() { return host_.data() + BT_; }  // (B, T)  on the host, for the sampler
  // Copies the caller's tokens and targets, (B, T) each, into the host copy.
  void fill(const int* tokens, const int* targets);
  // Copies the host copy to where the ops read it (forward does, once per micro-batch).
  void upload();

  const int* device_tokens() const;   // (B, T)  where the ops read them
  const int* device_targets() const;  // (B, T)

 private:
  size_t BT_;
  Device device_;
  std::vector<int> host_;     // (2, B, T)  tokens, then targets
  TypedBuffer<int> on_device_;  // (2, B, T)  the same on a device other than the CPU (empty on the CPU)
};

}  // namespace course
