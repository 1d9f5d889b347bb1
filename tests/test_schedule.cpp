// Pipeline schedules as data (05_pipeline/schedule.h), without training: the lists
// make_schedule builds, the simulator's makespans and bubbles against hand-worked
// timelines and the papers' formulas, deadlock and channel-order detection, the
// memory each schedule holds, and the timelines.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "05_pipeline/schedule.h"
#include "common/tensor/error.h"
#include "support/process.h"

using namespace course;

namespace {

// "F0 F1 B0 ..." : a rank's compute actions
std::string compute_labels(const Schedule& schedule, int rank) {
  std::string text;
  for (const Action& action : schedule.actions[rank]) {
    if (is_compute(action.type)) text += (text.empty() ? "" : " ") + action_label(action, schedule.chunks);
  }
  return text;
}

const std::vector<ScheduleKind> kAllKinds = {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved,
                                             ScheduleKind::ZeroBubbleH1};

}  // namespace

TEST_CASE("1F1B's lists: warm-up forwards, then one forward one backward, then the remaining backwards", "[unit]") {
  const Schedule schedule = make_schedule(ScheduleKind::OneFOneB, 2, 4);
  CHECK(compute_labels(schedule, 0) == "F0 F1 B0 F2 B1 F3 B2 B3");
  CHECK(compute_labels(schedule, 1) == "F0 B0 F1 B1 F2 B2 F3 B3");
  // the sends and receives around them: rank 1 receives before each forward, sends after each backward
  std::string rank1;
  for (const Action& action : schedule.actions[1]) rank1 += action_label(action, 1) + ", ";
  CHECK_THAT(rank1, Catch::StartsWith("recv activation 0, F0, B0, send gradient 0, recv activation 1, F1, "));
  CHECK(compute_labels(make_schedule(ScheduleKind::GPipe, 2, 3), 0) == "F0 F1 F2 B0 B1 B2");
  CHECK(compute_labels(make_schedule(ScheduleKind::ZeroBubbleH1, 2, 3), 1) == "F0 B0 F1 B1 W0 F2 B2 W1 W2");
  CHECK(compute_labels(make_schedule(ScheduleKind::Interleaved, 2, 2, 2), 0) == "F0a F1a F0b F1b B0b B1b B0a B1a");
}

TEST_CASE("the simulator's makespans equal hand-worked timelines (forward 1, backward 2)", "[unit]") {
  // GPipe, N = 2, M = 2: rank 1 waits 1 for F0; F0 F1 on both; B's 2 each: (M + N - 1)(F + B) = 9
  Simulation gpipe = simulate(make_schedule(ScheduleKind::GPipe, 2, 2), unit_costs(1));
  CHECK(gpipe.makespan == Approx(9.0));
  CHECK(gpipe.busy[0] == Approx(6.0));
  CHECK(gpipe.bubble_fraction() == Approx(1.0 / 3.0));
  // 1F1B, N = 3, M = 3: 3 x 3 busy, (M + N - 1) x 3 = 15 long, each rank idles 6
  Simulation one_f_one_b = simulate(make_schedule(ScheduleKind::OneFOneB, 3, 3), unit_costs(1));
  CHECK(one_f_one_b.makespan == Approx(15.0));
  for (int r = 0; r < 3; r++) CHECK(one_f_one_b.idle_fraction(r) == Approx(6.0 / 15.0));
  // ZB-H1, N = 2, M = 2 (F = B = W = 1): rank 0 F0 F1 . B0 W0 . B1 W1: 7 long, 1 idle each
  Simulation zero_bubble = simulate(make_schedule(ScheduleKind::ZeroBubbleH1, 2, 2), unit_costs(1));
  CHECK(zero_bubble.makespan == Approx(7.0));
  CHECK(zero_bubble.bubble_fraction() == Approx(1.0 / 7.0));
  // the text timeline of the GPipe case, cell by cell
  CHECK(text_timeline(gpipe.spans, 2, 1, 1.0) ==
        "rank 0 | F0 F1 .  .  .  B0 -- B1 --\n"
        "rank 1 | .  F0 F1 B0 -- B1 -- .  .\n");
}

TEST_CASE("every schedule up to 8 ranks and 16 micro-batches runs each action once, never deadlocks, and has the "
          "papers' bubble",
          "[unit]") {
  for (ScheduleKind kind : kAllKinds) {
    for (int N = 1; N <= 8; N++) {
      for (int M = 1; M <= 16; M++) {
        for (int V : kind == ScheduleKind::Interleaved ? std::vector<int>{2, 3} : std::vector<int>{1}) {
          if (kind == ScheduleKind::Interleaved && (N < 2 || M % N != 0)) continue;
          INFO(schedule_name(kind) << " N=" << N << " M=" << M << " V=" << V);
          const Schedule schedule = make_schedule(kind, N, M, V);
          const bool split = kind == ScheduleKind::ZeroBubbleH1;
          for (int r = 0; r < N; r++) {
            std::map<std::tuple<int, int, int>, int> seen;  // (type, micro-batch, chunk) -> times
            for (const Action& action : schedule.actions[r]) {
              if (is_compute(action.type)) seen[{static_cast<int>(action.type), action.micro_batch, action.chunk}]++;
            }
            const size_t kinds_per_chunk = split ? 3 : 2;  // F, B (+ W)
            REQUIRE(seen.size() == kinds_per_chunk * M * V);
            for (const auto& [key, times] : seen) REQUIRE(times == 1);
          }
          const Simulation sim = simulate(schedule, unit_costs(V));
          INFO(sim.deadlock);
          REQUIRE_FALSE(sim.deadlocked);
          // zero bubble's formula assumes the steady state is reached (M >= N)
          if (!split || M >= N) CHECK(sim.bubble_fraction() == Approx(bubble_formula(kind, N, M, V)).margin(1e-12));
          for (int r = 0; r < N; r++) {
            const int slots = peak_live_slots(schedule, r);
            if (kind == ScheduleKind::GPipe) CHECK(slots == M);
            if (kind == ScheduleKind::OneFOneB) CHECK(slots == std::min(N - r, M));
            if (split) CHECK(slots == std::min(N, M));
          }
        }
      }
    }
  }
}

