// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11).
//
// A counter-based generator is a pure function: (key, counter) -> random bits.
// There is no hidden state to advance, so element i of a weight tensor can be
// drawn without drawing elements 0..i-1 first. That is what makes the course's
// initialisation layout-independent: a rank that owns a slice of a weight
// (tensor parallel, FSDP) or a stage of the model (pipeline parallel) draws
// exactly the numbers that chapter 00 draws for the same elements.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string>

namespace course {

// The Philox4x32 round function applied 10 times; returns 4 random 32-bit words.
inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; round++) {
    uint64_t product0 = static_cast<uint64_t>(kMul0) * counter[0];
    uint64_t product1 = static_cast<uint64_t>(kMul1) * counter[2];
    counter = {static_cast<uint32_t>(product1 >> 32) ^ counter[1] ^ key[0], static_cast<uint32_t>(product1),
               static_cast<uint32_t>(product0 >> 32) ^ counter[3] ^ key[1], static_cast<uint32_t>(product0)};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return counter;
}

// FNV-1a: turns a parameter name such as "block3.qkv_w" into a stream id.
inline uint64_t hash_name(const std::string& name) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : name) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

// A stream of random numbers named by (seed, stream); draw i depends on i only.
class CounterRng {
 public:
  CounterRng(uint64_t seed, uint64_t stream)
      : key_{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)},
        stream_{static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)} {}

  // Four independent 32-bit words for index i.
  std::array<uint32_t, 4> bits(uint64_t i) const {
    return philox4x32({static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), stream_[0], stream_[1]}, key_);
  }

  // Uniform in (0, 1), never exactly 0 (so log() below is safe).
  static double to_unit(uint32_t word) { return (word + 0.5) / 4294967296.0; }

  double uniform(uint64_t i) const { return to_unit(bits(i)[0]); }

  // Standard normal for index i, by Box-Muller on two of the four words.
  double normal(uint64_t i) const {
    std::array<uint32_t, 4> words = bits(i);
    double u1 = to_unit(words[0]), u2 = to_unit(words[1]);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

  // Uniform integer in [0, n).
  uint64_t below(uint64_t i, uint64_t n) const {
    std::array<uint32_t, 4> words = bits(i);
    uint64_t wide = (static_cast<uint64_t>(words[0]) << 32) | words[1];
    return wide % n;
  }

 private:
  std::array<uint32_t, 2> key_;
  std::array<uint32_t, 2> stream_;
};

}  // namespace course
