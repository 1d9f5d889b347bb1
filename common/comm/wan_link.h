// A simulated wide-area link between sites, for training over slow links.
//
// `--sites S` groups the world into S sites of consecutive ranks (world rank r is in
// site r / (world / S)). Bytes between two ranks of one site move at full speed;
// bytes that cross sites go through a link of `--wan-bandwidth` and `--wan-latency`,
// one per rank and direction (each rank's own uplink to each other site):
//
//   site 0: ranks 0 1 ──┐   bandwidth, latency    ┌── site 1: ranks 2 3
//                       └──── each direction ─────┘
//
// The link is a token bucket of depth zero: it passes bytes at its bandwidth and
// never faster, one message after another, and each message arrives `latency`
// after its last byte leaves. The sending rank waits until its message would have
// arrived before it hands the bytes to the real transport, so the peer sees them
// no sooner than the simulated link would deliver them. (A real sender is free once
// its last byte has left, a latency earlier; in the course's collectives every send
// is paired with a receive from the other direction, which waits that long anyway.)
// Only the tcp backend shapes its traffic. Each rank has a link of its own to every
// peer in another site (and a group made by split, links of its own), so the ranks of
// one site do not share their site's bandwidth.
#pragma once

#include <cstddef>
#include <string>

namespace course {

struct WanOptions {
  int sites = 1;                     // --sites: 1 = one site, nothing shaped
  std::string bandwidth = "none";    // --wan-bandwidth: 100Mbit, 1Gbit, 10MB (bytes) per second
  std::string latency = "0ms";       // --wan-latency: 25ms, 0.1s, 500us
};

// "100Mbit" -> 12.5e6 bytes per second. Units: bit, Kbit, Mbit, Gbit (10^3 steps) and
// B, KB, MB, GB (bytes); a number before them. UsageError names the flag otherwise,
// and a bandwidth of 0.
double parse_bandwidth(const std::string& text);
// "25ms" -> 0.025 seconds. Units: s, ms, us. UsageError otherwise.
double parse_latency(const std::string& text);

// The shaping this rank's traffic gets: which site each world rank is in, and the
// link's figures. `world_size` must divide into `sites` (FlagError otherwise).
class WanLayout {
 public:
  WanLayout() = default;  // one site: nothing shaped
  WanLayout(const WanOptions& options, int world_size);

  bool shapes() const { return sites_ > 1; }
  int site_of(int world_rank) const { return world_rank / ranks_per_site_; }
  bool crosses(int world_rank_a, int world_rank_b) const {
    return shapes() && site_of(world_rank_a) != site_of(world_rank_b);
  }
  double bytes_per_second() const { return bytes_per_second_; }
  double latency_seconds() const { return latency_seconds_; }
  std::string describe() const;  // "2 sites of 2 ranks, 100 Mbit/s and 25 ms each way between them"

 private:
  int sites_ = 1;
  int ranks_per_site_ = 1;
  double bytes_per_second_ = 0;
  double latency_seconds_ = 0;
};

// One direction of one rank's link: when each message handed to it arrives.
class LinkSchedule {
 public:
  LinkSchedule(double bytes_per_second, double latency_seconds)
      : bytes_per_second_(bytes_per_second), latency_seconds_(latency_seconds) {}

  // A message of `bytes` handed to the link at time `now` (seconds, any clock that
  // only goes forward): it starts when the link has sent everything before it, takes
  // bytes / bandwidth to leave, and arrives `latency` later. Returns the arrival time.
  double deliver(double now, size_t bytes);

 private:
  double bytes_per_second_;
  double latency_seconds_;
  double free_at_ = 0;  // when the link will have sent the last byte it was given
};

}  // namespace course
