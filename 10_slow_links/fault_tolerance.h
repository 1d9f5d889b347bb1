// Fault-tolerant DiLoCo (torchft's idea): workers that die do not stop the others, and
// come back without a restart of anyone else.
//
// There is no fixed group. At each outer step the workers that are alive meet in the
// job's store (a quorum), and a group is made of them for that step alone:
//
//   outer step k:   worker 0 --.                       (worker 2 died at step 37)
//                   worker 1 --+-- quorum {0, 1, 3}: all-reduce of their pseudo-
//                   worker 3 --'   gradients, the outer step, on they go
//   the launcher restarts worker 2 (--restart-policy worker); it joins the next quorum:
//   outer step k+1: {0, 1, 2, 3}: 2 sends zeros, the others' average moves the global
//                   weights, and worker 0 sends 2 the global weights and momentum
//                   from before the step, which 2 then takes as the others do
//
// The quorum of outer step k, try t: each worker adds itself to the store's count;
// the first to arrive waits until all W are there (those with a pseudo-gradient, and
// restarted ones waiting to be let in) or --quorum-timeout has passed, then writes who
// is in for the others to read, and tells each joiner where. A worker that arrives
// after that has lost the step: it exits, and comes back as a restarted one. A try
// whose all-reduce fails (a member died in it) is voted down in the store by any
// member that saw the failure, and every member goes to try t + 1 with the workers
// left, before anyone applies the step.
//
// What this does not do (a coordinator such as torchft's lighthouse would): a worker
// that decides a quorum and dies before writing it stops the others at their comm
// timeout; a member slower than --quorum-timeout is taken for dead.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "10_slow_links/diloco.h"
#include "common/comm/comm.h"
#include "common/comm/env.h"
#include "common/comm/store.h"
#include "common/comm/wan_link.h"

namespace course {

// Who takes part in one try of an outer step.
struct Quorum {
  std::vector<int> members;  // world ranks, the group's rank order: the contributors, then the joining
  int contributors = 0;      // members[0, contributors) bring a pseudo-gradient
  int step = 0;              // the inner step the contributors are at (0: none)
  bool has(int rank) const;
};

class FaultTolerantOuterLoop {
 public:
  FaultTolerantOuterLoop(const LaunchEnv& env, const WanLayout& wan, double comm_timeout, double quorum_timeout);

  // A worker after inner step `step`, at outer step `outer`: the outer step with the
  // workers alive, tried again without those that die in it. False when this worker
  // came too late and the others went on without it.
  bool sync(DiLoCo& diloco, float* local_params, int step, int outer);
  // A restarted worker: asks to be let in, waits for the next quorum, and takes the
  // global weights and momentum there; returns the inner step the others are at.
  int join(DiLoCo& diloco, float* local_params);

  // The group of the last outer step (after the last step: the checks and the eval).
  Comm& last_group() { return *group_; }
  // What the committed outer steps sent.
  OpStats traffic() const { return traffic_; }

 private:
  Quorum meet(int outer, int attempt, int step);
  Quorum read_quorum(const std::string& key);
  // One try of an outer step: false when a member saw it fail (then nobody applied it).
  bool run_try(DiLoCo& diloco, float* local_params, const Quorum& quorum, int outer, int attempt);

  LaunchEnv env_;
  WanLayout wan_;
  double comm_timeout_;
  double quorum_timeout_;
  std::shared_ptr<Store> store_;
  std::unique_ptr<Comm> group_;  // this outer step's members
  OpStats traffic_;
};

}  // namespace course
