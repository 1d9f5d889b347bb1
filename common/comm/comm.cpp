#include "common/comm/comm.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <numeric>

#include "common/comm/flags.h"
#include "common/comm/comm_util.h"
#include "common/comm/store.h"
#include "common/tensor/device.h"
#include "common/tensor/clock.h"
#include "common/comm/comm_staged.h"
#ifdef COURSE_HAVE_NCCL
#include "common/comm/nccl.h"
#endif

namespace course {

// ----------------------------------------------------------------------------
// Work: the shared state between the issuing thread and the comm thread

struct Work::State {
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  double issued = 0.0;  // now_seconds() when posted
  OpInterval ran;     // set by the comm thread with `done`
  CommFailure error;  // no message when the operation succeeded
  bool not_started = false;  // refused because an earlier operation had failed
  std::shared_ptr<OpTicket> ticket;  // the backend's, or null
};

// A Work dropped without wait() still waits; its error is printed, because if it
// was the last operation nothing else would ever report it. Not the error of one
// that never started because an earlier operation had failed: that failure is
// reported where it happened, and once is enough.
void Work::wait_and_report() {
  const std::shared_ptr<State> state = state_;
  try {
    wait();
  } catch (const CommError& error) {
    if (!state->not_started && !state->error.echoed) std::fprintf(stderr, "%s (from an operation whose Work was never waited on)\n", error.what());
  }
}

Work::~Work() {
  if (state_ != nullptr) wait_and_report();
}

Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    if (state_ != nullptr) wait_and_report();
    state_ = std::move(other.state_);
  }
  return *this;
}

OpInterval Work::wait() {
  if (state_ == nullptr) return {};
  std::shared_ptr<State> state = std::move(state_);
  {
    std::unique_lock<std::mutex> lock(state->mutex);
    // no deadline here: the operation enforces the timeout itself, and fails
    state->finished.wait(lock, [&] { return state->done; });
    if (state->error.echoed) throw EchoedCommError(state->error.message);
    if (!state->error.message.empty()) throw CommError(state->error.message);
  }
  // on this (the waiting) thread: e.g. nccl makes the compute stream wait for the result
  if (state->ticket != nullptr) state->ticket->after_wait();
  OpInterval ran = state->ran;
  ran.issued = state->issued;
  return ran;
}

bool Work::done() const {
  if (state_ == nullptr) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

// ----------------------------------------------------------------------------
// the communication thread

CommThread::CommThread() : thread_([this] { run(); }) {}

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  posted_.notify_all();
  thread_.join();
}

void CommThread::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  posted_.notify_all();
}

void CommThread::call(const std::function<void()>& work) {
  auto ran = std::make_shared<std::promise<void>>();
  std::future<void> result = ran->get_future();
  post([&work, ran] {
    try {
      work();
      ran->set_value();
    } catch (...) {
      ran->set_exception(std::current_exception());
    }
  });
  result.get();
}

void CommThread::watch(std::function<bool()> poll) { watched_.push_back(std::move(poll)); }

// With operations in flight and no task to run, the thread polls this many times in
// a row at full speed (a small operation is over within them), then every
// kPollInterval, leaving the core to others.
constexpr int kFastPolls = 1000;
constexpr auto kPollInterval = std::chrono::microseconds(50);

void CommThread::run() {
  int idle_polls = 0;  // polls since the last task
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      const auto has_task = [&] { return !tasks_.empty(); };
      if (watched_.empty()) {
        posted_.wait(lock, [&] { return stopping_ || has_task(); });
        if (!has_task()) return;  // stopping, and every task has run and every watch is over
      } else if (!has_task() && idle_polls >= kFastPolls) {
        posted_.wait_for(lock, kPollInterval, has_task);
      }
      if (has_task()) {
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
    }
    if (task) {
      task();
      idle_polls = 0;
    } else {
      idle_polls++;
    }
    poll_watched();
  }
}

