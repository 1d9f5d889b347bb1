#include "common/model/model.h"

#include <cstring>

#include "common/model/adamw.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/tensor/ops.h"
#include "common/model/rng.h"

namespace course {

// ----------------------------------------------------------------------------
// layout

static void add_param(StageLayout& layout, const std::string& name, std::vector<int64_t> shape, InitKind init) {
  ParamSpec spec;
  spec.name = name;
  spec.shape = std::move(shape);
  spec.numel = 1;
  for (int64_t d : spec.shape) spec.numel *= static_cast<size_t>(d);
  spec.offset = layout.numel;
  spec.init = init;
  layout.numel += spec.numel;
  layout.params.push_back(spec);
}

StageLayout embedding_layout(const GPTConfig& config) {
  StageLayout layout{"embedding", {}, 0};
  add_param(layout, "wte", {config.vocab_size, config.d_model}, InitKind::Normal002);
  add_param(layout, "wpe", {config.seq_len, config.d_model}, InitKind::Normal002);
  return layout;
}

StageLayout block_layout(const GPTConfig& config, int layer) {
  const int64_t C = config.d_model;
  const std::string p = "block" + std::to_string(layer) + ".";
  StageLayout layout{"block" + std::to_string(layer), {}, 0};
  add_param(layout, p + "ln1_w", {C}, InitKind::Ones);
  add_param(layout, p + "ln1_b", {C}, InitKind::Zeros);
  add_param(layout, p + "qkv_w", {3 * C, C}, InitKind::Normal002);
  add_param(layout, p + "qkv_b", {3 * C}, InitKind::Zeros);
  add_param(layout, p + "proj_w", {C, C}, InitKind::Normal002);
  add_param(layout, p + "proj_b", {C}, InitKind::Zeros);
  add_param(layout, p + "ln2_w", {C}, InitKind::Ones);
  add_param(layout, p + "ln2_b", {C}, InitKind::Zeros);
  if (config.n_experts == 0) {
    add_param(layout, p + "fc_w", {4 * C, C}, InitKind::Normal002);
    add_param(layout, p + "fc_b", {4 * C}, InitKind::Zeros);
    add_param(layout, p + "fcproj_w", {C, 4 * C}, InitKind::Normal002);
    add_param(layout, p + "fcproj_b", {C}, InitKind::Zeros);
    return layout;
  }
  // the experts stacked along a first dimension E: expert e is row block e of each,
  // so a rank holding some experts holds whole rows (expert parallelism, chapter 09):
  // its E_local experts from expert_first on, one contiguous piece of each
  const int64_t E = config.n_experts, E_local = config.local_experts(), first = config.expert_first;
  add_param(layout, p + "router_w", {E, C}, InitKind::Normal002);
  add_param(layout, p + "expert_fc_w", {E_local, 4 * C, C}, InitKind::Normal002);
  add_param(layout, p + "expert_fc_b", {E_local, 4 * C}, InitKind::Zeros);
  add_param(layout, p + "expert_fcproj_w", {E_local, C, 4 * C}, InitKind::Normal002);
  add_param(layout, p + "expert_fcproj_b", {E_local, C}, InitKind::Zeros);
  for (size_t i = layout.params.size() - 4; i < layout.params.size(); i++) {
    ParamSpec& expert = layout.params[i];
    expert.global_first = static_cast<size_t>(first) * (expert.numel / static_cast<size_t>(E_local));
  }
  return layout;
}

StageLayout head_layout(const GPTConfig& config) {
  StageLayout layout{"head", {}, 0};
  add_param(layout, "lnf_w", {config.d_model}, InitKind::Ones);
  add_param(layout, "lnf_b", {config.d_model}, InitKind::Zeros);
  add_param(layout, "lm_head_w", {config.vocab_size, config.d_model}, InitKind::Normal002);
  return layout;
}

std::vector<StageLayout> model_layout(const GPTConfig& config) {
  std::vector<StageLayout> stages;
  stages.push_back(embedding_layout(config));
  for (int layer = 0; layer < config.n_layer; layer++) stages.push_back(block_layout(config, layer));
  stages.push_back(head_layout(config));
  return stages;
}

size_t count_parameters(const GPTConfig& config) {
  size_t total = 0;
  for (const StageLayout& stage : model_layout(config)) total += stage.numel;
  return total;
}

size_t count_active_parameters(const GPTConfig& config) {
  GPTConfig whole = config;
  whole.expert_first = whole.expert_count = 0;
  const size_t C = config.d_model, idle_experts = config.n_experts - std::min(config.n_experts, config.top_k);
  return count_parameters(whole) - config.n_layer * idle_experts * (8 * C * C + 5 * C);
}

float init_value(const ParamSpec& spec, uint64_t seed, size_t index) {
  switch (spec.init) {
    case InitKind::Zeros: return 0.0f;
    case InitKind::Ones: return 1.0f;
    case InitKind::Normal002: return static_cast<float>(0.02 * CounterRng(seed, hash_name(spec.name)).normal(index));
  }
  return 0.0f;
}

void init_stage_slice(const StageLayout& layout, uint64_t seed, float* dst, size_t begin, size_t end) {
  for (const ParamSpec& spec : layout.params) {
    // the part of this parameter that falls inside [begin, end)
    size_t first = std::max(begin, spec.offset);
    size_t last = std::min(end, spec.offset + spec.numel);
    for (size_t i = first; i < last; i++) {
      dst[i - begin] = init_value(spec, seed, spec.global_first + i - spec.offset);
    }
  }
}

double training_flops_per_token(const GPTConfig& config) {
  const double C = config.d_model, L = config.n_layer, T = config.seq_len, V = config.vocab_size;
  double gemm_weights = L * 12.0 * C * C + V * C;  // qkv + proj + fc + fcproj per block, lm head
  if (config.n_experts > 0) {
    // qkv + proj, the router, and fc + fcproj of the k experts a token goes to
    gemm_weights = L * (4.0 * C * C + config.n_experts * C + config.top_k * 8.0 * C * C) + V * C;
  }
  return 6.0 * gemm_weights + 12.0 * L * T * C;
}

MoeSizes moe_sizes(const GPTConfig& config, int B) {
  const int N = B * config.seq_len;
  return {N, config.d_model, config.n_experts, config.top_k,
          moe_capacity(config.capacity_factor, N, config.n_experts, config.top_k)};
}

float moe_aux_grad(const GPTConfig& config, float dloss, int B) {
  return config.aux_loss_coef * dloss * static_cast<float>(B * config.seq_len) / static_cast<float>(config.n_layer);
}

// ----------------------------------------------------------------------------
// views: one pointer per parameter, in layout order

static std::vector<float*> param_pointers(float* stage_buffer, const StageLayout& layout) {
  std::vector<float*> pointers;
  for (const ParamSpec& spec : layout.params) pointers.push_back(stage_buffer + spec.offset);
  return pointers;
}

EmbeddingWeights embedding_weights(float* stage_buffer, const GPTConfig& config) {
  std::vector<float*> p = param_pointers(stage_buffer, embedding_layout(config));
  return {p[0], p[1]};
}

BlockWeights block_weights(float* stage_buffer, const GPTConfig& config) {
  std::vector<float*> p = param_pointers(stage_buffer, block_layout(config, 0));
  if (config.n_experts == 0) {
    return {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], MoeWeights{}};
  }
  // the MLP's four are the router's and the experts' five
  return {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], nullptr, nullptr, nullptr, nullptr,
          MoeWeights{p[8], p[9], p[10], p[11], p[12]}};
}

