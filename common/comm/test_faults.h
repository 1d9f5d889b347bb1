// The faults the tests cause on purpose, all in this one file. A healthy run never
// produces them, and the tests must see what the course does when they happen: a rank
// that dies between two steps, a process killed half-way through writing a file, a
// gradient that overflows, a machine too busy to time.
//
// They are off unless the environment holds one switch, COURSE_TEST_FAULT, naming
// one fault and its settings as key=value pairs separated by commas:
//
//   die_at_step=S[,rank=R]   rank R (default 0) SIGKILLs itself after step S, as a crash
//                            would: no save, no goodbye (tests/test_restart.cpp)
//   die_writing=NAME         the process writing the file NAME (a checkpoint, a trace)
//                            SIGKILLs itself once half of it is on disk
//   inf_gradient_at_step=N   step N's global gradient norm is infinite, the overflow no
//                            small run makes on its own (a huge --lr makes the loss NaN first)
//   busy_cores=X             other processes kept X cores busy while the run trained
//   device_only_comm=1       the guarded device's staged Comm refuses host memory as
//                            nccl does: the CPU machine's stand-in for nccl's rules
//
// The two deaths strike in a launcher group's first attempt only, so that the group the
// launcher restarts can finish. A malformed switch is a UsageError naming it.
//
// It lives in the comm layer, the lowest that knows which rank and which attempt a
// process is (common/comm/env.h), so that every layer above may ask.
#pragma once

#include <cstdio>
#include <string>

namespace course {

// die_at_step: called by every rank after every step.
void die_if_told_after_step(int step);
// die_writing: called by the writer of `path` once half of it is written to `file`.
void die_if_told_mid_write(const std::string& path, std::FILE* file);
// inf_gradient_at_step: the training loop says which step runs; clip_grads asks
// whether its gradient norm is to be taken as infinite.
void test_faults_at_step(int step);
bool gradient_norm_told_infinite();
// busy_cores: true, with the value, when the switch replaces the machine's reading.
bool busy_cores_told(double* value);
// device_only_comm: whether the staged Comm on the guarded device plays nccl.
bool comm_told_device_only();

}  // namespace course
