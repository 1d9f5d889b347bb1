// Gradients by central finite differences, in double, for holding an analytic fp32
// backward against: with dout = R, a fixed random tensor, backward computes the
// gradient of L = sum(out * R), and L is evaluated in double by a reference forward
// (reference.h). A step h = 1e-4 leaves a truncation error ~h^2 and a rounding
// error ~1e-16/h, both far below fp32 rounding.
#pragma once

#include <catch2/catch.hpp>

#include <vector>

namespace course_test {

constexpr double kFiniteDifferenceStep = 1e-4;

inline std::vector<double> to_double(const std::vector<float>& values) { return {values.begin(), values.end()}; }

// L = sum(out * R)
inline double weighted_sum(const std::vector<double>& out, const std::vector<float>& R) {
  REQUIRE(out.size() == R.size());
  double sum = 0.0;
  for (size_t i = 0; i < out.size(); i++) sum += out[i] * R[i];
  return sum;
}

// dL/dx by central differences (L(x + h e_i) - L(x - h e_i)) / 2h for every element i of x,
// where loss_of(x) evaluates L in double
template <typename LossOf>
std::vector<double> finite_difference_gradient(const std::vector<float>& x, LossOf loss_of) {
  std::vector<double> point = to_double(x), gradient(x.size());
  for (size_t i = 0; i < x.size(); i++) {
    const double original = point[i];
    point[i] = original + kFiniteDifferenceStep;
    const double loss_plus = loss_of(point);
    point[i] = original - kFiniteDifferenceStep;
    const double loss_minus = loss_of(point);
    point[i] = original;
    gradient[i] = (loss_plus - loss_minus) / (2 * kFiniteDifferenceStep);
  }
  return gradient;
}

}  // namespace course_test