HeadWeights head_weights(float* stage_buffer, const GPTConfig& config) {
  std::vector<float*> p = param_pointers(stage_buffer, head_layout(config));
  return {p[0], p[1], p[2]};
}

// ----------------------------------------------------------------------------
// activation storage: one Buffer per struct, carved into the named arrays

EmbeddingActivations::EmbeddingActivations(const GPTConfig& config, int B, Device device)
    : storage(static_cast<size_t>(B) * config.seq_len * config.d_model, MemCategory::Activations, device),
      out(storage.data()) {}

// what attention saves for backward: the softmax (B, NH, T, T), or what a plugged-in one says
static size_t attention_saved_floats(const GPTConfig& config, int B, const BlockAttention* attention) {
  const size_t T = config.seq_len;
  return attention ? attention->saved_floats(B) : static_cast<size_t>(B) * config.n_head * T * T;
}

// ln2's type: config.linear_inputs in a dense block; fp32 in an MoE block, whose router
// and experts read it too
static DType ln2_type(const GPTConfig& config) { return config.n_experts > 0 ? DType::F32 : config.linear_inputs; }

size_t linear_input_floats(size_t values, DType type) { return type == DType::BF16 ? (values + 1) / 2 : values; }

LinearInput take_linear_input(Carver& carve, size_t values, DType type) {
  if (type == DType::BF16) return LinearInput(carve.take_bf16(values));
  return LinearInput(carve.take(values));
}

