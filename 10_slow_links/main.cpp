// Chapter 10: training over slow links.
//
// Chapter 02's workers, each on its slice of every global batch, over a link that can
// be slow (--sites, --wan-bandwidth, --wan-latency). Three ways to need it less:
//   --algorithm ddp --grad-compression int8   gradients every step, in a quarter of the bytes
//   --algorithm diloco --inner-steps H        weights every H steps (diloco.h)
//   ... --fragments P [--overlap-steps tau]   a P-th of them at a time, overlapped (streaming)
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "02_ddp/ddp.h"
#include "10_slow_links/compression.h"
#include "10_slow_links/diloco.h"
#include "10_slow_links/fault_tolerance.h"
#include "10_slow_links/worker_state.h"
#include "common/comm/env.h"
#include "common/comm/ring_volume.h"
#include "common/comm/wan_link.h"
#include "common/model/adamw.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "common/train/checkpoint.h"
#include "common/train/trainer.h"
#include "common/train/trainer_parts.h"

using namespace course;

// ---- the technique -------------------------------------------------------------------
class SlowLinks : public Technique {  // a worker per rank; what crosses the link, and when
 public:
  SlowLinks(Run& run, const SlowLinkFlags& flags, const DDPFlags& ddp_flags, const CommOptions& comm_options)
      : run_(run),
        options_(run.options),
        flags_(flags),
        my_rows_(data_parallel_slice(options_.batch, run.rank, run.ranks)),
        micro_batch_(my_rows_.rows / options_.micro_batches),
        model_(options_.model, micro_batch_, options_.seed, run.device),
        tokens_(static_cast<size_t>(micro_batch_) * options_.model.seq_len),
        targets_(tokens_.size()),
        step_loss_(options_.micro_batches, run.device) {
    per_rank_checkpoint = true;  // the workers' weights differ between outer steps: each saves its own
    if (flags.inner_optimizer == "adamw") adamw_ = std::make_unique<AdamW>(adamw_config(options_), model_.params.size());
    const Compression compression = parse_compression(flags.compression);
    if (flags.fault_tolerant) {
      // no fixed group: a quorum of the live workers at each outer step
      diloco_ = std::make_unique<DiLoCo>(nullptr, model_, flags);
      fault_tolerant_ = std::make_unique<FaultTolerantOuterLoop>(
          read_launch_env(), WanLayout(comm_options.wan, run.ranks), comm_options.timeout_seconds, flags.quorum_timeout);
    } else if (flags.algorithm == "diloco") {
      diloco_ = std::make_unique<DiLoCo>(run.world.get(), model_, flags);
    } else if (compression == Compression::None) {
      ddp_ = std::make_unique<DDP>(*run.world, model_, ddp_flags.bucket_mb, /*overlap=*/!ddp_flags.no_overlap);
    } else {
      compressed_ = std::make_unique<CompressedAverage>(*run.world, compression, model_.grads.size(),
                                                        !flags.no_error_feedback);
    }
    meters.add_axis("dp", [this] { return averages_traffic(); });
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, my_rows_);
      print_plan(run.backend());
    }
  }

  int resume() override {
    // a fault-tolerant worker the launcher restarted: the others' global weights, not a file
    if (fault_tolerant_ && read_launch_env().restart_count > 0) {
      return fault_tolerant_->join(*diloco_, model_.params.data()) + 1;
    }
    const int next_step = resume_worker_state(options_, run_.ranks, run_.rank, state_sections(), state_meta());
    return next_step == 1 && !flags_.init_from.empty() ? start_from_checkpoint() : next_step;
  }

  float step(int step) override {
    const int T = options_.model.seq_len;
    const float dloss = 1.0f / (static_cast<float>(my_rows_.rows) * T);  // the mean over this worker's tokens
    model_.zero_grad();
    for (int micro = 0; micro < options_.micro_batches; micro++) {
      run_.sampler->fill(step, my_rows_.first_row + micro * micro_batch_, micro_batch_, tokens_.data(),
                         targets_.data());
      model_.forward(tokens_.data(), targets_.data(), step_loss_);
      const bool last_micro = micro == options_.micro_batches - 1;
      model_.backward(dloss, ddp_ ? ddp_->backward_hook(last_micro) : nullptr);
    }
    // this worker's own loss: averaging it every step would cross the slow link every step
    const float loss = step_loss_.read();
    steps_run_++;
    // DDP: every worker's gradients averaged, whole or compressed; DiLoCo: none, each its own
    if (ddp_) meters.record_exposed(ddp_->synchronize_gradients().exposed_seconds);
    if (compressed_) compressed_->average(model_.grads.data());
    const double norm = std::sqrt(model_.grad_norm_squared());
    model_.clip_gradients(norm, options_.grad_clip);
    // the (inner) optimizer step
    if (adamw_) {
      adamw_->update(model_.params.data(), model_.grads.data(), step);
    } else {
      sgd_update(model_.params.data(), model_.grads.data(), model_.params.size(), options_.lr);
    }
    // DiLoCo: the fragments due after this step, averaged, and the outer step
    if (fault_tolerant_ && step % flags_.inner_steps == 0) {
      if (!fault_tolerant_->sync(*diloco_, model_.params.data(), step, step / flags_.inner_steps)) {
        throw CommError("worker " + std::to_string(run_.rank) + " was left out of outer step " +
                        std::to_string(step / flags_.inner_steps) + " (later than --quorum-timeout): exiting, so " +
                        "that the launcher restarts it with the global weights (hint: --restart-policy worker)");
      }
    } else if (diloco_ && !fault_tolerant_) {
      diloco_->after_inner_step(model_.params.data(), step, /*drain=*/checkpoint_due(options_, step));
    }
    sent_by_steps_ = averages_traffic();  // the summary's checks send a little more, after the last step
    return loss;
  }

  void save(int step) override {
    save_worker_state(options_, step, run_.ranks, run_.rank, state_sections(), state_meta());
  }

  JsonLine summary() override {
    // DiLoCo's model is the outer one: the workers' own weights have moved on since it
    if (diloco_) std::copy(diloco_->global.data(), diloco_->global.data() + model_.params.size(), model_.params.data());
    check_copies_agree(workers(), model_.params.data(), model_.params.size(), run_.device, "the workers' models");
    JsonLine fields = JsonLine()
        .add("algorithm", flags_.algorithm)
        .add("inner_optimizer", flags_.inner_optimizer)
        .add("inner_steps", flags_.algorithm == "diloco" ? flags_.inner_steps : 1)
        .add("fragments", flags_.fragments)
        .add("compression", flags_.compression)
        .add("outer_syncs", diloco_ ? diloco_->syncs() : 0)
        .add("sync_bytes_sent", static_cast<double>(sent_by_steps_.bytes_sent))
        .add("eval_loss", evaluate());
    // (a fault-tolerant run's groups change size as workers come and go: no one formula)
    if (!fault_tolerant_) fields.add("sync_bytes_formula", static_cast<double>(formula_bytes_sent()));
    return fields;
  }

 private:
  // rank 0, under the run header: what crosses the link, and when
  void print_plan(const std::string& backend) const;
  // What the averages sent so far: everything on the link but the checkpoints' barriers
  // (no loss crosses it: see step)
  OpStats averages_traffic() const {
    if (fault_tolerant_) return fault_tolerant_->traffic();
    const std::map<std::string, OpStats> by_operation = run_.world->stats();
    const auto barriers = by_operation.find("barrier");
    return run_.world->total_stats() - (barriers == by_operation.end() ? OpStats() : barriers->second);
  }
  // What this run's averages sent, by the formulas (diloco.h, compression.h; DDP's
  // buckets each a ring all-reduce).
  uint64_t formula_bytes_sent() const;
  // The model's mean loss on 4 global batches no step trained on (the sampler's steps
  // 10^6 + 1 to 4), each worker its slice: one number to hold every algorithm to.
  float evaluate();
  // --init-from: the checkpoint's weights (every worker the same), its step + 1 to go on at
  int start_from_checkpoint();
  // who the workers are now: the world, or the last outer step's quorum
  Comm& workers() { return fault_tolerant_ ? fault_tolerant_->last_group() : *run_.world; }
  std::vector<StateSection> state_sections();
  std::vector<std::pair<std::string, int>> state_meta() const;

  Run& run_;
  const TrainOptions& options_;
  const SlowLinkFlags flags_;
  const RowSlice my_rows_;  // the rows of every global batch this worker trains on
  const int micro_batch_;   // sequences per forward/backward
  GPT model_;
  std::unique_ptr<AdamW> adamw_;                  // the (inner) optimizer: AdamW, or none for SGD
  std::unique_ptr<DDP> ddp_;                      // --algorithm ddp, fp32: chapter 02's buckets
  std::unique_ptr<CompressedAverage> compressed_;  // --algorithm ddp, bf16 or int8
  std::unique_ptr<DiLoCo> diloco_;                // --algorithm diloco
  std::unique_ptr<FaultTolerantOuterLoop> fault_tolerant_;  // --fault-tolerant: DiLoCo's averages, by quorum
  std::vector<int> tokens_;   // (micro_batch, T)
  std::vector<int> targets_;  // (micro_batch, T)
  StepLoss step_loss_;        // the step's loss, added up where the model computes it
  int steps_run_ = 0;         // by this process (a resumed run counts from its first step)
  OpStats sent_by_steps_;     // averages_traffic() after the last of them
};

