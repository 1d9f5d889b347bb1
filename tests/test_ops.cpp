// Every op of common/tensor/ops.h against the double-precision reference in reference.h:
//
// 1. forward: the fp32 output agrees with the double reference on the same inputs;
// 2. backward: with dout = R, a fixed random tensor, backward computes the gradient of
//    L = sum(out * R). Each analytic fp32 gradient is compared with central finite
//    differences of L computed with the double reference;
// 3. backward accumulates (+=) as ops.h promises: two calls on the same gradient
//    buffers give twice one call.
//
// How errors are measured: error = max_i |actual_i - expected_i| / max(max_i |expected_i|, 1e-6),
// the worst deviation relative to the tensor's scale, so elements that happen to be
// near zero are not held to an impossible relative bound.
//
// Tolerances:
// - forward 1e-5: fp32 rounds each value to a relative 6e-8; the sums here have at most
//   V = 11 terms, so the accumulated error stays below 1e-6.
// - backward 1e-4: the fp32 gradient carries the rounding of the forward values it
//   reuses (mean, rstd, att, probs) and of its own sums, ~1e-6 relative; the finite
//   differences in double (h = 1e-4) are accurate to ~1e-8. 1e-4 leaves a wide margin
//   while a wrong term in a gradient formula gives errors of order 1.
// - accumulation 1e-6: the second call adds the same values again; BLAS may add the
//   existing value at a different point of its sum, which changes only the last bits.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "06_tensor_parallel/tp_ops.h"
#include "common/tensor/ops.h"
#include "support/finite_difference.h"
#include "support/random.h"
#include "reference.h"

using namespace course;

namespace {

using course_test::finite_difference_gradient;
using course_test::random_floats;
using course_test::random_ints;
using course_test::to_double;
using course_test::weighted_sum;

constexpr double kForwardTolerance = 1e-5;
constexpr double kBackwardTolerance = 1e-4;
constexpr double kAccumulateTolerance = 1e-6;
constexpr uint64_t kSeed = 1234;

// small shapes: every code path, fast enough to differentiate every element numerically
constexpr int B = 2, T = 5, C = 8, NH = 2, V = 11;
constexpr int N = B * T;


// twice[k] == 2 * once[k] for every gradient tensor k, within kAccumulateTolerance
// {dinp, dweight, dbias} against finite differences of loss(inp, weight, bias) in
// each argument in turn (layernorm and linear share this shape).
template <typename Loss>
void check_gradients_of_inp_weight_bias(const std::vector<std::vector<float>>& grads, const std::vector<float>& inp,
                                        const std::vector<float>& weight, const std::vector<float>& bias, Loss loss) {
  const std::vector<double> dinp = finite_difference_gradient(
      inp, [&](const std::vector<double>& x) { return loss(x, to_double(weight), to_double(bias)); });
  const std::vector<double> dweight = finite_difference_gradient(
      weight, [&](const std::vector<double>& x) { return loss(to_double(inp), x, to_double(bias)); });
  const std::vector<double> dbias = finite_difference_gradient(
      bias, [&](const std::vector<double>& x) { return loss(to_double(inp), to_double(weight), x); });
  CHECK(relative_error(grads[0], dinp) <= kBackwardTolerance);
  CHECK(relative_error(grads[1], dweight) <= kBackwardTolerance);
  CHECK(relative_error(grads[2], dbias) <= kBackwardTolerance);
}

void check_accumulates(const std::vector<std::vector<float>>& once, const std::vector<std::vector<float>>& twice) {
  REQUIRE(once.size() == twice.size());
  for (size_t k = 0; k < once.size(); k++) {
    std::vector<double> doubled(once[k].size());
    for (size_t i = 0; i < once[k].size(); i++) doubled[i] = 2.0 * once[k][i];
    CAPTURE(k);
    CHECK(relative_error(twice[k], doubled) <= kAccumulateTolerance);
  }
}

}  // namespace

// ----------------------------------------------------------------------------

