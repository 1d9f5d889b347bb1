#include "06_tensor_parallel/tp_model.h"

#include <algorithm>
#include <cstdio>

#include "common/train/checkpoint.h"
#include "common/train/checkpoint_manifest.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/tensor/ops.h"
#include "common/model/part_backward.h"
#include "common/train/sharded_checkpoint.h"
#include "common/train/trainer_parts.h"

namespace course {

namespace {

// The local sizes of one rank (tp_model.h's table).
struct LocalShape {
  LocalShape(const GPTConfig& config, int B, int ranks, bool sequence_parallel)
      : B(B),
        T(config.seq_len),
        Tl(sequence_parallel ? config.seq_len / ranks : config.seq_len),
        C(config.d_model),
        Cl(config.d_model / ranks),
        NHl(config.n_head / ranks),
        Fl(4 * config.d_model / ranks),
        Vl(config.vocab_size / ranks),
        linear_inputs(config.linear_inputs) {}
  size_t B, T, Tl, C, Cl, NHl, Fl, Vl;
  DType linear_inputs;  // how ln1, ln2, fch_gelu and lnf are stored (model.h's LinearInput)
  // floats of a LinearInput of `values` values
  size_t input_floats(size_t values) const { return linear_input_floats(values, linear_inputs); }
};

}  // namespace

// ----------------------------------------------------------------------------
// activations and workspace

// Points t's tensors at consecutive pieces of carve (a whole block's, but att only
// with_att, and the split_backward pair only with it).
static void carve_block(TPBlockTensors& t, Carver& carve, const LocalShape& s, bool with_att, bool split_backward) {
  const size_t local_rows = s.B * s.Tl, rows = s.B * s.T;
  t.ln1 = take_linear_input(carve, local_rows * s.C, s.linear_inputs);
  t.ln1_mean = carve.take(local_rows);
  t.ln1_rstd = carve.take(local_rows);
  t.qkv = carve.take(rows * 3 * s.Cl);
  t.att = with_att ? carve.take(s.B * s.NHl * s.T * s.T) : nullptr;
  t.atty = carve.take(rows * s.Cl);
  t.res2 = carve.take(local_rows * s.C);
  t.ln2 = take_linear_input(carve, local_rows * s.C, s.linear_inputs);
  t.ln2_mean = carve.take(local_rows);
  t.ln2_rstd = carve.take(local_rows);
  t.fch = carve.take(rows * s.Fl);
  t.fch_gelu = take_linear_input(carve, rows * s.Fl, s.linear_inputs);
  t.out = carve.take(local_rows * s.C);
  t.dfcproj_out = split_backward ? carve.take(rows * s.C) : nullptr;
  t.dproj_out = split_backward ? carve.take(rows * s.C) : nullptr;
}

size_t TPBlockActivations::floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel,
                                  bool split_backward, Recompute recompute) {
  const LocalShape s(config, B, ranks, sequence_parallel);
  if (recompute == Recompute::Full) return s.B * s.Tl * s.C;  // the output: the next block's input
  // outside f..g (ln1, res2, ln2, out and the LayerNorms' statistics): B Tl rows;
  // inside (qkv, atty, fch, fch_gelu, att): 1/N of the features or heads;
  // zero bubble's two kept gradients: whole (B, T, C) each. ln1, ln2 and fch_gelu as
  // stored (bf16 under --dtype bf16: half)
  const size_t att = recompute == Recompute::Selective ? 0 : s.B * s.NHl * s.T * s.T;
  const size_t local_rows = s.B * s.Tl, rows = s.B * s.T;
  return local_rows * (2 * s.C + 4) + 2 * s.input_floats(local_rows * s.C) + rows * (3 * s.Cl + s.Cl + s.Fl) +
         s.input_floats(rows * s.Fl) + att + (split_backward ? 2 * rows * s.C : 0);
}

TPBlockActivations::TPBlockActivations(const GPTConfig& config, const TPGroup& tp, bool split_backward,
                                       Recompute recompute)
    : recompute(recompute),
      storage(floats(config, tp.batch(), tp.size(), tp.sequence_parallel(), split_backward, recompute),
              MemCategory::Activations, tp.device()) {
  Carver carve(storage.data());
  if (recompute == Recompute::Full) {
    out = carve.take(storage.size());
    return;
  }
  const LocalShape s(config, tp.batch(), tp.size(), tp.sequence_parallel());
  carve_block(*this, carve, s, /*with_att=*/recompute == Recompute::None, split_backward);
}

