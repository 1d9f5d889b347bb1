// Benchmark: how fast is one training step on one CPU core, and where does the time go?
//
// Chapter 00 reports tokens/s; this program puts that number next to what the
// hardware can do. It first measures the machine's own matrix-multiply rate
// (cblas_sgemm on large square matrices: the best case for this core), then
// times full training steps of two model sizes, built exactly as
// 00_single_gpu/main.cpp builds them, and reports
//   achieved GFLOP/s = tokens/s x training_flops_per_token(config)
// as a percentage of that sgemm rate. The gap is the cost of everything that is
// not a big GEMM: small per-head attention GEMMs, softmax, LayerNorm, GELU,
// cross-entropy, and the memory-bound AdamW update.
//
// It is a measurement, not a test: it prints two tables and checks nothing.
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "benchmarks/step_timer.h"
#include "common/train/cli.h"
#include "common/train/metrics.h"
#include "common/model/model.h"

using namespace course;

// ----------------------------------------------------------------------------
// the machine's reference rate: one big square sgemm, best of a few repetitions

// Best-of rather than median: we want what the core CAN do, and on a shared
// machine any slower repetition was slowed down by someone else.
static double sgemm_gflops(int n, int repetitions) {
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size(), 0.0f);
  double best_seconds = 1e30;
  for (int r = 0; r < repetitions; r++) {
    const double start = now_seconds();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(),
                n);
    best_seconds = std::min(best_seconds, now_seconds() - start);
  }
  return 2.0 * n * n * n / best_seconds / 1e9;  // n^3 multiply-adds = 2 n^3 FLOPs
}

// ----------------------------------------------------------------------------
// one model configuration: build it as chapter 00 does, then time its steps

struct BenchConfig {
  std::string name;
  GPTConfig model;
  int batch;
};

// The model shape in the order of the trainer's flags, so the two lines below
// read like the command lines they stand for.
static GPTConfig shape(int seq, int d_model, int heads, int layers) {
  GPTConfig config;
  config.seq_len = seq;
  config.d_model = d_model;
  config.n_head = heads;
  config.n_layer = layers;
  return config;
}

// ----------------------------------------------------------------------------
// main: flags, the reference rate, the two tables

static int bench(int argc, char** argv) {
  int steps = 10, warmup = 2, threads = 1;
  ArgParser parser("bench_train_step", "Times full training steps on the CPU and compares them with sgemm.");
  parser.add_int("--steps", &steps, 1, "timed training steps per configuration");
  parser.add_int("--warmup", &warmup, 0, "untimed steps before those");
  parser.add_int("--threads", &threads, 1, "OpenBLAS threads (1 = one core, the course's default)");
  parser.parse(argc, argv);
  // One thread by default: the course's ranks each use one core, and a
  // single-threaded number is the one that is comparable between machines.
  openblas_set_num_threads(threads);

  std::printf("OpenBLAS: %s | %d thread(s) | %d warmup + %d timed steps per config\n\n", openblas_get_config(),
              threads, warmup, steps);

  // ---- reference: the sgemm rate ------------------------------------------------
  // Square matrices this big keep the core's FMA units busy; this is the
  // ceiling a training step could approach if it were nothing but large GEMMs.
  double peak = 0.0;
  for (int n : {512, 1024}) {
    const double rate = sgemm_gflops(n, 5);
    std::printf("sgemm %4d x %4d x %4d: %7.1f GFLOP/s\n", n, n, n, rate);
    peak = std::max(peak, rate);
  }
  std::printf("reference rate (best): %.1f GFLOP/s\n\n", peak);

  // ---- the configurations -----------------------------------------------------------
  // tiny = chapter 00's defaults; larger = wider and deeper, yet only about 2 s
  // a step on one core (about 25 s for the default 12 steps)
  std::vector<BenchConfig> configs = {
      {"tiny", shape(128, 128, 4, 4), 8},    // --seq 128 --d-model 128 --heads 4 --layers 4 --batch 8
      {"larger", shape(256, 384, 6, 6), 8},  // --seq 256 --d-model 384 --heads 6 --layers 6 --batch 8
  };
  std::vector<StepTimes> results;
  for (const BenchConfig& c : configs) {
    std::printf("running %s (seq %d, d_model %d, heads %d, layers %d, batch %d) ...\n", c.name.c_str(),
                c.model.seq_len, c.model.d_model, c.model.n_head, c.model.n_layer, c.batch);
    std::fflush(stdout);
    results.push_back(time_training_steps(c.model, c.batch, warmup, steps, Device::CPU));
  }

  // ---- table 1: throughput -------------------------------------------------------------
  std::printf("\n%-8s %11s %12s %10s %10s %9s %9s\n", "config", "parameters", "tokens/step", "ms/step", "tokens/s",
              "GFLOP/s", "% sgemm");
  for (size_t i = 0; i < configs.size(); i++) {
    const StepTimes& r = results[i];
    const double tokens_per_s = r.tokens_per_step / (r.step_ms / 1e3);
    const double gflops = tokens_per_s * training_flops_per_token(configs[i].model) / 1e9;
    std::printf("%-8s %11zu %12d %10.1f %10.0f %9.1f %8.1f%%\n", configs[i].name.c_str(), r.parameters,
                r.tokens_per_step, r.step_ms, tokens_per_s, gflops, 100.0 * gflops / peak);
  }

  // ---- table 2: where the step goes ------------------------------------------------------
  // Percentages are of the three phases' sum; medians of phases need not add up
  // exactly to the median step.
  std::printf("\n%-8s %15s %15s %15s   (optimizer = zero_grad + AdamW)\n", "config", "forward", "backward",
              "optimizer");
  for (size_t i = 0; i < configs.size(); i++) {
    const StepTimes& r = results[i];
    const double sum = r.forward_ms + r.backward_ms + r.optimizer_ms;
    auto cell = [&](double ms) {
      char text[32];
      std::snprintf(text, sizeof(text), "%.1f ms %3.0f%%", ms, 100.0 * ms / sum);  // "728.4 ms  37%"
      return std::string(text);
    };
    std::printf("%-8s %15s %15s %15s\n", configs[i].name.c_str(), cell(r.forward_ms).c_str(),
                cell(r.backward_ms).c_str(), cell(r.optimizer_ms).c_str());
  }
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("bench_train_step", [&] { return bench(argc, argv); });
}
