// The program every rank runs in the tensor-parallel tests: each piece of
// 06_tensor_parallel on this rank's slices, checked against chapter 00's unsplit
// op (or whole model) computed on every rank from the same inputs.
//
//   tp_worker [--backend auto|tcp|mpi] [--sp] [--comm-timeout S]
//
// 1. column-parallel linear: this rank's output features and, after f's backward,
//    the whole dL/dx; its weight and bias gradients are its rows of the unsplit ones;
// 2. row-parallel linear: the summed output (g) and its slice of dL/dx and dW;
// 3. vocabulary-parallel cross-entropy: every loss, and this rank's columns of
//    dlogits, with targets in every rank's slice of the vocabulary;
// 4. the whole model: one forward and backward of TPPart against common/model/model.h's
//    GPT: the loss, and every parameter's gradient on this rank against the
//    matching elements of the GPT's (global_index), split and replicated alike.
//
// 5. bf16 storage: at --dtype bf16 (bf16 GEMMs, bf16 messages), the model storing its
//    linear layers' saved inputs in bf16 (model.h's LinearInput; with SP gathered as
//    they are) computes the loss and gradients of the model storing them in fp32, bit
//    for bit.
//
// Bound: the split changes only the order of additions (a GEMM's sum over its input
// features is cut into N partial sums that g adds; softmax sums likewise), so every
// result must be within 1e-5 of the largest magnitude of the reference's tensor.
// Prints "rank R: all checks passed" and exits 0 when all is well.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "06_tensor_parallel/tensor_parallel.h"
#include "06_tensor_parallel/tp_model.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/model/model.h"
#include "common/tensor/device.h"
#include "common/tensor/ops.h"
#include "common/model/rng.h"
#include "support/forward_loss.h"

using namespace course;
using course_test::forward_loss;

