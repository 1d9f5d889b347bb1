// The tcp backend: the course's own collectives, over plain TCP sockets.
//
// Every algorithm a deep-learning framework relies on is written out here, with
// nothing hidden in a library:
//
//   rendezvous      the ranks find each other through the store, then connect a
//                   full mesh: one socket per pair of ranks
//   all_reduce      ring reduce-scatter, then ring all-gather (bandwidth-optimal);
//                   two ranks and a small message: one exchange (latency-optimal)
//   reduce_scatter  the first half of it
//   all_gather      the second half of it
//   all_to_all      a pairwise exchange: n-1 steps, each with another peer
//   broadcast       a pipelined chain from the root, in chunks
//   barrier         a dissemination barrier: log2(n) rounds of 1-byte messages
//   send / recv     straight to that peer, with the length first
//   split           an exchange of (color, key) through the store, then a new mesh
//
// The algorithms see only "send these bytes to rank a while receiving those from
// rank b" (exchange). Underneath, a pair of ranks on the same machine moves its
// bytes through shared memory instead of loopback TCP, several times faster
// (shm_transport.h; COURSE_TCP_TRANSPORT=socket turns that off).
//
// Every operation runs on the Comm's communication thread (see comm.h), one at a
// time, so the connections need no locks. Each wait has the Comm's timeout and
// says who waits, in which operation, for whom.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <future>
#include <list>
#include <thread>
#include <utility>

#include "common/comm/auth.h"
#include "common/comm/comm.h"
#include "common/comm/comm_util.h"
#include "common/comm/rendezvous.h"
#include "common/comm/shm_transport.h"

namespace course {

namespace {

// Broadcast forwards the data in pieces of this size, so the ranks down the chain
// start forwarding long before the whole buffer has reached them.
constexpr size_t kBroadcastChunkFloats = (256 * 1024) / sizeof(float);

// How long a rank that hosts the store waits, after a peer's death, for the others to
// read who died (closed_connection).
constexpr double kStoreGraceSeconds = 2.0;

// r mod n for an r that may be negative (ring positions to the left of rank 0).
int ring_index(int r, int n) { return ((r % n) + n) % n; }

// Where each rank's block lies in a buffer: block k is the floats
// [offset[k], offset[k] + count[k]). The ring moves one block per step.
struct Blocks {
  std::vector<size_t> offset;
  std::vector<size_t> count;
};

Blocks blocks_from_counts(const std::vector<size_t>& counts) {
  Blocks blocks;
  blocks.count = counts;
  size_t next = 0;
  for (size_t count : counts) {
    blocks.offset.push_back(next);
    next += count;
  }
  return blocks;
}

// `total` floats cut into n nearly equal blocks: the first total % n blocks get one
// float more. Some blocks are empty when total < n; all are when total is 0.
Blocks even_blocks(size_t total, int n) {
  std::vector<size_t> counts(n, total / n);
  for (size_t k = 0; k < total % n; k++) counts[k]++;
  return blocks_from_counts(counts);
}

// memmove rather than memcpy: an in-place all_gather passes in == out + offset.
template <typename T>
void copy_elements(T* dest, const T* source, size_t count) {
  if (dest != source && count > 0) std::memmove(dest, source, count * sizeof(T));
}

// Scratch bytes seen as `count` elements of T, grown when too small.
template <typename T>
T* scratch_of(std::vector<unsigned char>& scratch, size_t count) {
  if (scratch.size() < count * sizeof(T)) scratch.resize(count * sizeof(T));
  return reinterpret_cast<T*>(scratch.data());
}

class TcpComm : public Comm {
 public:
  // A group of `size` ranks. `world_ranks[r]` is group rank r's rank in the world,
  // for error messages. For size > 1 this connects the mesh through the store
  // under `prefix`, a name no other group uses; it returns when every member is
  // connected. Every group made from one world holds its rendezvous, so that a
  // store this process hosts lives as long as any of them. `transport` says
  // whether pairs on one machine move their bytes through shared memory.
  // `failure_key` is the world's: every group made from it notes there who closed a
  // connection first (closed_connection).
  // `wan` says which peers are in another site, behind the simulated link (wan_link.h).
  TcpComm(int rank, int size, double timeout_seconds, Rendezvous rendezvous, std::string prefix,
          std::string failure_key, std::vector<int> world_ranks, Transport transport, WanLayout wan)
      : Comm(rank, size, timeout_seconds),
        rendezvous_(std::move(rendezvous)),
        prefix_(std::move(prefix)),
        failure_key_(std::move(failure_key)),
        world_ranks_(std::move(world_ranks)),
        transport_(transport),
        wan_(wan) {
    if (size > 1) {
      connect_mesh();
      share_memory(links_, rank, transport_, timeout_seconds, describe("rendezvous"));
      // Returning from here means every member has connected, so none needs the
      // store for this group any more: rank 0 may even shut a store it hosts.
      OpStats rendezvous;
      dissemination_barrier("rendezvous", rendezvous);
    }
  }

