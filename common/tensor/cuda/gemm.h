// GEMMs for the CUDA ops (matmul.cu, attention.cu): cblas-style row-major calls
// translated to cuBLAS once, and the matmul precision (common/tensor/device.h) applied.
//
// Each call takes the arguments of cblas_sgemm(CblasRowMajor, ...), so every GEMM in
// the CUDA ops reads line for line like its CPU twin in ops_cpu.cpp.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "common/tensor/bf16.h"
#include "common/tensor/cuda/runtime.h"
#include "common/tensor/device.h"

namespace course::cuda {

// What cuBLAS is told for one GEMM: the type of A and B, and how it computes.
// FP32: fp32 inputs, CUBLAS_COMPUTE_32F (no tensor cores: the handle keeps cuBLAS's
// default math mode); TF32: CUBLAS_COMPUTE_32F_FAST_TF32; BF16: bf16 inputs, fp32
// accumulation. The output C is fp32 in every mode.
struct GemmMode {
  cudaDataType input_type;
  cublasComputeType_t compute_type;
};
GemmMode gemm_mode(MatmulPrecision precision);

// A GEMM input as cuBLAS reads it: the fp32 array itself, or under BF16 a bf16 copy
// with the same layout, made on the compute stream when this object is built (so
// after the work queued before it) and given back to the pool when it goes out of
// scope (the pool reuses it only for later work on the same stream).
class GemmInput {
 public:
  GemmInput(const float* values, int64_t count, const GemmMode& mode);
  // A bf16-stored input (model.h's LinearInput), read as it is: no copy. Only under BF16
  // (require_bf16_matmuls_for_stored_input, device.h).
  explicit GemmInput(const bf16* values);
  ~GemmInput();
  GemmInput(const GemmInput&) = delete;
  GemmInput& operator=(const GemmInput&) = delete;

  // the element `offset` elements in, whichever type the elements are
  const void* at(int64_t offset) const { return static_cast<const char*>(data_) + offset * element_bytes_; }

 private:
  const void* data_;
  size_t element_bytes_;
  __nv_bfloat16* copy_ = nullptr;
};

// C (M, N) = alpha op(A) (M, K) @ op(B) (K, N) + beta C, every matrix row-major with
// leading dimensions lda, ldb, ldc (C fp32).
void gemm_row_major(const GemmMode& mode, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha,
                    const void* A, int lda, const void* B, int ldb, float beta, float* C, int ldc);

// For i < batch: C_i = alpha op(A_i) @ op(B_i) + beta C_i, with A_i = A + i*stride_a
// (likewise B, C): one cblas_sgemm(CblasRowMajor, ...) per head, in one launch.
void batched_gemm_row_major(const GemmMode& mode, bool transpose_a, bool transpose_b, int M, int N, int K,
                            float alpha, const void* A, int lda, int64_t stride_a, const void* B, int ldb,
                            int64_t stride_b, float beta, float* C, int ldc, int64_t stride_c, int batch);

}  // namespace course::cuda
