// Host staging: device buffers through a backend that moves host memory (tcp, mpi).
//
// NCCL needs a GPU per rank. On a machine with one GPU and several ranks (the
// course's laptop-to-H100 path), the ranks share the GPU for compute and talk with
// tcp or mpi, which read and write host memory. stage_through_host puts a Comm in
// front of such a backend that takes device pointers. For each operation, on its
// comm thread:
//
//   1. the copies' own stream waits for the event the issuing thread recorded on the
//      compute stream as it issued the operation (cuda_ticket.h): the copies see
//      every op queued before, and the issuing thread never blocks;
//   2. the device buffers the operation reads are copied to a page-locked (pinned)
//      host buffer, one for the Comm, grown to the largest operation;
//   3. the host backend runs the operation there, with its own deadline and errors
//      (which name this rank, the operation, the peer and a hint, as always);
//   4. the buffers it writes are copied back; the Work is done once they have landed,
//      so ops queued after wait() see the result.
//
// Asynchronous operations work as on any Comm: the Work comes back at once and the
// operations run in issue order, one at a time, on the comm thread (so one staging
// buffer serves them all). Until wait(), the program must neither free the buffers
// nor queue ops that write them.
//
// Host pointers (a loss on the CPU) are passed straight through, so a program may
// mix them. The byte counters are the host backend's: the collective's bytes on the
// wire, not the PCIe copies; the time includes the copies. The pinned staging
// buffer is not in the memory tracker's counts (it is made on the comm thread).
//
// The cost: every byte crosses PCIe twice (to the host and back) on top of the
// wire, and the CPU backend's reduction runs on the CPU. It is the right tool to run
// several GPU ranks on one GPU, not to be fast; with a GPU per rank use nccl.
//
// The guarded device (common/tensor/guarded_device.h) stages through the same code: its
// copies open the arena for a memcpy instead of queueing on a stream, so the slot
// bookkeeping the GPU relies on runs in every CPU test.
#pragma once

#include <memory>

#include "common/comm/comm.h"
#include "common/tensor/memory.h"

namespace course {

// `inner` (tcp or mpi), taking buffers on `device` (CUDA or Guarded) as well as host
// ones; backend() says "tcp+staged". With CUDA, the copies run on
// cuda::current_gpu(), which must be the GPU the buffers are on. Null in, null out
// (a split that joined no group). CourseError for CUDA in a build without it.
std::unique_ptr<Comm> stage_through_host(std::unique_ptr<Comm> inner, Device device);

}  // namespace course
