// Test support: the Python that PyTorch's checks run under.
//
// `python3`, or the interpreter COURSE_TORCH_PYTHON names (e.g.
// COURSE_TORCH_PYTHON=~/.cache/course-bench-venv/bin/python, a venv with PyPI's torch).
// PyTorch is never a dependency of the course: where neither imports what a test
// needs, the test exits 77, which CTest reports as skipped (SKIP_RETURN_CODE).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "support/process.h"

namespace course_test {

// The interpreter that imports `modules` ("torch, transformers"); else the test is skipped.
inline std::string python_with(const std::string& modules) {
  const char* chosen = std::getenv("COURSE_TORCH_PYTHON");
  const std::string python = chosen != nullptr && *chosen != '\0' ? chosen : "python3";
  const ProcessResult probe = run_process({python, "-c", "import " + modules}, 120);
  if (probe.exit_code != 0) {
    std::printf("SKIPPED: %s cannot import %s (hint: COURSE_TORCH_PYTHON=/path/to/python3 with them)\n",
                python.c_str(), modules.c_str());
    std::fflush(stdout);
    std::exit(77);
  }
  return python;
}

}  // namespace course_test
