// The nccl backend: NCCL on GPUs. Every buffer is a device pointer.
//
// NCCL runs each operation as a GPU kernel on a CUDA stream. Every Comm here has a
// stream of its own, so communication overlaps compute running on other streams.
// What this file adds to NCCL is what the course's Comm promises:
//
//   - One issue order (comm.h's rule): every call this process makes on an NCCL
//     communicator, from making it to taking it down, is made on one thread, the
//     issuing thread every NcclComm shares (issuing_thread()), in the order the
//     program queued the operations. NCCL_LAUNCH_ORDER_IMPLICIT=1 (set before NCCL
//     first reads it, unless the user chose) makes NCCL start the kernels of
//     different communicators on the GPU in that order too.
//   - Ordering against compute, with events (cuda_ticket.h): as an operation is
//     issued, the issuing thread records an event on the compute stream; the comm
//     thread makes the comm stream wait for it before the NCCL calls, so the
//     operation sees everything queued before it, with no synchronisation by the
//     caller and no CPU blocking. After the NCCL calls the comm thread records a
//     `done` event on the comm stream and goes on to the next operation: back-to-
//     back operations queue on the GPU, none costs a round trip to the host. The
//     thread polls `done` between operations (finished()), and the Work is done
//     once it has completed; Work::wait then makes the compute stream wait for
//     `done`, so ops queued after wait() see the result.
//   - A deadline on every operation. An NCCL kernel waiting for a dead peer spins
//     forever, and some NCCL calls (making a communicator, splitting one, the first
//     connection to a peer) can block the calling thread just as long. So the
//     communicators are non-blocking (config.blocking = 0): every NCCL call returns
//     at once, maybe with ncclInProgress, and the comm thread then polls
//     ncclCommGetAsyncError (has NCCL finished the call? has it failed?) until it
//     says done; later, in finished(), it polls NCCL's state and `done` (has the
//     GPU finished the work?) until `done` has completed or the deadline, counted
//     from when the operation started, passes.
//   - Errors as CommErrors naming the rank, the operation, the call and NCCL's or
//     CUDA's own words. After any failure the communicator is aborted
//     (ncclCommAbort stops its kernels and frees it), on the comm thread, where no
//     other NCCL call can be under way (NCCL requires it): NCCL promises nothing
//     about operations in flight once one has failed, so they fail too.
//
// NCCL has no all-gather or reduce-scatter with a count per rank (MPI's
// allgatherv): with uneven counts they are built from one broadcast, or one reduce,
// rooted at each rank, issued as one group. Nor has it an all-to-all: that is one
// ncclSend and one ncclRecv per peer, issued as one group.
//
// Byte counters: NCCL does not tell us what it sent (it picks ring, tree or NVLink
// algorithms by size and machine), so collectives record the volume of the
// bandwidth-optimal ring algorithm (ring_volume.h), all_to_all every block but the
// rank's own; broadcast records the bytes
// (the root sends them, the others receive them) and send/recv the exact bytes.
#include "common/comm/nccl.h"
#include "common/comm/comm_util.h"
#include "common/comm/cuda_ticket.h"
#include "common/comm/nccl_average.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "common/comm/rendezvous.h"
#include "common/comm/ring_volume.h"
#include "common/tensor/clock.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "the nccl backend needs NCCL 2.18 or newer (ncclCommSplit, non-blocking communicators)"
#endif

// Every NCCL and CUDA call goes through these: a failure becomes a CommError naming
// the rank and operation (`where`), the call, NCCL's or CUDA's words, and a hint.
// (Here CUDA_CHECK is this file's, not runtime.h's, which throws a plain CourseError.)
#undef CUDA_CHECK
#define NCCL_CHECK(call, comm, where) check_nccl((call), #call, (comm), (where))
#define CUDA_CHECK(call, where) check_cuda((call), #call, (where))

