// Chapter 07: 3D parallelism, chapter 05's pipeline with tensor and data parallelism.
//
// The model is cut by layers across the pipeline's ranks instead of the batch: pipeline
// rank p owns a contiguous range of stages (the cut: model_split.h), the first the
// embedding, the last the head and the loss. Each micro-batch's (B, T, C) activation
// flows forward stage by stage, its gradient back the same way.
// M micro-batches in flight, ordered by a schedule (schedule.h, run by pipeline.h's
// executor): several ranks compute at once, except in the bubble.
// And each stage is split over a TP group (chapter 06), each pipeline replicated over dp (02/03).
//
//   ./build/bin/launch --nproc-per-node 8 -- ./build/bin/07_3d --dp 2 --pp 2 --tp 2
//
//   rank = (dp x 2 + pp) x 2 + tp:   stage 0      stage 1
//     the pipeline of dp 0          [ 0 | 1 ] -> [ 2 | 3 ]    [a | b]: a TP group
//     the pipeline of dp 1          [ 4 | 5 ] -> [ 6 | 7 ]    dp groups: 0,4 | 1,5 | 2,6 | 3,7
#include <cstdio>
#include <vector>

#include "05_pipeline/pipeline.h"
#include "07_3d/parallel_3d.h"
#include "common/train/checkpoint.h"
#include "common/train/rank_table.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class Parallel3D : public Technique {  // pipelines of tensor-parallel chunks, averaged over dp
 public:
  Parallel3D(Run& run, const GridPlace& place, const GridFlags& flags)
      : run_(run),
        options_(run.options),
        place_(place),
        my_rows_(data_parallel_slice(options_.batch, place_.dp_rank(), place_.dp_size())),
        micro_batch_(my_rows_.rows / options_.micro_batches),
        parts_(options_, place_, micro_batch_, run.device, *run.trace, meters),
        optimizer_(*place_.groups.dp, parts_, flags, options_),
        channels_(place_.pp_group(), place_.schedule),
        executor_(place_.schedule, place_.pp_rank(), parts_.pipeline_chunks, channels_, micro_batch_,
                  my_rows_.first_row, run.device, message_dtype(options_)),
        bubble_(place_.schedule, flags.timeline) {
    optimizer_.attach(executor_, parts_, run.trace.get());  // each chunk's DP reduction, under later backwards
    // bytes sent: the technique's own traffic, not the loss's report nor clipping's all-reduce
    meters.add_axis("tp", [this] { return place_.groups.tp->total_stats(); });
    meters.add_axis("pp", [this] { return channels_.total_stats(); });
    meters.add_axis("dp", [this] { return place_.groups.dp->total_stats(); });
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, my_rows_);
      place_.print(run.backend(), micro_batch_);
    }
  }

  int resume() override {
    return resume_grid_if_asked(options_, place_, parts_, optimizer_, run_.is_rank0());
  }

  float step(int step) override {
    const int T = options_.model.seq_len;
    const float dloss = 1.0f / (static_cast<float>(my_rows_.rows) * T);  // the mean over this rank's rows
    parts_.zero_grad();
    float loss = executor_.run_step(*run_.world, step, *run_.sampler, dloss, *run_.trace).loss;
    meters.record_exposed(optimizer_.average_gradients(), "dp");  // dp: what the pipeline did not hide
    loss = place_.report_loss(*run_.world, loss);  // it exists only where the head is
    const double update_start = now_seconds();
    // with --grad-clip 0 too: the norm is what stops a non-finite gradient before the update
    optimizer_.clip_gradients(*run_.world, place_.me, options_.grad_clip);
    optimizer_.step(step);
    run_.trace_compute("optimizer step", update_start, JsonLine().add("step", step));
    meters.record_idle(executor_.last_step().busy_seconds, executor_.last_step().window_seconds);
    return loss;
  }

  void save(int step) override {
    save_grid_checkpoint(options_, place_, step, parts_, optimizer_);
  }

  // every rank's share of the memory and of the time
  JsonLine summary() override {
    optimizer_.check_copies_agree(place_);  // the DP replicas, and each TP group's replicated parameters
    const std::vector<RankColumn> columns = optimizer_.memory_columns(executor_.memory_columns());
    return gather_rank_table(*run_.world, run_.device, meter_columns(meters, columns), place_.labels)
        .merge(place_.summary_fields())                              // the grid's sizes and options
        .merge(bubble_.gather(*run_.world, executor_.last_step()));  // and the bubble three ways
  }

  void conclude() const override { bubble_.print(meters.world_idle_fraction()); }

 private:
  Run& run_;
  const TrainOptions& options_;
  const GridPlace& place_;           // where every rank sits: its grid coordinates, groups and stages
  const RowSlice my_rows_;           // the rows of every global batch this rank trains on
  const int micro_batch_;            // sequences per forward/backward
  GridChunks parts_;                 // this rank's chunks of the model, sliced over its TP group
  DataParallelOptimizer optimizer_;  // their optimizers, over the DP group
  PipelineChannels channels_;        // to and from its neighbours
  PipelineExecutor executor_;        // runs this rank's list of the schedule
  BubbleReport bubble_;
};

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "07_3d";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  options.micro_batches = 4;  // the pipeline needs micro-batches to overlap (each of dp's slices)
  CommOptions comm_options;
  GridFlags flags;
  ArgParser parser(kProgram, "Chapter 07: 3D parallelism: data x pipeline x tensor parallel on a process grid.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  add_grid_flags(parser, flags);
  parser.parse(argc, argv);
  if (flags.dry_run) return flags.print_schedule(flags.pp, options.micro_batches);

  Run run(kProgram, options, &comm_options);
  const GridPlace place(run, flags);
  run.start(/*data_parallel_ranks=*/place.dp_size());
  Parallel3D technique(run, place, flags);

  // ---- the steps ---------------------------------------------------------------------
  StepReport report(run, technique);  // each step's time, meters and line; then the summary
  for (int step = technique.resume(); step <= options.steps; step++) {
    report.start_step();
    const float loss = checked_step(technique, step, run.rank);  // the step above; a NaN stops the run
    report.end_step(step, loss);
    if (checkpoint_due(options, step)) save_checkpoint(run, technique, step);
  }
  return report.finish();
}

int main(int argc, char** argv) {
  return guarded_main(kProgram, [&] { return train(argc, argv); });
}
