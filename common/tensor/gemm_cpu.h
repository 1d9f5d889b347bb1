// The CPU's GEMM, in the precision the run asked for (set_matmul_precision, device.h):
// every matrix product of the CPU ops (the linear layers, attention's two products,
// chapter 08's ring attention) goes through it, as the CUDA ops' go through gemm.h.
//
//   fp32  OpenBLAS's sgemm, as it is.
//   bf16  A and B rounded to bf16 (nearest even), then multiplied with fp32
//         accumulation. The rounded copies are made per call (cast per use: no bf16
//         weights are kept), into a workspace kept for the next call. Two ways:
//           - oneDNN's bf16 matmul (built with oneDNN 2.x or 3.x, on a CPU with AVX512-BF16
//             or AMX): bf16 copies, 2 bytes a value, multiplied by bf16 instructions;
//           - otherwise copies kept as the fp32 values they now exactly are, multiplied
//             in fp32: by oneDNN's f32 matmul where it has AVX-512 kernels (1.06-1.4x
//             OpenBLAS's sgemm on the chapters' shapes: benchmarks/README.md, bench_gemm),
//             for products of 2M multiply-adds and more (attention's row blocks stay
//             on sgemm, where oneDNN's cost per call would outweigh it); by OpenBLAS's
//             sgemm else. No bf16 instructions: bf16 runs at fp32's speed, plus the
//             rounding. (fp32 runs stay on sgemm: their bits do not depend on whether
//             the build found oneDNN, an optional dependency.)
//         All compute what a bf16 GEMM computes, up to the order of its sums.
//         bf16_gemm_note says which, once per run. An input stored in bf16 already is
//         read as it is, or widened into the fp32 copy, instead of rounded.
//   tf32  a GPU's mode only: the CPU computes fp32.
#pragma once

#include <string>

#include "common/tensor/bf16.h"

namespace course::cpu {

// C (M x N, row stride ldc) = alpha op(A) op(B) + beta C, op(X) = X or X^T: the
// arguments of cblas_sgemm(CblasRowMajor, ...). A is M x K after op (stored K x M when
// transposed), B is K x N after op.
void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc);

// An A operand prepared once for several GEMMs, as gemm would prepare it: where bf16
// rounds into fp32 copies (no oneDNN bf16 matmul), its rounded copy in gemm's A copy,
// which the next gemm without a PreparedA and the next prepare_a overwrite (and may
// move: a PreparedA is used by the GEMMs right after it, nothing in between); else the
// values as they are.
// linear_backward's dout is the A of both its GEMMs (dinp's; dweight's, transposed)
// and is rounded once for the two; so is attention_backward's dscores.
struct PreparedA {
  const float* values;
  int ld;        // row stride of values
  bool rounded;  // values is the rounded copy
};
// A stored as rows x cols, row stride ld (gemm reads it transposed or not).
PreparedA prepare_a(const float* A, int rows, int cols, int ld);
// gemm with an A from prepare_a, stored as it was prepared
void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const PreparedA& A, const float* B,
          int ldb, float beta, float* C, int ldc);

// gemm with one input stored in bf16 (model.h's LinearInput: a saved activation that only
// GEMMs read, kept in bf16 under --dtype bf16). Its values are what gemm would round it
// to, so a bf16 gemm reads them as they are (oneDNN's bf16 matmul) or widens them into
// its fp32 copy, instead of rounding: the same result, bit for bit, as gemm on the fp32
// values they came from. Only under bf16 (require_bf16_matmuls_for_stored_input, device.h).
// linear_forward's input is its GEMM's A; linear_backward's, the B of dweight's.
void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const bf16* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc);
void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const PreparedA& A, const bf16* B,
          int ldb, float beta, float* C, int ldc);

// oneDNN's matmul on gemm's arguments (M, N, K > 0), its inputs in `type`: fp32 as they
// are, or bf16, rounded into packed copies first; the sums in fp32. Returns false,
// computing nothing, when this build has no oneDNN or this CPU no kernel for the type
// (oneDNN emulates bf16 on AVX512 without BF16: right, but slower than sgemm). It is
// gemm's bf16 path where onednn_bf16_available(). The tests call it on any CPU: bf16
// where a kernel exists, and fp32, which gemm's fp32 runs do not use (they keep
// OpenBLAS's bits), to check the call's plumbing (layouts, transposes, strides, alpha, beta).
bool onednn_gemm(DType type, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A,
                 int lda, const float* B, int ldb, float beta, float* C, int ldc);
// Whether this build has oneDNN (configure's COURSE_ONEDNN found it).
bool onednn_built();
// Whether this build has oneDNN and this CPU a fast bf16 matmul in it (AVX512-BF16 or
// AMX; ONEDNN_MAX_CPU_ISA=AVX2 in the environment takes them away). Asked once.
bool onednn_bf16_available();
// Whether bf16 without it multiplies its large products' fp32 copies with oneDNN's f32
// matmul: this build has oneDNN, and oneDNN AVX-512 kernels on this CPU. Asked once.
bool onednn_f32_for_bf16();

// The GEMM libraries' threads per process (--threads): OpenBLAS's, and oneDNN's (OpenMP).
void set_gemm_threads(int threads);

// What bf16 means on this CPU, for the run header.
std::string bf16_gemm_note();

}  // namespace course::cpu
