// Comm: one interface over a group of ranks, whatever carries the bytes.
//
//   tcp   the course's own, over sockets: ring algorithms written out (comm_tcp.cpp)
//   mpi   Open MPI, for mpirun / srun and clusters (comm_mpi.cpp)
//   nccl  NCCL on GPUs (comm_nccl.cpp)
//
// Every operation is collective over the group (all ranks call it, in the same
// order) except send/recv. Each Comm runs its operations on a communication
// thread (a CommThread), in the order they were issued: a blocking call is an
// asynchronous call plus wait(), so a chapter can start an all-reduce, keep
// computing, and wait later (overlap), and blocking and asynchronous calls never
// reorder.
//
// One issue order for NCCL. A program has several Comms at once (chapter 07: the
// TP group, the pipeline's neighbours and the DP group, all split from one world).
// NCCL runs each operation as GPU kernels that wait for the peers; NCCL's
// documentation ("Using multiple NCCL communicators concurrently", "Thread
// safety") warns that operations of several communicators on one GPU can deadlock
// unless every rank issues them in one order, from one thread. So the rule is:
//
//   Every call this process makes on an NCCL communicator (making it, splitting
//   it, every operation, taking it down) goes through ONE thread, the nccl
//   issuing thread, shared by every nccl Comm of the process (the world and all
//   its splits), in the order the program queued them. The program is the same on
//   every rank and queues from its one training thread, so every rank issues in
//   the same order (a program that queued from two threads at once would have no
//   one order to keep). NCCL then starts the kernels in that order on the GPU too
//   (comm_nccl.cpp sets NCCL_LAUNCH_ORDER_IMPLICIT=1, NCCL's way to keep the host's
//   order across communicators).
//
// Sharing the thread costs no overlap: for nccl it only queues the kernels and
// moves on; between operations it checks which ones the GPU has finished
// (Comm::finished) and completes their Works.
//
// tcp and mpi (and host staging over them) keep a thread per Comm, and are not
// bound by this rule. Their operations run on the CPU and block in the transport
// until the peers take part, so a shared thread would run one Comm's transfer at a
// time (a grid's row and column operations could no longer overlap). And they need
// no common order: an operation waiting for its peers holds only its own thread,
// sockets or MPI request, which no other Comm's operation needs, whereas NCCL's
// kernels share one GPU.
//
// Every wait has a deadline (--comm-timeout, or COURSE_COMM_TIMEOUT seconds):
// a dead or stuck peer becomes a CommError naming this rank, the operation and
// the peer, never a hang. After an error the Comm is broken: later calls fail fast.
//
// Buffers on the GPU (CUDA builds). Two ways to communicate device buffers:
//
//   nccl              The buffers are handed to NCCL as they are: device memory in,
//                     device memory out, the GPUs talk directly (NVLink, or the network
//                     through GPUDirect). One GPU per rank: NCCL refuses two ranks on
//                     one GPU, so on a one-GPU machine nccl runs at world size 1 only.
//   tcp or mpi +      Any number of ranks sharing one GPU (or none). Each operation
//   host staging      copies its device buffers to pinned host memory, runs the host
//                     backend there, and copies the results back (comm_staged.h).
//                     Slower: every byte crosses PCIe twice on top of the wire. This is
//                     how a one-GPU machine runs several GPU ranks.
//
// CommOptions::buffers says where a program's buffers live; create_world_comm then
// picks the path (nccl when asked for, or by "auto" when every rank on this machine
// has a GPU of its own; host staging otherwise). Either way the ordering against the
// GPU's compute is done for the caller, with CUDA events: an operation sees every op
// the issuing thread queued on the compute stream before it (no synchronisation
// needed first), and once its Work is waited, ops queued after see its results.
// A staged Comm also takes host pointers (a loss on the CPU) and passes them through;
// nccl takes device memory only and says so when handed host memory.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/comm/env.h"
#include "common/comm/socket.h"
#include "common/comm/wan_link.h"
#include "common/tensor/bf16.h"    // bf16, DType
#include "common/tensor/memory.h"  // Device

