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
// The run ends as it goes: the last outer step's members mark the run over in the store,
// then check that their models agree and average the eval loss among the workers alive
// (finish: a member that dies there is left out, as in an outer step), and mark it ended.
// A worker restarted after the last outer step waits for that mark and exits 0: nothing
// is left for it to rejoin. Unless it is worker 0, which writes the run's summary and
// log: their end died with it, and its restart fails saying so.
//
// What this does not do (a coordinator such as torchft's lighthouse would): a worker
// that decides a quorum and dies before writing it stops the others at their comm
// timeout; a member slower than --quorum-timeout is taken for dead.
#pragma once

#include <functional>
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
  // `device`: where the buffers its groups move live (the model's)
  FaultTolerantOuterLoop(const LaunchEnv& env, const WanLayout& wan, double comm_timeout, double quorum_timeout,
                         Device device);

  // A worker after inner step `step`, at outer step `outer` (`last`: the run's last):
  // the outer step with the workers alive, tried again without those that die in it.
  // False when this worker came too late and the others went on without it.
  bool sync(DiLoCo& diloco, float* local_params, int step, int outer, bool last);
  // A restarted worker: asks to be let in, waits for the next quorum, and takes the
  // global weights and momentum there; returns the inner step the others are at.
  // AlreadyDone (common/tensor/error.h) when the others finished the run first.
  int join(DiLoCo& diloco, float* local_params);
  // After the last outer step: `collectives` (the end's checks) over a group of the
  // workers alive, run again over those left when a member dies in them (a CommError).
  void finish(const std::function<void(Comm& workers)>& collectives);
  // What the committed outer steps sent.
  OpStats traffic() const { return traffic_; }

 private:
  // The members of the try under `base`; `admit`: restarted workers waiting join it too
  Quorum meet(const std::string& base, int step, bool admit);
  Quorum read_quorum(const std::string& key);
  // A joiner that found the run over: AlreadyDone once the others' end's checks are
  // done, a CommError when they failed (or worker 0, the summary's writer, is the joiner)
  [[noreturn]] void wait_for_the_end();
  // group_ = a tcp group of the quorum's members, met under `base`
  void make_group(const Quorum& quorum, const std::string& base);
  // Every member says whether the try under `base` failed for it (`ok`), then waits for
  // the others' word: true when none saw it fail.
  bool vote(const std::string& base, const Quorum& quorum, bool ok);
  // One try of an outer step: false when a member saw it fail (then nobody applied it).
  bool run_try(DiLoCo& diloco, float* local_params, const Quorum& quorum, int outer, int attempt);
  // Tries go on while members die, each with its own deadlines: a failed try loses a
  // worker at least, so more tries than workers means something else fails (`what`
  // names the tries in the error).
  void check_tries(int attempt, const std::string& what) const;

  LaunchEnv env_;
  WanLayout wan_;
  double comm_timeout_;
  double quorum_timeout_;
  Device device_;
  std::shared_ptr<Store> store_;
  std::unique_ptr<Comm> group_;  // this outer step's members (or the end's)
  OpStats traffic_;
};

}  // namespace course
