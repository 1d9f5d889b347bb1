// Cutting the model by layers: which rank owns which stages, and the part of the
// model one rank holds.
//
// The model is a list of stages (common/model/model.h): 0 = embedding, 1..L = blocks,
// L+1 = head. A model-parallel rank owns a contiguous range of them; its
// parameters are exactly chapter 00's flat buffer between the range's first and
// last stage (the layout-independent initialisation makes them without building
// the rest). Chapter 05 links this library and gives each rank several parts.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/model/adamw.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/tensor/memory.h"
#include "common/train/meters.h"
#include "common/model/model.h"
#include "common/train/rank_table.h"
#include "common/model/step_loss.h"
#include "common/model/tokens.h"
#include "common/train/trainer.h"
#include "common/train/trace.h"

namespace course {

// Model stages [first, last], inclusive, in model_layout's numbering.
struct StageRange {
  int first = 0;
  int last = 0;
};

// Cuts the L blocks into `parts` contiguous groups as equal as possible: the first
// L % parts groups get one block more (the head's vocabulary projection makes the
// last part the heaviest already, so it gets the smaller share). The embedding goes
// with the first group, the head with the last. UsageError when parts > L.
std::vector<StageRange> split_stages(const GPTConfig& config, int parts);

// "embedding + blocks 0-1" / "blocks 2-3 + head": for run headers.
std::string describe_stages(const GPTConfig& config, StageRange range);

// Where every rank sits on the cut: its parts (chapter 04: one per rank; chapter
// 05: one per chunk), as the checkpoint manifest lists them and the tables name them.
struct StageCut {
  StageCut(const GPTConfig& config, std::vector<std::vector<StageRange>> every_rank);
  // rank 0, under the run header: "model parallel: 2 ranks, micro-batches of 4
  // sequence(s), backend tcp", then one line per rank, "  rank 1: blocks 2-3 + head"
  void print(const std::string& backend, int micro_batch) const;
  void print_ranks() const;

  std::vector<std::vector<StageRange>> every_rank;  // [r][c]: rank r's part c, in its checkpoint file's order
  std::vector<std::string> labels;                  // [r]: rank r's parts described, "; " between them
  int head_rank = 0;                                // the rank with the head: the only one that has the loss

  // The loss of a step, for the report: it exists only on the rank with the head,
  // which broadcasts it.
  float report_loss(Comm& world, float loss) const;
};
// Chapter 04's cut: split_stages into one part per rank, --pp `pp` checked against
// the run's ranks (whole_world_degree).
StageCut one_part_per_rank(const Run& run, int pp);

// What one micro-batch leaves in a part between its forward and its backward, on
// the part's device.
struct PartActivations {
  PartActivations(const GPTConfig& config, StageRange range, int micro_batch, Device device);
  // floats of Activations memory one micro-batch costs a part (the formula the
  // chapters' READMEs and tests use)
  static size_t floats(const GPTConfig& config, StageRange range, int micro_batch);

  // the sampler fills them; the embedding reads the tokens (first part), the loss the
  // targets (last part); ModelPart::forward uploads them (no device memory on a part
  // with neither)
  MicroBatchTokens batch;
  Device device;  // where every buffer below lives
  Buffer input;         // (B, T, C)  the previous part's output, received (empty on the first part)
  std::vector<EmbeddingActivations> embedding;  // one on the first part, none elsewhere
  std::vector<BlockActivations> blocks;         // one per block of the part, kept as config.recompute says
  std::vector<HeadActivations> head;            // one on the last part, none elsewhere
};

// Scratch for backward, shared by all the parts of one rank (only one forward or
// backward runs at a time): one block's gradients, the residual stream's ping-pong
// pair, and what the blocks do not keep under --recompute, on the parts' device.
struct BackwardWorkspace {
  BackwardWorkspace(const GPTConfig& config, int micro_batch, Device device);
  BackwardScratch scratch;
  Buffer residual_grad;          // (2, B, T, C)
  RecomputeWorkspace recompute;  // forward writes there too (common/model/model.h)
};

class ModelPart {
 public:
  // Parameters, gradients and everything the part computes live on `device`.
  ModelPart(const GPTConfig& config, StageRange range, int micro_batch, uint64_t seed, Device device);

  const GPTConfig& config() const { return config_; }
  StageRange range() const { return range_; }
  Device device() const { return device_; }
  bool has_embedding() const { return range_.first == 0; }
  bool has_head() const { return range_.last == config_.n_layer + 1; }
  // where this part's parameters start in chapter 00's flat buffer
  size_t global_offset() const { return global_offset_; }
  size_t activation_floats() const;  // (B, T, C): what crosses to the next part, and back

  // Forward of one micro-batch: from acts.batch (first part) or acts.input, through
  // the part's stages. The last part adds the micro-batch's mean loss to `loss`.
  // What the blocks do not keep under --recompute goes to work.recompute.
  void forward(PartActivations& acts, StepLoss& loss, BackwardWorkspace& work);
  // (B, T, C): the part's output, which the next part takes as its input
  const float* output(const PartActivations& acts) const;

  // Backward of one micro-batch. dout = dL/d(output) (null on the last part, which
  // starts from its loss scaled by dloss); dinput += dL/d(input) (null on the first
  // part). Parameter gradients += into grads.
  void backward(PartActivations& acts, const float* dout, float* dinput, float dloss, BackwardWorkspace& work);
  // The same in two halves (zero-bubble schedules): backward_input does everything
  // but the blocks' weight GEMMs and leaves what they need in acts (in place of
  // activations it is done with); backward_weight does those GEMMs later, after
  // which acts is spent. Together they equal backward bit for bit.
  void backward_input(PartActivations& acts, const float* dout, float* dinput, float dloss, BackwardWorkspace& work);
  void backward_weight(PartActivations& acts);

