// The CPU's GEMM, in the precision the run asked for (set_matmul_precision, device.h):
// every matrix product of the CPU ops (the linear layers, attention's two products,
// chapter 08's ring attention) goes through it, as the CUDA ops' go through gemm.h.
//
//   fp32  OpenBLAS's sgemm, as it is.
//   bf16  A and B rounded to bf16 (nearest even), then multiplied with fp32
//         accumulation: what a bf16 GEMM computes, up to the order of its sums. The
//         rounded copies are made per call (cast per use: no bf16 weights are kept),
//         into a workspace kept for the next call, and the product is OpenBLAS's
//         sgemm on them. OpenBLAS has no bf16 GEMM that takes our layouts, so here
//         bf16 runs at fp32's speed, plus the rounding (bf16_gemm_note says so once).
//   tf32  a GPU's mode only: the CPU computes fp32.
#pragma once

#include <string>

namespace course::cpu {

// C (M x N, row stride ldc) = alpha op(A) op(B) + beta C, op(X) = X or X^T: the
// arguments of cblas_sgemm(CblasRowMajor, ...). A is M x K after op (stored K x M when
// transposed), B is K x N after op.
void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc);

// What bf16 means on this CPU, for the run header.
std::string bf16_gemm_note();

}  // namespace course::cpu
