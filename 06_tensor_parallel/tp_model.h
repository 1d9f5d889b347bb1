// The GPT on one tensor-parallel rank: chapter 00's stages (common/model/model.h) with
// every big matrix split by tensor_parallel.h, and f and g where the split begins
// and ends.
//
// Shapes on a rank of N (with --sp, Tl = T/N: the rank's chunk of every sequence;
// without, Tl = T), Cl = C/N, NHl = NH/N heads, Fl = 4C/N, Vl = V/N:
//
//   embedding   wte rows [r Vl, (r+1) Vl)  ->  g  ->  + wpe                 out (B, Tl, C)
//   block       ln1 -> f -> qkv (my heads' q, k, v: 3Cl) -> attention (NHl heads)
//               -> proj (row-parallel) -> g -> + proj_b + x                  res2 (B, Tl, C)
//               ln2 -> f -> fc (Fl) -> gelu -> fcproj (row-parallel) -> g -> + fcproj_b + res2
//   head        lnf -> f -> lm_head rows [r Vl, (r+1) Vl) -> vocab-parallel cross-entropy
//
// The views EmbeddingWeights / BlockWeights / HeadWeights (common/model/model.h) point
// into this rank's buffer; their matrices have the local shapes: qkv_w (3Cl, C),
// qkv_b (3Cl), proj_w (C, Cl), fc_w (Fl, C), fc_b (Fl), fcproj_w (C, Fl),
// wte (Vl, C), lm_head_w (Vl, C); the rest are whole (replicated).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "06_tensor_parallel/tensor_parallel.h"
#include "common/model/adamw.h"
#include "common/train/checkpoint_manifest.h"
#include "common/train/cli.h"
#include "common/model/model.h"
#include "common/model/tokens.h"
#include "common/model/step_loss.h"

namespace course {

// ----------------------------------------------------------------------------
// activation recomputation (--recompute): what a block keeps from forward, and what
// backward computes again instead
//
//   none       every tensor below, per block and micro-batch
//   selective  all but att, the (B, NHl, T, T) attention probabilities: before a
//              block's backward, attention's forward runs again from the kept qkv
//              into one buffer per rank (Korthikanti et al. 2022)
//   full       only the block's output (the next block's input): before a block's
//              backward its whole forward runs again, f's and g's collectives
//              included, into one block's worth of buffers per rank
//
// The recomputed forward runs the same ops on the same inputs, so backward sees the
// same values bit for bit.

// ----------------------------------------------------------------------------
// one micro-batch's activations, kept from forward for backward

// A block's tensors, wherever they live (a block's own activations, or the rank's
// recomputation buffer); a null pointer is a tensor not kept.
struct TPBlockTensors {
  // ln1, ln2, fch_gelu (and the head's lnf): read only by linear layers, stored as
  // config.linear_inputs says (bf16 under --dtype bf16, as chapter 00's blocks: model.h)
  LinearInput ln1;            // (B, Tl, C)  only this rank's chunk with SP: f gathers it again in backward
  float* ln1_mean = nullptr;  // (B, Tl)
  float* ln1_rstd = nullptr;  // (B, Tl)
  float* qkv = nullptr;       // (B, T, 3Cl)
  float* att = nullptr;       // (B, NHl, T, T)
  float* atty = nullptr;      // (B, T, Cl)
  float* res2 = nullptr;      // (B, Tl, C)
  LinearInput ln2;            // (B, Tl, C)
  float* ln2_mean = nullptr;  // (B, Tl)
  float* ln2_rstd = nullptr;  // (B, Tl)
  float* fch = nullptr;       // (B, T, Fl)
  LinearInput fch_gelu;       // (B, T, Fl)
  float* out = nullptr;       // (B, Tl, C)
  // split_backward only: dL/d(output) of the two row-parallel layers, whole (g_backward
  // of the gradient), kept from the input half to the weight half. The input half
  // also leaves dL/d(fc output) in fch and dL/d(qkv) in qkv, done with by then.
  float* dfcproj_out = nullptr;  // (B, T, C)
  float* dproj_out = nullptr;    // (B, T, C)
};

struct TPBlockActivations : TPBlockTensors {
  // split_backward: room for what zero bubble's deferred weight half needs
  TPBlockActivations(const GPTConfig& config, const TPGroup& tp, bool split_backward = false,
                     Recompute recompute = Recompute::None);
  // none: B Tl (4C + 4) + B T (3Cl + Cl + 2Fl) + B NHl T T (+ 2 B T C split), with ln1,
  // ln2 and fch_gelu half of theirs at bf16 (B Tl (3C + 4) + B T (3Cl + Cl + 1.5Fl) + ...);
  // selective: the same without B NHl T T; full: B Tl C
  static size_t floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel,
                       bool split_backward = false, Recompute recompute = Recompute::None);
  Recompute recompute;
  Buffer storage;
};

