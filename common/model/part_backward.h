// The backward walk of a model part: the stages [first, last] of the model
// (common/model/model.h's numbering) that one rank holds, in reverse. Chapter 04's
// ModelPart and chapter 06's TPPart (and through them 05 and 07) walk their stages
// with it; what a stage's backward does is theirs, the order and the buffers are
// this.
//
//   head (when the part has it)      dL/d(loss)            -> dL/d(head input)
//   blocks, last to first            dL/d(block output)    -> dL/d(block input)
//   embedding (when the part has it) dL/d(embedding output)
//
// dL/d(residual stream) crosses each stage in a ping-pong pair of buffers: a stage
// reads its output's gradient from one and adds its input's into the other, zeroed
// first. A part without the head starts from dout, received from the next part; a
// part without the embedding has its first block add its input's gradient straight
// into dinput, the buffer that goes back to the previous part (no copy).
#pragma once

#include <cstdint>
#include <functional>

#include "common/tensor/memory.h"

namespace course {

// What the walk calls at each stage; the head and the embedding are null on a part
// that does not have them.
struct PartBackwardStages {
  // dx += dL/d(head input), from the loss
  std::function<void(float* dx)> head;
  // block b of the part's blocks (0 = its first): dx += dL/d(block input), given dout
  int blocks = 0;
  std::function<void(int b, const float* dout, float* dx)> block;
  // the embedding's gradients, given dout = dL/d(embedding output)
  std::function<void(const float* dout)> embedding;
};

// NC: the floats of one residual-stream gradient, B T C (a sequence-parallel rank's
// B T/N C); the buffers are zeroed with the ops of `device`.
void walk_part_backward(const PartBackwardStages& stages,
                        const float* dout,     // (NC)  null when the part has the head
                        float* dinput,         // (NC)  null when the part has the embedding
                        float* residual_grad,  // (2, NC)  the ping-pong pair
                        int64_t NC, Device device);

}  // namespace course
