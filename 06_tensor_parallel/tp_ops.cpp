// tp_ops_for(device): chapter 06's op table, built as the library's (common/tensor/ops_table.cpp).
#include "06_tensor_parallel/tp_ops.h"

#include "common/tensor/error.h"
#include "common/tensor/guarded_device.h"

namespace course {

// The same list, in the same order, for each device: a missing op does not compile.
#define COURSE_TP_OP_TABLE(OP) TPOpTable{OP(bias_residual_forward), OP(vocab_embedding_forward), OP(vocab_embedding_backward), OP(position_embedding_forward), OP(position_embedding_backward), OP(vocab_crossentropy_local_max), OP(vocab_crossentropy_local_sums), OP(vocab_crossentropy_finish), OP(vocab_crossentropy_backward)}
#define COURSE_CPU_OP(name) tp_ops::name
#define COURSE_GUARDED_OP(name) guarded::Op<&tp_ops::name>::run
#define COURSE_CUDA_OP(name) tp_cuda_ops::name

const TPOpTable& tp_ops_for(Device device) {
  static const TPOpTable cpu = COURSE_TP_OP_TABLE(COURSE_CPU_OP);
  static const TPOpTable guarded = COURSE_TP_OP_TABLE(COURSE_GUARDED_OP);
  if (device == Device::CPU) return cpu;
  if (device == Device::Guarded) return guarded;
#ifdef COURSE_HAVE_CUDA
  static const TPOpTable cuda = COURSE_TP_OP_TABLE(COURSE_CUDA_OP);
  return cuda;
#else
  throw CourseError("the CUDA ops are not in this build (configure with the `cuda` preset on a machine with nvcc)");
#endif
}

#undef COURSE_TP_OP_TABLE
#undef COURSE_CPU_OP
#undef COURSE_GUARDED_OP
#undef COURSE_CUDA_OP

}  // namespace course