void SlowLinks::print_plan(const std::string& backend) const {
  const double model_mb = static_cast<double>(model_.params.bytes()) / 1e6;
  if (diloco_) {
    std::printf("diloco: %d inner %s steps per worker, then the outer step (Nesterov, lr %.2g, momentum %.2g) on "
                "the workers' average pseudo-gradient, sent %s%s\n",
                flags_.inner_steps, flags_.inner_optimizer.c_str(), flags_.outer_lr, flags_.outer_momentum,
                flags_.compression == "none" ? "in fp32" : flags_.compression.c_str(),
                flags_.no_error_feedback ? " without error feedback" : "");
    if (flags_.fragments > 1) {
      std::printf("streaming: %d fragments of %.2f MB or less, synced on staggered steps, each arriving %d step(s) "
                  "after it leaves\n",
                  flags_.fragments, model_mb / flags_.fragments, flags_.overlap_steps);
    }
  } else {
    std::printf("ddp: every step the workers' gradients averaged (%.2f MB of them), sent %s%s\n", model_mb,
                flags_.compression == "none" ? "in fp32, chapter 02's buckets" : flags_.compression.c_str(),
                flags_.no_error_feedback ? " without error feedback" : "");
  }
  std::printf("workers: %d, over %s; the loss on each step's line is worker 0's, on its slice\n", run_.ranks,
              fault_tolerant_ ? "a tcp group of the live workers at each outer step (fault tolerant)"
                              : backend.c_str());
}