// the MLP's share of a block's activations: fch and fch_gelu, or an MoE layer's
static size_t mlp_saved_floats(const GPTConfig& config, int B, const BlockExperts* experts) {
  const size_t BT = static_cast<size_t>(B) * config.seq_len, C = config.d_model;
  if (experts) return experts->saved_floats(B);
  if (config.n_experts > 0) return MoeActivations::floats(moe_sizes(config, B));
  return BT * 4 * C + linear_input_floats(BT * 4 * C, config.linear_inputs);
}

size_t BlockActivations::floats(const GPTConfig& config, int B, const BlockAttention* attention,
                                const BlockExperts* experts) {
  const size_t BT = static_cast<size_t>(B) * config.seq_len, C = config.d_model;
  if (config.recompute == Recompute::Full) return BT * C;  // out
  const size_t att = config.recompute == Recompute::Selective ? 0 : attention_saved_floats(config, B, attention);
  // atty, res2, out: C each; qkv: 3C; ln1 and ln2: C each, as stored; four (mean, rstd) rows; att; the MLP's
  return BT * 6 * C + linear_input_floats(BT * C, config.linear_inputs) +
         linear_input_floats(BT * C, ln2_type(config)) + BT * 4 + att + mlp_saved_floats(config, B, experts);
}

BlockActivations::BlockActivations(const GPTConfig& config, int B, Device device, const BlockAttention* attention,
                                   const BlockExperts* experts)
    : storage(floats(config, B, attention, experts), MemCategory::Activations, device) {
  this->device = device;
  const size_t BT = static_cast<size_t>(B) * config.seq_len, C = config.d_model;
  Carver carve(storage.data());
  if (config.recompute == Recompute::Full) {  // the output only (every other view stays null): backward recomputes the rest
    out = carve.take(BT * C);
    return;
  }
  ln1 = take_linear_input(carve, BT * C, config.linear_inputs);
  ln1_mean = carve.take(BT);
  ln1_rstd = carve.take(BT);
  qkv = carve.take(BT * 3 * C);
  // selective: the shared buffer's, set by block_forward_kept and block_recompute
  att = config.recompute == Recompute::Selective ? nullptr : carve.take(attention_saved_floats(config, B, attention));
  atty = carve.take(BT * C);
  res2 = carve.take(BT * C);
  ln2 = take_linear_input(carve, BT * C, ln2_type(config));
  ln2_mean = carve.take(BT);
  ln2_rstd = carve.take(BT);
  if (experts) {
    fch = nullptr;
    experts_saved = carve.take(experts->saved_floats(B));
  } else if (config.n_experts > 0) {
    fch = nullptr;
    moe.carve(carve, moe_sizes(config, B));
  } else {
    fch = carve.take(BT * 4 * C);
    fch_gelu = take_linear_input(carve, BT * 4 * C, config.linear_inputs);
  }
  out = carve.take(BT * C);
}

size_t HeadActivations::floats(const GPTConfig& config, int B) {
  const size_t BT = static_cast<size_t>(B) * config.seq_len;
  // lnf, as stored; its (mean, rstd) rows; logits and probs (V each); losses
  return linear_input_floats(BT * config.d_model, config.linear_inputs) + 2 * BT + 2 * BT * config.vocab_size + BT;
}

HeadActivations::HeadActivations(const GPTConfig& config, int B, Device device)
    : storage(floats(config, B), MemCategory::Activations, device) {
  const size_t BT = static_cast<size_t>(B) * config.seq_len;
  Carver carve(storage.data());
  lnf = take_linear_input(carve, BT * config.d_model, config.linear_inputs);
  lnf_mean = carve.take(BT);
  lnf_rstd = carve.take(BT);
  logits = carve.take(BT * config.vocab_size);
  probs = carve.take(BT * config.vocab_size);
  losses = carve.take(BT);
}

size_t BackwardScratch::floats(const GPTConfig& config, int B, bool with_scores, const BlockExperts* experts) {
  const size_t BT = static_cast<size_t>(B) * config.seq_len, C = config.d_model;
  const size_t T = with_scores ? config.seq_len : 0;
  // dres2, dln2, datty, dqkv (3C), dln1, dlnf; the MLP's dfch_gelu and dfch (4C each), or an MoE layer's
  const size_t mlp = experts                  ? experts->scratch_floats(B)
                     : config.n_experts > 0 ? MoeScratch::floats(moe_sizes(config, B))
                                            : BT * 8 * C;
  return BT * C * (1 + 1 + 1 + 3 + 1 + 1) + mlp + T * T + BT * config.vocab_size;
}

