// ZeRO stage 3 (FSDP): the parameters are sharded too.
//
// Stages 1 and 2 still keep the whole model on every rank. Stage 3 keeps only a
// shard of it: every stage of the model (embedding, each block, head; model.h)
// has its own flat buffer, and each one is cut into N contiguous shards:
//
//   stage s (n_s floats, S_s = ceil(n_s/N) per shard, the last one shorter):
//     [ shard 0 | shard 1 | shard 2 | shard 3 ]
//       rank 0    rank 1    rank 2    rank 3
//
//   rank r keeps: its shard of every stage, in stage order     (parameters, ~4P/N bytes)
//                 the averaged gradient of those shards         (gradients,  ~4P/N bytes)
//                 AdamW's m and v for them                      (optimizer,  ~8P/N bytes)
//
// A stage's whole parameters exist only while it computes:
//
//   forward,  s = 0 .. L+1:   all-gather stage s (stage s+1's gather already started: prefetch),
//                             run it, free it (unless --no-reshard-after-forward)
//   backward, s = L+1 .. 0:   all-gather stage s again (unless kept; s-1's started),
//                             run its backward into a full-size gradient buffer,
//                             reduce-scatter (average) it: this rank gets its shard,
//                             free both buffers
//   step:                     AdamW on this rank's shards; nothing to gather after it
//
// Per stage rather than one cut of the whole flat buffer: a stage is the unit that
// is gathered, so each rank must hold a piece of every stage, and the gathered
// buffer is exactly what the stage functions take views into.
//
// ZeRO stage 2 runs the same stage loop with the parameters replicated: every rank
// keeps the whole flat parameter buffer (chapter 00's layout), and a stage's
// weights are a view into it instead of a gathered buffer. Only the gradients are
// sharded, and the cut is stage 1's, one contiguous shard of the flat buffer per
// rank (zero.h): shards_[s] is then that cut restricted to stage s (a rank's piece
// of a stage may be empty). Backward still reduce-scatters each stage's gradient
// right after computing it, so no rank ever holds more than one stage's full
// gradient plus its own shard (4S bytes); step updates the rank's shard and
// all-gathers the flat buffer, as ZeRO stage 1 does.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "03_fsdp/gathered_stage.h"
#include "03_fsdp/zero.h"
#include "common/model/adamw.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/tensor/memory.h"
#include "common/model/model.h"
#include "common/model/step_loss.h"
#include "common/model/tokens.h"
#include "common/train/trace.h"

namespace course {

class FSDP {
 public:
  // Builds this rank's shards of the model chapter 00 builds from `seed` (the same
  // values: init_stage_slice depends only on the seed, the name and the index).
  // reshard_after_forward = false keeps every gathered stage from forward for
  // backward: one all-gather per stage and step instead of two, for P floats of
  // comm buffers. prefetch = false starts each stage's all-gather only when the
  // stage is about to run (one stage's buffer less, nothing overlapped).
  // zero_stage: 3 (parameters sharded per stage) or 2 (parameters replicated,
  // gradients and AdamW state sharded as one cut of the flat buffer). Every buffer,
  // the gathered stages and the activations included, is on `device`.
  // grad_comm_dtype bf16: each stage's reduce-scatter moves a bf16 copy of its gradients
  // (2 bytes a value of the largest stage, in comm buffers), widened back into fp32.
  // param_gather_dtype bf16: the parameters' all-gathers move bf16 (stage 3:
  // GatheredStage; stage 2: ReplicatedParams).
  FSDP(Comm& comm, const GPTConfig& config, int micro_batch, uint64_t seed, int zero_stage,
       bool reshard_after_forward, bool prefetch, const AdamWConfig& adamw, Device device,
       DType grad_comm_dtype = DType::F32, DType param_gather_dtype = DType::F32);

  void zero_grad() { grads_.zero(); }
  // loss += the mean cross-entropy over the micro_batch x T positions, gathering each
  // stage in turn (on the device: nothing waits for it).
  void forward(const int* tokens, const int* targets, StepLoss& loss);  // (B, T), (B, T)  on the host
  // This rank's gradient shards += the rank-averaged gradient of dloss x (sum of
  // per-position losses), stage by stage in reverse.
  void backward(float dloss);
  // As ZeRO's: the squared global norm from every rank's sum of squares (collective),
  // and this rank's shards scaled when the norm is above max_norm.
  double grad_norm_squared();
  void clip_gradients(double norm, float max_norm);
  // AdamW on this rank's shards. Stage 3 gathers nothing: forward gathers what it
  // needs. Stage 2 all-gathers the updated shards: every rank the whole model again.
  void step(int step);