size_t TPRecomputed::floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel,
                            Recompute recompute) {
  const LocalShape s(config, B, ranks, sequence_parallel);
  if (recompute == Recompute::Selective) return s.B * s.NHl * s.T * s.T;
  if (recompute == Recompute::Full) return TPBlockActivations::floats(config, B, ranks, sequence_parallel);
  return 0;
}

TPRecomputed::TPRecomputed(const GPTConfig& config, const TPGroup& tp, Recompute recompute)
    : storage(floats(config, tp.batch(), tp.size(), tp.sequence_parallel(), recompute), MemCategory::Activations,
              tp.device()) {
  Carver carve(storage.data());
  if (recompute == Recompute::Selective) block.att = carve.take(storage.size());
  if (recompute == Recompute::Full) {
    carve_block(block, carve, LocalShape(config, tp.batch(), tp.size(), tp.sequence_parallel()), true, false);
  }
}

size_t TPHeadActivations::floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel) {
  const LocalShape s(config, B, ranks, sequence_parallel);
  // lnf (as stored) and its statistics, the logits and probabilities, the losses
  return s.input_floats(s.B * s.Tl * s.C) + 2 * s.B * s.Tl + 2 * s.B * s.T * s.Vl + s.B * s.T;
}

TPHeadActivations::TPHeadActivations(const GPTConfig& config, const TPGroup& tp)
    : storage(floats(config, tp.batch(), tp.size(), tp.sequence_parallel()), MemCategory::Activations, tp.device()) {
  const LocalShape s(config, tp.batch(), tp.size(), tp.sequence_parallel());
  Carver carve(storage.data());
  lnf = take_linear_input(carve, s.B * s.Tl * s.C, s.linear_inputs);
  lnf_mean = carve.take(s.B * s.Tl);
  lnf_rstd = carve.take(s.B * s.Tl);
  logits = carve.take(s.B * s.T * s.Vl);
  probs = carve.take(s.B * s.T * s.Vl);
  losses = carve.take(s.B * s.T);
}

static int blocks_in(const GPTConfig& config, int first_stage, int last_stage) {
  return std::min(last_stage, config.n_layer) - std::max(first_stage, 1) + 1;
}

size_t TPActivations::floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel, int first_stage,
                             int last_stage, bool split_backward, Recompute recompute) {
  const LocalShape s(config, B, ranks, sequence_parallel);
  size_t total = s.B * s.Tl * s.C;  // the embedding's output (or the received input)
  total += blocks_in(config, first_stage, last_stage) *
           TPBlockActivations::floats(config, B, ranks, sequence_parallel, split_backward, recompute);
  if (last_stage == config.n_layer + 1) total += TPHeadActivations::floats(config, B, ranks, sequence_parallel);
  return total;
}

TPActivations::TPActivations(const GPTConfig& config, const TPGroup& tp, int first_stage, int last_stage,
                             bool split_backward, Recompute recompute)
    : batch(static_cast<size_t>(tp.batch()) * config.seq_len, tp.device(),
            /*read_on_device=*/first_stage == 0 || last_stage == config.n_layer + 1),
      input(static_cast<size_t>(tp.batch()) * tp.local_seq() * config.d_model, MemCategory::Activations,
            tp.device()) {
  for (int b = 0; b < blocks_in(config, first_stage, last_stage); b++) {
    blocks.emplace_back(config, tp, split_backward, recompute);
  }
  if (last_stage == config.n_layer + 1) head.emplace_back(config, tp);
}

size_t TPWorkspace::floats(const GPTConfig& config, int B, int ranks, bool sequence_parallel) {
  const LocalShape s(config, B, ranks, sequence_parallel);
  const size_t rows = s.B * s.T, local_rows = s.B * s.Tl;
  const size_t sp_only = sequence_parallel ? 1 : 0;
  return sp_only * rows * s.C + rows * s.C + sp_only * local_rows * s.C + local_rows * s.C + 2 * rows * s.Fl +
         rows * s.Cl + rows * 3 * s.Cl + s.T * s.T + rows * s.Vl + 2 * local_rows * s.C;
}

