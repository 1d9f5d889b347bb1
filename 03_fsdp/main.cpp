// Chapter 03: ZeRO, stages 1, 2 and 3 (sharded data parallelism).
//
// Chapter 02's trainer with the training state in N shards, one per rank (sharded_model.h):
// stage 1 shards AdamW's moments (zero.h), stage 2 the averaged gradients too, stage 3 (FSDP,
// the default) the parameters too, each model stage gathered just before it runs (fsdp.h).
// The result: chapter 00's computation on the whole batch, split N ways.
#include <cmath>
#include <vector>

#include "03_fsdp/sharded_model.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class ShardedDataParallel : public Technique {  // a shard of the training state per rank, the rest gathered
 public:
  ShardedDataParallel(Run& run, const ZeroFlags& flags)
      : run_(run),
        options_(run.options),
        my_rows_(data_parallel_slice(options_.batch, run.rank, run.ranks)),
        micro_batch_(my_rows_.rows / options_.micro_batches),
        model_(*run.world, options_.model, micro_batch_, options_.seed, flags, adamw_config(options_), run.device,
               message_dtype(options_)),
        tokens_(static_cast<size_t>(micro_batch_) * options_.model.seq_len),
        targets_(tokens_.size()),
        step_loss_(options_.micro_batches, run.device) {
    model_.set_trace(run.trace.get());  // its collectives, and at stages 2 and 3 each model stage, as spans
    meters.add_axis("grad", [this] { return model_.gradient_stats(); });
    meters.add_axis("param", [this] { return model_.parameter_stats(); });
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, my_rows_);
      model_.print_layout(run.backend());
    }
  }

  // every rank reads its own shard, out of a checkpoint of any world size and stage
  int resume() override { return model_.resume_if_asked(options_, run_.is_rank0()); }

  float step(int step) override {
    const int T = options_.model.seq_len;
    // the mean over this rank's tokens, whichever micro-batch they fall in; where the ranks
    // split the batch (data parallelism), averaging over them then makes it the global mean
    const float dloss = 1.0f / (static_cast<float>(my_rows_.rows) * T);
    model_.zero_grad();
    for (int micro = 0; micro < options_.micro_batches; micro++) {
      run_.sampler->fill(step, my_rows_.first_row + micro * micro_batch_, micro_batch_, tokens_.data(),
                         targets_.data());
      const JsonLine where = JsonLine().add("step", step).add("micro_batch", micro);
      double span_start = now_seconds();
      model_.forward(tokens_.data(), targets_.data(), step_loss_);  // adds its mean loss on the device
      run_.trace_compute("forward", span_start, where);
      span_start = now_seconds();
      model_.backward(dloss);  // stages 2 and 3: each model stage's gradient reduce-scattered as it is computed
      run_.trace_compute("backward", span_start, where);
    }
    float loss = step_loss_.read();  // waits for the device: once a step, not once a micro-batch
    model_.reduce_gradients();  // stage 1: the whole gradient all-reduced now, as in DDP
    run_.world->all_reduce(&loss, 1, ReduceOp::Average);  // for the report: the global batch's mean loss
    const double update_start = now_seconds();
    // with --grad-clip 0 too: the norm is what stops a non-finite gradient before the update
    const double norm = std::sqrt(model_.grad_norm_squared());
    model_.clip_gradients(norm, options_.grad_clip);
    model_.step(step);  // AdamW on this rank's shard; stages 1 and 2 then all-gather the updated shards
    run_.trace_compute("optimizer step", update_start, JsonLine().add("step", step));
    return loss;
  }

  void save(int step) override {
    model_.save(options_, step);  // every rank its shard
  }

  JsonLine summary() override {
    model_.check_replicas_agree();  // stages 1 and 2: every rank's copy of the whole model is the same
    return model_.summary_fields();  // zero_stage, shard_floats, prefetch
  }

 private:
  Run& run_;
  const TrainOptions& options_;
  const RowSlice my_rows_;  // the rows of every global batch this rank trains on
  const int micro_batch_;   // sequences per forward/backward
  ShardedModel model_;      // this rank's shards of the model and of AdamW's state, and the collectives
  std::vector<int> tokens_;   // (micro_batch, T)
  std::vector<int> targets_;  // (micro_batch, T)
  StepLoss step_loss_;        // the step's loss, added up where the model computes it
};

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "03_fsdp";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  CommOptions comm_options;
  ZeroFlags flags;
  ArgParser parser(kProgram, "Chapter 03: ZeRO: data parallelism with the training state sharded over the ranks.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  add_zero_flags(parser, flags);  // --zero-stage (3 unless told 1 or 2), --no-reshard-after-forward, --no-prefetch
  parser.parse(argc, argv);
  check_zero_flags(flags);

  Run run(kProgram + (" zero-" + std::to_string(flags.stage)), options, &comm_options);
  run.start(/*data_parallel_ranks=*/run.ranks);
  ShardedDataParallel technique(run, flags);

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