  ~TcpComm() override {
    // Operations still queued use the links: let them finish first. The sockets
    // close and the rings unmap after this, when the members are destroyed.
    stop_thread();
  }

  // with a simulated link, the run's header says so: its times are the link's
  std::string backend() const override { return wan_.shapes() ? "tcp over " + wan_.describe() : "tcp"; }

 protected:
  void do_all_reduce(void* data, size_t count, DType type, ReduceOp op, OpStats& stats) override;
  void do_reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts, DType type, ReduceOp op,
                         OpStats& stats) override;
  void do_all_gather(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                     OpStats& stats) override;
  void do_all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                     const std::vector<size_t>& recv_counts, DType type, OpStats& stats) override;
  void do_broadcast(float* data, size_t count, int root, OpStats& stats) override;
  void do_send_recv(const void* send_data, size_t send_count, int to, void* recv_data, size_t recv_count,
                    int from, DType type, OpStats& stats) override;
  void do_barrier(OpStats& stats) override;
  std::unique_ptr<Comm> do_split(int color, int key) override;

 private:
  void connect_mesh();
  // The rings move elements of any type T (float, bf16): only their size and how two
  // are added (comm_util.h's combine) depend on it.
  template <typename T>
  void all_reduce(T* data, size_t count, ReduceOp op, OpStats& stats);
  template <typename T>
  void ring_reduce_scatter(const std::string& name, ReduceOp op, const T* in, const Blocks& blocks, T* result,
                           OpStats& stats);
  template <typename T>
  void ring_all_gather(const std::string& op, T* data, const Blocks& blocks, OpStats& stats);
  void dissemination_barrier(const std::string& op, OpStats& stats);
  // `shaped`: whether a send to another site goes through the simulated link (wan_link.h)
  void exchange(const std::string& what, int to, const void* send_data, size_t send_bytes, int from,
                void* recv_data, size_t recv_bytes, OpStats& stats, bool shaped = true);
  void framed_exchange(const std::string& op, int to, const void* send_data, size_t send_count, int from,
                       void* recv_data, size_t recv_count, DType type, const std::string& hint, OpStats& stats);
  [[noreturn]] void fail(const std::string& message, bool echoed = false);
  std::string peer_name(int peer) const;
  std::string traffic(const std::string& op, int to, int from) const;
  CommFailure closed_connection(const std::string& what, int peer);

  Rendezvous rendezvous_;               // the store; empty in a world of one
  std::string prefix_;                  // this group's store keys start with it
  std::string failure_key_;             // the world's record of the first closed connection
  std::vector<int> world_ranks_;
  Transport transport_;
  WanLayout wan_;                       // which peers are in another site, behind the simulated link
  int splits_ = 0;                      // how many times split has run on this group
  std::vector<Link> links_;             // links_[r]: the connection to rank r; none to itself
  // messages this rank sent to itself, not yet received: their bytes, and their count of values
  std::deque<std::pair<std::vector<unsigned char>, size_t>> to_self_;
  // Scratch for the ring and the two-rank exchange, kept between operations:
  // allocating (and page-faulting) megabytes on every call would cost more than the
  // transfer. Untracked: the memory tracker is used from the main thread only, and
  // this is the comm thread.
  std::vector<unsigned char> incoming_;
  std::vector<unsigned char> partial_;
};

// ----------------------------------------------------------------------------
// rendezvous: from "I know where the store is" to one socket per pair of ranks
//
// Each rank listens on a free port and publishes "address:port" in the store.
// For every pair, the higher rank connects to the lower, answers its challenge
// (the job's secret, auth.h) and says its rank in the next 4 bytes (the hello);
// the lower rank accepts. Connections arrive in any order, so the hello is how the
// lower rank knows who has connected. Each connection is challenged on a thread of
// its own: one that cannot answer (a stranger, or one that connects and says
// nothing) is dropped after kChallengeSeconds at most, while the ranks' connections
// go through beside it.