TPWorkspace::TPWorkspace(const GPTConfig& config, const TPGroup& tp, Recompute recompute)
    : storage(floats(config, tp.batch(), tp.size(), tp.sequence_parallel()), MemCategory::Workspace, tp.device()),
      reduce(3 * static_cast<size_t>(tp.batch()) * config.seq_len, MemCategory::CommBuffers, tp.device()),
      recomputed(config, tp, recompute) {
  const LocalShape s(config, tp.batch(), tp.size(), tp.sequence_parallel());
  const size_t rows = s.B * s.T, local_rows = s.B * s.Tl;
  const size_t sp_only = tp.sequence_parallel() ? 1 : 0;
  Carver carve(storage.data());
  scratch.whole = carve.take(sp_only * rows * s.C);
  scratch.partial = carve.take(rows * s.C);
  scratch.dlocal = carve.take(sp_only * local_rows * s.C);
  dres2 = carve.take(local_rows * s.C);
  dfch_gelu = carve.take(rows * s.Fl);
  dfch = carve.take(rows * s.Fl);
  datty = carve.take(rows * s.Cl);
  dqkv = carve.take(rows * 3 * s.Cl);
  dscores = carve.take(s.T * s.T);
  dlogits = carve.take(rows * s.Vl);
  residual_grad = carve.take(2 * local_rows * s.C);
}

// ----------------------------------------------------------------------------
// embedding: vocabulary-parallel token rows, g, then the positions

TPEmbedding::TPEmbedding(TPGroup& tp, const GPTConfig& config, const EmbeddingWeights& params,
                         const EmbeddingWeights& grads)
    : tp_(tp), vocab_local_(config.vocab_size / tp.size()), params_(params), grads_(grads) {}

void TPEmbedding::forward(float* out, const int* tokens, TPWorkspace& work) {
  const int B = tp_.batch(), T = tp_.seq(), C = tp_.width(), Vl = vocab_local_;
  const TPOpTable& op = tp_.tp_ops();
  float* partial = work.scratch.partial;
  // partial[b,t] = wte[token] if this rank holds the token's row, else 0
  op.vocab_embedding_forward(partial, tokens, params_.wte, tp_.rank() * Vl, Vl, B * T, C);
  // g: the rows summed over ranks (all but one added zeros: the sum is exactly chapter 00's row)
  const float* token_rows = tp_.g_forward(partial, out);
  // out = wte[token] + wpe[t], for this rank's positions
  const float* my_positions = params_.wpe + static_cast<size_t>(tp_.first_position()) * C;  // (local_T, C)
  op.position_embedding_forward(out, token_rows, my_positions, B, tp_.local_seq(), C);
}

void TPEmbedding::backward(const float* dout, const int* tokens, TPWorkspace& work) {
  const int B = tp_.batch(), T = tp_.seq(), C = tp_.width(), Vl = vocab_local_;
  const TPOpTable& op = tp_.tp_ops();
  op.position_embedding_backward(grads_.wpe + static_cast<size_t>(tp_.first_position()) * C, dout, B,
                                 tp_.local_seq(), C);
  const float* dtoken_rows = tp_.g_backward(dout, work.scratch.whole);  // (B, T, C): every position's gradient
  op.vocab_embedding_backward(grads_.wte, dtoken_rows, tokens, tp_.rank() * Vl, Vl, B * T, C);
}

// ----------------------------------------------------------------------------
// transformer block

TPBlock::TPBlock(TPGroup& tp, const GPTConfig& config, const BlockWeights& w, const BlockWeights& g)
    : tp_(tp),
      config_(config),
      params_(w),
      grads_(g),
      qkv_(tp, {w.qkv_w, w.qkv_b, g.qkv_w, g.qkv_b}, 3 * config.d_model / tp.size()),
      proj_(tp, {w.proj_w, w.proj_b, g.proj_w, g.proj_b}, config.d_model / tp.size()),
      fc_(tp, {w.fc_w, w.fc_b, g.fc_w, g.fc_b}, 4 * config.d_model / tp.size()),
      fcproj_(tp, {w.fcproj_w, w.fcproj_b, g.fcproj_w, g.fcproj_b}, 4 * config.d_model / tp.size()) {}

// --recompute as every block of the course does it (common/model/recompute.h)
void TPBlock::forward(TPBlockActivations& a, const float* x, TPWorkspace& work) {
  TPBlockTensors t = tensors_forward_writes<TPBlockTensors>(a.recompute, a, work.recomputed.block);
  forward_ops(t, x, work);
}

