#include "common/model/part_backward.h"

#include "common/tensor/ops.h"

namespace course {

void walk_part_backward(const PartBackwardStages& stages, const float* dout, float* dinput, float* residual_grad,
                        int64_t NC, Device device) {
  const OpTable& op = ops_for(device);
  float* ping_pong[2] = {residual_grad, residual_grad + NC};  // (NC) each
  int next = 0;
  const float* d = dout;  // dL/d(output of the stage being walked back through)
  if (stages.head) {
    op.zero(ping_pong[next], NC);
    stages.head(ping_pong[next]);
    d = ping_pong[next];
    next ^= 1;
  }
  for (int b = stages.blocks - 1; b >= 0; b--) {
    // a part without the embedding writes its first block's dx straight into dinput
    const bool into_input = b == 0 && !stages.embedding;
    float* dx = into_input ? dinput : ping_pong[next];
    if (!into_input) op.zero(dx, NC);
    stages.block(b, d, dx);
    d = dx;
    next ^= 1;
  }
  if (stages.embedding) stages.embedding(d);
}

}  // namespace course
