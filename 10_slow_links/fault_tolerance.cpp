// Fault-tolerant DiLoCo's outer loop (fault_tolerance.h).
#include "10_slow_links/fault_tolerance.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <thread>
#include <utility>

#include "10_slow_links/link_ops.h"
#include "common/comm/comm_staged.h"
#include "common/comm/rendezvous.h"
#include "common/tensor/clock.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"

namespace course {

namespace {

std::string outer_key(int outer, int attempt) {
  return "ft/outer" + std::to_string(outer) + "/try" + std::to_string(attempt);
}

// outer_key's outer step and try, from the key a quorum's decider admits a joiner to
std::pair<int, int> parse_outer_key(const std::string& key) {
  int outer = 0, attempt = 0;
  if (std::sscanf(key.c_str(), "ft/outer%d/try%d", &outer, &attempt) != 2) {
    throw CommError("fault-tolerant DiLoCo: the store admits this worker to '" + key + "', not an outer step's " +
                    "key (hint: is another job using the same store?)");
  }
  return {outer, attempt};
}

// Counters the workers add 1 to: the last outer step applied (the run is over), its
// end's checks done (the run has ended), or failed with an error that is not a lost peer
constexpr char kRunOverKey[] = "ft/over";
constexpr char kRunEndedKey[] = "ft/ended";
constexpr char kEndFailedKey[] = "ft/end_failed";

std::string seconds_text(double seconds) { return std::to_string(static_cast<long long>(seconds)) + " s"; }

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

// FNV-1a over the global weights' bytes (a host copy of them): what a log line can show
// to say "the same weights"
uint64_t checksum(const DiLoCo& diloco) {
  std::vector<unsigned char> bytes(diloco.global.bytes());
  copy_bytes(bytes.data(), Device::CPU, diloco.global.data(), diloco.device(), bytes.size());
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char byte : bytes) hash = (hash ^ byte) * 1099511628211ull;
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
                                               double quorum_timeout, Device device)
    : env_(env),
      wan_(wan),
      comm_timeout_(comm_timeout),
      quorum_timeout_(quorum_timeout),
      device_(device),
      store_(connect_rendezvous(env, comm_timeout).client) {}

// Quorum text in the store: "STEP;C0,C1,...;J0,J1,..." (contributors; joining)
Quorum FaultTolerantOuterLoop::read_quorum(const std::string& base) {
  const std::string text = store_->get(base + "/members", comm_timeout_);
  const size_t first = text.find(';'), second = text.find(';', first + 1);
  Quorum quorum;
  quorum.step = std::stoi(text.substr(0, first));
  quorum.members = split_ranks(text.substr(first + 1, second - first - 1));
  quorum.contributors = static_cast<int>(quorum.members.size());
  for (int r : split_ranks(text.substr(second + 1))) quorum.members.push_back(r);
  return quorum;
}

// A joiner's requests and admissions are counters ("ft/wait/R", "ft/admitted/R"): the
// decider of a quorum admits a worker that asked more often than it was admitted, and
// tells it where under "ft/admit/R/N" (its N-th request).
Quorum FaultTolerantOuterLoop::meet(const std::string& base, int step, bool admit) {
  const int W = env_.world_size;
  store_->add(base + "/worker" + std::to_string(env_.rank), 1);
  if (store_->add(base + "/arrived", 1) == 1) {
    // the first to arrive decides: every worker, or those there within the quorum timeout
    const double start = now_seconds();
    std::vector<int> contributors, joining;
    for (;;) {
      contributors.clear();
      joining.clear();
      for (int r = 0; r < W; r++) {
        const std::string who = std::to_string(r);
        if (store_->add(base + "/worker" + who, 0) > 0) {
          contributors.push_back(r);
        } else if (admit && store_->add("ft/wait/" + who, 0) > store_->add("ft/admitted/" + who, 0)) {
          joining.push_back(r);  // restarted, waiting to be let in
        }
      }
      if (static_cast<int>(contributors.size() + joining.size()) == W) break;
      if (now_seconds() - start > quorum_timeout_) break;
      pause_briefly();
    }
    std::vector<int> members = contributors;
    members.insert(members.end(), joining.begin(), joining.end());
    store_->set(base + "/members", std::to_string(step) + ";" + join_ranks(members, 0, contributors.size()) + ";" +
                                       join_ranks(members, contributors.size(), members.size()));
    for (int r : joining) {
      const int64_t admission = store_->add("ft/admitted/" + std::to_string(r), 1);
      store_->set("ft/admit/" + std::to_string(r) + "/" + std::to_string(admission), base);
    }
  }
  return read_quorum(base);
}

void FaultTolerantOuterLoop::make_group(const Quorum& quorum, const std::string& base) {
  group_ = create_tcp_group(env_, quorum.members, base + "/group", comm_timeout_, wan_);
  // the buffers are on the model's device: through the host, as a world's tcp is
  if (device_ != Device::CPU) group_ = stage_through_host(std::move(group_), device_);
}

bool FaultTolerantOuterLoop::vote(const std::string& base, const Quorum& quorum, bool ok) {
  store_->add(base + "/voted", 1);
  if (!ok) store_->add(base + "/failed", 1);
  const double start = now_seconds();
  while (store_->add(base + "/voted", 0) < static_cast<int64_t>(quorum.members.size()) &&
         now_seconds() - start < quorum_timeout_) {
    pause_briefly();
  }
  return store_->add(base + "/failed", 0) == 0;
}

bool FaultTolerantOuterLoop::run_try(DiLoCo& diloco, float* local_params, const Quorum& quorum, int outer,
                                     int attempt) {
  const std::string base = outer_key(outer, attempt);
  const size_t n = diloco.delta.size();
  const bool contributing =
      std::find(quorum.members.begin(), quorum.members.begin() + quorum.contributors, env_.rank) !=
      quorum.members.begin() + quorum.contributors;
  // this worker's pseudo-gradient (again on a retry: nothing has moved since), a joiner's zeros
  float* average = diloco.delta.data();  // (P)
  if (contributing) {
    diloco.pseudo_gradient(0, local_params, average);
  } else {
    diloco.delta.zero();
  }
  bool ok = true;
  std::string failure;
  try {
    make_group(quorum, base);
    // sum of the contributors' deltas, / contributors: their average
    group_->all_reduce(average, n, ReduceOp::Sum);
    link_ops_for(diloco.device()).divide(average, static_cast<int64_t>(n), static_cast<float>(quorum.contributors));
    if (quorum.contributors < static_cast<int>(quorum.members.size())) {
      // the joining take the outer state from before this step, and then the step itself
      group_->broadcast(diloco.global.data(), n, 0);
      group_->broadcast(diloco.momentum.data(), n, 0);
    }
  } catch (const CommError& error) {
    ok = false;
    failure = error.what();
  }
  // the step counts only if no member saw it fail
  if (!vote(base, quorum, ok)) {
    if (quorum.members[0] == env_.rank || !ok) {
      std::printf("outer step %d, try %d: %s: trying again with the workers left\n", outer, attempt,
                  ok ? "a member saw it fail" : failure.c_str());
    }
    group_.reset();
    return false;
  }
  diloco.outer_step(0, average, local_params);
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
                                          " (global weights " + hex(checksum(diloco)) + ")")
                                             .c_str());
    }
  }
  return true;
}

