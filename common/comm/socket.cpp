#include "common/comm/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/comm/comm_util.h"

namespace course {

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int milliseconds_left(double deadline, double timeout_seconds, const std::string& what) {
  double left = deadline - monotonic_seconds();
  if (left <= 0) {
    throw CommError(what + ": timed out after " + seconds_text(timeout_seconds) +
                    " s (hint: a peer is dead or stuck; raise --comm-timeout if it is just slow)");
  }
  // capped: the store's "forever" (1e9 s) must not overflow poll()'s int
  return static_cast<int>(std::min(left * 1000, 1e9)) + 1;
}

namespace {

std::string system_error(const std::string& what, const char* call) {
  return what + ": " + call + " failed: " + std::strerror(errno);
}

void set_options(int fd) {
  int one = 1;
  // small messages (store requests, ring steps of tiny buffers) go out at once
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) < 0) {
    throw CommError(system_error("socket", "setsockopt(TCP_NODELAY)"));
  }
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) throw CommError(system_error("socket", "fcntl"));
}

sockaddr_in resolve(const std::string& host, int port, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  int status = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (status != 0 || result == nullptr) {
    throw CommError(what + ": cannot resolve host '" + host + "': " + gai_strerror(status) +
                    " (hint: check --master-addr / MASTER_ADDR)");
  }
  sockaddr_in address = *reinterpret_cast<sockaddr_in*>(result->ai_addr);
  freeaddrinfo(result);
  address.sin_port = htons(static_cast<uint16_t>(port));
  return address;
}

}  // namespace

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::send_all(const void* data, size_t bytes, double timeout_seconds, const std::string& what) {
  Socket none;
  send_and_recv(*this, data, bytes, none, nullptr, 0, timeout_seconds, what);
}

void Socket::recv_all(void* data, size_t bytes, double timeout_seconds, const std::string& what) {
  Socket none;
  send_and_recv(none, nullptr, 0, *this, data, bytes, timeout_seconds, what);
}

void send_and_recv(Socket& to, const void* send_data, size_t send_bytes, Socket& from, void* recv_data,
                   size_t recv_bytes, double timeout_seconds, const std::string& what) {
  const double deadline = monotonic_seconds() + timeout_seconds;
  const char* send_cursor = static_cast<const char*>(send_data);
  char* recv_cursor = static_cast<char*>(recv_data);
  size_t to_send = send_bytes, to_recv = recv_bytes;
  while (to_send > 0 || to_recv > 0) {
    pollfd fds[2];
    int count = 0;
    int send_index = -1, recv_index = -1;
    if (to_send > 0) {
      send_index = count;
      fds[count++] = {to.fd(), POLLOUT, 0};
    }
    if (to_recv > 0) {
      if (send_index >= 0 && from.fd() == to.fd()) {
        fds[send_index].events |= POLLIN;
        recv_index = send_index;
      } else {
        recv_index = count;
        fds[count++] = {from.fd(), POLLIN, 0};
      }
    }
    int ready = poll(fds, count, milliseconds_left(deadline, timeout_seconds, what));
    if (ready < 0) {
      if (errno == EINTR) continue;
      throw CommError(system_error(what, "poll"));
    }
    if (to_recv > 0 && (fds[recv_index].revents & (POLLIN | POLLHUP | POLLERR))) {
      ssize_t got = ::recv(from.fd(), recv_cursor, to_recv, 0);
      if (got == 0) throw PeerClosed(what + ": the peer closed the connection (hint: it probably crashed; see its output)", false);
      if (got < 0 && errno == ECONNRESET) throw PeerClosed(system_error(what, "recv"), false);
      if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        throw CommError(system_error(what, "recv"));
      }
      if (got > 0) {
        recv_cursor += got;
        to_recv -= static_cast<size_t>(got);
      }
    }
    if (to_send > 0 && (fds[send_index].revents & (POLLOUT | POLLHUP | POLLERR))) {
      ssize_t sent = ::send(to.fd(), send_cursor, to_send, MSG_NOSIGNAL);
      if (sent < 0 && (errno == EPIPE || errno == ECONNRESET)) {
        throw PeerClosed(system_error(what, "send") + " (hint: the peer probably crashed; see its output)", true);
      }
      if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        throw CommError(system_error(what, "send") + " (hint: the peer probably crashed; see its output)");
      }
      if (sent > 0) {
        send_cursor += sent;
        to_send -= static_cast<size_t>(sent);
      }
    }
  }
}

// How many connections the kernel holds for accept, handshake done. When they are that
// many it drops new ones unanswered (their connectors try again, connect_to), and when
// they are many more than a server takes in a few milliseconds, a client waits behind
// them all. Measured, the store under a flood of silent connections on a busy 2-core
// machine: with 4096 a client waited 0.25 to 0.3 s (median) behind queued strangers,
// with 128 about 2 ms (at most 0.14 s).
constexpr int kListenBacklog = 128;

