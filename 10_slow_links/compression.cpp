// Compressed gradients and their error feedback (compression.h).
#include "10_slow_links/compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/tensor/bf16.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/tensor/ops.h"

namespace course {

Compression parse_compression(const std::string& name) {
  if (name == "none") return Compression::None;
  if (name == "bf16") return Compression::BF16;
  if (name == "int8") return Compression::Int8;
  throw UsageError("unknown compression '" + name + "' (hint: none, bf16 or int8)");
}

const char* compression_name(Compression compression) {
  switch (compression) {
    case Compression::None: return "none";
    case Compression::BF16: return "bf16";
    case Compression::Int8: return "int8";
  }
  return "?";
}

size_t encoded_bytes(Compression compression, size_t count) {
  switch (compression) {
    case Compression::None: return 4 * count;
    case Compression::BF16: return 2 * count;
    case Compression::Int8: return count + 4 * ((count + kInt8Block - 1) / kInt8Block);
  }
  return 0;
}

void encode(Compression compression, const float* values, size_t count, uint8_t* message, Device device) {
  switch (compression) {
    case Compression::None:
      copy_bytes(message, device, values, device, 4 * count);
      return;
    case Compression::BF16:
      // the top half of the fp32 bits, rounded to nearest even
      ops_for(device).cast_to_bf16(reinterpret_cast<bf16*>(message), values, static_cast<int64_t>(count));
      return;
    case Compression::Int8:
      link_ops_for(device).encode_int8(message, values, static_cast<int64_t>(count));
      return;
  }
}

void decode(Compression compression, const uint8_t* message, size_t count, float* values, Device device) {
  switch (compression) {
    case Compression::None:
      copy_bytes(values, device, message, device, 4 * count);
      return;
    case Compression::BF16:
      ops_for(device).cast_to_fp32(values, reinterpret_cast<const bf16*>(message), static_cast<int64_t>(count));
      return;
    case Compression::Int8:
      link_ops_for(device).decode_int8(values, message, static_cast<int64_t>(count));
      return;
  }
}

// ---- error feedback ------------------------------------------------------------------

ErrorFeedback::ErrorFeedback(Compression compression, size_t count, bool enabled, Device device)
    : compression_(compression),
      enabled_(enabled),
      device_(device),
      residual_(enabled ? count : 0, MemCategory::OptimizerState, device) {
  residual_.zero();
}

void ErrorFeedback::encode_with_feedback(float* values, size_t count, size_t offset, uint8_t* message) {
  const int64_t n = static_cast<int64_t>(count);
  float* residual = enabled_ ? residual_.data() + offset : nullptr;
  // x = values + residual
  if (residual) ops_for(device_).residual_backward(values, residual, n);
  encode(compression_, values, count, message, device_);
  if (!residual) return;
  // residual = x - decode(encode(x)): what this message could not say (decoded into the
  // residual itself, which then becomes the difference)
  decode(compression_, message, count, residual, device_);
  link_ops_for(device_).difference(residual, values, residual, n);
}

// ---- the compressed average ------------------------------------------------------------

CompressedAverage::CompressedAverage(Comm& comm, Compression compression, size_t count, bool error_feedback,
                                     Device device)
    : comm_(comm),
      compression_(compression),
      count_(count),
      device_(device),
      chunk_begin_(comm.size() + 1),
      slot_floats_(0),
      worker_(compression, count, error_feedback, device),
      owner_(compression, 0, false, device) {
  const int W = comm.size();
  // chunks of whole int8 blocks, as equal as blocks allow, so that no block spans two owners
  const size_t blocks = (count + kInt8Block - 1) / kInt8Block;
  for (int r = 0; r <= W; r++) chunk_begin_[r] = std::min(count, (blocks * r / W) * kInt8Block);
  size_t largest = 0;
  for (int r = 0; r < W; r++) largest = std::max(largest, chunk_begin_[r + 1] - chunk_begin_[r]);
  slot_floats_ = (encoded_bytes(compression, largest) + 3) / 4;
  const size_t mine = chunk_begin_[comm.rank() + 1] - chunk_begin_[comm.rank()];
  owner_ = ErrorFeedback(compression, mine, error_feedback, device);
  send_ = Buffer(W * slot_floats_, MemCategory::CommBuffers, device);
  received_ = Buffer(W * slot_floats_, MemCategory::CommBuffers, device);
  chunk_sum_ = Buffer(mine, MemCategory::CommBuffers, device);
  decoded_ = Buffer(mine, MemCategory::CommBuffers, device);
}

void CompressedAverage::average(float* data) {
  const int W = comm_.size(), me = comm_.rank();
  auto slot = [this](Buffer& buffer, int r) { return reinterpret_cast<uint8_t*>(buffer.data() + r * slot_floats_); };
  // 1. every chunk of this rank's values, encoded for the rank that owns it
  for (int r = 0; r < W; r++) {
    const size_t begin = chunk_begin_[r];
    worker_.encode_with_feedback(data + begin, chunk_begin_[r + 1] - begin, begin, slot(send_, r));
  }
  comm_.all_to_all(send_.data(), received_.data(), slot_floats_);
  // 2. the chunk this rank owns: every rank's message decoded and added in fp32, in rank order
  const OpTable& ops = ops_for(device_);
  const size_t mine = chunk_sum_.size();
  chunk_sum_.zero();
  for (int r = 0; r < W; r++) {
    decode(compression_, slot(received_, r), mine, decoded_.data(), device_);
    ops.residual_backward(chunk_sum_.data(), decoded_.data(), static_cast<int64_t>(mine));  // sum += decoded
  }
  link_ops_for(device_).divide(chunk_sum_.data(), static_cast<int64_t>(mine), static_cast<float>(W));
  // 3. the chunk's average, encoded again, to every rank; each decodes every chunk
  owner_.encode_with_feedback(chunk_sum_.data(), mine, 0, slot(send_, me));
  comm_.all_gather(send_.data() + me * slot_floats_, received_.data(), slot_floats_);
  for (int r = 0; r < W; r++) {
    decode(compression_, slot(received_, r), chunk_begin_[r + 1] - chunk_begin_[r], data + chunk_begin_[r], device_);
  }
}

uint64_t CompressedAverage::formula_bytes() const {
  return 2ull * (comm_.size() - 1) * slot_floats_ * 4;
}

}  // namespace course