  Buffer params;  // (part's P)  chapter 00's flat buffer [global_offset, global_offset + P)
  Buffer grads;   // (part's P)

 private:
  void backward_pass(PartActivations& acts, const float* dout, float* dinput, float dloss, BackwardWorkspace& work,
                     bool defer_weights);
  float* stage_params(int stage) { return params.data() + stage_offset_[stage - range_.first]; }
  float* stage_grads(int stage) { return grads.data() + stage_offset_[stage - range_.first]; }
  const float* block_input(const PartActivations& acts, int block) const;

  GPTConfig config_;
  StageRange range_;
  int micro_batch_;
  Device device_;
  size_t global_offset_ = 0;
  std::vector<size_t> stage_offset_;  // per owned stage, within params
};

// The parts one rank holds (their stages: `ranges`), each with its AdamW, all on
// `device`: the lists that clip_part_gradients, save_parts and resume_parts_if_asked take.
class RankParts {
 public:
  RankParts(const TrainOptions& options, const std::vector<StageRange>& ranges, int micro_batch, Device device);
  void zero_grad();
  // by the global norm over every rank's parts (clip_part_gradients)
  void clip_gradients(Comm& world, float max_norm);
  void update(int step);  // every part's AdamW step

  std::vector<ModelPart*> parts;   // [part]
  std::vector<AdamW*> optimizers;  // [part]
  BackwardWorkspace workspace;     // shared by the parts: one backward runs at a time

 private:
  std::vector<std::unique_ptr<ModelPart>> owned_parts_;
  std::vector<std::unique_ptr<AdamW>> owned_optimizers_;
};

// What crosses a stage boundary (an activation forward, its gradient back): `count`
// values to or from `peer`, as `type`. fp32 goes as it is; bf16 (--dtype bf16, half the
// bytes) is rounded by the sender into `message` and widened by the receiver (exactly).
// `message` is made `count` long here when it is not; a send's must live until its Work
// is done. Chapter 05's executor sends and receives through these too.
Work send_boundary(Comm& comm, const float* values, size_t count, int peer, DType type, TypedBuffer<bf16>& message,
                   Device device);
void recv_boundary(Comm& comm, float* values, size_t count, int peer, DType type, TypedBuffer<bf16>& message,
                   Device device);

// Chapter 04's walk of one micro-batch through this rank's part, one rank busy at
// a time: forward waits for the previous rank's activation, computes, and passes
// its own on; backward waits for the next rank's gradient, computes, and passes its
// own back. Every wait, transfer and computation is a span on --trace.
class PartWalk {
 public:
  // message_type: what the activation and its gradient travel as (bf16: half the bytes,
  // rounded by the sender and widened by the receiver)
  PartWalk(ModelPart& part, BackwardWorkspace& workspace, Comm& world, Trace& trace, int micro_batch,
           DType message_type);
  // the micro-batch in acts (tokens and targets filled); on the last part its mean loss goes into `loss`
  void forward(const JsonLine& where, StepLoss& loss);
  void backward(float dloss, const JsonLine& where);
  // seconds spent computing since the last call: the rest of the time the rank waited
  double take_busy_seconds();

  PartActivations acts;  // what the micro-batch leaves between its forward and its backward

 private:
  void send(const char* span, const float* data, int peer, const JsonLine& where);  // data: (B, T, C)
  void recv(const char* span, float* data, int peer, const JsonLine& where);        // data: (B, T, C)

  ModelPart& part_;
  BackwardWorkspace& workspace_;
  Comm& world_;
  Trace& trace_;
  Buffer dout_;        // (B, T, C)  received from the next rank, on the part's device (empty on the last part)
  Buffer dinput_;      // (B, T, C)  sent to the previous rank, on the part's device (empty on the first part)
  DType message_type_;
  TypedBuffer<bf16> message_;  // (B, T, C)  bf16 messages: what goes on the wire (empty for fp32)
  double busy_ = 0.0;  // seconds computing since take_busy_seconds
};
// rank 0, at the end: the measured idle share next to the (N-1)/N that one rank
// busy at a time predicts on N ranks
void print_naive_idle(double measured, int ranks);

// The global norm of the gradients, for clipping: each rank's sum of squares over
// its parts (in double), added across the ranks in float: the same model's norm
// as chapter 00's, up to rounding. Scales every part's gradients so the norm is at
// most max_norm.
void clip_part_gradients(Comm& comm, std::vector<ModelPart*> parts, float max_norm);

// ---- checkpoints -------------------------------------------------------------
// Every rank writes its parts' parameters and AdamW moments to
// checkpoint_path(dir, step, "_rank<r>"). every_rank[r]: rank r's parts' stages, in
// its file's order (the same list on every rank), from which rank 0 first writes
// the step's manifest (common/train/checkpoint_manifest.h).
void save_parts(const TrainOptions& options, const Comm& comm, int step, const std::vector<ModelPart*>& parts,
                const std::vector<AdamW*>& optimizers, const std::vector<std::vector<StageRange>>& every_rank);
// With --resume or after a restart (resume_wanted): loads this rank's parts from the
// newest checkpoint that every rank finished saving, whatever cut wrote it (another
// --pp or schedule: each part's stages are read out of the files that hold them),
// and returns the step to continue at (1 when there is none yet).
int resume_parts_if_asked(const TrainOptions& options, const std::vector<ModelPart*>& parts,
                          const std::vector<AdamW*>& optimizers, const std::vector<std::vector<StageRange>>& every_rank,
                          bool verbose);

}  // namespace course