namespace course {

namespace {

std::string nccl_text(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  // NCCL's last error message says more: which peer, which argument
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && detail[0] != '\0') text += std::string(": ") + detail;
  return text;
}

const char* nccl_hint(ncclResult_t result) {
  switch (result) {
    case ncclSystemError:
    case ncclRemoteError:
      return "a peer died or the network between the ranks failed; see the other ranks' output";
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return "are the buffers device memory on this rank's GPU, is each rank on a GPU of its own, and do all ranks "
             "call the same operations with the same counts? NCCL_DEBUG=WARN says more";
    case ncclUnhandledCudaError:
      return "a CUDA error inside NCCL: out of GPU memory, or a fault on the GPU";
    default:
      return "run with NCCL_DEBUG=WARN for NCCL's own account";
  }
}

void check_nccl(ncclResult_t result, const char* call, ncclComm_t comm, const std::string& where) {
  // ncclInProgress is not a failure: a non-blocking communicator finishes the call
  // in the background, and wait_for waits for it.
  if (result == ncclSuccess || result == ncclInProgress) return;
  throw CommError(where + ": " + call_name(call) + " failed: " + nccl_text(result, comm) + " (hint: " +
                  nccl_hint(result) + ")");
}

const char* cuda_hint(cudaError_t status) {
  switch (status) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
      return "no usable GPU here: nvidia-smi should list one; on the CPU use --backend tcp or mpi";
    case cudaErrorInvalidDevice:
      return "every rank needs a GPU of its own: start at most as many ranks per machine as it has GPUs";
    default:
      return "are the buffers device memory on this rank's GPU? CUDA_LAUNCH_BLOCKING=1 ties a fault to its kernel";
  }
}

void check_cuda(cudaError_t status, const char* call, const std::string& where) {
  if (status == cudaSuccess) return;
  throw CommError(where + ": " + call_name(call) + " failed: " + cudaGetErrorName(status) + ", " +
                  cudaGetErrorString(status) + " (hint: " + cuda_hint(status) + ")");
}

// NCCL's state of `comm`: ncclSuccess once it has finished the non-blocking calls
// made on it, ncclInProgress while it is still making them. Any other state (an
// error, from a call or from the network) is thrown as a CommError.
ncclResult_t nccl_state(ncclComm_t comm, const std::string& where) {
  ncclResult_t state = ncclSuccess;
  NCCL_CHECK(ncclCommGetAsyncError(comm, &state), comm, where);
  if (state != ncclSuccess && state != ncclInProgress) {
    throw CommError(where + ": NCCL reports " + nccl_text(state, comm) + " (hint: " + nccl_hint(state) + ")");
  }
  return state;
}

// Throws the timeout once `timeout_seconds` have passed since `started` (now_seconds()).
void check_deadline(double started, double timeout_seconds, const std::string& where) {
  if (now_seconds() - started <= timeout_seconds) return;
  throw CommError(where + ": timed out after " + seconds_text(timeout_seconds) +
                  " s (hint: a peer is dead or stuck; raise --comm-timeout if it is just slow)");
}

