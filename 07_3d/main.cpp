// Chapter 07: 3D parallelism.
//
// Every earlier technique at once, each on its own axis of a process grid
// (common/process_grid.h): the world's ranks are laid out as dp x pp x tp,
//
//   tp  (chapter 06) the ranks of a TP group split every matrix: f and g all-reduce
//       inside every micro-batch, so the group sits on the fastest links
//   pp  (chapter 05) the TP groups along a pipeline hold consecutive stages and
//       pass activations forward and gradients back, micro-batch by micro-batch
//   dp  (chapters 02/03) whole pipelines train on different slices of the batch
//       and average their gradients once per step (or shard the optimizer: ZeRO-1)
//
//   ./build/bin/launch --nproc-per-node 8 -- ./build/bin/07_3d --dp 2 --pp 2 --tp 2
//
//   dp 2 x pp 2 x tp 2, rank = (dp * 2 + pp) * 2 + tp:
//
//          pipeline of dp 0               pipeline of dp 1
//        stage 0      stage 1           stage 0      stage 1
//       [ 0 | 1 ] -> [ 2 | 3 ]         [ 4 | 5 ] -> [ 6 | 7 ]      [a | b]: a TP group
//          |  |         |  |              |  |         |  |
//          +--+---------+--+--- dp all-reduce: 0-4, 1-5, 2-6, 3-7 ---+
#include <cblas.h>

#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "common/rank_table.h"
#include "05_pipeline/pipeline.h"
#include "05_pipeline/schedule.h"
#include "07_3d/parallel_3d.h"
#include "common/checkpoint.h"
#include "common/cli.h"
#include "common/comm/comm.h"
#include "common/data.h"
#include "common/error.h"
#include "common/metrics.h"
#include "common/process_grid.h"
#include "common/trace.h"
#include "common/training.h"

using namespace course;

// "0-1 | 2-3": the groups of one axis, for the grid summary
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

