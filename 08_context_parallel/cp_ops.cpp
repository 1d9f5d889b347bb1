// cp_ops_for(device): chapter 08's op table, built as the library's (common/tensor/ops_table.cpp),
// and the host-side helpers of the block ops.
#include "08_context_parallel/cp_ops.h"

#include <algorithm>

#include "common/tensor/error.h"
#include "common/tensor/guarded_device.h"

namespace course {

BlockMask block_mask(const AttentionBlock& block) {
  const int last_query = block.q_start + block.Tq - 1, last_key = block.k_start + block.Tk - 1;
  if (block.k_start > last_query) return BlockMask::Hidden;
  if (last_key <= block.q_start) return BlockMask::Visible;
  return BlockMask::Causal;
}

size_t attention_block_scratch_floats(const AttentionBlock& block) {
  return 2 * static_cast<size_t>(std::min(block.Tq, kBlockTileRows)) * block.Tk;
}

// The same list, in the same order, for each device: a missing op does not compile.
#define COURSE_CP_OP_TABLE(OP) CPOpTable{OP(attention_blocks_begin), OP(attention_block_forward), OP(attention_row_dots), OP(attention_block_backward), OP(add_strided)}
#define COURSE_CPU_OP(name) cp_ops::name
#define COURSE_GUARDED_OP(name) guarded::Op<&cp_ops::name>::run
#define COURSE_CUDA_OP(name) cp_cuda_ops::name

const CPOpTable& cp_ops_for(Device device) {
  static const CPOpTable cpu = COURSE_CP_OP_TABLE(COURSE_CPU_OP);
  static const CPOpTable guarded = COURSE_CP_OP_TABLE(COURSE_GUARDED_OP);
  if (device == Device::CPU) return cpu;
  if (device == Device::Guarded) return guarded;
#ifdef COURSE_HAVE_CUDA
  static const CPOpTable cuda = COURSE_CP_OP_TABLE(COURSE_CUDA_OP);
  return cuda;
#else
  throw CourseError("the CUDA ops are not in this build (configure with the `cuda` preset on a machine with nvcc)");
#endif
}

#undef COURSE_CP_OP_TABLE
#undef COURSE_CPU_OP
#undef COURSE_GUARDED_OP
#undef COURSE_CUDA_OP

}  // namespace course
