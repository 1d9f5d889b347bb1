// The CPU ops' vectorised building blocks, shared by common/tensor/ops_cpu.cpp and the
// chapters' own CPU kernels (08_context_parallel/ring_attention.cpp): the
// multi-versioned loops, sums and maxima in lanes, and an exp the compiler can
// vectorise. A file whose float loops use them is compiled with COURSE_CPU_LOOP_OPTIONS
// (common/CMakeLists.txt), or those loops stay scalar. Loops on bits and plain adds
// need no options: bf16's rounding copies (gemm_cpu.cpp) and bf16 sums (comm_util.h)
// are clones too.
#pragma once

#include <cstdint>
#include <cstring>

// The loops of the functions marked COURSE_VECTOR_CLONES are compiled three times:
// for AVX-512 (16 floats per instruction), AVX2 (8) and the x86-64 baseline SSE2
// (4); the loader picks the widest one this CPU has (GCC's function
// multi-versioning), so the binaries run on any x86-64 machine. Every clone computes
// bit-identical results: each element gets the same IEEE operations in the same
// order (COURSE_CPU_LOOP_OPTIONS has -ffp-contract=off, so no clone fuses a multiply
// and an add into an FMA).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COURSE_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define COURSE_VECTOR_CLONES
#endif

namespace course {

// sum over c in [0, n) of term(c). A plain left-to-right sum is one chain of
// dependent adds (each waits for the previous one, ~4 cycles), and the compiler may
// not reorder float adds. So the sum is written in kLanes partial sums instead:
// lane l adds the terms c = l, l + kLanes, l + 2 kLanes, ...; the lanes are then
// added in order, then the last n mod kLanes terms. The lanes are independent, so the
// compiler keeps them in one vector register (8 floats: one AVX2 register, two SSE2)
// and the chain is kLanes times shorter. The order is fixed by the code, not the
// instruction set, so every clone's result is still identical.
static const int kLanes = 8;

template <typename Term>
static inline float lane_sum(int n, Term term) {
  float lanes[kLanes] = {};
  int c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int l = 0; l < kLanes; l++) lanes[l] += term(c + l);
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; l++) sum += lanes[l];
  for (; c < n; c++) sum += term(c);
  return sum;
}

// max over c in [0, n) of x[c], n >= 1, in the same lanes (max does not depend on the order)
static inline float lane_max(const float* x, int n) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; l++) lanes[l] = x[0];
  int c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int l = 0; l < kLanes; l++) lanes[l] = x[c + l] > lanes[l] ? x[c + l] : lanes[l];
  }
  float result = x[0];
  for (int l = 0; l < kLanes; l++) result = lanes[l] > result ? lanes[l] : result;
  for (; c < n; c++) result = x[c] > result ? x[c] : result;
  return result;
}

// e^x within 2 ulp for x in [-87, 88] (clamped outside: e^-87 ~ 1.6e-38 is as
// good as 0 here, e^88 ~ 1.7e38 as good as infinity). e^x = 2^n e^r with
// n = round(x / ln 2) and |r| <= ln(2)/2, e^r by Cephes' expf polynomial.
static inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // round x / ln 2 to the nearest integer: adding 1.5 x 2^23 pushes the fraction out of the float
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // x - n ln 2, ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * r * r + r + 1.0f;
  // 2^n: n + 127 written straight into a float's exponent bits
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_to_n;
  std::memcpy(&two_to_n, &exponent_bits, sizeof(float));
  return e_r * two_to_n;
}

}  // namespace course