void TPBlock::backward(TPBlockActivations& a, const float* x, const float* dout, float* dx, TPWorkspace& work,
                       bool defer_weights) {
  // selective: the probabilities again, from the kept q, k, v on this rank's heads;
  // full: the whole block again from its input, f's and g's collectives included
  TPBlockTensors t = tensors_backward_reads<TPBlockTensors>(
      a.recompute, a, work.recomputed.block,
      [&](TPBlockTensors& r) {
        tp_.ops().attention_forward(r.atty, r.att, r.qkv, tp_.batch(), tp_.seq(), tp_.width() / tp_.size(),
                                    config_.n_head / tp_.size());
      },
      [&](TPBlockTensors& r) { forward_ops(r, x, work); });
  backward_ops(t, x, dout, dx, work, defer_weights);
}

void TPBlock::forward_ops(TPBlockTensors& a, const float* x, TPWorkspace& work) {
  const BlockWeights& w = params_;
  const int B = tp_.batch(), T = tp_.seq(), C = tp_.width(), N = tp_.size();
  const int Cl = C / N, NHl = config_.n_head / N, Fl = 4 * C / N, local_rows = B * tp_.local_seq();
  TPScratch& scratch = work.scratch;
  const OpTable& op = tp_.ops();

  // attention half: res2 = x + proj(attention(qkv(ln1(x)))), on this rank's heads
  layernorm_into(op, a.ln1, a.ln1_mean, a.ln1_rstd, x, w.ln1_w, w.ln1_b, local_rows, C);
  qkv_.forward(a.qkv, a.ln1, scratch);  // f inside
  op.attention_forward(a.atty, a.att, a.qkv, B, T, Cl, NHl);
  proj_.forward(a.res2, a.atty, x, scratch);  // g inside, then + proj_b + x

  // MLP half: out = res2 + fcproj(gelu(fc(ln2(res2)))), on this rank's 4C/N hidden features
  layernorm_into(op, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, w.ln2_w, w.ln2_b, local_rows, C);
  fc_.forward(a.fch, a.ln2, scratch);
  gelu_into(op, a.fch_gelu, a.fch, static_cast<int64_t>(B) * T * Fl);
  fcproj_.forward(a.out, a.fch_gelu, a.res2, scratch);
}

void TPBlock::backward_ops(TPBlockTensors& a, const float* x, const float* dout, float* dx, TPWorkspace& work,
                           bool defer_weights) {
  const BlockWeights &w = params_, &g = grads_;
  const int B = tp_.batch(), T = tp_.seq(), C = tp_.width(), N = tp_.size();
  const int Cl = C / N, NHl = config_.n_head / N, Fl = 4 * C / N, local_rows = B * tp_.local_seq();
  const int64_t local_NC = static_cast<int64_t>(local_rows) * C, rows = static_cast<int64_t>(B) * T;
  TPScratch& scratch = work.scratch;
  const OpTable& op = tp_.ops();
  // deferring: each linear layer leaves its weight GEMM for backward_weight and keeps
  // the output gradient that GEMM needs here, in an activation backward is done with
  const auto kept = [&](float* where) { return defer_weights ? where : nullptr; };
  op.zero(work.dres2, local_NC);
  op.zero(work.dfch_gelu, rows * Fl);
  op.zero(work.dfch, rows * Fl);
  op.zero(work.datty, rows * Cl);
  op.zero(work.dqkv, rows * 3 * Cl);

  // MLP half, in reverse
  op.residual_backward(work.dres2, dout, local_NC);  // the residual path around the MLP
  fcproj_.backward(work.dfch_gelu, dout, a.fch_gelu, scratch, kept(a.dfcproj_out));  // g backward inside
  op.gelu_backward(work.dfch, a.fch, work.dfch_gelu, rows * Fl);
  const float* dln2 = fc_.backward(work.dfch, a.ln2, scratch, kept(a.fch));  // f backward inside
  op.layernorm_backward(work.dres2, g.ln2_w, g.ln2_b, dln2, a.res2, w.ln2_w, a.ln2_mean, a.ln2_rstd, local_rows, C);

  // attention half, in reverse
  proj_.backward(work.datty, work.dres2, a.atty, scratch, kept(a.dproj_out));
  op.attention_backward(work.dqkv, work.dscores, work.datty, a.qkv, a.att, B, T, Cl, NHl);
  const float* dln1 = qkv_.backward(work.dqkv, a.ln1, scratch, kept(a.qkv));
  op.layernorm_backward(dx, g.ln1_w, g.ln1_b, dln1, x, w.ln1_w, a.ln1_mean, a.ln1_rstd, local_rows, C);
  op.residual_backward(dx, work.dres2, local_NC);  // the residual path around attention
}