TEST_CASE("embedding adds the token row and the position row, and scatters gradients back to both", "[ops]") {
  const int max_T = T + 2;  // wpe has more rows than positions used: the extra rows must get no gradient
  std::vector<int> tokens = random_ints(kSeed, N, 1, V);
  tokens[N - 1] = tokens[0];  // a repeated token: its wte row must receive two contributions
  const std::vector<float> wte = random_floats(kSeed, V * C, 2, 1.0);
  const std::vector<float> wpe = random_floats(kSeed, max_T * C, 3, 1.0);
  const std::vector<float> R = random_floats(kSeed, N * C, 4, 1.0);

  auto reference = [&](const std::vector<double>& wte64, const std::vector<double>& wpe64) {
    return reference_embedding(tokens.data(), wte64.data(), wpe64.data(), B, T, C);
  };
  // the gradients after `calls` backward calls on zeroed buffers: {dwte, dwpe}
  auto backward = [&](int calls) {
    std::vector<float> dwte(V * C, 0.0f), dwpe(max_T * C, 0.0f);
    for (int call = 0; call < calls; call++)
      ops::embedding_backward(dwte.data(), dwpe.data(), R.data(), tokens.data(), B, T, C);
    return std::vector<std::vector<float>>{dwte, dwpe};
  };

  SECTION("forward matches the double reference") {
    std::vector<float> out(N * C);
    ops::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    CHECK(relative_error(out, reference(to_double(wte), to_double(wpe))) <= kForwardTolerance);
  }
  SECTION("backward matches finite differences of the reference") {
    const std::vector<std::vector<float>> grads = backward(1);
    const std::vector<double> dwte = finite_difference_gradient(
        wte, [&](const std::vector<double>& x) { return weighted_sum(reference(x, to_double(wpe)), R); });
    const std::vector<double> dwpe = finite_difference_gradient(
        wpe, [&](const std::vector<double>& x) { return weighted_sum(reference(to_double(wte), x), R); });
    CHECK(relative_error(grads[0], dwte) <= kBackwardTolerance);
    CHECK(relative_error(grads[1], dwpe) <= kBackwardTolerance);
  }
  SECTION("backward accumulates into the gradients") { check_accumulates(backward(1), backward(2)); }
}

TEST_CASE("layernorm normalises each row and its backward matches finite differences", "[ops]") {
  // rows with a non-zero mean and a non-unit spread, so both the centring and the scaling matter
  const std::vector<float> inp = random_floats(kSeed, N * C, 1, 2.0, 0.5);
  const std::vector<float> weight = random_floats(kSeed, C, 2, 0.5, 1.0);
  const std::vector<float> bias = random_floats(kSeed, C, 3, 0.5);
  const std::vector<float> R = random_floats(kSeed, N * C, 4, 1.0);

  std::vector<float> out(N * C), mean(N), rstd(N);
  ops::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C);

  auto loss = [&](const std::vector<double>& inp64, const std::vector<double>& weight64,
                  const std::vector<double>& bias64) {
    return weighted_sum(reference_layernorm(inp64.data(), weight64.data(), bias64.data(), N, C), R);
  };
  // {dinp, dweight, dbias} after `calls` backward calls on zeroed buffers
  auto backward = [&](int calls) {
    std::vector<float> dinp(N * C, 0.0f), dweight(C, 0.0f), dbias(C, 0.0f);
    for (int call = 0; call < calls; call++)
      ops::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), R.data(), inp.data(), weight.data(),
                              mean.data(), rstd.data(), N, C);
    return std::vector<std::vector<float>>{dinp, dweight, dbias};
  };

  SECTION("forward matches the double reference") {
    CHECK(relative_error(out, reference_layernorm(to_double(inp).data(), to_double(weight).data(),
                                                  to_double(bias).data(), N, C)) <= kForwardTolerance);
  }
  SECTION("backward matches finite differences of the reference") {
    check_gradients_of_inp_weight_bias(backward(1), inp, weight, bias, loss);
  }
  SECTION("backward accumulates into the gradients") { check_accumulates(backward(1), backward(2)); }
}

TEST_CASE("linear computes inp @ weight^T + bias and its backward matches finite differences", "[ops]") {
  const int IC = C, OC = 12;
  const std::vector<float> inp = random_floats(kSeed, N * IC, 1, 1.0);
  const std::vector<float> weight = random_floats(kSeed, OC * IC, 2, 1.0);
  const std::vector<float> bias = random_floats(kSeed, OC, 3, 1.0);
  const std::vector<float> R = random_floats(kSeed, N * OC, 4, 1.0);

  // bias64 empty: no bias
  auto loss = [&](const std::vector<double>& inp64, const std::vector<double>& weight64,
                  const std::vector<double>& bias64) {
    const double* bias_or_null = bias64.empty() ? nullptr : bias64.data();
    return weighted_sum(reference_linear(inp64.data(), weight64.data(), bias_or_null, N, IC, OC), R);
  };
  // {dinp, dweight, dbias} after `calls` backward calls on zeroed buffers
  auto backward = [&](int calls) {
    std::vector<float> dinp(N * IC, 0.0f), dweight(OC * IC, 0.0f), dbias(OC, 0.0f);
    for (int call = 0; call < calls; call++)
      ops::linear_backward(dinp.data(), dweight.data(), dbias.data(), R.data(), inp.data(), weight.data(), N, IC, OC);
    return std::vector<std::vector<float>>{dinp, dweight, dbias};
  };

  SECTION("forward matches the double reference, with and without bias") {
    std::vector<float> out(N * OC);
    ops::linear_forward(out.data(), inp.data(), weight.data(), bias.data(), N, IC, OC);
    CHECK(relative_error(out, reference_linear(to_double(inp).data(), to_double(weight).data(),
                                               to_double(bias).data(), N, IC, OC)) <= kForwardTolerance);
    ops::linear_forward(out.data(), inp.data(), weight.data(), nullptr, N, IC, OC);
    CHECK(relative_error(out, reference_linear(to_double(inp).data(), to_double(weight).data(), nullptr, N, IC, OC)) <=
          kForwardTolerance);
  }
  SECTION("backward matches finite differences of the reference") {
    check_gradients_of_inp_weight_bias(backward(1), inp, weight, bias, loss);
  }
  SECTION("backward without dinp and dbias still computes dweight") {
    // the LM head passes null for both: dweight must not depend on them being there
    std::vector<float> dweight(OC * IC, 0.0f);
    ops::linear_backward(nullptr, dweight.data(), nullptr, R.data(), inp.data(), weight.data(), N, IC, OC);
    const std::vector<double> expected = finite_difference_gradient(
        weight, [&](const std::vector<double>& x) { return loss(to_double(inp), x, {}); });
    CHECK(relative_error(dweight, expected) <= kBackwardTolerance);
  }
  SECTION("backward accumulates into the gradients") { check_accumulates(backward(1), backward(2)); }
}

