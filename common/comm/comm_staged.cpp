// Host staging (comm_staged.h): device buffers copied to host memory, the host
// backend's operation run there, the results copied back. The copies are the
// device's (a Copier): the GPU's through pinned memory on a stream of its own, the
// guarded device's by opening its arena.
#include "common/comm/comm_staged.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "common/comm/test_faults.h"
#include "common/tensor/guarded_device.h"
#ifdef COURSE_HAVE_CUDA
#include <cuda_runtime.h>

#include "common/comm/cuda_ticket.h"
#endif

namespace course {

namespace {

// Staged buffers start on this boundary in the staging buffer (DMA likes it).
constexpr size_t kAlignment = 256;

// One buffer of an operation, as the staging sees it: bytes, whatever their type.
struct Slot {
  void* user;            // the caller's pointer
  size_t bytes;
  bool read;             // the operation reads it: copied to the host before
  bool written;          // the operation writes it: copied back after
  void* host = nullptr;  // what the host backend gets: `user` itself when that is host memory
  bool staged = false;
  size_t offset = 0;     // in the staging buffer
};

// The slot of `count` elements of T at `data`
template <typename T>
Slot slot_of(const T* data, size_t count, bool read, bool written) {
  return Slot{const_cast<T*>(data), count * sizeof(T), read, written};
}
float* host_floats(const Slot& slot) { return static_cast<float*>(slot.host); }

// How one device's buffers reach the host and come back. Runs on the comm thread.
class Copier {
 public:
  virtual ~Copier() = default;
  // On the issuing thread, as the operation is queued: what orders it after the compute.
  virtual std::shared_ptr<OpTicket> ticket(const std::string& where) = 0;
  // Whether `data` is this device's memory (staged) rather than the host's (used in place).
  virtual bool on_device(const void* data, const std::string& where) = 0;
  // A host staging buffer of at least `bytes`, kept for later operations.
  virtual char* reserve(size_t bytes, const std::string& where) = 0;
  // Before the host backend runs: the read slots copied to the host once the compute
  // queued before the operation has run (with no staged slot, only that wait).
  virtual void copy_in(const std::vector<Slot>& slots, OpTicket* ticket, const std::string& where) = 0;
  // After it: the written slots copied back, landed before the Work is done.
  virtual void copy_out(const std::vector<Slot>& slots, const std::string& where) = 0;
  // A sub-communicator's copier: its own stream and staging buffer.
  virtual std::unique_ptr<Copier> for_group() const = 0;
};

// The guarded device: its ops ran before the operation was issued (they are the
// CPU's, synchronous), so a copy is the arena opened for a memcpy.
class GuardedCopier : public Copier {
 public:
  std::shared_ptr<OpTicket> ticket(const std::string&) override { return nullptr; }
  bool on_device(const void* data, const std::string&) override { return guarded::contains(data); }
  char* reserve(size_t bytes, const std::string&) override {
    if (staging_.size() < bytes) staging_.resize(bytes);
    return staging_.data();
  }
  void copy_in(const std::vector<Slot>& slots, OpTicket*, const std::string&) override { copy(slots, true); }
  void copy_out(const std::vector<Slot>& slots, const std::string&) override { copy(slots, false); }
  std::unique_ptr<Copier> for_group() const override { return std::make_unique<GuardedCopier>(); }

 private:
  void copy(const std::vector<Slot>& slots, bool in) {
    guarded::Open open;
    for (const Slot& slot : slots) {
      if (!slot.staged || !(in ? slot.read : slot.written)) continue;
      if (in) {
        std::memcpy(slot.host, slot.user, slot.bytes);
      } else {
        std::memcpy(slot.user, slot.host, slot.bytes);
      }
    }
  }
  std::vector<char> staging_;
};

#ifdef COURSE_HAVE_CUDA
// Every CUDA call here names the rank and operation, the call and CUDA's words.
#define STAGING_CHECK(call, where) check_comm_cuda((call), #call, (where) + ", staging through the host")

// The GPU: pinned host memory, copies on a stream of the copier's own, ordered after
// the compute by the event the issuing thread recorded (cuda_ticket.h).
class CudaCopier : public Copier {
 public:
  explicit CudaCopier(int device) : device_(device), events_(std::make_shared<EventPool>(device)) {}
  ~CudaCopier() override {
    // a destructor cannot throw, and there is nothing left to wait for
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    if (pinned_ != nullptr) (void)cudaFreeHost(pinned_);
  }
  std::shared_ptr<OpTicket> ticket(const std::string& where) override {
    return std::make_shared<CudaTicket>(where, events_);
  }
  bool on_device(const void* data, const std::string& where) override;
  char* reserve(size_t bytes, const std::string& where) override;
  void copy_in(const std::vector<Slot>& slots, OpTicket* ticket, const std::string& where) override;
  void copy_out(const std::vector<Slot>& slots, const std::string& where) override;
  std::unique_ptr<Copier> for_group() const override { return std::make_unique<CudaCopier>(device_); }

