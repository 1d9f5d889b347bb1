// ep_ops_for(device): chapter 09's op table, built as the library's (common/tensor/ops_table.cpp).
#include "09_expert_parallel/ep_ops.h"

#include "common/tensor/error.h"
#include "common/tensor/guarded_device.h"

namespace course {

// The same list, in the same order, for each device: a missing op does not compile.
#define COURSE_EP_OP_TABLE(OP) EPOpTable{OP(routing_counts), OP(assign_send_rows), OP(aux_loss_backward)}
#define COURSE_CPU_OP(name) ep_ops::name
#define COURSE_GUARDED_OP(name) guarded::Op<&ep_ops::name>::run
#define COURSE_CUDA_OP(name) ep_cuda_ops::name

const EPOpTable& ep_ops_for(Device device) {
  static const EPOpTable cpu = COURSE_EP_OP_TABLE(COURSE_CPU_OP);
  static const EPOpTable guarded = COURSE_EP_OP_TABLE(COURSE_GUARDED_OP);
  if (device == Device::CPU) return cpu;
  if (device == Device::Guarded) return guarded;
#ifdef COURSE_HAVE_CUDA
  static const EPOpTable cuda = COURSE_EP_OP_TABLE(COURSE_CUDA_OP);
  return cuda;
#else
  throw CourseError("the CUDA ops are not in this build (configure with the `cuda` preset on a machine with nvcc)");
#endif
}

#undef COURSE_EP_OP_TABLE
#undef COURSE_CPU_OP
#undef COURSE_GUARDED_OP
#undef COURSE_CUDA_OP

}  // namespace course