// Polls until `comm` has finished the non-blocking calls made on it (their kernels
// are then on the stream). Throws a CommError on an NCCL error or at the deadline;
// the caller then aborts `comm`.
void wait_for(ncclComm_t comm, double timeout_seconds, const std::string& where) {
  const double start = now_seconds();
  for (int polls = 0; nccl_state(comm, where) != ncclSuccess; polls++) {
    check_deadline(start, timeout_seconds, where);
    // a call is usually done within the first polls; after that, leave the core to others
    if (polls >= 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// The thread that makes every NCCL call of this process (comm.h's issue-order
// rule), shared by all NcclComms: made with the first, stopped after the last.
std::shared_ptr<CommThread> issuing_thread() {
  static std::mutex mutex;
  static std::weak_ptr<CommThread> shared;
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<CommThread> thread = shared.lock();
  if (thread == nullptr) {
    thread = std::make_shared<CommThread>();
    shared = thread;
  }
  return thread;
}

// NCCL reads and writes the buffers from GPU kernels: host memory there is an illegal
// address, or worse a silent wrong answer. Say so instead. Device, managed and pinned
// host memory are all reachable from the GPU.
// Runs on the comm thread: selects `device` first, because the current GPU is a
// per-thread setting and a fresh thread's first CUDA call would otherwise open a
// context on GPU 0.
void check_device_memory(int device, const void* data, size_t count, const char* what, const std::string& where) {
  if (data == nullptr || count == 0) return;
  CUDA_CHECK(cudaSetDevice(device), where);
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
    (void)cudaGetLastError();  // not a pointer CUDA can judge: leave it to NCCL
    return;
  }
  if (attributes.type != cudaMemoryTypeUnregistered) return;
  throw CommError(where + ": the " + what + " buffer is host memory, but the nccl backend takes device memory " +
                  "(hint: keep it in a Buffer on Device::CUDA and copy it with copy_bytes, or use --backend tcp or " +
                  "mpi, which stage device buffers through the host)");
}

// Pageable host memory: what NCCL's kernels cannot reach (device, managed and pinned
// host memory they can). On the issuing thread, whose current GPU is the Comm's.
bool unregistered_host_memory(const void* data) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
    (void)cudaGetLastError();  // not a pointer CUDA can judge: leave it to NCCL
    return false;
  }
  return attributes.type == cudaMemoryTypeUnregistered;
}

// Makes the calls in `calls` between ncclGroupStart and ncclGroupEnd: NCCL then
// launches them as one operation, so sends and receives that wait on each other
// cannot deadlock, and a broadcast per rank costs one launch. The group belongs to
// the thread, so it is ended even when a call inside fails.
void grouped(ncclComm_t comm, const std::string& where, const std::function<void()>& calls) {
  NCCL_CHECK(ncclGroupStart(), comm, where);
  try {
    calls();
  } catch (...) {
    (void)ncclGroupEnd();  // already failing: the first error is the one reported
    throw;
  }
  NCCL_CHECK(ncclGroupEnd(), comm, where);
}

// Non-blocking: every call returns at once and finishes in the background, so that
// wait_for can put our deadline on it.
ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// NCCL's own bf16 (ncclBfloat16, NCCL 2.10 on): its kernels add two bf16 values in fp32.
ncclDataType_t nccl_type(DType type) { return type == DType::BF16 ? ncclBfloat16 : ncclFloat; }

// Average is NCCL's sum, then launch_divide after it (nccl_average.h: not ncclAvg,
// whose bf16 factor 1/ranks is itself rounded).
ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Average: return ncclSum;
    case ReduceOp::Max: return ncclMax;
  }
  return ncclSum;
}

class NcclComm : public Comm {
 public:
  // Takes ownership of `comm` and `stream`, both on GPU `device`. Its operations run
  // on the issuing thread.
  NcclComm(ncclComm_t comm, cudaStream_t stream, int device, int rank, int size, double timeout_seconds)
      : Comm(rank, size, timeout_seconds, issuing_thread()),
        comm_(comm),
        stream_(stream),
        device_(device),
        events_(std::make_shared<EventPool>(device)) {}
  ~NcclComm() override;

  std::string backend() const override { return "nccl"; }
  Device device_only() const override { return Device::CUDA; }
  bool is_host_memory(const float* data) const override;