TEST_CASE("gelu follows the tanh approximation and its backward matches finite differences", "[ops]") {
  const int n = N * 4 * C;
  // spread over [-6, 6]: the linear middle, the curved shoulders and the flat tails
  const std::vector<float> inp = random_floats(kSeed, n, 1, 2.0);
  const std::vector<float> R = random_floats(kSeed, n, 2, 1.0);

  // {dinp} after `calls` backward calls on a zeroed buffer
  auto backward = [&](int calls) {
    std::vector<float> dinp(n, 0.0f);
    for (int call = 0; call < calls; call++) ops::gelu_backward(dinp.data(), inp.data(), R.data(), n);
    return std::vector<std::vector<float>>{dinp};
  };

  SECTION("forward matches the double reference") {
    std::vector<float> out(n);
    ops::gelu_forward(out.data(), inp.data(), n);
    CHECK(relative_error(out, reference_gelu(to_double(inp).data(), n)) <= kForwardTolerance);
  }
  SECTION("backward matches finite differences of the reference") {
    const std::vector<double> dinp = finite_difference_gradient(
        inp, [&](const std::vector<double>& x) { return weighted_sum(reference_gelu(x.data(), n), R); });
    CHECK(relative_error(backward(1)[0], dinp) <= kBackwardTolerance);
  }
  SECTION("backward accumulates into the gradient") { check_accumulates(backward(1), backward(2)); }
}

TEST_CASE("gelu is within a few ulp of the exact function everywhere it matters, and sane far out", "[ops]") {
  // every x = k/1024 in [-16, 16] (the range activations reach), against x sigmoid(2u)
  // in double (the same function as 0.5 x (1 + tanh(u)), without its cancellation).
  // The bound grows with |2u|: e^z of a z that is itself rounded (u is computed in
  // float) is off by |z| x (z's rounding), however exactly e^z is then computed.
  // The tanh form in float (before exp_approx) was off by up to 0.05 x (1 + |2u|) on
  // the left tail, where 1 + tanh(u) cancels; this one by 2.1e-7 x (1 + |2u|).
  std::vector<float> inp;
  for (int k = -16 * 1024; k <= 16 * 1024; k++) inp.push_back(k / 1024.0f);
  const int n = static_cast<int>(inp.size());
  std::vector<float> out(n), dinp(n, 0.0f), ones(n, 1.0f);
  ops::gelu_forward(out.data(), inp.data(), n);
  ops::gelu_backward(dinp.data(), inp.data(), ones.data(), n);
  const double scale = std::sqrt(2.0 / std::acos(-1.0));
  double worst_forward = 0.0, worst_backward = 0.0;
  for (int i = 0; i < n; i++) {
    const double x = inp[i], u = scale * (x + 0.044715 * x * x * x);
    const double s = 1.0 / (1.0 + std::exp(-2.0 * u));
    const double slope = 2.0 * x * s * (1.0 - s) * scale * (1.0 + 3.0 * 0.044715 * x * x);
    const double condition = 1.0 + std::fabs(2.0 * u);
    // relative where the value is a float's worth (gelu(-16) ~ -1e-300 is not)
    const double forward = x * s;
    worst_forward = std::max(worst_forward,
                             std::fabs(out[i] - forward) / std::max(std::fabs(forward), 1e-30) / condition);
    // the backward's two terms cancel where gelu turns (x ~ -0.75): relative to the larger term
    const double backward = s + slope, term = std::max(std::fabs(s), std::fabs(slope));
    worst_backward =
        std::max(worst_backward, std::fabs(dinp[i] - backward) / std::max(term, 1e-30) / condition);
  }
  INFO("max error / (1 + |2u|): forward " << worst_forward << ", backward " << worst_backward);
  CHECK(worst_forward <= 5e-7);   // measured 2.1e-7 (under 2 ulp per unit of |2u|)
  CHECK(worst_backward <= 5e-7);  // measured 2.1e-7
  // far out: x itself on the right, on the left 0 to within x e^-87 (exp_approx's floor)
  const std::vector<float> far = {-1e30f, -1e4f, -100.0f, 100.0f, 1e4f, 1e30f};
  std::vector<float> far_out(far.size());
  ops::gelu_forward(far_out.data(), far.data(), static_cast<int64_t>(far.size()));
  for (size_t i = 0; i < far.size(); i++) {
    INFO("gelu(" << far[i] << ") = " << far_out[i]);
    if (far[i] < 0) CHECK(std::fabs(far_out[i]) <= std::fabs(far[i]) * 1e-37f);
    if (far[i] > 0) CHECK(far_out[i] == far[i]);
  }
}

