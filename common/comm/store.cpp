#include "common/comm/store.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/comm/auth.h"
#include "common/comm/comm_util.h"

namespace course {

namespace {
enum Command : uint8_t { kSet = 1, kGet = 2, kAdd = 3 };
enum Status : uint8_t { kOk = 0, kFull = 1, kOverflow = 2 };  // SET's and ADD's replies
// Requests from a live client may be far apart (a training step between two
// barriers), so the server waits on its clients without a deadline.
constexpr double kForever = 1e9;
// Keys and values are short (addresses, ids, counters); anything larger is not a
// store client talking, and must not make the server allocate gigabytes.
constexpr uint32_t kMaxKeyBytes = 4096;
constexpr uint64_t kMaxValueBytes = 1 << 20;
constexpr size_t kMaxStoredBytes = 64 << 20;
}  // namespace

// ----------------------------------------------------------------------------
// server

StoreServer::StoreServer(const std::string& host, int port, std::string secret, size_t max_clients)
    : secret_(std::move(secret)), max_clients_(max_clients), listener_(listen_on(host, port, &port_)) {
  acceptor_ = std::thread([this] { accept_loop(); });
}

StoreServer::~StoreServer() {
  stopping_ = true;
  acceptor_.join();  // first: from here on no new client (and handler) can appear
  listener_.close();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int fd : client_fds_) shutdown(fd, SHUT_RDWR);  // wakes handlers blocked in recv
  }
  changed_.notify_all();
  for (Handler& handler : handlers_) handler.thread.join();
}

void StoreServer::join_finished_handlers() {
  for (auto handler = handlers_.begin(); handler != handlers_.end();) {
    if (*handler->done) {
      handler->thread.join();
      handler = handlers_.erase(handler);
    } else {
      ++handler;
    }
  }
}

void StoreServer::accept_loop() {
  std::vector<pollfd> ready;  // (1 + silent_.size())  the listener, then each silent connection
  while (!stopping_) {
    close_expired_silent();
    ready.assign(1, pollfd{listener_.fd(), POLLIN, 0});
    for (const Silent& silent : silent_) ready.push_back({silent.socket.fd(), POLLIN, 0});
    // a short poll, so that stopping_ is seen within 0.2 s
    if (poll(ready.data(), ready.size(), 200) <= 0) continue;
    // the silent connections that spoke (an answer, or they closed): each gets a handler,
    // taken from the back so that the indices before stay valid
    for (size_t i = ready.size(); i-- > 1;) {
      if (ready[i].revents == 0) continue;
      Silent spoke = std::move(silent_[i - 1]);
      silent_.erase(silent_.begin() + static_cast<std::ptrdiff_t>(i - 1));
      take(std::move(spoke.socket), spoke.nonce);
    }
    if (ready[0].revents != 0) accept_waiting_connections();
  }
}

