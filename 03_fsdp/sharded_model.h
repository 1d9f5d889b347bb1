// ZeRO at the stage the trainer picks (--zero-stage), driven as chapter 02's
// trainer drives its model: zero_grad, forward and backward per micro-batch, then
// the gradients made whole, the clipping and the update. One object holds the
// model, its sharded optimizer and the collectives between them:
//
//   stage 1   chapter 00's GPT, whole on every rank; class ZeRO (zero.h) shards its
//             AdamW state, all-reduces the gradients after backward and all-gathers
//             the updated shards after the step
//   stage 2   class FSDP's stage loop (fsdp.h) with the parameters replicated: each
//             model stage's gradient reduce-scattered as soon as backward has it, the
//             updated shards all-gathered after the step
//   stage 3   class FSDP with the parameters sharded too: each model stage gathered
//             just before it runs, in forward and again in backward
//
// It also says what its collectives sent, by what they carried (gradients or
// parameters): the two axes of the chapter's meters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "03_fsdp/fsdp.h"
#include "03_fsdp/zero.h"
#include "common/model/adamw.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/train/metrics.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "common/train/trace.h"

namespace course {

// The chapter's own flags.
struct ZeroFlags {
  int stage = 3;                          // --zero-stage: 1, 2 or 3 (what is sharded: above)
  bool no_reshard_after_forward = false;  // --no-reshard-after-forward: stage 3 keeps each gathered
                                          // model stage from forward for backward
  bool no_prefetch = false;               // --no-prefetch: stage 3 gathers a model stage only when it runs
  DType grad_comm_dtype = DType::F32;     // --grad-comm-dtype: what the gradients travel as (bf16: half the
                                          // bytes, through a bf16 copy, added in fp32; chapter 02's idea)
};
// Registers --zero-stage, --no-reshard-after-forward, --no-prefetch and --grad-comm-dtype on `parser`.
void add_zero_flags(ArgParser& parser, ZeroFlags& zero);
// After parsing: throws FlagError for a stage other than 1, 2 or 3, and for a
// stage-3 switch at another stage.
void check_zero_flags(const ZeroFlags& zero);

class ShardedModel {
 public:
  // This rank's part of the model chapter 00 builds from `seed`, at zero.stage, with
  // every buffer (parameters, gradients, moments, activations, gathered stages) on `device`.
  // param_gather_dtype: what the parameters' all-gathers move (bf16 under --dtype bf16:
  // every rank then computes with bf16 values of the weights, whose fp32 values stay
  // in the shards; zero.h's ReplicatedParams, gathered_stage.h).
  ShardedModel(Comm& comm, const GPTConfig& config, int micro_batch, uint64_t seed, const ZeroFlags& zero,
               const AdamWConfig& adamw, Device device, DType param_gather_dtype);

  void zero_grad();
  // loss += the mean cross-entropy over the micro_batch x T positions, on the device
  // (stage 3: each model stage gathered in turn).
  void forward(const int* tokens, const int* targets, StepLoss& loss);  // (B, T), (B, T)  on the host
  // The gradient of dloss x (sum of per-position losses), added up over micro-batches:
  // at stage 1 into the whole gradient buffer; at stages 2 and 3 each model stage's is
  // reduce-scattered as soon as it is computed, and this rank keeps its shard's average.
  void backward(float dloss);
  // Stage 1: all-reduces (averages) the whole gradient buffer. Stages 2 and 3 did
  // their part in backward: nothing is left to send.
  void reduce_gradients();
  // The squared norm of the whole averaged gradient from every rank's shard: each
  // rank's sum of squares, all-reduced (collective). clip_gradients scales this
  // rank's shard so the norm is at most max_norm.
  double grad_norm_squared();
  void clip_gradients(double norm, float max_norm);
  // AdamW on this rank's shard; at stages 1 and 2 an all-gather of the updated shards
  // then gives every rank the whole new model (stage 3's forward gathers what it needs).
  void step(int step);

  // Every rank writes its shard and its moments, rank 0 the manifest (zero.h).
  void save(const TrainOptions& options, int step) const;
  // With --resume or after a restart: loads this rank's shard from the newest complete
  // checkpoint (at any world size and stage); returns the step to continue at.
  int resume_if_asked(const TrainOptions& options, bool verbose);

  // --trace: the collectives on the communication lane (and at stages 2 and 3 each
  // model stage's forward and backward on the compute lane).
  void set_trace(Trace* trace);
  // rank 0, after the run header: how the model is cut, what is gathered when, and
  // which collectives the step lines' two figures, grad and param, count
  void print_layout(const std::string& backend) const;
  // What this rank has sent so far: the gradients' all-reduce or reduce-scatters, and
  // the parameters' all-gathers. Read between steps, when nothing is in flight.
  OpStats gradient_stats() const;
  OpStats parameter_stats() const;

  // After training, on every rank: at stages 1 and 2 every rank's whole copy of the
  // parameters must be the same (stage 3 has no copies: each rank holds only its shards).
  void check_replicas_agree() const;
  // The chapter's summary fields: zero_stage; shard_floats, rank 0's share of the
  // parameters, the largest (S = ceil(P/N) of the flat buffer at stages 1 and 2,
  // ceil(n_s/N) of every model stage s at stage 3); prefetch (1 or 0).
  JsonLine summary_fields() const;

 private:
  // rank 0's share of the parameters (summary_fields)
  size_t shard_floats() const;
  bool prefetches() const { return zero_.stage == 3 && !zero_.no_prefetch; }

  Comm& comm_;
  const ZeroFlags zero_;
  DType param_gather_dtype_;  // what the parameters' all-gathers move
  std::unique_ptr<GPT> gpt_;                 // stage 1: the whole model on every rank
  std::unique_ptr<ZeRO> sharded_optimizer_;  // stage 1: its AdamW state, sharded
  std::unique_ptr<FSDP> fsdp_;               // stages 2 and 3: this rank's shards, and the stage loop
};

}  // namespace course