 protected:
  // On the issuing thread: the event on the compute stream this operation waits for.
  std::shared_ptr<OpTicket> issue_ticket(const std::string& operation) override {
    return std::make_shared<CudaTicket>(describe(operation), events_);
  }
  bool finished(OpTicket* ticket, double started) override;
  void do_all_reduce(void* data, size_t count, DType type, ReduceOp op, OpStats& stats) override;
  void do_reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts, DType type, ReduceOp op,
                         OpStats& stats) override;
  void do_all_gather(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                     OpStats& stats) override;
  void do_all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                     const std::vector<size_t>& recv_counts, DType type, OpStats& stats) override;
  void do_broadcast(float* data, size_t count, int root, OpStats& stats) override;
  void do_send_recv(const void* send_data, size_t send_count, int to, void* recv_data, size_t recv_count, int from,
                    DType type, OpStats& stats) override;
  void do_barrier(OpStats& stats) override;
  std::unique_ptr<Comm> do_split(int color, int key) override;

 private:
  // One operation on the comm thread: select this Comm's GPU (the current GPU is a
  // per-thread setting), make the comm stream wait for the compute queued before the
  // operation was issued, make the NCCL calls, wait (with the deadline) until NCCL
  // has finished them, and record `done` after their kernels; finished() polls it.
  // Calls that put nothing on the stream (a split) pass on_stream = false; `then`,
  // when given, queues more work after NCCL's kernels, before `done` (Average's
  // division). Any failure aborts the communicator.
  void run(const std::string& where, const std::function<void()>& issue, bool on_stream = true,
           const std::function<void()>& then = nullptr);
  void destroy();
  void abort();

  ncclComm_t comm_;  // null once aborted
  cudaStream_t stream_;
  int device_;
  std::shared_ptr<EventPool> events_;  // the tickets' events, on device_
  float* barrier_value_ = nullptr;     // the one float a barrier all-reduces, made by the first barrier
};

// Once every operation has finished, the communicator is taken down on the issuing
// thread: ncclCommFinalize is a call on the communicator like the others (and
// collective within a machine), so it keeps the program's order too.
NcclComm::~NcclComm() { stop_thread([this] { destroy(); }); }

void NcclComm::destroy() {
  const std::string where = describe("destroy");
  // A destructor cannot throw: failures here are said on stderr.
  try {
    CUDA_CHECK(cudaSetDevice(device_), where);
    if (comm_ != nullptr) {
      // ncclCommFinalize lets what is in flight finish and takes the connections
      // down; it is non-blocking, so it too waits with a deadline. ncclCommDestroy
      // then frees what is left.
      NCCL_CHECK(ncclCommFinalize(comm_), comm_, where);
      wait_for(comm_, timeout_seconds(), where);
      NCCL_CHECK(ncclCommDestroy(comm_), comm_, where);
      comm_ = nullptr;
    }
  } catch (const CommError& failure) {
    std::fprintf(stderr, "%s\n", failure.what());
    abort();
  }
  try {
    if (barrier_value_ != nullptr) CUDA_CHECK(cudaFree(barrier_value_), where);
    CUDA_CHECK(cudaStreamDestroy(stream_), where);
  } catch (const CommError& failure) {
    std::fprintf(stderr, "%s\n", failure.what());
  }
}

void NcclComm::abort() {
  if (comm_ == nullptr) return;
  const ncclResult_t result = ncclCommAbort(comm_);
  comm_ = nullptr;
  if (result != ncclSuccess) {
    std::fprintf(stderr, "%s: ncclCommAbort failed: %s\n", describe("abort").c_str(), ncclGetErrorString(result));
  }
}

void NcclComm::run(const std::string& where, const std::function<void()>& issue, bool on_stream,
                   const std::function<void()>& then) {
  // every operation has one, made on the issuing thread as it was queued (issue_ticket)
  auto& ticket = static_cast<CudaTicket&>(*running_ticket());
  ticket.where = where;  // finished()'s and after_wait's messages name the peers too
  try {
    CUDA_CHECK(cudaSetDevice(device_), where);
    // The GPU, not this thread, waits: the NCCL kernels start once the compute
    // queued before the operation was issued has run.
    if (on_stream) CUDA_CHECK(cudaStreamWaitEvent(stream_, ticket.ready, 0), where);
    issue();
    wait_for(comm_, timeout_seconds(), where);
    // Only once NCCL has finished its calls are its kernels on the stream: `done`
    // recorded earlier would complete before they even ran, and `then` would run before them.
    if (then) then();
    if (on_stream) ticket.record_done(stream_);
  } catch (const CommError&) {
    abort();
    throw;
  }
}