uint64_t SlowLinks::formula_bytes_sent() const {
  if (diloco_) return diloco_->formula_bytes_sent();
  if (compressed_) return compressed_->formula_bytes() * steps_run_;
  uint64_t per_step = 0;
  for (const GradBucket& bucket : ddp_->buckets()) {
    per_step += ring_all_reduce_bytes((bucket.end - bucket.begin) * sizeof(float), run_.ranks);
  }
  return per_step * steps_run_;
}

int SlowLinks::start_from_checkpoint() {
  const CheckpointReader reader(flags_.init_from);
  check_model_meta(reader, options_.model, flags_.init_from);
  reader.read_section("params", model_.params.data(), model_.params.size());
  const int step = static_cast<int>(reader.meta("step"));
  if (step >= options_.steps) {
    throw FlagError("--init-from " + flags_.init_from + " is at step " + std::to_string(step) + " of --steps " +
                    std::to_string(options_.steps) + ": nothing to train (hint: raise --steps)");
  }
  if (diloco_) diloco_->start_from(model_.params.data());
  if (run_.is_rank0()) {
    std::printf("started from %s: its weights at step %d, fresh optimizer state: continuing at step %d\n",
                flags_.init_from.c_str(), step, step + 1);
  }
  return step + 1;
}

float SlowLinks::evaluate() {
  constexpr int kEvalBatches = 4;
  constexpr int kFirstEvalStep = 1000000;
  StepLoss eval_loss(kEvalBatches * options_.micro_batches, run_.device);
  for (int batch = 1; batch <= kEvalBatches; batch++) {
    for (int micro = 0; micro < options_.micro_batches; micro++) {
      run_.sampler->fill(kFirstEvalStep + batch, my_rows_.first_row + micro * micro_batch_, micro_batch_,
                         tokens_.data(), targets_.data());
      model_.forward(tokens_.data(), targets_.data(), eval_loss);
    }
  }
  float loss = eval_loss.read();
  workers().all_reduce(&loss, 1, ReduceOp::Average);
  return loss;
}