void TcpComm::connect_mesh() {
  const int me = rank();
  const double timeout = timeout_seconds();
  int port = 0;
  Socket listener = listen_on(rendezvous_.listen_host, 0, &port);
  // the address this machine reaches the store at is one the other machines can reach it at
  Store& store = *rendezvous_.client;
  store.set(prefix_ + "/address/" + std::to_string(me), store.local_address() + ":" + std::to_string(port));

  links_.resize(size());
  for (int peer = me - 1; peer >= 0; peer--) {
    const std::string where = store.get(prefix_ + "/address/" + std::to_string(peer));
    const size_t colon = where.rfind(':');
    const std::string what = describe("rendezvous") + ": connect to " + peer_name(peer) + " at " + where;
    Socket socket = connect_to(where.substr(0, colon), std::stoi(where.substr(colon + 1)), timeout, what);
    answer_challenge(socket, rendezvous_.secret, "tcp mesh", timeout, what);
    const int32_t hello = me;
    socket.send_all(&hello, sizeof(hello), timeout, what);
    links_[peer].socket = std::move(socket);
  }
  struct Arrival {
    Socket socket;
    std::future<int> hello;  // the rank it says it is once it has answered; -1: a stranger
  };
  std::list<Arrival> arrivals;  // a list: each challenge thread holds on to its element
  const std::string what = describe("rendezvous") + ": wait for the ranks above " + std::to_string(me) +
                           " to connect";
  const double deadline = monotonic_seconds() + timeout;
  for (int accepted = 0; accepted < size() - 1 - me;) {
    for (auto arrival = arrivals.begin(); arrival != arrivals.end();) {
      if (arrival->hello.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
        ++arrival;
        continue;
      }
      const int hello = arrival->hello.get();
      if (hello >= 0) {
        if (hello <= me || hello >= size() || links_[hello].socket.valid()) {
          throw CommError(what + ": a connection said it is rank " + std::to_string(hello) +
                          ", which is not a rank above " + std::to_string(me) + " that has not connected yet");
        }
        links_[hello].socket = std::move(arrival->socket);
        accepted++;
      }
      arrival = arrivals.erase(arrival);
    }
    if (accepted == size() - 1 - me) break;
    // back every 50 ms to collect the challenges that have ended
    pollfd ready{listener.fd(), POLLIN, 0};
    if (::poll(&ready, 1, std::min(50, milliseconds_left(deadline, timeout, what))) <= 0) continue;
    arrivals.push_back({accept_one(listener, timeout, what), {}});
    Arrival& arrival = arrivals.back();
    arrival.hello = std::async(std::launch::async, [&socket = arrival.socket, secret = rendezvous_.secret] {
      if (!challenge(socket, secret, "tcp mesh", kChallengeSeconds)) return -1;
      int32_t hello = -1;
      try {
        socket.recv_all(&hello, sizeof(hello), kChallengeSeconds, "hello");
      } catch (const CommError&) {
        return -1;  // it answered, then said nothing
      }
      return static_cast<int>(hello);
    });
  }
  // the connections still being challenged are strangers: let them go now, so that
  // their threads end at once instead of at their deadlines
  for (Arrival& arrival : arrivals) ::shutdown(arrival.socket.fd(), SHUT_RDWR);
}

// ----------------------------------------------------------------------------
// moving bytes

std::string TcpComm::peer_name(int peer) const {
  std::string name = "rank " + std::to_string(peer);
  // in a group made by split, also say which process that is
  if (world_ranks_[peer] != peer) name += " (world rank " + std::to_string(world_ranks_[peer]) + ")";
  return name;
}

// "rank 1 all_reduce: send to rank 2, recv from rank 0", for timeouts and errors
std::string TcpComm::traffic(const std::string& op, int to, int from) const {
  std::string what = describe(op) + ":";
  if (to >= 0) what += " send to " + peer_name(to);
  if (to >= 0 && from >= 0) what += ",";
  if (from >= 0) what += " recv from " + peer_name(from);
  return what;
}