BackwardScratch::BackwardScratch(const GPTConfig& config, int B, Device device, bool with_scores,
                                 const BlockExperts* experts)
    : storage(floats(config, B, with_scores, experts), MemCategory::Workspace, device), experts_scratch(nullptr) {
  const size_t BT = static_cast<size_t>(B) * config.seq_len, C = config.d_model;
  const size_t T = with_scores ? config.seq_len : 0;
  const bool moe_blocks = config.n_experts > 0;
  Carver carve(storage.data());
  dres2 = carve.take(BT * C);
  dfch_gelu = moe_blocks ? nullptr : carve.take(BT * 4 * C);
  dfch = moe_blocks ? nullptr : carve.take(BT * 4 * C);
  dln2 = carve.take(BT * C);
  datty = carve.take(BT * C);
  dqkv = carve.take(BT * 3 * C);
  dln1 = carve.take(BT * C);
  dscores = carve.take(T * T);
  dlogits = carve.take(BT * config.vocab_size);
  dlnf = carve.take(BT * C);
  if (experts) {
    experts_scratch = carve.take(experts->scratch_floats(B));
  } else if (moe_blocks) {
    moe.carve(carve, moe_sizes(config, B));
  }
}

// ----------------------------------------------------------------------------
// embedding stage

static std::vector<PositionChunk> chunks_or_whole(const GPTConfig& config, const std::vector<PositionChunk>& chunks) {
  return chunks.empty() ? std::vector<PositionChunk>{{0, config.seq_len}} : chunks;
}

void embedding_forward(const GPTConfig& config, const EmbeddingWeights& params, EmbeddingActivations& acts,
                       const int* tokens, int B, const std::vector<PositionChunk>& chunks) {
  const int C = config.d_model;
  size_t row = 0;  // the chunk's first row, (chunks, B, Tc) laid out
  // a chunk's tokens take the position embeddings of its own positions: wpe[start ..]
  for (const PositionChunk& chunk : chunks_or_whole(config, chunks)) {
    ops_for(acts.storage.device())
        .embedding_forward(acts.out + row * C, tokens + row, params.wte, params.wpe + static_cast<size_t>(chunk.start) * C,
                           B, chunk.length, C);
    row += static_cast<size_t>(B) * chunk.length;
  }
}

void embedding_backward(const GPTConfig& config, const EmbeddingWeights& grads, const int* tokens,
                        const float* dout, int B, Device device, const std::vector<PositionChunk>& chunks) {
  const int C = config.d_model;
  size_t row = 0;
  for (const PositionChunk& chunk : chunks_or_whole(config, chunks)) {
    ops_for(device).embedding_backward(grads.wte, grads.wpe + static_cast<size_t>(chunk.start) * C, dout + row * C,
                                       tokens + row, B, chunk.length, C);
    row += static_cast<size_t>(B) * chunk.length;
  }
}

// ----------------------------------------------------------------------------
// the ops on a LinearInput (model.h)

void layernorm_into(const OpTable& op, const LinearInput& out, float* mean, float* rstd, const float* inp,
                    const float* weight, const float* bias, int N, int C) {
  if (out.bf16_values) {
    op.layernorm_forward_bf16(out.bf16_values, mean, rstd, inp, weight, bias, N, C);
  } else {
    op.layernorm_forward(out.fp32, mean, rstd, inp, weight, bias, N, C);
  }
}

void gelu_into(const OpTable& op, const LinearInput& out, const float* inp, int64_t n) {
  if (out.bf16_values) {
    op.gelu_forward_bf16(out.bf16_values, inp, n);
  } else {
    op.gelu_forward(out.fp32, inp, n);
  }
}

void linear_from(const OpTable& op, float* out, const LinearInput& inp, const float* weight, const float* bias, int N,
                 int IC, int OC) {
  if (inp.bf16_values) {
    op.linear_forward_bf16(out, inp.bf16_values, weight, bias, N, IC, OC);
  } else {
    op.linear_forward(out, inp.fp32, weight, bias, N, IC, OC);
  }
}

