#include "07_3d/parallel_3d.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/train/checkpoint.h"
#include "common/train/checkpoint_manifest.h"
#include "common/tensor/error.h"
#include "common/train/sharded_checkpoint.h"
#include "common/train/trainer_parts.h"

namespace course {

// ----------------------------------------------------------------------------
// where a rank sits

void add_grid_flags(ArgParser& parser, GridFlags& flags) {
  parser.add_int("--dp", &flags.dp, 0, "data-parallel replicas; 0 = world size / (pp x tp)");
  parser.add_int("--pp", &flags.pp, 0, "pipeline stages (ranks along a pipeline); 0 = inferred");
  parser.add_int("--tp", &flags.tp, 0, "tensor-parallel ranks splitting every matrix; 0 = inferred");
  parser.add_choice("--grid-order", &flags.order, grid_order_names(), "the axes in the rank formula, outermost first");
  parser.add_switch("--sp", &flags.sequence_parallel, "sequence parallelism inside each TP group");
  parser.add_int("--zero-stage", &flags.zero_stage, 0,
                 "0: DDP gradient buckets over dp; 1: ZeRO-1 optimizer shards; 2: and gradient shards; 3: FSDP");
  parser.add_switch("--reshard-after-forward", &flags.reshard_after_forward,
                    "ZeRO-3: gather each stage's parameters around every forward and backward, not once a step");
  parser.add_float("--bucket-mb", &flags.bucket_mb, 0.0f, true, "DDP gradient bucket size in MB (10^6 bytes)");
  parser.add_dtype("--grad-comm-dtype", &flags.grad_comm_dtype,
                   "what the dp axis's gradient reductions send: bf16 sends half the bytes (added in fp32)");
  add_schedule_flags(parser, flags);
}

// the grid on the run's ranks, its TP degree checked against the model
static ProcessGrid checked_grid(const Run& run, const GridFlags& flags) {
  const ProcessGrid grid = make_process_grid(run.ranks, flags.dp, flags.pp, flags.tp, parse_grid_order(flags.order));
  check_tp_shape(run.options.model, grid.tp_size(), flags.sequence_parallel);
  check_zero_stage(flags.zero_stage, flags.reshard_after_forward);
  return grid;
}

GridPlace::GridPlace(Run& run, const GridFlags& grid_flags)
    : flags(grid_flags),
      grid(checked_grid(run, flags)),
      rank(run.rank),
      me(grid.coords_of(rank)),
      schedule(flags.make(grid.pp_size(), run.options)),
      groups(split_grid(*run.world, grid)),
      cut(split_stages(run.options.model, schedule.stages())),
      labels(grid.world_size()) {
  const GPTConfig& config = run.options.model;
  for (int r = 0; r < grid.world_size(); r++) {
    const GridCoords c = grid.coords_of(r);
    labels[r] = "(" + std::to_string(c.dp) + "," + std::to_string(c.pp) + "," + std::to_string(c.tp) + ")";
    for (int v = 0; v < schedule.chunks; v++) {
      labels[r] += (v ? "; " : " ") + describe_stages(config, cut[schedule.stage(c.pp, v)]);
    }
  }
}

float GridPlace::report_loss(Comm& world, float loss) const {
  const bool tells = me.pp == schedule.rank_of_stage(schedule.stages() - 1) && me.tp == 0;
  float mean = tells ? loss / grid.dp_size() : 0.0f;
  world.all_reduce(&mean, 1, ReduceOp::Sum);
  return mean;
}

JsonLine GridPlace::summary_fields() const {
  return JsonLine()
      .add("dp", grid.dp_size())
      .add("pp", grid.pp_size())
      .add("tp", grid.tp_size())
      .add("sequence_parallel", flags.sequence_parallel ? 1 : 0)
      .add("zero_stage", flags.zero_stage);
}

// "0,1 | 2,3": the groups of one axis, for the grid summary
static std::string axis_groups(const ProcessGrid& grid, char axis) {
  std::string text;
  for (int rank = 0; rank < grid.world_size(); rank++) {
    const GridCoords c = grid.coords_of(rank);
    // a group is listed once, from its member whose coordinate on this axis is 0
    if ((axis == 't' ? c.tp : axis == 'p' ? c.pp : c.dp) != 0) continue;
    const int members = axis == 't' ? grid.tp_size() : axis == 'p' ? grid.pp_size() : grid.dp_size();
    text += text.empty() ? "" : " | ";
    for (int i = 0; i < members; i++) {
      GridCoords member = c;
      (axis == 't' ? member.tp : axis == 'p' ? member.pp : member.dp) = i;
      text += (i ? "," : "") + std::to_string(grid.rank_of(member));
    }
  }
  return text;
}

// what runs over dp, for the grid summary
static std::string zero_description(const GridFlags& flags) {
  if (flags.zero_stage == 0) return "DDP buckets over dp";
  return "ZeRO-" + std::to_string(flags.zero_stage) + " over dp" +
         (flags.reshard_after_forward ? ", resharded after forward" : "");
}

void GridPlace::print(const std::string& backend, int micro_batch) const {
  std::printf("grid: dp %d x pp %d x tp %d, %s, backend %s\n", grid.dp_size(), grid.pp_size(), grid.tp_size(),
              grid.formula().c_str(), backend.c_str());
  std::printf("  schedule %s, %d chunk(s) per pipeline rank, %d micro-batches of %d sequence(s), %s%s\n",
              schedule_name(schedule.kind), schedule.chunks, schedule.micro_batches, micro_batch,
              zero_description(flags).c_str(),
              flags.sequence_parallel ? ", sequence parallel" : "");
  std::printf("  tp groups: %s\n  pipelines: %s\n  dp groups: %s\n  (the tables below: each rank's (dp,pp,tp))\n",
              axis_groups(grid, 't').c_str(), axis_groups(grid, 'p').c_str(), axis_groups(grid, 'd').c_str());
}

// ----------------------------------------------------------------------------
// pp x tp

namespace {
struct TPSlot : ChunkActivations {
  TPSlot(const GPTConfig& config, const TPGroup& tp, int first_stage, int last_stage, bool split_backward,
         Recompute recompute)
      : part(config, tp, first_stage, last_stage, split_backward, recompute) {
    tokens = part.batch.tokens();
    targets = part.batch.targets();
    input = part.input.data();
  }
  TPActivations part;
};
TPActivations& tp_acts(ChunkActivations& acts) { return static_cast<TPSlot&>(acts).part; }
const TPActivations& tp_acts(const ChunkActivations& acts) { return static_cast<const TPSlot&>(acts).part; }
}  // namespace

TPChunk::TPChunk(TPPart& part, TPGroup& tp, TPWorkspace& workspace, const GPTConfig& config, int first_stage,
                 int last_stage, bool split_backward, Recompute recompute)
    : part_(part), tp_(tp), workspace_(workspace), config_(config), first_stage_(first_stage),
      last_stage_(last_stage), split_backward_(split_backward), recompute_(recompute) {}

std::unique_ptr<ChunkActivations> TPChunk::new_activations() {
  return std::make_unique<TPSlot>(config_, tp_, first_stage_, last_stage_, split_backward_, recompute_);
}

size_t TPChunk::activation_floats() const {
  return TPActivations::floats(config_, tp_.batch(), tp_.size(), tp_.sequence_parallel(), first_stage_, last_stage_,
                               split_backward_, recompute_);
}

size_t TPChunk::shared_activation_floats() const {
  return TPRecomputed::floats(config_, tp_.batch(), tp_.size(), tp_.sequence_parallel(), recompute_);
}

size_t TPChunk::boundary_floats() const {
  return static_cast<size_t>(tp_.batch()) * tp_.local_seq() * tp_.width();
}

void TPChunk::forward(ChunkActivations& acts, StepLoss& loss) { part_.forward(tp_acts(acts), workspace_, loss); }

const float* TPChunk::output(const ChunkActivations& acts) const { return part_.output(tp_acts(acts)); }

void TPChunk::backward(ChunkActivations& acts, const float* dout, float* dinput, float dloss) {
  part_.backward(tp_acts(acts), dout, dinput, dloss, workspace_);
}

void TPChunk::backward_input(ChunkActivations& acts, const float* dout, float* dinput, float dloss) {
  part_.backward_input(tp_acts(acts), dout, dinput, dloss, workspace_);
}

void TPChunk::backward_weight(ChunkActivations& acts) { part_.backward_weight(tp_acts(acts), workspace_); }

GridChunks::GridChunks(const TrainOptions& options, const GridPlace& place, int micro_batch, Device device,
                       Trace& trace, StepMeters& meters)
    : tp_group_(*place.groups.tp, place.flags.sequence_parallel, micro_batch, options.model.seq_len,
                options.model.d_model, device, message_dtype(options)),
      workspace_(options.model, tp_group_, options.model.recompute) {
  tp_group_.set_trace(&trace);  // f, g and the loss's all-reduces inside every micro-batch
  tp_group_.set_meters(&meters, "tp");  // and the time the training thread waited for them
  const bool split_backward = place.schedule.kind == ScheduleKind::ZeroBubbleH1;
  const Recompute recompute = options.model.recompute;
  check_recompute_schedule(place.schedule.kind, recompute);
  const GridFlags& flags = place.flags;
  for (int c = 0; c < place.schedule.chunks; c++) {
    const StageRange stages = place.chunk_stages(c);
    ChunkParams* source = nullptr;  // ZeRO-2/3: the part's parameters are kept over dp
    if (flags.zero_stage >= 2) {
      owned_params_.push_back(std::make_unique<ChunkParams>(*place.groups.dp, tp_group_, options.model, stages.first,
                                                            stages.last, flags.zero_stage,
                                                            flags.reshard_after_forward, options.seed,
                                                            message_dtype(options)));
      source = owned_params_.back().get();
      params.push_back(source);
    }
    owned_parts_.push_back(
        std::make_unique<TPPart>(options.model, tp_group_, stages.first, stages.last, options.seed, source));
    owned_chunks_.push_back(std::make_unique<TPChunk>(*owned_parts_.back(), tp_group_, workspace_, options.model,
                                                      stages.first, stages.last, split_backward, recompute));
    parts.push_back(owned_parts_.back().get());
    pipeline_chunks.push_back(owned_chunks_.back().get());
  }
}

void GridChunks::zero_grad() {
  for (TPPart* part : parts) part->grads.zero();
}

void GridChunks::finish_gradients(int chunk) { parts[chunk]->finish_gradients(); }

// ----------------------------------------------------------------------------
// dp

DataParallelOptimizer::DataParallelOptimizer(Comm& dp, GridChunks& chunks, const GridFlags& flags,
                                             const TrainOptions& options)
    : parts_(chunks.parts), zero_stage_(flags.zero_stage) {
  for (size_t c = 0; c < parts_.size(); c++) {
    ChunkParams* params = chunks.params.empty() ? nullptr : chunks.params[c];
    chunks_.push_back(
        make_chunk_data_parallel(dp, *parts_[c], params, zero_stage_, adamw_config(options), flags.bucket_mb,
                                 flags.grad_comm_dtype, message_dtype(options)));
  }
}

void DataParallelOptimizer::attach(PipelineExecutor& executor, GridChunks& chunks, Trace* trace) {
  for (std::unique_ptr<ChunkDataParallel>& chunk : chunks_) chunk->set_trace(trace);
  executor.before_compute([this](const Action& a) {
    chunks_[a.chunk]->before_compute(a.type);
    note_lent();
  });
  executor.on_gradients_done([this, &chunks](int chunk) {  // the chunk's last backward of the step has run:
    chunks.finish_gradients(chunk);     // tp: its SP partial sums (nothing without --sp), then
    chunks_[chunk]->start_reduction();  // dp: its reduction, under the backwards still to run
    note_lent();                        // (with bf16 gradients it lends their copy)
  });
  for (ChunkParams* params : chunks.params) params->on_gathered([this] { note_lent(); });  // ZeRO-3's peak
}

void DataParallelOptimizer::note_lent() {
  size_t lent = 0;
  for (const std::unique_ptr<ChunkDataParallel>& chunk : chunks_) lent += chunk->lent_floats();
  peak_lent_ = std::max(peak_lent_, lent);
}

double DataParallelOptimizer::average_gradients() {
  double waited = 0.0;
  for (std::unique_ptr<ChunkDataParallel>& chunk : chunks_) waited += chunk->wait_reduction();
  return waited;
}

void DataParallelOptimizer::clip_gradients(Comm& world, GridCoords me, float max_norm) {
  std::vector<FlatRange> owned;
  std::vector<float*> grads;
  for (std::unique_ptr<ChunkDataParallel>& chunk : chunks_) {
    owned.push_back(chunk->owned_range());
    grads.push_back(chunk->owned_grads());
  }
  clip_grid_gradients(world, me, parts_, owned, grads, zero_stage_ > 0, max_norm);
}

void DataParallelOptimizer::step(int step) {
  for (std::unique_ptr<ChunkDataParallel>& chunk : chunks_) chunk->step(step);
}

std::vector<RankColumn> DataParallelOptimizer::memory_columns(std::vector<RankColumn> columns) const {
  if (zero_stage_ >= 2) {
    columns.push_back(
        {"lent_chunk_buffers", "lent", static_cast<double>(peak_lent_) * sizeof(float), ColumnUnit::Bytes});
  }
  return columns;
}

void DataParallelOptimizer::check_copies_agree(const GridPlace& place) {
  const std::string where = " (" + place.grid.describe(place.rank) + ")";
  for (size_t c = 0; c < chunks_.size(); c++) {
    ChunkDataParallel& chunk = *chunks_[c];
    const TPPart& part = *parts_[c];
    const Device device = part.group().device();
    const size_t P = part.layout().numel, replicated = part.layout().replicated_offset;
    if (chunk.replica() != nullptr) {
      course::check_copies_agree(*place.groups.dp, chunk.replica(), P, device, "the DP replicas' chunks" + where);
      course::check_copies_agree(*place.groups.tp, chunk.replica() + replicated, P - replicated, device,
                                 "the TP group's replicated parameters" + where);
      continue;
    }
    // ZeRO-3: nothing is replicated over dp. The TP group's slices are the same size,
    // so its ranks hold the same range of them: their shards' replicated parts agree
    const FlatRange mine = chunk.owned_range();
    const size_t first = std::max(mine.begin, replicated);
    if (first >= mine.end) continue;  // the same on every rank of the group
    course::check_copies_agree(*place.groups.tp, chunk.owned_params() + (first - mine.begin), mine.end - first,
                               device, "the TP group's replicated parameters" + where);
  }
}

// ----------------------------------------------------------------------------
// the global gradient norm

void clip_grid_gradients(Comm& world, GridCoords me, const std::vector<TPPart*>& chunks,
                         const std::vector<FlatRange>& updated, const std::vector<float*>& grads, bool sharded,
                         float max_norm) {
  double mine = 0.0;  // this rank's counted squares, in double
  if (sharded || me.dp == 0) {
    for (size_t c = 0; c < chunks.size(); c++) {
      const FlatRange r = updated[c];
      // (r.end - r.begin)  the chunk's TP slices' gradients in r: split range, replicated range
      const float* g = grads[c];
      const size_t split = chunks[c]->layout().replicated_offset;
      const Device device = chunks[c]->group().device();
      // the part of the range below the split (every tp rank), and above it (tp 0 only)
      const size_t split_end = std::min(r.end, split), replicated_begin = std::max(r.begin, split);
      if (r.begin < split_end) mine += grad_norm_squared(g, split_end - r.begin, device);
      if (me.tp == 0 && replicated_begin < r.end) {
        mine += grad_norm_squared(g + (replicated_begin - r.begin), r.end - replicated_begin, device);
      }
    }
  }
  float norm_squared = static_cast<float>(mine);
  world.all_reduce(&norm_squared, 1, ReduceOp::Sum);
  const double norm = std::sqrt(static_cast<double>(norm_squared));
  for (size_t c = 0; c < chunks.size(); c++) {
    const FlatRange r = updated[c];
    clip_grads(grads[c], r.end - r.begin, norm, max_norm, chunks[c]->group().device());
  }
}

// ----------------------------------------------------------------------------
// checkpoints

static std::string section(const char* name, int chunk) { return "chunk" + std::to_string(chunk) + "_" + name; }

// "07_3d at dp 2 x pp 2 x tp 2, 1 chunk(s) per pipeline rank, ZeRO-1": what decides
// the cut; the grid's order too when it is not the default, since it moves every
// rank's pieces ("... tp 2 in pp-dp-tp order, ...")
static std::string grid_cut(const ProcessGrid& grid, int chunks, int zero_stage) {
  const std::string order =
      grid.order() == GridOrder::DpPpTp ? "" : std::string(" in ") + grid_order_name(grid.order()) + " order";
  return "07_3d at dp " + std::to_string(grid.dp_size()) + " x pp " + std::to_string(grid.pp_size()) + " x tp " +
         std::to_string(grid.tp_size()) + order + ", " + std::to_string(chunks) + " chunk(s) per pipeline rank, " +
         (zero_stage == 0 ? "DDP" : "ZeRO-" + std::to_string(zero_stage));
}

// What rank `me` saves of its chunk c: the TP slices of the chunk's stages, or with
// ZeRO the shard of them whose moments it keeps (shard_layout, as ZeRO does)
static std::vector<ManifestPiece> saved_pieces(const GPTConfig& config, const GridPlace& place, GridCoords me,
                                               int chunk, int zero_stage) {
  const ProcessGrid& grid = place.grid;
  const StageRange range = place.cut[place.schedule.stage(me.pp, chunk)];
  const TPLayout layout = tp_layout(config, range.first, range.last, grid.tp_size());
  if (zero_stage == 0) return tp_pieces(layout, me.tp, grid.tp_size());
  const ShardLayout shards = shard_layout(layout.numel, grid.dp_size());
  return tp_pieces(layout, me.tp, grid.tp_size(), shards.begin[me.dp], shards.count[me.dp]);
}

// How the grid cuts the model: chunk c of every rank is sections chunk<c>_params, ...
static ShardedCut grid_checkpoint_cut(const GPTConfig& config, const GridPlace& place, int zero_stage) {
  const auto shards_of = [&config, &place, zero_stage](int rank) {
    std::vector<ManifestShard> shards;
    for (int c = 0; c < place.schedule.chunks; c++) {
      shards.push_back({"", section("params", c), section("adam_m", c), section("adam_v", c),
                        saved_pieces(config, place, place.grid.coords_of(rank), c, zero_stage)});
    }
    return shards;
  };
  return {grid_cut(place.grid, place.schedule.chunks, zero_stage), place.grid.world_size(), shards_of};
}

void save_grid_checkpoint(const TrainOptions& options, const GridPlace& place, int step, const GridChunks& chunks,
                          DataParallelOptimizer& optimizer) {
  std::vector<ShardValues> mine;
  for (size_t c = 0; c < chunks.parts.size(); c++) {
    ChunkDataParallel& chunk = optimizer.chunk(static_cast<int>(c));
    const AdamW& adamw = chunk.optimizer();
    mine.push_back({chunk.owned_params(), adamw.m.data(), adamw.v.data(), chunks.parts[c]->group().device()});
  }
  save_sharded(options, step, place.rank, grid_checkpoint_cut(options.model, place, optimizer.zero_stage()), mine);
}

int resume_grid_if_asked(const TrainOptions& options, const GridPlace& place, const GridChunks& chunks,
                         DataParallelOptimizer& optimizer, bool verbose) {
  const int tp = place.grid.tp_size();
  std::vector<ShardTarget> targets;
  for (size_t c = 0; c < chunks.parts.size(); c++) {
    // every rank needs its chunk's whole TP slices (or at ZeRO-3 its shard of them),
    // and the moments it keeps, from whichever files hold them (another layout: resharding)
    const StageRange range = place.chunk_stages(static_cast<int>(c));
    const TPLayout layout = tp_layout(options.model, range.first, range.last, tp);
    ChunkDataParallel& chunk = optimizer.chunk(static_cast<int>(c));
    AdamW& adamw = chunk.optimizer();
    const Device device = chunks.parts[c]->group().device();
    const std::vector<ManifestPiece> kept = tp_pieces(layout, place.me.tp, tp, chunk.owned_range().begin, adamw.count());
    if (chunk.replica() == nullptr) {  // ZeRO-3: the shard of the parameters too, the only ones kept
      targets.push_back({kept, {chunk.owned_params(), adamw.m.data(), adamw.v.data(), device}});
      continue;
    }
    targets.push_back({tp_pieces(layout, place.me.tp, tp), {chunk.replica(), nullptr, nullptr, device}});
    targets.push_back({kept, {nullptr, adamw.m.data(), adamw.v.data(), device}});
  }
  const int step =
      resume_sharded(options, grid_checkpoint_cut(options.model, place, optimizer.zero_stage()), targets, verbose);
  if (step == 1) return step;  // nothing loaded: the replicas hold their initial values still
  for (size_t c = 0; c < chunks.parts.size(); c++) optimizer.chunk(static_cast<int>(c)).replica_loaded();
  return step;
}

}  // namespace course
