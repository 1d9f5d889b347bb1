// The GPU backend as a trainer uses it: choosing the device, a whole GPT trained on
// the GPU against the same GPT on the CPU, checkpoints moving between the two, and the
// memory a GPU run tracks. Label `cuda`: without a GPU every test case here but the
// first reports itself skipped (tests/support/gpu.h).
//
// Tolerances:
// - loss per step, fp32, 1e-5 relative: the course's promise (DESIGN.md: every chapter
//   matches chapter 00 within 1e-5 per step). Each op agrees with the CPU to ~1e-6
//   (test_cuda_ops.cpp); the loss is a mean over every position, which averages
//   these errors rather than adding them up. After an AdamW step the two devices'
//   parameters agree too, except where a gradient is so near 0 that its rounding
//   decides its sign, and there the gradient says the loss does not care.
// - gradients after step 1, fp32, 1e-4 of each parameter tensor's largest gradient:
//   a backward pass chains ~10 ops per block, each adding ~1e-6 relative, and the
//   LayerNorm and softmax backwards subtract nearly equal terms, which can amplify
//   it; tests/test_model.cpp holds the CPU to finite differences with the same bound.
// - loss under BF16, 1e-2 relative to the fp32 CPU loss: bf16 GEMM inputs carry a
//   relative 2e-3 of rounding (at most 5.4e-3 per op in the emulation test_cuda_ops.cpp
//   describes); the loss, a mean over positions of log-sum-exp minus a logit, averages
//   this, and at initialisation the logits are small, so their errors are smaller still.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/model/adamw.h"
#include "common/train/checkpoint.h"
#include "common/train/cli.h"
#include "common/tensor/cuda/runtime.h"  // cuda::pool_stats (this file is built only with COURSE_HAVE_CUDA)
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/tensor/memory.h"
#include "common/model/model.h"
#include "common/model/rng.h"
#include "support/forward_loss.h"
#include "support/gpu.h"
#include "support/process.h"

using namespace course;
using course_test::error_relative_to_max;
using course_test::forward_loss;
using course_test::MatmulPrecisionScope;
using course_test::require_gpu;
using course_test::same_bits;
using course_test::to_host;

namespace {

constexpr uint64_t kSeed = 1337;
constexpr int kMicroBatch = 3;
constexpr int kSteps = 3;

// Small but complete, with nothing a multiple of 32 but the byte vocabulary:
// T = 40, C = 72, 3 heads of 24.
GPTConfig test_config() {
  GPTConfig config;
  config.vocab_size = 256;
  config.seq_len = 40;
  config.n_layer = 2;
  config.d_model = 72;
  config.n_head = 3;
  return config;
}

// With weight decay, so the GPU's update of it is exercised too.
AdamWConfig test_optimizer() { return AdamWConfig{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f}; }

// Step `step`'s batch: kMicroBatch sequences of random bytes, and their targets.
struct Batch {
  std::vector<int> tokens, targets;
};
Batch batch_for(const GPTConfig& config, int step) {
  const size_t count = static_cast<size_t>(kMicroBatch) * config.seq_len;
  CounterRng rng(kSeed, 1000 + step);
  Batch batch{std::vector<int>(count), std::vector<int>(count)};
  for (size_t i = 0; i < count; i++) {
    batch.tokens[i] = static_cast<int>(rng.below(2 * i, config.vocab_size));
    batch.targets[i] = static_cast<int>(rng.below(2 * i + 1, config.vocab_size));
  }
  return batch;
}

// zero_grad, forward, backward of the mean loss: what a trainer does before its update
float forward_backward(GPT& model, int step) {
  const Batch batch = batch_for(model.config(), step);
  model.zero_grad();
  const float loss = forward_loss(model, model.device(), batch.tokens.data(), batch.targets.data());
  model.backward(1.0f / (static_cast<float>(kMicroBatch) * model.config().seq_len));
  return loss;
}

std::vector<float> host_copy(const Buffer& buffer) {
  if (buffer.device() == Device::CUDA) return to_host(buffer);
  return std::vector<float>(buffer.data(), buffer.data() + buffer.size());
}

// The fp32 CPU losses of kSteps training steps: the reference for the GPU runs.
std::vector<float> cpu_losses(const GPTConfig& config) {
  GPT model(config, kMicroBatch, kSeed);
  AdamW optimizer(test_optimizer(), model.params.size());
  std::vector<float> losses;
  for (int step = 1; step <= kSteps; step++) {
    losses.push_back(forward_backward(model, step));
    optimizer.update(model.params.data(), model.grads.data(), step);
  }
  return losses;
}

size_t tracked(Device device, MemCategory category) {
  return memory_totals(device).current[static_cast<int>(category)];
}

}  // namespace

