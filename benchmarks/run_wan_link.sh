#!/usr/bin/env bash
# The simulated wide-area link (common/comm/wan_link.h) against its settings: an
# all-reduce between two ranks in two sites, each size timed by bench_collectives,
# next to what the link's bandwidth and latency say it must take. At two ranks the
# tcp all-reduce sends a buffer of up to 256 KiB in one exchange (one latency, the
# whole buffer on the link) and a larger one as a reduce-scatter and an all-gather
# (two latencies, two halves):
#   model = latency + bytes / bandwidth          (bytes <= 256 KiB)
#   model = 2 latency + bytes / bandwidth        (larger)
#   ./benchmarks/run_wan_link.sh [--bin build/cpu/bin] [--bandwidth 100Mbit] [--latency 25ms] [--max-mb 4]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/bin
bandwidth=100Mbit
latency=25ms
max_mb=4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --bandwidth) bandwidth="$2"; shift 2 ;;
    --latency) latency="$2"; shift 2 ;;
    --max-mb) max_mb="$2"; shift 2 ;;
    *) echo "usage: $0 [--bin DIR] [--bandwidth 100Mbit] [--latency 25ms] [--max-mb N]" >&2; exit 2 ;;
  esac
done
[[ -x "$bin/bench_collectives" ]] || { echo "run_wan_link: no $bin/bench_collectives (hint: ./scripts/build.sh)" >&2; exit 2; }

echo "all_reduce between 2 sites of 1 rank, $bandwidth and $latency each way (tcp)"
"$bin/launch" --nproc-per-node 2 -- "$bin/bench_collectives" --backend tcp --collective all_reduce \
  --max-mb "$max_mb" --sites 2 --wan-bandwidth "$bandwidth" --wan-latency "$latency" |
  sed -n 's/^\[rank 0\] //p' |
  awk '
    # the link as the program read the flags: "backend tcp over 2 sites of 1 rank(s), 100 Mbit/s and 25 ms each way ..."
    /^backend tcp over / {
      for (i = 1; i < NF; i++) {
        if ($(i + 1) == "Mbit/s") bw = $i * 1e6 / 8
        if ($(i + 1) == "ms") lat = $i / 1e3
      }
      printf "%10s %14s %14s %10s %16s\n", "size", "measured ms", "model ms", "off by", "measured MB/s"
    }
    $1 == "all_reduce" {
      bytes = $2 * ($3 == "MiB" ? 1048576 : 1024)
      measured = $4 / 1e3
      model = (bytes <= 262144 ? 1 : 2) * lat * 1e3 + bytes / bw * 1e3
      # the bandwidth the link gave: the bytes over the time left after the latencies
      link = bytes / ((measured - (model - bytes / bw * 1e3)) / 1e3) / 1e6
      printf "%6d %-3s %14.1f %14.1f %9.1f%% %16.2f\n", $2, $3, measured, model, 100 * (measured - model) / model, link
    }'