namespace {

const double kTolerance = 1e-5;
int failures = 0;
int my_rank = 0;

// n values ~ N(0, 1), the same on every rank
std::vector<float> random_values(size_t n, uint64_t stream) {
  CounterRng rng(42, stream);
  std::vector<float> values(n);
  for (size_t i = 0; i < n; i++) values[i] = static_cast<float>(rng.normal(i));
  return values;
}

// actual[i] against expected[index(i)], within kTolerance x max |expected|
template <typename Index>
void expect_close(const std::string& what, const float* actual, size_t count, const std::vector<float>& expected,
                  Index index) {
  double largest = 0.0, worst = 0.0;
  for (float value : expected) largest = std::max(largest, std::fabs(static_cast<double>(value)));
  for (size_t i = 0; i < count; i++) {
    worst = std::max(worst, std::fabs(static_cast<double>(actual[i]) - expected[index(i)]));
  }
  if (!(worst <= kTolerance * std::max(largest, 1e-30))) {
    failures++;
    std::fprintf(stderr, "rank %d: %s: differs by %g of %g (bound %g)\n", my_rank, what.c_str(), worst, largest,
                 kTolerance * largest);
  }
}

void expect_close(const std::string& what, const float* actual, const std::vector<float>& expected) {
  expect_close(what, actual, expected.size(), expected, [](size_t i) { return i; });
}

// rows [first_row, first_row + rows) of every sequence (B, T, C) -> (B, rows, C)
std::vector<float> sequence_chunk(const std::vector<float>& whole, int B, int T, int C, int first_row, int rows) {
  std::vector<float> chunk;
  for (int b = 0; b < B; b++) {
    const auto begin = whole.begin() + (static_cast<size_t>(b) * T + first_row) * C;
    chunk.insert(chunk.end(), begin, begin + static_cast<size_t>(rows) * C);
  }
  return chunk;
}

// ----------------------------------------------------------------------------
// 1 and 2: the parallel linear layers

void check_linear_layers(TPGroup& tp) {
  const int B = tp.batch(), T = tp.seq(), C = tp.width(), N = tp.size(), r = tp.rank(), rows = B * T;
  const int OC = 2 * C, OCl = OC / N, Tl = tp.local_seq();
  const std::vector<float> x = random_values(static_cast<size_t>(rows) * C, 1);    // (B, T, C)
  const std::vector<float> w = random_values(static_cast<size_t>(OC) * C, 2);      // (OC, C)
  const std::vector<float> bias = random_values(OC, 3);                            // (OC)
  const std::vector<float> dy = random_values(static_cast<size_t>(rows) * OC, 4);  // (B, T, OC)
  std::vector<float> whole(static_cast<size_t>(rows) * C), partial(static_cast<size_t>(rows) * C),
      local(static_cast<size_t>(B) * Tl * C);
  std::vector<float> x_local = sequence_chunk(x, B, T, C, tp.first_position(), Tl);
  const auto local_row = [&](size_t i) {  // element i of (B, Tl, C) -> its index in (B, T, C)
    const size_t b = i / (static_cast<size_t>(Tl) * C), rest = i % (static_cast<size_t>(Tl) * C);
    return (b * T + tp.first_position()) * C + rest;
  };

  // column-parallel: y = x W^T + b, this rank's output features [r OCl, (r+1) OCl)
  std::vector<float> y(static_cast<size_t>(rows) * OC), dx(static_cast<size_t>(rows) * C, 0.0f),
      dw(static_cast<size_t>(OC) * C, 0.0f), db(OC, 0.0f);
  ops::linear_forward(y.data(), x.data(), w.data(), bias.data(), rows, C, OC);
  ops::linear_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), rows, C, OC);
  const std::vector<float> w_rows(w.begin() + static_cast<size_t>(r) * OCl * C,
                                  w.begin() + static_cast<size_t>(r + 1) * OCl * C);
  const std::vector<float> b_rows(bias.begin() + r * OCl, bias.begin() + (r + 1) * OCl);
  std::vector<float> dy_cols;
  for (int i = 0; i < rows; i++) {
    const auto begin = dy.begin() + static_cast<size_t>(i) * OC + r * OCl;
    dy_cols.insert(dy_cols.end(), begin, begin + OCl);
  }
  std::vector<float> y_local(static_cast<size_t>(rows) * OCl), dw_local(static_cast<size_t>(OCl) * C, 0.0f),
      db_local(OCl, 0.0f);
  TPScratch scratch{whole.data(), partial.data(), local.data()};
  ColumnParallelLinear column(tp, {w_rows.data(), b_rows.data(), dw_local.data(), db_local.data()}, OCl);
  column.forward(y_local.data(), x_local.data(), scratch);
  expect_close("column-parallel forward", y_local.data(), y_local.size(), y,
               [&](size_t i) { return (i / OCl) * OC + r * OCl + i % OCl; });
  const float* dx_local = column.backward(dy_cols.data(), x_local.data(), scratch);
  expect_close("column-parallel dx (after f's backward)", dx_local, static_cast<size_t>(B) * Tl * C, dx, local_row);
  expect_close("column-parallel dW", dw_local.data(), dw_local.size(), dw,
               [&](size_t i) { return static_cast<size_t>(r) * OCl * C + i; });
  expect_close("column-parallel db", db_local.data(), db_local.size(), db, [&](size_t i) { return r * OCl + i; });

  // row-parallel: y = x W^T, W (C, OC) with this rank's input features [r OCl, (r+1) OCl)
  const std::vector<float> x2 = random_values(static_cast<size_t>(rows) * OC, 5);  // (B, T, OC)
  const std::vector<float> w2 = random_values(static_cast<size_t>(C) * OC, 6);     // (C, OC)
  const std::vector<float> dy2 = random_values(static_cast<size_t>(rows) * C, 7);  // (B, T, C)
  std::vector<float> y2(static_cast<size_t>(rows) * C), dx2(static_cast<size_t>(rows) * OC, 0.0f),
      dw2(static_cast<size_t>(C) * OC, 0.0f);
  ops::linear_forward(y2.data(), x2.data(), w2.data(), nullptr, rows, OC, C);
  ops::linear_backward(dx2.data(), dw2.data(), nullptr, dy2.data(), x2.data(), w2.data(), rows, OC, C);
  std::vector<float> x2_cols, w2_cols;
  for (int i = 0; i < rows; i++) {
    const auto begin = x2.begin() + static_cast<size_t>(i) * OC + r * OCl;
    x2_cols.insert(x2_cols.end(), begin, begin + OCl);
  }
  for (int i = 0; i < C; i++) {
    const auto begin = w2.begin() + static_cast<size_t>(i) * OC + r * OCl;
    w2_cols.insert(w2_cols.end(), begin, begin + OCl);
  }
  // a zero bias and a zero residual: the layer's output is the sum alone
  const std::vector<float> zero_bias(C, 0.0f), zero_residual(static_cast<size_t>(B) * Tl * C, 0.0f);
  std::vector<float> dx2_local(static_cast<size_t>(rows) * OCl, 0.0f), dw2_local(static_cast<size_t>(C) * OCl, 0.0f),
      db2(C, 0.0f);
  RowParallelLinear row(tp, {w2_cols.data(), zero_bias.data(), dw2_local.data(), db2.data()}, OCl);
  row.forward(local.data(), x2_cols.data(), zero_residual.data(), scratch);
  const float* y2_local = local.data();
  expect_close("row-parallel forward (after g)", y2_local, static_cast<size_t>(B) * Tl * C, y2, local_row);
  const std::vector<float> dy2_local = sequence_chunk(dy2, B, T, C, tp.first_position(), Tl);
  row.backward(dx2_local.data(), dy2_local.data(), x2_cols.data(), scratch);
  expect_close("row-parallel dx", dx2_local.data(), dx2_local.size(), dx2,
               [&](size_t i) { return (i / OCl) * OC + r * OCl + i % OCl; });
  expect_close("row-parallel dW", dw2_local.data(), dw2_local.size(), dw2,
               [&](size_t i) { return (i / OCl) * OC + r * OCl + i % OCl; });
}

