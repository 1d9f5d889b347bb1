// Chapter 06: tensor parallelism.
//
// Chapter 00's trainer with every matrix split over N ranks (the embedding and LM head by
// vocabulary): Megatron's f and g (tensor_parallel.h) sum the partial results, two all-reduces
// per block in forward, two in backward. --sp: LayerNorms and residuals on T/N positions.
// The result: chapter 00's computation on the whole batch, split N ways.
#include <cmath>
#include <vector>

#include "06_tensor_parallel/tp_model.h"
#include "common/model/adamw.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class TensorParallel : public Technique {  // a slice of every matrix per rank, f and g inside the layers
 public:
  TensorParallel(Run& run, bool sequence_parallel)
      : run_(run),
        options_(run.options),
        my_rows_(data_parallel_slice(options_.batch, /*dp_rank=*/0, /*dp_size=*/1)),  // no data parallelism
        micro_batch_(my_rows_.rows / options_.micro_batches),
        tp_(*run.world, sequence_parallel, micro_batch_, options_.model.seq_len, options_.model.d_model, run.device,
            message_dtype(options_)),
        model_(options_.model, tp_, options_.seed),
        optimizer_(adamw_config(options_), model_.params.size(), run.device),
        tokens_(static_cast<size_t>(micro_batch_) * options_.model.seq_len),
        targets_(tokens_.size()),
        step_loss_(options_.micro_batches, run.device) {
    if (sequence_parallel) run.name += " +sp";  // the report tells the two apart
    tp_.set_trace(run.trace.get());  // every f and g inside forward and backward on the communication lane
    tp_.set_meters(&meters);         // and the time each step waited for them: its exposed communication
    meters.add_axis("tp", [&run] { return run.world->total_stats(); });  // the world is the tp group
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, my_rows_);
      print_tp_split(options_.model, tp_, run.backend());
    }
  }

  int resume() override { return resume_tp_if_asked(options_, *run_.world, model_, optimizer_, run_.is_rank0()); }

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
      model_.backward(dloss);
      run_.trace_compute("backward", span_start, where);
    }
    float loss = step_loss_.read();  // waits for the device: once a step, not once a micro-batch
    model_.finish_gradients();  // --sp: the replicated parameters' gradients summed over the positions
    const double update_start = now_seconds();
    // with --grad-clip 0 too: the norm is what stops a non-finite gradient before the update
    const double norm = std::sqrt(model_.grad_norm_squared());
    model_.clip_gradients(norm, options_.grad_clip);
    optimizer_.update(model_.params.data(), model_.grads.data(), step);
    run_.trace_compute("optimizer step", update_start, JsonLine().add("step", step));
    return loss;
  }

  void save(int step) override {
    save_tp_checkpoint(options_, *run_.world, step, model_, optimizer_);  // every rank its slices
  }

  JsonLine summary() override {
    check_copies_agree(*run_.world, model_.replicated_params(), model_.replicated_count(), run_.device, "the copies");
    return model_.summary_fields();
  }
  void conclude() const override { model_.print_logits_saving(micro_batch_); }

 private:
  Run& run_;
  const TrainOptions& options_;
  const RowSlice my_rows_;  // the rows of every global batch this rank trains on
  const int micro_batch_;   // sequences per forward/backward
  TPGroup tp_;              // the world, every matrix split across it
  TPGPT model_;             // this rank's slices of every layer
  AdamW optimizer_;
  std::vector<int> tokens_;   // (micro_batch, T)
  std::vector<int> targets_;  // (micro_batch, T)
  StepLoss step_loss_;        // the step's loss, added up where the model computes it
};

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "06_tensor_parallel";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  CommOptions comm_options;
  TPFlags flags;
  ArgParser parser(kProgram, "Chapter 06: tensor parallelism: every matrix split across the ranks.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  add_tp_flags(parser, flags);
  parser.parse(argc, argv);

  Run run(kProgram, options, &comm_options);
  check_tp_shape(options.model, whole_world_degree("--tp", flags.tp, run.ranks), flags.sequence_parallel);
  run.start(/*data_parallel_ranks=*/1);  // every rank reads the whole batch: no data parallelism here
  TensorParallel technique(run, flags.sequence_parallel);

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