TEST_CASE("a schedule where every rank waits for the other is reported as a deadlock naming the stuck actions",
          "[unit]") {
  // rank 0 wants its backward before its forward, so it receives a gradient that
  // rank 1 can only send after the activation that rank 0 never sends
  Schedule broken = make_schedule(ScheduleKind::OneFOneB, 2, 1);
  broken.actions[0] = {{ActionType::RecvGradient, 0, 0},
                       {ActionType::Backward, 0, 0},
                       {ActionType::Forward, 0, 0},
                       {ActionType::SendActivation, 0, 0}};
  const Simulation sim = simulate(broken, unit_costs(1));
  CHECK(sim.deadlocked);
  CHECK_THAT(sim.deadlock, Catch::Contains("rank 0 waits at 'recv gradient 0' (from rank 1"));
  CHECK_THAT(sim.deadlock, Catch::Contains("rank 1 waits at 'recv activation 0' (from rank 0"));

  // receiving micro-batches in another order than they were sent cannot work on a FIFO channel
  Schedule swapped = make_schedule(ScheduleKind::GPipe, 2, 2);
  std::vector<Action>& rank1 = swapped.actions[1];
  std::swap(rank1[0], rank1[3]);  // recv activation 1 before recv activation 0
  std::swap(rank1[1], rank1[4]);
  CHECK_THROWS_WITH(simulate(swapped, unit_costs(1)), Catch::Contains("in another order"));
}

TEST_CASE("GPipe keeps every micro-batch's activations, 1F1B at most N - r",
          "[unit]") {
  const int N = 4, M = 8;
  const Schedule gpipe = make_schedule(ScheduleKind::GPipe, N, M);
  const Schedule one_f_one_b = make_schedule(ScheduleKind::OneFOneB, N, M);
  CHECK(peak_live_slots(gpipe, 0) == 8);
  CHECK(peak_live_slots(one_f_one_b, 0) == 4);  // N/M of GPipe's on rank 0
  CHECK(peak_live_slots(one_f_one_b, 3) == 1);
  // interleaved: the rank's chunks together, and each chunk alone (a pool per chunk)
  const Schedule interleaved = make_schedule(ScheduleKind::Interleaved, 2, 4, 2);
  CHECK(peak_live_slots(interleaved, 0) == 5);
  CHECK(peak_live_slots(interleaved, 0, 0) == 4);
  CHECK(peak_live_slots(interleaved, 0, 1) == 2);
}

TEST_CASE("schedules that cannot be built are refused with a usage error", "[unit]") {
  CHECK_THROWS_AS(make_schedule(ScheduleKind::Interleaved, 4, 6, 2), UsageError);
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::Interleaved, 4, 6, 2), Catch::Contains("not a multiple of --pp 4"));
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::Interleaved, 2, 4, 1), Catch::Contains("--virtual-stages 2 or more"));
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::Interleaved, 1, 4, 2), Catch::Contains("--pp 2 or more"));
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::OneFOneB, 2, 4, 2), Catch::Contains("interleaved schedule only"));
  CHECK_THROWS_WITH(make_schedule(ScheduleKind::GPipe, 0, 4), Catch::Contains("at least one rank"));
  CHECK_THROWS_WITH(parse_schedule("pipedream"), Catch::Contains("gpipe, 1f1b, interleaved or zb-h1"));
  CHECK(parse_schedule("zb-h1") == ScheduleKind::ZeroBubbleH1);
}

TEST_CASE("the timeline picture is an SVG with one bar per action", "[unit]") {
  course_test::TempDir dir;
  const Schedule schedule = make_schedule(ScheduleKind::ZeroBubbleH1, 2, 2);
  const Simulation sim = simulate(schedule, unit_costs(1));
  write_timeline_svg(dir.file("zb.svg"), "zb-h1", sim.spans, 2, 1, "units");
  const std::string svg = course_test::read_file(dir.file("zb.svg"));
  CHECK_THAT(svg, Catch::StartsWith("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  CHECK_THAT(svg, Catch::EndsWith("</svg>\n"));
  size_t bars = 0;
  for (size_t at = svg.find("stroke=\"white\""); at != std::string::npos; at = svg.find("stroke=\"white\"", at + 1)) {
    bars++;
  }
  CHECK(bars == sim.spans.size());
  CHECK_THROWS_AS(write_timeline_svg(dir.file("missing/zb.svg"), "x", sim.spans, 2, 1, "units"), CourseError);
}