void FaultTolerantOuterLoop::check_tries(int attempt, const std::string& what) const {
  if (attempt > env_.world_size) {
    throw CommError("worker " + std::to_string(env_.rank) + " " + what + ": " + std::to_string(attempt) +
                    " tries failed, more than the " + std::to_string(env_.world_size) + " workers that could " +
                    "have died in them (hint: see the workers' output for what fails)");
  }
}

bool FaultTolerantOuterLoop::sync(DiLoCo& diloco, float* local_params, int step, int outer, bool last) {
  for (int attempt = 0;; attempt++) {
    check_tries(attempt, "outer step " + std::to_string(outer));
    const Quorum quorum = meet(outer_key(outer, attempt), step, /*admit=*/true);
    if (!quorum.has(env_.rank)) return false;  // late: the others went on without it
    if (run_try(diloco, local_params, quorum, outer, attempt)) {
      if (last) store_->add(kRunOverKey, 1);
      return true;
    }
  }
}

int FaultTolerantOuterLoop::join(DiLoCo& diloco, float* local_params) {
  const std::string who = std::to_string(env_.rank);
  for (;;) {
    // ask to be let in, and wait for the next quorum's decider to say where, unless
    // the last outer step goes by first
    const int64_t request = store_->add("ft/wait/" + who, 1);
    const double start = now_seconds();
    while (store_->add("ft/admitted/" + who, 0) < request) {
      if (store_->add(kRunOverKey, 0) > 0) wait_for_the_end();
      if (now_seconds() - start > comm_timeout_) {
        throw CommError("worker " + who + " waited " + seconds_text(comm_timeout_) + " to be let into an outer " +
                        "step, and none came (hint: are the other workers alive? raise --comm-timeout for a " +
                        "long --inner-steps)");
      }
      pause_briefly();
    }
    const std::string base = store_->get("ft/admit/" + who + "/" + std::to_string(request), comm_timeout_);
    const auto [outer, attempt] = parse_outer_key(base);
    const Quorum quorum = read_quorum(base);
    if (run_try(diloco, local_params, quorum, outer, attempt)) {
      std::printf("[worker %d] joined at outer step %d with the global weights (%s): continuing after step %d\n",
                  env_.rank, outer, hex(checksum(diloco)).c_str(), quorum.step);
      return quorum.step;
    }
  }
}