void CommThread::poll_watched() {
  for (size_t i = 0; i < watched_.size();) {
    if (watched_[i]()) {
      watched_.erase(watched_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      i++;
    }
  }
}

// ----------------------------------------------------------------------------
// a Comm's operations on that thread

// An operation the comm thread has started, until it finishes.
struct Comm::Started {
  std::shared_ptr<Work::State> state;
  std::string name;
  double start = 0.0;  // now_seconds()
  OpStats stats;       // what do_* recorded
  uint64_t watch = 0;  // its place among this Comm's watched operations
};

Comm::Comm(int rank, int size, double timeout_seconds, std::shared_ptr<CommThread> thread)
    : rank_(rank),
      size_(size),
      timeout_seconds_(timeout_seconds),
      thread_(thread != nullptr ? std::move(thread) : std::make_shared<CommThread>()) {}

Comm::~Comm() { stop_thread(); }

void Comm::stop_thread(const std::function<void()>& last) {
  std::shared_ptr<CommThread> thread;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    all_finished_.wait(lock, [&] { return unfinished_ == 0; });
    thread = std::move(thread_);
  }
  if (thread == nullptr || !last) return;  // already stopped, or nothing to run last
  // a destructor calls this: failures are said on stderr
  try {
    thread->call(last);
  } catch (const std::exception& failure) {
    std::fprintf(stderr, "%s\n", failure.what());
  }
}  // the last Comm to let go of its thread stops it here

std::string Comm::describe(const std::string& operation) const {
  // in a group made by split, also say which process this is
  const std::string world = world_rank() != rank_ ? " (world rank " + std::to_string(world_rank()) + ")" : "";
  return "rank " + std::to_string(rank_) + world + " " + operation;
}

std::shared_ptr<OpTicket> Comm::issue_ticket(const std::string&) { return nullptr; }

bool Comm::finished(OpTicket*, double) { return true; }

CommFailure Comm::broken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return broken_;
}

Work Comm::enqueue(const std::string& name, std::function<void(OpStats&)> operation) {
  auto state = std::make_shared<Work::State>();
  // here, on the issuing thread: what the backend must note now (nccl: where the
  // compute stream is), not when the comm thread gets to the operation
  state->ticket = issue_ticket(name);
  state->issued = now_seconds();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    unfinished_++;
  }
  thread_->post([this, state, name, operation = std::move(operation)] { run_operation(state, name, operation); });
  return Work(state);
}

void Comm::run_operation(const std::shared_ptr<Work::State>& state, const std::string& name,
                         const std::function<void(OpStats&)>& operation) {
  const CommFailure earlier = broken();
  if (!earlier.message.empty()) {
    state->not_started = true;
    complete(*state,
             {describe(name) + ": not started, the communicator is broken by an earlier error: " + earlier.message,
              earlier.echoed},
             OpInterval{});
    return;
  }
  Started started;
  started.state = state;
  started.name = name;
  started.start = now_seconds();
  CommFailure error;
  bool done = false;
  running_ticket_ = state->ticket.get();
  try {
    operation(started.stats);
    // it finishes after the Comm's earlier operations, which may still be in flight
    done = watches_finished_ == watches_started_ && finished(state->ticket.get(), started.start);
  } catch (const CourseError& failure) {
    error = {failure.what(), failure.reported_by_another_rank()};
  } catch (const std::exception& failure) {
    error = {failure.what(), false};
  }
  running_ticket_ = nullptr;
  if (done || !error.message.empty()) {
    finish(started, error);
    return;
  }
  // issued but not over (nccl: its kernels are queued on the GPU): the thread goes
  // on to the next operation, and asks again between operations
  started.watch = watches_started_++;
  thread_->watch([this, started] { return poll_started(started); });
}

bool Comm::poll_started(const Started& started) {
  if (started.watch != watches_finished_) return false;  // an earlier operation of this Comm is not over
  CommFailure error;
  try {
    if (!finished(started.state->ticket.get(), started.start)) return false;
  } catch (const std::exception& failure) {
    error = {failure.what(), false};
  }
  watches_finished_++;
  finish(started, error);
  return true;
}

