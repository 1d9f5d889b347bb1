// A GPT-2-style decoder, written as a list of stages:
//
//   tokens -> [embedding] -> [block 0] -> ... -> [block L-1] -> [head] -> loss
//
// Each stage's parameters are one contiguous float buffer described by a
// StageLayout (names, shapes, offsets). The stage functions below take views into
// such buffers, so a later chapter can put stages on different ranks (pipeline),
// all-reduce a block's gradients as one slice (DDP), or gather a block's
// parameters into a temporary buffer just before using them (FSDP).
//
// Per block: pre-LayerNorm, causal multi-head attention with a fused qkv
// projection, residual, pre-LayerNorm, GELU MLP (C -> 4C -> C), residual. With
// n_experts E > 0 every block's MLP is a mixture of experts instead (common/model/moe.h):
// a router and E expert MLPs of the same shape, each token going to top_k of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/tensor/bf16.h"
#include "common/tensor/memory.h"
#include "common/tensor/ops.h"
#include "common/model/moe.h"
#include "common/model/recompute.h"
#include "common/model/step_loss.h"
#include "common/model/tokens.h"

namespace course {

struct GPTConfig {
  int vocab_size = 256;  // bytes: any file is data, no tokenizer needed
  int seq_len = 128;     // T, the context length (also the number of position embeddings)
  int n_layer = 4;       // L
  int d_model = 128;     // C
  int n_head = 4;        // NH
  // mixture of experts (common/model/moe.h); n_experts 0: dense blocks, and the rest unused
  int n_experts = 0;             // E: expert MLPs per block
  int top_k = 2;                 // k: experts per token
  float capacity_factor = 0.0f;  // capacity per expert = ceil(F N k / E) of a forward call's N; 0: dropless
  float aux_loss_coef = 0.01f;   // the load-balancing loss's weight in the loss that is optimised
  // expert parallelism (chapter 09): this process holds experts [expert_first,
  // expert_first + expert_count) of every block; the router still chooses among all E.
  // expert_count 0: all of them (every chapter but 09)
  int expert_first = 0;
  int expert_count = 0;
  int local_experts() const { return expert_count > 0 ? expert_count : n_experts; }
  // what each block keeps from its forward for its backward (BlockActivations, recompute.h)
  Recompute recompute = Recompute::None;
  // how the saved inputs of the linear layers that nothing else reads are stored
  // (LinearInput): bf16 under --dtype bf16, whose GEMMs round them to bf16 anyway
  DType linear_inputs = DType::F32;
};

// the MoE layer's sizes in a forward call of B sequences (capacity included)
MoeSizes moe_sizes(const GPTConfig& config, int B);

// ----------------------------------------------------------------------------
// parameter layout and initialisation

enum class InitKind { Normal002, Zeros, Ones };

struct ParamSpec {
  std::string name;            // globally unique, e.g. "block3.qkv_w"; names the RNG stream
  std::vector<int64_t> shape;  // e.g. (3C, C)
  size_t offset = 0;           // first element within the stage buffer
  size_t numel = 0;
  InitKind init = InitKind::Normal002;
  // the element of chapter 00's whole parameter this one starts at: 0, except for a
  // rank's slice of the stacked experts (chapter 09), whose values are the whole one's
  size_t global_first = 0;
};

struct StageLayout {
  std::string name;  // "embedding", "block3", "head"
  std::vector<ParamSpec> params;
  size_t numel = 0;  // total floats in the stage buffer
};

StageLayout embedding_layout(const GPTConfig& config);
// An MoE block's expert parameters hold the config's local experts: (E_local, 4C, C) etc.
StageLayout block_layout(const GPTConfig& config, int layer);
StageLayout head_layout(const GPTConfig& config);
// embedding, block 0 .. block L-1, head: L + 2 stages
std::vector<StageLayout> model_layout(const GPTConfig& config);
// the parameters the config's process holds (chapter 09's rank: its experts only)
size_t count_parameters(const GPTConfig& config);
// The parameters one token's forward uses: with MoE blocks, all but the E - k
// experts per block it does not go to (count_parameters when dense). The whole
// model's, whatever experts the config says this process holds.
size_t count_active_parameters(const GPTConfig& config);

// Element `index` (within the parameter) of parameter `spec`: weights ~ N(0, 0.02),
// biases 0, LayerNorm weights 1. Depends only on (seed, spec.name, index).
float init_value(const ParamSpec& spec, uint64_t seed, size_t index);
// Writes elements [begin, end) of a stage's flat buffer into dst[0 .. end-begin).
void init_stage_slice(const StageLayout& layout, uint64_t seed, float* dst, size_t begin, size_t end);

// Training FLOPs per token (forward + backward = 3x forward): 6 x (weights used in
// GEMMs) + 12 L T C for attention's two T x T products. Used for GFLOP/s and MFU.
// An MoE block's weights used per token are its active ones: the router (E C) and
// k experts (8 C^2 each), not all E (dropped choices still count: the nominal cost).
double training_flops_per_token(const GPTConfig& config);

// ----------------------------------------------------------------------------
// views into a stage buffer (the same function serves parameters and gradients)

struct EmbeddingWeights {
  float* wte;  // (V, C)
  float* wpe;  // (T, C)
};
struct BlockWeights {
  float* ln1_w;     // (C)
  float* ln1_b;     // (C)
  float* qkv_w;     // (3C, C)
  float* qkv_b;     // (3C)
  float* proj_w;    // (C, C)
  float* proj_b;    // (C)
  float* ln2_w;     // (C)
  float* ln2_b;     // (C)
  float* fc_w;      // (4C, C)
  float* fc_b;      // (4C)
  float* fcproj_w;  // (C, 4C)
  float* fcproj_b;  // (C)
  MoeWeights moe;   // an MoE block's router and experts, instead of fc and fcproj (null in a dense block)
};
struct HeadWeights {
  float* lnf_w;      // (C)
  float* lnf_b;      // (C)
  float* lm_head_w;  // (V, C)
};

EmbeddingWeights embedding_weights(float* stage_buffer, const GPTConfig& config);
BlockWeights block_weights(float* stage_buffer, const GPTConfig& config);
HeadWeights head_weights(float* stage_buffer, const GPTConfig& config);

// ----------------------------------------------------------------------------
// the attention a block runs
//
// A block's attention maps qkv (B, T, 3C) to atty (B, T, C). Without one given, it is
// ops' causal attention over the block's own T tokens, which saves the softmax
// probabilities (B, NH, T, T) for backward. Chapter 08 splits each sequence over
// ranks: a rank's queries then need the keys and values other ranks hold, so it
// plugs in an attention that fetches them (and saves what it chooses).

class BlockAttention {
 public:
  virtual ~BlockAttention() = default;
  // floats forward saves for backward (BlockActivations::att), for B sequences
  virtual size_t saved_floats(int B) const = 0;
  // atty from qkv; `saved` (saved_floats(B)) keeps what backward needs
  virtual void forward(float* atty, float* saved, const float* qkv, int B) = 0;
  // dqkv += dL/dqkv, given datty = dL/datty and what forward saved and produced
  virtual void backward(float* dqkv, const float* datty, const float* qkv, const float* atty, const float* saved,
                        int B) = 0;
};

// ----------------------------------------------------------------------------
// the experts an MoE block runs
//
// Without one given, an MoE block runs moe.h's layer over its own B T tokens with all
// E experts. Chapter 09 spreads the experts over ranks: a token's experts may live on
// other ranks, so it plugs in a layer that sends the tokens there and the outputs back
// (and saves what it chooses). A block's forward and backward take the views of its
// own MoE parameters (the rank's experts only, block_layout).

class BlockExperts {
 public:
  virtual ~BlockExperts() = default;
  // floats forward saves for backward (BlockActivations::experts_saved), for B sequences
  virtual size_t saved_floats(int B) const = 0;
  // floats backward works in (BackwardScratch::experts_scratch), shared by the blocks
  virtual size_t scratch_floats(int B) const = 0;
  // out = the MoE layer of x (both (B, T, C)); `saved` keeps what backward needs
  virtual void forward(float* out, float* saved, const float* x, const MoeWeights& w, int B) = 0;
  // dx += dL/dx and g += the MoE parameters' gradients, given dout = dL/d(out) and
  // daux = dL/d(the layer's aux loss), as moe_backward
  virtual void backward(float* dx, const MoeWeights& g, float* scratch, const float* dout, float daux,
                        const float* x, const MoeWeights& w, const float* saved, int B) = 0;
};

// ----------------------------------------------------------------------------
// activations saved by forward for backward, for one micro-batch of B sequences

struct EmbeddingActivations {
  EmbeddingActivations(const GPTConfig& config, int B, Device device = Device::CPU);
  Buffer storage;
  float* out;  // (B, T, C)
};

// A saved activation that only linear layers read, as their GEMMs' input: LayerNorm's
// outputs ln1 and ln2 (LayerNorm's backward reads its input and statistics, not its
// output), GELU's output fch_gelu (GELU's backward reads fch) and the head's lnf. Stored
// in config.linear_inputs: in fp32, or in bf16 under --dtype bf16, where each GEMM would
// round them to bf16 anyway. So bf16 storage changes no bit of a run and halves 6 of a
// dense block's 16 B T C values (the ops' *_bf16 twins write and read them: ops.h).
// At most one of the two pointers is set (none: a tensor this block does not keep).
struct LinearInput {
  // (not explicit: any fp32 tensor, atty for one, passes as a linear layer's input as it is)
  LinearInput() = default;
  LinearInput(float* values) : fp32(values) {}
  LinearInput(bf16* values) : bf16_values(values) {}
  float* fp32 = nullptr;
  bf16* bf16_values = nullptr;
};
// Its storage, in floats, for `values` values stored as `type` (a bf16 one takes half,
// rounded up), and a LinearInput carved so (Carver::take_bf16)
size_t linear_input_floats(size_t values, DType type);
LinearInput take_linear_input(Carver& carve, size_t values, DType type);

// The ops that write or read a LinearInput, on `op`'s device: each its fp32 op or its
// bf16 twin (ops.h), as the tensor is stored. Chapter 06's parallel layers call them too.
void layernorm_into(const OpTable& op, const LinearInput& out, float* mean, float* rstd, const float* inp,
                    const float* weight, const float* bias, int N, int C);
void gelu_into(const OpTable& op, const LinearInput& out, const float* inp, int64_t n);
void linear_from(const OpTable& op, float* out, const LinearInput& inp, const float* weight, const float* bias, int N,
                 int IC, int OC);
void linear_backward_from(const OpTable& op, float* dinp, float* dweight, float* dbias, const float* dout,
                          const LinearInput& inp, const float* weight, int N, int IC, int OC);

// The tensors of one block's forward, for its backward: views, owned elsewhere.
struct BlockTensors {
  Device device = Device::CPU;  // where they live: the ops that read and write them run there
  LinearInput ln1;            // (B, T, C)
  float* ln1_mean = nullptr;  // (B, T)
  float* ln1_rstd = nullptr;  // (B, T)
  float* qkv = nullptr;       // (B, T, 3C)
  float* att = nullptr;       // (B, NH, T, T), or what the block's BlockAttention saves
  float* atty = nullptr;      // (B, T, C)
  float* res2 = nullptr;      // (B, T, C)  residual stream after attention
  LinearInput ln2;            // (B, T, C)  (fp32 in an MoE block: its router and experts read it)
  float* ln2_mean = nullptr;  // (B, T)
  float* ln2_rstd = nullptr;  // (B, T)
  float* fch = nullptr;       // (B, T, 4C)  (null in an MoE block)
  LinearInput fch_gelu;       // (B, T, 4C)  (null in an MoE block)
  float* out = nullptr;       // (B, T, C)  residual stream after the MLP: the block's output
  MoeActivations moe;  // an MoE block's routing and expert rows (empty in a dense block, or with experts_saved)
  float* experts_saved = nullptr;  // what a plugged-in BlockExperts saves (null without one)
};

// What a block keeps, in a buffer of its own, depends on config.recompute (recompute.h):
// everything (none), everything but att (selective: null here, the blocks share one,
// RecomputeWorkspace::att), or only out (full: every other pointer null; backward
// recomputes them into RecomputeWorkspace::block).
struct BlockActivations : BlockTensors {
  BlockActivations(const GPTConfig& config, int B, Device device = Device::CPU,
                   const BlockAttention* attention = nullptr, const BlockExperts* experts = nullptr);
  // its storage, in floats (a bf16 LinearInput takes half as many as it has values)
  static size_t floats(const GPTConfig& config, int B, const BlockAttention* attention = nullptr,
                       const BlockExperts* experts = nullptr);
  Buffer storage;
};

struct HeadActivations {
  HeadActivations(const GPTConfig& config, int B, Device device = Device::CPU);
  static size_t floats(const GPTConfig& config, int B);  // (as BlockActivations::floats)
  Buffer storage;
  LinearInput lnf;  // (B, T, C)
  float* lnf_mean;  // (B, T)
  float* lnf_rstd;  // (B, T)
  float* logits;    // (B, T, V)
  float* probs;     // (B, T, V)
  float* losses;    // (B, T)
};

// Scratch for the gradients flowing through one block (or the head) during
// backward. Reused by every block, so it costs one block's worth, not L.
struct BackwardScratch {
  // with_scores = false: no dscores (a plugged-in BlockAttention brings its own scratch);
  // with experts, their scratch_floats in place of MoeScratch's
  BackwardScratch(const GPTConfig& config, int B, Device device = Device::CPU, bool with_scores = true,
                  const BlockExperts* experts = nullptr);
  static size_t floats(const GPTConfig& config, int B, bool with_scores = true,
                       const BlockExperts* experts = nullptr);
  Buffer storage;
  float* dres2;      // (B, T, C)
  float* dfch_gelu;  // (B, T, 4C)  (null with MoE blocks)
  float* dfch;       // (B, T, 4C)  (null with MoE blocks)
  float* dln2;       // (B, T, C)
  float* datty;      // (B, T, C)
  float* dqkv;       // (B, T, 3C)
  float* dln1;       // (B, T, C)
  float* dscores;    // (T, T), or none
  float* dlogits;    // (B, T, V)
  float* dlnf;       // (B, T, C)
  MoeScratch moe;    // an MoE block's gradients (empty with dense blocks, or with experts_scratch)
  float* experts_scratch;  // a plugged-in BlockExperts' (null without one)
};

// ----------------------------------------------------------------------------
// stage forward and backward (B sequences of the config's T tokens)
//
// Each runs on the device its activations (or scratch) live on, through
// ops_for(device) (common/tensor/ops.h): every pointer, tokens and targets included, must
// be on that device.

// A part of every sequence: chunks of positions, of equal length, in the order a
// rank's rows hold them (chapter 08 splits each sequence over ranks). Per-token
// buffers are then laid out chunk by chunk: (chunks, B, Tc, ...). No chunks: the
// whole sequence, positions 0 .. T-1.
struct PositionChunk {
  int start = 0;   // the chunk's first position within the sequence
  int length = 0;  // Tc
};

void embedding_forward(const GPTConfig& config, const EmbeddingWeights& params, EmbeddingActivations& acts,
                       const int* tokens, int B,  // tokens: (B, T), or (chunks, B, Tc)
                       const std::vector<PositionChunk>& chunks = {});
void embedding_backward(const GPTConfig& config, const EmbeddingWeights& grads, const int* tokens,
                        const float* dout, int B, Device device,  // dout: (B, T, C), or (chunks, B, Tc, C)
                        const std::vector<PositionChunk>& chunks = {});

// (attention: null for ops' causal attention over the block's T tokens; experts: null
// for moe.h's layer with every expert here)
void block_forward(const GPTConfig& config, const BlockWeights& params, BlockTensors& acts,
                   const float* x, int B, BlockAttention* attention = nullptr,  // x: (B, T, C), the block's input
                   BlockExperts* experts = nullptr);
// dx += dL/dx, given dout = dL/d(block output); parameter gradients += into grads.
// An MoE block also has a loss of its own, acts.moe.aux_loss: daux = dL/d(it), its
// weight in the loss (moe_aux_grad; ignored by a dense block).
void block_backward(const GPTConfig& config, const BlockWeights& params, const BlockWeights& grads,
                    const BlockTensors& acts, BackwardScratch& scratch, const float* x, const float* dout,
                    float* dx, int B, BlockAttention* attention = nullptr, float daux = 0.0f,
                    BlockExperts* experts = nullptr);

// An MoE block's daux when each of the forward call's B T tokens enters the loss
// with weight dloss (the cross-entropy's 1 / tokens averaged over): the aux loss of
// a forward call weighs as much as its tokens, shared by the L blocks. So the loss
// that is optimised is cross-entropy + aux_loss_coef x (the blocks' mean aux loss),
// averaged over the micro-batches like the cross-entropy.
float moe_aux_grad(const GPTConfig& config, float dloss, int B);

// block_backward in two halves, for pipeline schedules that defer weight gradients
// (zero bubble, chapter 05): block_backward = block_backward_input, then
// block_backward_weight, bit for bit.
//
// The input half: dx and every gradient except the four linear layers' weight
// GEMMs (LayerNorm weights and all biases included). It leaves the gradients the
// deferred GEMMs need in scratch: dqkv, dres2 (= d proj output), dfch and dout.
// An MoE block's experts and router get all their gradients in this half: only
// the attention's two weight GEMMs are deferred.
void block_backward_input(const GPTConfig& config, const BlockWeights& params, const BlockWeights& grads,
                          const BlockTensors& acts, BackwardScratch& scratch, const float* x, const float* dout,
                          float* dx, int B, BlockAttention* attention = nullptr, float daux = 0.0f,
                    BlockExperts* experts = nullptr);
// dL/d(output) of each of a block's four linear layers: with the layers' inputs
// (saved in BlockActivations), all that their weight gradients need.
struct LinearOutputGrads {
  const float* dqkv;     // (B, T, 3C)
  const float* dproj;    // (B, T, C)
  const float* dfc;      // (B, T, 4C)
  const float* dfcproj;  // (B, T, C)
};
// The weight half: grads.{qkv,proj,fc,fcproj}_w += d^T @ (that layer's input)
// (an MoE block: qkv and proj only; dfc and dfcproj are not read)
void block_backward_weight(const GPTConfig& config, const BlockWeights& grads, const BlockTensors& acts,
                           const LinearOutputGrads& d, int B);

// The per-position losses in acts.losses (B*T of them): the caller adds their mean to
// its StepLoss, or reads only the logits.
void head_forward(const GPTConfig& config, const HeadWeights& params, HeadActivations& acts, const float* x,
                  const int* targets, int B);
// dx += dL/dx where L = dloss * sum of per-position losses (dloss = 1/tokens averaged over)
void head_backward(const GPTConfig& config, const HeadWeights& params, const HeadWeights& grads,
                   const HeadActivations& acts, BackwardScratch& scratch, const float* x, const int* targets,
                   float dloss, float* dx, int B);

// ----------------------------------------------------------------------------
// activation recomputation
//
// Forward keeps what config.recompute says (BlockActivations); just before a block's
// backward, block_recompute computes the rest again, as common/model/recompute.h's
// policy says (the one chapter 06's blocks follow too). What the blocks do not keep
// lives in one RecomputeWorkspace, shared by every block (and every micro-batch and
// model part) of a rank: one block recomputes at a time. A plugged-in BlockAttention
// or BlockExperts is not recomputed (GPT refuses the mix: chapters 08's and 09's
// communicate).

struct RecomputeWorkspace {
  RecomputeWorkspace(const GPTConfig& config, int B, Device device = Device::CPU);
  // none: 0; selective: B NH T T; full: one block's BlockActivations::floats with nothing recomputed
  static size_t floats(const GPTConfig& config, int B);
  Buffer att;                           // (B, NH, T, T)  selective: the probabilities of the block at hand
  std::vector<BlockActivations> block;  // full: one block's whole activations (none otherwise)
  // the shared tensors recompute.h's policy fills: att (selective) or a whole block (full)
  BlockTensors tensors();
};

// block_forward as config.recompute keeps it: into `kept` (none), into `kept` with att
// in the shared buffer (selective), or into the shared block with the output written
// to kept.out (full). Returns the tensors it wrote (MoE routing is read there).
// attention, experts: as block_forward's, with config.recompute none only.
BlockTensors block_forward_kept(const GPTConfig& config, const BlockWeights& params, const BlockTensors& kept,
                                RecomputeWorkspace& shared,
                                const float* x,  // (B, T, C), the block's input
                                int B, BlockAttention* attention = nullptr, BlockExperts* experts = nullptr);
// Just before the block's backward: the tensors block_backward reads, what forward did
// not keep computed again from x (the block's input) and `kept`.
BlockTensors block_recompute(const GPTConfig& config, const BlockWeights& params, const BlockTensors& kept,
                             RecomputeWorkspace& shared, const float* x, int B);

// ----------------------------------------------------------------------------
// The whole model on one device: all stages in one flat parameter buffer (and one
// flat gradient buffer), stage s at [stage_offset(s), stage_offset(s) + numel).
// On Device::CUDA every buffer is device memory; forward and backward take the
// tokens on the host and copy them over.

// The GPT's one override point: what a later chapter plugs into its place. Nothing
// plugged in is every chapter's GPT but two: chapter 08 gives each rank some chunks of
// every sequence and an attention that brings in the other ranks' keys and values;
// chapter 09 an experts layer that sends tokens to the ranks that hold their experts.
struct GPTPlugins {
  std::vector<PositionChunk> chunks;    // the positions the rows hold; empty: 0 .. T-1
  BlockAttention* attention = nullptr;  // null: ops' causal attention over the rows' own tokens
  // null: moe.h's layer, all experts here; one given reports its routing itself, and
  // the config says which experts are here
  BlockExperts* experts = nullptr;
};

class GPT {
 public:
  // With MoE blocks, each forward adds what its routers did to *routing when given
  // (the step's meters: StepMeters::routing). `plugins`: chapter 08's and 09's parts.
  GPT(const GPTConfig& config, int micro_batch, uint64_t seed, Device device = Device::CPU,
      RoutingStats* routing = nullptr, const GPTPlugins& plugins = {});