// ----------------------------------------------------------------------------
// the one test that runs without a GPU

TEST_CASE("selecting the cuda device without a GPU is a UsageError naming the fix, and with one gives Device CUDA",
          "[cuda]") {
  REQUIRE(built_with_cuda());  // this executable is built only with the CUDA backend
  std::string why;
  if (cuda_device_count(&why) == 0) {
    INFO("no GPU here (" << why << "): select_device must refuse, pointing at --device cpu");
    REQUIRE_THROWS_AS(select_device("cuda"), UsageError);
    CHECK_THROWS_WITH(select_device("cuda"), Catch::Contains("--device cpu"));
  } else {
    CHECK(select_device("cuda") == Device::CUDA);
    CHECK(describe_device(Device::CUDA).rfind("cuda: GPU", 0) == 0);
  }
  CHECK(select_device("cpu") == Device::CPU);  // the CPU is there either way
}

// ----------------------------------------------------------------------------
// the model

TEST_CASE("a GPT trained for 3 steps on the GPU has the CPU's loss at every step and its gradients after the first",
          "[cuda]") {
  require_gpu();
  const GPTConfig config = test_config();
  GPT cpu(config, kMicroBatch, kSeed);
  GPT gpu(config, kMicroBatch, kSeed, Device::CUDA);
  AdamW cpu_optimizer(test_optimizer(), cpu.params.size());
  AdamW gpu_optimizer(test_optimizer(), gpu.params.size(), Device::CUDA);
  REQUIRE(gpu.params.device() == Device::CUDA);
  REQUIRE(gpu_optimizer.m.device() == Device::CUDA);
  // the same seed gives the same initial parameters, on either device, bit for bit
  REQUIRE(same_bits(to_host(gpu.params), host_copy(cpu.params)));

  for (int step = 1; step <= kSteps; step++) {
    INFO("step " << step);
    const float cpu_loss = forward_backward(cpu, step);
    const float gpu_loss = forward_backward(gpu, step);
    CHECK(std::abs(gpu_loss - cpu_loss) <= 1e-5 * std::abs(cpu_loss));

    if (step == 1) {
      // every parameter tensor's gradient, each relative to its own largest element
      const std::vector<float> gpu_grads = to_host(gpu.grads);
      const std::vector<StageLayout>& stages = cpu.layout();
      for (size_t s = 0; s < stages.size(); s++) {
        for (const ParamSpec& spec : stages[s].params) {
          const size_t begin = cpu.stage_offset(static_cast<int>(s)) + spec.offset;
          const std::vector<float> expected(cpu.grads.data() + begin, cpu.grads.data() + begin + spec.numel);
          const std::vector<float> actual(gpu_grads.begin() + begin, gpu_grads.begin() + begin + spec.numel);
          CAPTURE(spec.name);
          CHECK(error_relative_to_max(actual, expected) <= 1e-4);
        }
      }
    }
    cpu_optimizer.update(cpu.params.data(), cpu.grads.data(), step);
    gpu_optimizer.update(gpu.params.data(), gpu.grads.data(), step);
  }
}

TEST_CASE("a GPT with BF16 matmuls on the GPU stays within 1e-2 of the fp32 CPU loss for 3 steps", "[cuda]") {
  require_gpu();
  const GPTConfig config = test_config();
  const std::vector<float> expected = cpu_losses(config);

  const MatmulPrecisionScope bf16(MatmulPrecision::BF16);
  GPT gpu(config, kMicroBatch, kSeed, Device::CUDA);
  AdamW optimizer(test_optimizer(), gpu.params.size(), Device::CUDA);
  for (int step = 1; step <= kSteps; step++) {
    INFO("step " << step << ": CPU fp32 loss " << expected[step - 1]);
    const float loss = forward_backward(gpu, step);
    CHECK(std::abs(loss - expected[step - 1]) <= 1e-2 * std::abs(expected[step - 1]));
    optimizer.update(gpu.params.data(), gpu.grads.data(), step);
  }
}