void Comm::finish(const Started& started, const CommFailure& error) {
  // One Comm's operations run one after another (nccl's on one stream): one that
  // was issued while the previous one was still running started when it ended.
  const OpInterval ran{std::max(started.start, last_end_), now_seconds()};
  last_end_ = ran.end;
  OpStats delta = started.stats;
  delta.calls = 1;
  delta.seconds = ran.end - ran.start;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_[started.name] += delta;
    if (!error.message.empty() && broken_.message.empty()) broken_ = error;
  }
  complete(*started.state, error, ran);
}

void Comm::complete(Work::State& state, const CommFailure& error, OpInterval ran) {
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.error = error;
    state.ran = ran;
    state.done = true;
    state.finished.notify_all();
  }
  // Last: once no operation is unfinished, stop_thread lets the Comm be destroyed.
  // Notified under the lock, so the condition variable is still there.
  std::lock_guard<std::mutex> lock(mutex_);
  unfinished_--;
  all_finished_.notify_all();
}

// ----------------------------------------------------------------------------
// the operations: check arguments here, once, then hand over to the backend

static std::vector<size_t> equal_counts(int size, size_t count) { return std::vector<size_t>(size, count); }

static void check_peer(const Comm& comm, int peer, const std::string& what) {
  if (peer < 0 || peer >= comm.size()) {
    throw CommError("rank " + std::to_string(comm.rank()) + " " + what + ": peer " + std::to_string(peer) +
                    " is not in this group of " + std::to_string(comm.size()));
  }
}

static void check_counts(const Comm& comm, const std::vector<size_t>& counts, const std::string& what) {
  if (static_cast<int>(counts.size()) != comm.size()) {
    throw CommError("rank " + std::to_string(comm.rank()) + " " + what + ": " + std::to_string(counts.size()) +
                    " counts for a group of " + std::to_string(comm.size()));
  }
}

Work Comm::all_reduce_async(float* data, size_t count, ReduceOp op) {
  return enqueue("all_reduce", [=](OpStats& s) { do_all_reduce(data, count, DType::F32, op, s); });
}

Work Comm::all_reduce_async(bf16* data, size_t count, ReduceOp op) {
  return enqueue("all_reduce", [=](OpStats& s) { do_all_reduce(data, count, DType::BF16, op, s); });
}

Work Comm::reduce_scatter_async(const float* in, float* out, const std::vector<size_t>& counts, ReduceOp op) {
  check_counts(*this, counts, "reduce_scatter");
  return enqueue("reduce_scatter", [=](OpStats& s) { do_reduce_scatter(in, out, counts, DType::F32, op, s); });
}

Work Comm::reduce_scatter_async(const bf16* in, bf16* out, const std::vector<size_t>& counts, ReduceOp op) {
  check_counts(*this, counts, "reduce_scatter");
  return enqueue("reduce_scatter", [=](OpStats& s) { do_reduce_scatter(in, out, counts, DType::BF16, op, s); });
}

Work Comm::all_gather_async(const float* in, float* out, const std::vector<size_t>& counts) {
  check_counts(*this, counts, "all_gather");
  return enqueue("all_gather", [=](OpStats& s) { do_all_gather(in, out, counts, DType::F32, s); });
}

Work Comm::all_gather_async(const bf16* in, bf16* out, const std::vector<size_t>& counts) {
  check_counts(*this, counts, "all_gather");
  return enqueue("all_gather", [=](OpStats& s) { do_all_gather(in, out, counts, DType::BF16, s); });
}

