// The CUDA implementations of common/tensor/ops.h: cuBLAS for the GEMMs, one small file of
// kernels per op family. Each is declared with the type of its CPU twin, so the
// two sets of signatures cannot drift apart; ops.h documents the arguments and the
// math, and the CPU version (ops_cpu.cpp) is the reference every CUDA op is tested
// against (tests/test_cuda.cpp).
//
// Semantics are the CPU's: forward overwrites, backward accumulates (+=). Every
// pointer is device memory; every op runs on cuda::compute_stream() and returns
// before the GPU is done, except mean and sum_squares, which return a number.
#pragma once

#include "common/tensor/ops.h"

namespace course::cuda_ops {

decltype(ops::embedding_forward) embedding_forward;        // embedding.cu
decltype(ops::embedding_backward) embedding_backward;      // embedding.cu
decltype(ops::layernorm_forward) layernorm_forward;        // layernorm.cu
decltype(ops::layernorm_backward) layernorm_backward;      // layernorm.cu
decltype(ops::linear_forward) linear_forward;              // matmul.cu
decltype(ops::linear_backward) linear_backward;            // matmul.cu
decltype(ops::gelu_forward) gelu_forward;                  // elementwise.cu
decltype(ops::gelu_backward) gelu_backward;                // elementwise.cu
decltype(ops::layernorm_forward_bf16) layernorm_forward_bf16;  // layernorm.cu
decltype(ops::linear_forward_bf16) linear_forward_bf16;    // matmul.cu
decltype(ops::linear_backward_bf16) linear_backward_bf16;  // matmul.cu
decltype(ops::gelu_forward_bf16) gelu_forward_bf16;        // elementwise.cu
decltype(ops::residual_forward) residual_forward;          // elementwise.cu
decltype(ops::residual_backward) residual_backward;        // elementwise.cu
decltype(ops::attention_forward) attention_forward;        // attention.cu
decltype(ops::attention_backward) attention_backward;      // attention.cu
decltype(ops::crossentropy_forward) crossentropy_forward;  // crossentropy.cu
decltype(ops::crossentropy_backward) crossentropy_backward;  // crossentropy.cu
decltype(ops::zero) zero;                                  // elementwise.cu
decltype(ops::mean) mean;                                  // reduce.cu
decltype(ops::add_mean) add_mean;                          // reduce.cu
decltype(ops::sum_squares) sum_squares;                    // reduce.cu
decltype(ops::scale) scale;                                // elementwise.cu
decltype(ops::copy_strided) copy_strided;                  // elementwise.cu
decltype(ops::cast_to_bf16) cast_to_bf16;                  // elementwise.cu
decltype(ops::cast_to_fp32) cast_to_fp32;                  // elementwise.cu
decltype(ops::adamw_update) adamw_update;                  // adamw.cu

}  // namespace course::cuda_ops
