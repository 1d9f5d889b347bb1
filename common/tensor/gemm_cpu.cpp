// The CPU's GEMM (gemm_cpu.h).
#include "common/tensor/gemm_cpu.h"

#include <cblas.h>

#include <cstdint>
#include <cstring>

#ifdef COURSE_HAVE_ONEDNN
#include <omp.h>

#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "oneapi/dnnl/dnnl.hpp"
#endif

#include "common/tensor/bf16.h"
#include "common/tensor/device.h"
#include "common/tensor/memory.h"
#include "common/tensor/vector_math.h"

namespace course::cpu {

namespace {

// A rounded value kept as T: the fp32 it exactly is (sgemm's copies), or a bf16 (oneDNN's)
template <typename T>
T stored_as(uint32_t rounded_bits);
template <>
float stored_as<float>(uint32_t rounded_bits) {
  float value;
  std::memcpy(&value, &rounded_bits, sizeof value);
  return value;
}
template <>
bf16 stored_as<bf16>(uint32_t rounded_bits) {
  return bf16{static_cast<uint16_t>(rounded_bits >> 16)};
}

// One row of n values rounded to bf16, kept as T. In vector clones (vector_math.h): on
// the sgemm path these copies are a bf16 run's largest cost after the GEMMs: 21% of
// chapter 00's step at the default model in SSE2's 4 values at a time, 14% in AVX-512's 16.
template <typename T>
COURSE_VECTOR_CLONES void round_row(const float* row, T* out, int n) {
  for (int c = 0; c < n; c++) {
    uint32_t bits;
    std::memcpy(&bits, row + c, sizeof bits);
    out[c] = stored_as<T>(bf16_rounded_bits(bits));
  }
}

// Copy `which` (0: A's, 1: B's) of values of type T, at least `values` long: a tracked
// workspace, grown to the largest GEMM's and kept (the course's ops run on one thread:
// the training thread).
template <typename T>
T* copy_space(int which, size_t values) {
  // the tracker's totals first: statics end in reverse order, so they outlive the copies
  static MemoryTotals& totals = memory_totals(Device::CPU);
  (void)totals;
  static TypedBuffer<T> copies[2];
  TypedBuffer<T>& copy = copies[which];
  if (copy.size() < values) {
    copy = TypedBuffer<T>();  // the old one goes before the new one comes: never both in the peak
    copy = TypedBuffer<T>(values, MemCategory::Workspace);
  }
  return copy.data();
}

// The rows x cols matrix at `source` (row stride ld), each value rounded to bf16 and
// kept as T, packed (row stride cols) into copy `which`.
template <typename T>
const T* rounded(int which, const float* source, int rows, int cols, int ld) {
  T* out = copy_space<T>(which, static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; r++) {
    round_row(source + static_cast<int64_t>(r) * ld, out + static_cast<int64_t>(r) * cols, cols);
  }
  return out;
}

// One row of bf16 values, widened to the fp32 values they exactly are
COURSE_VECTOR_CLONES void widen_row(const bf16* row, float* out, int n) {
  for (int c = 0; c < n; c++) out[c] = to_float(row[c]);
}

// The rows x cols bf16 matrix at `source` (row stride ld) as fp32, packed into copy
// `which`: a bf16-stored input on the fp32-copy path, the values its rounding would give.
const float* widened(int which, const bf16* source, int rows, int cols, int ld) {
  float* out = copy_space<float>(which, static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; r++) {
    widen_row(source + static_cast<int64_t>(r) * ld, out + static_cast<int64_t>(r) * cols, cols);
  }
  return out;
}

// One input of a bf16 GEMM, as it comes: fp32 values to round, fp32 values bf16 holds
// already (a PreparedA's rounded copy), or bf16 values (a saved activation stored in
// bf16, common/model/model.h's LinearInput). Stored rows x cols, row stride ld.
struct Bf16Input {
  const float* fp32 = nullptr;
  const bf16* stored = nullptr;
  int ld = 0;
  bool rounded = false;  // fp32 holds bf16 values already
};

// x as oneDNN's bf16 matmul reads it: bf16 values, in place or rounded into copy
// `which`; ld becomes their row stride
const bf16* bf16_values(int which, const Bf16Input& x, int rows, int cols, int& ld) {
  if (x.stored != nullptr) {
    ld = x.ld;
    return x.stored;
  }
  ld = cols;
  return rounded<bf16>(which, x.fp32, rows, cols, x.ld);
}

// x as the fp32-copy path reads it: the fp32 values bf16 holds, in place when rounded
// already, else rounded or widened into copy `which`; ld becomes their row stride
const float* rounded_fp32_values(int which, const Bf16Input& x, int rows, int cols, int& ld) {
  if (x.rounded) {
    ld = x.ld;
    return x.fp32;
  }
  ld = cols;
  return x.stored != nullptr ? widened(which, x.stored, rows, cols, x.ld) : rounded<float>(which, x.fp32, rows, cols, x.ld);
}

#ifdef COURSE_HAVE_ONEDNN

// One engine and one stream for the process: the CPU, running each matmul when asked
// (the course's ops run on the training thread).
dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}
dnnl::stream& cpu_stream() {
  static dnnl::stream stream(cpu_engine());
  return stream;
}

// op(X), rows x cols, as oneDNN reads it: X stored row-major with row stride ld, or its
// transpose (element (r, c) of op(X) at c ld + r)
dnnl::memory::desc matrix(dnnl::memory::data_type type, int rows, int cols, bool transposed, int ld) {
  using dims = dnnl::memory::dims;
  return dnnl::memory::desc(dims{rows, cols}, type, transposed ? dims{1, ld} : dims{ld, 1});
}

// One call's shapes: a matmul is built for each (building one generates its kernel)
struct MatmulShape {
  dnnl::memory::data_type type;
  bool transpose_a, transpose_b;
  int M, N, K, lda, ldb, ldc;
  float alpha, beta;
  bool operator<(const MatmulShape& o) const {
    return std::tie(type, transpose_a, transpose_b, M, N, K, lda, ldb, ldc, alpha, beta) <
           std::tie(o.type, o.transpose_a, o.transpose_b, o.M, o.N, o.K, o.lda, o.ldb, o.ldc, o.alpha, o.beta);
  }
};
struct Matmul {
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c;
  float alpha;  // 3.x: the weights' scale, given with each run
};

// At most this many shapes get a matmul of their own. A chapter's products have a few
// dozen; an MoE block's expert GEMMs take as many rows as tokens reach each expert, a
// count that changes every step, and each new shape costs a kernel's generation: past
// the limit a new shape goes to sgemm (the same shape always takes the same path).
constexpr size_t kMaxMatmulShapes = 256;

// The matmul for `shape`, built the first time; null past kMaxMatmulShapes. The two APIs
// differ here only: 2.x builds its primitive descriptor from a matmul::desc and takes
// alpha as an output scale; 3.x takes the engine and the memory descriptors directly,
// and alpha as a scale of the weights given with each run. Throws dnnl::error when this
// CPU has none for its type.
const Matmul* matmul_for(const MatmulShape& shape) {
  static std::map<MatmulShape, Matmul> built;
  const auto found = built.find(shape);
  if (found != built.end()) return &found->second;
  if (built.size() == kMaxMatmulShapes) return nullptr;
  Matmul m{dnnl::matmul(), matrix(shape.type, shape.M, shape.K, shape.transpose_a, shape.lda),
           matrix(shape.type, shape.K, shape.N, shape.transpose_b, shape.ldb),
           matrix(dnnl::memory::data_type::f32, shape.M, shape.N, false, shape.ldc), shape.alpha};
  // C = alpha (A B) + beta C: the scale multiplies the product, the sum post-op adds beta C
  dnnl::primitive_attr attr;
  if (shape.beta != 0.0f) {
    dnnl::post_ops sum;
    sum.append_sum(shape.beta);
    attr.set_post_ops(sum);
  }
#if DNNL_VERSION_MAJOR >= 3
  if (shape.alpha != 1.0f) attr.set_scales_mask(DNNL_ARG_WEIGHTS, 0);  // one scale for the whole matrix
  m.primitive = dnnl::matmul(dnnl::matmul::primitive_desc(cpu_engine(), m.a, m.b, m.c, attr));
#else
  if (shape.alpha != 1.0f) attr.set_output_scales(0, {shape.alpha});
  m.primitive = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(m.a, m.b, m.c), attr, cpu_engine()));