// The checks every all_to_all passes first, whatever its elements (their bytes: `element` each)
void Comm::check_all_to_all(const void* in, const std::vector<size_t>& send_counts, const void* out,
                            const std::vector<size_t>& recv_counts, size_t element) const {
  check_counts(*this, send_counts, "all_to_all (send_counts)");
  check_counts(*this, recv_counts, "all_to_all (recv_counts)");
  const size_t sent = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
  const size_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  if (send_counts[rank_] != recv_counts[rank_]) {
    throw CommError(describe("all_to_all") + ": sends itself " + std::to_string(send_counts[rank_]) +
                    " values (send_counts[" + std::to_string(rank_) + "]) but receives " +
                    std::to_string(recv_counts[rank_]) + " (recv_counts[" + std::to_string(rank_) +
                    "]) (hint: send_counts[r] on rank s must equal recv_counts[s] on rank r)");
  }
  if (overlaps(static_cast<const unsigned char*>(in), sent * element, static_cast<const unsigned char*>(out),
               received * element)) {
    throw CommError(describe("all_to_all") + ": the input and output buffers overlap (hint: all_to_all cannot " +
                    "run in place; give it an output buffer of its own)");
  }
}

// The vectors are copied into the operation: the caller's may be gone before it runs.
Work Comm::all_to_all_async(const float* in, const std::vector<size_t>& send_counts, float* out,
                            const std::vector<size_t>& recv_counts) {
  check_all_to_all(in, send_counts, out, recv_counts, sizeof(float));
  return enqueue("all_to_all",
                 [=](OpStats& s) { do_all_to_all(in, send_counts, out, recv_counts, DType::F32, s); });
}

Work Comm::all_to_all_async(const bf16* in, const std::vector<size_t>& send_counts, bf16* out,
                            const std::vector<size_t>& recv_counts) {
  check_all_to_all(in, send_counts, out, recv_counts, sizeof(bf16));
  return enqueue("all_to_all",
                 [=](OpStats& s) { do_all_to_all(in, send_counts, out, recv_counts, DType::BF16, s); });
}

Work Comm::all_to_all_async(const float* in, float* out, size_t count_per_rank) {
  const std::vector<size_t> counts = equal_counts(size_, count_per_rank);
  return all_to_all_async(in, counts, out, counts);
}

Work Comm::broadcast_async(float* data, size_t count, int root) {
  check_peer(*this, root, "broadcast");
  return enqueue("broadcast", [=](OpStats& s) { do_broadcast(data, count, root, s); });
}

// A blocking send to oneself would wait for a recv that the same FIFO thread can
// only run afterwards: it works on some backends for small messages and hangs for
// large ones. send_recv(self, self) does both at once on every backend.
static void check_not_self(const Comm& comm, int peer, const std::string& what) {
  if (peer == comm.rank()) {
    throw CommError("rank " + std::to_string(comm.rank()) + " " + what + ": to itself (hint: use send_recv with " +
                    "this rank as both peers, or just copy)");
  }
}

Work Comm::send_async(const float* data, size_t count, int peer) {
  check_peer(*this, peer, "send");
  check_not_self(*this, peer, "send");
  return enqueue("send", [=](OpStats& s) { do_send_recv(data, count, peer, nullptr, 0, -1, DType::F32, s); });
}

Work Comm::recv_async(float* data, size_t count, int peer) {
  check_peer(*this, peer, "recv");
  check_not_self(*this, peer, "recv");
  return enqueue("recv", [=](OpStats& s) { do_send_recv(nullptr, 0, -1, data, count, peer, DType::F32, s); });
}

Work Comm::send_async(const bf16* data, size_t count, int peer) {
  check_peer(*this, peer, "send");
  check_not_self(*this, peer, "send");
  return enqueue("send", [=](OpStats& s) { do_send_recv(data, count, peer, nullptr, 0, -1, DType::BF16, s); });
}

Work Comm::recv_async(bf16* data, size_t count, int peer) {
  check_peer(*this, peer, "recv");
  check_not_self(*this, peer, "recv");
  return enqueue("recv", [=](OpStats& s) { do_send_recv(nullptr, 0, -1, data, count, peer, DType::BF16, s); });
}

bool Comm::carries_host_values(const float* data, size_t count) const {
  return count > 0 && count <= kMaxHostValues && device_only() != Device::CPU && is_host_memory(data);
}

