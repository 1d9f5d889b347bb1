// moe_ops_for(device): the mixture of experts' op table, built as the library's
// (common/tensor/ops_table.cpp).
#include "common/model/moe_ops.h"

#include "common/tensor/error.h"
#include "common/tensor/guarded_device.h"

namespace course {

// The same list, in the same order, for each device: a missing op does not compile.
#define COURSE_MOE_OP_TABLE(OP) MoeOpTable{OP(router_softmax), OP(router_softmax_backward), OP(route_top_k), OP(route_top_k_backward), OP(assign_rows), OP(dispatch_forward), OP(dispatch_backward), OP(combine_forward), OP(combine_backward), OP(aux_loss_forward), OP(aux_loss_backward)}
#define COURSE_CPU_OP(name) moe_ops::name
#define COURSE_GUARDED_OP(name) guarded::Op<&moe_ops::name>::run
#define COURSE_CUDA_OP(name) moe_cuda_ops::name

const MoeOpTable& moe_ops_for(Device device) {
  static const MoeOpTable cpu = COURSE_MOE_OP_TABLE(COURSE_CPU_OP);
  static const MoeOpTable guarded = COURSE_MOE_OP_TABLE(COURSE_GUARDED_OP);
  if (device == Device::CPU) return cpu;
  if (device == Device::Guarded) return guarded;
#ifdef COURSE_HAVE_CUDA
  static const MoeOpTable cuda = COURSE_MOE_OP_TABLE(COURSE_CUDA_OP);
  return cuda;
#else
  throw CourseError("the CUDA ops are not in this build (configure with the `cuda` preset on a machine with nvcc)");
#endif
}

#undef COURSE_MOE_OP_TABLE
#undef COURSE_CPU_OP
#undef COURSE_GUARDED_OP
#undef COURSE_CUDA_OP

}  // namespace course
