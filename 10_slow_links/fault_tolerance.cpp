// Fault-tolerant DiLoCo's outer loop (fault_tolerance.h).
#include "10_slow_links/fault_tolerance.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <thread>

#include "common/comm/rendezvous.h"
#include "common/tensor/clock.h"
#include "common/tensor/error.h"

namespace course {

namespace {

std::string outer_key(int outer, int attempt) {
  return "ft/outer" + std::to_string(outer) + "/try" + std::to_string(attempt);
}

std::string join_ranks(const std::vector<int>& ranks, size_t first, size_t last) {
  std::string text;
  for (size_t i = first; i < last; i++) text += (text.empty() ? "" : ",") + std::to_string(ranks[i]);
  return text;
}

std::vector<int> split_ranks(const std::string& text) {
  std::vector<int> ranks;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    if (!item.empty()) ranks.push_back(std::stoi(item));
  }
  return ranks;
}

// FNV-1a over the weights' bytes: what a log line can show to say "the same weights"
uint64_t checksum(const float* values, size_t count) {
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(values);
  uint64_t hash = 1469598103934665603ull;
  for (size_t i = 0; i < count * sizeof(float); i++) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

std::string hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

void pause_briefly() { std::this_thread::sleep_for(std::chrono::milliseconds(10)); }

}  // namespace

bool Quorum::has(int rank) const { return std::find(members.begin(), members.end(), rank) != members.end(); }

FaultTolerantOuterLoop::FaultTolerantOuterLoop(const LaunchEnv& env, const WanLayout& wan, double comm_timeout,
                                               double quorum_timeout)
    : env_(env),
      wan_(wan),
      comm_timeout_(comm_timeout),
      quorum_timeout_(quorum_timeout),
      store_(connect_rendezvous(env, comm_timeout).client) {}

// Quorum text in the store: "STEP;C0,C1,...;J0,J1,..." (contributors; joining)
Quorum FaultTolerantOuterLoop::meet(int outer, int attempt, bool contributing, int step) {
  const std::string base = outer_key(outer, attempt);
  const int W = env_.world_size;
  if (contributing) store_->set(base + "/step", std::to_string(step));
  store_->add(base + "/worker" + std::to_string(env_.rank), contributing ? 2 : 1);
  if (store_->add(base + "/arrived", 1) == 1) {
    // the first to arrive decides: everyone, or whoever came within the quorum timeout
    // (at least one with the weights: joiners alone have nothing to start from)
    const double start = now_seconds();
    std::vector<int> contributors, joining;
    for (;;) {
      contributors.clear();
      joining.clear();
      for (int r = 0; r < W; r++) {
        const int64_t state = store_->add(base + "/worker" + std::to_string(r), 0);
        if (state == 2) contributors.push_back(r);
        if (state == 1) joining.push_back(r);
      }
      const double waited = now_seconds() - start;
      if (static_cast<int>(contributors.size() + joining.size()) == W) break;
      if (waited > quorum_timeout_ && !contributors.empty()) break;
      if (waited > comm_timeout_) {
        throw CommError("rank " + std::to_string(env_.rank) + ": outer step " + std::to_string(outer) +
                        ": no worker with the weights came within --comm-timeout (hint: were they all lost?)");
      }
      pause_briefly();
    }
    const std::string contributors_step = contributors.empty() ? "0" : store_->get(base + "/step", comm_timeout_);
    std::vector<int> members = contributors;
    members.insert(members.end(), joining.begin(), joining.end());
    store_->set(base + "/members", contributors_step + ";" + join_ranks(members, 0, contributors.size()) + ";" +
                                       join_ranks(members, contributors.size(), members.size()));
    store_->add("ft/outer" + std::to_string(outer) + "/decided", 1);
  }
  const std::string text = store_->get(base + "/members", comm_timeout_);
  const size_t first = text.find(';'), second = text.find(';', first + 1);
  Quorum quorum;
  quorum.step = std::stoi(text.substr(0, first));
  quorum.members = split_ranks(text.substr(first + 1, second - first - 1));
  quorum.contributors = static_cast<int>(quorum.members.size());
  for (int r : split_ranks(text.substr(second + 1))) quorum.members.push_back(r);
  return quorum;
}

bool FaultTolerantOuterLoop::run_try(DiLoCo& diloco, float* local_params, const Quorum& quorum, int outer,
                                     int attempt, std::vector<float>& delta) {
  const std::string base = outer_key(outer, attempt);
  const size_t n = delta.size();
  const bool contributing =
      std::find(quorum.members.begin(), quorum.members.begin() + quorum.contributors, env_.rank) !=
      quorum.members.begin() + quorum.contributors;
  std::vector<float> average(n, 0.0f);  // (P)  a joiner adds zeros
  if (contributing) average = delta;
  bool ok = true;
  std::string failure;
  try {
    group_ = create_tcp_group(env_, quorum.members, base + "/group", comm_timeout_, wan_);
    // sum of the contributors' deltas, / contributors: their average
    group_->all_reduce(average.data(), n, ReduceOp::Sum);
    for (float& value : average) value /= static_cast<float>(quorum.contributors);
    if (quorum.contributors < static_cast<int>(quorum.members.size())) {
      // the joining take the outer state from before this step, and then the step itself
      group_->broadcast(diloco.global.data(), n, 0);
      group_->broadcast(diloco.momentum.data(), n, 0);
    }
  } catch (const CommError& error) {
    ok = false;
    failure = error.what();
  }
  // the vote: the step counts only if no member saw it fail
  store_->add(base + "/voted", 1);
  if (!ok) store_->add(base + "/failed", 1);
  const double start = now_seconds();
  while (store_->add(base + "/voted", 0) < static_cast<int64_t>(quorum.members.size()) &&
         now_seconds() - start < quorum_timeout_) {
    pause_briefly();
  }
  if (store_->add(base + "/failed", 0) > 0) {
    if (quorum.members[0] == env_.rank || !ok) {
      std::printf("outer step %d, try %d: %s: trying again with the workers left\n", outer, attempt,
                  ok ? "a member saw it fail" : failure.c_str());
    }
    group_.reset();
    return false;
  }
  diloco.outer_step(0, average.data(), local_params);
  traffic_ += group_->total_stats();
  if (quorum.members[0] == env_.rank) {
    std::vector<int> missing;
    for (int r = 0; r < env_.world_size; r++) {
      if (!quorum.has(r)) missing.push_back(r);
    }
    const std::vector<int> joining(quorum.members.begin() + quorum.contributors, quorum.members.end());
    if (!missing.empty() || !joining.empty()) {
      std::printf("outer step %d: averaged over workers %s%s%s\n", outer,
                  join_ranks(quorum.members, 0, quorum.contributors).c_str(),
                  missing.empty() ? "" : ("; lost: " + join_ranks(missing, 0, missing.size())).c_str(),
                  joining.empty() ? "" : ("; rejoined: " + join_ranks(joining, 0, joining.size()) +
                                          " (global weights " + hex(checksum(diloco.global.data(), n)) + ")")
                                             .c_str());
    }
  }
  return true;
}

int FaultTolerantOuterLoop::next_open_outer_step() {
  int outer = 1;
  while (store_->add("ft/outer" + std::to_string(outer) + "/decided", 0) > 0) outer++;
  return outer;
}

bool FaultTolerantOuterLoop::sync(DiLoCo& diloco, float* local_params, int step, int outer) {
  std::vector<float> delta(diloco.global.size());  // (P)
  diloco.pseudo_gradient(0, local_params, delta.data());
  for (int attempt = 0;; attempt++) {
    const Quorum quorum = meet(outer, attempt, /*contributing=*/true, step);
    if (!quorum.has(env_.rank)) {
      std::printf("[worker %d] late for outer step %d: its inner steps are lost, it takes the global weights at "
                  "the next one\n", env_.rank, outer);
      joined_step_ = join_from(diloco, local_params, outer + 1);
      return false;
    }
    if (run_try(diloco, local_params, quorum, outer, attempt, delta)) return true;
  }
}

int FaultTolerantOuterLoop::join(DiLoCo& diloco, float* local_params) {
  return join_from(diloco, local_params, next_open_outer_step());
}

int FaultTolerantOuterLoop::join_from(DiLoCo& diloco, float* local_params, int outer) {
  std::vector<float> nothing(diloco.global.size());
  for (int attempt = 0;;) {
    const Quorum quorum = meet(outer, attempt, /*contributing=*/false, 0);
    if (!quorum.has(env_.rank)) {  // decided before this worker came: the next outer step
      outer++;
      attempt = 0;
      continue;
    }
    if (run_try(diloco, local_params, quorum, outer, attempt, nothing)) {
      std::printf("[worker %d] joined at outer step %d with the global weights (%s): continuing after step %d\n",
                  env_.rank, outer, hex(checksum(diloco.global.data(), diloco.global.size())).c_str(), quorum.step);
      return quorum.step;
    }
    attempt++;  // with the contributors, who try again too
  }
}

}  // namespace course
