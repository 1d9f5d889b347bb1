// ops_for(device): the table that lets one model code run on any device.
#include "common/tensor/error.h"
#include "common/tensor/guarded_device.h"
#include "common/tensor/ops.h"
#ifdef COURSE_HAVE_CUDA
#include "common/tensor/cuda/ops_cuda.h"
#endif

namespace course {

// The same list, in the same order, for each device: a missing op does not compile.
#define COURSE_OP_TABLE(OP)                                                                                     \
  OpTable {                                                                                                    \
    OP(embedding_forward), OP(embedding_backward), OP(layernorm_forward), OP(layernorm_backward),              \
        OP(linear_forward), OP(linear_backward), OP(gelu_forward), OP(gelu_backward), OP(layernorm_forward_bf16),  \
        OP(linear_forward_bf16), OP(linear_backward_bf16), OP(gelu_forward_bf16), OP(residual_forward), \
        OP(residual_backward), OP(attention_forward), OP(attention_backward), OP(crossentropy_forward),        \
        OP(crossentropy_backward), OP(zero), OP(mean), OP(add_mean), OP(sum_squares), OP(scale),               \
        OP(copy_strided), OP(cast_to_bf16), OP(cast_to_fp32), OP(adamw_update)                                 \
  }

#define COURSE_CPU_OP(name) ops::name
#define COURSE_GUARDED_OP(name) guarded::Op<&ops::name>::run
#define COURSE_CUDA_OP(name) cuda_ops::name

const OpTable& ops_for(Device device) {
  static const OpTable cpu = COURSE_OP_TABLE(COURSE_CPU_OP);
  static const OpTable guarded = COURSE_OP_TABLE(COURSE_GUARDED_OP);
  if (device == Device::CPU) return cpu;
  if (device == Device::Guarded) return guarded;
#ifdef COURSE_HAVE_CUDA
  static const OpTable cuda = COURSE_OP_TABLE(COURSE_CUDA_OP);
  return cuda;
#else
  throw CourseError("the CUDA ops are not in this build (configure with the `cuda` preset on a machine with nvcc)");
#endif
}

#undef COURSE_OP_TABLE
#undef COURSE_CPU_OP
#undef COURSE_GUARDED_OP
#undef COURSE_CUDA_OP

}  // namespace course