 private:
  int device_;                     // the GPU of the compute stream and of the buffers
  std::shared_ptr<EventPool> events_;  // the tickets' events
  cudaStream_t stream_ = nullptr;  // the copies' stream; made on the comm thread on first use
  char* pinned_ = nullptr;         // the staging buffer, page-locked; grown to the largest operation
  size_t pinned_bytes_ = 0;
};

// Device (or managed) memory is staged; host memory, pinned or not, is used in place.
bool CudaCopier::on_device(const void* data, const std::string& where) {
  STAGING_CHECK(cudaSetDevice(device_), where);  // a per-thread setting: this is the comm thread
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, data);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky, but leave no error behind
    check_comm_cuda(status, "cudaPointerGetAttributes", where + ", staging through the host");
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

char* CudaCopier::reserve(size_t bytes, const std::string& where) {
  if (stream_ == nullptr) STAGING_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), where);
  if (bytes <= pinned_bytes_) return pinned_;
  // the stream is idle (every operation ends synchronised), so the old buffer can go
  if (pinned_ != nullptr) STAGING_CHECK(cudaFreeHost(pinned_), where);
  pinned_ = nullptr;
  pinned_bytes_ = 0;
  const size_t megabyte = size_t{1} << 20;
  const size_t size = (bytes + megabyte - 1) / megabyte * megabyte;
  void* block = nullptr;
  const cudaError_t status = cudaMallocHost(&block, size);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    check_comm_cuda(status, "cudaMallocHost", where + ", staging through the host",
                    "no page-locked host memory left for the staging buffer: use smaller buckets or fewer ranks "
                    "per machine, or nccl with a GPU per rank");
  }
  pinned_ = static_cast<char*>(block);
  pinned_bytes_ = size;
  return pinned_;
}

void CudaCopier::copy_in(const std::vector<Slot>& slots, OpTicket* ticket, const std::string& where) {
  auto* cuda_ticket = dynamic_cast<CudaTicket*>(ticket);
  bool any_staged = false;
  for (const Slot& slot : slots) any_staged = any_staged || slot.staged;
  if (!any_staged) {
    // host buffers only: a pinned one may still be written by compute queued before the
    // operation was issued, so the host backend reads it only after that has run
    if (cuda_ticket != nullptr) STAGING_CHECK(cudaEventSynchronize(cuda_ticket->ready), where);
    return;
  }
  // The copies start, on the GPU, once the compute queued before the operation was
  // issued has run (the event recorded then, on the issuing thread). The copies
  // back are on the same stream, so they too come after it.
  if (cuda_ticket != nullptr) STAGING_CHECK(cudaStreamWaitEvent(stream_, cuda_ticket->ready, 0), where);
  for (const Slot& slot : slots) {
    if (slot.staged && slot.read) {
      STAGING_CHECK(cudaMemcpyAsync(slot.host, slot.user, slot.bytes, cudaMemcpyDefault, stream_),
                    where);
    }
  }
  STAGING_CHECK(cudaStreamSynchronize(stream_), where);
}

void CudaCopier::copy_out(const std::vector<Slot>& slots, const std::string& where) {
  for (const Slot& slot : slots) {
    if (slot.staged && slot.written) {
      STAGING_CHECK(cudaMemcpyAsync(slot.user, slot.host, slot.bytes, cudaMemcpyDefault, stream_),
                    where);
    }
  }
  // landed before the Work is done: whatever is queued after wait() sees it
  STAGING_CHECK(cudaStreamSynchronize(stream_), where);
}

#undef STAGING_CHECK
#endif  // COURSE_HAVE_CUDA

