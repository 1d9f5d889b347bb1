#include "06_tensor_parallel/tensor_parallel.h"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/error.h"
#include "common/ops.h"

namespace course {

// ----------------------------------------------------------------------------
// f and g

TPGroup::TPGroup(Comm& comm, bool sequence_parallel, int B, int T, int C)
    : comm_(comm), sequence_parallel_(sequence_parallel), B_(B), T_(T), C_(C) {
  if (sequence_parallel_) staging_ = Buffer(static_cast<size_t>(B) * T * C, MemCategory::CommBuffers);
}

const float* TPGroup::f_forward(const float* x, float* whole) { return gather(x, whole, "f all-gather (sp)"); }

const float* TPGroup::gather(const float* chunk, float* whole, const char* name) {
  if (!sequence_parallel_) return chunk;
  const size_t floats = static_cast<size_t>(B_) * local_seq() * C_;
  Work gathered = comm_.all_gather_async(chunk, staging_.data(), std::vector<size_t>(size(), floats));
  wait_traced(gathered, name);
  from_rank_major(staging_.data(), whole);
  return whole;
}

const float* TPGroup::f_backward(float* d_partial, float* d_local) {
  Work sum = f_backward_start(d_partial, d_local);
  f_backward_wait(sum);
  return f_backward_result(d_partial, d_local);
}

void TPGroup::f_backward_wait(Work& sum) {
  wait_traced(sum, sequence_parallel_ ? "f reduce-scatter (sp)" : "f all-reduce");
}

Work TPGroup::f_backward_start(float* d_partial, float* d_local) {
  const size_t whole = static_cast<size_t>(B_) * T_ * C_;
  if (!sequence_parallel_) return comm_.all_reduce_async(d_partial, whole);
  to_rank_major(d_partial, staging_.data());
  return comm_.reduce_scatter_async(staging_.data(), d_local, std::vector<size_t>(size(), whole / size()));
}

// g is f with forward and backward swapped (only the names in the trace differ)
const float* TPGroup::g_forward(float* y_partial, float* y_local) {
  Work sum = f_backward_start(y_partial, y_local);
  wait_traced(sum, sequence_parallel_ ? "g reduce-scatter (sp)" : "g all-reduce");
  return f_backward_result(y_partial, y_local);
}

const float* TPGroup::g_backward(const float* dy, float* whole) { return gather(dy, whole, "g all-gather (sp)"); }

void TPGroup::all_reduce(float* data, size_t count, ReduceOp op, const char* name) {
  Work work = comm_.all_reduce_async(data, count, op);
  wait_traced(work, name);
}

// the span is when the collective ran on the communication thread
void TPGroup::wait_traced(Work& work, const char* name) {
  const OpInterval ran = work.wait();
  trace_communication(trace_, name, ran.start, ran.end);
}

// whole (B, T, C) -> rank_major (N, B, T/N, C): sequence b's chunk r goes to block r
void TPGroup::to_rank_major(const float* whole, float* rank_major) const {
  const size_t row = static_cast<size_t>(local_seq()) * C_;  // one sequence's chunk
  for (int r = 0; r < size(); r++) {
    for (int b = 0; b < B_; b++) {
      std::memcpy(rank_major + (static_cast<size_t>(r) * B_ + b) * row,
                  whole + static_cast<size_t>(b) * T_ * C_ + r * row, row * sizeof(float));
    }
  }
}

void TPGroup::from_rank_major(const float* rank_major, float* whole) const {
  const size_t row = static_cast<size_t>(local_seq()) * C_;
  for (int r = 0; r < size(); r++) {
    for (int b = 0; b < B_; b++) {
      std::memcpy(whole + static_cast<size_t>(b) * T_ * C_ + r * row,
                  rank_major + (static_cast<size_t>(r) * B_ + b) * row, row * sizeof(float));
    }
  }
}

// ----------------------------------------------------------------------------
// the parallel linear layers

ColumnParallelLinear::ColumnParallelLinear(TPGroup& tp, const LinearSlice& slice, int OCl)
    : tp_(tp), slice_(slice), out_features_(OCl) {}

void ColumnParallelLinear::forward(float* y, const float* x_local, TPScratch& scratch) {
  const float* x = tp_.f_forward(x_local, scratch.whole);
  ops::linear_forward(y, x, slice_.weight, slice_.bias, tp_.batch() * tp_.seq(), tp_.width(), out_features_);
}

const float* ColumnParallelLinear::backward(const float* dy, const float* x_local, TPScratch& scratch,
                                            float* kept_dy) {
  const int rows = tp_.batch() * tp_.seq(), C = tp_.width();
  ops::zero(scratch.partial, static_cast<int64_t>(rows) * C);
  // dx first, so that its sum over the ranks travels while dW = dy^T x is computed
  ops::linear_backward(scratch.partial, nullptr, slice_.dbias, dy, nullptr, slice_.weight, rows, C, out_features_);
  Work sum = tp_.f_backward_start(scratch.partial, scratch.dlocal);
  if (kept_dy == nullptr) backward_weight(dy, x_local, scratch);
  tp_.f_backward_wait(sum);
  if (kept_dy != nullptr) std::memcpy(kept_dy, dy, sizeof(float) * rows * out_features_);
  return tp_.f_backward_result(scratch.partial, scratch.dlocal);
}

void ColumnParallelLinear::backward_weight(const float* kept_dy, const float* x_local, TPScratch& scratch) {
  const float* x = tp_.f_forward(x_local, scratch.whole);
  ops::linear_backward(nullptr, slice_.dweight, nullptr, kept_dy, x, nullptr, tp_.batch() * tp_.seq(), tp_.width(),
                       out_features_);
}

RowParallelLinear::RowParallelLinear(TPGroup& tp, const LinearSlice& slice, int ICl)
    : tp_(tp), slice_(slice), in_features_(ICl) {}

void RowParallelLinear::forward(float* out, const float* x, const float* residual, TPScratch& scratch) {
  ops::linear_forward(scratch.partial, x, slice_.weight, nullptr, tp_.batch() * tp_.seq(), in_features_,
                      tp_.width());
  const float* y = tp_.g_forward(scratch.partial, out);  // with SP already in out
  bias_residual_forward(out, residual, y, slice_.bias, tp_.batch() * tp_.local_seq(), tp_.width());
}

void RowParallelLinear::backward(float* dx, const float* dout_local, const float* x, TPScratch& scratch,
                                 float* kept_dy) {
  const int rows = tp_.batch() * tp_.seq(), C = tp_.width();
  bias_backward(slice_.dbias, dout_local, tp_.batch() * tp_.local_seq(), C);
  const float* dy = tp_.g_backward(dout_local, scratch.whole);  // (B, T, C)
  float* dweight = kept_dy == nullptr ? slice_.dweight : nullptr;  // deferring: not now
  ops::linear_backward(dx, dweight, nullptr, dy, x, slice_.weight, rows, in_features_, C);
  if (kept_dy != nullptr) std::memcpy(kept_dy, dy, sizeof(float) * rows * C);
}

void RowParallelLinear::backward_weight(const float* kept_dy, const float* x) {
  ops::linear_backward(nullptr, slice_.dweight, nullptr, kept_dy, x, nullptr, tp_.batch() * tp_.seq(), in_features_,
                       tp_.width());
}

// ----------------------------------------------------------------------------
// the split of each parameter

static Split split_of(const std::string& name) {
  // the name after "blockN.", or the whole name for the embedding and the head
  const std::string field = name.substr(name.find('.') + 1);
  if (field == "qkv_w" || field == "qkv_b" || field == "fc_w" || field == "fc_b")
    return Split::Rows;                                                                               // column-parallel
  if (field == "proj_w" || field == "fcproj_w") return Split::Columns;                                // row-parallel
  if (field == "wte" || field == "lm_head_w") return Split::Rows;  // by vocabulary
  return Split::Replicated;  // LayerNorms, row-parallel biases, wpe
}

const TPParam& TPLayout::find(const std::string& name) const {
  for (const TPParam& param : params) {
    if (param.global.name == name) return param;
  }
  throw CourseError("tensor parallel layout: no parameter named " + name);
}

TPLayout tp_layout(const GPTConfig& config, int first_stage, int last_stage, int ranks) {
  const std::vector<StageLayout> stages = model_layout(config);
  TPLayout layout;
  std::vector<TPParam> replicated;
  for (int stage = first_stage; stage <= last_stage; stage++) {
    for (const ParamSpec& spec : stages[stage].params) {
      TPParam param;
      param.global = spec;
      param.split = split_of(spec.name);
      param.row_groups = spec.name.find("qkv") != std::string::npos ? 3 : 1;
      param.local_shape = spec.shape;
      if (param.split == Split::Rows) param.local_shape[0] /= ranks;
      if (param.split == Split::Columns) param.local_shape[1] /= ranks;
      param.local_numel = 1;
      for (int64_t d : param.local_shape) param.local_numel *= static_cast<size_t>(d);
      if (param.split == Split::Replicated) {
        replicated.push_back(param);
        continue;
      }
      param.local_offset = layout.numel;
      layout.numel += param.local_numel;
      layout.params.push_back(param);
    }
  }
  layout.replicated_offset = layout.numel;
  for (TPParam& param : replicated) {
    param.local_offset = layout.numel;
    layout.numel += param.local_numel;
    layout.params.push_back(param);
  }
  return layout;
}

size_t global_index(const TPParam& param, int rank, int ranks, size_t local_index) {
  const std::vector<int64_t>& shape = param.global.shape;
  const size_t cols = shape.size() > 1 ? static_cast<size_t>(shape[1]) : 1;  // a bias is one column
  switch (param.split) {
    case Split::Replicated: return local_index;
    case Split::Rows: {
      // rows come in row_groups groups (q, k, v), each cut into `ranks` equal slices
      const size_t group_rows = static_cast<size_t>(shape[0]) / param.row_groups;
      const size_t slice_rows = group_rows / ranks;
      const size_t local_row = local_index / cols;
      const size_t group = local_row / slice_rows, within = local_row % slice_rows;
      return (group * group_rows + rank * slice_rows + within) * cols + local_index % cols;
    }
    case Split::Columns: {
      const size_t local_cols = cols / ranks;
      return (local_index / local_cols) * cols + rank * local_cols + local_index % local_cols;
    }
  }
  return local_index;
}

void init_tp_params(const TPLayout& layout, uint64_t seed, int rank, int ranks, float* params) {
  for (const TPParam& param : layout.params) {
    float* dst = params + param.local_offset;
    for (size_t i = 0; i < param.local_numel; i++) {
      dst[i] = init_value(param.global, seed, global_index(param, rank, ranks, i));
    }
  }
}

void check_tp_shape(const GPTConfig& config, int tp, bool sequence_parallel) {
  const auto refuse = [&](const std::string& what, int value, const std::string& hint) {
    throw FlagError("--tp " + std::to_string(tp) + " does not divide " + what + " " + std::to_string(value) +
                     ": every rank needs an equal share (hint: " + hint + ")");
  };
  if (config.n_head % tp != 0) refuse("--heads", config.n_head, "use a --tp that divides the number of heads");
  if (config.d_model % tp != 0) refuse("--d-model", config.d_model, "use a --tp that divides --d-model");
  if (config.vocab_size % tp != 0) {
    refuse("the vocabulary of", config.vocab_size, "use a --tp that divides " + std::to_string(config.vocab_size));
  }
  if (sequence_parallel && config.seq_len % tp != 0) {
    refuse("--seq", config.seq_len, "with --sp each rank holds seq/tp positions: use a --seq that --tp divides");
  }
}

void print_tp_split(const GPTConfig& config, const TPGroup& tp, const std::string& backend) {
  const int N = tp.size(), hidden = 4 * config.d_model;
  std::printf("tensor parallel: %d ranks%s, backend %s\n", N, tp.sequence_parallel() ? ", sequence parallel" : "",
              backend.c_str());
  std::printf("  each rank: %d of %d heads, %d of %d MLP features, %d of %d vocabulary rows\n", config.n_head / N,
              config.n_head, hidden / N, hidden, config.vocab_size / N, config.vocab_size);
}

// ----------------------------------------------------------------------------
// bias, embeddings, cross-entropy

void bias_residual_forward(float* out, const float* residual, const float* y, const float* bias, int N, int C) {
  for (int i = 0; i < N; i++) {
    const size_t row = static_cast<size_t>(i) * C;
    // (y + b) + residual: chapter 00's order (linear_forward adds the bias, then the residual add)
    for (int c = 0; c < C; c++) out[row + c] = residual[row + c] + (y[row + c] + bias[c]);
  }
}

void bias_backward(float* dbias, const float* dout, int N, int C) {
  for (int i = 0; i < N; i++) {
    for (int c = 0; c < C; c++) dbias[c] += dout[static_cast<size_t>(i) * C + c];
  }
}

void vocab_embedding_forward(float* out, const int* tokens, const float* wte_local, int vocab_start, int Vl, int B,
                             int T, int C) {
  for (int i = 0; i < B * T; i++) {
    float* row = out + static_cast<size_t>(i) * C;
    const int local = tokens[i] - vocab_start;
    if (local < 0 || local >= Vl) {
      std::memset(row, 0, static_cast<size_t>(C) * sizeof(float));  // another rank's token: it adds the row
      continue;
    }
    std::memcpy(row, wte_local + static_cast<size_t>(local) * C, static_cast<size_t>(C) * sizeof(float));
  }
}

void vocab_embedding_backward(float* dwte_local, const float* dout, const int* tokens, int vocab_start, int Vl, int B,
                              int T, int C) {
  for (int i = 0; i < B * T; i++) {
    const int local = tokens[i] - vocab_start;
    if (local < 0 || local >= Vl) continue;
    float* drow = dwte_local + static_cast<size_t>(local) * C;
    const float* d = dout + static_cast<size_t>(i) * C;
    for (int c = 0; c < C; c++) drow[c] += d[c];
  }
}

void position_embedding_forward(float* out, const float* token_rows, const float* wpe, int first_position, int B,
                                int local_T, int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < local_T; t++) {
      const size_t row = (static_cast<size_t>(b) * local_T + t) * C;
      const float* position = wpe + static_cast<size_t>(first_position + t) * C;
      for (int c = 0; c < C; c++) out[row + c] = token_rows[row + c] + position[c];
    }
  }
}