// What recomputation refills before each block's backward: one per rank, which
// every block and micro-batch uses in turn (Activations memory, counted once).
struct TPRecomputed {
  TPRecomputed(const GPTConfig& config, const TPGroup& tp, Recompute recompute);
  // none: 0; selective: B NHl T T; full: one block's none-formula
  static size_t floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel, Recompute recompute);
  Buffer storage;
  TPBlockTensors block;  // selective: att only; full: every tensor but the split_backward pair
};

struct TPHeadActivations {
  TPHeadActivations(const GPTConfig& config, const TPGroup& tp);
  static size_t floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel);
  Buffer storage;
  LinearInput lnf;  // (B, Tl, C)
  float* lnf_mean;  // (B, Tl)
  float* lnf_rstd;  // (B, Tl)
  float* logits;    // (B, T, Vl)  1/N of chapter 00's (B, T, V): never gathered
  float* probs;     // (B, T, Vl)
  float* losses;    // (B, T)      every position's loss, the same on every rank
};

// All of a rank's stages for one micro-batch (chapter 06: the whole model).
struct TPActivations {
  TPActivations(const GPTConfig& config, const TPGroup& tp, int first_stage, int last_stage,
                bool split_backward = false, Recompute recompute = Recompute::None);
  // the formula the README and the tests use (TPRecomputed's buffer not included)
  static size_t floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel, int first_stage,
                       int last_stage, bool split_backward = false, Recompute recompute = Recompute::None);
  // every rank of the group reads the whole micro-batch; forward uploads it (no device
  // memory on a part with neither the embedding nor the head: nothing there reads it)
  MicroBatchTokens batch;
  Buffer input;              // (B, Tl, C)  the embedding's output, or a previous stage's
  std::vector<TPBlockActivations> blocks;
  std::vector<TPHeadActivations> head;  // one when the rank has the head
};

// Scratch of backward and of f and g, shared by every stage of a rank (one stage
// runs at a time).
struct TPWorkspace {
  TPWorkspace(const GPTConfig& config, const TPGroup& tp, Recompute recompute = Recompute::None);
  static size_t floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel);  // of storage
  Buffer storage;
  TPScratch scratch;  // f's and g's buffers, which the parallel layers share (tensor_parallel.h)
  float* dres2;       // (B, Tl, C)
  float* dfch_gelu;   // (B, T, Fl)
  float* dfch;        // (B, T, Fl)
  float* datty;       // (B, T, Cl)
  float* dqkv;        // (B, T, 3Cl)
  float* dscores;     // (T, T)
  float* dlogits;     // (B, T, Vl)
  float* residual_grad;  // (2, B, Tl, C)  dL/d(residual stream), ping-pong between stages
  Buffer reduce;         // (3, B, T)  the cross-entropy's all-reduced rows (communication)
  TPRecomputed recomputed;  // --recompute's buffer (Activations memory; empty with none)
};

// ----------------------------------------------------------------------------
// the stages, built from the parallel layers (f and g inside; each communicates
// over tp). Each points at its weights and gradients in the part's buffers, made
// once; activations and the workspace come with each call.