class StagedComm : public Comm {
 public:
  // device_only: refuse host memory as nccl does (the guarded device's stand-in for
  // nccl's rules on a CPU machine: COURSE_TEST_FAULT=device_only_comm=1)
  StagedComm(std::unique_ptr<Comm> inner, std::unique_ptr<Copier> copier, Device device_only = Device::CPU)
      : Comm(inner->rank(), inner->size(), inner->timeout_seconds()),
        inner_(std::move(inner)),
        copier_(std::move(copier)),
        device_only_(device_only) {}
  ~StagedComm() override {
    stop_thread();   // every operation issued has run: no copy is in flight
    inner_.reset();  // the host backend's thread stops here
  }

  // "tcp+staged", and "tcp+staged over 2 sites ..." behind a simulated link (wan_link.h)
  std::string backend() const override {
    std::string name = inner_->backend();
    return name.insert(std::min(name.find(' '), name.size()), "+staged");
  }

 protected:
  Device device_only() const override { return device_only_; }
  bool is_host_memory(const float* data) const override {
    return data != nullptr && !copier_->on_device(data, describe("is_host_memory"));
  }
  std::shared_ptr<OpTicket> issue_ticket(const std::string& operation) override {
    return copier_->ticket(describe(operation));
  }
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
  // Runs `operation` (a blocking call on inner_ with the slots' host pointers) with
  // the device slots staged: copied in before, copied back after. Adds the host
  // backend's bytes to `stats`.
  void staged(const std::string& where, std::vector<Slot>& slots, OpStats& stats,
              const std::function<void()>& operation);

  std::unique_ptr<Comm> inner_;
  std::unique_ptr<Copier> copier_;
  Device device_only_;
};

void StagedComm::staged(const std::string& where, std::vector<Slot>& slots, OpStats& stats,
                        const std::function<void()>& operation) {
  // which buffers are device memory, and where each one goes in the staging buffer
  size_t bytes_needed = 0;
  bool copies_back = false;
  for (Slot& slot : slots) {
    slot.host = slot.user;
    if (slot.user == nullptr || slot.bytes == 0) continue;
    if (!copier_->on_device(slot.user, where)) {
      if (device_only_ != Device::CPU) {  // as nccl's check_device_memory says it
        throw CommError(where + ": a buffer is host memory, but this backend (playing nccl: device_only_comm) " +
                        "takes device memory (hint: keep it in a Buffer on the device)");
      }
      continue;
    }
    slot.staged = true;
    slot.offset = bytes_needed;
    bytes_needed += (slot.bytes + kAlignment - 1) / kAlignment * kAlignment;
    copies_back = copies_back || slot.written;
  }
  if (bytes_needed > 0) {
    char* staging = copier_->reserve(bytes_needed, where);
    for (Slot& slot : slots) {
      if (slot.staged) slot.host = staging + slot.offset;
    }
  }
  copier_->copy_in(slots, running_ticket(), where);

  // the host backend's operation; its counters say what went on the wire
  const OpStats before = inner_->total_stats();
  operation();
  const OpStats after = inner_->total_stats();
  stats.bytes_sent += after.bytes_sent - before.bytes_sent;
  stats.bytes_received += after.bytes_received - before.bytes_received;

  if (copies_back) copier_->copy_out(slots, where);
}

// Calls body(T*) with the host copy's pointer in the elements' own type, float or
// bf16, so that the host backend's overload for that type runs.
template <typename Body>
void as_elements(DType type, void* host, Body body) {
  if (type == DType::BF16) {
    body(static_cast<bf16*>(host));
  } else {
    body(static_cast<float*>(host));
  }
}

void StagedComm::do_all_reduce(void* data, size_t count, DType type, ReduceOp op, OpStats& stats) {
  std::vector<Slot> slots = {{data, count * dtype_bytes(type), /*read=*/true, /*written=*/true}};
  staged(describe("all_reduce"), slots, stats, [&] {
    as_elements(type, slots[0].host, [&](auto* host) { inner_->all_reduce(host, count, op); });
  });
}

void StagedComm::do_reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                                   ReduceOp op, OpStats& stats) {
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  const size_t element = dtype_bytes(type);
  // in place (out is this rank's block of in) or not, in and out get places of their own
  std::vector<Slot> slots = {{const_cast<void*>(in), total * element, true, false},
                             {out, counts[rank()] * element, false, true}};
  staged(describe("reduce_scatter"), slots, stats, [&] {
    as_elements(type, slots[0].host, [&](auto* host_in) {
      inner_->reduce_scatter(host_in, static_cast<decltype(host_in)>(slots[1].host), counts, op);
    });
  });
}