void StoreServer::accept_waiting_connections() {
  try {
    // many connections per poll, not one: the kernel's queue, left full by a flood,
    // would drop a client's connection unanswered; and a quarter of the silent pool at
    // most, however many keep coming: one that answered meanwhile is seen at the next
    // poll, long before newcomers could push it out of the pool
    for (size_t taken = 0; taken < kMaxSilent / 4 && !stopping_; taken++) {
      Socket client = accept_waiting(listener_, "store accept");
      if (!client.valid()) break;
      if (secret_.empty()) {
        take(std::move(client), "");  // the open door: nothing to wait for
      } else {
        hold_silent(std::move(client));
      }
    }
  } catch (const CommError& error) {
    // out of file descriptors, say: report it, and do not spin on it
    std::fprintf(stderr, "store: %s\n", error.what());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void StoreServer::hold_silent(Socket client) {
  std::string nonce;
  try {
    nonce = send_challenge(client, kChallengeSeconds);  // a new connection's buffer has room: never waits
  } catch (const CommError&) {
    return;  // gone already
  }
  silent_.push_back({std::move(client), nonce, monotonic_seconds() + kChallengeSeconds});
  // the oldest closed: a client that was slow to answer tries again (StoreClient)
  if (silent_.size() > kMaxSilent) silent_.pop_front();
}

void StoreServer::close_expired_silent() {
  const double now = monotonic_seconds();
  while (!silent_.empty() && silent_.front().deadline < now) silent_.pop_front();  // in the order they came
}

void StoreServer::take(Socket client, const std::string& nonce) {
  join_finished_handlers();
  // a job needs one connection per process; past the cap, whoever it is waits
  // outside (closed at once) instead of costing the server another thread
  const auto connections_in = [this](Admission admission) {
    return static_cast<size_t>(std::count_if(handlers_.begin(), handlers_.end(), [&](const Handler& handler) {
      return *handler.admission == admission && !*handler.done;
    }));
  };
  if (connections_in(Admission::kProven) >= max_clients_) return;
  if (connections_in(Admission::kChallenged) >= kMaxUnproven) evict_oldest_unproven();
  std::lock_guard<std::mutex> lock(mutex_);
  const int fd = client.fd();
  client_fds_.push_back(fd);
  auto done = std::make_shared<std::atomic<bool>>(false);
  auto admission = std::make_shared<std::atomic<Admission>>(Admission::kChallenged);
  handlers_.push_back({std::thread([this, done, admission, nonce, socket = std::move(client)]() mutable {
                         serve(std::move(socket), nonce, *admission);
                         *done = true;
                       }),
                       done, admission, fd});
}

void StoreServer::evict_oldest_unproven() {
  // handlers_ is in the order the connections came
  for (const Handler& handler : handlers_) {
    Admission challenged = Admission::kChallenged;
    // skips the proven, and those let go already whose handlers have not ended yet
    if (*handler.done || !handler.admission->compare_exchange_strong(challenged, Admission::kLetGo)) continue;
    std::lock_guard<std::mutex> lock(mutex_);
    // only while its handler has not let the descriptor go: after that the number
    // may already name another connection
    if (std::find(client_fds_.begin(), client_fds_.end(), handler.fd) != client_fds_.end()) {
      shutdown(handler.fd, SHUT_RDWR);
    }
    return;
  }
}

bool StoreServer::put_locked(const std::string& key, const std::string& value) {
  const auto found = values_.find(key);
  const size_t before = found == values_.end() ? 0 : key.size() + found->second.size();
  const size_t after = stored_bytes_ - before + key.size() + value.size();
  if (after > kMaxStoredBytes && after > stored_bytes_) return false;
  values_[key] = value;
  stored_bytes_ = after;
  return true;
}

void StoreServer::serve(Socket client, const std::string& nonce, std::atomic<Admission>& admission) {
  // In only if the acceptor has not let it go meanwhile; once in, it stays: a client
  // told "accepted" and then cut off would fail its first request.
  const auto admit = [&admission] {
    Admission challenged = Admission::kChallenged;
    return admission.compare_exchange_strong(challenged, Admission::kProven);
  };
  try {
    // challenged already (the nonce it was sent), or the open door
    const bool proven = nonce.empty() ? challenge(client, secret_, "store", kChallengeSeconds, admit)
                                      : finish_challenge(client, secret_, "store", nonce, kChallengeSeconds, admit);
    if (!proven) throw CommError("not a client of this job");
    for (;;) {
      uint8_t command;
      uint32_t key_length;
      uint64_t value_length;
      client.recv_all(&command, 1, kForever, "store");
      client.recv_all(&key_length, sizeof(key_length), kForever, "store");
      if (command < kSet || command > kAdd || key_length > kMaxKeyBytes) break;  // not a store client
      std::string key(key_length, '\0');
      client.recv_all(key.data(), key_length, kForever, "store");
      client.recv_all(&value_length, sizeof(value_length), kForever, "store");
      if (value_length > kMaxValueBytes || (command != kSet && value_length != 8)) break;
      std::string value(value_length, '\0');
      client.recv_all(value.data(), value_length, kForever, "store");

      if (command == kSet) {
        uint8_t status;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          status = put_locked(key, value) ? kOk : kFull;
        }
        changed_.notify_all();
        client.send_all(&status, 1, kForever, "store");
      } else if (command == kAdd) {
        int64_t delta, result = 0;
        std::memcpy(&delta, value.data(), sizeof(delta));
        uint8_t status;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          const auto found = values_.find(key);
          // a key set with SET to something that is not a number counts as 0
          const int64_t current = found == values_.end() ? 0 : std::strtoll(found->second.c_str(), nullptr, 10);
          status = __builtin_add_overflow(current, delta, &result) ? kOverflow
                   : put_locked(key, std::to_string(result))       ? kOk
                                                                   : kFull;
        }
        changed_.notify_all();
        client.send_all(&status, 1, kForever, "store");
        if (status == kOk) client.send_all(&result, sizeof(result), kForever, "store");
      } else {
        double timeout_seconds;
        std::memcpy(&timeout_seconds, value.data(), sizeof(timeout_seconds));
        // clamped: a duration of 1e300 s would overflow the clock's nanoseconds
        const auto wait = std::chrono::duration<double>(std::min(std::max(timeout_seconds, 0.0), 1e7));
        std::string found;
        bool present;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          present = changed_.wait_for(lock, wait, [&] { return stopping_ || values_.count(key) != 0; }) &&
                    values_.count(key) != 0;
          if (present) found = values_[key];
        }
        uint8_t status = present ? 0 : 1;
        client.send_all(&status, 1, kForever, "store");
        if (present) {
          uint64_t length = found.size();
          client.send_all(&length, sizeof(length), kForever, "store");
          client.send_all(found.data(), found.size(), kForever, "store");
        }
      }
    }
  } catch (const CommError&) {
    // the client went away (it finished, or died)
  } catch (const std::exception& error) {
    // the server must outlive any one client: the launcher and every rank depend on it
    std::fprintf(stderr, "store: dropped a client: %s\n", error.what());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  client_fds_.erase(std::remove(client_fds_.begin(), client_fds_.end(), client.fd()), client_fds_.end());
}