TEST_CASE("residual adds its inputs and its backward passes the gradient through", "[ops]") {
  const int n = N * C;
  const std::vector<float> a = random_floats(kSeed, n, 1, 1.0);
  const std::vector<float> b = random_floats(kSeed, n, 2, 1.0);
  const std::vector<float> R = random_floats(kSeed, n, 3, 1.0);

  auto loss = [&](const std::vector<double>& a64, const std::vector<double>& b64) {
    return weighted_sum(reference_residual(a64.data(), b64.data(), n), R);
  };
  // {da} after `calls` backward calls on a zeroed buffer
  auto backward = [&](int calls) {
    std::vector<float> da(n, 0.0f);
    for (int call = 0; call < calls; call++) ops::residual_backward(da.data(), R.data(), n);
    return std::vector<std::vector<float>>{da};
  };

  SECTION("forward matches the double reference") {
    std::vector<float> out(n);
    ops::residual_forward(out.data(), a.data(), b.data(), n);
    CHECK(relative_error(out, reference_residual(to_double(a).data(), to_double(b).data(), n)) <= kForwardTolerance);
  }
  SECTION("backward matches finite differences of the reference") {
    const std::vector<double> da =
        finite_difference_gradient(a, [&](const std::vector<double>& x) { return loss(x, to_double(b)); });
    CHECK(relative_error(backward(1)[0], da) <= kBackwardTolerance);
    // b's gradient is not computed: ops.h has the caller use dout itself, which is right only if dL/db = R
    const std::vector<double> db =
        finite_difference_gradient(b, [&](const std::vector<double>& x) { return loss(to_double(a), x); });
    CHECK(relative_error(R, db) <= kBackwardTolerance);
  }
  SECTION("backward accumulates into the gradient") { check_accumulates(backward(1), backward(2)); }
}

TEST_CASE("causal attention over packed qkv matches the reference and its backward matches finite differences",
          "[ops]") {
  // N(0, 1) entries give scores q.k/sqrt(hs) of order 1: attention neither uniform nor one-hot
  const std::vector<float> qkv = random_floats(kSeed, N * 3 * C, 1, 1.0);
  const std::vector<float> R = random_floats(kSeed, N * C, 2, 1.0);

  std::vector<float> out(N * C), att(B * NH * T * T);
  ops::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);

  // {dqkv} after `calls` backward calls on a zeroed buffer
  auto backward = [&](int calls) {
    std::vector<float> dqkv(N * 3 * C, 0.0f), scratch(T * T);
    for (int call = 0; call < calls; call++)
      ops::attention_backward(dqkv.data(), scratch.data(), R.data(), qkv.data(), att.data(), B, T, C, NH);
    return std::vector<std::vector<float>>{dqkv};
  };

  SECTION("forward matches the double reference, output and saved probabilities") {
    CHECK(relative_error(out, reference_attention(to_double(qkv).data(), B, T, C, NH)) <= kForwardTolerance);
    CHECK(relative_error(att, reference_attention_probs(to_double(qkv).data(), B, T, C, NH)) <= kForwardTolerance);
  }
  SECTION("the future is invisible: changing a later position's k and v leaves earlier outputs unchanged") {
    const int changed_position = 3;
    std::vector<float> changed_qkv = qkv;
    for (int b = 0; b < B; b++)
      for (int c = C; c < 3 * C; c++) changed_qkv[(b * T + changed_position) * 3 * C + c] += 1.0f;  // k and v thirds
    std::vector<float> changed_out(N * C), changed_att(B * NH * T * T);
    ops::attention_forward(changed_out.data(), changed_att.data(), changed_qkv.data(), B, T, C, NH);
    for (int b = 0; b < B; b++) {
      for (int t = 0; t < T; t++) {
        for (int c = 0; c < C; c++) {
          const int i = (b * T + t) * C + c;
          CAPTURE(b, t, c);
          if (t < changed_position) {
            // masked probabilities are exactly 0, so the future contributes exactly nothing: bitwise equal
            CHECK(changed_out[i] == out[i]);
          } else {
            // and the change is real: every position that sees it moves
            CHECK(changed_out[i] != out[i]);
          }
        }
      }
    }
  }
  SECTION("backward matches finite differences of the reference") {
    const std::vector<double> dqkv = finite_difference_gradient(qkv, [&](const std::vector<double>& x) {
      return weighted_sum(reference_attention(x.data(), B, T, C, NH), R);
    });
    CHECK(relative_error(backward(1)[0], dqkv) <= kBackwardTolerance);
  }
  SECTION("backward accumulates into the gradient") { check_accumulates(backward(1), backward(2)); }
}

