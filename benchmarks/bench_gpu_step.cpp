// Benchmark: chapter 00's training step on a GPU, in fp32, TF32 and bf16.
//
// The model is GPT-2 124M's shape (12 layers, d_model 768, 12 heads, 1024
// positions) with the course's byte vocabulary (256 instead of 50257, so about
// 85M parameters: the blocks are GPT-2's, the embedding and the head are small).
// For each matmul precision it times full training steps, built exactly as
// 00_single_gpu builds them, and reports
//   achieved TFLOP/s = tokens/s x training_flops_per_token(config)
//   MFU              = achieved TFLOP/s / the GPU's dense bf16 peak (--peak-tflops)
// MFU is against the bf16 peak in every row, so the rows compare with each other
// and with benchmarks/pytorch_gpt.py, which uses the same FLOP count. The GEMM
// column is the rate cuBLAS reaches alone, in the row's precision, on the model's
// largest product (the MLP's up-projection): the ceiling the step's matmuls can
// approach, so "step / GEMM" says how much of it the rest of the step (attention's
// softmax, LayerNorm, GELU, AdamW, the bf16 input copies) costs.
//
// It is a measurement, not a test: it prints a table and checks nothing.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/step_timer.h"
#include "common/train/cli.h"
#include "common/tensor/cuda/gemm.h"
#include "common/tensor/cuda/runtime.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/train/metrics.h"
#include "common/model/model.h"
#include "common/model/rng.h"

using namespace course;

static MatmulPrecision parse_precision(const std::string& name) {
  if (name == "fp32") return MatmulPrecision::FP32;
  if (name == "tf32") return MatmulPrecision::TF32;
  if (name == "bf16") return MatmulPrecision::BF16;
  throw UsageError("--dtypes: unknown precision '" + name + "' (hint: a comma-separated list of fp32, tf32, bf16)");
}

// TFLOP/s of cuBLAS alone on (B*T, C) @ (C, 4C)^T, the inputs already in the
// precision's type (no bf16 copies timed), averaged over `repeats` calls.
static double gemm_tflops(const GPTConfig& config, int batch, MatmulPrecision precision, int repeats) {
  const int M = batch * config.seq_len, K = config.d_model, N = 4 * config.d_model;
  Buffer a(static_cast<size_t>(M) * K, MemCategory::Workspace, Device::CUDA);  // (M, K)
  Buffer b(static_cast<size_t>(N) * K, MemCategory::Workspace, Device::CUDA);  // (N, K)
  Buffer c(static_cast<size_t>(M) * N, MemCategory::Workspace, Device::CUDA);  // (M, N)
  std::vector<float> values(a.size());
  const CounterRng rng(/*seed=*/1, /*stream=*/0);
  // random, not zeros: a GPU multiplies zeros at lower power, so faster than real data
  for (size_t i = 0; i < values.size(); i++) values[i] = static_cast<float>(rng.uniform(i)) - 0.5f;
  copy_bytes(a.data(), Device::CUDA, values.data(), Device::CPU, a.bytes());
  copy_bytes(b.data(), Device::CUDA, values.data(), Device::CPU, b.bytes());
  const cuda::GemmMode mode = cuda::gemm_mode(precision);
  const cuda::GemmInput a_in(a.data(), static_cast<int64_t>(a.size()), mode);
  const cuda::GemmInput b_in(b.data(), static_cast<int64_t>(b.size()), mode);
  const auto multiply = [&] {
    cuda::gemm_row_major(mode, false, true, M, N, K, 1.0f, a_in.at(0), K, b_in.at(0), K, 0.0f, c.data(), N);
  };
  multiply();
  synchronize(Device::CUDA);
  const double start = now_seconds();
  for (int i = 0; i < repeats; i++) multiply();
  synchronize(Device::CUDA);
  const double seconds = (now_seconds() - start) / repeats;
  return 2.0 * M * N * K / seconds / 1e12;
}

static int bench(int argc, char** argv) {
  GPTConfig config;
  config.n_layer = 12;
  config.d_model = 768;
  config.n_head = 12;
  config.seq_len = 1024;
  int batch = 8, steps = 10, warmup = 3;
  float peak_tflops = 989.4f;  // H100 SXM, dense bf16
  std::string dtypes = "fp32,tf32,bf16";
  ArgParser parser("bench_gpu_step", "Times chapter 00's training step on a GPU in fp32, TF32 and bf16.");
  parser.add_int("--layers", &config.n_layer, 1, "transformer blocks L");
  parser.add_int("--d-model", &config.d_model, 1, "model width C");
  parser.add_int("--heads", &config.n_head, 1, "attention heads NH");
  parser.add_int("--seq", &config.seq_len, 1, "sequence length T");
  parser.add_int("--batch", &batch, 1, "sequences per step");
  parser.add_int("--steps", &steps, 1, "timed training steps per precision");
  parser.add_int("--warmup", &warmup, 0, "untimed steps before those");
  parser.add_float("--peak-tflops", &peak_tflops, 0.0f, true, "the GPU's dense bf16 peak, for MFU");
  parser.add_string("--dtypes", &dtypes, "precisions to time, comma-separated: fp32, tf32, bf16");
  parser.parse(argc, argv);
  if (config.d_model % config.n_head != 0) throw UsageError("--heads must divide --d-model");
  std::vector<MatmulPrecision> precisions;
  std::stringstream list(dtypes);
  for (std::string name; std::getline(list, name, ',');) precisions.push_back(parse_precision(name));

  const Device device = select_device("cuda");
  const double flops_per_token = training_flops_per_token(config);
  std::printf("%s | L%d C%d NH%d T%d batch %d | %.3g training FLOPs per token | MFU vs %.1f TFLOP/s\n\n",
              describe_device(device).c_str(), config.n_layer, config.d_model, config.n_head, config.seq_len, batch,
              flops_per_token, peak_tflops);
  std::printf("%-6s %11s %9s %10s %9s %7s %12s %12s %12s %12s %12s %11s\n", "dtype", "parameters", "ms/step",
              "tokens/s", "TFLOP/s", "MFU", "forward ms", "backward ms", "optimizer ms", "reserved GiB",
              "GEMM TFLOP/s", "step / GEMM");
  for (MatmulPrecision precision : precisions) {
    set_matmul_precision(precision);
    const StepTimes t = time_training_steps(config, batch, warmup, steps, device);
    const double tokens_per_s = t.tokens_per_step / (t.step_ms / 1e3);
    const double tflops = tokens_per_s * flops_per_token / 1e12;
    const double reserved_gib = cuda::pool_stats().peak_reserved_bytes / (1024.0 * 1024.0 * 1024.0);
    const double gemm = gemm_tflops(config, batch, precision, steps);
    std::printf("%-6s %11zu %9.1f %10.0f %9.1f %6.1f%% %12.1f %12.1f %12.1f %12.2f %12.1f %10.1f%%\n",
                precision_name(precision), t.parameters, t.step_ms, tokens_per_s, tflops, 100.0 * tflops / peak_tflops,
                t.forward_ms, t.backward_ms, t.optimizer_ms, reserved_gib, gemm, 100.0 * tflops / gemm);
    std::fflush(stdout);
    cuda::empty_cache();  // the next precision starts from an empty pool, and its peak is its own
    cuda::reset_peak_reserved();
  }
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("bench_gpu_step", [&] { return bench(argc, argv); });
}
