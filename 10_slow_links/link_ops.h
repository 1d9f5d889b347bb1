// Chapter 10's own ops: the elementwise math of what crosses the slow link (int8 messages,
// error feedback's residuals, the pseudo-gradient, the outer Nesterov step, the inner SGD),
// each with a CPU and a CUDA version of one signature, in an op table of this chapter's own
// (link_ops_for), as ep_ops_for is chapter 09's. The rest of the chapter's math is the
// library's ops (ops.h): bf16 messages are cast_to_bf16 and cast_to_fp32, sums are
// residual_backward (a += b), averages scale.
#pragma once

#include <cstdint>

#include "common/tensor/memory.h"

namespace course::link_ops {

constexpr int64_t kInt8Block = 256;  // values sharing one scale (compression.h)

// message = [scales (fp32, one per block of kInt8Block values) | q (int8, count)],
// scale = max|x| / 127 over the block, q = round(x / scale) to nearest even, in [-127, 127]
void encode_int8(uint8_t* message,     // (encoded_bytes: 4 per block + count)
                 const float* values,  // (count)
                 int64_t count);
// values = q * scale
void decode_int8(float* values,           // (count)
                 const uint8_t* message,  // (encoded_bytes: 4 per block + count)
                 int64_t count);

// out = a - b (out may be a or b): a pseudo-gradient (global - local), or a residual
// (what was meant - what the message says)
void difference(float* out, const float* a, const float* b, int64_t n);  // (n) x3

// x /= divisor: a sum of W workers' values made their average (a division, as the CPU's
// loop always did: x * (1/3) is not x / 3 in the last bit)
void divide(float* x, int64_t n, float divisor);  // (n)

// The outer optimizer, SGD with Nesterov momentum, on n weights, and the worker's copy
// after it: m = mu m + delta;  global -= lr (delta + mu m);
// local = keep local + (1 - keep) global  (keep 0: local = global)
void outer_step(float* global,        // (n)
                float* momentum,      // (n)
                float* local,         // (n)
                const float* delta,   // (n)  the workers' average pseudo-gradient
                int64_t n, float lr, float mu, float keep);

// p -= lr g: the inner optimizer --inner-optimizer sgd
void sgd_update(float* params, const float* grads, int64_t n, float lr);  // (n) x2

}  // namespace course::link_ops

namespace course {

// One device's implementations of the ops above (link_ops_cpu.cpp; link_ops_cuda.cu,
// compiled, never run on a GPU yet), with the same signatures.
struct LinkOpTable {
  decltype(&link_ops::encode_int8) encode_int8;
  decltype(&link_ops::decode_int8) decode_int8;
  decltype(&link_ops::difference) difference;
  decltype(&link_ops::divide) divide;
  decltype(&link_ops::outer_step) outer_step;
  decltype(&link_ops::sgd_update) sgd_update;
};

#ifdef COURSE_HAVE_CUDA
// The CUDA versions (link_ops_cuda.cu).
namespace link_cuda_ops {
decltype(link_ops::encode_int8) encode_int8;
decltype(link_ops::decode_int8) decode_int8;
decltype(link_ops::difference) difference;
decltype(link_ops::divide) divide;
decltype(link_ops::outer_step) outer_step;
decltype(link_ops::sgd_update) sgd_update;
}  // namespace link_cuda_ops
#endif

// The ops for data on `device`: the CPU's, the guarded device's (the CPU's with its arena
// open) or CUDA's. CourseError for CUDA in a CPU-only build.
const LinkOpTable& link_ops_for(Device device);

}  // namespace course
