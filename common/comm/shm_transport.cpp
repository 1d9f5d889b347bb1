#include "common/comm/shm_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>
#include <thread>

#include "common/tensor/error.h"

namespace course {

namespace {

// Each ring holds this much. Bigger rings let a sender run further ahead of a
// receiver that is busy (or, on an oversubscribed laptop, not scheduled), but a
// group of n ranks on one machine holds n(n-1) rings: 56 MB of /dev/shm for 8
// ranks, and some containers have only 64 MB. Measured on 2 cores, 256 KB and
// 4 MB rings were both slower than 1 MB.
constexpr size_t kRingBytes = 1 << 20;
// A sender publishes its progress after each slice, so the receiver starts
// copying out the first slice while the next is copied in.
constexpr size_t kSliceBytes = 64 * 1024;
// Looks at the rings this many times (yielding the core between looks) before
// sleeping: a peer that is copying makes room or data within microseconds, far
// sooner than a sleep and a wake-up through the kernel would notice.
constexpr int kLooksBeforeSleep = 200;
// The ring's bytes start a page after the header.
constexpr size_t kDataOffset = 4096;

std::string system_error(const std::string& what, const char* call, int error) {
  return what + ": " + call + " failed: " + std::strerror(error);
}

uint64_t random_u64() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}

std::string peer_closed(const std::string& what) {
  return what + ": the peer closed the connection (hint: it probably crashed; see its output)";
}

// The socket half of a link, one call at a time without waiting: bytes moved,
// 0 when the socket is not ready.
size_t send_some(Socket& socket, const char* data, size_t bytes, const std::string& what) {
  ssize_t sent = ::send(socket.fd(), data, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (sent >= 0) return static_cast<size_t>(sent);
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
  const std::string message = system_error(what, "send", errno) + " (hint: the peer probably crashed; see its output)";
  if (errno == EPIPE || errno == ECONNRESET) throw PeerClosed(message, true);
  throw CommError(message);
}

size_t recv_some(Socket& socket, char* data, size_t bytes, const std::string& what) {
  ssize_t got = ::recv(socket.fd(), data, bytes, MSG_DONTWAIT);
  if (got == 0) throw PeerClosed(peer_closed(what), false);
  if (got > 0) return static_cast<size_t>(got);
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
  if (errno == ECONNRESET) throw PeerClosed(system_error(what, "recv", errno), false);
  throw CommError(system_error(what, "recv", errno));
}

// Wakes the peer sleeping on the other end of a shared-memory link: the one this
// rank sends to (to_receiver) or receives from, which is who a failure names.
void ring_doorbell(Socket& socket, bool to_receiver, const std::string& what) {
  const char bell = 0;
  try {
    // A full socket buffer means the peer has unread doorbells already: those wake it.
    send_some(socket, &bell, 1, what);
  } catch (const PeerClosed& closed) {
    throw PeerClosed(closed.what(), to_receiver);
  }
}

// Takes the doorbells off a shared-memory link's socket. Returns false when the
// socket has closed: the peer is gone.
bool drain_doorbells(Socket& socket, const std::string& what) {
  char bells[64];
  for (;;) {
    ssize_t got = ::recv(socket.fd(), bells, sizeof(bells), MSG_DONTWAIT);
    if (got > 0 || (got < 0 && errno == EINTR)) continue;
    if (got == 0 || errno == ECONNRESET) return false;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    throw CommError(system_error(what, "recv", errno));
  }
}

}  // namespace

Transport transport_from_env() {
  const char* text = std::getenv("COURSE_TCP_TRANSPORT");
  if (text == nullptr || std::strcmp(text, "auto") == 0) return Transport::Auto;
  if (std::strcmp(text, "socket") == 0) return Transport::Socket;
  if (std::strcmp(text, "shm") == 0) return Transport::Shm;
  throw UsageError(std::string("COURSE_TCP_TRANSPORT='") + text + "' must be socket, shm or auto");
}

// ----------------------------------------------------------------------------
// the ring
//
// Two counters of bytes ever moved: `written` only grows by the sender's hand,
// `read` only by the receiver's. written - read bytes wait in the ring, starting
// at read % capacity; the rest is room. Each side only ever stores its own
// counter, so the ring needs no lock: publishing a counter with release order
// makes the bytes before it visible to the side that loads it with acquire.
// The two counters sit on separate cache lines so the sides do not fight over one.

struct ShmRing::Header {
  uint64_t secret;
  uint64_t capacity;
  alignas(64) std::atomic<uint64_t> written;
  std::atomic<uint32_t> writer_sleeping;
  alignas(64) std::atomic<uint64_t> read;
  std::atomic<uint32_t> reader_sleeping;
};

ShmRing::ShmRing(std::string name, void* memory, size_t mapped_bytes, bool owner)
    : name_(std::move(name)),
      header_(static_cast<Header*>(memory)),
      data_(static_cast<char*>(memory) + kDataOffset),
      mapped_bytes_(mapped_bytes),
      linked_(owner) {}

ShmRing::~ShmRing() {
  unlink();
  munmap(header_, mapped_bytes_);
}

std::unique_ptr<ShmRing> ShmRing::create(size_t capacity) {
  static_assert(sizeof(Header) <= kDataOffset, "the ring's header must fit before its data");
  // Two processes share these atomics, so they must be plain memory, not a lock
  // inside one process.
  static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
                "shared-memory counters need lock-free atomics");
  const std::string name = "/course-tcp-" + std::to_string(getpid()) + "-" + std::to_string(random_u64());
  const std::string what = "shared memory " + name;
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw CommError(system_error(what, "shm_open", errno));
  const size_t bytes = kDataOffset + capacity;
  // Reserve every page now: a /dev/shm too small for the ring is an error here,
  // not a SIGBUS in the middle of a training step.
  int status = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* memory = status == 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (status == 0 && memory == MAP_FAILED) status = errno;
  close(fd);
  if (status != 0) {
    shm_unlink(name.c_str());
    throw CommError(system_error(what, "posix_fallocate/mmap", status) +
                    " (hint: /dev/shm may be too small: in Docker, --shm-size=1g; or COURSE_TCP_TRANSPORT=socket)");
  }
  Header* header = new (memory) Header();
  header->secret = random_u64();
  header->capacity = capacity;
  return std::unique_ptr<ShmRing>(new ShmRing(name, memory, bytes, true));
}

