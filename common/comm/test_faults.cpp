#include "common/comm/test_faults.h"

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>

#include "common/comm/env.h"
#include "common/tensor/error.h"

namespace course {

namespace {

constexpr char kSwitch[] = "COURSE_TEST_FAULT";

// COURSE_TEST_FAULT's pairs, read once; empty when the switch is not set.
const std::map<std::string, std::string>& settings() {
  static const std::map<std::string, std::string> pairs = [] {
    std::map<std::string, std::string> read;
    const char* text = std::getenv(kSwitch);
    if (text == nullptr) return read;
    std::istringstream stream(text);
    std::string pair;
    while (std::getline(stream, pair, ',')) {
      const size_t equals = pair.find('=');
      const std::string key = pair.substr(0, equals);
      if (equals == std::string::npos ||
          (key != "die_at_step" && key != "rank" && key != "die_writing" && key != "inf_gradient_at_step" &&
           key != "busy_cores" && key != "device_only_comm")) {
        throw UsageError(std::string(kSwitch) + "='" + text + "': '" + pair + "' is not one of die_at_step=S, " +
                         "rank=R, die_writing=NAME, inf_gradient_at_step=N, busy_cores=X, device_only_comm=1 " +
                         "(common/comm/test_faults.h)");
      }
      read[key] = pair.substr(equals + 1);
    }
    return read;
  }();
  return pairs;
}

// The value of `key`, or nullptr when the switch does not set it.
const std::string* told(const std::string& key) {
  const auto found = settings().find(key);
  return found == settings().end() ? nullptr : &found->second;
}

bool first_attempt() { return read_launch_env().restart_count == 0; }

int g_step = 0;  // the step the training loop runs, for inf_gradient_at_step

}  // namespace

void die_if_told_after_step(int step) {
  const std::string* die_at = told("die_at_step");
  if (die_at == nullptr || std::atoi(die_at->c_str()) != step || !first_attempt()) return;
  const std::string* rank = told("rank");
  if (read_launch_env().rank == (rank != nullptr ? std::atoi(rank->c_str()) : 0)) ::raise(SIGKILL);
}

void die_if_told_mid_write(const std::string& path, std::FILE* file) {
  const std::string* name = told("die_writing");
  if (name == nullptr || std::filesystem::path(path).filename() != *name || !first_attempt()) return;
  std::fflush(file);
  ::raise(SIGKILL);
}

void test_faults_at_step(int step) { g_step = step; }

bool gradient_norm_told_infinite() {
  const std::string* at = told("inf_gradient_at_step");
  return at != nullptr && std::atoi(at->c_str()) == g_step;
}

bool busy_cores_told(double* value) {
  const std::string* cores = told("busy_cores");
  if (cores == nullptr) return false;
  *value = std::atof(cores->c_str());
  return true;
}

bool comm_told_device_only() {
  const std::string* told_so = told("device_only_comm");
  return told_so != nullptr && *told_so == "1";
}

}  // namespace course