void linear_backward_from(const OpTable& op, float* dinp, float* dweight, float* dbias, const float* dout,
                          const LinearInput& inp, const float* weight, int N, int IC, int OC) {
  if (inp.bf16_values) {
    op.linear_backward_bf16(dinp, dweight, dbias, dout, inp.bf16_values, weight, N, IC, OC);
  } else {
    op.linear_backward(dinp, dweight, dbias, dout, inp.fp32, weight, N, IC, OC);
  }
}

// ----------------------------------------------------------------------------
// transformer block

void block_forward(const GPTConfig& config, const BlockWeights& w, BlockTensors& a, const float* x, int B,
                   BlockAttention* attention, BlockExperts* experts) {
  const int T = config.seq_len, C = config.d_model, NH = config.n_head, N = B * T;
  const int64_t NC = static_cast<int64_t>(N) * C;
  const OpTable& op = ops_for(a.device);

  // attention half: res2 = x + proj(attention(qkv(ln1(x))))
  layernorm_into(op, a.ln1, a.ln1_mean, a.ln1_rstd, x, w.ln1_w, w.ln1_b, N, C);
  linear_from(op, a.qkv, a.ln1, w.qkv_w, w.qkv_b, N, C, 3 * C);
  if (attention) {
    attention->forward(a.atty, a.att, a.qkv, B);
  } else {
    op.attention_forward(a.atty, a.att, a.qkv, B, T, C, NH);
  }
  op.linear_forward(a.res2, a.atty, w.proj_w, w.proj_b, N, C, C);
  op.residual_forward(a.res2, x, a.res2, NC);

  // MLP half: out = res2 + fcproj(gelu(fc(ln2(res2)))), or res2 + moe(ln2(res2))
  layernorm_into(op, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w.ln2_w, w.ln2_b, N, C);
  if (experts) {
    experts->forward(a.out, a.experts_saved, a.ln2.fp32, w.moe, B);
  } else if (config.n_experts > 0) {
    moe_forward(a.out, a.ln2.fp32, w.moe, a.moe, moe_sizes(config, B), a.device);
  } else {
    linear_from(op, a.fch, a.ln2, w.fc_w, w.fc_b, N, C, 4 * C);
    gelu_into(op, a.fch_gelu, a.fch, 4 * NC);
    linear_from(op, a.out, a.fch_gelu, w.fcproj_w, w.fcproj_b, N, 4 * C, C);
  }
  op.residual_forward(a.out, a.res2, a.out, NC);
}

// The input half's walk (block_backward_input); `with_weights`: each linear layer's
// weight GEMM too, in the same linear_backward call as its input's, which reads dout
// once for both (under bf16, one rounding copy of it: ops_cpu.cpp). The GEMMs are the
// weight half's, on the same operands: the same bits.
static void block_backward_walk(const GPTConfig& config, const BlockWeights& w, const BlockWeights& g,
                                const BlockTensors& a, BackwardScratch& s, const float* x, const float* dout,
                                float* dx, int B, BlockAttention* attention, float daux, BlockExperts* experts,
                                bool with_weights) {
  const int T = config.seq_len, C = config.d_model, NH = config.n_head, N = B * T;
  const int64_t NC = static_cast<int64_t>(N) * C;
  const OpTable& op = ops_for(s.storage.device());
  // every backward op accumulates, so the block's scratch starts from zero
  op.zero(s.dres2, NC);
  op.zero(s.dln2, NC);
  op.zero(s.datty, NC);
  op.zero(s.dqkv, 3 * NC);
  op.zero(s.dln1, NC);

  // MLP half, in reverse: out = res2 + fcproj(gelu(fc(ln2(res2)))), or res2 + moe(ln2(res2))
  if (experts) {
    experts->backward(s.dln2, g.moe, s.experts_scratch, dout, daux, a.ln2.fp32, w.moe, a.experts_saved, B);
  } else if (config.n_experts > 0) {
    moe_backward(s.dln2, g.moe, s.moe, dout, daux, a.ln2.fp32, w.moe, a.moe, moe_sizes(config, B), s.storage.device());
  } else {
    op.zero(s.dfch_gelu, 4 * NC);
    op.zero(s.dfch, 4 * NC);
    linear_backward_from(op, s.dfch_gelu, with_weights ? g.fcproj_w : nullptr, g.fcproj_b, dout, a.fch_gelu,
                         w.fcproj_w, N, 4 * C, C);
    op.gelu_backward(s.dfch, a.fch, s.dfch_gelu, 4 * NC);
    linear_backward_from(op, s.dln2, with_weights ? g.fc_w : nullptr, g.fc_b, s.dfch, a.ln2, w.fc_w, N, C, 4 * C);
  }
  op.layernorm_backward(s.dres2, g.ln2_w, g.ln2_b, s.dln2, a.res2, w.ln2_w, a.ln2_mean, a.ln2_rstd, N, C);
  op.residual_backward(s.dres2, dout, NC);  // the residual path around the MLP

  // attention half, in reverse: res2 = x + proj(attention(qkv(ln1(x))))
  op.linear_backward(s.datty, with_weights ? g.proj_w : nullptr, g.proj_b, s.dres2, a.atty, w.proj_w, N, C, C);
  if (attention) {
    attention->backward(s.dqkv, s.datty, a.qkv, a.atty, a.att, B);
  } else {
    op.attention_backward(s.dqkv, s.dscores, s.datty, a.qkv, a.att, B, T, C, NH);
  }
  linear_backward_from(op, s.dln1, with_weights ? g.qkv_w : nullptr, g.qkv_b, s.dqkv, a.ln1, w.qkv_w, N, C, 3 * C);
  op.layernorm_backward(dx, g.ln1_w, g.ln1_b, s.dln1, x, w.ln1_w, a.ln1_mean, a.ln1_rstd, N, C);
  op.residual_backward(dx, s.dres2, NC);  // the residual path around attention
}

