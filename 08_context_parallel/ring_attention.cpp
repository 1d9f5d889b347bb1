#include "08_context_parallel/ring_attention.h"

#include <string>
#include <vector>

#include "common/tensor/error.h"
#include "common/train/metrics.h"

namespace course {

// ----------------------------------------------------------------------------
// the ring

double RingAttention::bytes_per_layer(int B) const {
  const AttentionBytes bytes = ring_attention_bytes(B, split_.local_len(), config_.d_model, split_.cp());
  return static_cast<double>(bytes.forward + bytes.backward) * dtype_bytes(message_type_) / sizeof(float);
}

AttentionBytes ring_attention_bytes(int B, int local_len, int C, int cp) {
  if (cp <= 1) return {};
  const uint64_t block = 2ull * B * local_len * C * sizeof(float);  // one rank's K and V, or dK and dV
  return {static_cast<uint64_t>(cp - 1) * block, static_cast<uint64_t>(2 * cp - 1) * block};
}

RingAttention::RingAttention(const GPTConfig& config, const SequenceSplit& split, Comm& cp, Device device,
                             DType message_type)
    : config_(config),
      split_(split),
      cp_(cp),
      device_(device),
      message_type_(message_type),
      ops_(ops_for(device)),
      cp_ops_(cp_ops_for(device)) {
  if (split.seq_len() != config.seq_len) {
    throw UsageError("ring attention: the split cuts " + std::to_string(split.seq_len()) + " positions but the " +
                     "model's sequence has " + std::to_string(config.seq_len) +
                     " (hint: split the model's full --seq)");
  }
  if (split.cp() != cp.size()) {
    throw UsageError("ring attention: the split is for " + std::to_string(split.cp()) + " cp ranks but the cp group " +
                     "has " + std::to_string(cp.size()) + " (hint: build the split with the cp group's size)");
  }
  if (config.n_head < 1 || config.d_model % config.n_head != 0) {
    throw UsageError("ring attention: --heads " + std::to_string(config.n_head) + " does not divide --d-model " +
                     std::to_string(config.d_model));
  }
}

ContextAttentionFloats ring_attention_floats(const GPTConfig& config, const SequenceSplit& split, int B) {
  const size_t block = static_cast<size_t>(B) * split.local_len() * 2 * config.d_model;  // (chunks, B, Tc, 2C)
  const size_t lse = static_cast<size_t>(B) * config.n_head * split.local_len();         // (chunks, B, NH, Tc)
  AttentionBlock pair;  // the scratch is sized for one chunk against one chunk
  pair.Tq = pair.Tk = split.chunk_len();
  return {lse, 4 * block, block + lse + attention_block_scratch_floats(pair)};
}

size_t RingAttention::saved_floats(int B) const { return ring_attention_floats(config_, split_, B).saved; }

void RingAttention::reset_counters() {
  forward_compute_seconds_ = 0.0;
  backward_compute_seconds_ = 0.0;
  reset_exposed();
}

void RingAttention::allocate(int B) {
  if (B <= allocated_batch_) return;
  const int Tc = split_.chunk_len();
  const size_t block = static_cast<size_t>(B) * split_.local_len() * 2 * config_.d_model;
  for (int i = 0; i < 2; i++) {
    kv_[i] = Buffer(block, MemCategory::CommBuffers, device_);
    dkv_[i] = Buffer(block, MemCategory::CommBuffers, device_);
  }
  dkv_hop_ = Buffer(block, MemCategory::Workspace, device_);
  if (message_type_ == DType::BF16) {
    for (HopMessages* messages : {&kv_messages_, &dkv_messages_}) {
      messages->send = TypedBuffer<bf16>(block, MemCategory::CommBuffers, device_);
      messages->recv = TypedBuffer<bf16>(block, MemCategory::CommBuffers, device_);
    }
  }
  row_dots_ = Buffer(saved_floats(B), MemCategory::Workspace, device_);
  scratch_ = Buffer(attention_block_scratch_floats(chunk_pair({0, Tc}, {0, Tc}, B)), MemCategory::Workspace, device_);
  allocated_batch_ = B;
}

void RingAttention::pack_kv(float* kv, const float* qkv, int B) {
  const int C = config_.d_model;
  // kv[row] = qkv[row, C:3C]
  ops_.copy_strided(kv, 2 * C, qkv + C, 3 * C, static_cast<int64_t>(B) * split_.local_len(), 2 * C);
}

AttentionBlock RingAttention::chunk_pair(const PositionChunk& query, const PositionChunk& key, int B) const {
  const int C = config_.d_model;
  return {B, C, config_.n_head, query.start, query.length, key.start, key.length, 3 * C, 2 * C};
}

Work RingAttention::start_hop(const float* send, float* recv, size_t count, HopMessages& messages) {
  const int N = cp_.size(), r = cp_.rank(), next = (r + 1) % N, previous = (r - 1 + N) % N;
  if (message_type_ == DType::F32) return cp_.send_recv_async(send, count, next, recv, count, previous);
  // m = bf16(x): half the bytes; finish_hop widens what arrives
  ops_.cast_to_bf16(messages.send.data(), send, static_cast<int64_t>(count));
  messages.widen_into = recv;
  return cp_.send_recv_async(messages.send.data(), count, next, messages.recv.data(), count, previous);
}

void RingAttention::finish_hop(Work& hop, const std::string& name, size_t count, HopMessages& messages) {
  const double wait_start = now_seconds();
  const OpInterval ran = hop.wait();
  count_exposed(now_seconds() - wait_start);
  if (messages.widen_into != nullptr) {
    // x = float(m): exact
    ops_.cast_to_fp32(messages.widen_into, messages.recv.data(), static_cast<int64_t>(count));
    messages.widen_into = nullptr;
  }
  trace_collective(trace_, name, ran, JsonLine().add("bytes", count * dtype_bytes(message_type_)));
}

void RingAttention::visible_pairs(int owner, int B,
                                  const std::function<void(int, int, const AttentionBlock&)>& attend) const {
  const std::vector<PositionChunk> queries = split_.chunks_of(cp_.rank()), keys = split_.chunks_of(owner);
  for (size_t cq = 0; cq < queries.size(); cq++) {
    for (size_t ck = 0; ck < keys.size(); ck++) {
      const AttentionBlock block = chunk_pair(queries[cq], keys[ck], B);
      if (block_mask(block) != BlockMask::Hidden) attend(static_cast<int>(cq), static_cast<int>(ck), block);
    }
  }
}

// Forward: N - 1 hops of the K/V blocks. At hop i this rank attends to the block of
// cp rank (r - i) mod N while the next block travels.
void RingAttention::forward(float* atty, float* saved, const float* qkv, int B) {
  allocate(B);
  const int N = cp_.size(), r = cp_.rank(), C = config_.d_model, NH = config_.n_head;
  const int chunks = split_.chunks_per_rank(), Tc = split_.chunk_len();
  const int64_t chunk_rows = static_cast<int64_t>(B) * Tc;  // a chunk's rows in every local buffer
  const size_t block_floats = static_cast<size_t>(chunks) * chunk_rows * 2 * C;  // (chunks, B, Tc, 2C)
  float* lse = saved;  // (chunks, B, NH, Tc)
  cp_ops_.attention_blocks_begin(atty, lse, chunks * B, Tc, C, NH);
  pack_kv(kv_[0].data(), qkv, B);
  for (int hop = 0; hop < N; hop++) {
    const int owner = (r - hop + N) % N;
    const float* kv = kv_[hop % 2].data();  // (chunks, B, Tc, 2C): owner's K and V
    Work next;                              // the next block, arriving while this one is attended to
    if (hop + 1 < N) next = start_hop(kv, kv_[(hop + 1) % 2].data(), block_floats, kv_messages_);
    const double start = now_seconds();
    visible_pairs(owner, B, [&](int cq, int ck, const AttentionBlock& pair) {
      const float* kv_chunk = kv + ck * chunk_rows * 2 * C;
      cp_ops_.attention_block_forward(atty + cq * chunk_rows * C, lse + cq * chunk_rows * NH, scratch_.data(),
                              qkv + cq * chunk_rows * 3 * C, kv_chunk, kv_chunk + C, pair);
    });
    forward_compute_seconds_ += now_seconds() - start;
    trace_compute(trace_, "forward attention, K/V of cp rank " + std::to_string(owner), start);
    finish_hop(next, "K/V hop " + std::to_string(hop + 1) + " of " + std::to_string(N - 1), block_floats,
               kv_messages_);
  }
}

// Backward: the K/V blocks go around again (N - 1 hops), each followed by its dK/dV
// accumulator (N hops: the last one brings it home). Rank r computes its part of a
// block's dK/dV while the accumulator it adds to is still on the way; dQ is local.
void RingAttention::backward(float* dqkv, const float* datty, const float* qkv, const float* atty,
                             const float* saved, int B) {
  allocate(B);
  const int N = cp_.size(), r = cp_.rank(), C = config_.d_model, NH = config_.n_head;
  const int chunks = split_.chunks_per_rank(), Tc = split_.chunk_len();
  const int64_t chunk_rows = static_cast<int64_t>(B) * Tc;
  const size_t block_floats = static_cast<size_t>(chunks) * chunk_rows * 2 * C;  // (chunks, B, Tc, 2C)
  const float* lse = saved;  // (chunks, B, NH, Tc)
  cp_ops_.attention_row_dots(row_dots_.data(), atty, datty, chunks * B, Tc, C, NH);
  pack_kv(kv_[0].data(), qkv, B);
  ops_.zero(dkv_[0].data(), block_floats);  // hop 0's accumulator "arrives" empty
  int arriving = 0;  // dkv_[arriving]: the accumulator of the block held now
  Work accumulator;  // the dK/dV hop in flight
  for (int hop = 0; hop < N; hop++) {
    const int owner = (r - hop + N) % N;
    const float* kv = kv_[hop % 2].data();
    Work next;
    if (hop + 1 < N) next = start_hop(kv, kv_[(hop + 1) % 2].data(), block_floats, kv_messages_);
    const double start = now_seconds();
    ops_.zero(dkv_hop_.data(), block_floats);
    visible_pairs(owner, B, [&](int cq, int ck, const AttentionBlock& pair) {
      const int64_t k_offset = ck * chunk_rows * 2 * C;
      float* dkv_chunk = dkv_hop_.data() + k_offset;
      cp_ops_.attention_block_backward(dqkv + cq * chunk_rows * 3 * C, dkv_chunk, dkv_chunk + C, scratch_.data(),
                               datty + cq * chunk_rows * C, lse + cq * chunk_rows * NH,
                               row_dots_.data() + cq * chunk_rows * NH, qkv + cq * chunk_rows * 3 * C,
                               kv + k_offset, kv + k_offset + C, pair);
    });
    backward_compute_seconds_ += now_seconds() - start;
    trace_compute(trace_, "backward attention, K/V of cp rank " + std::to_string(owner), start);
    finish_hop(accumulator, "dK/dV hop " + std::to_string(hop) + " of " + std::to_string(N), block_floats,
               dkv_messages_);
    // owner's dK/dV += this rank's part, then on to the next rank
    float* sum = dkv_[arriving].data();
    ops_.residual_backward(sum, dkv_hop_.data(), block_floats);  // sum += this rank's part
    if (N > 1) {
      accumulator = start_hop(sum, dkv_[1 - arriving].data(), block_floats, dkv_messages_);
      arriving = 1 - arriving;
    }
    finish_hop(next, "K/V hop " + std::to_string(hop + 1) + " of " + std::to_string(N - 1), block_floats,
               kv_messages_);
  }
  finish_hop(accumulator, "dK/dV hop " + std::to_string(N) + " of " + std::to_string(N) + " (home)", block_floats,
             dkv_messages_);
  // dkv_[arriving] now holds this rank's own dK and dV, summed over every rank's queries
  // dqkv[row, C:3C] += dkv[row]
  cp_ops_.add_strided(dqkv + C, 3 * C, dkv_[arriving].data(), 2 * C, chunks * chunk_rows, 2 * C);
}

}  // namespace course