// Every byte of every operation goes through here: sends send_bytes to rank `to`
// while receiving recv_bytes from rank `from` (-1: no peer that way), and counts
// them. Doing both at once is what lets two ranks send to each other without both
// blocking on full buffers. The link decides how: shared memory or socket.
void TcpComm::exchange(const std::string& what, int to, const void* send_data, size_t send_bytes, int from,
                       void* recv_data, size_t recv_bytes, OpStats& stats, bool shaped) {
  // bytes for another site leave when the simulated link would have delivered them
  // (a framed message's length header travels with its payload: not shaped apart)
  if (shaped && to >= 0 && send_bytes > 0 && wan_.crosses(world_ranks_[rank()], world_ranks_[to])) {
    const double seconds = wan_.seconds_for(send_bytes);
    if (seconds > timeout_seconds()) {
      fail(what + ": " + std::to_string(send_bytes) + " bytes take " + std::to_string(seconds) +
           " s on the simulated link, longer than the peer waits, --comm-timeout " +
           std::to_string(timeout_seconds()) + " s (hint: raise --comm-timeout or --wan-bandwidth)");
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
  try {
    link_send_and_recv(to >= 0 ? &links_[to] : nullptr, send_data, send_bytes, from >= 0 ? &links_[from] : nullptr,
                       recv_data, recv_bytes, timeout_seconds(), what);
  } catch (const PeerClosed& closed) {
    const CommFailure failure = closed_connection(what, closed.sending ? to : from);
    fail(failure.message, failure.echoed);
  } catch (const CommError& error) {
    fail(error.what());
  }
  stats.bytes_sent += send_bytes;
  stats.bytes_received += recv_bytes;
}

// A peer that closes its connection crashed, or stopped because it saw a failure
// first: one rank's death ripples around the ring as each neighbour stops in turn,
// so a rank's own neighbour is often not the one that died. The first rank to see a
// connection close is a neighbour of the dead one. It notes in the store whom it saw
// go, before it closes its own connections, and reports it; every later rank names
// that one too, but says nothing (echoed): one line for the job, not one per rank.
// Without the store (its host died, or left: see fail) a rank says what it saw.
CommFailure TcpComm::closed_connection(const std::string& what, int peer) {
  const std::string seen = peer_name(peer) + " closed the connection";
  const std::string hint = " (hint: " + peer_name(peer) + " probably crashed; see its output)";
  try {
    Store& store = *rendezvous_.client;
    const std::string first_key = failure_key_ + "/first";
    if (store.add(failure_key_ + "/count", 1) == 1) {
      store.set(first_key, std::to_string(world_ranks_[peer]) + " " + std::to_string(world_rank()));
      return {what + ": " + seen + hint, false};
    }
    // "<the world rank that closed first> <the world rank that saw it>"
    const std::string first = store.get(first_key, 5.0);
    const size_t space = first.find(' ');
    const std::string closed_first = first.substr(0, space), saw_it = first.substr(space + 1);
    if (closed_first == std::to_string(world_ranks_[peer])) return {what + ": " + seen + hint, true};
    return {what + ": " + seen + " after world rank " + saw_it + " saw world rank " + closed_first +
                " close its connection first (hint: world rank " + closed_first + " probably crashed; see its output)",
            true};
  } catch (const CommError&) {
    return {what + ": " + seen + hint, false};
  }
}

// After a failure this group is finished (comm.h). Shutting every socket down
// tells the peers at once (those on shared memory too: they sleep on the socket):
// they fail now instead of waiting out their timeout for bytes that never come.
void TcpComm::fail(const std::string& message, bool echoed) {
  for (Link& link : links_) {
    if (link.socket.valid()) shutdown(link.socket.fd(), SHUT_RDWR);
  }
  // A rank that hosts the store keeps it up a little (kStoreGraceSeconds) while the
  // others learn of the failure and read who died (closed_connection): if it left at
  // once, a survivor would find the record gone and speak too. Each survivor adds 1 to
  // the count when it sees a connection close; all but the dead rank do.
  if (rendezvous_.server) {
    try {
      Store& store = *rendezvous_.client;
      const double deadline = monotonic_seconds() + kStoreGraceSeconds;
      while (store.add(failure_key_ + "/count", 0) < size() - 1 && monotonic_seconds() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const CommError&) {
      // the store itself failed: nothing to keep up
    }
  }
  if (echoed) throw EchoedCommError(message);
  throw CommError(message);
}

// ----------------------------------------------------------------------------
// the ring
//
// The ranks form a ring: each sends only to its right neighbour (rank + 1) and
// receives only from its left (rank - 1). The buffer is cut into n blocks; block
// k ends up finished on rank k. With 4 ranks and blocks A B C D, rank r holding
// its own contribution a_r b_r c_r d_r:
//
// reduce-scatter: at step s rank r sends its partial sum of block r-s-1 and adds
// the partial of block r-s-2 that arrives into its own contribution to it.
//
//   step 0:  0 --D--> 1 --A--> 2 --B--> 3 --C--> 0    (its own contribution)
//   step 1:  0 --C--> 1 --D--> 2 --A--> 3 --B--> 0    (the partial it just made)
//   step 2:  0 --B--> 1 --C--> 2 --D--> 3 --A--> 0
//   now rank 0 holds A = a0+a1+a2+a3, rank 1 B, rank 2 C and rank 3 D
//
// all-gather: at step s rank r sends block r-s, the finished block it got last.
//
//   step 0:  0 --A--> 1 --B--> 2 --C--> 3 --D--> 0    (its own finished block)
//   step 1:  0 --D--> 1 --A--> 2 --B--> 3 --C--> 0    (the block it just received)
//   step 2:  0 --C--> 1 --D--> 2 --A--> 3 --B--> 0
//   now every rank holds A B C D
//
// Each phase is n-1 steps of one block (1/n of the data) per rank, so an
// all-reduce of B bytes sends 2(n-1)/n x B bytes from every rank: less than 2B
// however many ranks there are, and all links busy at every step. That is why it
// is called bandwidth-optimal.

// After this, `result` (count[rank] elements) holds the sum (or, for Max, the
// maximum) over ranks of this rank's block of `in`. `result` may be this rank's
// block of `in` itself. `name` is the operation, for error messages.
template <typename T>
void TcpComm::ring_reduce_scatter(const std::string& name, ReduceOp op, const T* in, const Blocks& blocks, T* result,
                                  OpStats& stats) {
  const int n = size(), me = rank();
  if (n == 1) {
    copy_elements(result, in + blocks.offset[0], blocks.count[0]);
    return;
  }
  const int right = ring_index(me + 1, n), left = ring_index(me - 1, n);
  const size_t largest = *std::max_element(blocks.count.begin(), blocks.count.end());
  T* incoming = scratch_of<T>(incoming_, largest);
  T* partial = scratch_of<T>(partial_, largest);
  const std::string what = traffic(name, right, left);

  const T* outgoing = in + blocks.offset[ring_index(me - 1, n)];
  for (int step = 0; step < n - 1; step++) {
    const int send_block = ring_index(me - step - 1, n);
    const int recv_block = ring_index(me - step - 2, n);
    exchange(what, right, outgoing, blocks.count[send_block] * sizeof(T), left, incoming,
             blocks.count[recv_block] * sizeof(T), stats);
    // The partial sum is sent on at the next step, after which `partial` is free
    // again. At the last step the block that arrives is this rank's own: its sum
    // is the result.
    T* sum = step == n - 2 ? result : partial;
    combine(op, sum, in + blocks.offset[recv_block], incoming, blocks.count[recv_block]);
    outgoing = sum;
  }
}

// Before: this rank's block of `data` is finished. After: every block is.
template <typename T>
void TcpComm::ring_all_gather(const std::string& op, T* data, const Blocks& blocks, OpStats& stats) {
  const int n = size(), me = rank();
  const int right = ring_index(me + 1, n), left = ring_index(me - 1, n);
  const std::string what = traffic(op, right, left);
  for (int step = 0; step < n - 1; step++) {
    const int send_block = ring_index(me - step, n);
    const int recv_block = ring_index(me - step - 1, n);
    exchange(what, right, data + blocks.offset[send_block], blocks.count[send_block] * sizeof(T), left,
             data + blocks.offset[recv_block], blocks.count[recv_block] * sizeof(T), stats);
  }
}

// Two ranks and a small message: one exchange of the whole buffer, then each rank
// adds the two copies itself. That sends what the ring sends (N values per rank)
// in one step instead of two, and a small message's time is the steps' latency:
// each step waits for the peer to be scheduled, which on an oversubscribed machine
// (chapter 07's 8 ranks on 2 cores) costs more than the bytes. Both ranks combine in
// rank order (rank 0's copy first), so both hold the same bits, NaNs included (the
// ring gets that by finishing each block on one rank). Larger messages keep the
// ring: it adds half the buffer per rank, and streams it in two halves.
constexpr size_t kOneExchangeMaxBytes = 256 * 1024;

template <typename T>
void TcpComm::all_reduce(T* data, size_t count, ReduceOp op, OpStats& stats) {
  if (size() == 2 && count * sizeof(T) <= kOneExchangeMaxBytes) {
    const int peer = 1 - rank();
    T* incoming = scratch_of<T>(incoming_, count);
    exchange(traffic("all_reduce", peer, peer), peer, data, count * sizeof(T), peer, incoming, count * sizeof(T),
             stats);
    const T* first = rank() == 0 ? data : incoming;
    const T* second = rank() == 0 ? incoming : data;
    combine(op, data, first, second, count);
    if (op == ReduceOp::Average) divide(data, count, 2);
    return;
  }
  const Blocks blocks = even_blocks(count, size());
  T* mine = data + blocks.offset[rank()];
  ring_reduce_scatter("all_reduce", op, data, blocks, mine, stats);
  // Averaging the one block this rank owns, before the gather spreads it, is n
  // times less work than averaging the whole buffer after.
  if (op == ReduceOp::Average) divide(mine, blocks.count[rank()], size());
  ring_all_gather("all_reduce", data, blocks, stats);
}

void TcpComm::do_all_reduce(void* data, size_t count, DType type, ReduceOp op, OpStats& stats) {
  if (type == DType::BF16) {
    all_reduce(static_cast<bf16*>(data), count, op, stats);
  } else {
    all_reduce(static_cast<float*>(data), count, op, stats);
  }
}

void TcpComm::do_reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                                ReduceOp op, OpStats& stats) {
  const Blocks blocks = blocks_from_counts(counts);
  if (type == DType::BF16) {
    ring_reduce_scatter("reduce_scatter", op, static_cast<const bf16*>(in), blocks, static_cast<bf16*>(out), stats);
    if (op == ReduceOp::Average) divide(static_cast<bf16*>(out), counts[rank()], size());
  } else {
    ring_reduce_scatter("reduce_scatter", op, static_cast<const float*>(in), blocks, static_cast<float*>(out),
                        stats);
    if (op == ReduceOp::Average) divide(static_cast<float*>(out), counts[rank()], size());
  }
}

void TcpComm::do_all_gather(const void* in, void* out, const std::vector<size_t>& counts, DType type,
                            OpStats& stats) {
  const Blocks blocks = blocks_from_counts(counts);
  const size_t element = dtype_bytes(type);
  // this rank's block into its place as bytes, then the ring: an all-gather only moves values
  auto* bytes = static_cast<unsigned char*>(out);
  copy_elements(bytes + blocks.offset[rank()] * element, static_cast<const unsigned char*>(in),
                counts[rank()] * element);
  if (type == DType::BF16) {
    ring_all_gather("all_gather", static_cast<bf16*>(out), blocks, stats);
  } else {
    ring_all_gather("all_gather", static_cast<float*>(out), blocks, stats);
  }
}

// ----------------------------------------------------------------------------
// all_to_all: a pairwise exchange
//
// At step s (1 .. n-1) rank r sends its block for rank r+s while it receives rank
// r-s's block for it. With 4 ranks:
//
//   step 1:  0 --> 1 --> 2 --> 3 --> 0
//   step 2:  0 --> 2, 1 --> 3, 2 --> 0, 3 --> 1
//   step 3:  0 --> 3 --> 2 --> 1 --> 0
//
// Every ordered pair of ranks meets once, so each block crosses the wire once and
// nothing is forwarded: a rank sends every block but its own, the least any
// algorithm can. Its own block is a copy. Unlike the ring, the partner changes at
// every step, so each step uses other links of the full mesh.

void TcpComm::do_all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                            const std::vector<size_t>& recv_counts, DType type, OpStats& stats) {
  const int n = size(), me = rank();
  const Blocks sends = blocks_from_counts(send_counts), receives = blocks_from_counts(recv_counts);
  const size_t element = dtype_bytes(type);
  const unsigned char* in_bytes = static_cast<const unsigned char*>(in);
  unsigned char* out_bytes = static_cast<unsigned char*>(out);
  copy_elements(out_bytes + receives.offset[me] * element, in_bytes + sends.offset[me] * element,
                recv_counts[me] * element);
  for (int step = 1; step < n; step++) {
    const int to = ring_index(me + step, n), from = ring_index(me - step, n);
    framed_exchange("all_to_all", to, in_bytes + sends.offset[to] * element, send_counts[to], from,
                    out_bytes + receives.offset[from] * element, recv_counts[from], type,
                    "send_counts[r] on rank s must equal recv_counts[s] on rank r", stats);
  }
}

// ----------------------------------------------------------------------------
// broadcast: a pipelined chain
//
// The ranks form a chain starting at the root: root -> root+1 -> ... -> root+n-1.
// Each rank forwards a chunk to the next while the following chunk arrives, so
// after a short fill every link of the chain carries data at once:
//
//   time 0:  root sends chunk 0
//   time 1:  root sends chunk 1, root+1 forwards chunk 0
//   time 2:  root sends chunk 2, root+1 forwards chunk 1, root+2 forwards chunk 0
//
// Every rank but the last sends the whole buffer once: no rank sends more than B
// bytes, where a root sending to everyone itself would send (n-1) x B.

void TcpComm::do_broadcast(float* data, size_t count, int root, OpStats& stats) {
  const int n = size();
  if (n == 1) return;
  const int position = ring_index(rank() - root, n);  // 0 for the root, n-1 for the end of the chain
  const int next = position < n - 1 ? ring_index(rank() + 1, n) : -1;
  const int previous = position > 0 ? ring_index(rank() - 1, n) : -1;
  const size_t bytes = count * sizeof(float);

  // The root only sends and the end of the chain only receives: the link
  // streams the bytes, so those two need no chunks.
  if (previous < 0) {
    exchange(traffic("broadcast", next, -1), next, data, bytes, -1, nullptr, 0, stats);
    return;
  }
  if (next < 0) {
    exchange(traffic("broadcast", -1, previous), -1, nullptr, 0, previous, data, bytes, stats);
    return;
  }
  // In the middle of the chain: receive chunk 0, then forward chunk c while
  // chunk c+1 arrives, then forward the last chunk.
  const size_t chunks = (count + kBroadcastChunkFloats - 1) / kBroadcastChunkFloats;
  if (chunks == 0) return;
  auto start = [&](size_t c) { return data + c * kBroadcastChunkFloats; };
  auto chunk_bytes = [&](size_t c) {
    return (std::min(count, (c + 1) * kBroadcastChunkFloats) - c * kBroadcastChunkFloats) * sizeof(float);
  };
  const std::string what = traffic("broadcast", next, previous);
  exchange(what, -1, nullptr, 0, previous, start(0), chunk_bytes(0), stats);
  for (size_t c = 0; c + 1 < chunks; c++) {
    exchange(what, next, start(c), chunk_bytes(c), previous, start(c + 1), chunk_bytes(c + 1), stats);
  }
  exchange(what, next, start(chunks - 1), chunk_bytes(chunks - 1), -1, nullptr, 0, stats);
}

// ----------------------------------------------------------------------------
// send and recv: straight to that peer
//
// A message to itself never touches the network: it waits in a queue until this
// rank receives it.

void TcpComm::do_send_recv(const void* send_data, size_t send_count, int to, void* recv_data, size_t recv_count,
                           int from, DType type, OpStats& stats) {
  const std::string op = to >= 0 && from >= 0 ? "send_recv" : to >= 0 ? "send" : "recv";
  const size_t element = dtype_bytes(type);
  if (to == rank()) {
    const unsigned char* bytes = static_cast<const unsigned char*>(send_data);
    to_self_.emplace_back(std::vector<unsigned char>(bytes, bytes + send_count * element), send_count);
    to = -1;
  }
  if (from == rank()) {
    if (to_self_.empty()) {
      fail(describe(op) + ": receive from itself, but it has sent itself nothing (hint: the send to itself must "
           "come first)");
    }
    if (to_self_.front().second != recv_count || to_self_.front().first.size() != recv_count * element) {
      fail(describe(op) + ": it sent itself " + std::to_string(to_self_.front().second) + " values but receives " +
           std::to_string(recv_count) + " " + dtype_name(type) + " values (hint: the send and the recv must agree " +
           "on the count and the type)");
    }
    copy_elements(static_cast<unsigned char*>(recv_data), to_self_.front().first.data(), recv_count * element);
    to_self_.pop_front();
    from = -1;
  }
  if (to < 0 && from < 0) return;
  framed_exchange(op, to, send_data, send_count, from, recv_data, recv_count, type,
                  "the send and the recv must agree on the count", stats);
}

// Each message starts with its length in values (8 bytes, not counted in the stats),
// so a receiver that expects a different size fails with a message that says so (and
// `hint`) instead of reading the wrong bytes.
void TcpComm::framed_exchange(const std::string& op, int to, const void* send_data, size_t send_count, int from,
                              void* recv_data, size_t recv_count, DType type, const std::string& hint,
                              OpStats& stats) {
  const std::string what = traffic(op, to, from);
  OpStats framing;  // the length headers are not payload
  uint64_t sent_length = send_count, received_length = 0;
  exchange(what, to, &sent_length, to >= 0 ? sizeof(sent_length) : 0, from, &received_length,
           from >= 0 ? sizeof(received_length) : 0, framing, /*shaped=*/false);
  if (from >= 0 && received_length != recv_count) {
    fail(what + ": " + peer_name(from) + " sends " + std::to_string(received_length) + " values but this rank " +
         "expects " + std::to_string(recv_count) + " (hint: " + hint + ")");
  }
  const size_t element = dtype_bytes(type);
  exchange(what, to, send_data, send_count * element, from, recv_data, recv_count * element, stats);
}

// ----------------------------------------------------------------------------
// barrier: dissemination
//
// In round j every rank sends one byte to the rank 2^j to its right and waits for
// one from the rank 2^j to its left. With 8 ranks:
//
//   round 0 (distance 1):  r --> r+1
//   round 1 (distance 2):  r --> r+2
//   round 2 (distance 4):  r --> r+4
//
// After round j, a rank has heard, directly or through the ranks it heard from,
// from the 2^(j+1) - 1 ranks to its left. After ceil(log2 n) rounds that is all
// of them, so no rank leaves before every rank has arrived. Every rank sends one
// byte a round: log2(n) steps, where a token going around the ring takes n.

void TcpComm::dissemination_barrier(const std::string& op, OpStats& stats) {
  const int n = size();
  for (int distance = 1; distance < n; distance *= 2) {
    const int to = ring_index(rank() + distance, n), from = ring_index(rank() - distance, n);
    const char token = 1;
    char received = 0;
    exchange(traffic(op, to, from), to, &token, 1, from, &received, 1, stats);
  }
}

void TcpComm::do_barrier(OpStats& stats) { dissemination_barrier("barrier", stats); }

// ----------------------------------------------------------------------------
// split: new groups, each with its own mesh
//
// Every rank publishes its (color, key) in the store and reads everyone else's.
// split is collective, so every rank of this group calls it the same number of
// times in the same order: the split counter names the same exchange on all of
// them. The ranks with the same color, ordered by (key, rank here), become a new
// group that connects its own mesh under a prefix no other group uses.

std::unique_ptr<Comm> TcpComm::do_split(int color, int key) {
  const int n = size();
  const std::string scope = prefix_ + "/split" + std::to_string(splits_++);
  std::vector<std::pair<int, int>> choices(n);  // choices[r] = (color, key) of rank r
  choices[rank()] = {color, key};
  if (n > 1) {
    Store& store = *rendezvous_.client;
    store.set(scope + "/choice/" + std::to_string(rank()), std::to_string(color) + " " + std::to_string(key));
    for (int r = 0; r < n; r++) {
      if (r == rank()) continue;
      const std::string choice = store.get(scope + "/choice/" + std::to_string(r));
      const size_t space = choice.find(' ');
      choices[r] = {std::stoi(choice.substr(0, space)), std::stoi(choice.substr(space + 1))};
    }
  }

  std::unique_ptr<Comm> group;
  if (color >= 0) {
    std::vector<int> members;  // ranks here, in the order of their rank in the new group
    for (int r = 0; r < n; r++) {
      if (choices[r].first == color) members.push_back(r);
    }
    std::sort(members.begin(), members.end(), [&](int a, int b) {
      return std::make_pair(choices[a].second, a) < std::make_pair(choices[b].second, b);
    });
    const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    std::vector<int> member_world_ranks;
    for (int r : members) member_world_ranks.push_back(world_ranks_[r]);
    group = std::make_unique<TcpComm>(new_rank, static_cast<int>(members.size()), timeout_seconds(), rendezvous_,
                                      scope + "/color" + std::to_string(color), failure_key_,
                                      std::move(member_world_ranks), transport_, wan_);
  }
  // Each new group waits only for its own members. This barrier over the old
  // group also waits for the other colors, so no process leaves split (and maybe
  // shuts a store it hosts) while another group still needs the store.
  OpStats rendezvous;
  dissemination_barrier("split", rendezvous);
  return group;
}

}  // namespace

