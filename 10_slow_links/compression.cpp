// Compressed gradients and their error feedback (compression.h).
#include "10_slow_links/compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/tensor/bf16.h"
#include "common/tensor/error.h"

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

// int8 message: the blocks' scales (fp32), then the values (int8)
void encode(Compression compression, const float* values, size_t count, uint8_t* message) {
  switch (compression) {
    case Compression::None:
      std::memcpy(message, values, 4 * count);
      return;
    case Compression::BF16:
      for (size_t i = 0; i < count; i++) {
        const bf16 value = to_bf16(values[i]);
        std::memcpy(message + 2 * i, &value, 2);
      }
      return;
    case Compression::Int8: {
      const size_t blocks = (count + kInt8Block - 1) / kInt8Block;
      int8_t* quantized = reinterpret_cast<int8_t*>(message + 4 * blocks);
      for (size_t b = 0; b < blocks; b++) {
        const size_t begin = b * kInt8Block, end = std::min(count, begin + kInt8Block);
        float max_abs = 0.0f;
        for (size_t i = begin; i < end; i++) max_abs = std::max(max_abs, std::fabs(values[i]));
        // scale = max|x| / 127: the block's largest value is sent exactly as +-127
        const float scale = max_abs / 127.0f;
        std::memcpy(message + 4 * b, &scale, 4);
        const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (size_t i = begin; i < end; i++) {
          const float q = std::nearbyint(values[i] * inverse);
          quantized[i] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, q)));
        }
      }
      return;
    }
  }
}

void decode(Compression compression, const uint8_t* message, size_t count, float* values) {
  switch (compression) {
    case Compression::None:
      std::memcpy(values, message, 4 * count);
      return;
    case Compression::BF16:
      for (size_t i = 0; i < count; i++) {
        bf16 value;
        std::memcpy(&value, message + 2 * i, 2);
        values[i] = to_float(value);
      }
      return;
    case Compression::Int8: {
      const size_t blocks = (count + kInt8Block - 1) / kInt8Block;
      const int8_t* quantized = reinterpret_cast<const int8_t*>(message + 4 * blocks);
      for (size_t b = 0; b < blocks; b++) {
        float scale;
        std::memcpy(&scale, message + 4 * b, 4);
        const size_t begin = b * kInt8Block, end = std::min(count, begin + kInt8Block);
        // x = q * scale
        for (size_t i = begin; i < end; i++) values[i] = static_cast<float>(quantized[i]) * scale;
      }
      return;
    }
  }
}

// ---- error feedback ------------------------------------------------------------------

ErrorFeedback::ErrorFeedback(Compression compression, size_t count, bool enabled)
    : compression_(compression), enabled_(enabled), residual_(enabled ? count : 0, MemCategory::OptimizerState) {
  residual_.zero();
}

void ErrorFeedback::encode_with_feedback(float* values, size_t count, size_t offset, uint8_t* message) {
  float* residual = enabled_ ? residual_.data() + offset : nullptr;
  // x = values + residual
  if (residual) {
    for (size_t i = 0; i < count; i++) values[i] += residual[i];
  }
  encode(compression_, values, count, message);
  if (!residual) return;
  // residual = x - decode(encode(x)): what this message could not say
  decoded_.resize(count);
  decode(compression_, message, count, decoded_.data());
  for (size_t i = 0; i < count; i++) residual[i] = values[i] - decoded_[i];
}

// ---- the compressed average ------------------------------------------------------------

CompressedAverage::CompressedAverage(Comm& comm, Compression compression, size_t count, bool error_feedback)
    : comm_(comm),
      compression_(compression),
      count_(count),
      chunk_begin_(comm.size() + 1),
      slot_floats_(0),
      worker_(compression, count, error_feedback),
      owner_(compression, 0, false) {
  const int W = comm.size();
  // chunks of whole int8 blocks, as equal as blocks allow, so that no block spans two owners
  const size_t blocks = (count + kInt8Block - 1) / kInt8Block;
  for (int r = 0; r <= W; r++) chunk_begin_[r] = std::min(count, (blocks * r / W) * kInt8Block);
  size_t largest = 0;
  for (int r = 0; r < W; r++) largest = std::max(largest, chunk_begin_[r + 1] - chunk_begin_[r]);
  slot_floats_ = (encoded_bytes(compression, largest) + 3) / 4;
  const size_t mine = chunk_begin_[comm.rank() + 1] - chunk_begin_[comm.rank()];
  owner_ = ErrorFeedback(compression, mine, error_feedback);
  send_ = Buffer(W * slot_floats_, MemCategory::CommBuffers);
  received_ = Buffer(W * slot_floats_, MemCategory::CommBuffers);
  chunk_sum_.resize(mine);
  decoded_.resize(mine);
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
  const size_t mine = chunk_sum_.size();
  std::fill(chunk_sum_.begin(), chunk_sum_.end(), 0.0f);
  for (int r = 0; r < W; r++) {
    decode(compression_, slot(received_, r), mine, decoded_.data());
    for (size_t i = 0; i < mine; i++) chunk_sum_[i] += decoded_[i];
  }
  for (size_t i = 0; i < mine; i++) chunk_sum_[i] /= static_cast<float>(W);
  // 3. the chunk's average, encoded again, to every rank; each decodes every chunk
  owner_.encode_with_feedback(chunk_sum_.data(), mine, 0, slot(send_, me));
  comm_.all_gather(send_.data() + me * slot_floats_, received_.data(), slot_floats_);
  for (int r = 0; r < W; r++) {
    decode(compression_, slot(received_, r), chunk_begin_[r + 1] - chunk_begin_[r], data + chunk_begin_[r]);
  }
}

uint64_t CompressedAverage::formula_bytes() const {
  return 2ull * (comm_.size() - 1) * slot_floats_ * 4;
}

}  // namespace course
