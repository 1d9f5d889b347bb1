#include "07_3d/parallel_3d.h"

#include <cmath>

#include "common/checkpoint.h"
#include "common/checkpoint_manifest.h"
#include "common/sharded_checkpoint.h"
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

size_t DataParallelOptimizer::optimizer_begin(int chunk) const {
  return zero_.empty() ? 0 : zero_[chunk]->shard_begin();
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

// "07_3d at dp 2 x pp 2 x tp 2, 1 chunk(s) per pipeline rank, ZeRO-1": what decides the cut
static std::string grid_cut(const ProcessGrid& grid, int chunks, int zero_stage) {
  return "07_3d at dp " + std::to_string(grid.dp_size()) + " x pp " + std::to_string(grid.pp_size()) + " x tp " +
         std::to_string(grid.tp_size()) + ", " + std::to_string(chunks) + " chunk(s) per pipeline rank, " +
         (zero_stage == 1 ? "ZeRO-1" : "DDP");
}

// What rank `me` saves of its chunk c: the TP slices of the chunk's stages, or with
// ZeRO-1 the shard of them whose moments it keeps (shard_layout, as ZeRO does)
static std::vector<ManifestPiece> saved_pieces(const GPTConfig& config, const Schedule& schedule,
                                               const std::vector<StageRange>& cut, const ProcessGrid& grid,
                                               GridCoords me, int chunk, int zero_stage) {
  const StageRange range = cut[schedule.stage(me.pp, chunk)];
  const TPLayout layout = tp_layout(config, range.first, range.last, grid.tp_size());
  if (zero_stage == 0) return tp_pieces(layout, me.tp, grid.tp_size());
  const ShardLayout shards = shard_layout(layout.numel, grid.dp_size());
  return tp_pieces(layout, me.tp, grid.tp_size(), shards.begin[me.dp], shards.count[me.dp]);
}

// How the grid cuts the model: chunk c of every rank is sections chunk<c>_params, ...
static ShardedCut grid_checkpoint_cut(const GPTConfig& config, const Schedule& schedule,
                                      const std::vector<StageRange>& cut, const ProcessGrid& grid, int zero_stage) {
  const auto shards_of = [=](int rank) {
    std::vector<ManifestShard> shards;
    for (int c = 0; c < schedule.chunks; c++) {
      shards.push_back({"", section("params", c), section("adam_m", c), section("adam_v", c),
                        saved_pieces(config, schedule, cut, grid, grid.coords_of(rank), c, zero_stage)});
    }
    return shards;
  };
  return {grid_cut(grid, schedule.chunks, zero_stage), grid.world_size(), shards_of};
}

void save_grid_checkpoint(const TrainOptions& options, const Comm& world, const Schedule& schedule,
                          const std::vector<StageRange>& cut, const ProcessGrid& grid, int step, const std::vector<TPPart*>& chunks,
                          DataParallelOptimizer& optimizer, int zero_stage) {
  std::vector<ShardValues> mine;
  for (size_t c = 0; c < chunks.size(); c++) {
    const AdamW& adamw = optimizer.optimizer(c);
    mine.push_back({chunks[c]->params.data() + optimizer.optimizer_begin(c), adamw.m.data(), adamw.v.data()});
  }
  save_sharded(options, step, world.rank(), grid_checkpoint_cut(options.model, schedule, cut, grid, zero_stage), mine);
}

int resume_grid_if_asked(const TrainOptions& options, const Schedule& schedule, const std::vector<StageRange>& cut,
                         const ProcessGrid& grid, GridCoords me, const std::vector<TPPart*>& chunks, DataParallelOptimizer& optimizer,
                         int zero_stage, bool verbose) {
  std::vector<ShardTarget> targets;
  for (size_t c = 0; c < chunks.size(); c++) {
    // every rank needs its chunk's whole TP slices, and the moments it keeps, from
    // whichever files hold them (another layout: resharding)
    const StageRange range = cut[schedule.stage(me.pp, static_cast<int>(c))];
    const TPLayout layout = tp_layout(options.model, range.first, range.last, grid.tp_size());
    AdamW& adamw = optimizer.optimizer(c);
    targets.push_back({tp_pieces(layout, me.tp, grid.tp_size()), {chunks[c]->params.data(), nullptr, nullptr}});
    targets.push_back({tp_pieces(layout, me.tp, grid.tp_size(), optimizer.optimizer_begin(c), adamw.count()),
                       {nullptr, adamw.m.data(), adamw.v.data()}});
  }
  return resume_sharded(options, grid_checkpoint_cut(options.model, schedule, cut, grid, zero_stage), targets,
                        verbose);
}

}  // namespace course