#endif
  return &built.emplace(shape, std::move(m)).first->second;
}

// Whether oneDNN's bf16 matmul runs on bf16 instructions with this ISA (not emulated)
bool has_bf16_instructions(dnnl::cpu_isa isa) {
#if DNNL_VERSION_MAJOR >= 3
  if (isa == dnnl::cpu_isa::avx512_core_fp16 || isa == dnnl::cpu_isa::avx512_core_amx_fp16) return true;
#endif
  return isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
}

// Whether oneDNN runs AVX-512 kernels with this ISA (its f32 matmul then beats sgemm on
// the chapters' shapes; held to AVX2 it is slower: benchmarks/README.md, bench_gemm)
bool has_avx512(dnnl::cpu_isa isa) {
#if DNNL_VERSION_MAJOR >= 3
  if (isa == dnnl::cpu_isa::avx512_core_fp16 || isa == dnnl::cpu_isa::avx512_core_amx_fp16) return true;
#endif
  return isa == dnnl::cpu_isa::avx512_core || isa == dnnl::cpu_isa::avx512_core_vnni ||
         isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
}

// oneDNN's name for the instructions it uses on this CPU
const char* isa_name(dnnl::cpu_isa isa) {
  switch (isa) {
#if DNNL_VERSION_MAJOR >= 3
    case dnnl::cpu_isa::avx512_core_amx_fp16: return "AMX-FP16";
    case dnnl::cpu_isa::avx512_core_fp16: return "AVX512-FP16";
    case dnnl::cpu_isa::avx2_vnni_2: return "AVX2-VNNI-2";
#endif
    case dnnl::cpu_isa::avx512_core_amx: return "AMX";
    case dnnl::cpu_isa::avx512_core_bf16: return "AVX512-BF16";
    case dnnl::cpu_isa::avx512_core_vnni: return "AVX512-VNNI";
    case dnnl::cpu_isa::avx512_core: return "AVX512";
    case dnnl::cpu_isa::avx2_vnni: return "AVX2-VNNI";
    case dnnl::cpu_isa::avx2: return "AVX2";
    case dnnl::cpu_isa::avx: return "AVX";
    case dnnl::cpu_isa::sse41: return "SSE4.1";
    default: return "another ISA";
  }
}