namespace course {

// Max: the element-wise maximum (tensor parallelism's cross-entropy takes the
// largest logit over the ranks' vocabulary slices with it).
enum class ReduceOp { Sum, Average, Max };

// What one kind of operation has cost so far on this rank.
struct OpStats {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0;      // payload bytes this rank put on the wire
  uint64_t bytes_received = 0;  // payload bytes this rank took off it
  double seconds = 0.0;         // wall time inside the operation on the comm thread
};
// What was done between two readings of the counters (`before` the earlier), and a
// running total of such differences.
inline OpStats operator-(const OpStats& now, const OpStats& before) {
  return {now.calls - before.calls, now.bytes_sent - before.bytes_sent, now.bytes_received - before.bytes_received,
          now.seconds - before.seconds};
}
inline OpStats& operator+=(OpStats& total, const OpStats& more) {
  total.calls += more.calls;
  total.bytes_sent += more.bytes_sent;
  total.bytes_received += more.bytes_received;
  total.seconds += more.seconds;
  return total;
}

// What an operation carries from the thread that issues it, through the comm
// thread, to the thread that waits for it. The backends that take device buffers
// (nccl, host staging) keep CUDA events in theirs (Comm::issue_ticket); the host
// backends have none.
class OpTicket {
 public:
  virtual ~OpTicket() = default;
  // On the thread that waits, once the operation has succeeded, before wait()
  // returns. Throws CommError.
  virtual void after_wait() {}
};

// When an operation ran, in now_seconds()'s clock (common/train/metrics.h): from when its
// communication thread started it (or, when it had to wait for the Comm's previous
// operation, when that one finished) to when the thread saw it finished. For tcp
// and mpi the thread runs it in between; for nccl it queues the kernels, then sees
// their `done` event complete in a later poll (so the end can be late by a poll,
// up to 50 us). A trace draws it: an asynchronous operation's span is when it
// really ran, not when it was issued or waited for, and one Comm's spans never
// overlap.
struct OpInterval {
  double start = 0.0;
  double end = 0.0;
  double issued = 0.0;  // when the issuing thread posted it (at or before start)
};

// A handle to an operation in flight. wait() returns when it is done, or throws
// the CommError that ended it. A Work that is destroyed without wait() waits.
// An operation's failure: its message ("" when it succeeded), and whether another
// rank reports its cause (EchoedCommError): then neither wait() nor a dropped Work prints it.
struct CommFailure {
  std::string message;
  bool echoed = false;
};

class Work {
 public:
  Work() = default;
  ~Work();
  Work(Work&&) noexcept = default;
  Work& operator=(Work&&) noexcept;
  // Returns when the operation ran; {0, 0} for an empty Work (default-made or already waited).
  OpInterval wait();
  bool done() const;

 private:
  friend class Comm;
  struct State;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  void wait_and_report();
  std::shared_ptr<State> state_;
};

// The thread a Comm's operations run on. It runs the tasks posted to it one at a
// time, in the order posted. Operations that a task started but that finish later
// (nccl's kernels on the GPU) are watched: between tasks, and while it has none,
// the thread calls each watch until it says the operation is over. Shared by the
// Comms that hold it (nccl's: the issue-order rule above); it stops once the last
// one lets go, after running what was posted.
class CommThread {
 public:
  CommThread();
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  // from any thread
  void post(std::function<void()> task);
  // Runs `work` on this thread, after what was posted before, and returns when it
  // has run, throwing what it threw. Not from this thread itself (it would wait for itself).
  void call(const std::function<void()>& work);
  // From a task on this thread only: `poll` is called on this thread, oldest watch
  // first, until it returns true.
  void watch(std::function<bool()> poll);

 private:
  void run();
  void poll_watched();

  std::mutex mutex_;
  std::condition_variable posted_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::function<bool()>> watched_;  // this thread's only
  std::thread thread_;  // last: starts once the members above exist
};

class Comm {
 public:
  static constexpr size_t kMaxHostValues = 1024;  // floats: more is a tensor in the wrong place
  virtual ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // this process's rank in the world Comm that this one was split from (its own rank if not split)
  int world_rank() const { return world_rank_ >= 0 ? world_rank_ : rank_; }
  double timeout_seconds() const { return timeout_seconds_; }
  virtual std::string backend() const = 0;

