// The GPT on one tensor-parallel rank: chapter 00's stages (common/model.h) with
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
// The views EmbeddingWeights / BlockWeights / HeadWeights (common/model.h) point
// into this rank's buffer; their matrices have the local shapes: qkv_w (3Cl, C),
// qkv_b (3Cl), proj_w (C, Cl), fc_w (Fl, C), fc_b (Fl), fcproj_w (C, Fl),
// wte (Vl, C), lm_head_w (Vl, C); the rest are whole (replicated).
#pragma once

#include <cstdint>
#include <vector>

#include "06_tensor_parallel/tensor_parallel.h"
#include "common/adamw.h"
#include "common/checkpoint_manifest.h"
#include "common/cli.h"
#include "common/model.h"

namespace course {

// ----------------------------------------------------------------------------
// one micro-batch's activations, kept from forward for backward

struct TPBlockActivations {
  // split_backward: room for what zero bubble's deferred weight half needs
  TPBlockActivations(const GPTConfig& config, const TPGroup& tp, bool split_backward = false);
  static size_t floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel,
                       bool split_backward = false);
  Buffer storage;
  float* ln1;       // (B, Tl, C)  only this rank's chunk with SP: f gathers it again in backward
  float* ln1_mean;  // (B, Tl)
  float* ln1_rstd;  // (B, Tl)
  float* qkv;       // (B, T, 3Cl)
  float* att;       // (B, NHl, T, T)
  float* atty;      // (B, T, Cl)
  float* res2;      // (B, Tl, C)
  float* ln2;       // (B, Tl, C)
  float* ln2_mean;  // (B, Tl)
  float* ln2_rstd;  // (B, Tl)
  float* fch;       // (B, T, Fl)
  float* fch_gelu;  // (B, T, Fl)
  float* out;       // (B, Tl, C)
  // split_backward only: dL/d(output) of the two row-parallel layers, whole (g_backward
  // of the gradient), kept from the input half to the weight half. The input half
  // also leaves dL/d(fc output) in fch and dL/d(qkv) in qkv, done with by then.
  float* dfcproj_out;  // (B, T, C)
  float* dproj_out;    // (B, T, C)
};

struct TPHeadActivations {
  TPHeadActivations(const GPTConfig& config, const TPGroup& tp);
  static size_t floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel);
  Buffer storage;
  float* lnf;       // (B, Tl, C)
  float* lnf_mean;  // (B, Tl)
  float* lnf_rstd;  // (B, Tl)
  float* logits;    // (B, T, Vl)  1/N of chapter 00's (B, T, V): never gathered
  float* probs;     // (B, T, Vl)
  float* losses;    // (B, T)      every position's loss, the same on every rank
};

// All of a rank's stages for one micro-batch (chapter 06: the whole model).
struct TPActivations {
  TPActivations(const GPTConfig& config, const TPGroup& tp, int first_stage, int last_stage,
                bool split_backward = false);
  // the formula the README and the tests use
  static size_t floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel, int first_stage,
                       int last_stage, bool split_backward = false);
  std::vector<int> tokens;   // (B, T)  every rank reads the whole micro-batch
  std::vector<int> targets;  // (B, T)
  Buffer input;              // (B, Tl, C)  the embedding's output, or a previous stage's
  std::vector<TPBlockActivations> blocks;
  std::vector<TPHeadActivations> head;  // one when the rank has the head
};

// Scratch of backward and of f and g, shared by every stage of a rank (one stage
// runs at a time).
struct TPWorkspace {
  TPWorkspace(const GPTConfig& config, const TPGroup& tp);
  static size_t floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel);  // of storage
  Buffer storage;
  float* whole;      // (B, T, C)   f's gathered input, g's gathered gradient (SP only)
  float* partial;    // (B, T, C)   a row-parallel output before g; a column-parallel dx before f
  float* dlocal;     // (B, Tl, C)  f_backward's chunk of the sum (SP only)
  float* dres2;      // (B, Tl, C)
  float* dfch_gelu;  // (B, T, Fl)
  float* dfch;       // (B, T, Fl)
  float* datty;      // (B, T, Cl)
  float* dqkv;       // (B, T, 3Cl)
  float* dscores;    // (T, T)
  float* dlogits;    // (B, T, Vl)
  float* residual_grad;  // (2, B, Tl, C)  dL/d(residual stream), ping-pong between stages
  Buffer reduce;         // (3, B, T)  the cross-entropy's all-reduced rows (communication)
};

// ----------------------------------------------------------------------------
// the stages (f and g inside; each communicates over tp)

