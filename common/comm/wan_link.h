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
// The link is stop-and-wait, one message in flight: a message of n bytes takes
// n / bandwidth to leave and arrives `latency` after its last byte. The sending rank
// waits until its message would have arrived before it hands the bytes to the real
// transport, so the peer sees them no sooner than the link would deliver them.
// What this leaves out, and what it costs:
//   - a real sender is free once its last byte has left, a latency earlier, and can
//     put the next message on the wire behind it; here every message to another site
//     pays its own latency. The ring's exchanges pair each send with a receive that
//     waits as long anyway; a broadcast's 256 KiB chunks and a pipeline's back-to-back
//     sends pay one latency each, where a real link would overlap them.
//   - each rank has a link of its own to every peer in another site, per Comm (a group
//     made by split has links of its own): the ranks of one site, and one rank's
//     groups, do not share the site's bandwidth.
// Only the tcp backend shapes its traffic.
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
// link's figures. `sites` must divide `world_size` (FlagError otherwise).
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
  // How long a message of `bytes` takes on the link, from its first byte leaving to its
  // last arriving: bytes / bandwidth + latency.
  double seconds_for(size_t bytes) const {
    return static_cast<double>(bytes) / bytes_per_second_ + latency_seconds_;
  }
  std::string describe() const;  // "2 sites of 2 ranks, 100 Mbit/s and 25 ms each way between them"

 private:
  int sites_ = 1;
  int ranks_per_site_ = 1;
  double bytes_per_second_ = 0;
  double latency_seconds_ = 0;
};



}  // namespace course
