#include "03_fsdp/gathered_stage.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "common/tensor/clock.h"
#include "common/tensor/ops.h"

namespace course {

ShardedRun sharded_run(const ShardLayout& cut, size_t begin, size_t end, int rank) {
  ShardedRun run;
  run.count = shard_counts_in(cut, begin, end);
  // a rank holding none of the run sends nothing from wherever this points
  if (run.count[rank] != 0) run.shard_offset = std::max(begin, cut.begin[rank]) - cut.begin[rank];
  return run;
}

GatheredStage::GatheredStage(std::vector<ShardedRun> runs, DType gather_dtype, std::string trace_name,
                             JsonLine trace_args, int trace_lane)
    : runs_(std::move(runs)), gather_dtype_(gather_dtype), trace_name_(std::move(trace_name)),
      trace_args_(std::move(trace_args)), trace_lane_(trace_lane) {
  for (const ShardedRun& run : runs_) {
    for (size_t count : run.count) numel_ += count;
  }
}

void GatheredStage::start_gather(Comm& comm, const float* shard, Device device) {
  if (held()) return;
  gathered_ = Buffer(numel_, MemCategory::CommBuffers, device);
  if (gather_dtype_ == DType::BF16) travelling_ = TypedBuffer<bf16>(numel_, MemCategory::CommBuffers, device);
  const int rank = comm.rank();
  size_t run_begin = 0;  // where the run starts in the gathered stage
  for (const ShardedRun& run : runs_) {
    // in: this rank's piece of the run; out: the whole run, rank r's piece after ranks 0 .. r-1's
    const float* piece = shard + run.shard_offset;
    if (gather_dtype_ == DType::BF16) {  // the piece rounded into its place in the copy, gathered in place
      bf16* out = travelling_.data() + run_begin;
      bf16* mine = out + std::accumulate(run.count.begin(), run.count.begin() + rank, size_t{0});
      ops_for(device).cast_to_bf16(mine, piece, static_cast<int64_t>(run.count[rank]));
      gathers_.push_back(comm.all_gather_async(mine, out, run.count));
    } else {
      gathers_.push_back(comm.all_gather_async(piece, gathered_.data() + run_begin, run.count));
    }
    run_begin += std::accumulate(run.count.begin(), run.count.end(), size_t{0});
  }
}

float* GatheredStage::finish_gather(Trace* trace, double* waited) {
  const double wait_start = now_seconds();
  std::vector<OpInterval> ran;
  for (Work& gather : gathers_) ran.push_back(gather.wait());
  if (waited != nullptr) *waited += now_seconds() - wait_start;
  for (const OpInterval& interval : ran) trace_collective(trace, trace_name_, interval, trace_args_, trace_lane_);
  gathers_.clear();
  if (travelling_.size() != 0) {  // bf16: the whole stage widened into fp32, the copy freed
    ops_for(gathered_.device()).cast_to_fp32(gathered_.data(), travelling_.data(), static_cast<int64_t>(numel_));
    travelling_ = TypedBuffer<bf16>();
  }
  return gathered_.data();
}

void GatheredStage::release() {
  for (Work& gather : gathers_) gather.wait();  // one still in flight writes into the buffer
  gathers_.clear();
  gathered_ = Buffer();
  travelling_ = TypedBuffer<bf16>();
}

}  // namespace course