void TPBlock::backward_weight(const TPBlockActivations& a, TPWorkspace& work) {
  if (a.recompute == Recompute::Full) {
    throw CourseError("TP rank " + std::to_string(tp_.rank()) + ": backward_weight of a block with --recompute " +
                      "full, whose activations are gone (check_recompute_schedule refuses zb-h1 with it)");
  }
  // dW += dy^T x for each linear layer, in the order the whole backward does them
  fcproj_.backward_weight(a.dfcproj_out, a.fch_gelu);
  fc_.backward_weight(a.fch, a.ln2, work.scratch);
  proj_.backward_weight(a.dproj_out, a.atty);
  qkv_.backward_weight(a.qkv, a.ln1, work.scratch);
}

// ----------------------------------------------------------------------------
// head: final LayerNorm, f, vocabulary-parallel LM head and cross-entropy

TPHead::TPHead(TPGroup& tp, const GPTConfig& config, const HeadWeights& w, const HeadWeights& g)
    : tp_(tp),
      config_(config),
      params_(w),
      grads_(g),
      lm_head_(tp, {w.lm_head_w, nullptr, g.lm_head_w, nullptr}, config.vocab_size / tp.size()) {}

void TPHead::forward(TPHeadActivations& a, const float* x, const int* targets, TPWorkspace& work, StepLoss& loss) {
  const int B = tp_.batch(), T = tp_.seq(), C = tp_.width(), Vl = config_.vocab_size / tp_.size();
  const OpTable& op = tp_.ops();
  layernorm_into(op, a.lnf, a.lnf_mean, a.lnf_rstd, x, params_.lnf_w, params_.lnf_b, B * tp_.local_seq(), C);
  lm_head_.forward(a.logits, a.lnf, work.scratch);
  vocab_crossentropy_forward(tp_, a.losses, a.probs, a.logits, targets, work.reduce.data(), tp_.rank() * Vl, B, T,
                             Vl);
  loss.add(a.losses, static_cast<int64_t>(B) * T);
}

void TPHead::backward(TPHeadActivations& a, const float* x, const int* targets, float dloss, float* dx,
                      TPWorkspace& work, bool defer_weights) {
  const int B = tp_.batch(), T = tp_.seq(), C = tp_.width(), Vl = config_.vocab_size / tp_.size();
  const OpTable& op = tp_.ops();
  op.zero(work.dlogits, static_cast<int64_t>(B) * T * Vl);
  tp_.tp_ops().vocab_crossentropy_backward(work.dlogits, a.probs, targets, dloss, tp_.rank() * Vl, B, T, Vl);
  // deferring: the probabilities are spent, so they keep dL/d(logits) for the deferred GEMM
  const float* dlnf = lm_head_.backward(work.dlogits, a.lnf, work.scratch, defer_weights ? a.probs : nullptr);
  op.layernorm_backward(dx, grads_.lnf_w, grads_.lnf_b, dlnf, x, params_.lnf_w, a.lnf_mean, a.lnf_rstd,
                        B * tp_.local_seq(), C);
}

void TPHead::backward_weight(const TPHeadActivations& a, TPWorkspace& work) {
  lm_head_.backward_weight(a.probs, a.lnf, work.scratch);
}

// ----------------------------------------------------------------------------
// the part

TPPart::TPPart(const GPTConfig& config, TPGroup& tp, int first_stage, int last_stage, uint64_t seed,
               TPParamSource* source)
    : config_(config),
      tp_(tp),
      first_stage_(first_stage),
      last_stage_(last_stage),
      layout_(tp_layout(config, first_stage, last_stage, tp.size())),
      stage_layouts_(tp_stage_layouts(config, first_stage, last_stage, tp.size())),
      stage_spans_(tp_stage_spans(stage_layouts_)),
      source_(source),
      blocks_(blocks_in(config, first_stage, last_stage)) {
  if (source_ == nullptr) {
    params = Buffer(layout_.numel, MemCategory::Parameters, tp.device());
    grads = Buffer(layout_.numel, MemCategory::Gradients, tp.device());
    // every element gets the value chapter 00 gives it: only this rank's slices are
    // made, on the host, then copied to the device
    std::vector<float> initial(layout_.numel);
    init_tp_params(layout_, seed, tp.rank(), tp.size(), initial.data());
    copy_bytes(params.data(), params.device(), initial.data(), Device::CPU, params.bytes());
  }
  // with a source: views of nothing yet, made again before each stage computes
  for (int stage = first_stage; stage <= last_stage; stage++) {
    bind_stage(stage, runs_in(params, stage), runs_in(grads, stage));
  }
}

