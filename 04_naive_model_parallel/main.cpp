// Chapter 04: naive model parallelism, chapter 00's trainer with the model split.
//
// The model is cut by layers across the pipeline's ranks instead of the batch: pipeline
// rank p owns a contiguous range of stages (the cut: model_split.h), the first the
// embedding, the last the head and the loss. Each micro-batch's (B, T, C) activation
// flows forward stage by stage, its gradient back the same way.
// One micro-batch at a time, on purpose: while one rank computes, N-1 others wait.
//
//   rank 0                 rank 1
//   [emb, blocks 0-1] --activation (B,T,C)--> [blocks 2-3, head, loss]
//                     <--gradient   (B,T,C)--
#include <cstdio>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "common/train/checkpoint.h"
#include "common/train/rank_table.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class NaiveModelParallel : public Technique {  // the model cut by layers, a range of stages per rank
 public:
  NaiveModelParallel(Run& run, const StageCut& place)
      : run_(run),
        options_(run.options),
        place_(place),
        my_rows_(data_parallel_slice(options_.batch, 0, 1)),  // every rank sees the whole batch
        micro_batch_(my_rows_.rows / options_.micro_batches),
        parts_(options_, place_.every_rank[run.rank], micro_batch_, run.device),
        walk_(*parts_.parts[0], parts_.workspace, *run.world, *run.trace, micro_batch_, message_dtype(options_)),
        step_loss_(options_.micro_batches, run.device) {
    // bytes sent: the technique's own traffic, not the loss's report nor clipping's all-reduce
    meters.add_axis("pp", [this] { return op_stats(*run_.world, "send"); });
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
    const double step_start = now_seconds();
    for (int micro = 0; micro < options_.micro_batches; micro++) {  // one at a time, through every rank
      run_.sampler->fill(step, my_rows_.first_row + micro * micro_batch_, micro_batch_, walk_.acts.batch.tokens(),
                         walk_.acts.batch.targets());
      const JsonLine where = JsonLine().add("step", step).add("micro_batch", micro);
      walk_.forward(where, step_loss_);  // each rank waits for its neighbour's activation
      walk_.backward(dloss, where);
    }
    float loss = step_loss_.read();  // waits for the device: once a step, not once a micro-batch
    loss = place_.report_loss(*run_.world, loss);  // it exists only where the head is
    const double update_start = now_seconds();
    // with --grad-clip 0 too: the norm is what stops a non-finite gradient before the update
    parts_.clip_gradients(*run_.world, options_.grad_clip);
    parts_.update(step);
    run_.trace_compute("optimizer step", update_start, JsonLine().add("step", step));
    meters.record_idle(walk_.take_busy_seconds(), now_seconds() - step_start);
    return loss;
  }

  void save(int step) override {
    save_parts(options_, *run_.world, step, parts_.parts, parts_.optimizers, place_.every_rank);
  }

  // every rank's share of the memory and of the time
  JsonLine summary() override {
    return gather_rank_table(*run_.world, run_.device, meter_columns(meters), place_.labels);
  }

  void conclude() const override { print_naive_idle(meters.world_idle_fraction(), run_.ranks); }

 private:
  Run& run_;
  const TrainOptions& options_;
  const StageCut place_;             // where every rank sits: its stages
  const RowSlice my_rows_;           // the rows of every global batch this rank trains on
  const int micro_batch_;            // sequences per forward/backward
  RankParts parts_;                  // this rank's part of the model, and its optimizer
  PartWalk walk_;                    // one micro-batch through this rank's part, from and to its neighbours
  StepLoss step_loss_;               // the step's loss, added up where the head computes it
};

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "04_naive_model_parallel";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  CommOptions comm_options;
  int pp = 0;
  ArgParser parser(kProgram, "Chapter 04: the model cut by layers across ranks, one rank busy at a time.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  parser.add_int("--pp", &pp, 0, "pipeline ranks (model parts); 0 = the world size");
  parser.parse(argc, argv);

  Run run(kProgram, options, &comm_options);
  const StageCut place = one_part_per_rank(run, pp);
  run.start(/*data_parallel_ranks=*/1);
  NaiveModelParallel technique(run, place);

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
