// Chapter 00: training a GPT on one device.
//
// Everything the parallel chapters split up, in one piece: a batch of byte sequences,
// forward to a loss, backward to gradients, one AdamW step; --micro-batches M adds up M
// slices' gradients (gradient accumulation). Every later chapter's main.cpp is this file
// with its technique in this class's place. --device cuda: the same code on a GPU; --dtype
// bf16: bf16 matmuls, fp32 weights. --experts E --top-k k: mixture-of-experts blocks.
#include <cmath>
#include <vector>

#include "common/model/adamw.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class SingleDevice : public Technique {  // no technique: the whole model on one device
 public:
  explicit SingleDevice(Run& run)
      : run_(run),
        options_(run.options),
        my_rows_(data_parallel_slice(options_.batch, run.rank, run.ranks)),
        micro_batch_(my_rows_.rows / options_.micro_batches),
        model_(options_.model, micro_batch_, options_.seed, run.device, &meters.routing),  // routers' figures
        optimizer_(adamw_config(options_), model_.params.size(), run.device),
        tokens_(static_cast<size_t>(micro_batch_) * options_.model.seq_len),
        targets_(tokens_.size()),
        step_loss_(options_.micro_batches, run.device) {
    per_rank_checkpoint = false;
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, my_rows_);
    }
  }

  int resume() override { return resume_if_asked(options_, model_.params.data(), optimizer_, run_.is_rank0()); }

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
    const double update_start = now_seconds();
    // with --grad-clip 0 too: the norm is what stops a non-finite gradient before the update
    const double norm = std::sqrt(model_.grad_norm_squared());
    model_.clip_gradients(norm, options_.grad_clip);
    optimizer_.update(model_.params.data(), model_.grads.data(), step);
    run_.trace_compute("optimizer step", update_start, JsonLine().add("step", step));
    return loss;
  }

  void save(int step) override {
    save_training_state(options_, step, model_.params.data(), optimizer_);
  }

 private:
  Run& run_;
  const TrainOptions& options_;
  const RowSlice my_rows_;  // the rows of every global batch this rank trains on
  const int micro_batch_;   // sequences per forward/backward
  GPT model_;
  AdamW optimizer_;
  std::vector<int> tokens_;   // (micro_batch, T)
  std::vector<int> targets_;  // (micro_batch, T)
  StepLoss step_loss_;        // the step's loss, added up where the model computes it
};

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "00_single_gpu";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  ArgParser parser(kProgram, "Chapter 00: train a small GPT on a single device.");
  add_common_flags(parser, options);
  parser.parse(argc, argv);

  Run run(kProgram, options, /*comm_options=*/nullptr, /*trains_experts=*/true);
  run.start(/*data_parallel_ranks=*/run.ranks);
  SingleDevice technique(run);

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
