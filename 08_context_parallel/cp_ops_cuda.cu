// Chapter 08's ops on the GPU (cp_ops.h): ring attention's block math.
// Reference: the functions of the same names in cp_ops_cpu.cpp (same formulas).
// Compiled, never run on a GPU yet (test_cuda holds every one against the CPU's).
//
// Shape: one thread per query row of one head for the output, the lse and dQ, and one
// thread per key row of one head for dK and dV. A thread recomputes the scores it needs
// (a dot product of hs channels each), so no T x T tile is stored and no two threads add
// into the same gradient: the results are the same bits on every run. This is the
// simplest correct kernel, not a fast one; flash attention's tiles in shared memory are
// what a fast one adds.
//
// Precision follows common/tensor/device.h as the CPU's block math does: under BF16 the
// inputs of every product (q and k for the scores, P and v for the output, dout and v
// for dP, dS and k for dQ, P and dout for dV, dS and q for dK) are rounded to bf16 and
// the sums are fp32, as cpu::gemm rounds its inputs and cuBLAS's bf16 GEMM takes them.
// TF32 is not modelled here: the products are fp32.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "08_context_parallel/cp_ops.h"
#include "common/tensor/cuda/launch.h"
#include "common/tensor/cuda/runtime.h"
#include "common/tensor/device.h"

namespace course::cp_cuda_ops {
namespace {

using cuda::item_index;
using cuda::launch_per_item;

// x as a GEMM's input sees it: rounded to bf16 under --dtype bf16, else itself
__device__ float as_input(float x, bool bf16_inputs) {
  return bf16_inputs ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}

// a . b over hs channels, both rounded as a GEMM's inputs, summed in fp32
__device__ float dot(const float* a, const float* b, int hs, bool bf16_inputs) {
  float sum = 0.0f;
  for (int c = 0; c < hs; c++) sum += as_input(a[c], bf16_inputs) * as_input(b[c], bf16_inputs);
  return sum;
}

// how many of the block's keys (always the first ones) the query at `position` sees
__device__ int visible_keys(const AttentionBlock& block, int position) {
  return min(max(position - block.k_start + 1, 0), block.Tk);
}

// ---- kernels ----------------------------------------------------------------

// x[i] = value      (one thread per element)
__global__ void fill_kernel(float* x, float value, int64_t n) {
  const int64_t i = item_index();
  if (i < n) x[i] = value;
}

// One query row i of head h of sequence b merges the block (one thread each):
// lse_block = log sum_j exp(S_j), lse_new = log(exp(lse) + exp(lse_block)),
// out = exp(lse - lse_new) out + sum_j exp(S_j - lse_new) v_j
__global__ void block_forward_kernel(float* out, float* lse, const float* q, const float* k, const float* v,
                                     AttentionBlock block, float scale, bool bf16_inputs) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(block.B) * block.NH * block.Tq) return;
  const int i = index % block.Tq, h = (index / block.Tq) % block.NH, b = index / (block.Tq * block.NH);
  const int visible = visible_keys(block, block.q_start + i);
  if (visible == 0) return;
  const int C = block.C, hs = C / block.NH;
  const float* q_row = q + (static_cast<int64_t>(b) * block.Tq + i) * block.q_stride + h * hs;
  const float* k_bh = k + static_cast<int64_t>(b) * block.Tk * block.kv_stride + h * hs;
  const float* v_bh = v + static_cast<int64_t>(b) * block.Tk * block.kv_stride + h * hs;
  float* out_row = out + (static_cast<int64_t>(b) * block.Tq + i) * C + h * hs;
  float& row_lse = lse[(static_cast<int64_t>(b) * block.NH + h) * block.Tq + i];
  // the block's max and sum of exp(S - max) in one pass (the sum rescaled when the max grows)
  float row_max = -INFINITY, row_sum = 0.0f;
  for (int j = 0; j < visible; j++) {
    const float score = scale * dot(q_row, k_bh + static_cast<int64_t>(j) * block.kv_stride, hs, bf16_inputs);
    if (score > row_max) {
      row_sum = row_sum * expf(row_max - score) + 1.0f;
      row_max = score;
    } else {
      row_sum += expf(score - row_max);
    }
  }
  const float lse_block = row_max + logf(row_sum);
  // lse_new = log(exp(lse) + exp(lse_block)), taken around the larger so nothing overflows
  const float larger = fmaxf(row_lse, lse_block);
  const float lse_new = larger + logf(expf(row_lse - larger) + expf(lse_block - larger));
  const float keep = expf(row_lse - lse_new);  // 0 before the first block (lse = -inf)
  for (int c = 0; c < hs; c++) out_row[c] *= keep;
  for (int j = 0; j < visible; j++) {
    const float* k_row = k_bh + static_cast<int64_t>(j) * block.kv_stride;
    const float* v_row = v_bh + static_cast<int64_t>(j) * block.kv_stride;
    const float p = as_input(expf(scale * dot(q_row, k_row, hs, bf16_inputs) - lse_new), bf16_inputs);
    for (int c = 0; c < hs; c++) out_row[c] += p * as_input(v_row[c], bf16_inputs);
  }
  row_lse = lse_new;
}