void block_backward(const GPTConfig& config, const BlockWeights& w, const BlockWeights& g, const BlockTensors& a,
                    BackwardScratch& s, const float* x, const float* dout, float* dx, int B, BlockAttention* attention,
                    float daux, BlockExperts* experts) {
  block_backward_walk(config, w, g, a, s, x, dout, dx, B, attention, daux, experts, /*with_weights=*/true);
}

void block_backward_input(const GPTConfig& config, const BlockWeights& w, const BlockWeights& g,
                          const BlockTensors& a, BackwardScratch& s, const float* x, const float* dout, float* dx,
                          int B, BlockAttention* attention, float daux, BlockExperts* experts) {
  // each linear_backward gets dweight = null: block_backward_weight does those GEMMs
  block_backward_walk(config, w, g, a, s, x, dout, dx, B, attention, daux, experts, /*with_weights=*/false);
}

void block_backward_weight(const GPTConfig& config, const BlockWeights& g, const BlockTensors& a,
                           const LinearOutputGrads& d, int B) {
  const int C = config.d_model, N = B * config.seq_len;
  const OpTable& op = ops_for(a.device);
  // dweight += dout^T @ inp for each layer (dinp and dbias null: the input half did them)
  if (config.n_experts == 0) {
    linear_backward_from(op, nullptr, g.fcproj_w, nullptr, d.dfcproj, a.fch_gelu, nullptr, N, 4 * C, C);
    linear_backward_from(op, nullptr, g.fc_w, nullptr, d.dfc, a.ln2, nullptr, N, C, 4 * C);
  }
  op.linear_backward(nullptr, g.proj_w, nullptr, d.dproj, a.atty, nullptr, N, C, C);
  linear_backward_from(op, nullptr, g.qkv_w, nullptr, d.dqkv, a.ln1, nullptr, N, C, 3 * C);
}

// ----------------------------------------------------------------------------
// activation recomputation

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::None;
  if (name == "selective") return Recompute::Selective;
  if (name == "full") return Recompute::Full;
  throw UsageError("--recompute must be none, selective or full, got '" + name + "'");
}

const char* recompute_name(Recompute recompute) {
  return recompute == Recompute::Full ? "full" : recompute == Recompute::Selective ? "selective" : "none";
}

// the config of a block that keeps everything: the shared block full recomputation fills
static GPTConfig keeping_everything(GPTConfig config) {
  config.recompute = Recompute::None;
  return config;
}

size_t RecomputeWorkspace::floats(const GPTConfig& config, int B) {
  switch (config.recompute) {
    case Recompute::Selective:
      return attention_saved_floats(config, B, nullptr);
    case Recompute::Full:
      return BlockActivations::floats(keeping_everything(config), B);
    case Recompute::None:
      break;
  }
  return 0;
}

RecomputeWorkspace::RecomputeWorkspace(const GPTConfig& config, int B, Device device)
    : att(config.recompute == Recompute::Selective ? floats(config, B) : 0, MemCategory::Activations, device) {
  if (config.recompute == Recompute::Full) block.emplace_back(keeping_everything(config), B, device);
}