void position_embedding_backward(float* dwpe, const float* dout, int first_position, int B, int local_T, int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < local_T; t++) {
      const float* d = dout + (static_cast<size_t>(b) * local_T + t) * C;
      float* dposition = dwpe + static_cast<size_t>(first_position + t) * C;
      for (int c = 0; c < C; c++) dposition[c] += d[c];
    }
  }
}

void vocab_crossentropy_forward(TPGroup& tp, float* losses, float* probs_local, const float* logits_local,
                                const int* targets, float* reduce_scratch, int vocab_start, int B, int T, int Vl) {
  const int rows = B * T;
  float* row_max = reduce_scratch;             // (B, T)
  float* sum_exp = reduce_scratch + rows;      // (B, T)
  float* target_logit = sum_exp + rows;        // (B, T)  right after sum_exp: one all-reduce for both
  for (int i = 0; i < rows; i++) {
    const float* z = logits_local + static_cast<size_t>(i) * Vl;
    float m = z[0];
    for (int v = 1; v < Vl; v++) m = std::fmax(m, z[v]);
    row_max[i] = m;
  }
  // m = max over every rank's slice of the row
  tp.all_reduce(row_max, rows, ReduceOp::Max, "cross-entropy max all-reduce");
  for (int i = 0; i < rows; i++) {
    const float* z = logits_local + static_cast<size_t>(i) * Vl;
    float* p = probs_local + static_cast<size_t>(i) * Vl;
    float sum = 0.0f;
    for (int v = 0; v < Vl; v++) {
      p[v] = std::exp(z[v] - row_max[i]);
      sum += p[v];
    }
    sum_exp[i] = sum;
    const int local = targets[i] - vocab_start;
    target_logit[i] = local >= 0 && local < Vl ? z[local] : 0.0f;  // only the owner's is non-zero
  }
  // s and z_t, summed over the ranks in one all-reduce
  tp.all_reduce(sum_exp, 2 * static_cast<size_t>(rows), ReduceOp::Sum, "cross-entropy sum all-reduce");
  for (int i = 0; i < rows; i++) {
    float* p = probs_local + static_cast<size_t>(i) * Vl;
    for (int v = 0; v < Vl; v++) p[v] /= sum_exp[i];
    // -log p[target] from the logits, as chapter 00 computes it
    losses[i] = -(target_logit[i] - row_max[i] - std::log(sum_exp[i]));
  }
}

void vocab_crossentropy_backward(float* dlogits_local, const float* probs_local, const int* targets, float dloss,
                                 int vocab_start, int B, int T, int Vl) {
  for (int i = 0; i < B * T; i++) {
    const float* p = probs_local + static_cast<size_t>(i) * Vl;
    float* dz = dlogits_local + static_cast<size_t>(i) * Vl;
    const int local = targets[i] - vocab_start;
    for (int v = 0; v < Vl; v++) dz[v] += (p[v] - (v == local ? 1.0f : 0.0f)) * dloss;
  }
}

}  // namespace course
