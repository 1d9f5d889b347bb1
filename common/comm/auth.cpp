#include "common/comm/auth.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace course {

// ----------------------------------------------------------------------------
// SHA-256: the message, padded to a multiple of 64 bytes with a 1 bit, zeros and
// its length in bits, goes through the compression function 64 bytes at a time.

namespace {

constexpr uint32_t kRoundConstants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

uint32_t rotate_right(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

// One 64-byte block into the state h[8].
void compress(uint32_t h[8], const uint8_t* block) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++) {
    w[i] = static_cast<uint32_t>(block[4 * i]) << 24 | static_cast<uint32_t>(block[4 * i + 1]) << 16 |
           static_cast<uint32_t>(block[4 * i + 2]) << 8 | block[4 * i + 3];
  }
  for (int i = 16; i < 64; i++) {
    const uint32_t s0 = rotate_right(w[i - 15], 7) ^ rotate_right(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotate_right(w[i - 2], 17) ^ rotate_right(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; i++) {
    const uint32_t t1 = k + (rotate_right(e, 6) ^ rotate_right(e, 11) ^ rotate_right(e, 25)) + ((e & f) ^ (~e & g)) +
                        kRoundConstants[i] + w[i];
    const uint32_t t2 = (rotate_right(a, 2) ^ rotate_right(a, 13) ^ rotate_right(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

}  // namespace

Digest sha256(const std::string& data) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string padded = data + '\x80';
  while (padded.size() % 64 != 56) padded += '\0';
  const uint64_t bits = static_cast<uint64_t>(data.size()) * 8;
  for (int shift = 56; shift >= 0; shift -= 8) padded += static_cast<char>(bits >> shift);
  for (size_t at = 0; at < padded.size(); at += 64) compress(h, reinterpret_cast<const uint8_t*>(padded.data() + at));
  Digest digest;
  for (int i = 0; i < 32; i++) digest[i] = static_cast<uint8_t>(h[i / 4] >> (24 - 8 * (i % 4)));
  return digest;
}

// HMAC(K, m) = H((K ^ opad) | H((K ^ ipad) | m)), K padded (or first hashed) to 64 bytes.
Digest hmac_sha256(const std::string& key, const std::string& message) {
  std::string block = key.size() > 64 ? std::string(reinterpret_cast<const char*>(sha256(key).data()), 32) : key;
  block.resize(64, '\0');
  std::string inner(64, '\0'), outer(64, '\0');
  for (int i = 0; i < 64; i++) {
    inner[i] = static_cast<char>(block[i] ^ 0x36);
    outer[i] = static_cast<char>(block[i] ^ 0x5c);
  }
  const Digest inner_digest = sha256(inner + message);
  return sha256(outer + std::string(reinterpret_cast<const char*>(inner_digest.data()), inner_digest.size()));
}

// ----------------------------------------------------------------------------
// the secret

static std::string random_bytes(size_t count) {
  std::string bytes(count, '\0');
  size_t done = 0;
  while (done < count) {
    const ssize_t got = ::getrandom(bytes.data() + done, count - done, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw CommError(std::string("getrandom failed: ") + std::strerror(errno));
    done += static_cast<size_t>(got);
  }
  return bytes;
}

std::string make_job_secret() {
  static const char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char byte : random_bytes(32)) {
    hex += kHex[byte >> 4];
    hex += kHex[byte & 15];
  }
  return hex;
}

// ----------------------------------------------------------------------------
// challenge and response

// The acceptor's TCP endpoint as each side sees it: the acceptor its own, the
// connector the one it dialed. Both proofs cover it, so a process in the middle,
// which the connector dialed instead of the acceptor, cannot pass the acceptor's
// proof along: it names another endpoint.
static std::string acceptor_endpoint(const Socket& socket, bool acceptor_side) {
  return endpoint_of(socket, /*peer=*/!acceptor_side);
}

// Each side's proof: the secret's HMAC over the whole transcript (both nonces, the
// acceptor's endpoint) and the side's role, so that neither proof can be replayed as
// the other, nor for another connection, door or endpoint.
static Digest proof_of(const std::string& secret, const std::string& purpose, const char* role,
                       const std::string& acceptor_nonce, const std::string& connector_nonce,
                       const std::string& endpoint) {
  return hmac_sha256(secret, purpose + '\0' + role + '\0' + acceptor_nonce + connector_nonce + endpoint);
}

// Every byte compared whatever the first difference: how long the comparison takes
// says nothing about how much of a guess was right.
static bool same_digest(const Digest& a, const Digest& b) {
  uint8_t difference = 0;
  for (size_t i = 0; i < a.size(); i++) difference |= a[i] ^ b[i];
  return difference == 0;
}

// The acceptor's first byte: whether a challenge follows.
enum Door : uint8_t { kOpen = 0, kLocked = 1 };
// The acceptor's byte after the connector's answer.
enum Verdict : uint8_t { kRefused = 0, kAccepted = 1 };

void answer_challenge(Socket& socket, const std::string& secret, const std::string& purpose, double timeout_seconds,
                      const std::string& what) {
  uint8_t door = 0;
  try {
    socket.recv_all(&door, 1, timeout_seconds, what + " (waiting for its first byte)");
  } catch (const CommError& error) {
    throw ClosedBeforeVerdict(error.what());
  }
  if (door == kOpen && secret.empty()) return;  // a job without a secret: open doors everywhere
  if (door == kOpen) {
    throw CommError(what + ": it asks for no secret, and this job has one: it is not this job's (hint: is " +
                    "another job's store or rank at this address? start every rank with the same launcher)");
  }
  if (door != kLocked) throw CommError(what + ": the other side is not a course store or rank");
  if (secret.empty()) {
    throw CommError(what + ": it asks for the job's secret and this process has none (hint: start every rank with " +
                    "the course launcher; on several nodes, export the same COURSE_JOB_SECRET on each)");
  }
  const std::string my_nonce = random_bytes(32);
  const std::string endpoint = acceptor_endpoint(socket, /*acceptor_side=*/false);
  // Until the verdict, a closed connection is the acceptor letting this process go
  // (a busy store makes room so), not a refusal: a later try may get in.
  const auto until_verdict = [&](const std::function<void()>& exchange) {
    try {
      exchange();
    } catch (const CommError& error) {
      throw ClosedBeforeVerdict(error.what());
    }
  };
  std::string nonce(32, '\0');
  Digest proof;
  until_verdict([&] {
    socket.recv_all(nonce.data(), nonce.size(), timeout_seconds, what + " (waiting for the job-secret challenge)");
    socket.send_all(my_nonce.data(), my_nonce.size(), timeout_seconds, what);
    socket.recv_all(proof.data(), proof.size(), timeout_seconds, what + " (waiting for its proof of the secret)");
  });
  // the acceptor proves the secret first: to a process that cannot, this one says nothing
  if (!same_digest(proof, proof_of(secret, purpose, "acceptor", nonce, my_nonce, endpoint))) {
    throw CommError(what + ": its proof of the secret for " + endpoint + " does not match this process's secret: " +
                    "it is not this job's (or it passes another's words along), or this process holds another " +
                    "job's secret; this process said nothing more (hint: is another process posing as the store " +
                    "or a rank at this address? do all ranks have the same COURSE_JOB_SECRET?)");
  }
  uint8_t verdict = kRefused;
  until_verdict([&] {
    const Digest answer = proof_of(secret, purpose, "connector", nonce, my_nonce, endpoint);
    socket.send_all(answer.data(), answer.size(), timeout_seconds, what);
    socket.recv_all(&verdict, 1, timeout_seconds, what + " (waiting for its verdict on the answer)");
  });
  if (verdict != kAccepted) {
    throw CommError(what + ": refused this process: it does not hold the job's secret (hint: start every rank with " +
                    "the same launcher, which hands them COURSE_JOB_SECRET)");
  }
}

std::string send_challenge(Socket& socket, double timeout_seconds) {
  // the door byte and the nonce in one message: a stranger costs one send
  const std::string nonce = random_bytes(32);
  const std::string message = std::string(1, static_cast<char>(kLocked)) + nonce;
  socket.send_all(message.data(), message.size(), timeout_seconds, "challenge");
  return nonce;
}

bool finish_challenge(Socket& socket, const std::string& secret, const std::string& purpose, const std::string& nonce,
                      double timeout_seconds, const std::function<bool()>& admit) {
  try {
    std::string their_nonce(32, '\0');
    socket.recv_all(their_nonce.data(), their_nonce.size(), timeout_seconds, "challenge");
    const std::string endpoint = acceptor_endpoint(socket, /*acceptor_side=*/true);
    const Digest proof = proof_of(secret, purpose, "acceptor", nonce, their_nonce, endpoint);  // this side first
    socket.send_all(proof.data(), proof.size(), timeout_seconds, "challenge");
    Digest answer;
    socket.recv_all(answer.data(), answer.size(), timeout_seconds, "challenge");
    if (!same_digest(answer, proof_of(secret, purpose, "connector", nonce, their_nonce, endpoint))) {
      const uint8_t refused = kRefused;  // said, not just closed: the other side must not try again
      socket.send_all(&refused, 1, timeout_seconds, "challenge");
      return false;
    }
    if (admit && !admit()) return false;  // closed without a verdict: the other side tries again
    const uint8_t accepted = kAccepted;
    socket.send_all(&accepted, 1, timeout_seconds, "challenge");
    return true;
  } catch (const CommError&) {
    return false;  // it went away or said nothing in time
  }
}

bool challenge(Socket& socket, const std::string& secret, const std::string& purpose, double timeout_seconds,
               const std::function<bool()>& admit) {
  try {
    if (secret.empty()) {
      // the open door lets the connector in: the last word comes before it
      if (admit && !admit()) return false;
      const uint8_t door = kOpen;
      socket.send_all(&door, 1, timeout_seconds, "challenge");
      return true;
    }
    const std::string nonce = send_challenge(socket, timeout_seconds);
    return finish_challenge(socket, secret, purpose, nonce, timeout_seconds, admit);
  } catch (const CommError&) {
    return false;  // it went away
  }
}

}  // namespace course