// ----------------------------------------------------------------------------
// client

static std::string full_message() {
  return ": the store is full (" + std::to_string(kMaxStoredBytes >> 20) +
         " MiB of keys and values; hint: a store holds addresses and counters, not data)";
}

StoreClient::StoreClient(const std::string& host, int port, double timeout_seconds, const std::string& secret)
    : timeout_seconds_(timeout_seconds), where_("store at " + host + ":" + std::to_string(port)) {
  // A server that closes the connection before its verdict had no room for it (full
  // of clients), or let it go to make room (full of strangers that say nothing, or
  // busy enough that this process answered late): try again, until the deadline.
  const double deadline = monotonic_seconds() + timeout_seconds;
  for (int attempt = 1;; attempt++) {
    const double left = std::max(0.0, deadline - monotonic_seconds());
    socket_ = connect_to(host, port, left, "connect to the " + where_);
    try {
      answer_challenge(socket_, secret, "store", left, "the " + where_);
      return;
    } catch (const ClosedBeforeVerdict&) {
      if (monotonic_seconds() + 0.05 >= deadline) {
        throw CommError("the " + where_ + " closed the connection before letting this process in, on each of " +
                        std::to_string(attempt) + " tries in " + seconds_text(timeout_seconds) +
                        " s (hint: it is full: more clients than its " + std::to_string(StoreServer::kMaxClients) +
                        " places, or a flood of connections from elsewhere)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

void StoreClient::request(uint8_t command, const std::string& key, const std::string& value) {
  uint32_t key_length = static_cast<uint32_t>(key.size());
  uint64_t value_length = value.size();
  std::string message(1, static_cast<char>(command));
  message.append(reinterpret_cast<const char*>(&key_length), sizeof(key_length));
  message += key;
  message.append(reinterpret_cast<const char*>(&value_length), sizeof(value_length));
  message += value;
  socket_.send_all(message.data(), message.size(), timeout_seconds_, where_ + " (key '" + key + "')");
}

void StoreClient::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  request(kSet, key, value);
  uint8_t status;
  const std::string what = where_ + " set '" + key + "'";
  socket_.recv_all(&status, 1, timeout_seconds_, what);
  if (status != kOk) throw CommError(what + full_message());
}

std::string StoreClient::get(const std::string& key, double timeout_seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string timeout(reinterpret_cast<const char*>(&timeout_seconds), sizeof(timeout_seconds));
  request(kGet, key, timeout);
  const std::string what = where_ + " get '" + key + "'";
  uint8_t status;
  // the server answers within timeout_seconds; allow a little for the round trip
  socket_.recv_all(&status, 1, timeout_seconds + 5, what);
  if (status != 0) {
    throw CommError(what + ": nobody set it within " + seconds_text(timeout_seconds) +
                    " s (hint: a rank did not start or died before the rendezvous)");
  }
  uint64_t length;
  socket_.recv_all(&length, sizeof(length), timeout_seconds_, what);
  // no value can be longer; a longer claim is not our store talking
  if (length > kMaxValueBytes) throw CommError(what + ": the reply claims " + std::to_string(length) + " bytes");
  std::string value(length, '\0');
  socket_.recv_all(value.data(), length, timeout_seconds_, what);
  return value;
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lock(mutex_);
  request(kAdd, key, std::string(reinterpret_cast<const char*>(&delta), sizeof(delta)));
  const std::string what = where_ + " add " + std::to_string(delta) + " to '" + key + "'";
  uint8_t status;
  socket_.recv_all(&status, 1, timeout_seconds_, what);
  if (status == kOverflow) throw CommError(what + ": the sum would overflow a 64-bit integer (the counter is unchanged)");
  if (status != kOk) throw CommError(what + full_message());
  int64_t result;
  socket_.recv_all(&result, sizeof(result), timeout_seconds_, what);
  return result;
}

}  // namespace course
