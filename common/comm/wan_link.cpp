#include "common/comm/wan_link.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "common/tensor/error.h"

namespace course {

namespace {

using Units = std::vector<std::pair<std::string, double>>;

// "100Mbit" with Mbit = 125000 in `units` -> 12.5e6 in *value; false when the text is
// not a finite number followed by one of the units
bool scaled_number(const std::string& text, const Units& units, double* value) {
  const char* begin = text.c_str();
  char* end = nullptr;
  const double number = std::strtod(begin, &end);
  if (end == begin || !std::isfinite(number)) return false;
  for (const auto& [unit, scale] : units) {
    if (unit != end) continue;
    *value = number * scale;
    return true;
  }
  return false;
}

std::string figure(double value, const char* unit) {
  char text[64];
  std::snprintf(text, sizeof(text), "%g %s", value, unit);
  return text;
}

}  // namespace

double parse_bandwidth(const std::string& text) {
  // bits per second in decimal steps, as links are sold; bytes for who counts them
  static const Units units = {{"bit", 1.0 / 8}, {"Kbit", 1e3 / 8}, {"Mbit", 1e6 / 8}, {"Gbit", 1e9 / 8},
                               {"B", 1.0},       {"KB", 1e3},       {"MB", 1e6},       {"GB", 1e9}};
  double bytes_per_second = 0;
  if (scaled_number(text, units, &bytes_per_second)) {
    if (!(bytes_per_second > 0)) {
      throw FlagError("--wan-bandwidth '" + text + "': a link must move some bytes (hint: 100Mbit, 1Gbit)");
    }
    return bytes_per_second;
  }
  throw FlagError("--wan-bandwidth '" + text +
                  "': not a bandwidth (hint: a number and a unit: 100Mbit, 1Gbit, 10MB; bit, Kbit, Mbit, Gbit or B, "
                  "KB, MB, GB per second)");
}

double parse_latency(const std::string& text) {
  static const Units units = {{"s", 1.0}, {"ms", 1e-3}, {"us", 1e-6}};
  double seconds = 0;
  if (scaled_number(text, units, &seconds) && seconds >= 0) return seconds;
  throw FlagError("--wan-latency '" + text + "': not a duration (hint: 25ms, 0.1s or 500us, at least 0)");
}

WanLayout::WanLayout(const WanOptions& options, int world_size) : sites_(options.sites) {
  if (options.sites < 1 || world_size % options.sites != 0) {
    throw FlagError("--sites " + std::to_string(options.sites) + " does not divide the " +
                    std::to_string(world_size) + " ranks into sites of equal size (hint: a divisor of " +
                    std::to_string(world_size) + ")");
  }
  ranks_per_site_ = world_size / options.sites;
  if (!shapes()) {
    if (options.bandwidth != "none" || options.latency != "0ms") {
      throw FlagError("--wan-bandwidth and --wan-latency shape the traffic between sites, and there is one site "
                      "(hint: add --sites 2 or more)");
    }
    return;
  }
  if (options.bandwidth == "none") {
    throw FlagError("--sites " + std::to_string(options.sites) +
                    " needs the link between them (hint: --wan-bandwidth 100Mbit --wan-latency 25ms)");
  }
  bytes_per_second_ = parse_bandwidth(options.bandwidth);
  latency_seconds_ = parse_latency(options.latency);
}

std::string WanLayout::describe() const {
  return std::to_string(sites_) + " sites of " + std::to_string(ranks_per_site_) + " rank(s), " +
         figure(bytes_per_second_ * 8 / 1e6, "Mbit/s") + " and " + figure(latency_seconds_ * 1e3, "ms") +
         " each way between them";
}

}  // namespace course
