#include "07_3d/parallel_3d.h"

#include <cmath>

#include "common/checkpoint.h"
#include "common/error.h"
#include "common/training.h"

namespace course {

// ----------------------------------------------------------------------------
// pp x tp

namespace {
struct TPSlot : ChunkActivations {
  TPSlot(const GPTConfig& config, const TPGroup& tp, int first_stage, int last_stage, bool split_backward)
      : part(config, tp, first_stage, last_stage, split_backward) {
    tokens = part.tokens.data();
    targets = part.targets.data();
    input = part.input.data();
  }
  TPActivations part;
};
TPActivations& tp_acts(ChunkActivations& acts) { return static_cast<TPSlot&>(acts).part; }
const TPActivations& tp_acts(const ChunkActivations& acts) { return static_cast<const TPSlot&>(acts).part; }
}  // namespace

TPChunk::TPChunk(TPPart& part, TPGroup& tp, TPWorkspace& workspace, const GPTConfig& config, int first_stage,
                 int last_stage, bool split_backward)
    : part_(part), tp_(tp), workspace_(workspace), config_(config), first_stage_(first_stage),
      last_stage_(last_stage), split_backward_(split_backward) {}

std::unique_ptr<ChunkActivations> TPChunk::new_activations() {
  return std::make_unique<TPSlot>(config_, tp_, first_stage_, last_stage_, split_backward_);
}

size_t TPChunk::activation_floats() const {
  return TPActivations::floats(config_, tp_.batch(), tp_.size(), tp_.sequence_parallel(), first_stage_, last_stage_,
                               split_backward_);
}

size_t TPChunk::boundary_floats() const {
  return static_cast<size_t>(tp_.batch()) * tp_.local_seq() * tp_.width();
}

float TPChunk::forward(ChunkActivations& acts) { return part_.forward(tp_acts(acts), workspace_); }

const float* TPChunk::output(const ChunkActivations& acts) const { return part_.output(tp_acts(acts)); }

void TPChunk::backward(ChunkActivations& acts, const float* dout, float* dinput, float dloss) {
  part_.backward(tp_acts(acts), dout, dinput, dloss, workspace_);
}

void TPChunk::backward_input(ChunkActivations& acts, const float* dout, float* dinput, float dloss) {
  part_.backward_input(tp_acts(acts), dout, dinput, dloss, workspace_);
}

void TPChunk::backward_weight(ChunkActivations& acts) { part_.backward_weight(tp_acts(acts), workspace_); }

// ----------------------------------------------------------------------------
// dp

DataParallelOptimizer::DataParallelOptimizer(Comm& dp, std::vector<TPPart*> chunks, int zero_stage,
                                             double bucket_mb, const AdamWConfig& adamw)
    : chunks_(std::move(chunks)) {
  if (zero_stage != 0 && zero_stage != 1) {
    throw FlagError("--zero-stage " + std::to_string(zero_stage) + " is not available here: 0 (DDP buckets) or 1 " +
                    "(ZeRO-1, the optimizer state sharded over the DP group)");
  }
  for (TPPart* part : chunks_) {
    if (zero_stage == 0) {
      ddp_.push_back(std::make_unique<DDP>(dp, part->grads.data(), part->grads.size(), bucket_mb));
      adamw_.push_back(std::make_unique<AdamW>(adamw, part->params.size()));
    } else {
      zero_.push_back(std::make_unique<ZeRO>(dp, part->params.data(), part->grads.data(), part->params.size(), adamw));
    }
  }
}

void DataParallelOptimizer::average_gradients() {
  for (std::unique_ptr<DDP>& ddp : ddp_) ddp->synchronize_gradients();
  for (std::unique_ptr<ZeRO>& zero : zero_) zero->reduce_gradients();
}

void DataParallelOptimizer::step(int step) {
  for (size_t c = 0; c < adamw_.size(); c++) {
    adamw_[c]->update(chunks_[c]->params.data(), chunks_[c]->grads.data(), step);
  }
  for (std::unique_ptr<ZeRO>& zero : zero_) zero->step(step);
}

void DataParallelOptimizer::set_trace(Trace* trace) {
  for (std::unique_ptr<DDP>& ddp : ddp_) ddp->set_trace(trace);
  for (std::unique_ptr<ZeRO>& zero : zero_) zero->set_trace(trace);
}

AdamW& DataParallelOptimizer::optimizer(int chunk) {
  return zero_.empty() ? *adamw_[chunk] : zero_[chunk]->optimizer();
}

// ----------------------------------------------------------------------------
// the global gradient norm

void clip_grid_gradients(Comm& world, GridCoords me, const std::vector<TPPart*>& chunks, float max_norm) {
  double mine = 0.0;  // this rank's counted squares, in double
  if (me.dp == 0) {
    for (const TPPart* part : chunks) {
      const size_t split = part->layout().replicated_offset;
      mine += grad_norm_squared(part->grads.data(), split);
      if (me.tp == 0) mine += grad_norm_squared(part->grads.data() + split, part->grads.size() - split);
    }
  }
  float norm_squared = static_cast<float>(mine);
  world.all_reduce(&norm_squared, 1, ReduceOp::Sum);
  const double norm = std::sqrt(static_cast<double>(norm_squared));
  for (TPPart* part : chunks) clip_grads(part->grads.data(), part->grads.size(), norm, max_norm);
}

// ----------------------------------------------------------------------------
// checkpoints

static std::string section(const char* name, int chunk) { return "chunk" + std::to_string(chunk) + "_" + name; }

void save_grid_checkpoint(const TrainOptions& options, const Comm& world, const ProcessGrid& grid, int step,
                          const std::vector<TPPart*>& chunks, DataParallelOptimizer& optimizer, int zero_stage) {
  CheckpointWriter writer;
  write_rank_meta(writer, options, step, world.size(), world.rank());
  writer.set_meta("dp", grid.dp_size());
  writer.set_meta("pp", grid.pp_size());
  writer.set_meta("tp", grid.tp_size());
  writer.set_meta("chunks", static_cast<int64_t>(chunks.size()));
  writer.set_meta("zero_stage", zero_stage);
  for (int c = 0; c < static_cast<int>(chunks.size()); c++) {
    AdamW& adamw = optimizer.optimizer(c);
    writer.add_section(section("params", c), chunks[c]->params.data(), chunks[c]->params.size());
    writer.add_section(section("adam_m", c), adamw.m.data(), adamw.count());
    writer.add_section(section("adam_v", c), adamw.v.data(), adamw.count());
  }
  writer.write(checkpoint_path(options.checkpoint_dir, step, rank_suffix(world.rank())));
}

int resume_grid_if_asked(const TrainOptions& options, const Comm& world, const ProcessGrid& grid,
                         const std::vector<TPPart*>& chunks, DataParallelOptimizer& optimizer, int zero_stage,
                         bool verbose) {
  // rank 0's file names the step, so every rank resumes the same one
  const auto newest = checkpoint_to_resume(options, /*per_rank=*/true, verbose);
  if (!newest) return 1;
  // rank 0's file says how the job was cut: checked before this rank looks for its
  // own, which another grid may not have written
  const CheckpointReader first(*newest);
  const int step = static_cast<int>(first.meta("step"));
  const std::string written = "--dp " + std::to_string(first.meta("dp")) + " --pp " +
                              std::to_string(first.meta("pp")) + " --tp " + std::to_string(first.meta("tp")) +
                              " (" + std::to_string(first.meta("chunks")) + " chunk(s) per rank, --zero-stage " +
                              std::to_string(first.meta("zero_stage")) + ")";
  const std::string wanted = "--dp " + std::to_string(grid.dp_size()) + " --pp " + std::to_string(grid.pp_size()) +
                             " --tp " + std::to_string(grid.tp_size()) + " (" + std::to_string(chunks.size()) +
                             " chunk(s) per rank, --zero-stage " + std::to_string(zero_stage) + ")";
  if (written != wanted) {
    throw FlagError("checkpoint '" + *newest + "' was written by " + written + " and this run is " + wanted +
                    " (hint: resume with the same layout, or use a fresh --checkpoint-dir)");
  }
  const std::string mine = checkpoint_path(options.checkpoint_dir, step, rank_suffix(world.rank()));
  CheckpointReader reader(mine);  // throws, naming the file, if it is missing or damaged
  check_model_meta(reader, options.model, mine);
  if (reader.meta("seed") != static_cast<int64_t>(options.seed) || reader.meta("global_batch") != options.batch) {
    throw UsageError("checkpoint '" + mine + "' was written with another --seed or --batch (hint: resume with the " +
                     "same flags, or use a fresh --checkpoint-dir)");
  }
  if (step >= options.steps) {
    throw UsageError("checkpoint '" + mine + "' is already at step " + std::to_string(step) + " of --steps " +
                     std::to_string(options.steps) + " (hint: raise --steps to train further)");
  }
  for (int c = 0; c < static_cast<int>(chunks.size()); c++) {
    AdamW& adamw = optimizer.optimizer(c);
    reader.read_section(section("params", c), chunks[c]->params.data(), chunks[c]->params.size());
    reader.read_section(section("adam_m", c), adamw.m.data(), adamw.count());
    reader.read_section(section("adam_v", c), adamw.v.data(), adamw.count());
  }
  if (verbose) print_resumed(*newest, " (and the other ranks' files)", step + 1);
  return step + 1;
}

}  // namespace course