// ----------------------------------------------------------------------------
// checkpoints

TEST_CASE("a training state saved from the GPU loads bit for bit on the CPU, and from there back on the GPU",
          "[cuda]") {
  require_gpu();
  const GPTConfig config = test_config();
  TrainOptions options;  // what save/load_training_state record and check
  options.model = config;
  options.batch = kMicroBatch;
  options.seed = kSeed;
  course_test::TempDir dir;
  const std::string from_gpu = dir.file("from_gpu.ckpt"), from_cpu = dir.file("from_cpu.ckpt");
  const int saved_step = 2;

  // two steps on the GPU, so both AdamW moments hold something
  GPT gpu(config, kMicroBatch, kSeed, Device::CUDA);
  AdamW gpu_optimizer(test_optimizer(), gpu.params.size(), Device::CUDA);
  for (int step = 1; step <= saved_step; step++) {
    forward_backward(gpu, step);
    gpu_optimizer.update(gpu.params.data(), gpu.grads.data(), step);
  }
  save_training_state(from_gpu, options, saved_step, gpu.params.data(), gpu_optimizer);
  const std::vector<float> params = to_host(gpu.params), m = to_host(gpu_optimizer.m), v = to_host(gpu_optimizer.v);

  // into a CPU model built from another seed: every value it ends up with came from the file
  GPT cpu(config, kMicroBatch, kSeed + 1);
  AdamW cpu_optimizer(test_optimizer(), cpu.params.size());
  REQUIRE_FALSE(same_bits(host_copy(cpu.params), params));
  CHECK(load_training_state(from_gpu, options, cpu.params.data(), cpu_optimizer) == saved_step);
  CHECK(same_bits(host_copy(cpu.params), params));
  CHECK(same_bits(host_copy(cpu_optimizer.m), m));
  CHECK(same_bits(host_copy(cpu_optimizer.v), v));

  // saved again from the CPU: the file holds host bytes whatever the device, so it is the same file
  save_training_state(from_cpu, options, saved_step, cpu.params.data(), cpu_optimizer);
  const bool same_file = course_test::read_file(from_cpu) == course_test::read_file(from_gpu);
  CHECK(same_file);

  // and from the CPU's file into a fresh GPU model
  GPT resumed(config, kMicroBatch, kSeed + 1, Device::CUDA);
  AdamW resumed_optimizer(test_optimizer(), resumed.params.size(), Device::CUDA);
  CHECK(load_training_state(from_cpu, options, resumed.params.data(), resumed_optimizer) == saved_step);
  CHECK(same_bits(to_host(resumed.params), params));
  CHECK(same_bits(to_host(resumed_optimizer.m), m));
  CHECK(same_bits(to_host(resumed_optimizer.v), v));

  // the next step's loss: the resumed GPU model computes the original's bit for bit (same
  // parameters, same GPU, and no atomics in forward: cuBLAS and the kernels are
  // deterministic there); the CPU model within the fp32 bound
  const int next = saved_step + 1;
  const float original_loss = forward_backward(gpu, next);
  CHECK(forward_backward(resumed, next) == original_loss);
  CHECK(std::abs(forward_backward(cpu, next) - original_loss) <= 1e-5 * std::abs(original_loss));
}

// ----------------------------------------------------------------------------
// memory