// A step's loss or a gradient norm lives on the host; nccl's kernels cannot read it.
// Copied to the device (queued on the compute stream, so the collective's ticket
// orders it first) and back (a copy to the host waits for the collective).
void Comm::through_device(float* data, size_t count, const std::function<void(float* on_device)>& collective) {
  const Device device = device_only();
  Buffer on_device(count, MemCategory::CommBuffers, device);  // (count)
  copy_bytes(on_device.data(), device, data, Device::CPU, count * sizeof(float));
  collective(on_device.data());
  copy_bytes(data, Device::CPU, on_device.data(), device, count * sizeof(float));
}

void Comm::all_reduce(float* data, size_t count, ReduceOp op) {
  if (!carries_host_values(data, count)) {
    all_reduce_async(data, count, op).wait();
    return;
  }
  through_device(data, count, [&](float* on_device) { all_reduce_async(on_device, count, op).wait(); });
}

void Comm::reduce_scatter(const float* in, float* out, const std::vector<size_t>& counts, ReduceOp op) {
  reduce_scatter_async(in, out, counts, op).wait();
}

void Comm::reduce_scatter(const float* in, float* out, size_t count_per_rank, ReduceOp op) {
  reduce_scatter(in, out, equal_counts(size_, count_per_rank), op);
}

// bf16 is never a few host values (a loss, a norm): no trip through a device buffer
void Comm::all_reduce(bf16* data, size_t count, ReduceOp op) { all_reduce_async(data, count, op).wait(); }

void Comm::reduce_scatter(const bf16* in, bf16* out, const std::vector<size_t>& counts, ReduceOp op) {
  reduce_scatter_async(in, out, counts, op).wait();
}

void Comm::all_gather(const bf16* in, bf16* out, const std::vector<size_t>& counts) {
  all_gather_async(in, out, counts).wait();
}

void Comm::all_gather(const float* in, float* out, const std::vector<size_t>& counts) {
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  if (!carries_host_values(out, total)) {
    all_gather_async(in, out, counts).wait();
    return;
  }
  // this rank's block into its place in out (it may be there already: in place), then all of out
  const size_t mine = std::accumulate(counts.begin(), counts.begin() + rank_, size_t{0});
  std::copy(in, in + counts[rank_], out + mine);
  through_device(out, total, [&](float* on_device) { all_gather_async(on_device + mine, on_device, counts).wait(); });
}

void Comm::all_gather(const float* in, float* out, size_t count_per_rank) {
  all_gather(in, out, equal_counts(size_, count_per_rank));
}

void Comm::all_to_all(const float* in, const std::vector<size_t>& send_counts, float* out,
                      const std::vector<size_t>& recv_counts) {
  all_to_all_async(in, send_counts, out, recv_counts).wait();
}

void Comm::all_to_all(const float* in, float* out, size_t count_per_rank) {
  all_to_all_async(in, out, count_per_rank).wait();
}

void Comm::all_to_all(const bf16* in, const std::vector<size_t>& send_counts, bf16* out,
                      const std::vector<size_t>& recv_counts) {
  all_to_all_async(in, send_counts, out, recv_counts).wait();
}

void Comm::broadcast(float* data, size_t count, int root) {
  if (!carries_host_values(data, count)) {
    broadcast_async(data, count, root).wait();
    return;
  }
  through_device(data, count, [&](float* on_device) { broadcast_async(on_device, count, root).wait(); });
}
void Comm::send(const float* data, size_t count, int peer) { send_async(data, count, peer).wait(); }
void Comm::recv(float* data, size_t count, int peer) { recv_async(data, count, peer).wait(); }
void Comm::send(const bf16* data, size_t count, int peer) { send_async(data, count, peer).wait(); }
void Comm::recv(bf16* data, size_t count, int peer) { recv_async(data, count, peer).wait(); }

