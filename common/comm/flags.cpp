#include "common/comm/flags.h"

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "common/comm/env.h"
#include "common/tensor/error.h"

namespace course {

ArgParser::ArgParser(std::string program, std::string description)
    : program_(std::move(program)), description_(std::move(description)) {}

// Large enough for any count in the course, small enough that products of two
// flags (batch x seq) stay far from overflow.
static constexpr long long kMaxInt = 1'000'000'000;

static long long parse_integer(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE) {
    throw FlagError(flag + " expects a whole number, got '" + text + "'");
  }
  return value;
}

void ArgParser::add_int(const std::string& flag, int* target, int min_value, const std::string& help) {
  flags_.push_back({flag, help, std::to_string(*target), true, [=](const std::string& text) {
                      long long value = parse_integer(flag, text);
                      if (value < min_value) {
                        throw FlagError(flag + " must be at least " + std::to_string(min_value) + ", got " + text);
                      }
                      if (value > kMaxInt) {
                        throw FlagError(flag + " must be at most " + std::to_string(kMaxInt) + ", got " + text);
                      }
                      *target = static_cast<int>(value);
                    }});
}

void ArgParser::add_uint64(const std::string& flag, uint64_t* target, const std::string& help) {
  flags_.push_back({flag, help, std::to_string(*target), true, [=](const std::string& text) {
                      long long value = parse_integer(flag, text);
                      if (value < 0) throw FlagError(flag + " must not be negative, got " + text);
                      *target = static_cast<uint64_t>(value);
                    }});
}

void ArgParser::add_float(const std::string& flag, float* target, float min_value, bool min_exclusive,
                          const std::string& help) {
  std::ostringstream default_text;
  default_text << *target;
  flags_.push_back({flag, help, default_text.str(), true, [=](const std::string& text) {
                      errno = 0;
                      char* end = nullptr;
                      float value = std::strtof(text.c_str(), &end);
                      if (text.empty() || *end != '\0') {
                        throw FlagError(flag + " expects a number, got '" + text + "'");
                      }
                      if (errno == ERANGE || !std::isfinite(value)) {
                        throw FlagError(flag + " must be a finite number within float range, got " + text);
                      }
                      bool too_small = min_exclusive ? value <= min_value : value < min_value;
                      if (too_small) {
                        std::ostringstream bound;
                        bound << min_value;
                        throw FlagError(flag + " must be " + (min_exclusive ? "greater than " : "at least ") +
                                        bound.str() + ", got " + text);
                      }
                      *target = value;
                    }});
}

void ArgParser::add_string(const std::string& flag, std::string* target, const std::string& help) {
  flags_.push_back({flag, help, target->empty() ? "none" : *target, true, [=](const std::string& text) {
                      if (text.empty()) throw FlagError(flag + " expects a value");
                      *target = text;
                    }});
}

void ArgParser::add_choice(const std::string& flag, std::string* target, std::vector<std::string> choices,
                           const std::string& help) {
  std::string listed;
  for (const std::string& choice : choices) listed += (listed.empty() ? "" : "|") + choice;
  flags_.push_back({flag, help + " (" + listed + ")", *target, true, [=](const std::string& text) {
                      for (const std::string& choice : choices) {
                        if (text == choice) {
                          *target = text;
                          return;
                        }
                      }
                      throw FlagError(flag + " must be one of " + listed + ", got '" + text + "'");
                    }});
}

void ArgParser::add_dtype(const std::string& flag, DType* target, const std::string& help) {
  flags_.push_back({flag, help + " (fp32|bf16)", dtype_name(*target), true, [=](const std::string& text) {
                      if (text != "fp32" && text != "bf16") {
                        throw FlagError(flag + " must be one of fp32|bf16, got '" + text + "'");
                      }
                      *target = text == "bf16" ? DType::BF16 : DType::F32;
                    }});
}

void ArgParser::add_switch(const std::string& flag, bool* target, const std::string& help) {
  flags_.push_back({flag, help, "off", false, [=](const std::string&) { *target = true; }});
}

// Levenshtein distance: the fewest single-character insertions, deletions and
// substitutions that turn a into b ("--step" -> "--steps": 1).
static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); j++) row[j] = j;
  for (size_t i = 1; i <= a.size(); i++) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); j++) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string ArgParser::nearest_flag(const std::string& name) const {
  // close enough to be a typo: at most 2 edits, and fewer than a third of the name
  size_t best = std::min<size_t>(2, name.size() / 3);
  std::string nearest;
  for (const Flag& flag : flags_) {
    const size_t distance = edit_distance(name, flag.name);
    if (distance <= best) {
      best = distance;
      nearest = flag.name;
    }
  }
  if (!nearest.empty()) return nearest;
  // or the beginning of exactly one flag's name (--nproc for --nproc-per-node)
  for (const Flag& flag : flags_) {
    if (name.size() > 3 && flag.name.compare(0, name.size(), name) == 0) {
      if (!nearest.empty()) return "";  // more than one: no guess
      nearest = flag.name;
    }
  }
  return nearest;
}

const ArgParser::Flag* ArgParser::find(const std::string& name) const {
  for (const Flag& flag : flags_) {
    if (flag.name == name) return &flag;
  }
  return nullptr;
}

void ArgParser::parse(int argc, char** argv) {
  for (int i = 1; i < argc; i++) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      if (launch_rank() == 0) std::cout << usage();  // once, not once per rank
      std::exit(0);
    }
    // accept both "--flag value" and "--flag=value"
    std::string value;
    bool has_inline_value = false;
    size_t equals = arg.find('=');
    if (arg.rfind("--", 0) == 0 && equals != std::string::npos) {
      value = arg.substr(equals + 1);
      arg = arg.substr(0, equals);
      has_inline_value = true;
    }
    if (arg.rfind("-", 0) != 0) {
      throw FlagError("unexpected argument '" + arg + "': " + program_ + " takes flags only, each --name or " +
                      "--name value (run " + program_ + " --help for the list of flags)");
    }
    const Flag* flag = find(arg);
    if (flag == nullptr) {
      const std::string nearest = nearest_flag(arg);
      throw FlagError("unknown flag '" + arg + "'" + (nearest.empty() ? "" : " (did you mean " + nearest + "?)") +
                      " (run " + program_ + " --help for the list of flags)");
    }
    if (flag->takes_value && !has_inline_value) {
      if (i + 1 >= argc) throw FlagError(arg + " expects a value");
      value = argv[++i];
    } else if (!flag->takes_value && has_inline_value) {
      throw FlagError(arg + " takes no value");
    }
    flag->set(value);
    if (given_ != nullptr) given_->insert(flag->name);
  }
}

std::string ArgParser::usage() const {
  std::ostringstream out;
  out << "usage: " << program_ << " [flags]\n" << description_ << "\n\nflags:\n";
  for (const Flag& flag : flags_) {
    std::string left = "  " + flag.name + (flag.takes_value ? " X" : "");
    out << left << std::string(left.size() < 24 ? 24 - left.size() : 1, ' ') << flag.help
        << " [default: " << flag.default_text << "]\n";
  }
  return out.str();
}

}  // namespace course