TEST_CASE("a CUDA Buffer is tracked by category while alive, starts zeroed, and a GPT counts the same bytes on "
          "either device",
          "[cuda]") {
  require_gpu();
  const size_t before = tracked(Device::CUDA, MemCategory::CommBuffers);
  const size_t before_cpu = tracked(Device::CPU, MemCategory::CommBuffers);
  {
    Buffer a(1000, MemCategory::CommBuffers, Device::CUDA);
    Buffer b(333, MemCategory::CommBuffers, Device::CUDA);
    CHECK(a.device() == Device::CUDA);
    CHECK(tracked(Device::CUDA, MemCategory::CommBuffers) == before + 4 * 1333);
    CHECK(tracked(Device::CPU, MemCategory::CommBuffers) == before_cpu);  // counted on its own device only
    Buffer moved = std::move(a);  // moving does not count twice
    CHECK(tracked(Device::CUDA, MemCategory::CommBuffers) == before + 4 * 1333);
    CHECK(memory_totals(Device::CUDA).peak[static_cast<int>(MemCategory::CommBuffers)] >= before + 4 * 1333);
  }
  CHECK(tracked(Device::CUDA, MemCategory::CommBuffers) == before);  // released on destruction

  // zeroed even when the caching pool hands out a block that held other values
  {
    const std::vector<float> ones(1000, 1.0f);
    Buffer dirty = course_test::to_device(ones);
  }
  const Buffer fresh(1000, MemCategory::Workspace, Device::CUDA);
  CHECK(same_bits(to_host(fresh), std::vector<float>(1000, 0.0f)));

  // a GPT and its AdamW: the bytes per category do not depend on the device (the GPU
  // adds only a Workspace buffer for the tokens, not compared here)
  const GPTConfig config = test_config();
  const MemCategory categories[] = {MemCategory::Parameters, MemCategory::Gradients, MemCategory::OptimizerState,
                                    MemCategory::Activations};
  auto model_bytes = [&](Device device) {
    std::vector<size_t> start, used;
    for (MemCategory category : categories) start.push_back(tracked(device, category));
    GPT model(config, kMicroBatch, kSeed, device);
    AdamW optimizer(test_optimizer(), model.params.size(), device);
    for (size_t i = 0; i < start.size(); i++) used.push_back(tracked(device, categories[i]) - start[i]);
    return used;
  };
  std::vector<size_t> gpu_start;
  for (MemCategory category : categories) gpu_start.push_back(tracked(Device::CUDA, category));
  const std::vector<size_t> on_cpu = model_bytes(Device::CPU), on_gpu = model_bytes(Device::CUDA);
  const size_t P = count_parameters(config);
  CHECK(on_gpu[0] == 4 * P);  // parameters
  CHECK(on_gpu[1] == 4 * P);  // gradients
  CHECK(on_gpu[2] == 8 * P);  // AdamW's m and v
  CHECK(on_gpu == on_cpu);
  // and all of it released with the model
  std::vector<size_t> gpu_end;
  for (MemCategory category : categories) gpu_end.push_back(tracked(Device::CUDA, category));
  CHECK(gpu_end == gpu_start);
}

TEST_CASE("the caching pool reuses a freed block: 100 allocations of one size cost at most 1 cudaMalloc", "[cuda]") {
  require_gpu();
  SECTION("device_allocate and device_free") {
    const size_t bytes = 3 * 1000 * 1000 + 7;  // above 1 MiB: rounded up to whole 2 MiB
    const cuda::PoolStats before = cuda::pool_stats();
    for (int i = 0; i < 100; i++) {
      void* block = cuda::device_allocate(bytes);
      REQUIRE(block != nullptr);
      cuda::device_free(block);
    }
    const cuda::PoolStats after = cuda::pool_stats();
    CHECK(after.allocations - before.allocations == 100);
    CHECK(after.cuda_malloc_calls - before.cuda_malloc_calls <= 1);
    // and the pool holds at most that one new block
    CHECK(after.reserved_bytes <= before.reserved_bytes + (bytes + (2u << 20)));
  }
  SECTION("Buffer, as the trainers allocate") {
    const size_t before_bytes = tracked(Device::CUDA, MemCategory::Workspace);
    const cuda::PoolStats before = cuda::pool_stats();
    for (int i = 0; i < 100; i++) {
      const Buffer buffer(12345, MemCategory::Workspace, Device::CUDA);  // 49380 bytes: rounded to 512
      REQUIRE(buffer.data() != nullptr);
    }
    const cuda::PoolStats after = cuda::pool_stats();
    CHECK(after.allocations - before.allocations == 100);
    CHECK(after.cuda_malloc_calls - before.cuda_malloc_calls <= 1);
    CHECK(tracked(Device::CUDA, MemCategory::Workspace) == before_bytes);  // each one released
  }
  SECTION("emptied and its peak reset, the pool's next peak is the next allocations' own") {
    void* big = cuda::device_allocate(64u << 20);
    cuda::device_free(big);
    cuda::empty_cache();
    cuda::reset_peak_reserved();
    const cuda::PoolStats reset = cuda::pool_stats();
    CHECK(reset.peak_reserved_bytes == reset.reserved_bytes);
    void* small = cuda::device_allocate(1u << 20);
    CHECK(cuda::pool_stats().peak_reserved_bytes < reset.reserved_bytes + (64u << 20));
    cuda::device_free(small);
  }
}