std::unique_ptr<ShmRing> ShmRing::open(const std::string& name, uint64_t secret) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return nullptr;  // no such name here: the creator is on another machine
  struct stat info {};
  void* memory = MAP_FAILED;
  if (fstat(fd, &info) == 0 && static_cast<size_t>(info.st_size) > kDataOffset) {
    memory = mmap(nullptr, info.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (memory == MAP_FAILED) return nullptr;
  const Header* header = static_cast<const Header*>(memory);
  if (header->secret != secret || header->capacity + kDataOffset != static_cast<size_t>(info.st_size)) {
    munmap(memory, info.st_size);  // the same name, other memory: not the creator's ring
    return nullptr;
  }
  return std::unique_ptr<ShmRing>(new ShmRing(name, memory, info.st_size, false));
}

uint64_t ShmRing::secret() const { return header_->secret; }

void ShmRing::unlink() {
  if (linked_) shm_unlink(name_.c_str());
  linked_ = false;
}

size_t ShmRing::write_some(const void* data, size_t bytes) {
  const uint64_t capacity = header_->capacity;
  const uint64_t written = header_->written.load(std::memory_order_relaxed);  // only this side stores it
  const uint64_t read = header_->read.load(std::memory_order_acquire);        // the reader is done with those
  const size_t count = std::min({bytes, static_cast<size_t>(capacity - (written - read)), kSliceBytes});
  if (count == 0) return 0;
  // the room may wrap around the end of the ring: at most two copies
  const size_t start = written % capacity;
  const size_t first = std::min(count, static_cast<size_t>(capacity - start));
  std::memcpy(data_ + start, data, first);
  std::memcpy(data_, static_cast<const char*>(data) + first, count - first);
  header_->written.store(written + count, std::memory_order_seq_cst);
  return count;
}

size_t ShmRing::read_some(void* data, size_t bytes) {
  const uint64_t capacity = header_->capacity;
  const uint64_t read = header_->read.load(std::memory_order_relaxed);           // only this side stores it
  const uint64_t written = header_->written.load(std::memory_order_acquire);     // the bytes before it are there
  const size_t count = std::min({bytes, static_cast<size_t>(written - read), kSliceBytes});
  if (count == 0) return 0;
  const size_t start = read % capacity;
  const size_t first = std::min(count, static_cast<size_t>(capacity - start));
  std::memcpy(data, data_ + start, first);
  std::memcpy(static_cast<char*>(data) + first, data_, count - first);
  header_->read.store(read + count, std::memory_order_seq_cst);
  return count;
}

bool ShmRing::has_room() const { return header_->written.load() - header_->read.load() < header_->capacity; }
bool ShmRing::has_data() const { return header_->written.load() != header_->read.load(); }
void ShmRing::set_reader_sleeping(bool sleeping) { header_->reader_sleeping.store(sleeping ? 1 : 0); }
void ShmRing::set_writer_sleeping(bool sleeping) { header_->writer_sleeping.store(sleeping ? 1 : 0); }
bool ShmRing::take_reader_sleeping() { return header_->reader_sleeping.exchange(0) != 0; }
bool ShmRing::take_writer_sleeping() { return header_->writer_sleeping.exchange(0) != 0; }

// ----------------------------------------------------------------------------
// pairing up: which peers share this machine
//
// Rather than guess from host names (containers on one host may not share
// /dev/shm; two machines may both be called "localhost"), each pair tries:
//   1. each rank creates a ring for every peer to write to it, and sends the
//      peer its name and secret (an empty name: no offer, under socket)
//   2. each rank opens the rings offered to it and answers 1 if it found the
//      secret there, 0 if not
//   3. a pair uses shared memory if both answered 1; the names are removed
// The messages are tiny, so sending to every peer before receiving from any
// never blocks, and the ranks cannot wait on each other in a circle.

namespace {
struct Offer {
  char name[64];
  uint64_t secret;
};
}  // namespace

void share_memory(std::vector<Link>& links, int self, Transport transport, double timeout_seconds,
                  const std::string& what) {
  const int n = static_cast<int>(links.size());
  auto peer_what = [&](int peer) { return what + ": shared memory with rank " + std::to_string(peer); };

  std::vector<std::unique_ptr<ShmRing>> offered(n), opened(n);
  for (int peer = 0; peer < n; peer++) {
    if (peer == self) continue;
    Offer offer{};
    if (transport != Transport::Socket) {
      try {
        offered[peer] = ShmRing::create(kRingBytes);
      } catch (const CommError& error) {
        // under auto the pair falls back to its socket; under shm that is not allowed
        if (transport == Transport::Shm) throw CommError(peer_what(peer) + ": " + error.what());
        // said out loud: the fallback is several times slower, and the reader
        // comparing numbers must know why
        std::fprintf(stderr, "%s: unavailable (%s); using the socket instead\n", peer_what(peer).c_str(),
                     error.what());
      }
    }
    if (offered[peer] != nullptr) {
      std::strncpy(offer.name, offered[peer]->name().c_str(), sizeof(offer.name) - 1);
      offer.secret = offered[peer]->secret();
    }
    links[peer].socket.send_all(&offer, sizeof(offer), timeout_seconds, peer_what(peer));
  }
  for (int peer = 0; peer < n; peer++) {
    if (peer == self) continue;
    Offer offer{};
    links[peer].socket.recv_all(&offer, sizeof(offer), timeout_seconds, peer_what(peer));
    offer.name[sizeof(offer.name) - 1] = '\0';
    if (offer.name[0] != '\0') opened[peer] = ShmRing::open(offer.name, offer.secret);
  }
  for (int peer = 0; peer < n; peer++) {
    if (peer == self) continue;
    const uint8_t reached = opened[peer] != nullptr;
    links[peer].socket.send_all(&reached, 1, timeout_seconds, peer_what(peer));
  }
  for (int peer = 0; peer < n; peer++) {
    if (peer == self) continue;
    uint8_t peer_reached = 0;
    links[peer].socket.recv_all(&peer_reached, 1, timeout_seconds, peer_what(peer));
    if (offered[peer] != nullptr) offered[peer]->unlink();  // the peer has opened it, or never will
    if (peer_reached && opened[peer] != nullptr) {
      links[peer].in = std::move(offered[peer]);
      links[peer].out = std::move(opened[peer]);
    } else if (transport == Transport::Shm) {
      throw CommError(peer_what(peer) + ": COURSE_TCP_TRANSPORT=shm, but the two processes cannot share memory " +
                      "(hint: they run on different machines or in different containers; use auto)");
    }
  }
}

// ----------------------------------------------------------------------------
// moving bytes over links
//
// Socket to socket, this is send_and_recv. With a ring on either side it is a
// loop that moves what it can each way without waiting, and only when neither
// way can move sleeps in poll() on the sockets: a doorbell, the peer's socket
// becoming ready, the peer dying and the deadline all wake it.
//
// A peer that is gone has closed its socket, but what it wrote into the ring
// before is still there, as the bytes before a TCP end of file are: a receiver
// takes them, and fails only when it needs more than the ring holds.

void link_send_and_recv(Link* to, const void* send_data, size_t send_bytes, Link* from, void* recv_data,
                        size_t recv_bytes, double timeout_seconds, const std::string& what) {
  ShmRing* out = send_bytes > 0 ? to->out.get() : nullptr;
  ShmRing* in = recv_bytes > 0 ? from->in.get() : nullptr;
  if (out == nullptr && in == nullptr) {
    Socket none;
    send_and_recv(send_bytes > 0 ? to->socket : none, send_data, send_bytes, recv_bytes > 0 ? from->socket : none,
                  recv_data, recv_bytes, timeout_seconds, what);
    return;
  }

  const double deadline = monotonic_seconds() + timeout_seconds;
  const char* send_cursor = static_cast<const char*>(send_data);
  char* recv_cursor = static_cast<char*>(recv_data);
  int idle_looks = 0;
  bool to_gone = false, from_gone = false;  // the peer on that ring link has closed its socket
  while (send_bytes > 0 || recv_bytes > 0) {
    size_t sent = 0, got = 0;
    if (send_bytes > 0) {
      if (out != nullptr) {
        sent = out->write_some(send_cursor, send_bytes);
        if (sent > 0 && out->take_reader_sleeping()) ring_doorbell(to->socket, true, what);
      } else {
        sent = send_some(to->socket, send_cursor, send_bytes, what);
      }
      send_cursor += sent;
      send_bytes -= sent;
    }
    if (recv_bytes > 0) {
      if (in != nullptr) {
        got = in->read_some(recv_cursor, recv_bytes);
        if (got > 0 && in->take_writer_sleeping()) ring_doorbell(from->socket, false, what);
      } else {
        got = recv_some(from->socket, recv_cursor, recv_bytes, what);
      }
      recv_cursor += got;
      recv_bytes -= got;
    }
    if (sent > 0 || got > 0) {
      idle_looks = 0;
      continue;
    }
    if (++idle_looks < kLooksBeforeSleep) {
      std::this_thread::yield();  // on a machine with more ranks than cores, the peer may need this core
      continue;
    }
    idle_looks = 0;
    if (send_bytes > 0 && to_gone) throw PeerClosed(peer_closed(what), true);
    if (recv_bytes > 0 && from_gone && !in->has_data()) throw PeerClosed(peer_closed(what), false);

    // Sleep. Raise the flags, then look once more: progress made before the
    // flags went up rang no doorbell.
    pollfd fds[2];
    int count = 0;
    bool ready = false;
    if (send_bytes > 0) {
      fds[count++] = {to->socket.fd(), static_cast<short>(out != nullptr ? POLLIN : POLLOUT), 0};
      if (out != nullptr) {
        out->set_writer_sleeping(true);
        ready = ready || out->has_room();
      }
    }
    if (recv_bytes > 0) {
      if (count == 1 && fds[0].fd == from->socket.fd()) {
        fds[0].events |= POLLIN;
      } else {
        fds[count++] = {from->socket.fd(), POLLIN, 0};
      }
      if (in != nullptr) {
        in->set_reader_sleeping(true);
        ready = ready || in->has_data();
      }
    }
    if (!ready && poll(fds, count, milliseconds_left(deadline, timeout_seconds, what)) < 0 && errno != EINTR) {
      throw CommError(system_error(what, "poll", errno));
    }
    if (out != nullptr) out->set_writer_sleeping(false);
    if (in != nullptr) in->set_reader_sleeping(false);
    // On a link with rings the socket carries only doorbells, and its end of
    // file is how a peer that has gone shows.
    if (send_bytes > 0 && out != nullptr && (fds[0].revents & (POLLIN | POLLHUP | POLLERR))) {
      to_gone = !drain_doorbells(to->socket, what) || to_gone;
    }
    if (recv_bytes > 0 && in != nullptr && (fds[count - 1].revents & (POLLIN | POLLHUP | POLLERR))) {
      from_gone = !drain_doorbells(from->socket, what) || from_gone;
    }
  }
}

}  // namespace course
