// A small TCP key-value store for rendezvous (the role of PyTorch's TCPStore).
// (Finished clients' handler threads are joined only when the server stops; a
// launcher restarting its group many times keeps a few idle threads around.)
//
// Processes that know only the store's address use it to find each other: each
// rank publishes "where I listen" under a key and reads the others'. The launcher
// hosts the server; without a launcher, rank 0 does.
//
// Protocol, one request at a time per connection:
//   request: u8 command | u32 key length | key | u64 value length | value
//   SET: stores value; reply u8 0
//   GET: value is a f64 timeout in seconds; waits until the key exists;
//        reply u8 0 | u64 length | value, or u8 1 on timeout
//   ADD: value is an i64; adds it to the key's integer (0 if new); reply i64 result
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
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
  // Listens on host:port (0 = any free port) and serves until destroyed.
  StoreServer(const std::string& host, int port);
  ~StoreServer();
  int port() const { return port_; }

 private:
  void accept_loop();
  void serve(Socket client);

  int port_ = 0;
  Socket listener_;
  std::atomic<bool> stopping_{false};
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
  std::thread acceptor_;
  std::vector<std::thread> handlers_;
  std::vector<int> client_fds_;
};

class StoreClient {
 public:
  // Connects, retrying until timeout_seconds: the server may not be up yet.
  StoreClient(const std::string& host, int port, double timeout_seconds);

  void set(const std::string& key, const std::string& value);
  // Waits until `key` is set (CommError after the timeout, naming the key).
  std::string get(const std::string& key);
  // Atomically adds delta to the integer under key; returns the new value.
  int64_t add(const std::string& key, int64_t delta);

  // The address this machine uses to reach the store: what peers can reach it at.
  std::string local_address() const { return course::local_address(socket_); }

 private:
  void request(uint8_t command, const std::string& key, const std::string& value);
  std::mutex mutex_;  // one request at a time on the connection
  Socket socket_;
  double timeout_seconds_;
  std::string where_;
};

}  // namespace course
