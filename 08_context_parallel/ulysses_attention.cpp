#include "08_context_parallel/ulysses_attention.h"

#include <string>
#include <vector>

#include "common/tensor/error.h"
#include "common/train/metrics.h"  // now_seconds
#include "common/tensor/ops.h"

namespace course {

AttentionBytes ulysses_attention_bytes(int B, int T, int C, int cp) {
  // each all_to_all sends N-1 of its N blocks; a block of qkv is B (T/N) 3 (C/N) floats
  const uint64_t block = static_cast<uint64_t>(B) * (T / cp) * (C / cp);  // one of q, k, v or y
  const uint64_t per_pass = 4 * block * static_cast<uint64_t>(cp - 1) * sizeof(float);  // 3 (qkv) + 1 (y)
  return {per_pass, per_pass};
}

void check_ulysses_heads(int heads, int cp) {
  if (heads % cp != 0) {
    throw FlagError("--cp-mode a2a needs the heads divisible by --cp: " + std::to_string(heads) + " heads over " +
                    std::to_string(cp) + " ranks (hint: --heads a multiple of " + std::to_string(cp) +
                    ", or --cp-mode ring)");
  }
}

UlyssesAttention::UlyssesAttention(const GPTConfig& config, const SequenceSplit& split, Comm& cp, Device device,
                                   DType message_type)
    : config_(config),
      split_(split),
      cp_(cp),
      device_(device),
      message_type_(message_type),
      head_channels_(config.d_model / cp.size()) {
  const int N = cp.size();
  check_ulysses_heads(config.n_head, N);
  if (split.cp() != N || split.seq_len() != config.seq_len) {
    throw CourseError("UlyssesAttention: a split of " + std::to_string(split.seq_len()) + " positions over " +
                      std::to_string(split.cp()) + " ranks for a cp group of " + std::to_string(N) +
                      " and sequences of " + std::to_string(config.seq_len) + " (a bug: build both from the flags)");
  }
}

ContextAttentionFloats ulysses_attention_floats(const GPTConfig& config, const SequenceSplit& split, int B) {
  const size_t T = config.seq_len, N = split.cp(), head_channels = config.d_model / N, heads = config.n_head / N;
  const size_t local_rows = static_cast<size_t>(B) * split.local_len();
  // this rank's heads of qkv at every position, then their probabilities
  const size_t saved = static_cast<size_t>(B) * T * 3 * head_channels + static_cast<size_t>(B) * heads * T * T;
  const size_t workspace = static_cast<size_t>(B) * T * head_channels + static_cast<size_t>(B) * T * 3 * head_channels;
  return {saved, 2 * local_rows * 3 * config.d_model, workspace + T * T};
}

size_t UlyssesAttention::saved_floats(int B) const { return ulysses_attention_floats(config_, split_, B).saved; }

void UlyssesAttention::allocate(int B) {
  if (B <= allocated_batch_) return;
  const size_t T = config_.seq_len, C = config_.d_model;
  const size_t local_rows = static_cast<size_t>(B) * split_.local_len();
  send_ = Buffer(local_rows * 3 * C, MemCategory::CommBuffers, device_);
  receive_ = Buffer(local_rows * 3 * C, MemCategory::CommBuffers, device_);
  if (message_type_ == DType::BF16) {
    send_message_ = TypedBuffer<bf16>(local_rows * 3 * C, MemCategory::CommBuffers, device_);
    receive_message_ = TypedBuffer<bf16>(local_rows * 3 * C, MemCategory::CommBuffers, device_);
  }
  y_ = Buffer(static_cast<size_t>(B) * T * head_channels_, MemCategory::Workspace, device_);
  dqkv_heads_ = Buffer(static_cast<size_t>(B) * T * 3 * head_channels_, MemCategory::Workspace, device_);
  dscores_ = Buffer(T * T, MemCategory::Workspace, device_);
  allocated_batch_ = B;
}

// ----------------------------------------------------------------------------
// moving heads and positions: each a few strided copies, on the run's device

void UlyssesAttention::split_heads(float* blocks, const float* matrix, size_t rows) const {
  const OpTable& op = ops_for(device_);
  const int64_t C = config_.d_model, width = head_channels_;
  for (int j = 0; j < cp_.size(); j++) {
    op.copy_strided(blocks + j * rows * width, width, matrix + j * width, C, static_cast<int64_t>(rows), width);
  }
}

void UlyssesAttention::join_heads(float* matrix, const float* blocks, size_t rows) const {
  const OpTable& op = ops_for(device_);
  const int64_t C = config_.d_model, width = head_channels_;
  for (int j = 0; j < cp_.size(); j++) {
    op.copy_strided(matrix + j * width, C, blocks + j * rows * width, width, static_cast<int64_t>(rows), width);
  }
}

// Chunk c of the owner is B runs of Tc rows: one per sequence, each contiguous on both sides.
void UlyssesAttention::place_positions(float* whole, const float* local, int owner, int width, int B) const {
  const OpTable& op = ops_for(device_);
  const int64_t T = config_.seq_len, Tc = split_.chunk_len();
  const std::vector<PositionChunk> chunks = split_.chunks_of(owner);
  for (size_t c = 0; c < chunks.size(); c++) {
    op.copy_strided(whole + static_cast<int64_t>(chunks[c].start) * width, T * width, local + c * B * Tc * width,
                    Tc * width, B, Tc * width);
  }
}

void UlyssesAttention::take_positions(float* local, const float* whole, int owner, int width, int B) const {
  const OpTable& op = ops_for(device_);
  const int64_t T = config_.seq_len, Tc = split_.chunk_len();
  const std::vector<PositionChunk> chunks = split_.chunks_of(owner);
  for (size_t c = 0; c < chunks.size(); c++) {
    op.copy_strided(local + c * B * Tc * width, Tc * width, whole + static_cast<int64_t>(chunks[c].start) * width,
                    T * width, B, Tc * width);
  }
}

void UlyssesAttention::exchange(const float* send, float* recv, size_t block, const char* name) {
  const double start = now_seconds();
  const std::vector<size_t> counts(cp_.size(), block);
  const int64_t values = static_cast<int64_t>(block) * cp_.size();
  Work work;
  if (message_type_ == DType::F32) {
    work = cp_.all_to_all_async(send, counts, recv, counts);
  } else {
    // m = bf16(x): half the bytes, widened once they have arrived
    ops_for(device_).cast_to_bf16(send_message_.data(), send, values);
    work = cp_.all_to_all_async(send_message_.data(), counts, receive_message_.data(), counts);
  }
  const OpInterval ran = work.wait();
  count_exposed(now_seconds() - start);
  if (message_type_ == DType::BF16) ops_for(device_).cast_to_fp32(recv, receive_message_.data(), values);
  trace_collective(trace_, name, ran);
}

double UlyssesAttention::bytes_per_layer(int B) const {
  const AttentionBytes bytes = ulysses_attention_bytes(B, config_.seq_len, config_.d_model, split_.cp());
  return static_cast<double>(bytes.forward + bytes.backward) * dtype_bytes(message_type_) / sizeof(float);
}

// ----------------------------------------------------------------------------
// forward and backward

void UlyssesAttention::forward(float* atty, float* saved, const float* qkv, int B) {
  allocate(B);
  const OpTable& op = ops_for(device_);
  const int N = cp_.size(), T = config_.seq_len, width = head_channels_, heads = config_.n_head / N;
  const size_t local_rows = static_cast<size_t>(B) * split_.local_len();
  float* qkv_heads = saved;                                       // (B, T, 3C/N)
  float* probs = saved + static_cast<size_t>(B) * T * 3 * width;  // (B, NH/N, T, T)

  // qkv to the head split: rank j gets the columns of its heads of q, k and v (3 per row)
  split_heads(send_.data(), qkv, 3 * local_rows);
  const size_t qkv_block = local_rows * 3 * width;  // (chunks, B, Tc, 3C/N)
  exchange(send_.data(), receive_.data(), qkv_block, "ulysses qkv all_to_all");
  for (int i = 0; i < N; i++) place_positions(qkv_heads, receive_.data() + i * qkv_block, i, 3 * width, B);

  // y_r = softmax(q k^T / sqrt(hs), causal) v for this rank's heads, over every position
  const double compute_start = now_seconds();
  op.attention_forward(y_.data(), probs, qkv_heads, B, T, width, heads);
  compute_seconds_ += now_seconds() - compute_start;

  // back to the sequence split: rank i gets its positions; rank j's block fills j's heads' columns
  const size_t y_block = local_rows * width;  // (chunks, B, Tc, C/N)
  for (int i = 0; i < N; i++) take_positions(send_.data() + i * y_block, y_.data(), i, width, B);
  exchange(send_.data(), receive_.data(), y_block, "ulysses atty all_to_all");
  join_heads(atty, receive_.data(), local_rows);
}

void UlyssesAttention::backward(float* dqkv, const float* datty, const float*, const float*, const float* saved,
                                int B) {
  allocate(B);
  const OpTable& op = ops_for(device_);
  const int N = cp_.size(), T = config_.seq_len, width = head_channels_, heads = config_.n_head / N;
  const size_t local_rows = static_cast<size_t>(B) * split_.local_len();
  const float* qkv_heads = saved;                                       // (B, T, 3C/N)
  const float* probs = saved + static_cast<size_t>(B) * T * 3 * width;  // (B, NH/N, T, T)

  // datty to the head split, as qkv went in forward
  const size_t y_block = local_rows * width;
  split_heads(send_.data(), datty, local_rows);
  exchange(send_.data(), receive_.data(), y_block, "ulysses datty all_to_all");
  float* dy = y_.data();  // (B, T, C/N)
  for (int i = 0; i < N; i++) place_positions(dy, receive_.data() + i * y_block, i, width, B);

  // dqkv_r += attention's backward for this rank's heads (from zero: it is ours alone)
  const double compute_start = now_seconds();
  op.zero(dqkv_heads_.data(), static_cast<int64_t>(B) * T * 3 * width);
  op.attention_backward(dqkv_heads_.data(), dscores_.data(), dy, qkv_heads, probs, B, T, width, heads);
  compute_seconds_ += now_seconds() - compute_start;

  // dqkv back to the sequence split, rejoined (in send_, free again once the exchange is done)
  const size_t qkv_block = local_rows * 3 * width;
  for (int i = 0; i < N; i++) take_positions(send_.data() + i * qkv_block, dqkv_heads_.data(), i, 3 * width, B);
  exchange(send_.data(), receive_.data(), qkv_block, "ulysses dqkv all_to_all");
  join_heads(send_.data(), receive_.data(), 3 * local_rows);
  // dqkv += the gradient of this rank's positions, every head
  op.residual_backward(dqkv, send_.data(), static_cast<int64_t>(local_rows) * 3 * config_.d_model);
}

}  // namespace course