  // ---- blocking operations -------------------------------------------------
  // data[i] = op over ranks of data[i], on every rank. all_reduce, all_gather and
  // broadcast take a few host values (up to kMaxHostValues floats: a loss, a gradient
  // norm, the rank table's figures) on every backend, nccl included: they cross
  // through a small buffer on its device.
  void all_reduce(float* data, size_t count, ReduceOp op = ReduceOp::Sum);
  // The three reductions' data also in bf16: half the bytes on the wire. Every
  // backend adds two bf16 values in fp32 and rounds the sum once (a ring rounds at
  // each hop, as NCCL does); Average divides in fp32 too, after the sum (on nccl as
  // well: nccl_average.h).
  void all_reduce(bf16* data, size_t count, ReduceOp op = ReduceOp::Sum);
  // in: sum(counts) floats, rank r's block at offset sum(counts[0..r));
  // out: counts[rank] floats = op over ranks of this rank's block
  void reduce_scatter(const float* in, float* out, const std::vector<size_t>& counts, ReduceOp op = ReduceOp::Sum);
  void reduce_scatter(const float* in, float* out, size_t count_per_rank, ReduceOp op = ReduceOp::Sum);
  void reduce_scatter(const bf16* in, bf16* out, const std::vector<size_t>& counts, ReduceOp op = ReduceOp::Sum);
  // in: counts[rank] floats; out: sum(counts) floats, rank r's block at offset sum(counts[0..r))
  // (in place is allowed: in == out + offset of this rank's block; so is reduce_scatter's
  // out being this rank's block of in. Other overlaps are not.)
  void all_gather(const float* in, float* out, const std::vector<size_t>& counts);
  void all_gather(const float* in, float* out, size_t count_per_rank);
  void all_gather(const bf16* in, bf16* out, const std::vector<size_t>& counts);
  // Every rank sends a block to every rank (itself included) and receives one from each:
  // in: sum(send_counts) floats, the block for rank r at offset sum(send_counts[0..r));
  // out: sum(recv_counts) floats, the block from rank r at offset sum(recv_counts[0..r)).
  // send_counts[r] on this rank must equal recv_counts[this rank] on rank r (the tcp
  // backend checks and names both counts; mpi and nccl cannot, and fail or hang until
  // the deadline). in and out must not overlap. Context parallelism's Ulysses attention
  // (chapter 08) turns a sequence split into a head split with it; expert parallelism
  // (chapter 09) sends each token to its expert's rank.
  void all_to_all(const float* in, const std::vector<size_t>& send_counts, float* out,
                  const std::vector<size_t>& recv_counts);
  // count_per_rank floats to and from every rank: in and out both hold size() blocks
  void all_to_all(const float* in, float* out, size_t count_per_rank);
  // the same in bf16: 2-byte values, moved as they are (chapter 08's and 09's
  // activations under --dtype bf16)
  void all_to_all(const bf16* in, const std::vector<size_t>& send_counts, bf16* out,
                  const std::vector<size_t>& recv_counts);
  // data on every rank = data on root
  void broadcast(float* data, size_t count, int root);
  void send(const float* data, size_t count, int peer);
  void recv(float* data, size_t count, int peer);
  // The point-to-point operations also move bf16: `count` 2-byte values, half the bytes
  // of fp32's (a pipeline's activations under --dtype bf16). Nothing is added, so
  // nothing is rounded: what arrives is what was sent.
  void send(const bf16* data, size_t count, int peer);
  void recv(bf16* data, size_t count, int peer);
  // sends to one peer while receiving from another (a ring shift, a pipeline exchange)
  void send_recv(const float* send_data, size_t send_count, int to, float* recv_data, size_t recv_count, int from);
  void send_recv(const bf16* send_data, size_t send_count, int to, bf16* recv_data, size_t recv_count, int from);
  void barrier();
  // A new Comm over the ranks that pass the same color, ordered by (key, rank).
  // Collective over this Comm. A negative color joins no group and gets nullptr.
  std::unique_ptr<Comm> split(int color, int key);

  // ---- asynchronous operations: the buffers must stay alive, and neither the
  // ---- program nor a kernel it queues may write them, until wait() -----------
  Work all_reduce_async(float* data, size_t count, ReduceOp op = ReduceOp::Sum);
  Work all_reduce_async(bf16* data, size_t count, ReduceOp op = ReduceOp::Sum);
  Work reduce_scatter_async(const float* in, float* out, const std::vector<size_t>& counts,
                            ReduceOp op = ReduceOp::Sum);
  Work reduce_scatter_async(const bf16* in, bf16* out, const std::vector<size_t>& counts,
                            ReduceOp op = ReduceOp::Sum);
  Work all_gather_async(const float* in, float* out, const std::vector<size_t>& counts);
  Work all_gather_async(const bf16* in, bf16* out, const std::vector<size_t>& counts);
  Work all_to_all_async(const float* in, const std::vector<size_t>& send_counts, float* out,
                        const std::vector<size_t>& recv_counts);
  Work all_to_all_async(const float* in, float* out, size_t count_per_rank);
  Work all_to_all_async(const bf16* in, const std::vector<size_t>& send_counts, bf16* out,
                        const std::vector<size_t>& recv_counts);
  Work broadcast_async(float* data, size_t count, int root);
  Work send_async(const float* data, size_t count, int peer);
  Work recv_async(float* data, size_t count, int peer);
  Work send_async(const bf16* data, size_t count, int peer);
  Work recv_async(bf16* data, size_t count, int peer);
  // both directions at once: a ring's hop (context parallelism's keys and values) in flight while computing
  Work send_recv_async(const float* send_data, size_t send_count, int to, float* recv_data, size_t recv_count,
                       int from);
  Work send_recv_async(const bf16* send_data, size_t send_count, int to, bf16* recv_data, size_t recv_count,
                       int from);

