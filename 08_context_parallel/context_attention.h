// What chapter 08's attentions (ring_attention.h, ulysses_attention.h) share beyond
// common/model/model.h's BlockAttention: the figures the chapter reports and the trace.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/train/meters.h"
#include "common/model/model.h"
#include "common/train/trace.h"

namespace course {

// What one rank's attention holds for B sequences, in floats, beyond the block's own
// buffers: what forward saves per block (BlockActivations::att), its communication
// buffers and its workspace. The attentions allocate exactly these; the planner
// (planner/planner.h) counts a cp rank's memory with them, and tests/test_3d.cpp finds
// the runs' peaks equal to its figures.
struct ContextAttentionFloats {
  size_t saved = 0, comm_buffers = 0, workspace = 0;
};

// What one rank sends per layer and micro-batch, by an attention's formula.
struct AttentionBytes {
  uint64_t forward = 0;
  uint64_t backward = 0;
};

class ContextAttention : public BlockAttention {
 public:
  // seconds this rank spent computing attention (forward and backward, every layer,
  // since construction): contiguous vs zigzag shows in these
  virtual double compute_seconds() const = 0;
  // bytes this rank sends per layer and micro-batch of B sequences, forward and
  // backward, by the formula in the attention's header: what the counts must equal
  virtual double bytes_per_layer(int B) const = 0;
  // --trace: each transfer on the communication lane, each block of math on the
  // compute lane. nullptr: none.
  virtual void set_trace(Trace* trace) = 0;

  // seconds this rank waited for a transfer that the compute did not hide, since
  // construction; each wait also goes to `meters` (the step's exposed communication)
  double exposed_comm_seconds() const { return exposed_comm_seconds_; }
  void set_meters(StepMeters* meters) { meters_ = meters; }

 protected:
  void count_exposed(double seconds) {
    exposed_comm_seconds_ += seconds;
    if (meters_) meters_->record_exposed(seconds);
  }
  void reset_exposed() { exposed_comm_seconds_ = 0.0; }

 private:
  StepMeters* meters_ = nullptr;
  double exposed_comm_seconds_ = 0.0;
};

}  // namespace course
