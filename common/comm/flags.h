// The flag parser every program of the course uses: a flag is registered with the
// variable it fills and the rule its value must keep, and a wrong one is a FlagError
// that names it (common/tensor/error.h). It sits in the comm layer because the comm
// library registers its own flags (--backend, --comm-timeout: comm.h's
// add_comm_flags) and because --help is printed once, by the launcher's rank 0
// (common/comm/env.h).
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/tensor/bf16.h"  // DType

namespace course {

// A small declarative flag parser: flags are registered with a target variable and
// a validity rule, then parse() fills them or throws UsageError.
class ArgParser {
 public:
  ArgParser(std::string program, std::string description);

  void add_int(const std::string& flag, int* target, int min_value, const std::string& help);
  void add_uint64(const std::string& flag, uint64_t* target, const std::string& help);
  // min_exclusive: the value must be > min_value (e.g. a learning rate), else >= min_value
  void add_float(const std::string& flag, float* target, float min_value, bool min_exclusive,
                 const std::string& help);
  void add_string(const std::string& flag, std::string* target, const std::string& help);
  void add_choice(const std::string& flag, std::string* target, std::vector<std::string> choices,
                  const std::string& help);
  void add_switch(const std::string& flag, bool* target, const std::string& help);
  // fp32 or bf16 (common/tensor/bf16.h)
  void add_dtype(const std::string& flag, DType* target, const std::string& help);

  // parse() adds the name of every flag on the command line to *names ("--top-k"):
  // a flag given its default value is given, which its target alone cannot tell.
  void record_given(std::set<std::string>* names) { given_ = names; }

  // Fills the targets. --help prints usage (on rank 0) and exits 0; anything wrong throws FlagError.
  void parse(int argc, char** argv);
  std::string usage() const;

 private:
  struct Flag {
    std::string name;
    std::string help;
    std::string default_text;
    bool takes_value = true;
    std::function<void(const std::string&)> set;
  };
  const Flag* find(const std::string& name) const;
  // the registered flag closest to a misspelled one, or "" when none is close
  std::string nearest_flag(const std::string& name) const;

  std::string program_;
  std::string description_;
  std::vector<Flag> flags_;
  std::set<std::string>* given_ = nullptr;  // record_given's
};

}  // namespace course
