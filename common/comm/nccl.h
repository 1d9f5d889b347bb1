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
// `device_index` (one GPU per rank; usually env.local_rank). Collective: every rank
// calls it. Rank 0 makes NCCL's unique id and shares it through the store at
// MASTER_ADDR:MASTER_PORT (rendezvous.h). Leaves `device_index` the calling
// thread's current GPU, as NCCL needs it to be while the communicator is made.
//
// The operations run on the Comm's own CUDA stream, which waits for no other stream:
// finish writing a buffer (cudaStreamSynchronize on the stream that wrote it) before
// handing it to an operation. When an operation's Work is done, its results are in
// device memory, visible to every stream.
//
// UsageError: several ranks but no MASTER_ADDR/MASTER_PORT. CommError: no such GPU,
// the store or a peer unreachable within timeout_seconds, or NCCL failed to start.
std::unique_ptr<Comm> create_nccl_comm(const LaunchEnv& env, double timeout_seconds, int device_index);

}  // namespace course