bool NcclComm::finished(OpTicket* ticket, double started) {
  const auto& cuda_ticket = static_cast<const CudaTicket&>(*ticket);
  if (cuda_ticket.done == nullptr) return true;  // nothing was queued on the GPU (zero counts, a split)
  const std::string& where = cuda_ticket.where;
  if (comm_ == nullptr) {
    throw CommError(where + ": did not finish: the communicator was aborted after an error in another of its " +
                    "operations (hint: the first error, above, says why)");
  }
  try {
    // NCCL's state first: a peer that died shows there, while the kernels would spin on
    if (nccl_state(comm_, where) == ncclSuccess) {
      const cudaError_t status = cudaEventQuery(cuda_ticket.done);
      if (status == cudaSuccess) return true;
      if (status != cudaErrorNotReady) check_cuda(status, "cudaEventQuery", where);
    }
    check_deadline(started, timeout_seconds(), where);
    return false;
  } catch (const CommError&) {
    abort();
    throw;
  }
}

bool NcclComm::is_host_memory(const float* data) const { return unregistered_host_memory(data); }

// Zero counts: every rank has the same counts, so every rank skips the same calls.

// bf16 (--grad-comm-dtype bf16) compiled, never run on a GPU yet.
void NcclComm::do_all_reduce(void* data, size_t count, DType type, ReduceOp op, OpStats& stats) {
  if (count == 0) return;
  const std::string where = describe("all_reduce");
  check_device_memory(device_, data, count, "data", where);
  run(
      where,
      [&] { NCCL_CHECK(ncclAllReduce(data, data, count, nccl_type(type), nccl_op(op), comm_, stream_), comm_, where); },
      true, [&] {
        if (op == ReduceOp::Average) launch_divide(data, count, type, size(), stream_);
      });
  const uint64_t bytes = ring_all_reduce_bytes(count * dtype_bytes(type), size());
  stats.bytes_sent += bytes;
  stats.bytes_received += bytes;
}

void NcclComm::do_reduce_scatter(const void* in_elements, void* out, const std::vector<size_t>& counts, DType type,
                                 ReduceOp op, OpStats& stats) {
  // offsets in bytes: the blocks are counts of `type`
  const auto* in = static_cast<const unsigned char*>(in_elements);
  const size_t element = dtype_bytes(type);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  if (total == 0) return;
  const std::string where = describe("reduce_scatter");
  check_device_memory(device_, in, total, "input", where);
  check_device_memory(device_, out, counts[rank()], "output", where);
  run(where, [&] {
    if (all_equal(counts)) {
      NCCL_CHECK(ncclReduceScatter(in, out, counts[0], nccl_type(type), nccl_op(op), comm_, stream_), comm_, where);
      return;
    }
    // Uneven counts: rank r's block is reduced onto rank r, one reduce per rank.
    grouped(comm_, where, [&] {
      size_t offset = 0;
      for (int root = 0; root < size(); root++) {
        if (counts[root] > 0) {
          // Only the root receives. NCCL lets the others pass a null recvbuff and never
          // writes theirs (nccl.h: "recvbuff may be NULL on all calls except for root
          // device"); still, a null in a call is a trap for whatever else reads its
          // arguments (a profiler plugin, a debugging tool, a later NCCL). So the others
          // pass their own copy of the root's block: device memory on this GPU, of the
          // block's size, which the call reads anyway (as sendbuff) and, off the root,
          // does not write. Unlike a scratch buffer, nothing to allocate.
          void* result = root == rank() ? out : const_cast<unsigned char*>(in + offset * element);
          NCCL_CHECK(ncclReduce(in + offset * element, result, counts[root], nccl_type(type), nccl_op(op), root,
                                comm_, stream_),
                     comm_, where);
        }
        offset += counts[root];
      }
    });
  }, true, [&] {  // this rank's block of the sum, averaged
    if (op == ReduceOp::Average) launch_divide(out, counts[rank()], type, size(), stream_);
  });
  const uint64_t bytes = ring_gather_bytes(total * element, size());
  stats.bytes_sent += bytes;
  stats.bytes_received += bytes;
}

