// The nccl backend's factory (comm_nccl.cpp). It exists only in builds with CUDA and
// NCCL, where COURSE_HAVE_NCCL is defined: include this header under
// `#ifdef COURSE_HAVE_NCCL`.
#pragma once

#ifndef COURSE_HAVE_NCCL
#error "common/comm/nccl.h is only for builds with CUDA and NCCL (COURSE_HAVE_NCCL); include it under #ifdef COURSE_HAVE_NCCL"
#endif

#include <memory>

#include "common/comm/comm.h"
#include "common/comm/env.h"

namespace course {

// A Comm over all ranks of the job whose buffers are DEVICE pointers on GPU
// `device_index` (one GPU per rank; usually gpu_for_rank, env.h). Collective: every rank
// calls it. Rank 0 makes NCCL's unique id and shares it through the store at
// MASTER_ADDR:MASTER_PORT (rendezvous.h). Leaves `device_index` the calling
// thread's current GPU, as NCCL needs it to be while the communicator is made.
//
// Every buffer must be device memory (or managed, or pinned host memory): a
// pageable host pointer is a CommError saying so, as NCCL's kernels cannot read it.
// This is the path with one GPU per rank; on a machine with fewer GPUs than ranks
// (one H100, two ranks), use tcp or mpi with host staging instead (comm_staged.h),
// which create_world_comm picks for CommOptions::buffers = Device::CUDA.
//
// The operations run on the Comm's own CUDA stream, ordered against the compute
// stream (cuda::compute_stream(), where every op runs) with events, so a chapter
// needs no synchronisation of its own:
//   - issuing an operation records an event on the compute stream, on the issuing
//     thread; the comm stream waits for it (on the GPU) before the NCCL kernels, so
//     the operation sees every op queued before it was issued. The ops queued after
//     it may run alongside it: until wait(), they must not write its buffers, nor
//     read the ones it writes.
//   - wait() returns once the NCCL kernels have finished (the issuing thread
//     queues them, records their `done` event and moves on; between operations it
//     polls `done` and NCCL's error state, aborting the communicator at an error or
//     the deadline), and makes the compute stream wait for `done`: ops queued after
//     wait() see the result. The result is then in device memory, visible to every
//     stream.
// Every NcclComm of the process, this world and its splits, issues through one
// thread, in the order the program queued the operations (comm.h's issue-order rule).
// The compute stream is cuda::current_gpu()'s, and the buffers are there: it must be
// `device_index` (a CommError otherwise). select_device and create_world_comm both
// pick gpu_for_rank's GPU by default: pick the device first.
//
// UsageError: several ranks but no MASTER_ADDR/MASTER_PORT. CommError: no such GPU,
// the store or a peer unreachable within timeout_seconds, or NCCL failed to start.
std::unique_ptr<Comm> create_nccl_comm(const LaunchEnv& env, double timeout_seconds, int device_index);

}  // namespace course