// vocabulary-parallel token rows, g, then the positions
class TPEmbedding {
 public:
  TPEmbedding(TPGroup& tp, const GPTConfig& config, const EmbeddingWeights& params, const EmbeddingWeights& grads);
  void forward(float* out,         // (B, Tl, C)
               const int* tokens,  // (B, T)
               TPWorkspace& work);
  void backward(const float* dout,  // (B, Tl, C)
                const int* tokens, TPWorkspace& work);

 private:
  TPGroup& tp_;
  int vocab_local_;  // Vl: this rank's rows of wte
  EmbeddingWeights params_, grads_;
};

// the transformer block: two pairs of a column-parallel layer and a row-parallel one
// (attention's qkv and proj, the MLP's fc and fcproj), each pair between f and g
class TPBlock {
 public:
  TPBlock(TPGroup& tp, const GPTConfig& config, const BlockWeights& params, const BlockWeights& grads);
  // x: (B, Tl, C); what `a` does not keep (a.recompute) goes to work.recomputed
  void forward(TPBlockActivations& a, const float* x, TPWorkspace& work);
  // dx += dL/dx given dout = dL/d(block output); parameter gradients += into grads.
  // First what `a` does not keep is computed again into work.recomputed.
  // defer_weights (zero bubble, chapter 07): everything but the weight GEMMs, leaving
  // in `a` what they need (acts made with split_backward); backward_weight then does
  // them, and the two halves equal the whole backward.
  void backward(TPBlockActivations& a, const float* x, const float* dout, float* dx, TPWorkspace& work,
                bool defer_weights = false);
  void backward_weight(const TPBlockActivations& a, TPWorkspace& work);

 private:
  // the block's ops on tensors t (every one present)
  void forward_ops(TPBlockTensors& t, const float* x, TPWorkspace& work);
  void backward_ops(TPBlockTensors& t, const float* x, const float* dout, float* dx, TPWorkspace& work,
                    bool defer_weights);

  TPGroup& tp_;
  GPTConfig config_;
  BlockWeights params_, grads_;  // the LayerNorms' are used here; the linear layers hold theirs
  ColumnParallelLinear qkv_;     // f, then the q, k, v of this rank's heads: 3Cl features
  RowParallelLinear proj_;       // this rank's heads' outputs, then g
  ColumnParallelLinear fc_;      // f, then this rank's Fl hidden features
  RowParallelLinear fcproj_;     // this rank's hidden features, then g
};

// final LayerNorm, f, vocabulary-parallel LM head and cross-entropy
class TPHead {
 public:
  TPHead(TPGroup& tp, const GPTConfig& config, const HeadWeights& params, const HeadWeights& grads);
  // loss += the mean loss over the micro-batch, the same on every rank (the per-position
  // losses come out of the cross-entropy's all-reduces whole on each)
  void forward(TPHeadActivations& a, const float* x, const int* targets, TPWorkspace& work, StepLoss& loss);
  void backward(TPHeadActivations& a, const float* x, const int* targets, float dloss, float* dx, TPWorkspace& work,
                bool defer_weights = false);
  // (the deferred GEMM reads dL/d(logits) from a.probs, where the input half left it)
  void backward_weight(const TPHeadActivations& a, TPWorkspace& work);

 private:
  TPGroup& tp_;
  GPTConfig config_;
  HeadWeights params_, grads_;  // the LayerNorm's are used here; the LM head holds its own
  ColumnParallelLinear lm_head_;  // f, then this rank's Vl rows of the vocabulary
};

// ----------------------------------------------------------------------------
// a rank's part of the model: stages [first_stage, last_stage], every matrix split

// Where one stage's parameters sit in a part's buffer: its split ones in [split_begin,
// split_end), its replicated ones in [replicated_begin, replicated_end). The two runs
// back to back are the stage's own tp_layout(stage, stage).
struct TPStageSpan {
  size_t split_begin = 0, split_end = 0;
  size_t replicated_begin = 0, replicated_end = 0;
  size_t split_count() const { return split_end - split_begin; }
  size_t numel() const { return split_count() + replicated_end - replicated_begin; }
};
// [s - first_stage]: tp_layout(s, s) of each stage of a part of stages [first_stage, last_stage]
std::vector<TPLayout> tp_stage_layouts(const GPTConfig& config, int first_stage, int last_stage, int ranks);
// [s - first_stage]: where each of those stages sits in the part's buffer (tp_layout(first_stage, last_stage))
std::vector<TPStageSpan> tp_stage_spans(const std::vector<TPLayout>& stage_layouts);

