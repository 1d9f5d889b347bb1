// bf16 (bfloat16): the top half of an fp32's bits. The same 8-bit exponent, so the
// same range as fp32, with 8 bits of mantissa (7 stored) instead of 24 (23 stored):
//
//   fp32  s eeeeeeee mmmmmmmmmmmmmmmmmmmmmmm
//   bf16  s eeeeeeee mmmmmmm                  (about 3 significant decimal digits)
//
// Half the bytes of every value that is stored or sent in it. Mixed precision keeps
// what must not lose digits (master weights, optimizer moments, sums) in fp32 and
// rounds the rest to bf16; a sum of bf16 values is always computed in fp32.
//
// A distinct type, not a bare uint16_t: a buffer of bf16 cannot be passed where
// floats are expected, and the comm library knows its elements' size and how to add them.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace course {

struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 is two bytes");

// fp32 -> bf16 on the bits, rounded to nearest even: add 0x7fff, plus 1 when the kept
// part is odd, and keep the top half. A NaN keeps its top bits, made quiet (a NaN whose
// payload is all in the low half would otherwise become Inf); Inf stays Inf, and values
// past bf16's largest round to Inf, as every hardware conversion does. The result's low
// half is zero: it is also the fp32 bits of the value bf16 now holds. Written without
// branches, so that a loop of it becomes vector instructions.
inline uint32_t bf16_rounded_bits(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return nan ? ((bits | 0x00400000u) & 0xffff0000u) : rounded;
}

inline bf16 to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bf16{static_cast<uint16_t>(bf16_rounded_bits(bits) >> 16)};
}

// bf16 -> fp32: exact (the low half of the bits is zero)
inline float to_float(bf16 value) {
  const uint32_t wide = static_cast<uint32_t>(value.bits) << 16;
  float result;
  std::memcpy(&result, &wide, sizeof result);
  return result;
}

// The element types the course stores and sends.
enum class DType { F32, BF16 };

inline size_t dtype_bytes(DType type) { return type == DType::BF16 ? 2 : 4; }
inline const char* dtype_name(DType type) { return type == DType::BF16 ? "bf16" : "fp32"; }

}  // namespace course