  // ---- counters (read them when nothing is in flight) ----------------------
  std::map<std::string, OpStats> stats() const;
  OpStats total_stats() const;
  void reset_stats();

 protected:
  // `thread`: the communication thread to share (nccl's issuing thread); null makes
  // one of the Comm's own.
  Comm(int rank, int size, double timeout_seconds, std::shared_ptr<CommThread> thread = nullptr);
  // Each backend's own code. They run on the communication thread, one at a
  // time, in issue order; they record what they send and receive in `stats`.
  // The reductions take their elements' type: `count` and `counts` are elements of
  // it (fp32 or bf16), and the pointers point at them.
  virtual void do_all_reduce(void* data, size_t count, DType type, ReduceOp op, OpStats& stats) = 0;
  virtual void do_reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                                 ReduceOp op, OpStats& stats) = 0;
  virtual void do_all_gather(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                             OpStats& stats) = 0;
  // bytes_sent and bytes_received count the blocks to and from other ranks, not its own
  virtual void do_all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                             const std::vector<size_t>& recv_counts, DType type, OpStats& stats) = 0;
  virtual void do_broadcast(float* data, size_t count, int root, OpStats& stats) = 0;
  // to/from -1: that direction is skipped; counts are values of `type`
  virtual void do_send_recv(const void* send_data, size_t send_count, int to, void* recv_data, size_t recv_count,
                            int from, DType type, OpStats& stats) = 0;
  virtual void do_barrier(OpStats& stats) = 0;
  virtual std::unique_ptr<Comm> do_split(int color, int key) = 0;
  // A backend that reads device memory only (nccl): its device, and whether `data`
  // is host memory it cannot read. The default: Device::CPU, a backend that reads
  // host memory (tcp and mpi; the staged Comm, which copies device buffers itself).
  virtual Device device_only() const { return Device::CPU; }
  virtual bool is_host_memory(const float* /*data*/) const { return false; }
  // Called on the issuing thread as each operation is queued (the default: no
  // ticket). What it returns reaches the operation on the comm thread
  // (running_ticket()) and the thread that waits (OpTicket::after_wait). The nccl
  // and staging backends record an event on the compute stream here: it marks the
  // GPU work the operation must wait for, which only the issuing thread knows.
  virtual std::shared_ptr<OpTicket> issue_ticket(const std::string& operation);
  // The ticket of the operation running now (comm thread only, inside do_*).
  OpTicket* running_ticket() const { return running_ticket_; }
  // On the comm thread, after do_* returned: whether the operation that ran with
  // `ticket` has finished. The host backends finish inside do_*: the default says
  // yes. nccl's do_* only queue kernels on the GPU; its finished() checks their
  // `done` event and NCCL's error state, and is called again between later
  // operations until it says yes or throws a CommError (an error, or the deadline:
  // timeout_seconds() after `started`, in now_seconds()'s clock). A Comm's
  // operations finish in issue order.
  virtual bool finished(OpTicket* ticket, double started);
  // Backends call this first in their destructor, while their members are still
  // alive: it waits until every operation issued has finished, runs `last` (if
  // given) on the comm thread, and lets go of the thread (stopping it if no other
  // Comm shares it).
  void stop_thread(const std::function<void()>& last = nullptr);
  // "rank 2 all_reduce" for error messages
  std::string describe(const std::string& operation) const;

 private:
  struct Started;  // an operation the comm thread has started (comm.cpp)
  Work enqueue(const std::string& name, std::function<void(OpStats&)> operation);
  void run_operation(const std::shared_ptr<Work::State>& state, const std::string& name,
                     const std::function<void(OpStats&)>& operation);
  bool poll_started(const Started& started);
  void finish(const Started& started, const CommFailure& error);
  void complete(Work::State& state, const CommFailure& error, OpInterval ran);
  CommFailure broken() const;
  void check_all_to_all(const void* in, const std::vector<size_t>& send_counts, const void* out,
                        const std::vector<size_t>& recv_counts, size_t element) const;
  // Whether `data` is host values a device_only backend gets through a device buffer
  bool carries_host_values(const float* data, size_t count) const;
  // `collective` run on a copy of the host values on device_only()'s device, copied back after
  void through_device(float* data, size_t count, const std::function<void(float* on_device)>& collective);

  int rank_;
  int size_;
  int world_rank_ = -1;  // set by split()
  double timeout_seconds_;
  mutable std::mutex mutex_;
  std::condition_variable all_finished_;
  int unfinished_ = 0;  // operations issued whose Work is not yet complete
  CommFailure broken_;  // the first error; later operations fail fast with it
  std::map<std::string, OpStats> stats_;
  // comm thread only:
  OpTicket* running_ticket_ = nullptr;
  uint64_t watches_started_ = 0;   // operations handed to watch, in issue order
  uint64_t watches_finished_ = 0;  // of those, finished: the next to finish is this one
  double last_end_ = 0.0;          // when the previous operation finished (OpInterval)
  std::shared_ptr<CommThread> thread_;
};