TEST_CASE("causal attention over several blocks of query rows (T = 130: 64 + 64 + 2) matches the reference",
          "[ops]") {
  // ops_cpu.cpp multiplies blocks of 64 query rows by the keys they can see only;
  // the test above fits in one block, this one crosses two block edges and ends
  // in a partial block
  const int b_long = 1, t_long = 130, c_long = 8, nh_long = 2, n_long = b_long * t_long;
  const std::vector<float> qkv = random_floats(kSeed, n_long * 3 * c_long, 3, 1.0);
  const std::vector<float> R = random_floats(kSeed, n_long * c_long, 4, 1.0);
  std::vector<float> out(n_long * c_long), att(b_long * nh_long * t_long * t_long);
  ops::attention_forward(out.data(), att.data(), qkv.data(), b_long, t_long, c_long, nh_long);
  CHECK(relative_error(out, reference_attention(to_double(qkv).data(), b_long, t_long, c_long, nh_long)) <=
        kForwardTolerance);
  CHECK(relative_error(att, reference_attention_probs(to_double(qkv).data(), b_long, t_long, c_long, nh_long)) <=
        kForwardTolerance);
  std::vector<float> dqkv(n_long * 3 * c_long, 0.0f), scratch(t_long * t_long);
  ops::attention_backward(dqkv.data(), scratch.data(), R.data(), qkv.data(), att.data(), b_long, t_long, c_long,
                          nh_long);
  const std::vector<double> expected = finite_difference_gradient(qkv, [&](const std::vector<double>& x) {
    return weighted_sum(reference_attention(x.data(), b_long, t_long, c_long, nh_long), R);
  });
  CHECK(relative_error(dqkv, expected) <= kBackwardTolerance);
}

TEST_CASE("cross-entropy is -log softmax at the target and its backward matches finite differences", "[ops]") {
  const std::vector<float> logits = random_floats(kSeed, N * V, 1, 2.0);
  const std::vector<int> targets = random_ints(kSeed, N, 2, V);
  // crossentropy_backward takes one scalar dL/dlosses for every position, not a tensor R:
  // L = dloss * sum(losses)
  const float dloss = 0.37f;

  std::vector<float> losses(N), probs(N * V);
  ops::crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), B, T, V);

  // {dlogits} after `calls` backward calls on a zeroed buffer
  auto backward = [&](int calls) {
    std::vector<float> dlogits(N * V, 0.0f);
    for (int call = 0; call < calls; call++)
      ops::crossentropy_backward(dlogits.data(), probs.data(), targets.data(), dloss, B, T, V);
    return std::vector<std::vector<float>>{dlogits};
  };

  SECTION("forward matches the double reference, losses and probabilities") {
    CHECK(relative_error(losses, reference_crossentropy(to_double(logits).data(), targets.data(), N, V)) <=
          kForwardTolerance);
    CHECK(relative_error(probs, reference_softmax(to_double(logits).data(), N, V)) <= kForwardTolerance);
  }
  SECTION("each loss is -log of the softmax probability of its target") {
    // straight from the definition, exp and log with no max-subtraction: safe for logits of order 1
    std::vector<double> expected(N);
    for (int i = 0; i < N; i++) {
      double sum = 0.0;
      for (int v = 0; v < V; v++) sum += std::exp(static_cast<double>(logits[i * V + v]));
      expected[i] = -std::log(std::exp(static_cast<double>(logits[i * V + targets[i]])) / sum);
    }
    CHECK(relative_error(losses, expected) <= kForwardTolerance);
  }
  SECTION("huge logits do not overflow: adding 1000 to every logit leaves the losses unchanged") {
    // softmax is shift-invariant; exp(1000) would overflow fp32 unless the op subtracts the row maximum.
    // Tolerance 1e-3 absolute: fp32 stores 1000 + z only to about 6e-5.
    std::vector<float> shifted_logits = logits;
    for (float& z : shifted_logits) z += 1000.0f;
    std::vector<float> shifted_losses(N), shifted_probs(N * V);
    ops::crossentropy_forward(shifted_losses.data(), shifted_probs.data(), shifted_logits.data(), targets.data(), B,
                              T, V);
    for (int i = 0; i < N; i++) CHECK(shifted_losses[i] == Approx(losses[i]).margin(1e-3));
  }
  SECTION("backward matches finite differences of the reference") {
    const std::vector<double> dlogits = finite_difference_gradient(logits, [&](const std::vector<double>& x) {
      double sum = 0.0;
      for (double loss : reference_crossentropy(x.data(), targets.data(), N, V)) sum += loss;
      return dloss * sum;
    });
    CHECK(relative_error(backward(1)[0], dlogits) <= kBackwardTolerance);
  }
  SECTION("backward accumulates into the gradient") { check_accumulates(backward(1), backward(2)); }
}