// row_dots[b, h, t] = dout[b, t, head h] . out[b, t, head h]      (one thread per row and head)
__global__ void row_dots_kernel(float* row_dots, const float* out, const float* dout, int B, int T, int C, int NH) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(B) * NH * T) return;
  const int t = index % T, h = (index / T) % NH, b = index / (static_cast<int64_t>(T) * NH);
  const int hs = C / NH;
  const int64_t row = (static_cast<int64_t>(b) * T + t) * C + h * hs;
  double sum = 0.0;  // in double, as the CPU's
  for (int c = 0; c < hs; c++) sum += static_cast<double>(dout[row + c]) * out[row + c];
  row_dots[index] = static_cast<float>(sum);
}

// The score gradient of query row i (its q, dout, lse, D) against key row j (its k, v):
// P = exp(S - lse), dS = P (dout . v - D); p returns P as the product with dout takes it
__device__ float score_gradient(float* p, const float* q_row, const float* dout_row, float row_lse, float row_dot,
                                const float* k_row, const float* v_row, int hs, float scale, bool bf16_inputs) {
  const float probability = expf(scale * dot(q_row, k_row, hs, bf16_inputs) - row_lse);
  *p = as_input(probability, bf16_inputs);
  return probability * (dot(dout_row, v_row, hs, bf16_inputs) - row_dot);
}

// dQ[i] += sum over the keys j it sees of dS[i, j] k[j] / sqrt(hs)      (one thread per query row and head)
__global__ void block_backward_dq_kernel(float* dq, const float* dout, const float* lse, const float* row_dots,
                                         const float* q, const float* k, const float* v, AttentionBlock block,
                                         float scale, bool bf16_inputs) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(block.B) * block.NH * block.Tq) return;
  const int i = index % block.Tq, h = (index / block.Tq) % block.NH, b = index / (block.Tq * block.NH);
  const int visible = visible_keys(block, block.q_start + i);
  const int C = block.C, hs = C / block.NH;
  const int64_t q_offset = (static_cast<int64_t>(b) * block.Tq + i) * block.q_stride + h * hs;
  const int64_t kv_bh = static_cast<int64_t>(b) * block.Tk * block.kv_stride + h * hs;
  const float* dout_row = dout + (static_cast<int64_t>(b) * block.Tq + i) * C + h * hs;
  const int64_t lse_index = (static_cast<int64_t>(b) * block.NH + h) * block.Tq + i;
  for (int j = 0; j < visible; j++) {
    const int64_t kv_offset = kv_bh + static_cast<int64_t>(j) * block.kv_stride;
    float p;
    const float ds = as_input(score_gradient(&p, q + q_offset, dout_row, lse[lse_index], row_dots[lse_index],
                                             k + kv_offset, v + kv_offset, hs, scale, bf16_inputs),
                              bf16_inputs);
    for (int c = 0; c < hs; c++) dq[q_offset + c] += scale * (ds * as_input(k[kv_offset + c], bf16_inputs));
  }
}

