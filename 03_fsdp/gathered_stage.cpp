#include "03_fsdp/gathered_stage.h"

#include <algorithm>
#include <utility>

#include "common/tensor/clock.h"

namespace course {

ShardedRun sharded_run(const ShardLayout& cut, size_t begin, size_t end, int rank) {
  ShardedRun run;
  run.count = shard_counts_in(cut, begin, end);
  // a rank holding none of the run sends nothing from wherever this points
  if (run.count[rank] != 0) run.shard_offset = std::max(begin, cut.begin[rank]) - cut.begin[rank];
  return run;
}

GatheredStage::GatheredStage(std::vector<ShardedRun> runs, std::string trace_name, JsonLine trace_args,
                             int trace_lane)
    : runs_(std::move(runs)), trace_name_(std::move(trace_name)), trace_args_(std::move(trace_args)),
      trace_lane_(trace_lane) {
  for (const ShardedRun& run : runs_) {
    for (size_t count : run.count) numel_ += count;
  }
}

void GatheredStage::start_gather(Comm& comm, const float* shard, Device device) {
  if (held()) return;
  gathered_ = Buffer(numel_, MemCategory::CommBuffers, device);
  float* out = gathered_.data();
  for (const ShardedRun& run : runs_) {
    // in: this rank's piece of the run; out: the whole run, rank r's piece after ranks 0 .. r-1's
    gathers_.push_back(comm.all_gather_async(shard + run.shard_offset, out, run.count));
    for (size_t count : run.count) out += count;
  }
}

float* GatheredStage::finish_gather(Trace* trace, double* waited) {
  const double wait_start = now_seconds();
  std::vector<OpInterval> ran;
  for (Work& gather : gathers_) ran.push_back(gather.wait());
  if (waited != nullptr) *waited += now_seconds() - wait_start;
  for (const OpInterval& interval : ran) trace_collective(trace, trace_name_, interval, trace_args_, trace_lane_);
  gathers_.clear();
  return gathered_.data();
}

void GatheredStage::release() {
  for (Work& gather : gathers_) gather.wait();  // one still in flight writes into the buffer
  gathers_.clear();
  gathered_ = Buffer();
}

}  // namespace course