TEST_CASE("copy_strided copies a block of columns between matrices of other widths, and nothing else", "[ops]") {
  // columns 2..5 of a (3, 7) matrix into columns 1..4 of a (3, 6) one, and back out
  const int rows = 3, src_stride = 7, dst_stride = 6, width = 4;
  std::vector<float> src(rows * src_stride), dst(rows * dst_stride, -1.0f);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<float>(i);
  ops::copy_strided(dst.data() + 1, dst_stride, src.data() + 2, src_stride, rows, width);
  for (int r = 0; r < rows; r++) {
    for (int c = 0; c < dst_stride; c++) {
      INFO("row " << r << ", column " << c);
      const bool copied = c >= 1 && c < 1 + width;
      CHECK(dst[r * dst_stride + c] == (copied ? src[r * src_stride + c + 1] : -1.0f));
    }
  }
  std::vector<float> back(rows * width);
  ops::copy_strided(back.data(), width, dst.data() + 1, dst_stride, rows, width);
  for (int r = 0; r < rows; r++) {
    for (int c = 0; c < width; c++) CHECK(back[r * width + c] == src[r * src_stride + 2 + c]);
  }
  ops::copy_strided(nullptr, 0, nullptr, 0, 0, 5);  // no rows: nothing touched
  ops::copy_strided(nullptr, 3, nullptr, 3, 4, 0);  // no columns: nothing touched
}

TEST_CASE("add_mean adds mean(x) / divisor into its total: bit for bit the host's loss += mean / micro_batches",
          "[ops]") {
  // steps of 3 and 7 micro-batches' per-position losses (around ln 11 = 2.4), added up as a
  // trainer did on the host, in float, in micro-batch order: the step's loss keeps every bit.
  // (Another order of the same roundings, such as float(sum / (n divisor)), differs from it
  // in the last bit for some of these 100 steps.)
  for (const int micro_batches : {3, 7}) {
    for (uint64_t stream = 1; stream <= 50; stream++) {
      const std::vector<float> losses = random_floats(kSeed, micro_batches * N, stream, 0.5, 2.4);
      float host = 0.0f, total = 0.0f;
      double exact = 0.0;  // the mean over every position, in double
      for (int m = 0; m < micro_batches; m++) {
        const float* x = losses.data() + m * N;
        host += ops::mean(x, N) / micro_batches;
        ops::add_mean(&total, x, N, static_cast<float>(micro_batches));
        for (int i = 0; i < N; i++) exact += x[i];
      }
      INFO(micro_batches << " micro-batches, stream " << stream);
      CHECK(total == host);
      CHECK(std::abs(total - exact / (micro_batches * N)) <= 1e-6 * exact / (micro_batches * N));
    }
  }

  // it adds to what is there, and an empty micro-batch's mean is 0/0, as mean's
  const std::vector<float> losses = random_floats(kSeed, N, 1, 0.5, 2.4);
  float nonzero = 1.5f;
  ops::add_mean(&nonzero, losses.data(), N, 2.0f);
  CHECK(nonzero == 1.5f + ops::mean(losses.data(), N) / 2.0f);
  float empty = 0.0f;
  ops::add_mean(&empty, losses.data(), 0, 1.0f);
  CHECK(std::isnan(empty));
}

// ----------------------------------------------------------------------------
// tensor parallelism's ops (chapter 06). Each of kRanks ranks holds Vl rows of a
// vocabulary of kSplitV; the tests play every rank in turn and combine their results
// as the chapter's all-reduces do, which must give chapter 00's op. Where the
// combination only adds zeros (the embedding) or the formula per element is the same
// (the backward ops), the results are compared bit for bit.

namespace {
constexpr int kRanks = 3, kSplitV = 12, kVl = kSplitV / kRanks;
}  // namespace

