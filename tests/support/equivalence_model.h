// The small model every chapter-equivalence test trains (tests/test_ddp.cpp,
// tests/test_fsdp.cpp): the trainers' flags for it, and the same shape as a config
// for the formulas the tests check against.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "common/model.h"

namespace course_test {

// the model shape and optimizer of every equivalence run; the batch is given per test
inline const std::vector<std::string> kModel = {"--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "32",
                                                "--lr",     "3e-3"};

inline course::GPTConfig model_config() {
  course::GPTConfig config;
  config.n_layer = 2;
  config.d_model = 32;
  config.n_head = 2;
  config.seq_len = 32;
  return config;
}

inline size_t parameter_count() { return course::count_parameters(model_config()); }

}  // namespace course_test