StageRuns TPPart::runs_in(Buffer& whole, int stage) const {
  if (whole.size() == 0) return {};
  const TPStageSpan& span = stage_spans_[stage - first_stage_];
  return {whole.data() + span.split_begin, whole.data() + span.replicated_begin};
}

void TPPart::bind_stage(int stage, StageRuns params_at, StageRuns grads_at) {
  const TPLayout& alone = stage_layouts_[stage - first_stage_];
  // a tensor's offset in the stage alone: in its split run, then its replicated one
  const auto in = [&alone](const StageRuns& runs, const std::string& name) -> float* {
    const size_t offset = alone.find(name).local_offset;
    if (offset < alone.replicated_offset) return runs.split == nullptr ? nullptr : runs.split + offset;
    return runs.replicated == nullptr ? nullptr : runs.replicated + (offset - alone.replicated_offset);
  };
  const auto w = [&](const std::string& name) { return in(params_at, name); };
  const auto g = [&](const std::string& name) { return in(grads_at, name); };
  if (stage == 0) {
    embedding_.emplace(tp_, config_, EmbeddingWeights{w("wte"), w("wpe")}, EmbeddingWeights{g("wte"), g("wpe")});
  } else if (stage == config_.n_layer + 1) {
    head_.emplace(tp_, config_, HeadWeights{w("lnf_w"), w("lnf_b"), w("lm_head_w")},
                  HeadWeights{g("lnf_w"), g("lnf_b"), g("lm_head_w")});
  } else {
    const std::string p = "block" + std::to_string(stage - 1) + ".";
    const auto block = [&](const auto& at) {
      return BlockWeights{at(p + "ln1_w"), at(p + "ln1_b"), at(p + "qkv_w"),    at(p + "qkv_b"),
                          at(p + "proj_w"), at(p + "proj_b"), at(p + "ln2_w"), at(p + "ln2_b"),
                          at(p + "fc_w"),  at(p + "fc_b"),  at(p + "fcproj_w"), at(p + "fcproj_b"),
                          MoeWeights{}};  // dense blocks only
    };
    blocks_[stage - block_stage(0)].emplace(tp_, config_, block(w), block(g));
  }
}

std::vector<TPLayout> tp_stage_layouts(const GPTConfig& config, int first_stage, int last_stage, int ranks) {
  std::vector<TPLayout> layouts;
  for (int stage = first_stage; stage <= last_stage; stage++) layouts.push_back(tp_layout(config, stage, stage, ranks));
  return layouts;
}

std::vector<TPStageSpan> tp_stage_spans(const std::vector<TPLayout>& stage_layouts) {
  std::vector<TPStageSpan> spans;  // each after the one before it, in both runs
  TPStageSpan span;
  for (const TPLayout& own : stage_layouts) {
    span.split_begin = span.split_end;
    span.split_end += own.replicated_offset;
    span.replicated_begin = span.replicated_end;
    span.replicated_end += own.numel - own.replicated_offset;
    spans.push_back(span);
  }
  // the replicated runs start after every stage's split run
  for (TPStageSpan& each : spans) {
    each.replicated_begin += span.split_end;
    each.replicated_end += span.split_end;
  }
  return spans;
}

TPStageSpan TPPart::stage_span(int stage) const {
  if (stage < first_stage_ || stage > last_stage_) {
    throw CourseError("TP rank " + std::to_string(tp_.rank()) + ": stage " + std::to_string(stage) +
                      " is not in this part (stages " + std::to_string(first_stage_) + "-" +
                      std::to_string(last_stage_) + ")");
  }
  return stage_spans_[stage - first_stage_];
}

template <typename Compute>
void TPPart::run_stage(int stage, int next_stage, Compute&& compute) {
  if (source_ == nullptr) {
    compute();
    return;
  }
  bind_stage(stage, source_->stage_params(stage, next_stage), runs_in(grads, stage));
  compute();
  source_->stage_done(stage);
}

const float* TPPart::block_input(const TPActivations& acts, int block) const {
  return block == 0 ? acts.input.data() : acts.blocks[block - 1].out;
}

