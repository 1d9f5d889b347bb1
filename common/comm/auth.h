// A closed door: only processes that hold the job's secret may talk to its store
// and its ranks.
//
// A store or a rank listening on a port takes connections from anyone who can
// reach it: another user's process on the machine, or anything on the network.
// Such a process could read every rank's address, publish a false one, or join a
// collective. So the launcher makes a random secret for each job and hands it to
// its workers in the environment (COURSE_JOB_SECRET, which only the job's own
// processes can read), and whoever accepts a connection challenges it:
//
//   acceptor -> connector:  u8 1 and a random 32-byte nonce A, new for every connection
//   connector -> acceptor:  its own random nonce C
//   acceptor -> connector:  HMAC-SHA256(secret, purpose | "acceptor" | A | C | E)
//   connector -> acceptor:  HMAC-SHA256(secret, purpose | "connector" | A | C | E),
//                           only once the acceptor's proof checked out
//   acceptor -> connector:  the verdict: u8 1 "accepted", or u8 0 "refused"
//
// E is the acceptor's TCP endpoint, "ip:port": its own address to the acceptor, the
// address it dialed to the connector. That stops a relay: a process posing as the
// store, which a worker dialed, cannot pass the real store's words along, because
// the real store's proof names the real store's endpoint, not the one the worker
// dialed, and the worker then says nothing more (before, it answered first, and a
// relay logged in to the store with its answer). Both proofs cover both nonces and
// the two roles, so neither is worth anything for another connection or the other
// side. (A connection through address translation, where the dialed endpoint is not
// the one the acceptor sees, is refused the same way.)
// An acceptor may also close the connection before its verdict: a store full of
// connections lets one go to make room (store.h). The connector then tries again,
// while a refusal is final.
//
// Each side computes what the other should have sent and compares: both prove they
// hold the secret, so a process posing as the store or as a rank learns nothing
// from a worker (not its hello, not its shared-memory ring). The secret never
// crosses the wire, and a recorded answer is worthless for the next connection
// (other nonces). A connector that holds a secret refuses an acceptor that asks
// for none: the job it belongs to locks its doors.
// `purpose` ("store", "tcp mesh") keeps an answer for one door from opening
// another. Without a secret (a job not started by the course launcher: mpirun,
// variables set by hand) the acceptor's first byte is 0, "no challenge", as open
// as torchrun's store. Either way the connector learns at once which it is, so a
// process without the secret at a locked door gets a clear error, not a
// conversation it misreads.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include "common/comm/socket.h"

namespace course {

using Digest = std::array<uint8_t, 32>;

// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), written out: the course has no
// crypto library to lean on, and both fit on a page.
Digest sha256(const std::string& data);
Digest hmac_sha256(const std::string& key, const std::string& message);

// 32 random bytes from the kernel (getrandom), as 64 hex digits. Workers read the
// job's in LaunchEnv::job_secret (env.h).
std::string make_job_secret();

// How long an acceptor waits for the answer: a process of the job answers at once.
constexpr double kChallengeSeconds = 10;

// The acceptor closed the connection (or said nothing) before its verdict: it had no
// room for it, or let it go to make room, and a later try may find some.
class ClosedBeforeVerdict : public CommError {
 public:
  using CommError::CommError;
};

// The connecting side: answers the acceptor's challenge, if it sends one; CommError
// when it asks for a secret this process does not have, or refuses the answer;
// ClosedBeforeVerdict when it closes before its verdict.
void answer_challenge(Socket& socket, const std::string& secret, const std::string& purpose, double timeout_seconds,
                      const std::string& what);
// The accepting side: challenges the connection (without a secret: says there is
// no challenge) and says whether it proved it holds the secret. A wrong answer, no answer within
// timeout_seconds or a closed connection is false, never an exception: a stranger
// at the door must not bring down the job. `admit`, when given, has the last word
// just before the byte that lets the connector in: false lets it go without that
// byte, to try again (the store, which may have let it go to make room meanwhile).
bool challenge(Socket& socket, const std::string& secret, const std::string& purpose, double timeout_seconds,
               const std::function<bool()>& admit = nullptr);
// challenge() in its two halves, for a server that holds connections that have said
// nothing yet without a thread each (store.h): the first sends the door byte and a
// nonce (returned; CommError when the connection is gone), the second waits for the
// answer to that nonce and gives the verdict, as challenge() does.
std::string send_challenge(Socket& socket, double timeout_seconds);
bool finish_challenge(Socket& socket, const std::string& secret, const std::string& purpose, const std::string& nonce,
                      double timeout_seconds, const std::function<bool()>& admit = nullptr);

}  // namespace course
