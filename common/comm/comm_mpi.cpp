// The mpi backend: Open MPI (or any MPI-3 library), for jobs started by mpirun or srun.
//
// MPI does the collectives; this file adds what the course's Comm promises on top:
//   - Calls from any thread. Every Comm calls MPI from its own communication thread,
//     and the Comms that split makes run side by side, so MPI is initialised with
//     MPI_THREAD_MULTIPLE.
//   - A deadline on every operation. A blocking MPI_Allreduce waits forever for a
//     stuck peer, so each operation is started with MPI's non-blocking call
//     (MPI_Iallreduce, ...) and then polled with MPI_Testall until it completes or
//     the deadline passes.
//   - Errors as CommErrors. The communicators return error codes (MPI_ERRORS_RETURN)
//     instead of aborting the job, and each code becomes a message naming the rank,
//     the operation, the MPI call and MPI's own text.
//
// Byte counters: MPI does not tell us what it sent (it picks its algorithm by
// message size), so collectives record the volume of the bandwidth-optimal ring
// algorithm (ring_volume.h), all_to_all what its pairwise exchange sends (every block
// but this rank's own); broadcast records the bytes (the root sends them, the others
// receive them) and send/recv the exact bytes.
#include "common/comm/comm.h"
#include "common/comm/comm_util.h"

#ifndef COURSE_HAVE_MPI

namespace course {

bool mpi_available() { return false; }

std::unique_ptr<Comm> create_mpi_comm(double) {
  throw UsageError("--backend mpi: this build has no MPI (hint: apt-get install libopenmpi-dev openmpi-bin, "
                   "then configure and build again)");
}

}  // namespace course

#else

// The C API only: Open MPI's mpi.h would also pull in the deprecated C++ bindings,
// which live in a library we do not link.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "common/comm/ring_volume.h"

// Every MPI call goes through MPI_CHECK: a failure becomes a CommError naming the
// rank and operation (`where`), the call, and MPI's own words for the error.
#define MPI_CHECK(call, where) check_mpi((call), #call, (where))

namespace course {

namespace {

// Set once any MPI operation of this process has failed: see finalize_mpi.
std::atomic<bool> mpi_failed{false};

[[noreturn]] void fail(const std::string& message) {
  mpi_failed = true;
  throw CommError(message);
}

void check_mpi(int code, const char* call, const std::string& where) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    length = std::snprintf(text, sizeof(text), "MPI error code %d", code);
  }
  fail(where + ": " + call_name(call) + " failed: " + std::string(text, length) +
       " (hint: did a peer die? See the other ranks' output; all ranks must call the same operations with the "
       "same counts)");
}

