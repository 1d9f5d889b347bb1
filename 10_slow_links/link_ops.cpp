// link_ops_for(device): chapter 10's op table, built as the library's (common/tensor/ops_table.cpp).
#include "10_slow_links/link_ops.h"

#include "common/tensor/error.h"
#include "common/tensor/guarded_device.h"

namespace course {

// The same list, in the same order, for each device: a missing op does not compile.
#define COURSE_LINK_OP_TABLE(OP) \
  LinkOpTable { OP(encode_int8), OP(decode_int8), OP(difference), OP(divide), OP(outer_step), OP(sgd_update) }
#define COURSE_CPU_OP(name) link_ops::name
#define COURSE_GUARDED_OP(name) guarded::Op<&link_ops::name>::run
#define COURSE_CUDA_OP(name) link_cuda_ops::name

const LinkOpTable& link_ops_for(Device device) {
  static const LinkOpTable cpu = COURSE_LINK_OP_TABLE(COURSE_CPU_OP);
  static const LinkOpTable guarded = COURSE_LINK_OP_TABLE(COURSE_GUARDED_OP);
  if (device == Device::CPU) return cpu;
  if (device == Device::Guarded) return guarded;
#ifdef COURSE_HAVE_CUDA
  static const LinkOpTable cuda = COURSE_LINK_OP_TABLE(COURSE_CUDA_OP);
  return cuda;
#else
  throw CourseError("the CUDA ops are not in this build (configure with the `cuda` preset on a machine with nvcc)");
#endif
}

#undef COURSE_LINK_OP_TABLE
#undef COURSE_CPU_OP
#undef COURSE_GUARDED_OP
#undef COURSE_CUDA_OP

}  // namespace course