const float* TPPart::output(const TPActivations& acts) const {
  return acts.blocks.empty() ? acts.input.data() : acts.blocks.back().out;
}

void TPPart::forward(TPActivations& acts, TPWorkspace& work, StepLoss& loss) {
  if (embedding_ || head_) acts.batch.upload();
  // forward: the stages in order, each next the one after it
  const auto after = [&](int stage) { return stage < last_stage_ ? stage + 1 : -1; };
  if (embedding_) {
    run_stage(0, after(0), [&] { embedding_->forward(acts.input.data(), acts.batch.device_tokens(), work); });
  }
  for (int b = 0; b < static_cast<int>(blocks_.size()); b++) {
    const int stage = block_stage(b);
    run_stage(stage, after(stage), [&] { blocks_[b]->forward(acts.blocks[b], block_input(acts, b), work); });
  }
  if (head_) {
    run_stage(last_stage_, -1,
              [&] { head_->forward(acts.head[0], output(acts), acts.batch.device_targets(), work, loss); });
  }
}

void TPPart::backward(TPActivations& acts, const float* dout, float* dinput, float dloss, TPWorkspace& work) {
  backward_pass(acts, dout, dinput, dloss, work, /*defer_weights=*/false);
}

void TPPart::backward_input(TPActivations& acts, const float* dout, float* dinput, float dloss, TPWorkspace& work) {
  backward_pass(acts, dout, dinput, dloss, work, /*defer_weights=*/true);
}

void TPPart::backward_weight(TPActivations& acts, TPWorkspace& work) {
  // not run_stage: the weight halves read no parameters (the embedding has no weight half)
  if (head_) head_->backward_weight(acts.head[0], work);
  for (int b = static_cast<int>(blocks_.size()) - 1; b >= 0; b--) blocks_[b]->backward_weight(acts.blocks[b], work);
}

// common/model/part_backward.h's walk over this part's stages
void TPPart::backward_pass(TPActivations& acts, const float* dout, float* dinput, float dloss, TPWorkspace& work,
                           bool defer_weights) {
  // backward: the stages in reverse, each next the one before it
  const auto before = [&](int stage) { return stage > first_stage_ ? stage - 1 : -1; };
  PartBackwardStages stages;
  if (head_) {
    stages.head = [&](float* dx) {
      run_stage(last_stage_, before(last_stage_), [&] {
        head_->backward(acts.head[0], output(acts), acts.batch.device_targets(), dloss, dx, work, defer_weights);
      });
    };
  }
  stages.blocks = static_cast<int>(blocks_.size());
  stages.block = [&](int b, const float* d, float* dx) {
    run_stage(block_stage(b), before(block_stage(b)),
              [&] { blocks_[b]->backward(acts.blocks[b], block_input(acts, b), d, dx, work, defer_weights); });
  };
  if (embedding_) {
    stages.embedding = [&](const float* d) {
      run_stage(0, -1, [&] { embedding_->backward(d, acts.batch.device_tokens(), work); });
    };
  }
  const int64_t local_NC = static_cast<int64_t>(tp_.batch()) * tp_.local_seq() * config_.d_model;
  walk_part_backward(stages, dout, dinput, work.residual_grad, local_NC, tp_.device());
}

void TPPart::finish_gradients() {
  if (tp_.sequence_parallel()) {
    tp_.all_reduce(grads.data() + layout_.replicated_offset, replicated_count(), ReduceOp::Sum,
                   "replicated gradients all-reduce (sp)");
  }
}

double TPPart::grad_norm_squared() {
  // the split range: each rank holds different elements, so the squares add up over the group
  float split = static_cast<float>(course::grad_norm_squared(grads.data(), layout_.replicated_offset, grads.device()));
  tp_.comm().all_reduce(&split, 1);
  // the replicated range: the same numbers on every rank, counted once
  return static_cast<double>(split) +
         course::grad_norm_squared(grads.data() + layout_.replicated_offset, replicated_count(), grads.device());
}

void TPPart::clip_gradients(double norm, float max_norm) {
  clip_grads(grads.data(), grads.size(), norm, max_norm, grads.device());
}

// ----------------------------------------------------------------------------
// chapter 06's whole model