// Polls `requests` until all are complete or the deadline passes. MPI advances a
// non-blocking operation only inside MPI calls, so we keep calling MPI_Testall;
// after the first thousand polls (a small operation is done by then) we sleep a
// little between polls, so a long wait does not take a core from a peer process.
// An operation abandoned at the deadline stays pending (MPI cannot cancel a
// collective); the Comm is broken from then on and issues nothing more.
void wait_all(int count, MPI_Request* requests, MPI_Status* statuses, double timeout_seconds,
              const std::string& where) {
  const auto start = std::chrono::steady_clock::now();
  for (int polls = 0;; polls++) {
    int done = 0;
    int code = MPI_Testall(count, requests, &done, statuses);
    if (code == MPI_ERR_IN_STATUS && statuses != MPI_STATUSES_IGNORE) {
      // which request failed, and why, is in its status
      for (int i = 0; i < count; i++) {
        if (statuses[i].MPI_ERROR != MPI_SUCCESS && statuses[i].MPI_ERROR != MPI_ERR_PENDING) {
          code = statuses[i].MPI_ERROR;
          break;
        }
      }
    }
    check_mpi(code, "MPI_Testall", where);
    if (done) return;
    if (std::chrono::steady_clock::now() - start > std::chrono::duration<double>(timeout_seconds)) {
      fail(where + ": timed out after " + seconds_text(timeout_seconds) +
           " s (hint: a peer is dead or stuck; raise --comm-timeout if it is just slow)");
    }
    if (polls >= 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// MPI counts are ints: 2^31 floats or more must be sent in pieces.
int mpi_count(size_t count, const std::string& where) {
  if (count > static_cast<size_t>(INT_MAX)) {
    fail(where + ": " + std::to_string(count) + " floats do not fit MPI's int counts (hint: communicate in buckets "
         "of fewer than 2^31 floats)");
  }
  return static_cast<int>(count);
}

// MPI has no bf16 type (MPI 4.0 defines none; MPIX_BFLOAT16 is MPICH's own). A bf16
// travels as an MPI_UINT16_T, the right size, and its reductions are operations of
// our own that add (or compare) in fp32: comm_util.h's combine, as the tcp ring's.
MPI_Datatype mpi_type(DType type) { return type == DType::BF16 ? MPI_UINT16_T : MPI_FLOAT; }

void bf16_sum(void* in, void* inout, int* count, MPI_Datatype*) {
  auto* result = static_cast<bf16*>(inout);
  combine(ReduceOp::Sum, result, static_cast<const bf16*>(in), result, static_cast<size_t>(*count));
}
void bf16_max(void* in, void* inout, int* count, MPI_Datatype*) {
  auto* result = static_cast<bf16*>(inout);
  combine(ReduceOp::Max, result, static_cast<const bf16*>(in), result, static_cast<size_t>(*count));
}

// Average is a sum that the backend divides afterwards (comm_util.h's divide).
MPI_Op mpi_op(ReduceOp op, DType type, const std::string& where) {
  if (type == DType::F32) return op == ReduceOp::Max ? MPI_MAX : MPI_SUM;
  // made once, on first use (MPI is initialised by then), whichever Comm's thread gets
  // there first; commutative, as a sum is
  static MPI_Op sum = MPI_OP_NULL, max = MPI_OP_NULL;
  static std::once_flag made;
  std::call_once(made, [&] {
    MPI_CHECK(MPI_Op_create(&bf16_sum, /*commute=*/1, &sum), where);
    MPI_CHECK(MPI_Op_create(&bf16_max, /*commute=*/1, &max), where);
  });
  return op == ReduceOp::Max ? max : sum;
}

// ReduceOp::Average's division, in the elements' type
void divide_elements(void* data, size_t count, DType type, int ranks) {
  if (type == DType::BF16) {
    divide(static_cast<bf16*>(data), count, ranks);
  } else {
    divide(static_cast<float*>(data), count, ranks);
  }
}

// MPI_Finalize waits for every rank to reach it, so after a failure (a peer dead or
// stuck) it could hang. Then we leave without it, and mpirun, seeing a rank exit
// without finalizing, ends the rest of the job.
void finalize_mpi() {
  int finalized = 0;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized || mpi_failed) return;
  if (MPI_Finalize() != MPI_SUCCESS) std::fprintf(stderr, "mpi: MPI_Finalize failed at exit\n");
}

std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    default: return "level " + std::to_string(level);
  }
}

// MPI is initialised once per process, by the first Comm that needs it, and
// finalised at exit (only if we initialised it: a program that started MPI itself
// also ends it).
void initialize_mpi() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  const std::string where = "mpi init";
  int initialized = 0;
  MPI_CHECK(MPI_Initialized(&initialized), where);
  if (!initialized) {
    int provided = 0;
    MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), where);
    std::atexit(finalize_mpi);
    // errors on the world communicator (MPI_Comm_idup below) come back as codes too
    MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), where);
  }
  int provided = 0;
  MPI_CHECK(MPI_Query_thread(&provided), where);
  if (provided < MPI_THREAD_MULTIPLE) {
    fail(where + ": this MPI library offers only " + thread_level_name(provided) +
         ", and the mpi backend calls MPI from several threads (MPI_THREAD_MULTIPLE) (hint: use an MPI built "
         "with thread support, `ompi_info | grep -i thread` tells, or --backend tcp)");
  }
}

