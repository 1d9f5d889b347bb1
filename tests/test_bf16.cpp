// bf16 (common/tensor/bf16.h): the conversion on edge values against an arithmetic
// reference, the cast ops on every device against it, the comm library's bf16 sums
// (fp32 addition, one rounding), and the CPU's bf16 GEMM.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "common/comm/comm_util.h"
#include "common/tensor/bf16.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/tensor/gemm_cpu.h"
#include "common/tensor/ops.h"
#include "support/gpu.h"
#include "support/random.h"

using namespace course;

namespace {

float round_trip(float x) { return to_float(to_bf16(x)); }
std::vector<float> round_trip(const std::vector<float>& values) {
  std::vector<float> rounded(values.size());
  for (size_t i = 0; i < values.size(); i++) rounded[i] = round_trip(values[i]);
  return rounded;
}

// Two random matrices of `values` floats each (room for any layout the GEMM case reads)
// and their bf16 roundings: what a bf16 GEMM must multiply
struct GemmOperands {
  std::vector<float> a, b, a_rounded, b_rounded;
};
GemmOperands random_operands(uint64_t seed, size_t values) {
  GemmOperands operands;
  operands.a = course_test::random_floats(seed, values, 0, 3.0);
  operands.b = course_test::random_floats(seed + 1, values, 0, 3.0);
  operands.a_rounded = round_trip(operands.a);
  operands.b_rounded = round_trip(operands.b);
  return operands;
}

float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// bf16 by arithmetic, not by bits: the nearest of the two bf16 neighbours of x (the
// even one on a tie), for finite x whose bf16 is finite
float bf16_reference(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const float down = bits_to_float(bits & 0xffff0000u);
  const float up = bits_to_float((bits & 0xffff0000u) + 0x10000u);  // next bf16 away from zero
  const double to_down = std::fabs(static_cast<double>(x) - down), to_up = std::fabs(static_cast<double>(up) - x);
  if (to_down != to_up) return to_down < to_up ? down : up;
  return ((bits >> 16) & 1) == 0 ? down : up;
}

TEST_CASE("bf16: round to nearest even, NaN stays NaN, Inf stays Inf", "[bf16]") {
  const std::vector<float> edges = {0.0f, -0.0f, 1.0f, -1.0f,
                                    bits_to_float(0x3f808000u),  // 1 + 2^-8: a tie, rounds down to even 1
                                    bits_to_float(0x3f818000u),  // a tie, rounds up to even
                                    bits_to_float(0x3f808001u),  // just above a tie: up
                                    bits_to_float(0x00000001u),  // the smallest subnormal
                                    bits_to_float(0x807fffffu),  // the largest negative subnormal
                                    std::numeric_limits<float>::min(), 3.14159265f, -2.5e-30f, 65504.0f};
  for (float x : edges) {
    INFO("x = " << x);
    CHECK(round_trip((x)) == bf16_reference(x));
    CHECK(std::signbit(round_trip((x))) == std::signbit(x));
  }
  const std::vector<float> randoms = course_test::random_floats(7, 10000, 0, 1e3);
  for (float x : randoms) REQUIRE(round_trip((x)) == bf16_reference(x));
  CHECK(std::isnan(round_trip((std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(round_trip((bits_to_float(0x7f800001u)))));  // a NaN whose top half is Inf's
  CHECK(round_trip((std::numeric_limits<float>::infinity())) == std::numeric_limits<float>::infinity());
  CHECK(round_trip((-std::numeric_limits<float>::infinity())) ==
        -std::numeric_limits<float>::infinity());
  CHECK(std::isinf(round_trip((std::numeric_limits<float>::max()))));  // rounds up past the largest
}

TEST_CASE("the cast ops give bf16.h's conversion on the CPU and the guarded device, and back exactly", "[bf16]") {
  const Device device = GENERATE(Device::CPU, Device::Guarded);
  INFO(device_name(device));
  std::vector<float> values = course_test::random_floats(11, 1001, 0, 100.0);
  values[0] = std::numeric_limits<float>::infinity();
  values[1] = bits_to_float(0x3f808000u);  // a tie
  const int64_t n = static_cast<int64_t>(values.size());
  Buffer fp32(values.size(), MemCategory::Workspace, device);
  TypedBuffer<bf16> halves(values.size(), MemCategory::CommBuffers, device);
  CHECK(halves.bytes() == 2 * values.size());
  copy_bytes(fp32.data(), device, values.data(), Device::CPU, fp32.bytes());
  ops_for(device).cast_to_bf16(halves.data(), fp32.data(), n);
  std::vector<bf16> rounded(values.size());
  copy_bytes(rounded.data(), Device::CPU, halves.data(), device, halves.bytes());
  for (size_t i = 0; i < values.size(); i++) REQUIRE(rounded[i].bits == to_bf16(values[i]).bits);
  ops_for(device).cast_to_fp32(fp32.data(), halves.data(), n);
  std::vector<float> widened(values.size());
  copy_bytes(widened.data(), Device::CPU, fp32.data(), device, fp32.bytes());
  for (size_t i = 0; i < values.size(); i++) REQUIRE(widened[i] == to_float(rounded[i]));
}

TEST_CASE("a bf16 sum is the fp32 sum rounded once, and Average divides in fp32", "[bf16]") {
  const std::vector<float> a = course_test::random_floats(5, 500, 0, 10.0);
  const std::vector<float> b = course_test::random_floats(6, 500, 0, 10.0);
  std::vector<bf16> x(a.size()), y(b.size()), sum(a.size()), largest(a.size());
  for (size_t i = 0; i < a.size(); i++) {
    x[i] = to_bf16(a[i]);
    y[i] = to_bf16(b[i]);
  }
  combine(ReduceOp::Sum, sum.data(), x.data(), y.data(), sum.size());
  combine(ReduceOp::Max, largest.data(), x.data(), y.data(), sum.size());
  for (size_t i = 0; i < a.size(); i++) {
    REQUIRE(sum[i].bits == to_bf16(to_float(x[i]) + to_float(y[i])).bits);
    REQUIRE(to_float(largest[i]) == std::max(to_float(x[i]), to_float(y[i])));
  }
  std::vector<bf16> averaged = sum;
  divide(averaged.data(), averaged.size(), 3);
  for (size_t i = 0; i < a.size(); i++) REQUIRE(averaged[i].bits == to_bf16(to_float(sum[i]) / 3.0f).bits);
}


TEST_CASE("the CPU GEMM at bf16 multiplies the bf16-rounded inputs, in every transpose, and fp32 is untouched",
          "[bf16]") {
  // a small product (sgemm's, as attention's row blocks) and one of 2.6M multiply-adds,
  // which oneDNN's f32 matmul takes where onednn_f32_for_bf16 (gemm_cpu.h)
  const auto [M, N, K] = GENERATE(std::make_tuple(5, 7, 9), std::make_tuple(128, 128, 160));
  INFO(M << " x " << N << " x " << K);
  const bool onednn_sums = cpu::onednn_bf16_available() || (M == 128 && cpu::onednn_f32_for_bf16());
  // room for either layout with padded rows: the padding must not be read
  const auto [a, b, a_rounded, b_rounded] = random_operands(21, static_cast<size_t>(M + 3) * (K + 3));
  for (bool transpose_a : {false, true}) {
    for (bool transpose_b : {false, true}) {
      INFO("transpose a " << transpose_a << ", b " << transpose_b);
      // A stored M x K or (transposed) K x M, B stored K x N or N x K, each row padded
      const int lda = (transpose_a ? M : K) + 3, ldb = (transpose_b ? K : N) + 2;
      std::vector<float> at_bf16(M * N, 1.0f), expected(M * N, 1.0f), at_fp32(M * N, 1.0f);
      {
        course_test::MatmulPrecisionScope bf16_scope(MatmulPrecision::BF16);
        cpu::gemm(transpose_a, transpose_b, M, N, K, 0.5f, a.data(), lda, b.data(), ldb, 1.0f, at_bf16.data(), N);
      }
      cpu::gemm(transpose_a, transpose_b, M, N, K, 0.5f, a_rounded.data(), lda, b_rounded.data(), ldb, 1.0f,
                expected.data(), N);
      cpu::gemm(transpose_a, transpose_b, M, N, K, 0.5f, a.data(), lda, b.data(), ldb, 1.0f, at_fp32.data(), N);
      if (onednn_sums) {  // oneDNN's matmul: the same products, summed in its own order
        CHECK(course_test::error_relative_to_max(at_bf16, expected) <= 1e-6);
      } else {  // the rounded copies into sgemm: the very same sums
        CHECK(at_bf16 == expected);
      }
      CHECK(at_fp32 != at_bf16);  // fp32 did not round
    }
  }
}

// prepare_a (gemm_cpu.h): an A rounded once for two GEMMs, as linear_backward's dout
TEST_CASE("an A prepared once gives gemm's bits in every transpose, at fp32 and bf16, for two GEMMs in a row",
          "[bf16]") {
  // a small product (sgemm's) and a large one (oneDNN's f32 matmul's where onednn_f32_for_bf16)
  const auto [M, N, K] = GENERATE(std::make_tuple(5, 7, 9), std::make_tuple(128, 128, 160));
  INFO(M << " x " << N << " x " << K);
  const auto [a, b, a_rounded, b_rounded] = random_operands(23, static_cast<size_t>(M + 3) * (K + 3));
  for (const MatmulPrecision precision : {MatmulPrecision::FP32, MatmulPrecision::BF16}) {
    const course_test::MatmulPrecisionScope scope(precision);
    for (bool transpose_a : {false, true}) {
      for (bool transpose_b : {false, true}) {
        INFO("bf16 " << (precision == MatmulPrecision::BF16) << ", transpose a " << transpose_a << ", b "
                     << transpose_b);
        // A stored M x K or (transposed) K x M, B stored K x N or N x K, each row padded
        const int lda = (transpose_a ? M : K) + 3, ldb = (transpose_b ? K : N) + 2;
        std::vector<float> plain(M * N, 1.0f), prepared(M * N, 1.0f), again(M * N, 1.0f);
        cpu::gemm(transpose_a, transpose_b, M, N, K, 0.5f, a.data(), lda, b.data(), ldb, 1.0f, plain.data(), N);
        const cpu::PreparedA a_once =
            cpu::prepare_a(a.data(), transpose_a ? K : M, transpose_a ? M : K, lda);
        CHECK(a_once.rounded == (precision == MatmulPrecision::BF16 && !cpu::onednn_bf16_available()));
        cpu::gemm(transpose_a, transpose_b, M, N, K, 0.5f, a_once, b.data(), ldb, 1.0f, prepared.data(), N);
        // the second GEMM with it: its B's copy must not have touched A's
        cpu::gemm(transpose_a, transpose_b, M, N, K, 0.5f, a_once, b.data(), ldb, 1.0f, again.data(), N);
        CHECK(prepared == plain);
        CHECK(again == plain);
      }
    }
  }
}

// oneDNN's matmul (gemm_cpu.h) on gemm's arguments, against sgemm: at fp32 the same
// product (the plumbing: each layout, transpose, padded stride, alpha and beta), at bf16
// the product of the rounded inputs. Both up to the order of the sums. bf16 runs wherever
// oneDNN has a kernel, emulated or not (AVX512 emulates it; plain AVX2 has none).
TEST_CASE("oneDNN's matmul gives sgemm's product in every layout, at fp32 and at bf16 where the CPU has a kernel",
          "[bf16]") {
  const int M = 33, N = 17, K = 40;
  const auto [a, b, a_rounded, b_rounded] = random_operands(31, 48 * 48);
  if (!cpu::onednn_built()) {
    std::vector<float> c(M * N, 0.0f);
    CHECK_FALSE(cpu::onednn_gemm(DType::F32, false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c.data(), N));
    WARN("this build has no oneDNN (configure with libdnnl-dev installed): only the refusal is checked");
    return;
  }
  int bf16_checked = 0;
  for (bool transpose_a : {false, true}) {
    for (bool transpose_b : {false, true}) {
      for (const auto& [alpha, beta] : {std::pair<float, float>{1.0f, 0.0f}, std::pair<float, float>{0.5f, 1.0f}}) {
        INFO("transpose a " << transpose_a << ", b " << transpose_b << ", alpha " << alpha << ", beta " << beta);
        const int lda = (transpose_a ? M : K) + 3, ldb = (transpose_b ? K : N) + 2, ldc = N + 1;
        const std::vector<float> initial = course_test::random_floats(33, M * ldc, 0, 1.0);
        std::vector<float> onednn = initial, expected = initial;
        REQUIRE(cpu::onednn_gemm(DType::F32, transpose_a, transpose_b, M, N, K, alpha, a.data(), lda, b.data(), ldb,
                                 beta, onednn.data(), ldc));
        cpu::gemm(transpose_a, transpose_b, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, expected.data(), ldc);
        CHECK(course_test::error_relative_to_max(onednn, expected) <= 1e-6);

        std::vector<float> at_bf16 = initial, rounded = initial;
        if (!cpu::onednn_gemm(DType::BF16, transpose_a, transpose_b, M, N, K, alpha, a.data(), lda, b.data(), ldb,
                              beta, at_bf16.data(), ldc)) {
          continue;  // no bf16 kernel on this CPU
        }
        cpu::gemm(transpose_a, transpose_b, M, N, K, alpha, a_rounded.data(), lda, b_rounded.data(), ldb, beta,
                  rounded.data(), ldc);
        CHECK(course_test::error_relative_to_max(at_bf16, rounded) <= 1e-6);
        CHECK(course_test::error_relative_to_max(at_bf16, expected) > 1e-4);  // it did round
        bf16_checked++;
      }
    }
  }
  if (bf16_checked == 0) WARN("oneDNN has no bf16 matmul on this CPU (" << cpu::bf16_gemm_note() << "): fp32 only");
}

// A GEMM input stored in bf16 (model.h's LinearInput: the linear layers' saved inputs
// under --dtype bf16) holds what the GEMM would round it to: gemm reads it as it is or
// widens it, and gives the bits of gemm on the fp32 values it came from (oneDNN's bf16
// matmul, reading it in place, sums in its own order: within 1e-6 there). Outside bf16
// it is refused, as on CUDA.
TEST_CASE("a bf16-stored GEMM input gives the bits of gemm on the fp32 values it was rounded from, as A and as B",
          "[bf16]") {
  const auto [M, N, K] = GENERATE(std::make_tuple(5, 7, 9), std::make_tuple(128, 128, 160));
  INFO(M << " x " << N << " x " << K);
  const auto [a, b, a_rounded, b_rounded] = random_operands(41, static_cast<size_t>(M + 3) * (K + 3));
  std::vector<bf16> a_stored(a.size()), b_stored(b.size());
  for (size_t i = 0; i < a.size(); i++) a_stored[i] = to_bf16(a[i]);
  for (size_t i = 0; i < b.size(); i++) b_stored[i] = to_bf16(b[i]);
  const auto same = [](const std::vector<float>& actual, const std::vector<float>& expected) {
    return cpu::onednn_bf16_available() ? course_test::error_relative_to_max(actual, expected) <= 1e-6
                                        : actual == expected;
  };
  {
    const course_test::MatmulPrecisionScope scope(MatmulPrecision::BF16);
    for (bool transpose_a : {false, true}) {
      for (bool transpose_b : {false, true}) {
        INFO("transpose a " << transpose_a << ", b " << transpose_b);
        const int lda = (transpose_a ? M : K) + 3, ldb = (transpose_b ? K : N) + 2;
        std::vector<float> expected(M * N, 1.0f), stored_a(M * N, 1.0f), stored_b(M * N, 1.0f);
        cpu::gemm(transpose_a, transpose_b, M, N, K, 0.5f, a.data(), lda, b.data(), ldb, 1.0f, expected.data(), N);
        cpu::gemm(transpose_a, transpose_b, M, N, K, 0.5f, a_stored.data(), lda, b.data(), ldb, 1.0f,
                  stored_a.data(), N);
        CHECK(same(stored_a, expected));
        // B stored, with A prepared (linear_backward's dweight: dout prepared, the saved input as B)
        const cpu::PreparedA a_once = cpu::prepare_a(a.data(), transpose_a ? K : M, transpose_a ? M : K, lda);
        cpu::gemm(transpose_a, transpose_b, M, N, K, 0.5f, a_once, b_stored.data(), ldb, 1.0f, stored_b.data(), N);
        CHECK(same(stored_b, expected));
      }
    }
  }
  std::vector<float> c(M * N, 0.0f);
  CHECK_THROWS_AS(cpu::gemm(false, false, M, N, K, 1.0f, a_stored.data(), K, b.data(), N, 0.0f, c.data(), N),
                  CourseError);
}

// The ops' bf16 twins (ops.h): LayerNorm and GELU store their fp32 values rounded, and the
// linear layer reading such an input computes, at bf16, the linear layer's bits on the fp32
// values. On the CPU and the guarded device; a small shape (sgemm) and one whose GEMMs
// take oneDNN's f32 matmul where onednn_f32_for_bf16.
TEST_CASE("the ops' bf16 twins store LayerNorm's and GELU's values rounded, and linear on them gives fp32's bits",
          "[bf16]") {
  const Device device = GENERATE(Device::CPU, Device::Guarded);
  const auto [N, C] = GENERATE(std::make_pair(6, 8), std::make_pair(256, 64));
  INFO(device_name(device) << ", N " << N << ", C " << C);
  const int OC = 3 * C;
  const OpTable& op = ops_for(device);
  const course_test::MatmulPrecisionScope scope(MatmulPrecision::BF16);
  auto on_device = [&](const std::vector<float>& values) {
    Buffer buffer(values.size(), MemCategory::Workspace, device);
    copy_bytes(buffer.data(), device, values.data(), Device::CPU, buffer.bytes());
    return buffer;
  };
  auto floats_of = [&](const Buffer& buffer) {
    std::vector<float> values(buffer.size());
    copy_bytes(values.data(), Device::CPU, buffer.data(), device, buffer.bytes());
    return values;
  };
  auto halves_of = [&](const TypedBuffer<bf16>& buffer) {
    std::vector<bf16> values(buffer.size());
    copy_bytes(values.data(), Device::CPU, buffer.data(), device, buffer.bytes());
    return values;
  };
  const size_t NC = static_cast<size_t>(N) * C;
  const Buffer inp = on_device(course_test::random_floats(51, NC, 0, 2.0));
  const Buffer ln_weight = on_device(course_test::random_floats(52, C, 0, 0.3, 1.0));
  const Buffer ln_bias = on_device(course_test::random_floats(53, C, 0, 0.3));
  Buffer ln_out(NC, MemCategory::Workspace, device), mean(N, MemCategory::Workspace, device),
      rstd(N, MemCategory::Workspace, device), mean_again(N, MemCategory::Workspace, device),
      rstd_again(N, MemCategory::Workspace, device);
  TypedBuffer<bf16> ln_stored(NC, MemCategory::Workspace, device);
  op.layernorm_forward(ln_out.data(), mean.data(), rstd.data(), inp.data(), ln_weight.data(), ln_bias.data(), N, C);
  op.layernorm_forward_bf16(ln_stored.data(), mean_again.data(), rstd_again.data(), inp.data(), ln_weight.data(),
                            ln_bias.data(), N, C);
  const std::vector<float> ln_values = floats_of(ln_out);
  const std::vector<bf16> ln_halves = halves_of(ln_stored);
  for (size_t i = 0; i < NC; i++) REQUIRE(ln_halves[i].bits == to_bf16(ln_values[i]).bits);
  CHECK(floats_of(mean_again) == floats_of(mean));
  CHECK(floats_of(rstd_again) == floats_of(rstd));

  Buffer gelu_out(NC, MemCategory::Workspace, device);
  TypedBuffer<bf16> gelu_stored(NC, MemCategory::Workspace, device);
  op.gelu_forward(gelu_out.data(), inp.data(), static_cast<int64_t>(NC));
  op.gelu_forward_bf16(gelu_stored.data(), inp.data(), static_cast<int64_t>(NC));
  const std::vector<float> gelu_values = floats_of(gelu_out);
  const std::vector<bf16> gelu_halves = halves_of(gelu_stored);
  for (size_t i = 0; i < NC; i++) REQUIRE(gelu_halves[i].bits == to_bf16(gelu_values[i]).bits);

  // the linear layer on LayerNorm's output, fp32 and stored
  const Buffer weight = on_device(course_test::random_floats(54, static_cast<size_t>(OC) * C, 0, 0.1));
  const Buffer bias = on_device(course_test::random_floats(55, OC, 0, 0.1));
  const Buffer dout = on_device(course_test::random_floats(56, static_cast<size_t>(N) * OC, 0, 1.0));
  Buffer out(static_cast<size_t>(N) * OC, MemCategory::Workspace, device),
      out_stored(static_cast<size_t>(N) * OC, MemCategory::Workspace, device);
  op.linear_forward(out.data(), ln_out.data(), weight.data(), bias.data(), N, C, OC);
  op.linear_forward_bf16(out_stored.data(), ln_stored.data(), weight.data(), bias.data(), N, C, OC);
  CHECK(floats_of(out_stored) == floats_of(out));
  const std::vector<float> start = course_test::random_floats(57, static_cast<size_t>(OC) * C, 0, 0.1);
  Buffer dinp = on_device(std::vector<float>(NC, 0.5f)), dinp_stored = on_device(std::vector<float>(NC, 0.5f));
  Buffer dweight = on_device(start), dweight_stored = on_device(start);
  Buffer dbias = on_device(std::vector<float>(OC, 0.25f)), dbias_stored = on_device(std::vector<float>(OC, 0.25f));
  op.linear_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), ln_out.data(), weight.data(), N, C, OC);
  op.linear_backward_bf16(dinp_stored.data(), dweight_stored.data(), dbias_stored.data(), dout.data(),
                          ln_stored.data(), weight.data(), N, C, OC);
  CHECK(floats_of(dinp_stored) == floats_of(dinp));
  CHECK(floats_of(dweight_stored) == floats_of(dweight));
  CHECK(floats_of(dbias_stored) == floats_of(dbias));
}

}  // namespace
