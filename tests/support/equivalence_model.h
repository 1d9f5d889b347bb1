// The small model every chapter-equivalence test trains (tests/test_ddp.cpp,
// tests/test_fsdp.cpp): the trainers' flags for it, and the same shape as a config
// for the formulas the tests check against.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "common/model/model.h"

namespace course_test {

inline course::GPTConfig model_config() {
  course::GPTConfig config;
  config.n_layer = 2;
  config.d_model = 32;
  config.n_head = 2;
  config.seq_len = 32;
  return config;
}

// A trainer's flags for a model shape, with the equivalence runs' learning rate (a
// test whose chapter needs another shape makes its flags from its own config)
inline std::vector<std::string> model_flags(const course::GPTConfig& config) {
  return {"--layers", std::to_string(config.n_layer), "--d-model", std::to_string(config.d_model),
          "--heads",  std::to_string(config.n_head),  "--seq",     std::to_string(config.seq_len),
          "--lr",     "3e-3"};
}

// the model shape and optimizer of every equivalence run; the batch is given per test
inline const std::vector<std::string> kModel = model_flags(model_config());

inline size_t parameter_count() { return course::count_parameters(model_config()); }

}  // namespace course_test
