// One forward's mean loss on the host, for the tests that compare it: a StepLoss of
// one micro-batch, read at once (a trainer reads its StepLoss once a step instead).
#pragma once

#include <utility>

#include "common/tensor/memory.h"
#include "common/model/step_loss.h"

namespace course_test {

// model.forward(inputs..., loss) on a fresh StepLoss on `device`, then its value
template <typename Model, typename... Inputs>
float forward_loss(Model& model, course::Device device, Inputs&&... inputs) {
  course::StepLoss loss(/*micro_batches=*/1, device);
  model.forward(std::forward<Inputs>(inputs)..., loss);
  return loss.read();
}

}  // namespace course_test