void Comm::send_recv(const float* send_data, size_t send_count, int to, float* recv_data, size_t recv_count,
                     int from) {
  send_recv_async(send_data, send_count, to, recv_data, recv_count, from).wait();
}

void Comm::send_recv(const bf16* send_data, size_t send_count, int to, bf16* recv_data, size_t recv_count,
                     int from) {
  send_recv_async(send_data, send_count, to, recv_data, recv_count, from).wait();
}

Work Comm::send_recv_async(const float* send_data, size_t send_count, int to, float* recv_data, size_t recv_count,
                           int from) {
  check_peer(*this, to, "send_recv");
  check_peer(*this, from, "send_recv");
  return enqueue("send_recv", [=](OpStats& s) {
    do_send_recv(send_data, send_count, to, recv_data, recv_count, from, DType::F32, s);
  });
}

Work Comm::send_recv_async(const bf16* send_data, size_t send_count, int to, bf16* recv_data, size_t recv_count,
                           int from) {
  check_peer(*this, to, "send_recv");
  check_peer(*this, from, "send_recv");
  return enqueue("send_recv", [=](OpStats& s) {
    do_send_recv(send_data, send_count, to, recv_data, recv_count, from, DType::BF16, s);
  });
}

void Comm::barrier() {
  enqueue("barrier", [=](OpStats& s) { do_barrier(s); }).wait();
}

std::unique_ptr<Comm> Comm::split(int color, int key) {
  std::unique_ptr<Comm> group;
  enqueue("split", [&](OpStats&) { group = do_split(color, key); }).wait();
  if (group) group->world_rank_ = world_rank();
  return group;
}

std::map<std::string, OpStats> Comm::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

OpStats Comm::total_stats() const {
  OpStats total;
  for (const auto& [name, op] : stats()) {
    total.calls += op.calls;
    total.bytes_sent += op.bytes_sent;
    total.bytes_received += op.bytes_received;
    total.seconds += op.seconds;
  }
  return total;
}

void Comm::reset_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.clear();
}

// ----------------------------------------------------------------------------
// choosing a backend

// Deadlines are computed in seconds and nanoseconds: beyond about 11 days they stop
// meaning anything useful and start overflowing.
constexpr double kMaxTimeoutSeconds = 1e6;

double default_comm_timeout() {
  const char* text = std::getenv("COURSE_COMM_TIMEOUT");
  if (text == nullptr) return 300.0;
  errno = 0;
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (*text == '\0' || *end != '\0' || errno == ERANGE || !(value > 0) || value > kMaxTimeoutSeconds) {
    throw UsageError(std::string("COURSE_COMM_TIMEOUT='") + text + "' must be a number of seconds above 0 and at " +
                     "most 1000000 (hint: 86400 is a day)");
  }
  return value;
}

void add_comm_flags(ArgParser& parser, CommOptions& options) {
  options.timeout_seconds = static_cast<float>(default_comm_timeout());
  parser.add_choice("--backend", &options.backend, {"auto", "tcp", "mpi", "nccl"},
                    "how ranks talk: auto = mpi under mpirun/srun, else tcp");
  parser.add_float("--comm-timeout", &options.timeout_seconds, 0.0f, true,
                   "seconds a communication may wait before it fails (env COURSE_COMM_TIMEOUT)");
  parser.add_int("--sites", &options.wan.sites, 1,
                 "the ranks in this many sites of consecutive ranks, a simulated wide-area link between them (tcp)");
  parser.add_string("--wan-bandwidth", &options.wan.bandwidth,
                    "with --sites: the link's bandwidth each way, per rank (100Mbit, 1Gbit, 10MB)");
  parser.add_string("--wan-latency", &options.wan.latency, "with --sites: the link's one-way latency (25ms)");
}

// auto with device buffers: nccl when every rank on this machine has a GPU of its own
// and the ranks can meet to share NCCL's id; else a host backend staged through the host.
static bool nccl_fits(const LaunchEnv& env) {
#ifdef COURSE_HAVE_NCCL
  const bool can_meet = env.world_size == 1 || (!env.master_addr.empty() && env.store_port > 0);
  return can_meet && gpus_of_their_own(env, cuda_device_count());
#else
  (void)env;
  return false;
#endif
}