static int train(int argc, char** argv) {
  // ---- flags -----------------------------------------------------------------
  TrainOptions options;
  options.micro_batches = 4;  // the pipeline needs micro-batches to overlap
  CommOptions comm_options;
  int dp = 0, pp = 1, tp = 1, virtual_stages = 0, zero_stage = 0;
  float bucket_mb = 25.0f;
  bool sequence_parallel = false;
  std::string schedule_flag = "1f1b", grid_order = "dp-pp-tp";
  ArgParser parser("07_3d", "Chapter 07: 3D parallelism: data x pipeline x tensor parallel on a process grid.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  parser.add_int("--dp", &dp, 0, "data-parallel replicas; 0 = world size / (pp x tp)");
  parser.add_int("--pp", &pp, 1, "pipeline stages (ranks along a pipeline); 0 = inferred");
  parser.add_int("--tp", &tp, 1, "tensor-parallel ranks splitting every matrix; 0 = inferred");
  parser.add_choice("--grid-order", &grid_order, grid_order_names(), "the axes in the rank formula, outermost first");
  parser.add_switch("--sp", &sequence_parallel, "sequence parallelism inside each TP group");
  parser.add_choice("--schedule", &schedule_flag, schedule_names(), "the pipeline's order of forwards and backwards");
  parser.add_int("--virtual-stages", &virtual_stages, 0, "model chunks per pipeline rank; 0 = 2 for interleaved");
  parser.add_int("--zero-stage", &zero_stage, 0, "0: DDP gradient buckets over dp; 1: ZeRO-1 optimizer shards");
  parser.add_float("--bucket-mb", &bucket_mb, 0.0f, true, "DDP gradient bucket size in MB (10^6 bytes)");
  parser.parse(argc, argv);
  const ScheduleKind kind = parse_schedule(schedule_flag);
  const int V = virtual_stages > 0 ? virtual_stages : (kind == ScheduleKind::Interleaved ? 2 : 1);
  const Device device = setup_device(options, /*gpu_ready=*/false);
  openblas_set_num_threads(options.threads);

  // ---- the grid and its three groups -----------------------------------------------
  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), comm_options);
  const int rank = world->rank(), ranks = world->size();
  const ProcessGrid grid = make_process_grid(ranks, dp, pp, tp, parse_grid_order(grid_order));
  validate_common(options, grid.dp_size());
  const GPTConfig& config = options.model;
  check_tp_shape(config, grid.tp_size(), sequence_parallel);
  check_interleaved_cut(kind, config.n_layer, grid.pp_size(), V);
  const GridCoords me = grid.coords_of(rank);
  GridComms groups = split_grid(*world, grid);
  const Schedule schedule = make_schedule(kind, grid.pp_size(), options.micro_batches, V);
  const std::vector<StageRange> cut = split_stages(config, schedule.stages());
  const bool is_rank0 = rank == 0;
  MetricsLog log(is_rank0 ? options.log : "");
  Trace trace(options.trace, rank, ranks);
  if (!options.checkpoint_dir.empty()) ensure_checkpoint_dir(options.checkpoint_dir);
  const int T = config.seq_len;

  // ---- data: this pipeline's slice of the global batch ---------------------------------
  TextData data = load_text_data(options.data, T);
  BatchSampler sampler(data, T, options.batch, options.seed);
  const RowSlice my_rows = data_parallel_slice(options.batch, me.dp, grid.dp_size());
  const int micro_batch = my_rows.rows / options.micro_batches;

  // ---- this rank's chunks: tensor-parallel slices of its stages ------------------------
  TPGroup tp_group(*groups.tp, sequence_parallel, micro_batch, T, config.d_model);
  tp_group.set_trace(&trace);  // f, g and the loss's all-reduces inside every micro-batch
  TPWorkspace workspace(config, tp_group);
  std::vector<std::unique_ptr<TPPart>> parts;
  std::vector<std::unique_ptr<TPChunk>> tp_chunks;
  std::vector<TPPart*> chunks;
  std::vector<PipelineChunk*> pipeline_chunks;  // the same, as the executor drives them
  for (int c = 0; c < V; c++) {
    const StageRange stages = cut[schedule.stage(me.pp, c)];
    parts.push_back(std::make_unique<TPPart>(config, tp_group, stages.first, stages.last, options.seed));
    tp_chunks.push_back(
        std::make_unique<TPChunk>(*parts.back(), tp_group, workspace, config, stages.first, stages.last,
                                  /*split_backward=*/kind == ScheduleKind::ZeroBubbleH1));
    chunks.push_back(parts.back().get());
    pipeline_chunks.push_back(tp_chunks.back().get());
  }
  DataParallelOptimizer optimizer(*groups.dp, chunks, zero_stage, bucket_mb,
                                  {options.lr, 0.9f, 0.95f, 1e-8f, options.weight_decay});
  optimizer.set_trace(&trace);  // the DP all-reduces (or ZeRO-1's all-gathers) after the pipeline's step
  PipelineChannels channels(*groups.pp, schedule);
  PipelineExecutor executor(schedule, me.pp, pipeline_chunks, channels, micro_batch, my_rows.first_row);

  std::vector<std::string> labels(ranks);  // "(1,0,1) embedding + blocks 0-1": (dp,pp,tp), then the stages
  for (int r = 0; r < ranks; r++) {
    const GridCoords c = grid.coords_of(r);
    labels[r] = "(" + std::to_string(c.dp) + "," + std::to_string(c.pp) + "," + std::to_string(c.tp) + ")";
    for (int v = 0; v < V; v++) {
      labels[r] += (v ? "; " : " ") + describe_stages(config, cut[schedule.stage(c.pp, v)]);
    }
  }
  if (is_rank0) {
    print_run_header(options, data, count_parameters(config), micro_batch, grid.dp_size());
    std::printf("grid: dp %d x pp %d x tp %d, %s, backend %s\n", grid.dp_size(), grid.pp_size(), grid.tp_size(),
                grid.formula().c_str(), world->backend().c_str());
    std::printf("  schedule %s, %d chunk(s) per pipeline rank, %s%s\n", schedule_name(kind), V,
                zero_stage ? "ZeRO-1 over dp" : "DDP buckets over dp", sequence_parallel ? ", sequence parallel" : "");
    std::printf("  tp groups: %s\n  pipelines: %s\n  dp groups: %s\n  (the tables below: each rank's (dp,pp,tp))\n",
                axis_groups(grid, 't').c_str(),
                axis_groups(grid, 'p').c_str(), axis_groups(grid, 'd').c_str());
  }
  const int first_step = resume_grid_if_asked(options, schedule, cut, grid, me, chunks, optimizer, zero_stage, is_rank0);

  // ---- training loop -------------------------------------------------------------
  RunReport report("07_3d", config, options.batch, ranks, device);
  const float dloss = 1.0f / (static_cast<float>(my_rows.rows) * T);  // averaged over dp afterwards
  const int last_stage_rank = schedule.rank_of_stage(schedule.stages() - 1);
  // what each axis's communicators have done so far: tp, pp, dp
  const auto axis_stats = [&] {
    return std::array<OpStats, 3>{groups.tp->total_stats(), channels.total_stats(), groups.dp->total_stats()};
  };
  uint64_t sent_total[3] = {0, 0, 0};  // tp, pp, dp
  double comm_seconds_total = 0.0;     // all three axes, on their communication threads
  double idle_sum = 0.0;
  int measured_steps = 0;

  for (int step = first_step; step <= options.steps; step++) {
    const double start = now_seconds();
    const std::array<OpStats, 3> before = axis_stats();
    for (TPPart* part : chunks) part->grads.zero();
    // pp x tp: the schedule over this rank's tensor-parallel chunks
    const PipelineStepStats stats = executor.run_step(*world, step, sampler, dloss, trace);
    for (TPPart* part : chunks) part->finish_gradients();  // tp: the SP partial sums (nothing without --sp)
    optimizer.average_gradients();  // dp: the pipelines average their gradients
    if (options.grad_clip > 0.0f) clip_grid_gradients(*world, me, chunks, options.grad_clip);
    optimizer.step(step);

    // the loss: the mean of the pipelines' last stages (tp 0 speaks for its group)
    const bool speaks = me.pp == last_stage_rank && me.tp == 0;
    float loss = speaks ? stats.loss / grid.dp_size() : 0.0f;
    world->all_reduce(&loss, 1, ReduceOp::Sum);

    const std::array<OpStats, 3> after = axis_stats();
    uint64_t sent[3];
    double comm_seconds = 0.0;
    for (int axis = 0; axis < 3; axis++) {
      sent[axis] = after[axis].bytes_sent - before[axis].bytes_sent;
      sent_total[axis] += sent[axis];
      comm_seconds += after[axis].seconds - before[axis].seconds;
    }
    comm_seconds_total += comm_seconds;
    const double idle = 1.0 - stats.busy_seconds / stats.window_seconds;
    if (step > first_step || first_step == options.steps) {  // the first step also pays for warming up
      idle_sum += idle;
      measured_steps++;
    }
    char text[96];  // bytes sent on each axis (the idle share is in the log and the final table)
    std::snprintf(text, sizeof(text), " | tp %s pp %s dp %s", format_bytes(static_cast<double>(sent[0])).c_str(),
                  format_bytes(static_cast<double>(sent[1])).c_str(),
                  format_bytes(static_cast<double>(sent[2])).c_str());
    report.step(step, options.steps, loss, now_seconds() - start, is_rank0 && !options.quiet ? options.print_every : 0,
                log,
                JsonLine().add("tp_bytes_sent", sent[0]).add("pp_bytes_sent", sent[1]).add("dp_bytes_sent", sent[2])
                    .add("comm_ms", comm_seconds * 1e3).add("idle_fraction", idle),
                text);

    // ---- checkpoint: every rank writes its own chunks ----------------------------------
    if (checkpoint_due(options, step)) {
      save_grid_checkpoint(options, *world, schedule, cut, grid, step, chunks, optimizer, zero_stage);
      world->barrier();  // nobody exits before every file is on disk
      prune_checkpoints(options.checkpoint_dir, /*keep=*/2, rank_suffix(rank));
    }
  }

  // ---- summary: every rank's coordinates, memory, bytes per axis and idle share --------
  // DP replicas must hold the same chunks, and a TP group the same replicated parameters
  for (TPPart* part : chunks) {
    if (!replicas_identical(*groups.dp, part->params.data(), part->params.size()) ||
        !replicas_identical(*groups.tp, part->replicated_params(), part->replicated_count())) {
      throw CourseError(grid.describe(rank) + ": parameters that should be copies differ after training (a bug: "
                        "replicas must apply the same gradients)");
    }
  }
  const int steps_run = options.steps - first_step + 1;
  const double my_idle = measured_steps ? idle_sum / measured_steps : 0.0;
  const JsonLine table = gather_rank_table(
      *world,
      {{"tp_sent_per_step", "tp sent", static_cast<double>(sent_total[0]) / steps_run, ColumnUnit::Bytes},
       {"pp_sent_per_step", "pp sent", static_cast<double>(sent_total[1]) / steps_run, ColumnUnit::Bytes},
       {"dp_sent_per_step", "dp sent", static_cast<double>(sent_total[2]) / steps_run, ColumnUnit::Bytes},
       {"comm_ms_per_step", "comm/step", comm_seconds_total * 1e3 / steps_run, ColumnUnit::Milliseconds},
       {"idle_fraction", "idle", my_idle, ColumnUnit::Percent}},
      labels);
  float bubble = static_cast<float>(my_idle);
  world->all_reduce(&bubble, 1, ReduceOp::Average);
  if (is_rank0) {
    const double formula = bubble_formula(kind, grid.pp_size(), options.micro_batches, V);
    report.finish(log, run_configuration(options, world->backend())
                           .add("dp", grid.dp_size())
                           .add("pp", grid.pp_size())
                           .add("tp", grid.tp_size())
                           .add("sequence_parallel", sequence_parallel ? 1 : 0)
                           .add("zero_stage", zero_stage)
                           .add("schedule", schedule_name(kind))
                           .add("chunks", V)
                           .add("bytes_sent_per_step",
                                static_cast<double>(sent_total[0] + sent_total[1] + sent_total[2]) / steps_run)
                           .add("tp_bytes_sent_per_step", static_cast<double>(sent_total[0]) / steps_run)
                           .add("pp_bytes_sent_per_step", static_cast<double>(sent_total[1]) / steps_run)
                           .add("dp_bytes_sent_per_step", static_cast<double>(sent_total[2]) / steps_run)
                           .add("bubble_measured", static_cast<double>(bubble))
                           .add("bubble_formula", formula)
                           .merge(table));
    std::printf("bubble (idle share of the step, mean over ranks): measured %.1f%%, formula %.1f%%\n",
                100.0 * bubble, 100.0 * formula);
  }
  finish_trace(trace, options.trace, world.get());
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("07_3d", [&] { return train(argc, argv); });
}
