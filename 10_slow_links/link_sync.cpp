// What a worker sends over the link, and when (link_sync.h).
#include "10_slow_links/link_sync.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "common/comm/env.h"
#include "common/comm/ring_volume.h"
#include "common/comm/wan_link.h"
#include "common/tensor/clock.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/train/checkpoint.h"
#include "common/train/metrics.h"
#include "common/train/trainer_parts.h"

namespace course {

LinkSync::LinkSync(Run& run, GPT& model, AdamW* adamw, const SlowLinkFlags& flags, const DDPFlags& ddp_flags,
                   const CommOptions& comm_options)
    : run_(run), model_(model), adamw_(adamw), flags_(flags) {
  const Compression compression = parse_compression(flags.compression);
  if (ddp_flags.grad_comm_dtype != DType::F32) {
    throw FlagError("--grad-comm-dtype is chapter 02's plain bf16 all-reduce; this chapter sends bf16 with error "
                    "feedback (hint: --grad-compression bf16)");
  }
  if (flags.fault_tolerant) {
    const LaunchEnv env = read_launch_env();
    // without a launcher (or under mpirun) rank 0 hosts the store, and a worker that dies takes it along
    if (env.store_host == StoreHost::RankZero) {
      throw FlagError("--fault-tolerant needs a store that outlives every worker, the launcher's (hint: ./build/bin/"
                      "launch --nproc-per-node " + std::to_string(std::max(env.world_size, 2)) +
                      " --restart-policy worker -- ...)");
    }
    // no fixed group: a quorum of the live workers at each outer step
    diloco_ = std::make_unique<DiLoCo>(nullptr, model, flags);
    fault_tolerant_ = std::make_unique<FaultTolerantOuterLoop>(
        env, WanLayout(comm_options.wan, run.ranks), comm_options.timeout_seconds, flags.quorum_timeout, run.device);
  } else if (flags.algorithm == "diloco") {
    diloco_ = std::make_unique<DiLoCo>(run.world.get(), model, flags);
  } else if (compression == Compression::None) {
    ddp_ = std::make_unique<DDP>(*run.world, model, ddp_flags.bucket_mb, /*overlap=*/!ddp_flags.no_overlap);
    ddp_->set_trace(run.trace.get());  // the buckets' all-reduces on the communication lane, as in 02
  } else {
    compressed_ =
        std::make_unique<CompressedAverage>(*run.world, compression, model.grads.size(), !flags.no_error_feedback,
                                            run.device);
  }
}

void LinkSync::print_plan() const {
  const double model_mb = static_cast<double>(model_.params.bytes()) / 1e6;
  const char* feedback = flags_.no_error_feedback ? " without error feedback" : "";
  if (diloco_) {
    std::printf("diloco: %d inner %s steps per worker, then the outer step (Nesterov, lr %.2g, momentum %.2g) on "
                "the workers' average pseudo-gradient, sent %s%s\n",
                flags_.inner_steps, flags_.inner_optimizer.c_str(), flags_.outer_lr, flags_.outer_momentum,
                flags_.compression == "none" ? "in fp32" : flags_.compression.c_str(), feedback);
    if (flags_.fragments > 1) {
      std::printf("streaming: %d fragments of about %.2f MB, synced on staggered steps, each arriving %d step(s) "
                  "after it leaves\n",
                  flags_.fragments, model_mb / flags_.fragments, flags_.overlap_steps);
    }
  } else {
    std::printf("ddp: every step the workers' gradients averaged (%.2f MB of them), sent %s%s\n", model_mb,
                flags_.compression == "none" ? "in fp32, chapter 02's buckets" : flags_.compression.c_str(), feedback);
  }
  std::printf("workers: %d, over %s; the loss on each step's line is worker 0's, on its slice\n", run_.ranks,
              fault_tolerant_ ? "a tcp group of the live workers at each outer step (fault tolerant)"
                              : run_.backend().c_str());
}

int LinkSync::resume() {
  // a fault-tolerant worker the launcher restarted: the others' global weights, not a file
  if (fault_tolerant_ && read_launch_env().restart_count > 0) {
    return fault_tolerant_->join(*diloco_, model_.params.data()) + 1;
  }
  const int next_step = resume_worker_state(run_.options, run_.ranks, run_.rank, run_.device, state_sections(),
                                            state_meta());
  return next_step == 1 && !flags_.init_from.empty() ? start_from_checkpoint() : next_step;
}

void LinkSync::save(int step) {
  save_worker_state(run_.options, step, run_.ranks, run_.rank, run_.device, state_sections(), state_meta());
}

std::function<void(int)> LinkSync::backward_hook(bool last_micro_batch) {
  return ddp_ ? ddp_->backward_hook(last_micro_batch) : nullptr;
}

void LinkSync::average_gradients(StepMeters& meters) {
  steps_run_++;
  if (ddp_) meters.record_exposed(ddp_->synchronize_gradients().exposed_seconds);
  if (compressed_) {
    const double start = now_seconds();
    compressed_->average(model_.grads.data());  // in the step: all of it exposed
    meters.record_exposed(now_seconds() - start);
  }
}

void LinkSync::after_update(int step) {
  // fault tolerant: an outer step after the last step too, so that the run ends on one
  // model held by the workers alive then (who else would the end's checks ask?)
  const bool last = step == run_.options.steps;
  if (fault_tolerant_ && (step % flags_.inner_steps == 0 || last)) {
    const int outer = (step + flags_.inner_steps - 1) / flags_.inner_steps;
    if (!fault_tolerant_->sync(*diloco_, model_.params.data(), step, outer, last)) {
      throw CommError("worker " + std::to_string(run_.rank) + " was left out of outer step " + std::to_string(outer) +
                      " (later than --quorum-timeout): exiting, so that the launcher restarts it with the global " +
                      "weights (hint: --restart-policy worker)");
    }
  } else if (diloco_ && !fault_tolerant_) {
    // drained before a checkpoint (which holds no messages on their way) and after the
    // last step: the final outer model then has every average the workers sent
    diloco_->after_inner_step(model_.params.data(), step, /*drain=*/checkpoint_due(run_.options, step) || last);
  }
  sent_by_steps_ = traffic();
}

JsonLine LinkSync::finish(RowSlice rows) {
  // DiLoCo's model is the outer one: the workers' own weights have moved on since it
  if (diloco_) {
    copy_bytes(model_.params.data(), run_.device, diloco_->global.data(), run_.device, model_.params.bytes());
  }
  // the end's checks: the models agree, and the eval loss averaged over the workers
  // (fault tolerant: over those alive now, whoever dies in them left out)
  const float my_eval_loss = eval_loss(rows);
  const auto agree_and_average = [&](Comm& workers) {
    check_copies_agree(workers, model_.params.data(), model_.params.size(), run_.device, "the workers' models");
    float mean = my_eval_loss;
    workers.all_reduce(&mean, 1, ReduceOp::Average);
    final_eval_loss_ = mean;
  };
  if (fault_tolerant_) {
    fault_tolerant_->finish(agree_and_average);
  } else {
    agree_and_average(*run_.world);
  }
  JsonLine fields = JsonLine()
                        .add("algorithm", flags_.algorithm)
                        .add("inner_optimizer", flags_.inner_optimizer)
                        .add("inner_steps", diloco_ ? flags_.inner_steps : 1)
                        .add("fragments", flags_.fragments)
                        .add("compression", flags_.compression)
                        .add("outer_syncs", diloco_ ? diloco_->syncs() : 0)
                        .add("sync_bytes_sent", static_cast<double>(sent_by_steps_.bytes_sent));
  // (a fault-tolerant run's groups change size as workers come and go: no one formula)
  if (!fault_tolerant_) fields.add("sync_bytes_formula", static_cast<double>(formula_bytes_sent()));
  return fields.add("eval_loss", final_eval_loss_);
}

void LinkSync::print_conclusion() const {
  std::printf("eval loss %.4f: the final model%s on 16 batches no step trained on\n", final_eval_loss_,
              diloco_ ? " (the outer one)" : "");
  std::printf("the averages sent %s per worker", format_bytes(static_cast<double>(sent_by_steps_.bytes_sent)).c_str());
  if (!fault_tolerant_) {
    std::printf(" (formula %s)", format_bytes(static_cast<double>(formula_bytes_sent())).c_str());
  }
  if (diloco_) std::printf(" in %d fragment syncs", diloco_->syncs());
  std::printf("\n");
}

float LinkSync::eval_loss(RowSlice rows) {
  constexpr int kEvalBatches = 16, kFirstEvalStep = 1000000;
  const int micro_batches = run_.options.micro_batches, micro_batch = rows.rows / micro_batches;
  std::vector<int> tokens(static_cast<size_t>(micro_batch) * run_.options.model.seq_len);  // (micro_batch, T)
  std::vector<int> targets(tokens.size());                                                 // (micro_batch, T)
  StepLoss loss_sum(kEvalBatches * micro_batches, run_.device);
  for (int batch = 1; batch <= kEvalBatches; batch++) {
    for (int micro = 0; micro < micro_batches; micro++) {
      run_.sampler->fill(kFirstEvalStep + batch, rows.first_row + micro * micro_batch, micro_batch, tokens.data(),
                         targets.data());
      model_.forward(tokens.data(), targets.data(), loss_sum);
    }
  }
  return loss_sum.read();
}

OpStats LinkSync::traffic() const {
  if (fault_tolerant_) return fault_tolerant_->traffic();
  // everything on the link but the checkpoints' barriers
  const std::map<std::string, OpStats> by_operation = run_.world->stats();
  const auto barriers = by_operation.find("barrier");
  return run_.world->total_stats() - (barriers == by_operation.end() ? OpStats() : barriers->second);
}

uint64_t LinkSync::formula_bytes_sent() const {
  if (diloco_) return diloco_->formula_bytes_sent();
  if (compressed_) return compressed_->formula_bytes() * steps_run_;
  uint64_t per_step = 0;  // DDP's buckets, each a ring all-reduce
  for (const GradBucket& bucket : ddp_->buckets()) {
    per_step += ring_all_reduce_bytes((bucket.end - bucket.begin) * sizeof(float), run_.ranks);
  }
  return per_step * steps_run_;
}

int LinkSync::start_from_checkpoint() {
  const CheckpointReader reader(flags_.init_from);
  check_model_meta(reader, run_.options.model, flags_.init_from);
  reader.read_section("params", model_.params.data(), model_.params.size(), run_.device);
  const int step = static_cast<int>(reader.meta("step"));
  if (step >= run_.options.steps) {
    throw FlagError("--init-from " + flags_.init_from + " is at step " + std::to_string(step) + " of --steps " +
                    std::to_string(run_.options.steps) + ": nothing to train (hint: raise --steps)");
  }
  if (diloco_) diloco_->start_from(model_.params.data());
  if (run_.is_rank0()) {
    std::printf("started from %s: its weights at step %d, fresh optimizer state: continuing at step %d\n",
                flags_.init_from.c_str(), step, step + 1);
  }
  return step + 1;
}

std::vector<StateSection> LinkSync::state_sections() {
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
    const std::pair<const char*, ErrorFeedback*> residuals[] = {{"residual_", &averages[i]->worker_feedback()},
                                                                {"owner_residual_", &averages[i]->owner_feedback()}};
    for (const auto& [name, feedback] : residuals) {
      Buffer& residual = feedback->residual();
      if (residual.size() > 0) sections.push_back({name + std::to_string(i), residual.data(), residual.size()});
    }
  }
  return sections;
}

std::vector<std::pair<std::string, int>> LinkSync::state_meta() const {
  return {{"diloco", diloco_ ? 1 : 0},
          {"inner_steps", flags_.inner_steps},
          {"fragments", flags_.fragments},
          {"compression", static_cast<int>(parse_compression(flags_.compression))},
          {"error_feedback", flags_.no_error_feedback ? 0 : 1},
          {"inner_adamw", adamw_ ? 1 : 0}};
}

}  // namespace course