// dV[j] += sum over the queries i that see key j of P[i, j] dout[i],
// dK[j] += sum over them of dS[i, j] q[i] / sqrt(hs)      (one thread per key row and head)
__global__ void block_backward_dkv_kernel(float* dk, float* dv, const float* dout, const float* lse,
                                          const float* row_dots, const float* q, const float* k, const float* v,
                                          AttentionBlock block, float scale, bool bf16_inputs) {
  const int64_t index = item_index();
  if (index >= static_cast<int64_t>(block.B) * block.NH * block.Tk) return;
  const int j = index % block.Tk, h = (index / block.Tk) % block.NH, b = index / (block.Tk * block.NH);
  const int C = block.C, hs = C / block.NH;
  const int64_t kv_offset = (static_cast<int64_t>(b) * block.Tk + j) * block.kv_stride + h * hs;
  const int first_query = max(block.k_start + j - block.q_start, 0);  // query i sees key j iff i >= this
  for (int i = first_query; i < block.Tq; i++) {
    const int64_t q_offset = (static_cast<int64_t>(b) * block.Tq + i) * block.q_stride + h * hs;
    const float* dout_row = dout + (static_cast<int64_t>(b) * block.Tq + i) * C + h * hs;
    const int64_t lse_index = (static_cast<int64_t>(b) * block.NH + h) * block.Tq + i;
    float p;
    const float ds = as_input(score_gradient(&p, q + q_offset, dout_row, lse[lse_index], row_dots[lse_index],
                                             k + kv_offset, v + kv_offset, hs, scale, bf16_inputs),
                              bf16_inputs);
    for (int c = 0; c < hs; c++) {
      dv[kv_offset + c] += p * as_input(dout_row[c], bf16_inputs);
      dk[kv_offset + c] += scale * (ds * as_input(q[q_offset + c], bf16_inputs));
    }
  }
}

// dst[r, c] += src[r, c]      (one thread per element of the rows x width block)
__global__ void add_strided_kernel(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                                   int64_t width) {
  const int64_t index = item_index();
  if (index >= rows * width) return;
  const int64_t r = index / width, c = index % width;
  dst[r * dst_stride + c] += src[r * src_stride + c];
}

bool bf16_inputs() { return matmul_precision() == MatmulPrecision::BF16; }
float score_scale(const AttentionBlock& block) { return 1.0f / std::sqrt(static_cast<float>(block.C / block.NH)); }

}  // namespace

// ---- the ops (cp_ops.h), on the compute stream ----------------------------------------

void attention_blocks_begin(float* out, float* lse, int B, int T, int C, int NH) {
  const int64_t out_size = static_cast<int64_t>(B) * T * C, lse_size = static_cast<int64_t>(B) * NH * T;
  launch_per_item(fill_kernel, "fill_kernel", out_size, out, 0.0f, out_size);
  launch_per_item(fill_kernel, "fill_kernel", lse_size, lse, -INFINITY, lse_size);
}

void attention_block_forward(float* out, float* lse, float* /*scratch: unused here*/, const float* q, const float* k,
                             const float* v, const AttentionBlock& block) {
  if (block_mask(block) == BlockMask::Hidden) return;
  launch_per_item(block_forward_kernel, "block_forward_kernel", static_cast<int64_t>(block.B) * block.NH * block.Tq,
                  out, lse, q, k, v, block, score_scale(block), bf16_inputs());
}

void attention_row_dots(float* row_dots, const float* out, const float* dout, int B, int T, int C, int NH) {
  launch_per_item(row_dots_kernel, "row_dots_kernel", static_cast<int64_t>(B) * NH * T, row_dots, out, dout, B, T, C,
                  NH);
}

void attention_block_backward(float* dq, float* dk, float* dv, float* /*scratch: unused here*/, const float* dout,
                              const float* lse, const float* row_dots, const float* q, const float* k, const float* v,
                              const AttentionBlock& block) {
  if (block_mask(block) == BlockMask::Hidden) return;
  const float scale = score_scale(block);
  launch_per_item(block_backward_dq_kernel, "block_backward_dq_kernel",
                  static_cast<int64_t>(block.B) * block.NH * block.Tq, dq, dout, lse, row_dots, q, k, v, block, scale,
                  bf16_inputs());
  launch_per_item(block_backward_dkv_kernel, "block_backward_dkv_kernel",
                  static_cast<int64_t>(block.B) * block.NH * block.Tk, dk, dv, dout, lse, row_dots, q, k, v, block,
                  scale, bf16_inputs());
}

void add_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t width) {
  launch_per_item(add_strided_kernel, "add_strided_kernel", rows * width, dst, dst_stride, src, src_stride, rows,
                  width);
}

}  // namespace course::cp_cuda_ops