// Every Comm has an MPI communicator of its own, and between two ranks MPI delivers
// messages in the order they were sent, so one tag serves every send and recv.
constexpr int kTag = 0;

class MpiComm : public Comm {
 public:
  // Takes ownership of `comm`.
  MpiComm(MPI_Comm comm, int rank, int size, double timeout_seconds)
      : Comm(rank, size, timeout_seconds), comm_(comm) {}

  ~MpiComm() override {
    stop_thread();
    // After MPI_Finalize (a Comm that outlives main) no MPI call is allowed.
    int finalized = 0;
    if (MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized && MPI_Comm_free(&comm_) != MPI_SUCCESS) {
      std::fprintf(stderr, "%s: MPI_Comm_free failed (ignored)\n", describe("destroy").c_str());
    }
  }

  std::string backend() const override { return "mpi"; }

 protected:
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
  MPI_Comm comm_;
  // What MPI reads while an operation runs lives here rather than on the stack, so
  // that an operation abandoned at its deadline never reads freed memory.
  std::vector<unsigned char> scratch_;  // a copy of an input that overlaps its output
  std::vector<int> counts_;        // the blocks' sizes, as MPI's ints
  std::vector<int> offsets_;       // and their offsets in the whole buffer
  std::vector<int> send_counts_;   // all_to_all's send blocks (counts_, offsets_: its receive blocks)
  std::vector<int> send_offsets_;
};

// counts and offsets = the blocks' sizes and offsets in the whole buffer, as MPI's ints
void layout(const std::vector<size_t>& blocks, std::vector<int>& counts, std::vector<int>& offsets,
            const std::string& where) {
  counts.resize(blocks.size());
  offsets.resize(blocks.size());
  size_t offset = 0;
  for (size_t r = 0; r < blocks.size(); r++) {
    counts[r] = mpi_count(blocks[r], where);
    offsets[r] = mpi_count(offset, where);
    offset += blocks[r];
  }
}

// A Comm that owns `comm`, a communicator MPI has just made.
std::unique_ptr<Comm> adopt(MPI_Comm comm, double timeout_seconds, const std::string& where) {
  // failures come back as codes, which MPI_CHECK turns into CommErrors, instead of ending the job
  MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), where);
  int rank = 0;
  int size = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank), where);
  MPI_CHECK(MPI_Comm_size(comm, &size), where);
  return std::make_unique<MpiComm>(comm, rank, size, timeout_seconds);
}

void MpiComm::do_all_reduce(void* data, size_t count, DType type, ReduceOp op, OpStats& stats) {
  const std::string where = describe("all_reduce");
  MPI_Request request;
  // MPI_IN_PLACE: the input is `data` and so is the output; no second buffer
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data, mpi_count(count, where), mpi_type(type), mpi_op(op, type, where),
                           comm_, &request),
            where);
  wait_all(1, &request, MPI_STATUSES_IGNORE, timeout_seconds(), where);
  if (op == ReduceOp::Average) divide_elements(data, count, type, size());
  const uint64_t bytes = ring_all_reduce_bytes(count * dtype_bytes(type), size());
  stats.bytes_sent += bytes;
  stats.bytes_received += bytes;
}

