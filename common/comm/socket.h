// TCP sockets with deadlines: the plumbing under the store and the tcp backend.
//
// Every blocking call takes a deadline and a description of what it is doing
// ("rank 1 all_reduce: recv from rank 2"), so that a dead or stuck peer becomes a
// CommError naming the operation and the peer instead of a hang.
#pragma once

#include <cstddef>
#include <string>

#include "common/tensor/error.h"

namespace course {

// A failure to communicate: timeout, a peer that went away, a refused connection.
class CommError : public CourseError {
 public:
  explicit CommError(const std::string& message) : CourseError(message, 1) {}
};

// A failure this rank only ran into: another rank reports its cause (comm_tcp.cpp's
// closed_connection: a rank that stopped because it saw a peer die), so this one exits
// without saying it again.
class EchoedCommError : public CommError {
 public:
  explicit EchoedCommError(const std::string& message) : CommError(message) {}
  bool reported_by_another_rank() const override { return true; }
};

// The peer at the other end closed the connection, or reset it: it crashed, or it
// stopped after an error of its own. `sending` says which way this rank was moving
// bytes when it noticed, so that a caller with two peers can name the one that left.
class PeerClosed : public CommError {
 public:
  PeerClosed(const std::string& message, bool sending) : CommError(message), sending(sending) {}
  bool sending;
};

// Seconds on a monotonic clock: deadlines are monotonic_seconds() + timeout.
double monotonic_seconds();
// Milliseconds left until `deadline`, for poll(); once it has passed, a CommError
// "<what>: timed out after <timeout_seconds> s (hint: ...)".
int milliseconds_left(double deadline, double timeout_seconds, const std::string& what);

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { close(); }
  Socket(Socket&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void close();

  // Exactly `bytes`, or CommError("<what>: ...") on timeout or a closed connection.
  void send_all(const void* data, size_t bytes, double timeout_seconds, const std::string& what);
  void recv_all(void* data, size_t bytes, double timeout_seconds, const std::string& what);

 private:
  int fd_ = -1;
};

// Sends to one socket while receiving from another (either may be the same socket),
// so two ranks that send to each other at once never both block on full buffers.
void send_and_recv(Socket& to, const void* send_data, size_t send_bytes, Socket& from, void* recv_data,
                   size_t recv_bytes, double timeout_seconds, const std::string& what);

// Listens on host:port (port 0: any free port; *bound_port gets the real one).
// A taken port is a CommError that says so.
Socket listen_on(const std::string& host, int port, int* bound_port);
Socket accept_one(Socket& listener, double timeout_seconds, const std::string& what);
// The next connection already waiting on a listener, without waiting: an invalid
// Socket when there is none. A server drains its queue with it (store.h).
Socket accept_waiting(Socket& listener, const std::string& what);
// Connects, retrying until the deadline: the peer may not be listening yet.
Socket connect_to(const std::string& host, int port, double timeout_seconds, const std::string& what);
// The local address a connected socket uses, e.g. "10.0.0.5": the address other
// machines can reach this one at.
std::string local_address(const Socket& socket);
// A connected socket's endpoint, "ip:port": its own (getsockname), or with peer its
// peer's (getpeername); "" when it has none (not IPv4, or not connected).
std::string endpoint_of(const Socket& socket, bool peer);

}  // namespace course