TEST_CASE("bias_residual_forward adds the bias to each row, then the residual, also in place", "[ops]") {
  const std::vector<float> y = random_floats(kSeed, N * C, 1, 1.0);
  const std::vector<float> residual = random_floats(kSeed, N * C, 2, 1.0);
  const std::vector<float> bias = random_floats(kSeed, C, 3, 1.0);
  std::vector<float> out(N * C), in_place = y;
  tp_ops::bias_residual_forward(out.data(), residual.data(), y.data(), bias.data(), N, C);
  tp_ops::bias_residual_forward(in_place.data(), residual.data(), in_place.data(), bias.data(), N, C);
  for (int i = 0; i < N * C; i++) {
    INFO("element " << i);
    // chapter 00's order: the linear layer adds its bias, then the block adds the residual
    CHECK(out[i] == residual[i] + (y[i] + bias[i % C]));
  }
  CHECK(in_place == out);
}

TEST_CASE("vocabulary-parallel embedding: the ranks' token rows, summed, plus the positions are chapter 00's",
          "[ops]") {
  std::vector<int> tokens = random_ints(kSeed, N, 1, kSplitV);
  tokens[N - 1] = tokens[0];  // a repeated token: its row receives two gradients
  const std::vector<float> wte = random_floats(kSeed, kSplitV * C, 2, 1.0);
  const std::vector<float> wpe = random_floats(kSeed, T * C, 3, 1.0);
  const std::vector<float> dout = random_floats(kSeed, N * C, 4, 1.0);
  std::vector<float> expected(N * C), dwte_expected(kSplitV * C, 0.0f), dwpe_expected(T * C, 0.0f);
  ops::embedding_forward(expected.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  ops::embedding_backward(dwte_expected.data(), dwpe_expected.data(), dout.data(), tokens.data(), B, T, C);

  // every rank's rows, and the sum over the ranks that g computes
  std::vector<float> summed(N * C, 0.0f), dwte(kSplitV * C, 0.0f);
  int others_not_zero = 0;
  for (int r = 0; r < kRanks; r++) {
    std::vector<float> rows(N * C, -1.0f);
    tp_ops::vocab_embedding_forward(rows.data(), tokens.data(), wte.data() + r * kVl * C, r * kVl, kVl, N, C);
    for (int i = 0; i < N * C; i++) {
      if (tokens[i / C] / kVl != r) others_not_zero += rows[i] != 0.0f;  // another rank's token: 0
      summed[i] += rows[i];
    }
    tp_ops::vocab_embedding_backward(dwte.data() + r * kVl * C, dout.data(), tokens.data(), r * kVl, kVl, N, C);
  }
  CHECK(others_not_zero == 0);
  std::vector<float> out(N * C);
  tp_ops::position_embedding_forward(out.data(), summed.data(), wpe.data(), B, T, C);
  CHECK(out == expected);
  CHECK(dwte == dwte_expected);
  std::vector<float> dwpe(T * C, 0.0f);
  tp_ops::position_embedding_backward(dwpe.data(), dout.data(), B, T, C);
  CHECK(dwpe == dwpe_expected);

  SECTION("a sequence-parallel rank's chunk of positions [2, 4) gets those positions' rows, and their gradient") {
    const int first = 2, Tc = 2;
    std::vector<float> chunk_in, chunk_expected, chunk_dout;
    for (int b = 0; b < B; b++) {
      const int begin = (b * T + first) * C, end = begin + Tc * C;
      chunk_in.insert(chunk_in.end(), summed.begin() + begin, summed.begin() + end);
      chunk_expected.insert(chunk_expected.end(), expected.begin() + begin, expected.begin() + end);
      chunk_dout.insert(chunk_dout.end(), dout.begin() + begin, dout.begin() + end);
    }
    std::vector<float> chunk_out(chunk_in.size()), chunk_dwpe(T * C, 0.0f);
    tp_ops::position_embedding_forward(chunk_out.data(), chunk_in.data(), wpe.data() + first * C, B, Tc, C);
    CHECK(chunk_out == chunk_expected);
    tp_ops::position_embedding_backward(chunk_dwpe.data() + first * C, chunk_dout.data(), B, Tc, C);
    for (int i = 0; i < T * C; i++) {
      const bool in_chunk = i >= first * C && i < (first + Tc) * C;
      INFO("dwpe element " << i);
      CHECK(chunk_dwpe[i] == (in_chunk ? dwpe_expected[i] : 0.0f));
    }
  }
  SECTION("both backward ops accumulate into their gradients") {
    const auto backward = [&](int calls) {
      std::vector<float> dwte_rows(kVl * C, 0.0f), dwpe_rows(T * C, 0.0f);
      for (int call = 0; call < calls; call++) {
        tp_ops::vocab_embedding_backward(dwte_rows.data(), dout.data(), tokens.data(), kVl, kVl, N, C);
        tp_ops::position_embedding_backward(dwpe_rows.data(), dout.data(), B, T, C);
      }
      return std::vector<std::vector<float>>{dwte_rows, dwpe_rows};
    };
    check_accumulates(backward(1), backward(2));
  }
}

TEST_CASE("vocabulary-parallel cross-entropy: the ranks' steps, combined as the all-reduces do, are the cross-entropy",
          "[ops]") {
  std::vector<float> logits = random_floats(kSeed, N * kSplitV, 1, 2.0);
  logits[3 * kSplitV + 2 * kVl + 1] = 9.0f;  // row 3's max on the last rank: the max must cross ranks
  const std::vector<int> targets = random_ints(kSeed, N, 2, kSplitV);
  const float dloss = 0.37f;
  const auto my_columns = [&](const std::vector<float>& whole, int r) {  // (N, kSplitV) -> (N, kVl)
    std::vector<float> mine;
    for (int i = 0; i < N; i++) {
      const auto begin = whole.begin() + i * kSplitV + r * kVl;
      mine.insert(mine.end(), begin, begin + kVl);
    }
    return mine;
  };

  // local max, then the max over the ranks (the first all-reduce)
  std::vector<float> row_max(N, -INFINITY);
  for (int r = 0; r < kRanks; r++) {
    std::vector<float> local_max(N);
    tp_ops::vocab_crossentropy_local_max(local_max.data(), my_columns(logits, r).data(), B, T, kVl);
    for (int i = 0; i < N; i++) row_max[i] = std::max(row_max[i], local_max[i]);
  }
  CHECK(row_max[3] == 9.0f);
  // local sums, then the sums over the ranks (the second)
  std::vector<std::vector<float>> exps(kRanks, std::vector<float>(N * kVl));
  std::vector<float> sum_exp(N, 0.0f), target_logit(N, 0.0f);
  for (int r = 0; r < kRanks; r++) {
    std::vector<float> local_sum(N), local_target(N);
    tp_ops::vocab_crossentropy_local_sums(exps[r].data(), local_sum.data(), local_target.data(),
                                       my_columns(logits, r).data(), row_max.data(), targets.data(), r * kVl, B, T,
                                       kVl);
    for (int i = 0; i < N; i++) {
      const bool owner = targets[i] / kVl == r;
      CHECK(local_target[i] == (owner ? logits[i * kSplitV + targets[i]] : 0.0f));
      sum_exp[i] += local_sum[i];
      target_logit[i] += local_target[i];
    }
  }
  // every rank finishes its columns; the losses are the same on each
  std::vector<float> probs(N * kSplitV), dlogits(N * kSplitV, 0.0f), losses(N);
  for (int r = 0; r < kRanks; r++) {
    std::vector<float> rank_losses(N), dlogits_local(N * kVl, 0.0f);
    tp_ops::vocab_crossentropy_finish(rank_losses.data(), exps[r].data(), row_max.data(), sum_exp.data(),
                                   target_logit.data(), B, T, kVl);
    tp_ops::vocab_crossentropy_backward(dlogits_local.data(), exps[r].data(), targets.data(), dloss, r * kVl, B, T, kVl);
    if (r > 0) CHECK(rank_losses == losses);
    losses = rank_losses;
    for (int i = 0; i < N; i++) {
      for (int v = 0; v < kVl; v++) {
        probs[i * kSplitV + r * kVl + v] = exps[r][i * kVl + v];
        dlogits[i * kSplitV + r * kVl + v] = dlogits_local[i * kVl + v];
      }
    }
  }
  CHECK(relative_error(losses, reference_crossentropy(to_double(logits).data(), targets.data(), N, kSplitV)) <=
        kForwardTolerance);
  CHECK(relative_error(probs, reference_softmax(to_double(logits).data(), N, kSplitV)) <= kForwardTolerance);
  // backward: per element the formula of chapter 00's backward, on the same probabilities
  std::vector<float> dlogits_expected(N * kSplitV, 0.0f);
  ops::crossentropy_backward(dlogits_expected.data(), probs.data(), targets.data(), dloss, B, T, kSplitV);
  CHECK(dlogits == dlogits_expected);

  SECTION("backward accumulates into the gradient") {
    const std::vector<float> probs_local = my_columns(probs, 1);
    const auto backward = [&](int calls) {
      std::vector<float> dlogits_local(N * kVl, 0.0f);
      for (int call = 0; call < calls; call++) {
        tp_ops::vocab_crossentropy_backward(dlogits_local.data(), probs_local.data(), targets.data(), dloss, kVl, B, T,
                                         kVl);
      }
      return std::vector<std::vector<float>>{dlogits_local};
    };
    check_accumulates(backward(1), backward(2));
  }
}