void FaultTolerantOuterLoop::wait_for_the_end() {
  const std::string who = std::to_string(env_.rank);
  const double start = now_seconds();
  while (store_->add(kRunEndedKey, 0) == 0) {
    if (store_->add(kEndFailedKey, 0) > 0 || now_seconds() - start > comm_timeout_) {
      throw CommError("worker " + who + " was restarted after the run's last outer step, and the others' end's " +
                      "checks failed or did not end within --comm-timeout (hint: see their output)");
    }
    pause_briefly();
  }
  if (env_.rank == 0) {
    throw CommError("worker 0 died after the run's last outer step: the others finished training and checked " +
                    std::string("their models, but worker 0 writes the run's summary and log, which are lost (hint: ") +
                    "--checkpoint-dir keeps every worker's final state)");
  }
  throw AlreadyDone("[worker " + who + "] restarted after the run's last outer step: the others have finished "
                    "without it, nothing is left to rejoin");
}

void FaultTolerantOuterLoop::finish(const std::function<void(Comm& workers)>& collectives) {
  for (int attempt = 0;; attempt++) {
    check_tries(attempt, "the end's checks");
    const std::string base = "ft/end/try" + std::to_string(attempt);
    const Quorum quorum = meet(base, 0, /*admit=*/false);
    if (!quorum.has(env_.rank)) {
      throw CommError("worker " + std::to_string(env_.rank) + " came to the end's checks later than " +
                      "--quorum-timeout: the others finished without it (hint: raise --quorum-timeout)");
    }
    bool ok = true;
    try {
      make_group(quorum, base);
      collectives(*group_);
    } catch (const CommError& error) {
      ok = false;
      std::printf("the end's checks, try %d: %s: trying again with the workers left\n", attempt, error.what());
    } catch (const CourseError&) {  // the models differ: no retry mends that; a restarted worker must not wait
      store_->add(kEndFailedKey, 1);
      throw;
    }
    if (vote(base, quorum, ok)) {
      store_->add(kRunEndedKey, 1);
      return;
    }
  }
}

}  // namespace course
