// The checks a multi-process test's worker makes on its rank's results: each failed
// one is printed on stderr, naming the rank, and counted; the worker exits 1 if any
// failed, else prints that all passed (what the test reads).
//
//   WorkerChecks check(comm.rank());
//   check.close("dx", dx, expected_dx);        // within 1e-5 of the reference's largest |value|
//   check.equal("bytes sent", sent, formula);
//   return check.finish("(tcp, 2 ranks)");
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace course_test {

class WorkerChecks {
 public:
  explicit WorkerChecks(int rank, double tolerance = 1e-5) : rank_(rank), tolerance_(tolerance) {}

  // |actual - expected| <= tolerance x max |expected|, element by element
  void close(const std::string& what, const std::vector<float>& actual, const std::vector<float>& expected) {
    double largest = 0.0, worst = 0.0;
    for (float value : expected) largest = std::max(largest, std::fabs(static_cast<double>(value)));
    for (size_t i = 0; i < std::min(actual.size(), expected.size()); i++) {
      worst = std::max(worst, std::fabs(static_cast<double>(actual[i]) - expected[i]));
    }
    if (actual.size() != expected.size() || !(worst <= tolerance_ * std::max(largest, 1e-30))) {
      fail(what + ": differs by " + std::to_string(worst) + " of " + std::to_string(largest) + " (" +
           std::to_string(actual.size()) + " values, " + std::to_string(expected.size()) + " expected)");
    }
  }
  // |actual - expected| <= tolerance x |expected|
  void relative(const std::string& what, double actual, double expected) {
    if (!(std::fabs(actual - expected) <= tolerance_ * std::fabs(expected))) {
      fail(what + ": " + std::to_string(actual) + ", expected " + std::to_string(expected));
    }
  }
  void equal(const std::string& what, long long actual, long long expected) {
    if (actual != expected) fail(what + ": " + std::to_string(actual) + ", expected " + std::to_string(expected));
  }
  void fail(const std::string& message) {
    failures_++;
    std::fprintf(stderr, "rank %d: %s\n", rank_, message.c_str());
  }
  // the worker's exit code: 1 if a check failed; else 0, saying so on stdout
  int finish(const std::string& what) const {
    if (failures_ > 0) {
      std::fprintf(stderr, "rank %d: %d check(s) failed\n", rank_, failures_);
      return 1;
    }
    std::printf("rank %d: all checks passed %s\n", rank_, what.c_str());
    return 0;
  }

 private:
  int rank_;
  double tolerance_;
  int failures_ = 0;
};

}  // namespace course_test
