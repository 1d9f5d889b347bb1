// GEMMs for the CUDA ops: see gemm.h.
#include "common/tensor/cuda/gemm.h"

namespace course::cuda {

GemmMode gemm_mode(MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::FP32: return {CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case MatmulPrecision::TF32: return {CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
    case MatmulPrecision::BF16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
  }
  return {CUDA_R_32F, CUBLAS_COMPUTE_32F};
}

// ---- bf16 copies of GEMM inputs ----------------------------------------------

namespace {
// out[i] = bf16(inp[i]), rounded to nearest even
__global__ void to_bf16_kernel(__nv_bfloat16* out, const float* inp, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16(inp[i]);
}

void launch_to_bf16(__nv_bfloat16* out, const float* inp, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  to_bf16_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(out, inp, n);
  CUDA_CHECK_LAUNCH("to_bf16_kernel");
}
}  // namespace

GemmInput::GemmInput(const float* values, int64_t count, const GemmMode& mode)
    : data_(values), element_bytes_(sizeof(float)) {
  if (mode.input_type != CUDA_R_16BF) return;
  copy_ = static_cast<__nv_bfloat16*>(device_allocate(count * sizeof(__nv_bfloat16)));
  launch_to_bf16(copy_, values, count, compute_stream());
  data_ = copy_;
  element_bytes_ = sizeof(__nv_bfloat16);
}

GemmInput::GemmInput(const bf16* values) : data_(values), element_bytes_(sizeof(bf16)) {
  require_bf16_matmuls_for_stored_input();
}

GemmInput::~GemmInput() {
  if (copy_ != nullptr) device_free(copy_);
}

// ---- the GEMMs -----------------------------------------------------------------

void gemm_row_major(const GemmMode& mode, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha,
                    const void* A, int lda, const void* B, int ldb, float beta, float* C, int ldc) {
  // cuBLAS is column-major, where row-major X reads as X^T: ask for C^T = op(B)^T op(A)^T (swap A,B and M,N, keep ops)
  CUBLAS_CHECK(cublasGemmEx(cublas_handle(), transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                            transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B, mode.input_type, ldb, A,
                            mode.input_type, lda, &beta, C, CUDA_R_32F, ldc, mode.compute_type, CUBLAS_GEMM_DEFAULT));
}

void batched_gemm_row_major(const GemmMode& mode, bool transpose_a, bool transpose_b, int M, int N, int K,
                            float alpha, const void* A, int lda, int64_t stride_a, const void* B, int ldb,
                            int64_t stride_b, float beta, float* C, int ldc, int64_t stride_c, int batch) {
  // the same swap as gemm_row_major, for each matrix of the batch
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      cublas_handle(), transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
      &alpha, B, mode.input_type, ldb, stride_b, A, mode.input_type, lda, stride_a, &beta, C, CUDA_R_32F, ldc,
      stride_c, batch, mode.compute_type, CUBLAS_GEMM_DEFAULT));
}

}  // namespace course::cuda
