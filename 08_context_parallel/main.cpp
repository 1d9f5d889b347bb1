// Chapter 08: context parallelism.
//
// Chapter 02's trainer with every sequence split over the N ranks of a cp group: each
// rank holds T/N tokens of each sequence, and attention fetches the other ranks' keys
// and values (context_parallel.h). Gradients are averaged over every rank, as in 02.
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/08_context_parallel --seq 1024
#include <cmath>
#include <vector>

#include "02_ddp/ddp.h"
#include "08_context_parallel/context_parallel.h"
#include "common/model/adamw.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class ContextParallel : public Technique {  // T/N of every sequence per rank, attention fetches the rest
 public:
  ContextParallel(Run& run, const CPFlags& flags)
      : run_(run),
        options_(run.options),
        place_(*run.world, flags, options_.model),
        my_rows_(data_parallel_slice(options_.batch, place_.dp_rank, place_.dp)),
        micro_batch_(my_rows_.rows / options_.micro_batches),
        attention_(make_context_attention(flags, run, place_, meters)),
        model_(options_.model, micro_batch_, options_.seed, run.device, /*routing=*/nullptr,
               {place_.split.chunks_of(place_.cp_rank), attention_.get()}),
        optimizer_(adamw_config(options_), model_.params.size(), run.device),
        ddp_(*run.world, model_, flags.bucket_mb, /*overlap=*/!flags.no_overlap, flags.grad_comm_dtype),
        tokens_(static_cast<size_t>(micro_batch_) * place_.split.local_len()),
        targets_(tokens_.size()),
        step_loss_(options_.micro_batches, run.device) {
    per_rank_checkpoint = false;  // rank 0 saves the model, every rank resumes from it: identical replicas
    ddp_.set_trace(run.trace.get());  // the buckets' all-reduces on the communication lane
    meters.add_axis("cp", [this] { return place_.cp_group->total_stats(); });
    meters.add_axis("dp", [this] { return ddp_.total_stats(); });
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, my_rows_);
      print_cp_layout(flags, place_, run.backend());
      ddp_.print(run.backend());
    }
  }

  int resume() override { return resume_if_asked(options_, model_.params.data(), optimizer_, run_.is_rank0()); }

  float step(int step) override {
    // the mean over this rank's tokens, whichever micro-batch they fall in; where the ranks
    // split the batch (data parallelism), averaging over them then makes it the global mean
    const float dloss = 1.0f / (static_cast<float>(my_rows_.rows) * place_.split.local_len());
    model_.zero_grad();
    for (int micro = 0; micro < options_.micro_batches; micro++) {
      place_.sample_local(*run_.sampler, step, my_rows_.first_row + micro * micro_batch_, micro_batch_,
                          tokens_.data(), targets_.data());  // this rank's chunks of each sequence
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
    run_.world->all_reduce(&loss, 1, ReduceOp::Average);  // for the report: the global batch's mean loss
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

  JsonLine summary() override {
    check_copies_agree(*run_.world, model_.params.data(), model_.params.size(), run_.device, "the replicas' parameters");
    return cp_rank_table(*run_.world, place_, *attention_, meters, micro_batch_, options_);
  }

 private:
  Run& run_;
  const TrainOptions& options_;
  CPPlace place_;           // this rank's dp and cp coordinates, its chunks and cp group
  const RowSlice my_rows_;  // the rows of every global batch this rank trains on
  const int micro_batch_;   // sequences per forward/backward
  std::unique_ptr<ContextAttention> attention_;
  GPT model_;
  AdamW optimizer_;
  DDP ddp_;
  std::vector<int> tokens_;   // (chunks, micro_batch, Tc)
  std::vector<int> targets_;  // (chunks, micro_batch, Tc)
  StepLoss step_loss_;        // the step's loss, added up where the model computes it
};

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "08_context_parallel";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  CommOptions comm_options;
  CPFlags flags;
  ArgParser parser(kProgram, "Chapter 08: context parallelism: every sequence split over the ranks.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  add_cp_flags(parser, flags);
  parser.parse(argc, argv);

  Run run(kProgram, options, &comm_options);
  resolve_cp_flags(flags, options.model, run.ranks);  // --dp x --cp = the world
  run.start(/*data_parallel_ranks=*/flags.dp);
  ContextParallel technique(run, flags);

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