Socket listen_on(const std::string& host, int port, int* bound_port) {
  const std::string what = "listen on " + host + ":" + std::to_string(port);
  Socket listener(::socket(AF_INET, SOCK_STREAM, 0));
  if (!listener.valid()) throw CommError(system_error(what, "socket"));
  int one = 1;
  setsockopt(listener.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in address = resolve(host, port, what);
  if (bind(listener.fd(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) < 0) {
    if (errno == EADDRINUSE) {
      throw CommError(what + ": the port is already in use (hint: pick another --master-port, or 0 for any free one)");
    }
    throw CommError(system_error(what, "bind"));
  }
  if (::listen(listener.fd(), kListenBacklog) < 0) throw CommError(system_error(what, "listen"));
  set_options(listener.fd());
  if (bound_port != nullptr) {
    socklen_t length = sizeof(address);
    getsockname(listener.fd(), reinterpret_cast<sockaddr*>(&address), &length);
    *bound_port = ntohs(address.sin_port);
  }
  return listener;
}

Socket accept_waiting(Socket& listener, const std::string& what) {
  for (;;) {
    Socket client(::accept(listener.fd(), nullptr, nullptr));
    if (client.valid()) {
      set_options(client.fd());  // owned by `client` already: no leak if this throws
      return client;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) return client;
    if (errno != EINTR && errno != ECONNABORTED) {
      throw CommError(system_error(what, "accept") + " (hint: if it says too many open files, raise `ulimit -n`)");
    }
  }
}

Socket accept_one(Socket& listener, double timeout_seconds, const std::string& what) {
  const double deadline = monotonic_seconds() + timeout_seconds;
  for (;;) {
    pollfd fd{listener.fd(), POLLIN, 0};
    int ready = poll(&fd, 1, milliseconds_left(deadline, timeout_seconds, what));
    if (ready < 0 && errno != EINTR) throw CommError(system_error(what, "poll"));
    if (ready <= 0) continue;
    Socket client = accept_waiting(listener, what);
    if (client.valid()) return client;
  }
}

// A connection attempt's first wait for the peer's answer, and the most any one waits.
// A listener whose queue of connections is full drops the request unanswered, and the
// kernel would send it again only after 1 s, then 3 s: a short attempt sends a new one
// instead, while a slow network, whose answer takes longer, gets attempts twice as long
// each time, up to the cap (longer than any round trip a training cluster has).
constexpr double kFirstAttemptSeconds = 0.02;
constexpr double kLongestAttemptSeconds = 1.0;

Socket connect_to(const std::string& host, int port, double timeout_seconds, const std::string& what) {
  const double deadline = monotonic_seconds() + timeout_seconds;
  const std::string where = what + " (" + host + ":" + std::to_string(port) + ")";
  sockaddr_in address = resolve(host, port, what);
  double attempt_seconds = kFirstAttemptSeconds;
  for (;;) {
    Socket socket(::socket(AF_INET, SOCK_STREAM, 0));
    if (!socket.valid()) throw CommError(system_error(what, "socket"));
    // non-blocking before connect: a host that silently drops the packets (a
    // firewall, a wrong address) would otherwise block here for minutes, past
    // any deadline
    set_options(socket.fd());
    int status = ::connect(socket.fd(), reinterpret_cast<sockaddr*>(&address), sizeof(address));
    int error = status == 0 ? 0 : errno;
    if (error == EINPROGRESS) {
      pollfd connecting{socket.fd(), POLLOUT, 0};
      const int attempt_milliseconds = static_cast<int>(attempt_seconds * 1000);
      int ready =
          poll(&connecting, 1, std::min(attempt_milliseconds, milliseconds_left(deadline, timeout_seconds, where)));
      if (ready < 0 && errno != EINTR) throw CommError(system_error(where, "poll"));
      socklen_t length = sizeof(error);
      if (ready <= 0) {
        error = ETIMEDOUT;  // this attempt ran out of time; the deadline check below decides
      } else if (getsockopt(socket.fd(), SOL_SOCKET, SO_ERROR, &error, &length) < 0) {
        throw CommError(system_error(where, "getsockopt(SO_ERROR)"));
      }
    }
    if (error == 0) return socket;
    if (error != ECONNREFUSED && error != ETIMEDOUT && error != ENETUNREACH && error != EINTR) {
      errno = error;
      throw CommError(system_error(where, "connect"));
    }
    milliseconds_left(deadline, timeout_seconds, where);
    if (error == ETIMEDOUT) {
      attempt_seconds = std::min(2 * attempt_seconds, kLongestAttemptSeconds);  // unanswered: at once, longer
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // not listening yet: try again shortly
    }
  }
}

std::string endpoint_of(const Socket& socket, bool peer) {
  sockaddr_in address{};
  socklen_t length = sizeof(address);
  sockaddr* raw = reinterpret_cast<sockaddr*>(&address);
  const int status = peer ? getpeername(socket.fd(), raw, &length) : getsockname(socket.fd(), raw, &length);
  if (status != 0 || address.sin_family != AF_INET) return "";
  char text[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &address.sin_addr, text, sizeof(text));
  return std::string(text) + ":" + std::to_string(ntohs(address.sin_port));
}

std::string local_address(const Socket& socket) {
  sockaddr_in address{};
  socklen_t length = sizeof(address);
  if (getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&address), &length) < 0) return "127.0.0.1";
  char text[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &address.sin_addr, text, sizeof(text));
  return text;
}

}  // namespace course