// ----------------------------------------------------------------------------
// the factory

std::unique_ptr<Comm> create_tcp_comm(const LaunchEnv& env, double timeout_seconds, const WanLayout& wan) {
  const Transport transport = transport_from_env();
  if (env.world_size == 1) {
    // a world of one: every collective is a copy, and there is nobody to meet
    return std::make_unique<TcpComm>(0, 1, timeout_seconds, Rendezvous{}, "", "", std::vector<int>{0}, transport, wan);
  }
  Rendezvous rendezvous = connect_rendezvous(env, timeout_seconds);

  // A store can outlive one world: the launcher restarts the group on its store,
  // and a program may create several worlds in turn. Each world needs keys of its
  // own, or it would read the addresses of the last one. The restart count
  // separates restarts; within one, the n ranks of a world all join (add 1)
  // before any of them can finish connecting, so joins 1..n of the count belong
  // to world 0, n+1..2n to world 1, and so on.
  const std::string scope = "tcp/restart" + std::to_string(env.restart_count);
  const int64_t joined = rendezvous.client->add(scope + "/joined", 1);
  const std::string prefix = scope + "/world" + std::to_string((joined - 1) / env.world_size);

  std::vector<int> world_ranks(env.world_size);
  for (int r = 0; r < env.world_size; r++) world_ranks[r] = r;
  return std::make_unique<TcpComm>(env.rank, env.world_size, timeout_seconds, std::move(rendezvous), prefix,
                                   prefix + "/first_closed", std::move(world_ranks), transport, wan);
}

std::unique_ptr<Comm> create_tcp_group(const LaunchEnv& env, const std::vector<int>& members,
                                       const std::string& key_prefix, double timeout_seconds, const WanLayout& wan) {
  const auto me = std::find(members.begin(), members.end(), env.rank);
  if (me == members.end()) {
    throw CourseError("rank " + std::to_string(env.rank) + ": create_tcp_group: not one of the group's members " +
                      "(hint: a bug in the caller)");
  }
  const int rank = static_cast<int>(me - members.begin());
  const int size = static_cast<int>(members.size());
  Rendezvous rendezvous = size > 1 ? connect_rendezvous(env, timeout_seconds) : Rendezvous{};
  return std::make_unique<TcpComm>(rank, size, timeout_seconds, std::move(rendezvous), key_prefix,
                                   key_prefix + "/first_closed", members, transport_from_env(), wan);
}

}  // namespace course
