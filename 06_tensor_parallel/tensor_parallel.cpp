#include "06_tensor_parallel/tensor_parallel.h"

#include <cstdio>

#include "common/tensor/error.h"
#include "common/tensor/ops.h"

namespace course {

// ----------------------------------------------------------------------------
// f and g

TPGroup::TPGroup(Comm& comm, bool sequence_parallel, int B, int T, int C, Device device, DType message_type)
    : comm_(comm),
      sequence_parallel_(sequence_parallel),
      B_(B),
      T_(T),
      C_(C),
      device_(device),
      message_type_(message_type) {
  const size_t whole = static_cast<size_t>(B) * T * C;
  if (message_type_ == DType::BF16) sum_message_ = TypedBuffer<bf16>(whole, MemCategory::CommBuffers, device);
  if (!sequence_parallel_) return;
  gather_staging_ = Buffer(whole, MemCategory::CommBuffers, device);
  scatter_staging_ = Buffer(whole, MemCategory::CommBuffers, device);
  if (message_type_ == DType::BF16) {
    scattered_message_ = TypedBuffer<bf16>(whole / size(), MemCategory::CommBuffers, device);
    chunk_message_ = TypedBuffer<bf16>(whole / size(), MemCategory::CommBuffers, device);
    gathered_message_ = TypedBuffer<bf16>(whole, MemCategory::CommBuffers, device);
  }
}

LinearInput TPGroup::f_forward(const LinearInput& x, float* whole) {
  Work gathered = f_forward_start(x);
  return f_forward_finish(gathered, x, whole);
}

Work TPGroup::f_forward_start(const LinearInput& x) {
  return x.bf16_values != nullptr ? gather_start(x.bf16_values) : gather_start(x.fp32);
}

LinearInput TPGroup::f_forward_finish(Work& gathered, const LinearInput& x, float* whole) {
  if (!sequence_parallel_) return x;
  // The gathered chunks are widened into fp32 `whole` (the values bf16 holds), as every
  // gather's are: putting them in sequence order is copy_strided's, an fp32 op. The
  // layer's GEMM then rounds them to themselves, the same bits as reading bf16.
  gather_finish(gathered, x.fp32, whole, "f all-gather (sp)");
  return LinearInput(whole);
}

const float* TPGroup::gather(const float* chunk, float* whole, const char* name) {
  Work gathered = gather_start(chunk);
  return gather_finish(gathered, chunk, whole, name);
}

Work TPGroup::gather_start(const float* chunk) {
  if (!sequence_parallel_) return Work();
  const size_t floats = static_cast<size_t>(B_) * local_seq() * C_;
  if (message_type_ == DType::F32) {
    return comm_.all_gather_async(chunk, gather_staging_.data(), std::vector<size_t>(size(), floats));
  }
  // m = bf16(x): the chunks gathered in half the bytes
  ops().cast_to_bf16(chunk_message_.data(), chunk, static_cast<int64_t>(floats));
  return gather_start(chunk_message_.data());
}

Work TPGroup::gather_start(const bf16* chunk) {
  if (!sequence_parallel_) return Work();
  if (message_type_ != DType::BF16) {
    throw CourseError("TPGroup: a bf16-stored input to gather, and fp32 messages (a bf16-stored LinearInput exists "
                      "only under --dtype bf16, whose TPGroup sends bf16; a bug)");
  }
  const size_t values = static_cast<size_t>(B_) * local_seq() * C_;
  // the chunk is the bf16 message itself (a LinearInput's: rounded once, where LayerNorm made it)
  return comm_.all_gather_async(chunk, gathered_message_.data(), std::vector<size_t>(size(), values));
}

const float* TPGroup::gather_finish(Work& gathered, const float* chunk, float* whole, const char* name) {
  if (!sequence_parallel_) return chunk;
  wait_traced(gathered, name);
  if (message_type_ == DType::BF16) {
    ops().cast_to_fp32(gather_staging_.data(), gathered_message_.data(), static_cast<int64_t>(gather_staging_.size()));
  }
  from_rank_major(gather_staging_.data(), whole);
  return whole;
}

const float* TPGroup::f_backward(float* d_partial, float* d_local) {
  Work sum = f_backward_start(d_partial, d_local);
  f_backward_wait(sum);
  return f_backward_result(d_partial, d_local);
}

void TPGroup::f_backward_wait(Work& sum) {
  finish_sum(sum, sequence_parallel_ ? "f reduce-scatter (sp)" : "f all-reduce");
}

Work TPGroup::f_backward_start(float* d_partial, float* d_local) {
  const size_t whole = static_cast<size_t>(B_) * T_ * C_;
  const std::vector<size_t> counts(size(), whole / size());
  if (message_type_ == DType::F32) {
    if (!sequence_parallel_) return comm_.all_reduce_async(d_partial, whole);
    to_rank_major(d_partial, scatter_staging_.data());
    return comm_.reduce_scatter_async(scatter_staging_.data(), d_local, counts);
  }
  // m = bf16(partial): summed in half the bytes, widened by finish_sum
  sum_destination_ = sequence_parallel_ ? d_local : d_partial;
  if (!sequence_parallel_) {
    ops().cast_to_bf16(sum_message_.data(), d_partial, static_cast<int64_t>(whole));
    return comm_.all_reduce_async(sum_message_.data(), whole);
  }
  to_rank_major(d_partial, scatter_staging_.data());
  ops().cast_to_bf16(sum_message_.data(), scatter_staging_.data(), static_cast<int64_t>(whole));
  return comm_.reduce_scatter_async(sum_message_.data(), scattered_message_.data(), counts);
}

void TPGroup::finish_sum(Work& sum, const char* name) {
  wait_traced(sum, name);
  if (message_type_ == DType::F32) return;
  // x = float(sum): this rank's result, exact in fp32
  const bf16* result = sequence_parallel_ ? scattered_message_.data() : sum_message_.data();
  const size_t count = static_cast<size_t>(B_) * local_seq() * C_;
  ops().cast_to_fp32(sum_destination_, result, static_cast<int64_t>(count));
}

// g is f with forward and backward swapped (only the names in the trace differ)
const float* TPGroup::g_forward(float* y_partial, float* y_local) {
  Work sum = f_backward_start(y_partial, y_local);
  finish_sum(sum, sequence_parallel_ ? "g reduce-scatter (sp)" : "g all-reduce");
  return f_backward_result(y_partial, y_local);
}

const float* TPGroup::g_backward(const float* dy, float* whole) { return gather(dy, whole, "g all-gather (sp)"); }

void TPGroup::all_reduce(float* data, size_t count, ReduceOp op, const char* name) {
  Work work = comm_.all_reduce_async(data, count, op);
  wait_traced(work, name);
}

void TPGroup::trace_compute_since(const char* name, double start_seconds) const {
  if (trace_ != nullptr) trace_compute(trace_, name, start_seconds);
}

// the span is when the collective ran on the communication thread, and its
// queued_us how long before that this thread issued it; the exposed time is how
// long this thread waited for it
void TPGroup::wait_traced(Work& work, const char* name) {
  const double waited_from = now_seconds();
  const OpInterval ran = work.wait();
  if (meters_ != nullptr) meters_->record_exposed(now_seconds() - waited_from, meters_axis_);
  trace_collective(trace_, name, ran);
}

// whole (B, T, C) -> rank_major (N, B, T/N, C): sequence b's chunk r goes to block r.
// Block r is B rows of one chunk each (T/N C floats), taken from the B sequences of
// `whole` (rows of T C floats) at chunk r's columns.
void TPGroup::to_rank_major(const float* whole, float* rank_major) const {
  const int64_t chunk = static_cast<int64_t>(local_seq()) * C_, sequence = static_cast<int64_t>(T_) * C_;
  for (int r = 0; r < size(); r++) {
    ops().copy_strided(rank_major + r * B_ * chunk, chunk, whole + r * chunk, sequence, B_, chunk);
  }
}

void TPGroup::from_rank_major(const float* rank_major, float* whole) const {
  const int64_t chunk = static_cast<int64_t>(local_seq()) * C_, sequence = static_cast<int64_t>(T_) * C_;
  for (int r = 0; r < size(); r++) {
    ops().copy_strided(whole + r * chunk, sequence, rank_major + r * B_ * chunk, chunk, B_, chunk);
  }
}

// ----------------------------------------------------------------------------
// the parallel linear layers

ColumnParallelLinear::ColumnParallelLinear(TPGroup& tp, const LinearSlice& slice, int OCl)
    : tp_(tp), slice_(slice), out_features_(OCl) {}

void ColumnParallelLinear::forward(float* y, const LinearInput& x_local, TPScratch& scratch) {
  const LinearInput x = tp_.f_forward(x_local, scratch.whole);
  linear_from(tp_.ops(), y, x, slice_.weight, slice_.bias, tp_.batch() * tp_.seq(), tp_.width(), out_features_);
}

const float* ColumnParallelLinear::backward(const float* dy, const LinearInput& x_local, TPScratch& scratch,
                                            float* kept_dy) {
  const int rows = tp_.batch() * tp_.seq(), C = tp_.width();
  const OpTable& op = tp_.ops();
  const bool weight_now = kept_dy == nullptr;
  // with SP, x's chunks travel while dx = dy W is computed, which does not need them
  Work gathered = weight_now ? tp_.f_forward_start(x_local) : Work();
  const double start = now_seconds();
  op.zero(scratch.partial, static_cast<int64_t>(rows) * C);
  op.linear_backward(scratch.partial, nullptr, slice_.dbias, dy, nullptr, slice_.weight, rows, C, out_features_);
  tp_.trace_compute_since("dgrad GEMM", start);
  const LinearInput x = weight_now ? tp_.f_forward_finish(gathered, x_local, scratch.whole) : LinearInput();
  // and dx's sum over the ranks travels while dW = dy^T x is computed
  Work sum = tp_.f_backward_start(scratch.partial, scratch.dlocal);
  if (weight_now) {
    weight_gradient(dy, x);
  } else {
    op.copy_strided(kept_dy, out_features_, dy, out_features_, rows, out_features_);
  }
  tp_.f_backward_wait(sum);
  return tp_.f_backward_result(scratch.partial, scratch.dlocal);
}

void ColumnParallelLinear::backward_weight(const float* kept_dy, const LinearInput& x_local, TPScratch& scratch) {
  weight_gradient(kept_dy, tp_.f_forward(x_local, scratch.whole));
}

void ColumnParallelLinear::weight_gradient(const float* dy, const LinearInput& x) {
  const double start = now_seconds();
  linear_backward_from(tp_.ops(), nullptr, slice_.dweight, nullptr, dy, x, nullptr, tp_.batch() * tp_.seq(),
                       tp_.width(), out_features_);
  tp_.trace_compute_since("wgrad GEMM", start);
}

RowParallelLinear::RowParallelLinear(TPGroup& tp, const LinearSlice& slice, int ICl)
    : tp_(tp), slice_(slice), in_features_(ICl) {}

void RowParallelLinear::forward(float* out, const LinearInput& x, const float* residual, TPScratch& scratch) {
  linear_from(tp_.ops(), scratch.partial, x, slice_.weight, nullptr, tp_.batch() * tp_.seq(), in_features_,
              tp_.width());
  const float* y = tp_.g_forward(scratch.partial, out);  // with SP already in out
  tp_.tp_ops().bias_residual_forward(out, residual, y, slice_.bias, tp_.batch() * tp_.local_seq(), tp_.width());
}

void RowParallelLinear::backward(float* dx, const float* dout_local, const LinearInput& x, TPScratch& scratch,
                                 float* kept_dy) {
  const int rows = tp_.batch() * tp_.seq(), C = tp_.width();
  const OpTable& op = tp_.ops();
  // db += sum of dout's rows: linear_backward with the bias gradient alone computes just that
  op.linear_backward(nullptr, nullptr, slice_.dbias, dout_local, nullptr, nullptr, tp_.batch() * tp_.local_seq(),
                     in_features_, C);
  const float* dy = tp_.g_backward(dout_local, scratch.whole);  // (B, T, C)
  float* dweight = kept_dy == nullptr ? slice_.dweight : nullptr;  // deferring: not now
  linear_backward_from(op, dx, dweight, nullptr, dy, x, slice_.weight, rows, in_features_, C);
  if (kept_dy != nullptr) op.copy_strided(kept_dy, C, dy, C, rows, C);
}

void RowParallelLinear::backward_weight(const float* kept_dy, const LinearInput& x) {
  linear_backward_from(tp_.ops(), nullptr, slice_.dweight, nullptr, kept_dy, x, nullptr, tp_.batch() * tp_.seq(),
                       in_features_, tp_.width());
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
                     ": every rank needs an equal share (hint: " + hint + "; chapter 06's --tp is the world size " +
                     "unless given)");
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
// the vocabulary-parallel cross-entropy

void vocab_crossentropy_forward(TPGroup& tp, float* losses, float* probs_local, const float* logits_local,
                                const int* targets, float* reduce_scratch, int vocab_start, int B, int T, int Vl) {
  const int rows = B * T;
  const TPOpTable& op = tp.tp_ops();
  float* row_max = reduce_scratch;         // (B, T)
  float* sum_exp = reduce_scratch + rows;  // (B, T)
  float* target_logit = sum_exp + rows;    // (B, T)  right after sum_exp: one all-reduce for both
  op.vocab_crossentropy_local_max(row_max, logits_local, B, T, Vl);
  // m = max over every rank's slice of the row
  tp.all_reduce(row_max, rows, ReduceOp::Max, "cross-entropy max all-reduce");
  op.vocab_crossentropy_local_sums(probs_local, sum_exp, target_logit, logits_local, row_max, targets, vocab_start, B,
                                   T, Vl);
  // s and z_t, summed over the ranks in one all-reduce
  tp.all_reduce(sum_exp, 2 * static_cast<size_t>(rows), ReduceOp::Sum, "cross-entropy sum all-reduce");
  op.vocab_crossentropy_finish(losses, probs_local, row_max, sum_exp, target_logit, B, T, Vl);
}

}  // namespace course
