// Chapter 10: training over slow links.
//
// Chapter 02's workers over a link that can be slow (--sites, --wan-bandwidth,
// --wan-latency), sending less (link_sync.h): compressed gradients every step, or
// weights every H steps (DiLoCo, diloco.h), whole or a fragment at a time. A step's
// loss is the worker's own: averaging it would cross the slow link every step.
#include <cmath>
#include <vector>

#include "10_slow_links/diloco.h"
#include "10_slow_links/link_sync.h"
#include "common/model/adamw.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class SlowLinks : public Technique {  // a worker per rank; what crosses the link, and when
 public:
  SlowLinks(Run& run, const SlowLinkFlags& link_flags, const DDPFlags& flags, const CommOptions& comm_options)
      : run_(run),
        options_(run.options),
        my_rows_(data_parallel_slice(options_.batch, run.rank, run.ranks)),
        micro_batch_(my_rows_.rows / options_.micro_batches),
        model_(options_.model, micro_batch_, options_.seed, run.device),
        optimizer_(link_flags.inner_optimizer, adamw_config(options_), model_.params.size(), run.device),
        sync_(run, model_, optimizer_.adamw(), link_flags, flags, comm_options),
        tokens_(static_cast<size_t>(micro_batch_) * options_.model.seq_len),
        targets_(tokens_.size()),
        step_loss_(options_.micro_batches, run.device) {
    per_rank_checkpoint = true;  // the workers' weights differ between outer steps: each saves its own
    meters.add_axis("dp", [this] { return sync_.traffic(); });
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, my_rows_);
      sync_.print_plan();
    }
  }

  int resume() override { return sync_.resume(); }

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
      model_.backward(dloss, sync_.backward_hook(/*last_micro_batch=*/micro == options_.micro_batches - 1));
      run_.trace_compute("backward", span_start, where);
    }
    float loss = step_loss_.read();  // waits for the device: once a step, not once a micro-batch
    sync_.average_gradients(meters);  // DDP: every worker's gradients averaged; DiLoCo: none, each its own
    const double update_start = now_seconds();
    // with --grad-clip 0 too: the norm is what stops a non-finite gradient before the update
    const double norm = std::sqrt(model_.grad_norm_squared());
    model_.clip_gradients(norm, options_.grad_clip);
    optimizer_.update(model_.params.data(), model_.grads.data(), step);
    sync_.after_update(step);  // DiLoCo: the fragments due after this step, averaged, and the outer step
    run_.trace_compute("optimizer step", update_start, JsonLine().add("step", step));
    return loss;
  }

  void save(int step) override {
    sync_.save(step);
  }

  JsonLine summary() override {
    return sync_.finish(my_rows_);  // the workers' models checked equal (DiLoCo: the global one), its eval loss
  }

  void conclude() const override { sync_.print_conclusion(); }

 private:
  Run& run_;
  const TrainOptions& options_;
  const RowSlice my_rows_;  // the rows of every global batch this rank trains on
  const int micro_batch_;   // sequences per forward/backward
  GPT model_;
  InnerOptimizer optimizer_;  // AdamW, or SGD (--inner-optimizer)
  LinkSync sync_;             // what crosses the link, and when
  std::vector<int> tokens_;   // (micro_batch, T)
  std::vector<int> targets_;  // (micro_batch, T)
  StepLoss step_loss_;        // the step's loss, added up where the model computes it
};

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "10_slow_links";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  CommOptions comm_options;
  DDPFlags flags;
  SlowLinkFlags link_flags;
  ArgParser parser(kProgram, "Chapter 10: training over slow links: compressed gradients, DiLoCo, streaming DiLoCo.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  add_ddp_flags(parser, flags);
  add_slow_link_flags(parser, link_flags);
  parser.parse(argc, argv);
  validate_slow_link_flags(link_flags, options, comm_options);

  // fault tolerant: no world (the first lost worker would break it), a group per outer step
  Run run(kProgram, options, link_flags.fault_tolerant ? nullptr : &comm_options);
  if (link_flags.fault_tolerant) run.ranks_from_launch_environment();
  run.name += " " + variant_name(link_flags);  // "10_slow_links diloco H10", the report's label
  run.start(/*data_parallel_ranks=*/run.ranks);
  SlowLinks technique(run, link_flags, flags, comm_options);

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