void NcclComm::do_all_gather(const void* in, void* out_elements, const std::vector<size_t>& counts, DType type,
                             OpStats& stats) {
  auto* out = static_cast<unsigned char*>(out_elements);
  const size_t element = dtype_bytes(type);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  if (total == 0) return;
  const std::string where = describe("all_gather");
  check_device_memory(device_, in, counts[rank()], "input", where);
  check_device_memory(device_, out, total, "output", where);
  run(where, [&] {
    if (all_equal(counts)) {
      NCCL_CHECK(ncclAllGather(in, out, counts[0], nccl_type(type), comm_, stream_), comm_, where);
      return;
    }
    // Uneven counts: every rank broadcasts its block into its place in `out`.
    grouped(comm_, where, [&] {
      size_t offset = 0;
      for (int root = 0; root < size(); root++) {
        if (counts[root] > 0) {
          // the root sends from `in`; the others' send buffer is unused
          const void* source = root == rank() ? in : out + offset * element;
          NCCL_CHECK(ncclBroadcast(source, out + offset * element, counts[root], nccl_type(type), root, comm_,
                                   stream_),
                     comm_, where);
        }
        offset += counts[root];
      }
    });
  });
  const uint64_t bytes = ring_gather_bytes(total * element, size());
  stats.bytes_sent += bytes;
  stats.bytes_received += bytes;
}

// Compiled, but it has never run on a GPU (no machine of the course's had one when it
// was written): the first GPU run is its test (test_comm_cuda's nccl case runs it).
void NcclComm::do_all_to_all(const void* in_values, const std::vector<size_t>& send_counts, void* out_values,
                             const std::vector<size_t>& recv_counts, DType type, OpStats& stats) {
  // byte pointers: the blocks' offsets count values of `type`, `element` bytes each
  const size_t element = dtype_bytes(type);
  const unsigned char* in = static_cast<const unsigned char*>(in_values);
  unsigned char* out = static_cast<unsigned char*>(out_values);
  const size_t sent = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
  const size_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  if (sent == 0 && received == 0) return;
  const std::string where = describe("all_to_all");
  check_device_memory(device_, in, sent, "input", where);
  check_device_memory(device_, out, received, "output", where);
  const int n = size(), me = rank();
  std::vector<size_t> send_at(n), recv_at(n);  // where each rank's block starts in `in` and in `out`
  std::exclusive_scan(send_counts.begin(), send_counts.end(), send_at.begin(), size_t{0});
  std::exclusive_scan(recv_counts.begin(), recv_counts.end(), recv_at.begin(), size_t{0});
  run(where, [&] {
    // its own block is a copy on the comm stream, ahead of the group
    if (send_counts[me] > 0) {
      CUDA_CHECK(cudaMemcpyAsync(out + recv_at[me] * element, in + send_at[me] * element, send_counts[me] * element,
                                 cudaMemcpyDeviceToDevice, stream_),
                 where);
    }
    // One group: every send and receive starts together, so no pair waits on another.
    // A block of 0 floats is skipped on both sides (the counts agree). NCCL cannot
    // check that they agree: a mismatch hangs until the deadline.
    grouped(comm_, where, [&] {
      for (int peer = 0; peer < n; peer++) {
        if (peer != me && send_counts[peer] > 0) {
          NCCL_CHECK(ncclSend(in + send_at[peer] * element, send_counts[peer], nccl_type(type), peer, comm_, stream_),
                     comm_, where);
        }
        if (peer != me && recv_counts[peer] > 0) {
          NCCL_CHECK(ncclRecv(out + recv_at[peer] * element, recv_counts[peer], nccl_type(type), peer, comm_, stream_),
                     comm_, where);
        }
      }
    });
  });
  stats.bytes_sent += all_to_all_bytes(send_counts, rank(), element);
  stats.bytes_received += all_to_all_bytes(recv_counts, rank(), element);
}