BlockTensors RecomputeWorkspace::tensors() {
  BlockTensors shared;
  if (!block.empty()) shared = block[0];
  if (att.size() > 0) shared.att = att.data();
  return shared;
}

BlockTensors block_forward_kept(const GPTConfig& config, const BlockWeights& w, const BlockTensors& kept,
                                RecomputeWorkspace& shared, const float* x, int B, BlockAttention* attention,
                                BlockExperts* experts) {
  BlockTensors written = tensors_forward_writes(config.recompute, kept, shared.tensors());
  block_forward(config, w, written, x, B, attention, experts);
  return written;
}

BlockTensors block_recompute(const GPTConfig& config, const BlockWeights& w, const BlockTensors& kept,
                             RecomputeWorkspace& shared, const float* x, int B) {
  return tensors_backward_reads(
      config.recompute, kept, shared.tensors(),
      [&](BlockTensors& t) {
        ops_for(t.device).attention_forward(t.atty, t.att, t.qkv, B, config.seq_len, config.d_model, config.n_head);
      },
      [&](BlockTensors& t) { block_forward(config, w, t, x, B); });
}

// ----------------------------------------------------------------------------
// head: final LayerNorm, LM head, cross-entropy

void head_forward(const GPTConfig& config, const HeadWeights& w, HeadActivations& a, const float* x,
                  const int* targets, int B) {
  const int T = config.seq_len, C = config.d_model, V = config.vocab_size, N = B * T;
  const OpTable& op = ops_for(a.storage.device());
  layernorm_into(op, a.lnf, a.lnf_mean, a.lnf_rstd, x, w.lnf_w, w.lnf_b, N, C);
  linear_from(op, a.logits, a.lnf, w.lm_head_w, nullptr, N, C, V);
  op.crossentropy_forward(a.losses, a.probs, a.logits, targets, B, T, V);
}

void head_backward(const GPTConfig& config, const HeadWeights& w, const HeadWeights& g, const HeadActivations& a,
                   BackwardScratch& s, const float* x, const int* targets, float dloss, float* dx, int B) {
  const int T = config.seq_len, C = config.d_model, V = config.vocab_size, N = B * T;
  const OpTable& op = ops_for(s.storage.device());
  op.zero(s.dlogits, static_cast<int64_t>(N) * V);
  op.zero(s.dlnf, static_cast<int64_t>(N) * C);
  op.crossentropy_backward(s.dlogits, a.probs, targets, dloss, B, T, V);
  linear_backward_from(op, s.dlnf, g.lm_head_w, nullptr, s.dlogits, a.lnf, w.lm_head_w, N, C, V);
  op.layernorm_backward(dx, g.lnf_w, g.lnf_b, s.dlnf, x, w.lnf_w, a.lnf_mean, a.lnf_rstd, N, C);
}

// ----------------------------------------------------------------------------
// GPT: every stage on this device

// config with seq_len = the tokens per sequence that the plugged-in chunks hold
static GPTConfig rows_config(GPTConfig config, const GPTPlugins& plugins) {
  if (!plugins.chunks.empty()) config.seq_len = static_cast<int>(plugins.chunks.size()) * plugins.chunks[0].length;
  return config;
}

GPT::GPT(const GPTConfig& config, int micro_batch, uint64_t seed, Device device, RoutingStats* routing,
         const GPTPlugins& plugins)
    : params(count_parameters(config), MemCategory::Parameters, device),
      grads(count_parameters(config), MemCategory::Gradients, device),
      config_(config),
      plugins_(plugins),
      rows_(rows_config(config, plugins)),
      micro_batch_(micro_batch),
      device_(device),
      routing_(routing),
      layout_(model_layout(config)),
      embedding_acts_(rows_, micro_batch, device),
      recompute_(rows_, micro_batch, device),
      head_acts_(rows_, micro_batch, device),
      scratch_(rows_, micro_batch, device, /*with_scores=*/plugins.attention == nullptr, plugins.experts),
      residual_grad_(2 * static_cast<size_t>(micro_batch) * rows_.seq_len * config.d_model, MemCategory::Workspace,
                     device),
      tokens_(static_cast<size_t>(micro_batch) * rows_.seq_len, device) {
  if (config.recompute != Recompute::None && (plugins.attention != nullptr || plugins.experts != nullptr)) {
    throw UsageError("a plugged-in attention or experts layer is not recomputed (hint: drop --recompute)");
  }
  // initialise on the host (the values depend only on seed, name and index), then copy to the device
  Buffer host_params(device == Device::CPU ? 0 : params.size(), MemCategory::Workspace);
  float* init_target = device == Device::CPU ? params.data() : host_params.data();
  size_t offset = 0;
  for (const StageLayout& stage : layout_) {
    stage_offset_.push_back(offset);
    init_stage_slice(stage, seed, init_target + offset, 0, stage.numel);
    offset += stage.numel;
  }
  if (device != Device::CPU) copy_bytes(params.data(), device, init_target, Device::CPU, params.bytes());
  for (int layer = 0; layer < config.n_layer; layer++) {
    block_acts_.emplace_back(rows_, micro_batch, device, plugins.attention, plugins.experts);
  }
}

