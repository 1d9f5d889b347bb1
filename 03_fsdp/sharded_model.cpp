#include "03_fsdp/sharded_model.h"

#include <cstdio>

#include "common/tensor/error.h"
#include "common/train/meters.h"
#include "common/train/trainer_parts.h"

namespace course {

void add_zero_flags(ArgParser& parser, ZeroFlags& zero) {
  parser.add_int("--zero-stage", &zero.stage, 1,
                 "1: shard the AdamW state; 2: also reduce-scatter the gradients; 3 (FSDP): also shard the "
                 "parameters, all-gathered stage by stage in forward and again in backward");
  parser.add_switch("--no-reshard-after-forward", &zero.no_reshard_after_forward,
                    "stage 3: keep each stage gathered from forward to backward (one all-gather per stage "
                    "and step instead of two, for P floats of comm buffers)");
  parser.add_dtype("--grad-comm-dtype", &zero.grad_comm_dtype,
                   "what the gradients' all-reduce (stage 1) or reduce-scatters (2, 3) move: bf16 = half the bytes");
  parser.add_switch("--no-prefetch", &zero.no_prefetch,
                    "stage 3: start each stage's all-gather only when the stage needs it, instead of while the "
                    "stage before it computes (to measure what prefetching saves)");
}

void check_zero_flags(const ZeroFlags& zero) {
  if (zero.stage < 1 || zero.stage > 3) {
    throw FlagError("--zero-stage must be 1 (shard the optimizer state), 2 (and the gradients) or 3 (and the "
                    "parameters), got " + std::to_string(zero.stage));
  }
  if (zero.no_reshard_after_forward && zero.stage != 3) {
    throw FlagError("--no-reshard-after-forward needs --zero-stage 3 (only stage 3 shards the parameters), got "
                    "--zero-stage " + std::to_string(zero.stage));
  }
  if (zero.no_prefetch && zero.stage != 3) {
    throw FlagError("--no-prefetch needs --zero-stage 3 (only stage 3 gathers parameters before a stage runs), got "
                    "--zero-stage " + std::to_string(zero.stage));
  }
}

ShardedModel::ShardedModel(Comm& comm, const GPTConfig& config, int micro_batch, uint64_t seed,
                           const ZeroFlags& zero, const AdamWConfig& adamw, Device device,
                           DType param_gather_dtype)
    : comm_(comm), zero_(zero), param_gather_dtype_(param_gather_dtype) {
  if (zero.stage == 1) {
    gpt_ = std::make_unique<GPT>(config, micro_batch, seed, device);
    sharded_optimizer_ = std::make_unique<ZeRO>(comm, *gpt_, adamw, zero.grad_comm_dtype, param_gather_dtype);
  } else {
    fsdp_ = std::make_unique<FSDP>(comm, config, micro_batch, seed, zero.stage, !zero.no_reshard_after_forward,
                                   !zero.no_prefetch, adamw, device, zero.grad_comm_dtype, param_gather_dtype);
  }
}

void ShardedModel::zero_grad() {
  if (fsdp_) {
    fsdp_->zero_grad();
  } else {
    gpt_->zero_grad();
  }
}

void ShardedModel::forward(const int* tokens, const int* targets, StepLoss& loss) {
  if (fsdp_) {
    fsdp_->forward(tokens, targets, loss);
  } else {
    gpt_->forward(tokens, targets, loss);
  }
}

void ShardedModel::backward(float dloss) {
  if (fsdp_) {
    fsdp_->backward(dloss);
  } else {
    gpt_->backward(dloss);
  }
}

void ShardedModel::reduce_gradients() {
  if (sharded_optimizer_) sharded_optimizer_->reduce_gradients();
}

double ShardedModel::grad_norm_squared() {
  return fsdp_ ? fsdp_->grad_norm_squared() : sharded_optimizer_->grad_norm_squared();
}

void ShardedModel::clip_gradients(double norm, float max_norm) {
  if (fsdp_) {
    fsdp_->clip_gradients(norm, max_norm);
  } else {
    sharded_optimizer_->clip_gradients(norm, max_norm);
  }
}

void ShardedModel::step(int step) {
  if (fsdp_) {
    fsdp_->step(step);
  } else {
    sharded_optimizer_->step(step);
  }
}

void ShardedModel::save(const TrainOptions& options, int step) const {
  if (fsdp_) {
    fsdp_->save(options, step);
  } else {
    sharded_optimizer_->save(options, step);
  }
}

int ShardedModel::resume_if_asked(const TrainOptions& options, bool verbose) {
  // each rank reads its own shard; at stages 1 and 2 the shards are then gathered into every replica
  return fsdp_ ? fsdp_->resume_if_asked(options, verbose) : sharded_optimizer_->resume_if_asked(options, verbose);
}

void ShardedModel::set_trace(Trace* trace) {
  if (fsdp_) {
    fsdp_->set_trace(trace);
  } else {
    sharded_optimizer_->set_trace(trace);
  }
}

void ShardedModel::print_layout(const std::string& backend) const {
  const int ranks = comm_.size();
  if (zero_.stage == 3) {
    std::printf("zero: stage 3, each of %zu model stages cut in %d shard(s): %zu parameters on rank 0\n",
                fsdp_->stages().size(), ranks, shard_floats());
    std::printf("zero: gathered stages %s after forward, %s, backend %s\n",
                zero_.no_reshard_after_forward ? "kept" : "resharded",
                zero_.no_prefetch ? "each gathered when needed" : "the next stage prefetched", backend.c_str());
  } else {
    std::printf("zero: stage %d, %d shard(s) of %zu parameters, gradients %s, backend %s\n", zero_.stage, ranks,
                shard_floats(), zero_.stage == 1 ? "all-reduced" : "reduce-scattered", backend.c_str());
  }
  // what the step lines' grad and param bytes are, and in which precision when it is not fp32
  const auto in_bf16 = [](DType type) { return type == DType::BF16 ? ", in bf16" : ""; };
  std::printf("zero: sent = grad (the gradients' %s%s) + param (the parameters' all-gather%s%s)\n",
              zero_.stage == 1 ? "all-reduce" : "reduce-scatter", in_bf16(zero_.grad_comm_dtype),
              zero_.stage == 3 ? "s" : "", in_bf16(param_gather_dtype_));
  // so the communication time is not what the step waited for
  if (prefetches()) std::printf("zero: the communication time includes the prefetches, which overlap compute\n");
}


// FSDP's collectives are the only reduce-scatters and all-gathers during a step (the
// loss's and the clipping's all-reduces are neither), so their kinds' counters are
// its traffic. Stage 1's all-reduce is not told apart that way: ZeRO counts its own.
OpStats ShardedModel::gradient_stats() const {
  return fsdp_ ? op_stats(comm_, "reduce_scatter") : sharded_optimizer_->gradient_stats();
}

OpStats ShardedModel::parameter_stats() const {
  return fsdp_ ? op_stats(comm_, "all_gather") : sharded_optimizer_->parameter_stats();
}

void ShardedModel::check_replicas_agree() const {
  if (zero_.stage == 3) return;  // each rank holds only its shards: no copies to compare
  const Buffer& params = fsdp_ ? fsdp_->replicated_params() : gpt_->params;
  check_copies_agree(comm_, params.data(), params.size(), params.device(), "the gathered parameters");
}

size_t ShardedModel::shard_floats() const {
  return fsdp_ ? fsdp_->local_floats() : sharded_optimizer_->layout().shard_floats;
}

JsonLine ShardedModel::summary_fields() const {
  return JsonLine()
      .add("zero_stage", zero_.stage)
      .add("shard_floats", shard_floats())
      .add("prefetch", prefetches() ? 1 : 0);
}

}  // namespace course