void NcclComm::do_broadcast(float* data, size_t count, int root, OpStats& stats) {
  if (count == 0) return;
  const std::string where = describe("broadcast from rank " + std::to_string(root));
  check_device_memory(device_, data, count, "data", where);
  run(where, [&] { NCCL_CHECK(ncclBroadcast(data, data, count, ncclFloat, root, comm_, stream_), comm_, where); });
  const uint64_t bytes = count * sizeof(float);
  if (rank() == root) {
    stats.bytes_sent += bytes;
  } else {
    stats.bytes_received += bytes;
  }
}

void NcclComm::do_send_recv(const void* send_data, size_t send_count, int to, void* recv_data, size_t recv_count,
                            int from, DType type, OpStats& stats) {
  const bool sends = to >= 0 && send_count > 0;
  const bool receives = from >= 0 && recv_count > 0;
  if (!sends && !receives) return;
  std::string what;
  if (to >= 0) what = "send to rank " + std::to_string(to);
  if (from >= 0) what += std::string(what.empty() ? "" : ", ") + "recv from rank " + std::to_string(from);
  const std::string where = describe(what);
  if (sends) check_device_memory(device_, send_data, send_count, "send", where);
  if (receives) check_device_memory(device_, recv_data, recv_count, "receive", where);
  // One group: NCCL starts the send and the receive together, so two ranks that
  // send to each other (a ring shift) never wait on each other. NCCL cannot check
  // that the counts match; a mismatch hangs until the deadline.
  run(where, [&] {
    grouped(comm_, where, [&] {
      if (sends) NCCL_CHECK(ncclSend(send_data, send_count, nccl_type(type), to, comm_, stream_), comm_, where);
      if (receives) NCCL_CHECK(ncclRecv(recv_data, recv_count, nccl_type(type), from, comm_, stream_), comm_, where);
    });
  });
  if (sends) stats.bytes_sent += send_count * dtype_bytes(type);
  if (receives) stats.bytes_received += recv_count * dtype_bytes(type);
}

void NcclComm::do_barrier(OpStats&) {
  const std::string where = describe("barrier");
  // NCCL has no barrier. An all-reduce of one float is one: it cannot finish on any
  // rank before every rank has started it.
  run(where, [&] {
    if (barrier_value_ == nullptr) {
      CUDA_CHECK(cudaMalloc(&barrier_value_, sizeof(float)), where);
      CUDA_CHECK(cudaMemsetAsync(barrier_value_, 0, sizeof(float), stream_), where);
    }
    NCCL_CHECK(ncclAllReduce(barrier_value_, barrier_value_, 1, ncclFloat, ncclSum, comm_, stream_), comm_, where);
  });
}

std::unique_ptr<Comm> NcclComm::do_split(int color, int key) {
  const std::string where = describe("split");
  // NCCL writes `child` when the split completes, which may be after we stop
  // waiting: it must outlive run(), whose abort waits for NCCL to finish.
  ncclComm_t child = nullptr;
  try {
    run(where, [&] {
      ncclConfig_t config = nonblocking_config();
      const int nccl_color = color < 0 ? NCCL_SPLIT_NOCOLOR : color;
      NCCL_CHECK(ncclCommSplit(comm_, nccl_color, key, &child, &config), comm_, where);
    }, /*on_stream=*/false);
    if (child == nullptr) return nullptr;  // NCCL_SPLIT_NOCOLOR: this rank joins no group
    wait_for(child, timeout_seconds(), where);
    int child_rank = 0;
    int child_size = 0;
    NCCL_CHECK(ncclCommUserRank(child, &child_rank), child, where);
    NCCL_CHECK(ncclCommCount(child, &child_size), child, where);
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), where);
    return std::make_unique<NcclComm>(child, stream, device_, child_rank, child_size, timeout_seconds());
  } catch (const CommError&) {
    if (child != nullptr) (void)ncclCommAbort(child);  // already failing: the first error is the one reported
    throw;
  }
}

}  // namespace

