// A small TCP key-value store for rendezvous (the role of PyTorch's TCPStore).
//
// Processes that know only the store's address use it to find each other: each
// rank publishes "where I listen" under a key and reads the others'. The launcher
// hosts the server; without a launcher, rank 0 does.
//
// Given the job's secret, the server first challenges every connection
// (auth.h) and drops one that cannot answer; connections that say nothing wait
// without a thread, a bounded number of them (kMaxSilent). It also bounds what any
// client can make it hold: at most kMaxClients (512) connections (one thread each;
// finished ones are joined as new ones arrive), keys of 4 KiB, values of 1 MiB, 64 MiB
// in all.
//
// Protocol, one request at a time per connection:
//   request: u8 command | u32 key length | key | u64 value length | value
//   SET: stores value; reply u8 0, or u8 1 when the store would grow past its cap
//   GET: value is a f64 timeout in seconds; waits until the key exists;
//        reply u8 0 | u64 length | value, or u8 1 on timeout
//   ADD: value is an i64; adds it to the key's integer (0 if new);
//        reply u8 0 | i64 result, or u8 1 (full) or u8 2 (the sum would overflow): nothing changes
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/comm/socket.h"

namespace course {

class StoreServer {
 public:
  static constexpr size_t kMaxClients = 512;
  // With a secret, a new connection is sent its challenge at once and waits for its
  // answer among the silent: a socket and a nonce each, held by the accepting thread,
  // no thread of its own, so that a flood of connections that say nothing costs the
  // server little and delays nobody. There are at most this many: past that the oldest
  // is closed (a client closed so, because it answered late, tries again), and none
  // stays longer than kChallengeSeconds.
  static constexpr size_t kMaxSilent = 256;
  // Connections that have spoken get a thread, which reads their answer; those still
  // answering have a pool of their own, this large: when it is full the oldest of them
  // is let go, so that connections that send a few bytes and stall hold no place a
  // client of the job needs.
  static constexpr size_t kMaxUnproven = 32;

  // Listens on host:port (0 = any free port) and serves until destroyed; with a
  // secret, only clients that hold it (auth.h). A connection beyond max_clients
  // proven ones is closed at once.
  StoreServer(const std::string& host, int port, std::string secret = "", size_t max_clients = kMaxClients);
  ~StoreServer();
  int port() const { return port_; }

 private:
  // Where a connection stands. It leaves kChallenged once, by whichever comes first:
  // its handler letting it in, or the acceptor letting it go to make room.
  enum class Admission { kChallenged, kProven, kLetGo };
  struct Handler {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
    std::shared_ptr<std::atomic<Admission>> admission;
    int fd;  // its connection, while it is in client_fds_
  };
  // A connection challenged that has said nothing yet.
  struct Silent {
    Socket socket;
    std::string nonce;  // the one it was sent
    double deadline;    // monotonic_seconds(): closed then if still silent
  };
  void accept_loop();
  void accept_waiting_connections();
  // Sends a new connection its challenge and holds it among the silent.
  void hold_silent(Socket client);
  void close_expired_silent();
  // Gives a connection its handler, within the caps (or closes it): one that has spoken
  // after its challenge (nonce), or, without a secret, a new one (no nonce).
  void take(Socket client, const std::string& nonce);
  void join_finished_handlers();
  // With mutex_ held: stores value under key unless that would grow the store past
  // its cap (a change that does not grow it is always taken).
  bool put_locked(const std::string& key, const std::string& value);
  void serve(Socket client, const std::string& nonce, std::atomic<Admission>& admission);
  // Makes room in the unproven pool when it is full: lets the oldest connection
  // still being challenged go (its handler then ends, and its client tries again).
  void evict_oldest_unproven();

  int port_ = 0;
  std::string secret_;
  size_t max_clients_;
  Socket listener_;
  std::atomic<bool> stopping_{false};
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
  size_t stored_bytes_ = 0;  // keys and values in values_
  std::thread acceptor_;
  std::deque<Silent> silent_;  // in the order they came; the accepting thread's alone
  std::vector<Handler> handlers_;
  std::vector<int> client_fds_;
};

// What a rank needs of the store it meets the others at: the course's own
// (StoreClient, below) or torchrun's (C10dStoreClient, c10d_store.h).
class Store {
 public:
  virtual ~Store() = default;
  // CommError when the store is full.
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Waits until `key` is set (CommError after the timeout, naming the key): the
  // client's timeout, or one of its own.
  std::string get(const std::string& key) { return get(key, timeout_seconds()); }
  virtual std::string get(const std::string& key, double timeout_seconds) = 0;
  // Atomically adds delta to the integer under key; returns the new value
  // (CommError when it would overflow).
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // The address this machine uses to reach the store: what peers can reach it at.
  virtual std::string local_address() const = 0;
  virtual double timeout_seconds() const = 0;
};

class StoreClient : public Store {
 public:
  // Connects, retrying until timeout_seconds: the server may not be up yet; with a
  // secret, answers the server's challenge (CommError when it refuses).
  StoreClient(const std::string& host, int port, double timeout_seconds, const std::string& secret);

  using Store::get;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_seconds) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string local_address() const override { return course::local_address(socket_); }
  double timeout_seconds() const override { return timeout_seconds_; }

 private:
  void request(uint8_t command, const std::string& key, const std::string& value);
  std::mutex mutex_;  // one request at a time on the connection
  Socket socket_;
  double timeout_seconds_;
  std::string where_;
};

}  // namespace course