  // loss += the mean cross-entropy over the micro_batch x T positions (x Tl, the
  // plugged-in chunks' tokens), on the model's device: nothing waits for it (common/model/step_loss.h).
  void forward(const int* tokens, const int* targets, StepLoss& loss);  // (B, T), (B, T); or (chunks, B, Tc) each
  // Gradients += d(dloss * sum of per-position losses)/d(parameters), and with MoE
  // blocks the load-balancing loss's share (moe_aux_grad).
  // stage_done(s), when given, is called as soon as stage s's gradients are final
  // (stages finish in reverse: head, block L-1, ..., block 0, embedding): the
  // moment data parallelism can start sending them while backward goes on.
  void backward(float dloss, const std::function<void(int stage)>& stage_done = nullptr);
  void zero_grad() { grads.zero(); }
  // for clipping: the squared norm of the gradient (in double), and the gradient
  // scaled by max_norm / norm when the norm is larger
  double grad_norm_squared() const;
  void clip_gradients(double norm, float max_norm);

  const GPTConfig& config() const { return config_; }
  int micro_batch() const { return micro_batch_; }
  int tokens_per_sequence() const { return rows_.seq_len; }  // T, or the part's Tl
  Device device() const { return device_; }
  const std::vector<StageLayout>& layout() const { return layout_; }
  size_t stage_offset(int stage) const { return stage_offset_[stage]; }

  Buffer params;  // (P)  all parameters
  Buffer grads;   // (P)  their gradients

 private:
  GPTConfig config_;
  GPTPlugins plugins_;
  GPTConfig rows_;  // config_ with seq_len = the plugged-in chunks' tokens per sequence: what the activations hold
  int micro_batch_;
  Device device_;
  RoutingStats* routing_;
  std::vector<StageLayout> layout_;
  std::vector<size_t> stage_offset_;
  EmbeddingActivations embedding_acts_;
  std::vector<BlockActivations> block_acts_;  // what each block keeps (config.recompute)
  RecomputeWorkspace recompute_;              // what they do not, for the block at hand
  HeadActivations head_acts_;
  BackwardScratch scratch_;
  Buffer residual_grad_;  // (2, B, T, C)  dL/d(residual stream), ping-pong between blocks
  MicroBatchTokens tokens_;  // the micro-batch's tokens and targets, kept for backward
};

}  // namespace course
