// Compressed gradients: each value sent in fewer bytes, and the rounding error
// carried to the next step (error feedback) so that nothing is lost, only delayed.
//
//   none  4 bytes a value (fp32)
//   bf16  2 bytes: the top half of the fp32 bits, rounded to nearest even
//   int8  1 byte, plus one fp32 scale per block of kInt8Block values:
//         q = round(x / scale), scale = max|x| / 127 over the block
//
// Error feedback (1-bit Adam, PowerSGD): a sender keeps what its message could not
// say, residual = (x + residual) - decode(encode(x + residual)), and adds it to the
// next message. Over many steps the sum of the messages follows the sum of the true
// values within one message's rounding.
//
// A sum of int8 messages is not an int8 message (the scales differ), so a ring, which
// adds as it forwards, cannot carry them. The average goes in two exchanges instead
// (ZeRO++'s qgZ and 1-bit Adam do the same):
//
//   all-to-all   rank r gets chunk r of every rank's message     (W-1) chunks out
//   local sum    decode, add in fp32, divide by W: chunk r's average
//   all-gather   chunk r's average, encoded again, to every rank  (W-1) chunks out
//
// so a rank sends 2 (W-1)/W n b bytes, a ring all-reduce's volume at b bytes a value.
// The second encoding has its own residual (the "server" error of 1-bit Adam), kept
// by the chunk's owner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "10_slow_links/link_ops.h"
#include "common/comm/comm.h"
#include "common/tensor/memory.h"

namespace course {

enum class Compression { None, BF16, Int8 };
Compression parse_compression(const std::string& name);  // "none", "bf16", "int8"
const char* compression_name(Compression compression);

constexpr size_t kInt8Block = link_ops::kInt8Block;  // values sharing one scale

// Bytes of the message that carries `count` values.
size_t encoded_bytes(Compression compression, size_t count);
// values (count) -> message (encoded_bytes), both on `device`: its ops do the work
// (bf16: ops.h's cast_to_bf16; int8: link_ops.h's encode_int8)
void encode(Compression compression, const float* values, size_t count, uint8_t* message,
            Device device = Device::CPU);
// message -> values (count): what the receiver reads
void decode(Compression compression, const uint8_t* message, size_t count, float* values,
            Device device = Device::CPU);

// One sender's error feedback over a buffer of `count` values on `device`.
class ErrorFeedback {
 public:
  ErrorFeedback(Compression compression, size_t count, bool enabled, Device device = Device::CPU);
  // values += residual; encodes them into message; residual = values - decoded message
  void encode_with_feedback(float* values, size_t count, size_t offset, uint8_t* message);
  const Buffer& residual() const { return residual_; }
  Buffer& residual() { return residual_; }

 private:
  Compression compression_;
  bool enabled_;
  Device device_;
  Buffer residual_;  // (count)  what earlier messages could not say
};

// The average over `comm`'s ranks of a buffer of `count` floats, sent compressed
// (all-to-all, local fp32 sum, all-gather; see above), with error feedback on both
// encodings when `error_feedback`.
class CompressedAverage {
 public:
  // data on `device` (every buffer here is there too)
  CompressedAverage(Comm& comm, Compression compression, size_t count, bool error_feedback, Device device);
  // data (count), the same length on every rank -> the average of every rank's data
  // as the messages say it, the same bits on every rank
  void average(float* data);

  // The bytes one rank sends per average, by the formula: 2 (W-1) messages of one
  // chunk (the largest, as the all-to-all pads every chunk to it).
  uint64_t formula_bytes() const;
  ErrorFeedback& worker_feedback() { return worker_; }
  ErrorFeedback& owner_feedback() { return owner_; }

 private:
  Comm& comm_;
  Compression compression_;
  size_t count_;
  Device device_;
  std::vector<size_t> chunk_begin_;  // (W+1)  chunk r is [chunk_begin_[r], chunk_begin_[r+1])
  size_t slot_floats_;               // one chunk's message, in whole floats (the comm moves floats)
  ErrorFeedback worker_;             // (count)  this rank's own message
  ErrorFeedback owner_;              // (chunk)  the re-encoded average of the chunk it owns
  Buffer send_;                      // (W, slot_floats)  an encoded chunk per rank
  Buffer received_;                  // (W, slot_floats)
  Buffer chunk_sum_;                 // (chunk)
  Buffer decoded_;                   // (chunk)  one rank's message, decoded
};

}  // namespace course
