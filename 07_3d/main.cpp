// Chapter 07: 3D parallelism.
//
// Chapter 05's pipeline with every stage split over a TP group (chapter 06) and the
// whole pipeline replicated over dp (chapters 02/03): each earlier technique on its
// own axis of a process grid, dp x pp x tp (common/process_grid.h, parallel_3d.h).
// TP's f and g all-reduce inside every micro-batch, so a TP group sits on the fastest
// links; the pipelines average their gradients once per step (or shard them: ZeRO-1).
//
//   ./build/bin/launch --nproc-per-node 8 -- ./build/bin/07_3d --dp 2 --pp 2 --tp 2
//
//   rank = (dp x 2 + pp) x 2 + tp:   stage 0      stage 1
//     the pipeline of dp 0          [ 0 | 1 ] -> [ 2 | 3 ]    [a | b]: a TP group
//     the pipeline of dp 1          [ 4 | 5 ] -> [ 6 | 7 ]    dp groups: 0,4 | 1,5 | 2,6 | 3,7
#include <cstdio>
#include <string>

#include "05_pipeline/pipeline.h"
#include "05_pipeline/schedule.h"
#include "07_3d/parallel_3d.h"
#include "common/process_grid.h"
#include "common/rank_table.h"
#include "common/trainer.h"
#include "common/training.h"

using namespace course;

// ---- the technique: pipelines of tensor-parallel chunks, averaged over dp ------------------
class Parallel3D : public Technique {
 public:
  Parallel3D(Run& run, const ProcessGrid& grid, const Schedule& schedule, bool sequence_parallel, int zero_stage,
             float bucket_mb)
      : run_(run),
        options_(run.options),
        place_(*run.world, grid, schedule, options_.model),
        my_rows_(data_parallel_slice(options_.batch, place_.me.dp, place_.grid.dp_size())),
        micro_batch_(my_rows_.rows / options_.micro_batches),
        parts_(options_, place_, micro_batch_, sequence_parallel, *run.trace),
        optimizer_(*place_.groups.dp, parts_.parts, zero_stage, bucket_mb, adamw_config(options_)),
        channels_(*place_.groups.pp, place_.schedule),
        executor_(place_.schedule, place_.me.pp, parts_.pipeline_chunks, channels_, micro_batch_,
                  my_rows_.first_row) {
    optimizer_.set_trace(run.trace.get());  // the DP all-reduces (or ZeRO-1's all-gathers) after the pipeline
    // bytes sent per axis; not the loss's all-reduce nor clipping's, over the world
    meters.add_axis("tp", [this] { return place_.groups.tp->total_stats(); });
    meters.add_axis("pp", [this] { return channels_.total_stats(); });
    meters.add_axis("dp", [this] { return place_.groups.dp->total_stats(); });
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, count_parameters(options_.model), micro_batch_, place_.grid.dp_size());
      place_.print(run.backend(), zero_stage, sequence_parallel);
    }
  }

  int resume() override { return resume_grid_if_asked(options_, place_, parts_, optimizer_, run_.is_rank0()); }

  float step(int step) override {
    const int T = options_.model.seq_len;
    const float dloss = 1.0f / (static_cast<float>(my_rows_.rows) * T);  // averaged over dp afterwards
    parts_.zero_grad();
    // pp x tp: this rank's list of the schedule, over its tensor-parallel chunks
    const PipelineStepStats stats = executor_.run_step(*run_.world, step, *run_.sampler, dloss, *run_.trace);
    parts_.finish_gradients();      // tp: the SP partial sums (nothing without --sp)
    optimizer_.average_gradients();  // dp: the pipelines average their gradients
    if (options_.grad_clip > 0.0f) clip_grid_gradients(*run_.world, place_.me, parts_.parts, options_.grad_clip);
    optimizer_.step(step);
    meters.record_idle(stats.busy_seconds, stats.window_seconds);
    // the loss: the mean of the pipelines' last stages (tp 0 speaks for its group)
    float loss = place_.reports_loss() ? stats.loss / place_.grid.dp_size() : 0.0f;
    run_.world->all_reduce(&loss, 1, ReduceOp::Sum);
    return loss;
  }

  void save(int step) override { save_grid_checkpoint(options_, place_, step, parts_, optimizer_); }

  // every rank's coordinates, memory, bytes per axis and idle share
  JsonLine summary() override {
    parts_.check_copies_agree(place_);
    const JsonLine table = gather_rank_table(
        *run_.world,
        {{"tp_sent_per_step", "tp sent", meters.bytes_per_step("tp"), ColumnUnit::Bytes},
         {"pp_sent_per_step", "pp sent", meters.bytes_per_step("pp"), ColumnUnit::Bytes},
         {"dp_sent_per_step", "dp sent", meters.bytes_per_step("dp"), ColumnUnit::Bytes},
         {"comm_ms_per_step", "comm/step", meters.comm_ms_per_step(), ColumnUnit::Milliseconds},
         {"idle_fraction", "idle", meters.idle_fraction(), ColumnUnit::Percent}},
        place_.labels);
    return JsonLine()
        .add("dp", place_.grid.dp_size()).add("pp", place_.grid.pp_size()).add("tp", place_.grid.tp_size())
        .add("sequence_parallel", parts_.sequence_parallel() ? 1 : 0)
        .add("zero_stage", optimizer_.zero_stage())
        .add("schedule", schedule_name(place_.schedule.kind))
        .add("chunks", place_.schedule.chunks)
        .add("bubble_formula", place_.bubble_formula())
        .merge(table);
  }

  void conclude() const override {
    std::printf("bubble (idle share of the step, mean over ranks): measured %.1f%%, formula %.1f%%\n",
                100.0 * meters.world_idle_fraction(), 100.0 * place_.bubble_formula());
  }

 private:
  Run& run_;
  const TrainOptions& options_;
  GridPlace place_;                  // this rank's coordinates, groups, schedule and cut
  const RowSlice my_rows_;           // this pipeline's rows of every global batch
  const int micro_batch_;            // sequences per forward/backward
  GridChunks parts_;                 // this rank's chunks of the model, sliced over its TP group
  DataParallelOptimizer optimizer_;  // their optimizers, over the DP group
  PipelineChannels channels_;        // to and from its neighbours
  PipelineExecutor executor_;        // runs this rank's list of the schedule
};

// ---- the trainer ---------------------------------------------------------------------
static int train(int argc, char** argv) {
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

  Run run("07_3d", options, &comm_options, /*gpu_ready=*/false);
  const ProcessGrid grid = make_process_grid(run.ranks, dp, pp, tp, parse_grid_order(grid_order));
  check_tp_shape(options.model, grid.tp_size(), sequence_parallel);
  check_interleaved_cut(kind, options.model.n_layer, grid.pp_size(), V);
  run.start(/*data_parallel_ranks=*/grid.dp_size());  // each pipeline takes its slice of the batch
  Parallel3D technique(run, grid, make_schedule(kind, grid.pp_size(), options.micro_batches, V), sequence_parallel,
                       zero_stage, bucket_mb);
  return train(run, technique);
}

int main(int argc, char** argv) {
  return guarded_main("07_3d", [&] { return train(argc, argv); });
}