std::vector<StateSection> SlowLinks::state_sections() {
  const size_t count = model_.params.size();
  std::vector<StateSection> sections = {{"params", model_.params.data(), count}};
  if (adamw_) {
    sections.push_back({"adam_m", adamw_->m.data(), count});
    sections.push_back({"adam_v", adamw_->v.data(), count});
  }
  std::vector<CompressedAverage*> averages;
  if (compressed_) averages.push_back(compressed_.get());
  if (diloco_) {
    sections.push_back({"global", diloco_->global.data(), count});
    sections.push_back({"momentum", diloco_->momentum.data(), count});
    for (auto& average : diloco_->compressed) averages.push_back(average.get());
  }
  for (size_t i = 0; i < averages.size(); i++) {
    for (ErrorFeedback* feedback : {&averages[i]->worker_feedback(), &averages[i]->owner_feedback()}) {
      Buffer& residual = feedback->residual();
      const std::string name = (feedback == &averages[i]->worker_feedback() ? "residual_" : "owner_residual_");
      if (residual.size() > 0) sections.push_back({name + std::to_string(i), residual.data(), residual.size()});
    }
  }
  return sections;
}

std::vector<std::pair<std::string, int>> SlowLinks::state_meta() const {
  return {{"diloco", diloco_ ? 1 : 0},
          {"inner_steps", flags_.inner_steps},
          {"fragments", flags_.fragments},
          {"compression", static_cast<int>(parse_compression(flags_.compression))},
          {"error_feedback", flags_.no_error_feedback ? 0 : 1},
          {"inner_adamw", adamw_ ? 1 : 0}};
}

// ---- the trainer ---------------------------------------------------------------------
constexpr char kProgram[] = "10_slow_links";  // the binary: in --help, in its errors, in the report

static int train(int argc, char** argv) {
  TrainOptions options;
  CommOptions comm_options;
  DDPFlags ddp_flags;
  SlowLinkFlags flags;
  ArgParser parser(kProgram, "Chapter 10: training over slow links: compressed gradients, DiLoCo, streaming DiLoCo.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  add_ddp_flags(parser, ddp_flags);
  add_slow_link_flags(parser, flags);
  parser.parse(argc, argv);
  validate_slow_link_flags(flags, options, comm_options);

  // fault tolerant: no world (the first lost worker would break it), a group per outer step
  Run run(kProgram, options, flags.fault_tolerant ? nullptr : &comm_options, /*gpu_ready=*/false);
  if (flags.fault_tolerant) run.ranks_from_launch_environment();
  run.name += " " + (flags.algorithm == "diloco" ? "diloco H" + std::to_string(flags.inner_steps) : "ddp");
  if (flags.fragments > 1) run.name += " P" + std::to_string(flags.fragments);
  if (flags.compression != "none") run.name += " " + flags.compression;
  if (flags.fault_tolerant) run.name += " fault-tolerant";
  run.start(/*data_parallel_ranks=*/run.ranks);
  SlowLinks technique(run, flags, ddp_flags, comm_options);

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