  // Each rank writes its shards (stage order) and their moments, at its zero_stage
  // (stage 2's file is stage 1's: the rank's shard of the flat buffer).
  void save(const TrainOptions& options, int step) const;
  // With --resume or after a restart (resume_wanted): loads this rank's shards (at stage 2, then gathers the whole
  // model); returns the step to continue at.
  int resume_if_asked(const TrainOptions& options, bool verbose);

  // --trace: each stage's forward and backward on the compute lane, its all-gathers
  // and reduce-scatter on the communication lane (drawn when they ran, so a prefetch
  // shows under the stage before). The trainer traces the optimizer step. nullptr: none.
  void set_trace(Trace* trace) { trace_ = trace; }

  const std::vector<StageLayout>& stages() const { return stages_; }
  const std::vector<ShardLayout>& shards() const { return shards_; }
  size_t local_floats() const { return local_offset_.back(); }
  // stage 2: (P)  every rank's whole copy of the parameters
  const Buffer& replicated_params() const { return params_; }

 private:
  // Starts the all-gather of stage s into a fresh comm buffer, unless it is
  // already gathered (kept from forward) or on its way (stage 2: nothing to gather).
  void start_gather(int s);
  // Stage s's whole parameters: (n_s), once its all-gather has finished (stage 2:
  // its place in the replicated flat buffer).
  float* gathered(int s);
  void release(int s);
  float* shard(Buffer& buffer, int s) { return buffer.data() + local_offset_[s]; }
  // (this rank's count)  the fp32 values this rank updates and checkpoints, in stage
  // order: all of params_ at stage 3, its values of the flat buffer at stage 2
  float* owned_params() { return replicated_ ? replica_->owned() : params_.data(); }

  Comm& comm_;
  GPTConfig config_;
  int micro_batch_;
  int zero_stage_;
  bool replicated_;                   // stage 2: every rank keeps all the parameters
  bool reshard_after_forward_;
  bool prefetch_;                     // start stage s+1's gather (s-1's in backward) before stage s runs
  Device device_;                     // where every buffer below is, and the ops that read them run
  std::vector<StageLayout> stages_;   // embedding, block 0 .. L-1, head
  std::vector<size_t> stage_offset_;  // [s]: where stage s starts in the flat buffer (chapter 00's layout)
  ShardLayout flat_;                  // stage 2: the cut of the whole flat buffer (zero.h)
  std::vector<ShardLayout> shards_;   // shards_[s]: how stage s is cut over the ranks
  std::vector<size_t> local_offset_;  // [s]: where this rank's shard of stage s starts in grads_ (and, at
                                      // stage 3, params_); the last entry (one past the head): their size
  Buffer params_;                     // stage 3: (sum over s of this rank's count)  the only parameters a rank
                                      // keeps; stage 2: (P)  the whole flat buffer
  Buffer grads_;                      // (same)  their averaged gradients
  AdamW optimizer_;                   // moments for params_ only
  std::optional<ReplicatedParams> replica_;  // stage 2: params_ as every rank's copy, updated shard by shard
  std::vector<GatheredStage> gathered_;  // stage 3: [s]: stage s, gathered from the shards while it is needed
  Trace* trace_ = nullptr;
  DType grad_comm_dtype_;
  TypedBuffer<bf16> stage_grads_bf16_;  // (the largest stage)  bf16: a stage's gradients as they travel

  // as GPT's: one micro-batch's activations, and backward's scratch
  EmbeddingActivations embedding_acts_;
  std::vector<BlockActivations> block_acts_;  // what each block keeps (config.recompute)
  RecomputeWorkspace recompute_;              // what they do not, for the block at hand
  HeadActivations head_acts_;
  BackwardScratch scratch_;
  Buffer residual_grad_;  // (2, B, T, C)  dL/d(residual stream), ping-pong between blocks
  MicroBatchTokens tokens_;  // the micro-batch's tokens and targets, kept for backward
};

}  // namespace course