void tp_embedding_forward(TPGroup& tp, const GPTConfig& config, const EmbeddingWeights& w, float* out,
                          const int* tokens, TPWorkspace& work);  // out: (B, Tl, C)
void tp_embedding_backward(TPGroup& tp, const GPTConfig& config, const EmbeddingWeights& grads, const float* dout,
                           const int* tokens, TPWorkspace& work);
void tp_block_forward(TPGroup& tp, const GPTConfig& config, const BlockWeights& w, TPBlockActivations& a,
                      const float* x, TPWorkspace& work);  // x: (B, Tl, C)
// dx += dL/dx; parameter gradients += into grads. defer_weights (zero bubble, chapter
// 07): everything but the weight GEMMs, leaving in `a` what they need (the block's
// acts must have been made with split_backward); the *_backward_weight functions
// then do them, and the two halves equal the whole backward.
void tp_block_backward(TPGroup& tp, const GPTConfig& config, const BlockWeights& w, const BlockWeights& grads,
                       TPBlockActivations& a, const float* x, const float* dout, float* dx, TPWorkspace& work,
                       bool defer_weights = false);
void tp_block_backward_weight(TPGroup& tp, const GPTConfig& config, const BlockWeights& grads,
                              const TPBlockActivations& a, TPWorkspace& work);
float tp_head_forward(TPGroup& tp, const GPTConfig& config, const HeadWeights& w, TPHeadActivations& a,
                      const float* x, const int* targets, TPWorkspace& work);
void tp_head_backward(TPGroup& tp, const GPTConfig& config, const HeadWeights& w, const HeadWeights& grads,
                      TPHeadActivations& a, const float* x, const int* targets, float dloss, float* dx,
                      TPWorkspace& work, bool defer_weights = false);
// (the head's deferred GEMM reads dL/d(logits) from a.probs, where the input half left it)
void tp_head_backward_weight(TPGroup& tp, const GPTConfig& config, const HeadWeights& grads,
                             const TPHeadActivations& a, TPWorkspace& work);

// ----------------------------------------------------------------------------
// a rank's part of the model: stages [first_stage, last_stage], every matrix split

class TPPart {
 public:
  TPPart(const GPTConfig& config, TPGroup& tp, int first_stage, int last_stage, uint64_t seed);

  bool has_embedding() const { return first_stage_ == 0; }
  bool has_head() const { return last_stage_ == config_.n_layer + 1; }
  const TPLayout& layout() const { return layout_; }

  // Forward of one micro-batch from acts.tokens (or acts.input); the mean loss on
  // the part with the head, else 0.
  float forward(TPActivations& acts, TPWorkspace& work);
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

  float* replicated_params() { return params.data() + layout_.replicated_offset; }
  size_t replicated_count() const { return layout_.numel - layout_.replicated_offset; }

  Buffer params;  // (this rank's P)  split parameters, then replicated ones
  Buffer grads;

 private:
  // where each owned stage's tensors sit in one buffer (params or grads); made once,
  // since the buffers never move
  struct Views {
    EmbeddingWeights embedding{};
    std::vector<BlockWeights> blocks;  // the part's blocks, in order
    HeadWeights head{};
  };
  Views make_views(float* buffer) const;
  void backward_pass(TPActivations& acts, const float* dout, float* dinput, float dloss, TPWorkspace& work,
                     bool defer_weights);
  const float* block_input(const TPActivations& acts, int block) const;

  GPTConfig config_;
  TPGroup& tp_;
  int first_stage_, last_stage_;
  TPLayout layout_;
  Views param_views_, grad_views_;
};

// Scales every gradient so the whole model's norm is at most max_norm.
void clip_tp_gradients(TPPart& part, float max_norm);

// What rank `rank` of `ranks` holds of `layout`, as checkpoint-manifest pieces in
// its buffer's order (by local_offset: the split parameters, then the replicated
// ones, which every rank holds whole); global_index says where each local element
// comes from. begin, count: only that range of the buffer (chapter 07's ZeRO-1 shard).
std::vector<ManifestPiece> tp_pieces(const TPLayout& layout, int rank, int ranks, size_t begin = 0,
                                     size_t count = SIZE_MAX);

// Per-rank checkpoints: this rank's parameters and AdamW moments, and from rank 0
// the step's manifest (common/checkpoint_manifest.h). Resuming (--resume, or after a
// restart) loads the newest step that every rank finished saving, at any --tp: each
// rank reads its slices out of the files that hold them.
void save_tp_checkpoint(const TrainOptions& options, const Comm& comm, int step, const TPPart& part,
                        const AdamW& optimizer);
int resume_tp_if_asked(const TrainOptions& options, const Comm& comm, TPPart& part, AdamW& optimizer, bool verbose);

}  // namespace course
