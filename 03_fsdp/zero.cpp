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

std::vector<ManifestPiece> zero_pieces(const GPTConfig& config, int ranks, int rank, int zero_stage) {
  const std::vector<ManifestParam> params = manifest_params(config);
  if (zero_stage < 3) {
    const ShardLayout flat = shard_layout(count_parameters(config), ranks);
    return pieces_of_flat_range(params, flat.begin[rank], flat.count[rank]);
  }
  std::vector<ManifestPiece> pieces;
  size_t stage_offset = 0;  // where the stage starts in chapter 00's flat buffer
  for (const StageLayout& stage : model_layout(config)) {
    const ShardLayout cut = shard_layout(stage.numel, ranks);
    const std::vector<ManifestPiece> mine = pieces_of_flat_range(params, stage_offset + cut.begin[rank], cut.count[rank]);
    pieces.insert(pieces.end(), mine.begin(), mine.end());
    stage_offset += stage.numel;
  }
  return pieces;
}

// How `ranks` ranks at `zero_stage` cut the model, as the manifest says it: stages 1
// and 2 cut alike, so either resumes the other as a plain load.
static std::string zero_layout(int ranks, int zero_stage) {
  const std::string n = std::to_string(ranks);
  return zero_stage == 3 ? "03_fsdp ZeRO-3 at " + n + " ranks: every model stage cut in " + n + " contiguous shards"
                         : "03_fsdp ZeRO-1/2 at " + n + " ranks: chapter 00's flat buffer cut in " + n +
                               " contiguous shards";
}

// The manifest of a step saved by `ranks` ranks at `zero_stage`: every rank's pieces.
static CheckpointManifest zero_manifest(const TrainOptions& options, int ranks, int step, int zero_stage) {
  CheckpointManifest manifest = start_manifest(options, step, ranks, zero_layout(ranks, zero_stage));
  for (int rank = 0; rank < ranks; rank++) {
    manifest.shards.push_back(
        {rank_file_name(step, rank), "params", "adam_m", "adam_v", zero_pieces(options.model, ranks, rank, zero_stage)});
  }
  return manifest;
}

void save_zero_shard(const TrainOptions& options, const Comm& comm, int step, int zero_stage, const float* params,
                     const AdamW& optimizer) {
  const std::string& dir = options.checkpoint_dir;
  // before rank 0's own file: a step whose every file exists always has its manifest
  if (comm.rank() == 0) save_manifest(dir, zero_manifest(options, comm.size(), step, zero_stage));
  CheckpointWriter writer;
  write_rank_meta(writer, options, step, comm.size(), comm.rank());
  writer.set_meta("zero_stage", zero_stage);
  writer.add_section("params", params, optimizer.count());
  writer.add_section("adam_m", optimizer.m.data(), optimizer.count());
  writer.add_section("adam_v", optimizer.v.data(), optimizer.count());
  writer.write(shard_checkpoint_path(dir, step, comm.rank()));
}

int resume_zero_shard(const Comm& comm, const TrainOptions& options, int zero_stage, bool verbose, float* params,
                      AdamW& optimizer) {
  std::string newest;
  const auto manifest = manifest_to_resume(options, zero_layout(comm.size(), zero_stage), verbose, &newest);
  if (!manifest) return 0;
  load_pieces(*manifest, options.checkpoint_dir, zero_pieces(options.model, comm.size(), comm.rank(), zero_stage),
              params, optimizer.m.data(), optimizer.v.data());
  const int step = static_cast<int>(manifest->get("step"));
  if (verbose) print_resumed(newest, " (and the other ranks' shards)", step + 1);
  return step;
}

void ZeRO::save(const TrainOptions& options, int step) const {
  save_zero_shard(options, comm_, step, 1, params_ + shard_begin(), optimizer_);
}

int ZeRO::resume_if_asked(const TrainOptions& options, bool verbose) {
  const int step = resume_zero_shard(comm_, options, 1, verbose, params_ + shard_begin(), optimizer_);
  if (step == 0) return 1;
  comm_.all_gather(params_ + shard_begin(), params_, layout_.count);  // every rank: the whole model again
  return step + 1;
}

}  // namespace course