std::unique_ptr<Comm> create_nccl_comm(const LaunchEnv& env, double timeout_seconds, int device_index) {
  const std::string where = "rank " + std::to_string(env.rank) + " nccl init";
  // Before NCCL reads its settings: start the kernels of different communicators on
  // the GPU in the order the issuing thread issued them (NCCL 2.26 and later; older
  // ones ignore it). A value the user set is kept.
  setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", /*overwrite=*/0);
  // left the calling thread's current GPU (nccl.h); a per-thread setting
  CUDA_CHECK(cudaSetDevice(device_index), where);
  // The buffers are where the compute runs, and operations are ordered against its
  // stream: that must be this GPU. (current_gpu() is the one select_device picked;
  // GPU 0 if no GPU was picked yet.)
  const int compute_gpu = cuda::current_gpu();
  if (compute_gpu != device_index) {
    throw CommError(where + ": NCCL would run on GPU " + std::to_string(device_index) + " but this process computes " +
                    "on GPU " + std::to_string(compute_gpu) + " (hint: pick the device first, as --device cuda " +
                    "does, and leave CommOptions::device_index at -1)");
  }
  CUDA_CHECK(cudaSetDevice(device_index), where);  // current_gpu() may have made its context current

  // Rank 0 makes the unique id (it names the job's NCCL bootstrap, which rank 0
  // hosts) and publishes it in the store; the others read it there. The key is new
  // for every world Comm a process makes and for every restart of the group, so a
  // store that outlives them (the launcher's) never hands out a stale id.
  static std::atomic<int> made{0};
  const std::string key =
      "nccl/restart" + std::to_string(env.restart_count) + "/comm" + std::to_string(made++) + "/unique_id";
  // Held until the communicator is up: once init is done on rank 0, every rank has
  // read the id, and rank 0's store may go.
  Rendezvous rendezvous = connect_rendezvous(env, timeout_seconds);
  ncclUniqueId id;
  if (env.rank == 0) {
    NCCL_CHECK(ncclGetUniqueId(&id), nullptr, where);
    rendezvous.client->set(key, std::string(id.internal, sizeof(id.internal)));
  } else {
    const std::string value = rendezvous.client->get(key);
    if (value.size() != sizeof(id.internal)) {
      throw CommError(where + ": the store holds " + std::to_string(value.size()) + " bytes under '" + key +
                      "', not an NCCL id of " + std::to_string(sizeof(id.internal)) +
                      " (hint: do all ranks run the same program?)");
    }
    std::memcpy(id.internal, value.data(), sizeof(id.internal));
  }

  // on the issuing thread, like every call on a communicator (comm.h); held until
  // the Comm holds it, so that the thread made here is the one its operations use
  std::shared_ptr<CommThread> thread = issuing_thread();
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  thread->call([&] {
    try {
      // NCCL binds the communicator to the current GPU of the thread that makes it
      CUDA_CHECK(cudaSetDevice(device_index), where);
      ncclConfig_t config = nonblocking_config();
      NCCL_CHECK(ncclCommInitRankConfig(&comm, env.world_size, id, env.rank, &config), comm, where);
      wait_for(comm, timeout_seconds, where);
      // non-blocking stream: it does not wait for the legacy default stream, nor it for us
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), where);
    } catch (const CommError&) {
      if (comm != nullptr) (void)ncclCommAbort(comm);  // already failing: the first error is the one reported
      throw;
    }
  });
  return std::make_unique<NcclComm>(comm, stream, device_index, env.rank, env.world_size, timeout_seconds);
}

}  // namespace course