// ----------------------------------------------------------------------------
// 3: vocabulary-parallel cross-entropy

void check_cross_entropy(TPGroup& tp) {
  const int B = 2, T = 8, V = 256, N = tp.size(), r = tp.rank(), Vl = V / N, rows = B * T;
  std::vector<float> logits = random_values(static_cast<size_t>(rows) * V, 8);
  for (float& z : logits) z *= 4.0f;  // spread, so the max matters
  std::vector<int> targets(rows);
  for (int i = 0; i < rows; i++) targets[i] = (i * 37 + 11) % V;  // targets land in every rank's slice
  std::vector<float> losses(rows), probs(static_cast<size_t>(rows) * V), dlogits(static_cast<size_t>(rows) * V, 0.0f);
  ops::crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), B, T, V);
  ops::crossentropy_backward(dlogits.data(), probs.data(), targets.data(), 0.5f, B, T, V);

  std::vector<float> mine;
  for (int i = 0; i < rows; i++) {
    const auto begin = logits.begin() + static_cast<size_t>(i) * V + r * Vl;
    mine.insert(mine.end(), begin, begin + Vl);
  }
  std::vector<float> tp_losses(rows), tp_probs(static_cast<size_t>(rows) * Vl), scratch(3 * rows),
      tp_dlogits(static_cast<size_t>(rows) * Vl, 0.0f);
  vocab_crossentropy_forward(tp, tp_losses.data(), tp_probs.data(), mine.data(), targets.data(), scratch.data(),
                             r * Vl, B, T, Vl);
  tp_ops::vocab_crossentropy_backward(tp_dlogits.data(), tp_probs.data(), targets.data(), 0.5f, r * Vl, B, T, Vl);
  const auto my_column = [&](size_t i) { return (i / Vl) * V + r * Vl + i % Vl; };
  expect_close("vocab-parallel cross-entropy losses", tp_losses.data(), losses);
  expect_close("vocab-parallel cross-entropy dlogits", tp_dlogits.data(), tp_dlogits.size(), dlogits, my_column);
}

// ----------------------------------------------------------------------------
// 4: the whole model against chapter 00's GPT

void check_whole_model(TPGroup& tp, const GPTConfig& config) {
  const int B = tp.batch(), T = config.seq_len, L = config.n_layer;
  const uint64_t seed = 7;
  std::vector<int> tokens(static_cast<size_t>(B) * T), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); i++) {
    tokens[i] = static_cast<int>((i * 131 + 7) % config.vocab_size);
    targets[i] = static_cast<int>((i * 59 + 3) % config.vocab_size);
  }
  const float dloss = 1.0f / (static_cast<float>(B) * T);

  GPT reference(config, B, seed);
  const float reference_loss = forward_loss(reference, Device::CPU, tokens.data(), targets.data());
  reference.backward(dloss);

  TPPart part(config, tp, 0, L + 1, seed);
  TPActivations acts(config, tp, 0, L + 1);
  TPWorkspace work(config, tp);
  acts.batch.fill(tokens.data(), targets.data());
  part.grads.zero();
  const float loss = forward_loss(part, tp.device(), acts, work);
  part.backward(acts, nullptr, nullptr, dloss, work);
  part.finish_gradients();
  expect_close("whole-model loss", &loss, {reference_loss});

  // every parameter: the slice this rank holds, against the GPT's whole tensor
  size_t stage_offset = 0;
  for (const StageLayout& stage : model_layout(config)) {
    for (const ParamSpec& spec : stage.params) {
      const TPParam& param = part.layout().find(spec.name);
      const size_t global = stage_offset + spec.offset;
      const std::vector<float> ref_params(reference.params.data() + global,
                                          reference.params.data() + global + spec.numel);
      const std::vector<float> ref_grads(reference.grads.data() + global, reference.grads.data() + global + spec.numel);
      const auto index = [&](size_t i) { return global_index(param, tp.rank(), tp.size(), i); };
      // initialisation: exactly chapter 00's values (the same function of the same global index)
      for (size_t i = 0; i < param.local_numel; i++) {
        if (part.params.data()[param.local_offset + i] != ref_params[index(i)]) {
          failures++;
          std::fprintf(stderr, "rank %d: %s element %zu is not chapter 00's initial value\n", my_rank,
                       spec.name.c_str(), i);
          break;
        }
      }
      expect_close("gradient of " + spec.name, part.grads.data() + param.local_offset, param.local_numel, ref_grads,
                   index);
    }
    stage_offset += stage.numel;
  }
}

