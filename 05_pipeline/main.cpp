// Chapter 05: pipeline parallelism, chapter 04's trainer with micro-batches in flight.
//
// The model is cut by layers across the pipeline's ranks instead of the batch: pipeline
// rank p owns a contiguous range of stages (the cut: model_split.h), the first the
// embedding, the last the head and the loss. Each micro-batch's (B, T, C) activation
// flows forward stage by stage, its gradient back the same way.
// M micro-batches in flight, ordered by a schedule (schedule.h, run by pipeline.h's
// executor): several ranks compute at once, except in the bubble.
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/05_pipeline --schedule zb-h1
//
//   rank 0                 rank 1
//   [emb, blocks 0-1] --activation (B,T,C)--> [blocks 2-3, head, loss]
//                     <--gradient   (B,T,C)--
#include <cstdio>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "05_pipeline/pipeline.h"
#include "common/train/checkpoint.h"
#include "common/train/rank_table.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class PipelineParallel : public Technique {  // the model cut by layers, a range of stages per rank
 public:
  PipelineParallel(Run& run, const PipelinePlace& place, const PipelineFlags& flags)
      : run_(run),
        options_(run.options),
        place_(place),
        my_rows_(data_parallel_slice(options_.batch, 0, 1)),  // every rank sees the whole batch
        micro_batch_(my_rows_.rows / options_.micro_batches),
        parts_(options_, place_.every_rank[run.rank], micro_batch_, run.device),
        channels_(place_.pp_group(), place_.schedule),
        executor_(place_.schedule, place_.pp_rank(), parts_.pipeline_chunks, channels_, micro_batch_,
                  my_rows_.first_row, run.device, message_dtype(options_)),
        bubble_(place_.schedule, flags.timeline) {
    // bytes sent: the technique's own traffic, not the loss's report nor clipping's all-reduce
    meters.add_axis("pp", [this] { return channels_.total_stats(); });
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, my_rows_);
      place_.print(run.backend(), micro_batch_);
    }
  }

  int resume() override {
    return resume_parts_if_asked(options_, parts_.parts, parts_.optimizers, place_.every_rank, run_.is_rank0());
  }

  float step(int step) override {
    const int T = options_.model.seq_len;
    const float dloss = 1.0f / (static_cast<float>(my_rows_.rows) * T);  // the mean over this rank's rows
    parts_.zero_grad();
    float loss = executor_.run_step(*run_.world, step, *run_.sampler, dloss, *run_.trace).loss;
    loss = place_.report_loss(*run_.world, loss);  // it exists only where the head is
    const double update_start = now_seconds();
    // with --grad-clip 0 too: the norm is what stops a non-finite gradient before the update
    parts_.clip_gradients(*run_.world, options_.grad_clip);
    parts_.update(step);
    run_.trace_compute("optimizer step", update_start, JsonLine().add("step", step));
    meters.record_idle(executor_.last_step().busy_seconds, executor_.last_step().window_seconds);
    return loss;
  }

  void save(int step) override {
    save_parts(options_, *run_.world, step, parts_.parts, parts_.optimizers, place_.every_rank);
  }

  // every rank's share of the memory and of the time
  JsonLine summary() override {
    return gather_rank_table(*run_.world, run_.device, meter_columns(meters, executor_.memory_columns()), place_.labels)
        .merge(bubble_.gather(*run_.world, executor_.last_step()));  // and the bubble three ways
  }

  void conclude() const override { bubble_.print(meters.world_idle_fraction()); }

 private:
  Run& run_;
  const TrainOptions& options_;
  const PipelinePlace& place_;       // where every rank sits: its stages, and the schedule
  const RowSlice my_rows_;           // the rows of every global batch this rank trains on
  const int micro_batch_;            // sequences per forward/backward
  RankChunks parts_;                 // this rank's chunks of the model, and their optimizers
  PipelineChannels channels_;        // to and from its neighbours
  PipelineExecutor executor_;        // runs this rank's list of the schedule
  BubbleReport bubble_;
};

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "05_pipeline";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  options.micro_batches = 8;  // this chapter's subject: a pipeline needs micro-batches to overlap
  CommOptions comm_options;
  PipelineFlags flags;
  ArgParser parser(kProgram, "Chapter 05: pipeline parallelism with micro-batches and a schedule.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  add_pipeline_flags(parser, flags);
  parser.parse(argc, argv);
  if (flags.dry_run) return flags.print_schedule(flags.pp, options.micro_batches);

  Run run(kProgram, options, &comm_options);
  const PipelinePlace place(run, flags);
  run.start(/*data_parallel_ranks=*/1);
  PipelineParallel technique(run, place, flags);

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
