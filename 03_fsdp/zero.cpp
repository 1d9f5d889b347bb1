#include "03_fsdp/zero.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/error.h"
#include "common/training.h"

namespace course {

ShardLayout shard_layout(size_t parameters, int ranks) {
  ShardLayout layout;
  layout.shard_floats = (parameters + ranks - 1) / ranks;
  for (int r = 0; r < ranks; r++) {
    const size_t begin = std::min(r * layout.shard_floats, parameters);
    layout.begin.push_back(begin);
    layout.count.push_back(std::min(layout.shard_floats, parameters - begin));
  }
  return layout;
}

ZeRO::ZeRO(Comm& comm, GPT& model, const AdamWConfig& adamw)
    : ZeRO(comm, model.params.data(), model.grads.data(), model.params.size(), adamw) {}

ZeRO::ZeRO(Comm& comm, float* params, float* grads, size_t count, const AdamWConfig& adamw)
    : comm_(comm),
      params_(params),
      grads_(grads),
      count_(count),
      layout_(shard_layout(count, comm.size())),
      optimizer_(adamw, layout_.count[comm.rank()]) {}

// What happened on the Comm since `before` (a total_stats() reading). Read only
// between blocking calls, when nothing is in flight.
static CommCost cost_since(const Comm& comm, const OpStats& before) {
  const OpStats now = comm.total_stats();
  return {now.bytes_sent - before.bytes_sent, now.seconds - before.seconds};
}

CommCost ZeRO::reduce_gradients() {
  const OpStats before = comm_.total_stats();
  // (P)  this rank's gradients, summed over its micro-batches
  // (started and waited at once: the blocking call, but the Work says when it ran)
  const OpInterval ran = comm_.all_reduce_async(grads_, count_, ReduceOp::Average).wait();
  trace_communication(trace_, "all-reduce gradients", ran.start, ran.end);
  return cost_since(comm_, before);
}

void ZeRO::clip_gradients(float max_norm) {
  const float* shard = grads_ + shard_begin();  // (S)  this rank's averaged gradients
  // each rank's sum of squares is computed in double, then added across ranks
  // in float: the norm differs from chapter 00's by rounding only
  float norm_squared = static_cast<float>(grad_norm_squared(shard, shard_count()));
  comm_.all_reduce(&norm_squared, 1, ReduceOp::Sum);
  clip_grads(grads_ + shard_begin(), shard_count(), std::sqrt(static_cast<double>(norm_squared)),
             max_norm);
}

CommCost ZeRO::step(int step) {
  const double start = now_seconds();
  optimizer_.update(params_ + shard_begin(), grads_ + shard_begin(), step);
  trace_compute(trace_, "optimizer step", start);
  const OpStats before = comm_.total_stats();
  // in place: this rank's block of the output is its freshly updated shard
  const OpInterval ran = comm_.all_gather_async(params_ + shard_begin(), params_, layout_.count).wait();
  trace_communication(trace_, "all-gather parameters", ran.start, ran.end);
  return cost_since(comm_, before);
}

std::string shard_checkpoint_path(const std::string& dir, int step, int rank) {
  return checkpoint_path(dir, step, rank_suffix(rank));
}

void write_shard_meta(CheckpointWriter& writer, const TrainOptions& options, const Comm& comm, int step,
                      int zero_stage) {
  write_rank_meta(writer, options, step, comm.size(), comm.rank());
  writer.set_meta("zero_stage", zero_stage);
}

int shard_checkpoint_to_resume(const Comm& comm, const TrainOptions& options, int zero_stage, bool verbose) {
  const auto newest = checkpoint_to_resume(options, /*per_rank=*/true, verbose);
  if (!newest) return 0;
  const int64_t written_by = CheckpointReader(*newest).meta("world_size");
  if (written_by != comm.size()) {
    throw UsageError("checkpoint '" + *newest + "' was written by " + std::to_string(written_by) +
                     " ranks and this run has " + std::to_string(comm.size()) +
                     ": a sharded checkpoint holds one shard per rank, cut for that world size " +
                     "(hint: resume with the same number of ranks, or use a fresh --checkpoint-dir)");
  }
  const int step = static_cast<int>(CheckpointReader(*newest).meta("step"));
  const std::string mine = shard_checkpoint_path(options.checkpoint_dir, step, comm.rank());
  CheckpointReader reader(mine);  // throws, naming the file, if this rank's shard is missing or damaged
  check_model_meta(reader, options.model, mine);
  if (reader.meta("seed") != static_cast<int64_t>(options.seed) || reader.meta("global_batch") != options.batch) {
    throw UsageError("checkpoint '" + mine + "' was written with --seed " + std::to_string(reader.meta("seed")) +
                     " --batch " + std::to_string(reader.meta("global_batch")) + ", this run has --seed " +
                     std::to_string(options.seed) + " --batch " + std::to_string(options.batch) +
                     " (hint: resume with the same flags, or use a fresh --checkpoint-dir)");
  }
  // Stages 1 and 2 keep the same state (a shard of the flat buffer and its
  // moments), so either resumes the other; stage 3 cuts each model stage apart.
  const int written_stage = static_cast<int>(reader.meta("zero_stage"));
  if ((written_stage == 3) != (zero_stage == 3)) {
    throw UsageError("checkpoint '" + mine + "' was written with --zero-stage " + std::to_string(written_stage) +
                     " and this run has --zero-stage " + std::to_string(zero_stage) +
                     ": stage 3 shards every model stage separately, stages 1 and 2 the flat buffer " +
                     "(hint: resume with the same stage, or use a fresh --checkpoint-dir)");
  }
  if (step >= options.steps) {
    throw UsageError(mine + " is already at step " + std::to_string(step) + " of --steps " +
                     std::to_string(options.steps) + ": nothing to train (hint: raise --steps)");
  }
  if (verbose) print_resumed(*newest, " (and the other ranks' shards)", step + 1);
  return step;
}

void ZeRO::save(const TrainOptions& options, int step) const {
  CheckpointWriter writer;
  write_shard_meta(writer, options, comm_, step, 1);
  writer.add_section("params", params_ + shard_begin(), shard_count());
  writer.add_section("adam_m", optimizer_.m.data(), shard_count());
  writer.add_section("adam_v", optimizer_.v.data(), shard_count());
  writer.write(shard_checkpoint_path(options.checkpoint_dir, step, comm_.rank()));
}

int ZeRO::resume_if_asked(const TrainOptions& options, bool verbose) {
  const int step = shard_checkpoint_to_resume(comm_, options, 1, verbose);
  if (step == 0) return 1;
  CheckpointReader reader(shard_checkpoint_path(options.checkpoint_dir, step, comm_.rank()));
  reader.read_section("params", params_ + shard_begin(), shard_count());
  reader.read_section("adam_m", optimizer_.m.data(), shard_count());
  reader.read_section("adam_v", optimizer_.v.data(), shard_count());
  comm_.all_gather(params_ + shard_begin(), params_, layout_.count);  // every rank: the whole model again
  return step + 1;
}

}  // namespace course