// One stage's parameters (or gradients) in tp_layout(stage, stage)'s two runs: its
// split tensors from `split`, its replicated ones from `replicated` (null: none here).
struct StageRuns {
  float* split = nullptr;
  float* replicated = nullptr;
};

// Where a part's stages read their parameters when the part does not keep them:
// a source that holds them elsewhere and hands each stage its own just before it
// computes (chapter 07's ZeRO-3 keeps shards over its DP group and gathers a stage
// as it is needed). A part with a source keeps no parameters, and its gradients are
// lent by whoever gave it the source.
class TPParamSource {
 public:
  virtual ~TPParamSource() = default;
  // Before stage `stage` computes: a forward, a backward or zero bubble's input half
  // (not the weight half: dW = dy^T x reads what the input half kept, no parameter).
  // next_stage: the stage this pass computes next (-1: none), which a source may
  // start fetching meanwhile.
  virtual StageRuns stage_params(int stage, int next_stage) = 0;
  // After it has computed: the source may take them back.
  virtual void stage_done(int stage) = 0;
};

class TPPart {
 public:
  // Without a source, the part keeps its parameters (initialised as chapter 00's) and
  // gradients in params and grads; with one, it keeps neither (above).
  TPPart(const GPTConfig& config, TPGroup& tp, int first_stage, int last_stage, uint64_t seed,
         TPParamSource* source = nullptr);

  bool has_embedding() const { return first_stage_ == 0; }
  bool has_head() const { return last_stage_ == config_.n_layer + 1; }
  const TPLayout& layout() const { return layout_; }
  const GPTConfig& config() const { return config_; }
  const TPGroup& group() const { return tp_; }

  // Forward of one micro-batch from acts.batch (or acts.input); the part with the
  // head adds the micro-batch's mean loss to `loss`.
  void forward(TPActivations& acts, TPWorkspace& work, StepLoss& loss);
  // Backward of one micro-batch; dout = dL/d(output) (null with the head), dinput
  // += dL/d(input) (null with the embedding).
  void backward(TPActivations& acts, const float* dout, float* dinput, float dloss, TPWorkspace& work);
  // The same in zero bubble's two halves (acts made with split_backward): the input
  // half's collectives and the weight half's (with SP, re-gathering the LayerNorm
  // outputs) run in the same order on every rank of the group.
  void backward_input(TPActivations& acts, const float* dout, float* dinput, float dloss, TPWorkspace& work);
  void backward_weight(TPActivations& acts, TPWorkspace& work);
  const float* output(const TPActivations& acts) const;  // (B, Tl, C)

  // After the last micro-batch: with SP every replicated parameter saw only this
  // rank's chunk of the sequence, so its gradient is a partial sum over positions,
  // completed by one all-reduce of the replicated range. Without SP they are
  // already whole (and the same on every rank): nothing to do.
  void finish_gradients();
  // sum of squared gradients of the whole model: the split range summed over the
  // group, the replicated range (the same on every rank) counted once
  double grad_norm_squared();
  // scales every gradient by max_norm / norm when the norm is larger
  void clip_gradients(double norm, float max_norm);

  float* replicated_params() { return params.data() + layout_.replicated_offset; }
  size_t replicated_count() const { return layout_.numel - layout_.replicated_offset; }
  int first_stage() const { return first_stage_; }
  int last_stage() const { return last_stage_; }
  TPStageSpan stage_span(int stage) const;  // CourseError for a stage the part does not have

  Buffer params;  // (this rank's P)  split parameters, then replicated ones (empty with a source)
  Buffer grads;   // (this rank's P)  their gradients (with a source: empty until lent)