// ----------------------------------------------------------------------------
// 5: bf16 storage of the linear layers' inputs, against fp32 storage, at bf16

// one forward and backward of the whole model at bf16: its loss and this rank's gradients.
// split: zero bubble's two halves (the weight half gathers the stored inputs again with SP)
std::vector<float> loss_and_gradients_at_bf16(Comm& world, bool sequence_parallel, GPTConfig config,
                                              DType linear_inputs, bool split, Recompute recompute) {
  config.linear_inputs = linear_inputs;
  TPGroup tp(world, sequence_parallel, /*B=*/2, config.seq_len, config.d_model, Device::CPU, DType::BF16);
  const int B = tp.batch(), T = config.seq_len, L = config.n_layer;
  std::vector<int> tokens(static_cast<size_t>(B) * T), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); i++) {
    tokens[i] = static_cast<int>((i * 131 + 7) % config.vocab_size);
    targets[i] = static_cast<int>((i * 59 + 3) % config.vocab_size);
  }
  TPPart part(config, tp, 0, L + 1, /*seed=*/7);
  TPActivations acts(config, tp, 0, L + 1, split, recompute);
  TPWorkspace work(config, tp, recompute);
  acts.batch.fill(tokens.data(), targets.data());
  part.grads.zero();
  std::vector<float> result = {forward_loss(part, tp.device(), acts, work)};
  const float dloss = 1.0f / (static_cast<float>(B) * T);
  if (split) {
    part.backward_input(acts, nullptr, nullptr, dloss, work);
    part.backward_weight(acts, work);
  } else {
    part.backward(acts, nullptr, nullptr, dloss, work);
  }
  part.finish_gradients();
  result.insert(result.end(), part.grads.data(), part.grads.data() + part.grads.size());
  return result;
}

void check_bf16_storage(Comm& world, bool sequence_parallel, const GPTConfig& config) {
  struct Variant {
    const char* name;
    bool split;
    Recompute recompute;
  };
  set_matmul_precision(MatmulPrecision::BF16);
  for (const Variant& v : {Variant{"whole backward", false, Recompute::None},
                           Variant{"zero bubble's split backward", true, Recompute::None},
                           Variant{"--recompute full", false, Recompute::Full}}) {
    const std::vector<float> fp32 =
        loss_and_gradients_at_bf16(world, sequence_parallel, config, DType::F32, v.split, v.recompute);
    const std::vector<float> bf16 =
        loss_and_gradients_at_bf16(world, sequence_parallel, config, DType::BF16, v.split, v.recompute);
    if (bf16 != fp32) {
      failures++;
      std::fprintf(stderr, "rank %d: at bf16 (%s), the loss (%.9g against %.9g) or gradients storing the linear "
                   "inputs in bf16 are not fp32 storage's bits\n", my_rank, v.name, bf16[0], fp32[0]);
    }
  }
  set_matmul_precision(MatmulPrecision::FP32);
}

int run(int argc, char** argv) {
  CommOptions options;
  bool sequence_parallel = false;
  ArgParser parser("tp_worker", "Checks chapter 06's pieces against the unsplit ops (the TP tests' worker).");
  add_comm_flags(parser, options);
  parser.add_switch("--sp", &sequence_parallel, "sequence parallelism");
  parser.parse(argc, argv);
  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), options);
  my_rank = world->rank();

  GPTConfig config;
  config.n_layer = 2;
  config.d_model = 32;
  config.n_head = 4;
  config.seq_len = 16;
  check_tp_shape(config, world->size(), sequence_parallel);
  TPGroup group(*world, sequence_parallel, /*B=*/2, config.seq_len, config.d_model);
  check_linear_layers(group);
  check_cross_entropy(group);
  check_whole_model(group, config);
  check_bf16_storage(*world, sequence_parallel, config);
  world->barrier();
  if (failures > 0) {
    std::fprintf(stderr, "rank %d: %d check(s) failed\n", world->rank(), failures);
    return 1;
  }
  std::printf("rank %d: all checks passed (%s, %d ranks%s)\n", world->rank(), world->backend().c_str(), world->size(),
              sequence_parallel ? ", sequence parallel" : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("tp_worker", [&] { return run(argc, argv); });
}
