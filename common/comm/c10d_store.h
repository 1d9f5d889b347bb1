// torchrun's store, as a client: PyTorch's c10d TCPStore.
//
// torchrun's agent hosts a TCPStore on MASTER_PORT and tells its workers so with
// TORCHELASTIC_USE_AGENT_STORE=True: they are to join it as clients, not open a store
// of their own (the port is taken). A chapter started by torchrun does that through
// this class, and meets the other ranks through it as through the course's store.
//
// The wire format, as PyTorch's torch/csrc/distributed/c10d/TCPStore*.cpp defines it
// and as tried against torch 2.15's server (little-endian; a string is u64 length | bytes):
//   VALIDATE    0   u32 0x3C85F7CE           first, once; no reply
//   PING       13   u32 nonce                reply: the nonce
//   SET         1   key | value              no reply
//   GET         3   key                      reply: value (the key must exist: WAIT first)
//   ADD         4   key | i64 delta          reply: i64, the new value
//   CHECK       5   u64 n | n keys           reply: u8 0 when all are set, 1 when not
//   WAIT        6   u64 n | n keys           reply: u8 0 once all are set
//   CANCEL_WAIT 12                           reply: u8 1 (after a 0 when the wait had just ended)
// Keys go out with PyTorch's client prefix, "/", so that both clients name a key alike.
//
// TCPStore has no authentication: whatever can reach the port can read and write
// every key. The chapter says so when it meets through one (connect_rendezvous).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/comm/socket.h"
#include "common/comm/store.h"

namespace course {

class C10dStoreClient : public Store {
 public:
  // Connects, retrying until timeout_seconds (the agent may still be starting), then
  // validates and pings: CommError when what answers is no c10d TCPStore.
  C10dStoreClient(const std::string& host, int port, double timeout_seconds);

  using Store::get;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_seconds) override;
  int64_t add(const std::string& key, int64_t delta) override;
  // Whether every key is set, without waiting.
  bool check(const std::vector<std::string>& keys);
  std::string local_address() const override { return course::local_address(socket_); }
  double timeout_seconds() const override { return timeout_seconds_; }

 private:
  // Waits until `key` is set: true, or false after timeout_seconds (the wait cancelled).
  bool wait(const std::string& key, double timeout_seconds);
  void send(const std::string& message, const std::string& what);
  template <typename T>
  T receive(const std::string& what);

  std::mutex mutex_;  // one request at a time on the connection
  Socket socket_;
  double timeout_seconds_;
  std::string where_;
};

}  // namespace course