void MpiComm::do_reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                                ReduceOp op, OpStats& stats) {
  const std::string where = describe("reduce_scatter");
  layout(counts, counts_, offsets_, where);
  const size_t element = dtype_bytes(type);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  const size_t mine = counts[rank()];
  // MPI may not write where it reads. When `out` lies inside `in` (a shard reduced
  // where it sits), the input is copied first: MPI_IN_PLACE would take the input
  // from `out` and overwrite it, and `in` is const.
  const auto* in_bytes = static_cast<const unsigned char*>(in);
  const void* send = in;
  if (overlaps(in_bytes, total * element, static_cast<const unsigned char*>(out), mine * element)) {
    scratch_.assign(in_bytes, in_bytes + total * element);
    send = scratch_.data();
  }
  MPI_Request request;
  if (all_equal(counts)) {
    MPI_CHECK(MPI_Ireduce_scatter_block(send, out, counts_[0], mpi_type(type), mpi_op(op, type, where), comm_,
                                        &request),
              where);
  } else {
    MPI_CHECK(MPI_Ireduce_scatter(send, out, counts_.data(), mpi_type(type), mpi_op(op, type, where), comm_,
                                  &request),
              where);
  }
  wait_all(1, &request, MPI_STATUSES_IGNORE, timeout_seconds(), where);
  if (op == ReduceOp::Average) divide_elements(out, mine, type, size());
  const uint64_t bytes = ring_gather_bytes(total * element, size());
  stats.bytes_sent += bytes;
  stats.bytes_received += bytes;
}

void MpiComm::do_all_gather(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                            OpStats& stats) {
  const std::string where = describe("all_gather");
  layout(counts, counts_, offsets_, where);
  const size_t element = dtype_bytes(type);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  const size_t mine = counts[rank()];
  const auto* in_bytes = static_cast<const unsigned char*>(in);
  auto* out_bytes = static_cast<unsigned char*>(out);
  // This rank's block already where it belongs in `out` (a shard gathered in place):
  // MPI_IN_PLACE says so. Any other overlap would have MPI read what it writes, so
  // the block is copied first.
  const void* send = in;
  if (in_bytes == out_bytes + offsets_[rank()] * element) {
    send = MPI_IN_PLACE;
  } else if (overlaps(in_bytes, mine * element, static_cast<const unsigned char*>(out_bytes), total * element)) {
    scratch_.assign(in_bytes, in_bytes + mine * element);
    send = scratch_.data();
  }
  const MPI_Datatype datatype = mpi_type(type);
  MPI_Request request;
  if (all_equal(counts)) {
    MPI_CHECK(MPI_Iallgather(send, counts_[0], datatype, out, counts_[0], datatype, comm_, &request), where);
  } else {
    MPI_CHECK(MPI_Iallgatherv(send, counts_[rank()], datatype, out, counts_.data(), offsets_.data(), datatype, comm_,
                              &request),
              where);
  }
  wait_all(1, &request, MPI_STATUSES_IGNORE, timeout_seconds(), where);
  const uint64_t bytes = ring_gather_bytes(total * element, size());
  stats.bytes_sent += bytes;
  stats.bytes_received += bytes;
}

void MpiComm::do_all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                            const std::vector<size_t>& recv_counts, DType type, OpStats& stats) {
  const std::string where = describe("all_to_all");
  // MPI's offsets are ints too: a block starting 2^31 floats or more in is refused, as is one that long
  layout(send_counts, send_counts_, send_offsets_, where);
  layout(recv_counts, counts_, offsets_, where);
  // Always the v form: every rank must call the same collective, and whether one rank's
  // blocks happen to be equal says nothing of another's (chapter 09's routed tokens)
  MPI_Request request;
  MPI_CHECK(MPI_Ialltoallv(in, send_counts_.data(), send_offsets_.data(), mpi_type(type), out, counts_.data(),
                           offsets_.data(), mpi_type(type), comm_, &request),
            where);
  wait_all(1, &request, MPI_STATUSES_IGNORE, timeout_seconds(), where);
  stats.bytes_sent += all_to_all_bytes(send_counts, rank(), dtype_bytes(type));
  stats.bytes_received += all_to_all_bytes(recv_counts, rank(), dtype_bytes(type));
}

void MpiComm::do_broadcast(float* data, size_t count, int root, OpStats& stats) {
  const std::string where = describe("broadcast from rank " + std::to_string(root));
  MPI_Request request;
  MPI_CHECK(MPI_Ibcast(data, mpi_count(count, where), MPI_FLOAT, root, comm_, &request), where);
  wait_all(1, &request, MPI_STATUSES_IGNORE, timeout_seconds(), where);
  const uint64_t bytes = count * sizeof(float);
  if (rank() == root) {
    stats.bytes_sent += bytes;
  } else {
    stats.bytes_received += bytes;
  }
}

