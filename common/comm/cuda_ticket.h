// The events that order a communication operation against the GPU's compute. CUDA
// builds only (COURSE_HAVE_CUDA): the nccl backend and host staging use it.
//
// Every op of the course runs on one CUDA stream, the compute stream, in the order
// the program queued it; the CPU runs ahead of it. A communication operation works
// on another stream (nccl's, or staging's copies), so it must be told where in the
// compute stream's order it stands. Three threads take part:
//
//   the issuing thread, as the operation is queued (Comm::issue_ticket):
//       `ready` = an event recorded on the compute stream. It completes once every
//       op this thread queued before the operation has run. It must be recorded
//       now: by the time the comm thread gets to the operation, the program has
//       queued more (the rest of backward), which the operation must not wait for.
//   the comm thread, when the operation runs:
//       its stream waits for `ready` (cudaStreamWaitEvent: the GPU waits, the CPU
//       does not), then copies or communicates. nccl records `done` on its stream
//       after its kernels, and polls it (with the deadline) before the Work is done.
//   the thread that waits, in Work::wait (OpTicket::after_wait):
//       the compute stream waits for `done`, so the ops queued after wait() run
//       after the result is written. (The comm thread has already seen `done`
//       complete, so this costs the GPU nothing; it is the ordering made explicit,
//       and it stays right if waiting ever stops blocking the CPU.)
#pragma once

#ifndef COURSE_HAVE_CUDA
#error "common/comm/cuda_ticket.h is only for CUDA builds (COURSE_HAVE_CUDA)"
#endif

#include <cuda_runtime.h>

#include <string>

#include "common/comm/comm.h"
#include "common/comm/comm_util.h"
#include "common/cuda/runtime.h"

namespace course {

// A CUDA call's failure as a CommError naming the rank and operation (`where`), the
// call, CUDA's own words and a hint.
inline void check_comm_cuda(cudaError_t status, const char* call, const std::string& where,
                            const char* hint = "a fault on the GPU, or out of memory; CUDA_LAUNCH_BLOCKING=1 "
                                               "ties a fault to its kernel") {
  if (status == cudaSuccess) return;
  throw CommError(where + ": " + call_name(call) + " failed: " + cudaGetErrorName(status) + ", " +
                  cudaGetErrorString(status) + " (hint: " + hint + ")");
}

class CudaTicket : public OpTicket {
 public:
  // On the issuing thread: records `ready` on the compute stream.
  explicit CudaTicket(std::string where_) : where(std::move(where_)) {
    // an event belongs to the GPU current when it is made, and can only be recorded
    // on that GPU's streams: make it on the compute stream's GPU, then put the
    // thread's current GPU back as it was
    const int gpu = cuda::current_gpu();
    int current = gpu;
    check_comm_cuda(cudaGetDevice(&current), "cudaGetDevice", where);
    if (current != gpu) check_comm_cuda(cudaSetDevice(gpu), "cudaSetDevice", where);
    const cudaError_t made = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    if (current != gpu) (void)cudaSetDevice(current);
    check_comm_cuda(made, "cudaEventCreateWithFlags", where);
    const cudaError_t recorded = cudaEventRecord(ready, cuda::compute_stream());
    if (recorded != cudaSuccess) {
      (void)cudaEventDestroy(ready);  // the destructor does not run when the constructor throws
      ready = nullptr;
      check_comm_cuda(recorded, "cudaEventRecord", where);
    }
  }
  ~CudaTicket() override {
    // a destructor cannot throw; an event still pending is released once it completes
    if (ready != nullptr) (void)cudaEventDestroy(ready);
    if (done != nullptr) (void)cudaEventDestroy(done);
  }
  CudaTicket(const CudaTicket&) = delete;
  CudaTicket& operator=(const CudaTicket&) = delete;

  // On the waiting thread: later compute waits for the operation's result.
  void after_wait() override {
    if (done == nullptr) return;  // nothing ran on the GPU (zero counts)
    check_comm_cuda(cudaStreamWaitEvent(cuda::compute_stream(), done, 0), "cudaStreamWaitEvent", where);
  }

  const std::string where;      // "rank 2 all_reduce", for messages
  cudaEvent_t ready = nullptr;  // on the compute stream, at issue
  cudaEvent_t done = nullptr;   // on the operation's stream after its GPU work (made by the comm thread), or null
};

}  // namespace course
