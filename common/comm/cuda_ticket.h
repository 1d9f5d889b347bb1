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
//       after its kernels and moves on to the next operation; between operations
//       it polls `done` (with the deadline, Comm::finished), and the Work is done
//       once `done` has completed.
//   the thread that waits, in Work::wait (OpTicket::after_wait):
//       the compute stream waits for `done`, so the ops queued after wait() run
//       after the result is written. (The comm thread has already seen `done`
//       complete, so this costs the GPU nothing; it is the ordering made explicit,
//       and it stays right if waiting ever stops blocking the CPU.)
//
// The events come from a pool (EventPool), one per Comm, and go back to it when the
// ticket goes (after wait()): making and destroying two events per operation
// would cost more than recording them. An event can be recorded again as soon as
// the streams that must wait for it have been told to (cudaStreamWaitEvent waits
// for the record made before the call, not for later ones).
#pragma once

#ifndef COURSE_HAVE_CUDA
#error "common/comm/cuda_ticket.h is only for CUDA builds (COURSE_HAVE_CUDA)"
#endif

#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/comm/comm_util.h"
#include "common/tensor/cuda/runtime.h"

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

// Events made on one GPU once and used again. Any thread may take and give back.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    for (cudaEvent_t event : free_) (void)cudaEventDestroy(event);  // a destructor cannot throw
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // An event of this pool's GPU, for `where` (named in the error if one must be made and cannot).
  cudaEvent_t take(const std::string& where) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        cudaEvent_t event = free_.back();
        free_.pop_back();
        return event;
      }
    }
    // an event belongs to the GPU current when it is made, and can only be recorded
    // on that GPU's streams: make it on the pool's GPU, then put the calling
    // thread's current GPU back as it was
    int current = device_;
    check_comm_cuda(cudaGetDevice(&current), "cudaGetDevice", where);
    if (current != device_) check_comm_cuda(cudaSetDevice(device_), "cudaSetDevice", where);
    cudaEvent_t event = nullptr;
    const cudaError_t made = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (current != device_) (void)cudaSetDevice(current);
    check_comm_cuda(made, "cudaEventCreateWithFlags", where);
    return event;
  }

  void give(cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() < kMaxFree) {
      free_.push_back(event);
    } else {
      (void)cudaEventDestroy(event);  // more than operations are ever in flight: let it go
    }
  }

 private:
  static constexpr size_t kMaxFree = 64;
  const int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

class CudaTicket : public OpTicket {
 public:
  // On the issuing thread: records `ready` on the compute stream.
  CudaTicket(std::string where_, std::shared_ptr<EventPool> events) : where(std::move(where_)), events_(std::move(events)) {
    ready = events_->take(where);
    const cudaError_t recorded = cudaEventRecord(ready, cuda::compute_stream());
    if (recorded != cudaSuccess) {
      events_->give(ready);  // the destructor does not run when the constructor throws
      ready = nullptr;
      check_comm_cuda(recorded, "cudaEventRecord", where);
    }
  }
  ~CudaTicket() override {
    if (ready != nullptr) events_->give(ready);
    if (done != nullptr) events_->give(done);
  }
  CudaTicket(const CudaTicket&) = delete;
  CudaTicket& operator=(const CudaTicket&) = delete;

  // On the comm thread, once the operation's GPU work is queued on `stream`.
  void record_done(cudaStream_t stream) {
    done = events_->take(where);
    check_comm_cuda(cudaEventRecord(done, stream), "cudaEventRecord", where);
  }

  // On the waiting thread: later compute waits for the operation's result.
  void after_wait() override {
    if (done == nullptr) return;  // nothing ran on the GPU (zero counts)
    check_comm_cuda(cudaStreamWaitEvent(cuda::compute_stream(), done, 0), "cudaStreamWaitEvent", where);
  }

  // "rank 2 all_reduce", for messages; the comm thread may make it more precise
  // ("rank 2 broadcast from rank 0") before the Work is done
  std::string where;
  cudaEvent_t ready = nullptr;  // on the compute stream, at issue
  cudaEvent_t done = nullptr;   // on the operation's stream after its GPU work (record_done), or null

 private:
  std::shared_ptr<EventPool> events_;  // the Comm's; kept alive by its tickets, which may outlive it
};

}  // namespace course