std::string onednn_version() {
  const dnnl_version_t* v = dnnl::version();
  return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
}

#endif  // COURSE_HAVE_ONEDNN

// oneDNN's matmul of A and B as they are, of `type` (M, N, K > 0). False, computing
// nothing, without oneDNN, without a kernel for the type on this CPU, or past
// kMaxMatmulShapes.
bool onednn_run(DType type, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const void* A,
                int lda, const void* B, int ldb, float beta, float* C, int ldc) {
#ifdef COURSE_HAVE_ONEDNN
  const auto data_type = type == DType::BF16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
  const Matmul* matmul = nullptr;
  try {
    matmul = matmul_for({data_type, transpose_a, transpose_b, M, N, K, lda, ldb, ldc, alpha, beta});
  } catch (const dnnl::error&) {
    return false;  // no kernel on this CPU for these types
  }
  if (matmul == nullptr) return false;  // a shape past kMaxMatmulShapes
  dnnl::engine& engine = cpu_engine();
  dnnl::memory a_memory(matmul->a, engine, const_cast<void*>(A)), b_memory(matmul->b, engine, const_cast<void*>(B)),
      c_memory(matmul->c, engine, C);
  std::unordered_map<int, dnnl::memory> args = {
      {DNNL_ARG_SRC, a_memory}, {DNNL_ARG_WEIGHTS, b_memory}, {DNNL_ARG_DST, c_memory}};
#if DNNL_VERSION_MAJOR >= 3
  float alpha_value = matmul->alpha;  // (1)  read by the run below
  if (alpha_value != 1.0f) {
    const dnnl::memory::desc one({1}, dnnl::memory::data_type::f32, dnnl::memory::dims{1});
    args.emplace(DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, dnnl::memory(one, engine, &alpha_value));
  }
#endif
  matmul->primitive.execute(cpu_stream(), args);
  cpu_stream().wait();
  return true;
#else
  (void)type, (void)transpose_a, (void)transpose_b, (void)M, (void)N, (void)K, (void)alpha, (void)A, (void)lda;
  (void)B, (void)ldb, (void)beta, (void)C, (void)ldc;
  return false;
#endif
}

}  // namespace

