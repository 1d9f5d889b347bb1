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
//   forward,  s = 0 .. L+1:   all-gather stage s (stage s+1's gather already started),
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
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "03_fsdp/zero.h"
#include "common/adamw.h"
#include "common/cli.h"
#include "common/comm/comm.h"
#include "common/memory.h"
#include "common/model.h"

namespace course {

class FSDP {
 public:
  // Builds this rank's shards of the model chapter 00 builds from `seed` (the same
  // values: init_stage_slice depends only on the seed, the name and the index).
  // reshard_after_forward = false keeps every gathered stage from forward for
  // backward: one all-gather per stage and step instead of two, for P floats of
  // comm buffers.
  FSDP(Comm& comm, const GPTConfig& config, int micro_batch, uint64_t seed, bool reshard_after_forward,
       const AdamWConfig& adamw);

  void zero_grad() { grads_.zero(); }
  // Mean cross-entropy over the micro_batch x T positions, gathering each stage in turn.
  float forward(const int* tokens, const int* targets);  // (B, T), (B, T)
  // This rank's gradient shards += the rank-averaged gradient of dloss x (sum of
  // per-position losses), stage by stage in reverse.
  void backward(float dloss);
  // As ZeRO::clip_gradients: the global norm from every rank's sum of squares.
  void clip_gradients(float max_norm);
  // AdamW on this rank's shards. Nothing is gathered: forward gathers what it needs.
  void step(int step);

  // Each rank writes its shards (stage order) and their moments, zero_stage 3.
  void save(const TrainOptions& options, int step) const;
  // With --resume: loads this rank's shards; returns the step to continue at.
  int resume_if_asked(const TrainOptions& options, bool verbose);

  const std::vector<StageLayout>& stages() const { return stages_; }
  const std::vector<ShardLayout>& shards() const { return shards_; }
  size_t local_floats() const { return params_.size(); }

 private:
  // Starts the all-gather of stage s into a fresh comm buffer, unless it is
  // already gathered (kept from forward) or on its way.
  void start_gather(int s);
  // Stage s's whole parameters: (n_s), once its all-gather has finished.
  float* gathered(int s);
  void release(int s) { gathered_[s] = Buffer(); }
  float* shard(Buffer& buffer, int s) { return buffer.data() + local_offset_[s]; }

  Comm& comm_;
  GPTConfig config_;
  int micro_batch_;
  bool reshard_after_forward_;
  std::vector<StageLayout> stages_;   // embedding, block 0 .. L-1, head
  std::vector<ShardLayout> shards_;   // shards_[s]: how stage s is cut over the ranks
  std::vector<size_t> local_offset_;  // [s]: where this rank's shard of stage s starts in params_ and grads_;
                                      // the last entry (one past the head): their size
  Buffer params_;                     // (sum over s of this rank's count)  the only parameters a rank keeps
  Buffer grads_;                      // (same)  their averaged gradients
  AdamW optimizer_;                   // moments for params_ only
  std::vector<Buffer> gathered_;      // gathered_[s]: (n_s) while stage s is gathered, empty otherwise
  std::vector<Work> gathering_;       // gathering_[s]: stage s's all-gather while in flight

  // as GPT's: one micro-batch's activations, and backward's scratch
  EmbeddingActivations embedding_acts_;
  std::vector<BlockActivations> block_acts_;
  HeadActivations head_acts_;
  BackwardScratch scratch_;
  Buffer residual_grad_;               // (2, B, T, C)  dL/d(residual stream), ping-pong between blocks
  std::vector<int> tokens_, targets_;  // (B, T) copies kept for backward
};

}  // namespace course