struct CommOptions {
  std::string backend = "auto";    // auto | tcp | mpi | nccl
  float timeout_seconds = 300;     // --comm-timeout / COURSE_COMM_TIMEOUT
  int device_index = -1;           // nccl: the GPU to use; -1 = gpu_for_rank (env.h)
  Device buffers = Device::CPU;    // where the program's buffers live (its --device)
  WanOptions wan;                  // --sites, --wan-bandwidth, --wan-latency (tcp only: wan_link.h)
};

// The Comm over all ranks of the job, for the backend asked for, taking buffers
// where options.buffers says:
//
//   buffers   backend    what you get
//   CPU       auto       mpi under mpirun/srun (when built with MPI), else tcp
//   CPU       tcp, mpi   that backend, on host memory
//   CUDA      nccl       NCCL on device memory (CUDA builds with NCCL; one GPU per rank)
//   CUDA      auto       nccl when built with it and this machine has a GPU for each of
//                        its ranks (and, with several ranks, MASTER_ADDR/PORT for the
//                        id); else what auto picks on the CPU, staged through the host
//   CUDA      tcp, mpi   that backend staged through the host (stage_through_host):
//                        device pointers are copied to pinned memory and back; backend()
//                        says "tcp+staged" / "mpi+staged"
//   Guarded   auto, tcp, mpi  as for CPU, staged through the host as CUDA is (the test
//                        device of common/tensor/guarded_device.h); nccl is refused
//
// nccl with CPU buffers is allowed (a program that manages device memory itself),
// but every buffer must be device memory. Rendezvous for tcp and nccl goes through
// the store at MASTER_ADDR (hosted by the launcher, or by rank 0 when no launcher
// hosts one: env.h). UsageError: CUDA buffers in a build without CUDA.
std::unique_ptr<Comm> create_world_comm(const LaunchEnv& env, const CommOptions& options);

// The default timeout: COURSE_COMM_TIMEOUT if set (UsageError if malformed), else 300 s.
double default_comm_timeout();

// --backend, --comm-timeout and the simulated wide-area link's --sites, --wan-bandwidth
// and --wan-latency: the flags every communicating program takes.
class ArgParser;
void add_comm_flags(ArgParser& parser, CommOptions& options);

// The backends' factories (each in its own file).
std::unique_ptr<Comm> create_tcp_comm(const LaunchEnv& env, double timeout_seconds, const WanLayout& wan = {});
// A tcp group of some of the job's ranks, for a program whose groups change while it
// runs (workers that die and come back: chapter 10's fault-tolerant DiLoCo). `members`
// are world ranks in the group's rank order, this process among them; they meet
// through the job's store under `key_prefix`, which no other group may use. Unlike
// split, nothing is collective over a parent group, which might hold the dead. `wan`
// is the world's layout: a link crosses sites as the members' world ranks say.
std::unique_ptr<Comm> create_tcp_group(const LaunchEnv& env, const std::vector<int>& members,
                                       const std::string& key_prefix, double timeout_seconds, const WanLayout& wan = {});
bool mpi_available();
std::unique_ptr<Comm> create_mpi_comm(double timeout_seconds);

}  // namespace course