void StagedComm::do_all_gather(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                               OpStats& stats) {
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  const size_t element = dtype_bytes(type);
  std::vector<Slot> slots = {{const_cast<void*>(in), counts[rank()] * element, true, false},
                             {out, total * element, false, true}};
  staged(describe("all_gather"), slots, stats, [&] {
    as_elements(type, slots[0].host, [&](auto* host_in) {
      inner_->all_gather(host_in, static_cast<decltype(host_in)>(slots[1].host), counts);
    });
  });
}

// Compiled, but it has never run on a GPU (no machine of the course's had one when it
// was written): test_comm_cuda's staged case is its first test.
void StagedComm::do_all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                               const std::vector<size_t>& recv_counts, DType type, OpStats& stats) {
  const size_t sent = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
  const size_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  const size_t element = dtype_bytes(type);
  std::vector<Slot> slots = {{const_cast<void*>(in), sent * element, true, false},
                             {out, received * element, false, true}};
  staged(describe("all_to_all"), slots, stats, [&] {
    as_elements(type, slots[0].host, [&](auto* host_in) {
      inner_->all_to_all(host_in, send_counts, static_cast<decltype(host_in)>(slots[1].host), recv_counts);
    });
  });
}

void StagedComm::do_broadcast(float* data, size_t count, int root, OpStats& stats) {
  // the root's data goes out, the others' comes in
  const bool is_root = rank() == root;
  std::vector<Slot> slots = {slot_of(data, count, is_root, !is_root)};
  staged(describe("broadcast from rank " + std::to_string(root)), slots, stats,
         [&] { inner_->broadcast(host_floats(slots[0]), count, root); });
}

void StagedComm::do_send_recv(const void* send_data, size_t send_count, int to, void* recv_data,
                              size_t recv_count, int from, DType type, OpStats& stats) {
  std::string what;
  if (to >= 0) what = "send to rank " + std::to_string(to);
  if (from >= 0) what += std::string(what.empty() ? "" : ", ") + "recv from rank " + std::to_string(from);
  const size_t element = dtype_bytes(type);
  std::vector<Slot> slots = {{const_cast<void*>(send_data), to >= 0 ? send_count * element : 0, true, false},
                             {recv_data, from >= 0 ? recv_count * element : 0, false, true}};
  staged(describe(what), slots, stats, [&] {
    as_elements(type, slots[0].host, [&](auto* host_send) {
      auto* host_recv = static_cast<decltype(host_send)>(slots[1].host);
      if (to >= 0 && from >= 0) {
        inner_->send_recv(host_send, send_count, to, host_recv, recv_count, from);
      } else if (to >= 0) {
        inner_->send(host_send, send_count, to);
      } else if (from >= 0) {
        inner_->recv(host_recv, recv_count, from);
      }
    });
  });
}

void StagedComm::do_barrier(OpStats& stats) {
  std::vector<Slot> none;
  staged(describe("barrier"), none, stats, [&] { inner_->barrier(); });
}

std::unique_ptr<Comm> StagedComm::do_split(int color, int key) {
  // the group's Comm stages too, with a stream and a staging buffer of its own
  std::unique_ptr<Comm> group = inner_->split(color, key);
  if (group == nullptr) return nullptr;
  return std::make_unique<StagedComm>(std::move(group), copier_->for_group(), device_only_);
}

}  // namespace

std::unique_ptr<Comm> stage_through_host(std::unique_ptr<Comm> inner, Device device) {
  if (inner == nullptr) return nullptr;
  if (inner->backend() == "nccl") {
    throw CourseError("stage_through_host: the nccl backend takes device buffers itself (a bug: stage tcp or mpi)");
  }
  if (device == Device::Guarded) {
    return std::make_unique<StagedComm>(std::move(inner), std::make_unique<GuardedCopier>(),
                                        comm_told_device_only() ? Device::Guarded : Device::CPU);
  }
#ifdef COURSE_HAVE_CUDA
  // the GPU the program computes on (select_device picked it), where its buffers are
  if (device == Device::CUDA) {
    return std::make_unique<StagedComm>(std::move(inner), std::make_unique<CudaCopier>(cuda::current_gpu()));
  }
#endif
  throw CourseError(std::string("stage_through_host: nothing stages ") + device_name(device) +
                    " buffers in this build (a bug)");
}

}  // namespace course