std::unique_ptr<Comm> create_world_comm(const LaunchEnv& env, const CommOptions& options) {
  if (!(options.timeout_seconds <= kMaxTimeoutSeconds)) {
    throw FlagError("--comm-timeout must be at most 1000000 seconds (hint: 86400 is a day)");
  }
  const bool device_buffers = options.buffers != Device::CPU;
  if (options.buffers == Device::CUDA && !built_with_cuda()) {
    throw FlagError("communication on CUDA buffers in a build without CUDA (hint: use --device cpu)");
  }
  std::string backend = options.backend;
  if (backend == "nccl" && options.buffers == Device::Guarded) {
    throw FlagError("--backend nccl needs GPU buffers, and the guarded device is the CPU (hint: --backend tcp or "
                    "mpi, which stage its buffers through the host)");
  }
  const WanLayout wan(options.wan, env.world_size);
  if (backend == "auto" && wan.shapes()) backend = "tcp";  // the one backend that simulates the link
  if (backend == "auto" && options.buffers == Device::CUDA && nccl_fits(env)) backend = "nccl";
  if (backend == "auto") {
    bool under_mpi_launcher = env.launcher == "mpirun" || env.launcher == "srun";
    backend = under_mpi_launcher && mpi_available() ? "mpi" : "tcp";
  }
  if (wan.shapes() && (backend == "mpi" || backend == "nccl")) {
    throw FlagError("--sites: only the tcp backend simulates the link between sites, and this run uses " + backend +
                    " (hint: --backend tcp, under the course launcher)");
  }
  std::unique_ptr<Comm> host_comm;  // tcp or mpi: they read and write host memory
  if (backend == "tcp") {
    if (env.launcher == "mpirun" || env.launcher == "srun") {
      if (env.world_size > 1 && env.master_addr.empty()) {
        throw FlagError("--backend tcp under " + env.launcher + " needs MASTER_ADDR and MASTER_PORT for the " +
                        "rendezvous (hint: use --backend mpi, or export MASTER_ADDR/MASTER_PORT)");
      }
    }
    host_comm = create_tcp_comm(env, options.timeout_seconds, wan);
  } else if (backend == "mpi") {
    if (!mpi_available()) {
      throw FlagError("--backend mpi: this build has no MPI (hint: apt-get install libopenmpi-dev and rebuild)");
    }
    if (env.launcher == "torchrun" && env.world_size > 1) {
      throw FlagError("--backend mpi needs the processes to be started by mpirun or srun (hint: use --backend tcp "
                      "under the course launcher)");
    }
    host_comm = create_mpi_comm(options.timeout_seconds);
  } else if (backend == "nccl") {
#ifdef COURSE_HAVE_NCCL
    // one GPU per rank: by default the one select_device computes on (gpu_for_rank, env.h).
    // Fewer GPUs visible than ranks here is no error in itself: with a per-rank
    // CUDA_VISIBLE_DEVICES each rank sees one, its own. Ranks that do share a GPU are
    // refused by NCCL's init ("Duplicate GPU detected", ncclInvalidUsage, whose hint asks that).
    return create_nccl_comm(env, options.timeout_seconds,
                            options.device_index >= 0 ? options.device_index : gpu_for_rank(env, cuda_device_count()));
#else
    throw FlagError("--backend nccl: this build has no NCCL (hint: install the CUDA toolkit with NCCL and use the "
                    "`cuda` preset, or use --backend tcp or mpi)");
#endif
  } else {
    throw FlagError("--backend must be auto, tcp, mpi or nccl, got '" + backend + "'");
  }
  if (!device_buffers) return host_comm;
  // device buffers through a host backend: copied to the host and back around each operation
  return stage_through_host(std::move(host_comm), options.buffers);
}

}  // namespace course
