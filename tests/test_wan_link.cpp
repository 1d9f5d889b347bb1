// The simulated wide-area link (common/comm/wan_link.h): the time it gives counted
// bytes, its flags, and a real run whose communication time is at least what its
// bytes take on the link (the sleep that shapes them makes that a bound, not a
// machine-speed margin).
#include <catch2/catch.hpp>

#include <string>

#include "support/matchers.h"
#include "support/process.h"
#include "support/runs.h"

#include "common/comm/wan_link.h"
#include "common/tensor/error.h"

using namespace course;
using course_test::MessageContains;
using course_test::ProcessResult;

TEST_CASE("a message takes its bytes over the bandwidth, and a latency", "[wan]") {
  // 8 Mbit/s = 1 MB/s and 10 ms: a 100 kB message takes 0.1 s to leave, 0.11 s to arrive
  const WanLayout link(WanOptions{2, "8Mbit", "10ms"}, 2);
  CHECK(link.bytes_per_second() == Approx(1e6));
  CHECK(link.latency_seconds() == Approx(0.010));
  CHECK(link.seconds_for(100000) == Approx(0.110));
  CHECK(link.seconds_for(50000) == Approx(0.060));
}

TEST_CASE("bandwidths and latencies are read with their units, and nonsense is refused", "[wan]") {
  CHECK(parse_bandwidth("100Mbit") == Approx(12.5e6));
  CHECK(parse_bandwidth("1Gbit") == Approx(125e6));
  CHECK(parse_bandwidth("10MB") == Approx(10e6));
  CHECK(parse_bandwidth("2.5Kbit") == Approx(312.5));
  CHECK(parse_latency("25ms") == Approx(0.025));
  CHECK(parse_latency("0.1s") == Approx(0.1));
  CHECK(parse_latency("500us") == Approx(0.0005));
  CHECK_THROWS_MATCHES(parse_bandwidth("0Mbit"), FlagError, MessageContains("must move some bytes"));
  CHECK_THROWS_MATCHES(parse_bandwidth("100"), FlagError, MessageContains("a number and a unit"));
  CHECK_THROWS_MATCHES(parse_bandwidth("fast"), FlagError, MessageContains("not a bandwidth"));
  CHECK_THROWS_MATCHES(parse_latency("25"), FlagError, MessageContains("not a duration"));
  CHECK_THROWS_MATCHES(parse_latency("-1ms"), FlagError, MessageContains("not a duration"));
}

TEST_CASE("sites are consecutive ranks, and only traffic between sites is shaped", "[wan]") {
  const WanLayout layout(WanOptions{2, "100Mbit", "25ms"}, 4);
  CHECK(layout.shapes());
  CHECK(layout.site_of(1) == 0);
  CHECK(layout.site_of(2) == 1);
  CHECK_FALSE(layout.crosses(0, 1));
  CHECK(layout.crosses(1, 2));
  CHECK(layout.describe() == "2 sites of 2 rank(s), 100 Mbit/s and 25 ms each way between them");
  CHECK_FALSE(WanLayout(WanOptions{}, 4).shapes());
  CHECK_THROWS_MATCHES(WanLayout(WanOptions{3, "100Mbit", "25ms"}, 4), FlagError,
                       MessageContains("--sites 3 does not divide the 4 ranks"));
  CHECK_THROWS_MATCHES(WanLayout(WanOptions{2, "none", "25ms"}, 4), FlagError,
                       MessageContains("needs the link between them"));
  CHECK_THROWS_MATCHES(WanLayout(WanOptions{1, "100Mbit", "0ms"}, 4), FlagError, MessageContains("add --sites 2"));
}

TEST_CASE("a message the link takes longer to deliver than the peer waits is an error that says so", "[wan]") {
  // DDP's buckets at 1 kB/s: each takes minutes, and the peer gives up after 5 s
  const ProcessResult result = course_test::run_process(
      course_test::concat(course_test::launcher_command(2),
                          {course_test::course_binary("02_ddp"), "--steps", "1", "--quiet", "--sites", "2",
                           "--wan-bandwidth", "8Kbit", "--comm-timeout", "5", "--backend", "tcp"}),
      120);
  INFO(result.describe() << "\n" << result.err);
  CHECK(result.exit_code == 1);
  CHECK_THAT(result.err, Catch::Contains("on the simulated link, longer than the peer waits"));
  CHECK_THAT(result.err, Catch::Contains("hint: raise --comm-timeout or --wan-bandwidth"));
}

TEST_CASE("DDP across two sites waits for its bytes on the link, and refuses a bad link", "[wan]") {
  course_test::TempDir dir;
  // 10 MB/s and 20 ms: DDP's 3.50 MB a step take 0.35 s on the link, a step's
  // all-reduce at least that plus a latency per message
  const std::string log = dir.file("wan.jsonl");
  const auto result = course_test::run_ok(course_test::concat(course_test::launcher_command(2),
                                          {course_test::course_binary("02_ddp"), "--steps", "2", "--quiet", "--sites",
                                           "2", "--wan-bandwidth", "10MB", "--wan-latency", "20ms", "--backend", "tcp",
                                           "--log", log}),
                      240);
  // the header says the link is simulated, and how
  CHECK_THAT(result.out, Catch::Contains("backend tcp over 2 sites of 1 rank(s), 80 Mbit/s and 20 ms each way"));
  const course_test::RunLog run = course_test::read_log(log);
  const double bytes = course_test::number(run.summary, "bytes_sent_per_step");
  const double comm_ms = course_test::number(run.summary, "comm_ms_per_step");
  CHECK(bytes == 3501056);
  CHECK(comm_ms >= 1e3 * (bytes / 10e6 + 0.020));

  course_test::check_refusals(course_test::course_binary("02_ddp"), {"--backend", "tcp"},
                              {{{"--sites", "3"}, 2, "--sites 3 does not divide the 2 ranks"},
                               {{"--sites", "2"}, 2, "needs the link between them"},
                               {{"--sites", "2", "--wan-bandwidth", "0Mbit"}, 2, "must move some bytes"},
                               {{"--wan-latency", "25ms"}, 2, "add --sites 2"}},
                              120);
}
