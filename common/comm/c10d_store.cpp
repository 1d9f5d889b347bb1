#include "common/comm/c10d_store.h"

#include <unistd.h>

#include <cstring>

#include "common/comm/comm_util.h"

namespace course {

namespace {

constexpr uint32_t kValidationMagic = 0x3C85F7CE;

enum Query : uint8_t {
  kValidate = 0,
  kSet = 1,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kCancelWait = 12,
  kPing = 13,
};
constexpr uint8_t kStopWaiting = 0, kWaitCanceled = 1;  // WAIT's replies
constexpr uint8_t kReady = 0;                           // CHECK's
// PyTorch's clients put this before every key (TCPStore's keyPrefix_), and so does
// this one, so that a key means the same to both: "x" here is "x" to a torch client.
const std::string kKeyPrefix = "/";

template <typename T>
void append(std::string& message, T value) {
  message.append(reinterpret_cast<const char*>(&value), sizeof(value));
}

void append_string(std::string& message, const std::string& text) {
  append<uint64_t>(message, text.size());
  message += text;
}

void append_key(std::string& message, const std::string& key) { append_string(message, kKeyPrefix + key); }

}  // namespace

C10dStoreClient::C10dStoreClient(const std::string& host, int port, double timeout_seconds)
    : timeout_seconds_(timeout_seconds), where_("torchrun's store (c10d TCPStore) at " + host + ":" + std::to_string(port)) {
  socket_ = connect_to(host, port, timeout_seconds, "connect to " + where_);
  std::string hello(1, static_cast<char>(kValidate));
  append(hello, kValidationMagic);
  // a ping proves that what listens is a TCPStore: it echoes the nonce
  const uint32_t nonce = static_cast<uint32_t>(::getpid());
  hello += static_cast<char>(kPing);
  append(hello, nonce);
  send(hello, "validate");
  const std::string what = where_ + " ping";
  uint32_t echoed = 0;
  try {
    echoed = receive<uint32_t>(what);
  } catch (const CommError& error) {
    throw CommError(std::string(error.what()) + " (hint: is MASTER_PORT torchrun's store? With " +
                    "TORCHELASTIC_USE_AGENT_STORE=True the ranks join it as c10d clients)");
  }
  if (echoed != nonce) {
    throw CommError(what + ": the reply is not the nonce sent (hint: MASTER_PORT is some other server, not "
                           "torchrun's store)");
  }
}

void C10dStoreClient::send(const std::string& message, const std::string& what) {
  socket_.send_all(message.data(), message.size(), timeout_seconds_, where_ + " " + what);
}

template <typename T>
T C10dStoreClient::receive(const std::string& what) {
  T value;
  socket_.recv_all(&value, sizeof(value), timeout_seconds_, what);
  return value;
}

void C10dStoreClient::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string message(1, static_cast<char>(kSet));
  append_key(message, key);
  append_string(message, value);
  send(message, "set '" + key + "'");
}

bool C10dStoreClient::wait(const std::string& key, double timeout_seconds) {
  std::string message(1, static_cast<char>(kWait));
  append<uint64_t>(message, 1);
  append_key(message, key);
  send(message, "wait for '" + key + "'");
  const std::string what = where_ + " wait for '" + key + "'";
  uint8_t reply = 0;
  try {
    socket_.recv_all(&reply, 1, timeout_seconds, what);
    return true;
  } catch (const PeerClosed&) {
    throw;
  } catch (const CommError&) {
    // the deadline: cancel the wait. The server may have answered just before
    // (STOP_WAITING), then it answers the cancel too (WAIT_CANCELED).
  }
  send(std::string(1, static_cast<char>(kCancelWait)), "cancel the wait for '" + key + "'");
  reply = receive<uint8_t>(what);
  const bool set_after_all = reply == kStopWaiting;
  if (set_after_all) reply = receive<uint8_t>(what);
  if (reply != kWaitCanceled) throw CommError(what + ": the store's reply to a cancelled wait is " + std::to_string(reply));
  return set_after_all;
}

std::string C10dStoreClient::get(const std::string& key, double timeout_seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string what = where_ + " get '" + key + "'";
  if (!wait(key, timeout_seconds)) {
    throw CommError(what + ": nobody set it within " + seconds_text(timeout_seconds) +
                    " s (hint: a rank did not start or died before the rendezvous)");
  }
  std::string message(1, static_cast<char>(kGet));
  append_key(message, key);
  send(message, "get '" + key + "'");
  const uint64_t length = receive<uint64_t>(what);
  // the course's values are addresses and ids: a longer claim is not a TCPStore talking
  if (length > (1u << 20)) throw CommError(what + ": the reply claims " + std::to_string(length) + " bytes");
  std::string value(length, '\0');
  socket_.recv_all(value.data(), length, timeout_seconds_, what);
  return value;
}

int64_t C10dStoreClient::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string message(1, static_cast<char>(kAdd));
  append_key(message, key);
  append<int64_t>(message, delta);
  send(message, "add to '" + key + "'");
  return receive<int64_t>(where_ + " add to '" + key + "'");
}

bool C10dStoreClient::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string message(1, static_cast<char>(kCheck));
  append<uint64_t>(message, keys.size());
  for (const std::string& key : keys) append_key(message, key);
  send(message, "check");
  return receive<uint8_t>(where_ + " check") == kReady;
}

}  // namespace course
