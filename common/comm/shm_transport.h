// Shared memory between ranks on one machine: the tcp backend's fast path.
//
// Over loopback TCP the kernel copies every byte twice (into the socket buffer
// and out of it), a few kilobytes per packet, with a system call each time. Two
// processes on one machine can do better: map the same memory and copy through
// it. Each direction of such a pair gets a ring buffer in POSIX shared memory
// (shm_open + mmap): the sender copies into it, the receiver copies out, and
// neither enters the kernel while data keeps flowing.
//
// The pair's socket stays open beside the rings, carrying no data but doing two
// jobs the rings cannot:
//   doorbell   a side that finds nothing to do sleeps in poll() on the socket;
//              the other side sends it one byte when it has made progress
//   liveness   when a process dies the kernel closes its sockets, so the sleeper
//              wakes up to "the peer closed the connection", not a hang
// Every wait still has the deadline and the description the socket path has.
//
// COURSE_TCP_TRANSPORT picks the transport: socket (always TCP), shm (shared
// memory between every pair, an error where that is impossible) or auto (the
// default: shared memory for pairs on the same machine, TCP for the rest).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/comm/socket.h"

namespace course {

enum class Transport { Socket, Shm, Auto };

// COURSE_TCP_TRANSPORT, Auto when unset; UsageError when it is something else.
Transport transport_from_env();

// One direction between two processes on this machine: a single-producer,
// single-consumer ring buffer in shared memory. The receiver creates it; the
// sender opens it by name and proves it reached the same memory by reading the
// secret the receiver wrote there (the same name on another machine, or in
// another container, is other memory).
class ShmRing {
 public:
  // A new ring (CommError when shared memory cannot be had, e.g. /dev/shm is full).
  static std::unique_ptr<ShmRing> create(size_t capacity);
  // The ring another process created; nullptr when this process cannot reach it.
  static std::unique_ptr<ShmRing> open(const std::string& name, uint64_t secret);
  ~ShmRing();
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;

  const std::string& name() const { return name_; }
  uint64_t secret() const;
  // Removes the name: the memory lives on while mapped, and nothing is left
  // behind in /dev/shm when the processes end, however they end.
  void unlink();

  // Copy in (sender) or out (receiver) as much as fits or is there, up to
  // `bytes`, without waiting; returns how many bytes moved.
  size_t write_some(const void* data, size_t bytes);
  size_t read_some(void* data, size_t bytes);
  bool has_room() const;
  bool has_data() const;

  // The sleeping protocol. A side about to sleep raises its flag, then looks at
  // the ring once more; a side that has just moved data takes the other's flag
  // down and, if it was up, rings the doorbell. Both use sequentially consistent
  // atomics, so either the sleeper sees the progress or the mover sees the flag:
  // a wake-up is never lost.
  void set_reader_sleeping(bool sleeping);
  void set_writer_sleeping(bool sleeping);
  bool take_reader_sleeping();
  bool take_writer_sleeping();

 private:
  struct Header;
  ShmRing(std::string name, void* memory, size_t mapped_bytes, bool owner);
  std::string name_;
  Header* header_;
  char* data_;
  size_t mapped_bytes_;
  bool linked_;  // this process created the name and has not removed it yet
};

// The connection to one peer: its socket, and when the pair shares memory, a
// ring each way.
struct Link {
  Socket socket;
  std::unique_ptr<ShmRing> out;  // this rank -> peer
  std::unique_ptr<ShmRing> in;   // peer -> this rank
};

// Gives each pair of connected links that can share memory its two rings. Every
// rank of the group calls it at once, with its links by rank (its own invalid);
// the pairs agree through their sockets. Rings stay off under Transport::Socket;
// under Transport::Shm a pair that cannot share memory is a CommError.
void share_memory(std::vector<Link>& links, int self, Transport transport, double timeout_seconds,
                  const std::string& what);

// send_and_recv over links: sends to `to` while receiving from `from` (either
// may be null when its byte count is 0), each through the rings when the link
// has them and through the socket otherwise.
void link_send_and_recv(Link* to, const void* send_data, size_t send_bytes, Link* from, void* recv_data,
                        size_t recv_bytes, double timeout_seconds, const std::string& what);

}  // namespace course
