// ops_for(device): the table that lets one model code run on either device.
#include "common/error.h"
#include "common/ops.h"
#ifdef COURSE_HAVE_CUDA
#include "common/cuda/ops_cuda.h"
#endif

namespace course {

// The same list, in the same order, for each device: a missing op does not compile.
#define COURSE_OP_TABLE(NS)                                                                              \
  OpTable {                                                                                             \
    NS::embedding_forward, NS::embedding_backward, NS::layernorm_forward, NS::layernorm_backward,       \
        NS::linear_forward, NS::linear_backward, NS::gelu_forward, NS::gelu_backward,                   \
        NS::residual_forward, NS::residual_backward, NS::attention_forward, NS::attention_backward,     \
        NS::crossentropy_forward, NS::crossentropy_backward, NS::zero, NS::mean, NS::sum_squares,       \
        NS::scale, NS::copy_strided, NS::adamw_update                                                   \
  }

const OpTable& ops_for(Device device) {
  static const OpTable cpu = COURSE_OP_TABLE(ops);
  if (device == Device::CPU) return cpu;
#ifdef COURSE_HAVE_CUDA
  static const OpTable cuda = COURSE_OP_TABLE(cuda_ops);
  return cuda;
#else
  throw CourseError("the CUDA ops are not in this build (configure with the `cuda` preset on a machine with nvcc)");
#endif
}

#undef COURSE_OP_TABLE

}  // namespace course
