// Chapter 09: expert parallelism.
//
// Chapter 02's trainer on chapter 00's mixture-of-experts GPT (--experts E --top-k k),
// with every block's experts spread over the R ranks, E/R each: tokens travel to their
// experts' ranks and the outputs come back (expert_parallel.h). Everything else is
// replicated, its gradients averaged as in 02; each expert's gradient stays on its rank.
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/09_expert_parallel --experts 4 --top-k 2
#include <cmath>
#include <vector>

#include "02_ddp/ddp.h"
#include "09_expert_parallel/expert_model.h"
#include "common/model/adamw.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class ExpertParallelism : public Technique {  // E/R experts per rank, tokens sent to them and back
 public:
  ExpertParallelism(Run& run, const EPFlags& flags)
      : run_(run),
        options_(run.options),
        my_rows_(data_parallel_slice(options_.batch, run.rank, run.ranks)),
        micro_batch_(my_rows_.rows / options_.micro_batches),
        my_experts_(expert_parallel_config(options_.model, run.ranks, run.rank)),
        experts_(my_experts_, *run.world, micro_batch_, run.device, message_dtype(options_)),
        model_(my_experts_, micro_batch_, options_.seed, run.device, /*routing=*/nullptr, GPTPlugins{{}, nullptr, &experts_}),
        optimizer_(adamw_config(options_), model_.params.size(), run.device),
        ddp_(*run.world, model_, flags.bucket_mb, /*overlap=*/!flags.no_overlap, expert_ranges(model_),
             flags.grad_comm_dtype),
        tokens_(static_cast<size_t>(micro_batch_) * options_.model.seq_len),
        targets_(tokens_.size()),
        step_loss_(options_.micro_batches, run.device) {
    experts_.set_meters(&meters);  // chapter 00's routing figures, and the all-to-alls as exposed
    experts_.set_trace(run.trace.get());  // each all-to-all on the communication lane
    ddp_.set_trace(run.trace.get());  // the buckets' all-reduces on the communication lane
    meters.add_axis("ep", [this] { return experts_.counters().all_to_all; });
    meters.add_axis("dp", [this] { return ddp_.total_stats(); });
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, my_rows_);
      print_expert_layout(my_experts_, run.ranks, run.backend());
      ddp_.print(run.backend());
    }
  }

  // every rank reads its experts and the replicated rest, out of a checkpoint of any --ep
  int resume() override { return resume_experts_if_asked(options_, run_.rank, run_.ranks, model_, optimizer_); }

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
      model_.backward(dloss, ddp_.backward_hook(/*communicate=*/micro == options_.micro_batches - 1));
      run_.trace_compute("backward", span_start, where);
    }
    float loss = step_loss_.read();  // waits for the device: once a step, not once a micro-batch
    meters.record_exposed(ddp_.synchronize_gradients().exposed_seconds);  // exposed: the comm backward did not hide
    average_expert_gradients(model_, run_.ranks);  // every rank's tokens reached them: the sum, made a mean
    run_.world->all_reduce(&loss, 1, ReduceOp::Average);  // for the report: the global batch's mean loss
    const double update_start = now_seconds();
    // with --grad-clip 0 too: the norm is what stops a non-finite gradient before the update
    const double norm = std::sqrt(expert_parallel_grad_norm_squared(*run_.world, model_));
    model_.clip_gradients(norm, options_.grad_clip);
    optimizer_.update(model_.params.data(), model_.grads.data(), step);
    run_.trace_compute("optimizer step", update_start, JsonLine().add("step", step));
    return loss;
  }

  void save(int step) override {
    save_experts(options_, step, run_.rank, run_.ranks, model_, optimizer_);  // every rank its experts
  }

  JsonLine summary() override {
    check_replicated_agree(*run_.world, model_);  // the replicated parameters, every rank alike
    return expert_rank_table(*run_.world, experts_, model_, meters);
  }

 private:
  Run& run_;
  const TrainOptions& options_;
  const RowSlice my_rows_;  // the rows of every global batch this rank trains on
  const int micro_batch_;   // sequences per forward/backward
  const GPTConfig my_experts_;  // the model, with this rank's E/R experts of each block
  ExpertParallel experts_;      // the blocks' MoE layer: dispatch, local experts, combine
  GPT model_;
  AdamW optimizer_;
  DDP ddp_;
  std::vector<int> tokens_;   // (micro_batch, T)
  std::vector<int> targets_;  // (micro_batch, T)
  StepLoss step_loss_;        // the step's loss, added up where the model computes it
};

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "09_expert_parallel";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  CommOptions comm_options;
  EPFlags flags;
  ArgParser parser(kProgram, "Chapter 09: expert parallelism: every block's experts spread over the ranks.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  add_ep_flags(parser, flags);
  parser.parse(argc, argv);

  Run run(kProgram, options, &comm_options, /*trains_experts=*/true);
  check_ep_flags(options.model, whole_world_degree("--ep", flags.ep, run.ranks));
  run.start(/*data_parallel_ranks=*/run.ranks);
  ExpertParallelism technique(run, flags);

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