void add_tp_flags(ArgParser& parser, TPFlags& flags) {
  parser.add_int("--tp", &flags.tp, 0, "tensor-parallel ranks (each holds 1/tp of every matrix); 0 = the world size");
  parser.add_switch("--sp", &flags.sequence_parallel,
                    "sequence parallelism: LayerNorms and residuals on 1/tp of the sequence");
}

JsonLine TPGPT::summary_fields() const {
  return JsonLine()
      .add("tp", group().size())
      .add("sequence_parallel", group().sequence_parallel() ? 1 : 0)
      .add("params_per_rank", params.size())
      .add("replicated_params", replicated_count());
}

void TPGPT::print_logits_saving(int micro_batch) const {
  const GPTConfig& model = config();
  // the bytes of chapter 00's (B, T, V) logits; their probabilities take as many again
  const double full_logits = 4.0 * micro_batch * model.seq_len * model.vocab_size;
  std::printf("logits and their probabilities: %s per rank instead of chapter 00's %s (never gathered)\n",
              format_bytes(2 * full_logits / group().size()).c_str(), format_bytes(2 * full_logits).c_str());
}

TPGPT::TPGPT(const GPTConfig& config, TPGroup& tp, uint64_t seed)
    : TPPart(config, tp, 0, config.n_layer + 1, seed),
      acts_(config, tp, 0, config.n_layer + 1, /*split_backward=*/false, config.recompute),
      workspace_(config, tp, config.recompute) {}

void TPGPT::forward(const int* tokens, const int* targets, StepLoss& loss) {
  acts_.batch.fill(tokens, targets);
  TPPart::forward(acts_, workspace_, loss);
}

void TPGPT::backward(float dloss) { TPPart::backward(acts_, /*dout=*/nullptr, /*dinput=*/nullptr, dloss, workspace_); }

// ----------------------------------------------------------------------------
// checkpoints: one file per rank

// How --tp N cuts the model, as the manifest says it.
static std::string tp_cut(int ranks) {
  return "06_tensor_parallel at --tp " + std::to_string(ranks) + " (rows, columns, replicated parameters)";
}

std::vector<ManifestPiece> tp_pieces(const TPLayout& layout, int rank, int ranks, size_t begin, size_t count) {
  const size_t end = std::min(layout.numel, count == SIZE_MAX ? layout.numel : begin + count);
  std::vector<const TPParam*> in_buffer_order;
  for (const TPParam& param : layout.params) in_buffer_order.push_back(&param);
  std::sort(in_buffer_order.begin(), in_buffer_order.end(),
            [](const TPParam* a, const TPParam* b) { return a->local_offset < b->local_offset; });
  std::vector<ManifestPiece> pieces;
  for (const TPParam* param : in_buffer_order) {
    // the part of [begin, end) inside this parameter's local elements
    const size_t lo = std::max(begin, param->local_offset);
    const size_t hi = std::min(end, param->local_offset + param->local_numel);
    if (lo >= hi) continue;
    const size_t skip = lo - param->local_offset;
    const auto global_of = [&](size_t i) { return global_index(*param, rank, ranks, skip + i); };
    const std::vector<ManifestPiece> mine = pieces_of_indices(param->global.name, hi - lo, global_of);
    pieces.insert(pieces.end(), mine.begin(), mine.end());
  }
  return pieces;
}

// How --tp N cuts the model: every rank's slices, from the layout every rank shares
// (another --tp at resume: resharding).
static ShardedCut tp_checkpoint_cut(const TPLayout& layout, int ranks) {
  const auto shards_of = [layout, ranks](int rank) {
    return std::vector<ManifestShard>{{"", "params", "adam_m", "adam_v", tp_pieces(layout, rank, ranks)}};
  };
  return {tp_cut(ranks), ranks, shards_of};
}

void save_tp_checkpoint(const TrainOptions& options, const Comm& comm, int step, const TPPart& part,
                        const AdamW& optimizer) {
  save_sharded(options, step, comm.rank(), tp_checkpoint_cut(part.layout(), comm.size()),
               {{part.params.data(), optimizer.m.data(), optimizer.v.data(), part.params.device()}},
               {{"tensor_parallel", comm.size()}});
}

int resume_tp_if_asked(const TrainOptions& options, const Comm& comm, TPPart& part, AdamW& optimizer, bool verbose) {
  return resume_sharded(options, comm.rank(), tp_checkpoint_cut(part.layout(), comm.size()),
                        {{part.params.data(), optimizer.m.data(), optimizer.v.data(), part.params.device()}}, verbose);
}

}  // namespace course