 private:
  // The stage's runs in a buffer laid out as the part (null when it is empty)
  StageRuns runs_in(Buffer& whole, int stage) const;
  // Makes stage `stage`'s object, viewing its parameters and gradients where they are now.
  void bind_stage(int stage, StageRuns params, StageRuns grads);
  // compute() with the stage's parameters where the source says (without one: where they always are)
  template <typename Compute>
  void run_stage(int stage, int next_stage, Compute&& compute);
  void backward_pass(TPActivations& acts, const float* dout, float* dinput, float dloss, TPWorkspace& work,
                     bool defer_weights);
  const float* block_input(const TPActivations& acts, int block) const;
  int block_stage(int block) const { return std::max(first_stage_, 1) + block; }  // blocks_[block]'s stage

  GPTConfig config_;
  TPGroup& tp_;
  int first_stage_, last_stage_;
  TPLayout layout_;
  std::vector<TPLayout> stage_layouts_;   // [s - first_stage_]: tp_layout(s, s)
  std::vector<TPStageSpan> stage_spans_;  // [s - first_stage_]: where stage s sits in layout_
  TPParamSource* source_;                 // null: the parameters are in params
  // the stages, viewing their parameters and gradients (with a source, made again before each computes)
  std::optional<TPEmbedding> embedding_;  // when the part has the embedding
  std::vector<std::optional<TPBlock>> blocks_;  // the part's blocks, in order
  std::optional<TPHead> head_;            // when the part has the head
};

// ----------------------------------------------------------------------------
// chapter 06's model: every stage on this rank of the group, driven as chapter 00
// drives its GPT (zero_grad, then forward and backward per micro-batch); it holds
// the micro-batch's activations and the workspace, as GPT holds its own

// Chapter 06's own flags.
struct TPFlags {
  int tp = 0;                      // --tp: ranks splitting every matrix; 0 = the world size
  bool sequence_parallel = false;  // --sp
};
void add_tp_flags(ArgParser& parser, TPFlags& flags);

class TPGPT : public TPPart {
 public:
  TPGPT(const GPTConfig& config, TPGroup& tp, uint64_t seed);  // recomputing as config.recompute says

  void zero_grad() { grads.zero(); }
  // loss += the mean cross-entropy over the micro-batch's B x T positions, the same on
  // every rank (f and g inside the layers bring the ranks' slices together), on the device.
  void forward(const int* tokens, const int* targets, StepLoss& loss);  // (B, T), (B, T)
  // This rank's gradients += d(dloss * sum of per-position losses)/d(its slices).
  void backward(float dloss);

  // the summary's fields: tp, sequence_parallel, params_per_rank, replicated_params
  JsonLine summary_fields() const;
  // rank 0, at the end: the logits' and probabilities' bytes per rank against chapter
  // 00's (B, T, V) for one micro-batch of B sequences: never gathered whole
  void print_logits_saving(int micro_batch) const;

 private:
  TPActivations acts_;     // the micro-batch's, tokens and targets included
  TPWorkspace workspace_;  // backward's scratch, f's and g's buffers, and the recomputed block
};

// What rank `rank` of `ranks` holds of `layout`, as checkpoint-manifest pieces in
// its buffer's order (by local_offset: the split parameters, then the replicated
// ones, which every rank holds whole); global_index says where each local element
// comes from. begin, count: only that range of the buffer (chapter 07's ZeRO-1 shard).
std::vector<ManifestPiece> tp_pieces(const TPLayout& layout, int rank, int ranks, size_t begin = 0,
                                     size_t count = SIZE_MAX);

// Per-rank checkpoints: this rank's parameters and AdamW moments, and from rank 0
// the step's manifest (common/train/checkpoint_manifest.h). Resuming (--resume, or after a
// restart) loads the newest step that every rank finished saving, at any --tp: each
// rank reads its slices out of the files that hold them.
void save_tp_checkpoint(const TrainOptions& options, const Comm& comm, int step, const TPPart& part,
                        const AdamW& optimizer);
int resume_tp_if_asked(const TrainOptions& options, const Comm& comm, TPPart& part, AdamW& optimizer, bool verbose);

}  // namespace course