void MpiComm::do_send_recv(const void* send_data, size_t send_count, int to, void* recv_data, size_t recv_count,
                           int from, DType type, OpStats& stats) {
  std::string what;
  if (to >= 0) what = "send to rank " + std::to_string(to);
  if (from >= 0) what += std::string(what.empty() ? "" : ", ") + "recv from rank " + std::to_string(from);
  const std::string where = describe(what);
  // Both directions start before we wait on either, so two ranks that send to each
  // other (a ring shift) never wait on each other.
  MPI_Request requests[2];
  MPI_Status statuses[2];
  int started = 0;
  if (from >= 0) {
    MPI_CHECK(MPI_Irecv(recv_data, mpi_count(recv_count, where), mpi_type(type), from, kTag, comm_,
                        &requests[started++]),
              where);
  }
  if (to >= 0) {
    MPI_CHECK(MPI_Isend(send_data, mpi_count(send_count, where), mpi_type(type), to, kTag, comm_,
                        &requests[started++]),
              where);
  }
  wait_all(started, requests, statuses, timeout_seconds(), where);
  if (from >= 0) {
    // A longer message than asked for is an MPI error (MPI_ERR_TRUNCATE); a shorter
    // one is not, but here it is a bug all the same.
    int received = 0;
    MPI_CHECK(MPI_Get_count(&statuses[0], mpi_type(type), &received), where);
    if (static_cast<size_t>(received) != recv_count) {
      fail(where + ": expected " + std::to_string(recv_count) + " " + dtype_name(type) + " values, rank " +
           std::to_string(from) + " sent " + std::to_string(received) + " (hint: send and recv counts must be equal)");
    }
    stats.bytes_received += recv_count * dtype_bytes(type);
  }
  if (to >= 0) stats.bytes_sent += send_count * dtype_bytes(type);
}

void MpiComm::do_barrier(OpStats&) {
  const std::string where = describe("barrier");
  MPI_Request request;
  MPI_CHECK(MPI_Ibarrier(comm_, &request), where);
  wait_all(1, &request, MPI_STATUSES_IGNORE, timeout_seconds(), where);
}

std::unique_ptr<Comm> MpiComm::do_split(int color, int key) {
  const std::string where = describe("split");
  // MPI_Comm_split has no non-blocking form: it waits, with no deadline, for every
  // rank to call it. Meeting in a barrier that has one first turns a dead or stuck
  // peer into a timeout here rather than a hang inside MPI_Comm_split.
  MPI_Request request;
  MPI_CHECK(MPI_Ibarrier(comm_, &request), where);
  wait_all(1, &request, MPI_STATUSES_IGNORE, timeout_seconds(), where);
  MPI_Comm group = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &group), where);
  if (group == MPI_COMM_NULL) return nullptr;  // MPI_UNDEFINED: this rank joins no group
  return adopt(group, timeout_seconds(), where);
}

}  // namespace

bool mpi_available() { return true; }

std::unique_ptr<Comm> create_mpi_comm(double timeout_seconds) {
  initialize_mpi();
  int world_rank = 0;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "mpi init");
  const std::string where = "rank " + std::to_string(world_rank) + " mpi init";
  // The Comm gets a duplicate of MPI_COMM_WORLD, a communicator of its own: two
  // Comms over the same ranks, each on its own thread, then never match each
  // other's messages. MPI_Comm_idup is the duplicate we can wait for with a deadline.
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Request request;
  MPI_CHECK(MPI_Comm_idup(MPI_COMM_WORLD, &comm, &request), where);
  wait_all(1, &request, MPI_STATUSES_IGNORE, timeout_seconds, where);
  return adopt(comm, timeout_seconds, where);
}

}  // namespace course

#endif  // COURSE_HAVE_MPI