double GPT::grad_norm_squared() const { return course::grad_norm_squared(grads.data(), grads.size(), device_); }

void GPT::clip_gradients(double norm, float max_norm) {
  clip_grads(grads.data(), grads.size(), norm, max_norm, device_);
}

void GPT::forward(const int* tokens, const int* targets, StepLoss& loss) {
  const int B = micro_batch_, L = config_.n_layer;
  const size_t BT = static_cast<size_t>(B) * rows_.seq_len;
  tokens_.fill(tokens, targets);
  tokens_.upload();  // kept for backward, where the ops read them
  const int* device_tokens = tokens_.device_tokens();
  const int* device_targets = tokens_.device_targets();

  embedding_forward(config_, embedding_weights(params.data() + stage_offset_[0], config_), embedding_acts_,
                    device_tokens, B, plugins_.chunks);
  const float* x = embedding_acts_.out;
  for (int layer = 0; layer < L; layer++) {
    const BlockWeights weights = block_weights(params.data() + stage_offset_[1 + layer], config_);
    const BlockTensors written =
        block_forward_kept(rows_, weights, block_acts_[layer], recompute_, x, B, plugins_.attention, plugins_.experts);
    if (config_.n_experts > 0 && routing_ != nullptr && plugins_.experts == nullptr) {
      routing_->add(written.moe, moe_sizes(rows_, B));
    }
    x = block_acts_[layer].out;
  }
  head_forward(rows_, head_weights(params.data() + stage_offset_[L + 1], config_), head_acts_, x, device_targets, B);
  loss.add(head_acts_.losses, static_cast<int64_t>(BT));
}

void GPT::backward(float dloss, const std::function<void(int stage)>& stage_done) {
  const int B = micro_batch_, L = config_.n_layer;
  const size_t NC = static_cast<size_t>(B) * rows_.seq_len * config_.d_model;
  float* dout = residual_grad_.data();  // dL/d(output of the current stage)
  float* dx = dout + NC;                // dL/d(input of the current stage)
  const int* device_tokens = tokens_.device_tokens();
  const int* device_targets = tokens_.device_targets();
  const OpTable& op = ops_for(device_);
  const float daux = config_.n_experts > 0 ? moe_aux_grad(rows_, dloss, B) : 0.0f;

  op.zero(dout, static_cast<int64_t>(NC));
  const float* head_input = block_acts_.empty() ? embedding_acts_.out : block_acts_[L - 1].out;
  head_backward(rows_, head_weights(params.data() + stage_offset_[L + 1], config_),
                head_weights(grads.data() + stage_offset_[L + 1], config_), head_acts_, scratch_, head_input,
                device_targets, dloss, dout, B);
  if (stage_done) stage_done(L + 1);
  for (int layer = L - 1; layer >= 0; layer--) {
    const float* x = layer == 0 ? embedding_acts_.out : block_acts_[layer - 1].out;
    op.zero(dx, static_cast<int64_t>(NC));
    const BlockWeights weights = block_weights(params.data() + stage_offset_[1 + layer], config_);
    const BlockTensors acts = block_recompute(rows_, weights, block_acts_[layer], recompute_, x, B);
    block_backward(rows_, weights, block_weights(grads.data() + stage_offset_[1 + layer], config_), acts, scratch_, x,
                   dout, dx, B, plugins_.attention, daux, plugins_.experts);
    std::swap(dout, dx);
    if (stage_done) stage_done(1 + layer);
  }
  embedding_backward(config_, embedding_weights(grads.data() + stage_offset_[0], config_), device_tokens, dout, B,
                     device_, plugins_.chunks);
  if (stage_done) stage_done(0);
}

}  // namespace course