bool onednn_gemm(DType type, bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A,
                 int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  if (type == DType::F32) return onednn_run(type, transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  // packed bf16 copies: 2 bytes a value
  const bf16* a = bf16_values(0, {A, nullptr, lda}, transpose_a ? K : M, transpose_a ? M : K, lda);
  const bf16* b = bf16_values(1, {B, nullptr, ldb}, transpose_b ? N : K, transpose_b ? K : N, ldb);
  return onednn_run(type, transpose_a, transpose_b, M, N, K, alpha, a, lda, b, ldb, beta, C, ldc);
}

bool onednn_built() {
#ifdef COURSE_HAVE_ONEDNN
  return true;
#else
  return false;
#endif
}

bool onednn_bf16_available() {
#ifdef COURSE_HAVE_ONEDNN
  // fast: bf16 instructions. oneDNN also emulates bf16 on plain AVX512, slower than sgemm.
  static const bool available = [] {
    if (!has_bf16_instructions(dnnl::get_effective_cpu_isa())) return false;
    try {
      matmul_for({dnnl::memory::data_type::bf16, false, false, 16, 16, 16, 16, 16, 16, 1.0f, 0.0f});
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return available;
#else
  return false;
#endif
}

void set_gemm_threads(int threads) {
  openblas_set_num_threads(threads);
#ifdef COURSE_HAVE_ONEDNN
  omp_set_num_threads(threads);
#endif
}

bool onednn_f32_for_bf16() {
#ifdef COURSE_HAVE_ONEDNN
  static const bool chosen = !onednn_bf16_available() && has_avx512(dnnl::get_effective_cpu_isa());
  return chosen;
#else
  return false;
#endif
}

// Whether the GEMMs round their inputs into fp32 copies (for oneDNN's f32 matmul or
// sgemm): bf16 without oneDNN's bf16 matmul, which takes bf16 copies of its own
static bool rounds_into_fp32_copies() {
  return matmul_precision() == MatmulPrecision::BF16 && !onednn_bf16_available();
}

// Below this many multiply-adds (attention's row blocks: at most 128 x 128 x 32 at the
// default model) oneDNN's cost per call (finding the primitive, wrapping the buffers)
// outweighs its faster kernel: routed to it too, chapter 00's bf16 step at the default
// model took 73.7 ms instead of 71.2 (alternating runs); the linear layers' products
// (16M and more) gain.
constexpr int64_t kOneDnnMinMultiplyAdds = int64_t{1} << 21;

static void sgemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
                  const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans, transpose_b ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// C = alpha op(A) op(B) + beta C on gemm's rounded fp32 copies: oneDNN's f32 matmul
// where onednn_f32_for_bf16() and the product is large enough, else sgemm
static void multiply_rounded(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A,
                             int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  const bool large = static_cast<int64_t>(M) * N * K >= kOneDnnMinMultiplyAdds;
  if (large && onednn_f32_for_bf16() &&
      onednn_run(DType::F32, transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
    return;
  }
  sgemm(transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// C = alpha op(A) op(B) + beta C with A and B in bf16 (M, N, K > 0): oneDNN's bf16 matmul
// where it is available, else the rounded fp32 copies multiplied by multiply_rounded
static void gemm_bf16(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const Bf16Input& A,
                      const Bf16Input& B, float beta, float* C, int ldc) {
  const int a_rows = transpose_a ? K : M, a_cols = transpose_a ? M : K;
  const int b_rows = transpose_b ? N : K, b_cols = transpose_b ? K : N;
  int lda = 0, ldb = 0;
  if (onednn_bf16_available()) {
    const bf16* a = bf16_values(0, A, a_rows, a_cols, lda);
    const bf16* b = bf16_values(1, B, b_rows, b_cols, ldb);
    if (onednn_run(DType::BF16, transpose_a, transpose_b, M, N, K, alpha, a, lda, b, ldb, beta, C, ldc)) return;
  }
  const float* a = rounded_fp32_values(0, A, a_rows, a_cols, lda);
  const float* b = rounded_fp32_values(1, B, b_rows, b_cols, ldb);
  multiply_rounded(transpose_a, transpose_b, M, N, K, alpha, a, lda, b, ldb, beta, C, ldc);
}

void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
  if (matmul_precision() == MatmulPrecision::BF16 && M > 0 && N > 0 && K > 0) {
    gemm_bf16(transpose_a, transpose_b, M, N, K, alpha, {A, nullptr, lda}, {B, nullptr, ldb}, beta, C, ldc);
    return;
  }
  sgemm(transpose_a, transpose_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

PreparedA prepare_a(const float* A, int rows, int cols, int ld) {
  if (!rounds_into_fp32_copies() || rows == 0 || cols == 0) return {A, ld, false};
  return {rounded<float>(0, A, rows, cols, ld), cols, true};
}

void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const PreparedA& A, const float* B,
          int ldb, float beta, float* C, int ldc) {
  if (!A.rounded || M == 0 || N == 0 || K == 0) {
    gemm(transpose_a, transpose_b, M, N, K, alpha, A.values, A.ld, B, ldb, beta, C, ldc);
    return;
  }
  // A's copy is made: B's alone, as gemm makes it
  gemm_bf16(transpose_a, transpose_b, M, N, K, alpha, {A.values, nullptr, A.ld, true}, {B, nullptr, ldb}, beta, C,
            ldc);
}

// C = beta C: a product with nothing to sum (K = 0) or nothing to write (M or N = 0),
// as sgemm leaves it (beta = 0 writes zeros)
static void empty_product(int M, int N, float beta, float* C, int ldc) {
  for (int r = 0; r < M; r++) {
    float* row = C + static_cast<int64_t>(r) * ldc;
    for (int c = 0; c < N; c++) row[c] = beta == 0.0f ? 0.0f : beta * row[c];
  }
}

void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const bf16* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
  require_bf16_matmuls_for_stored_input();
  if (M == 0 || N == 0 || K == 0) return empty_product(M, N, beta, C, ldc);
  gemm_bf16(transpose_a, transpose_b, M, N, K, alpha, {nullptr, A, lda}, {B, nullptr, ldb}, beta, C, ldc);
}

void gemm(bool transpose_a, bool transpose_b, int M, int N, int K, float alpha, const PreparedA& A, const bf16* B,
          int ldb, float beta, float* C, int ldc) {
  require_bf16_matmuls_for_stored_input();
  if (M == 0 || N == 0 || K == 0) return empty_product(M, N, beta, C, ldc);
  gemm_bf16(transpose_a, transpose_b, M, N, K, alpha, {A.values, nullptr, A.ld, A.rounded}, {nullptr, B, ldb}, beta,
            C, ldc);
}

std::string bf16_gemm_note() {
#ifdef COURSE_HAVE_ONEDNN
  const std::string isa = isa_name(dnnl::get_effective_cpu_isa());
  if (onednn_bf16_available()) {
    return "bf16 GEMMs: oneDNN " + onednn_version() + "'s bf16 matmul (" + isa +
           "), inputs rounded to bf16 per call, products summed in fp32";
  }
  if (onednn_f32_for_bf16()) {
    return "bf16 GEMMs: inputs rounded to bf16, products summed in fp32 by oneDNN " + onednn_version() +
           "'s f32 matmul (" + isa + "; no fast bf16 matmul on this CPU), attention's small ones by OpenBLAS's "
           "sgemm: the numbers of bf16, at oneDNN's fp32 speed plus the rounding copies";
  }
  return "bf16 GEMMs: inputs rounded to bf16, products summed in fp32 by OpenBLAS's sgemm (oneDNN " +
         onednn_version() + " has no fast bf16 matmul on this CPU's " + isa +
         "): the numbers of bf16, at fp32's speed plus the rounding copies";
#else
  return "bf16 GEMMs: inputs rounded to bf16, products summed in fp32 by OpenBLAS's sgemm (no bf16 GEMM library in "
         "this build): the numbers of bf16, at fp32's speed plus the rounding copies";
#endif
}

}  // namespace course::cpu
