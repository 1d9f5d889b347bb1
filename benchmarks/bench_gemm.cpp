// The CPU's GEMM paths on the chapters' shapes, one thread: OpenBLAS's sgemm (every fp32
// run), oneDNN's fp32 matmul, --dtype bf16 as this CPU runs it (cpu::gemm: oneDNN's bf16
// matmul where the CPU has bf16 instructions, otherwise rounded copies into sgemm), and
// oneDNN's bf16 matmul itself wherever it has a kernel (emulated on AVX512 without BF16).
//
//   ./build/bin/bench_gemm               # the table, GFLOP/s (median of 5 timings)
//   ONEDNN_MAX_CPU_ISA=AVX2 ./build/bin/bench_gemm   # what oneDNN does without AVX512
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common/tensor/clock.h"
#include "common/tensor/device.h"
#include "common/tensor/gemm_cpu.h"

using namespace course;

namespace {

struct Shape {
  const char* what;
  int M, N, K;
  bool transpose_b;  // a linear layer's forward multiplies by W^T
};

// GFLOP/s of `product` on M x N x K: the median of 5 timings of enough calls for 0.1 s
template <typename Product>
double gflops(const Shape& s, Product product) {
  product();  // first call: buffers grown, kernels built
  int calls = 1;
  for (double start = now_seconds(); now_seconds() - start < 0.02; calls++) product();
  calls = std::max(1, calls * 5);
  std::vector<double> rates;
  for (int round = 0; round < 5; round++) {
    const double start = now_seconds();
    for (int i = 0; i < calls; i++) product();
    rates.push_back(2.0 * s.M * s.N * s.K * calls / (now_seconds() - start) / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[2];
}

std::string cell(double rate) {
  if (rate < 0) return "-";
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", rate);
  return text;
}

}  // namespace

int main() {
  cpu::set_gemm_threads(1);
  // default model: B T = 1024 rows, C 128; C 512: B T = 2048; GPT-2 small's widths
  const std::vector<Shape> shapes = {
      {"default qkv", 1024, 384, 128, true},   {"default fc", 1024, 512, 128, true},
      {"default proj", 1024, 128, 512, true},  {"default dW", 128, 512, 1024, false},
      {"C 512 qkv", 2048, 1536, 512, true},    {"C 512 fc", 2048, 2048, 512, true},
      {"C 512 proj", 2048, 512, 2048, true},   {"GPT-2 fc", 2048, 3072, 768, true},
  };
  std::printf("%s\n", cpu::bf16_gemm_note().c_str());
  std::printf("GFLOP/s, one thread, median of 5 timings\n");
  std::printf("%-14s %5s %5s %5s | %8s %11s %11s %12s\n", "shape", "M", "N", "K", "sgemm", "oneDNN fp32",
              "bf16 (run)", "oneDNN bf16");
  for (const Shape& s : shapes) {
    const int lda = s.K, ldb = s.transpose_b ? s.K : s.N;
    std::vector<float> A(static_cast<size_t>(s.M) * s.K, 0.5f), B(static_cast<size_t>(s.K) * s.N, 0.25f),
        C(static_cast<size_t>(s.M) * s.N);
    const auto sgemm = [&] {
      cpu::gemm(false, s.transpose_b, s.M, s.N, s.K, 1.0f, A.data(), lda, B.data(), ldb, 0.0f, C.data(), s.N);
    };
    const auto onednn = [&](DType type) {
      return cpu::onednn_gemm(type, false, s.transpose_b, s.M, s.N, s.K, 1.0f, A.data(), lda, B.data(), ldb, 0.0f,
                              C.data(), s.N);
    };
    const double fp32 = gflops(s, sgemm);
    const double onednn_fp32 = onednn(DType::F32) ? gflops(s, [&] { onednn(DType::F32); }) : -1;
    set_matmul_precision(MatmulPrecision::BF16);
    const double run_bf16 = gflops(s, sgemm);
    set_matmul_precision(MatmulPrecision::FP32);
    const double onednn_bf16 = onednn(DType::BF16) ? gflops(s, [&] { onednn(DType::BF16); }) : -1;
    std::printf("%-14s %5d %5d %5d | %8s %11s %11s %12s\n", s.what, s.M, s.N, s.K, cell(fp32).c_str(),
                cell(onednn_fp32).c_str(), cell(run_bf16).c_str(), cell(onednn_bf16).c_str());
  }
  std::printf("(-: no such kernel in this build or on this CPU)\n");
  return 0;
}
