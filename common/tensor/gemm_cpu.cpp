// The CPU's GEMM (gemm_cpu.h).
#include "common/tensor/gemm_cpu.h"

#include <cblas.h>

#include <cstdint>
#include <cstring>

#include "common/tensor/bf16.h"
#include "common/tensor/device.h"
#include "common/tensor/memory.h"

namespace course::cpu {

namespace {

// The rounded copies of one GEMM's two inputs: tracked workspace, grown to the largest
// GEMM's and kept (the course's ops run on one thread: the training thread).
Buffer& rounded_copy(int which, size_t floats) {
  // the tracker's totals first: statics end in reverse order, so they outlive the copies
  static MemoryTotals& totals = memory_totals(Device::CPU);
  (void)totals;
  static Buffer copies[2];
  Buffer& copy = copies[which];
  if (copy.size() < floats) {
    copy = Buffer();  // the old one goes before the new one comes: never both in the peak
    copy = Buffer(floats, MemCategory::Workspace);
  }
  return copy;
}

// x rounded to bf16 and kept as the fp32 it now exactly is: bf16.h's to_bf16 on the
// bits, written without branches so that the loop below becomes vector instructions
// (a NaN keeps its top bits, made quiet, as to_bf16 does).
inline uint32_t round_bits_to_bf16(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return nan ? ((bits | 0x00400000u) & 0xffff0000u) : rounded;
}

// The rows x cols matrix at `source` (row stride ld), each value rounded to bf16 and
// kept as fp32; returned packed (row stride cols).
const float* rounded(int which, const float* source, int rows, int cols, int ld) {
  float* copy = rounded_copy(which, static_cast<size_t>(rows) * cols).data();
  for (int r = 0; r < rows; r++) {
    const float* row = source + static_cast<int64_t>(r) * ld;
    float* out = copy + static_cast<int64_t>(r) * cols;
    for (int c = 0; c < cols; c++) {
      uint32_t bits;
      std::memcpy(&bits, row + c, sizeof bits);
      bits = round_bits_to_bf16(bits);
      std::memcpy(out + c, &bits, sizeof bits);
    }
  }
  return copy;
}

}  // namespace

void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
  if (matmul_precision() == MatmulPrecision::BF16 && M > 0 && N > 0 && K > 0) {
    // as stored: A is M x K, or K x M when transposed; B is K x N, or N x K
    const int a_rows = transpose_a ? K : M, a_cols = transpose_a ? M : K;
    const int b_rows = transpose_b ? N : K, b_cols = transpose_b ? K : N;
    A = rounded(0, A, a_rows, a_cols, lda);
    B = rounded(1, B, b_rows, b_cols, ldb);
    lda = a_cols;
    ldb = b_cols;
  }
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans, transpose_b ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
}

std::string bf16_gemm_note() {
  return "bf16 GEMMs: inputs rounded to bf16, products summed in fp32 by OpenBLAS's sgemm (no bf16 GEMM library in "
         "this build): the numbers of bf16, at fp32's speed";
}

}  // namespace course::cpu
