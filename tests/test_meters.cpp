// StepMeters: what a technique records during a step and what the training loop
// reads from it (common/train/meters.h), without any communication.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "common/train/meters.h"
#include "common/train/metrics.h"
#include "common/train/rank_table.h"

namespace {

double field(const course::JsonLine& line, const std::string& key) {
  const std::map<std::string, std::string> fields = course::parse_json_line(line.str());
  const auto found = fields.find(key);
  if (found == fields.end()) FAIL("no field " << key << " in " << line.str());
  return std::stod(found->second);
}

}  // namespace

TEST_CASE("exposed communication is kept per axis when a technique names several, and their sum overall",
          "[unit]") {
  course::StepMeters meters;
  course::OpStats tp, dp;  // what each axis's communication threads spent so far
  meters.add_axis("tp", [&] { return tp; });
  meters.add_axis("dp", [&] { return dp; });
  for (int step = 0; step < 2; step++) {  // per step: tp ran 10 ms and 4 of them were waited for; dp 2 and 1
    meters.start_step();
    tp.seconds += 0.010;
    dp.seconds += 0.002;
    meters.record_exposed(0.003, "tp");
    meters.record_exposed(0.001, "dp");
    meters.record_exposed(0.001, "tp");
    meters.end_step();
  }
  CHECK(meters.exposed_axes() == std::vector<std::string>{"tp", "dp"});  // in the order first named
  CHECK(meters.exposed_ms_per_step("tp") == Approx(4.0));
  CHECK(meters.exposed_ms_per_step("dp") == Approx(1.0));
  CHECK(meters.exposed_ms_per_step() == Approx(5.0));
  CHECK(meters.hidden_fraction() == Approx(1.0 - 5.0 / 12.0));  // of the two axes' 12 ms

  const course::JsonLine step = meters.step_fields();
  CHECK(field(step, "exposed_comm_ms") == Approx(5.0));
  CHECK(field(step, "tp_exposed_comm_ms") == Approx(4.0));
  CHECK(field(step, "dp_exposed_comm_ms") == Approx(1.0));
  const course::JsonLine summary = meters.summary_fields(nullptr);
  CHECK(field(summary, "tp_exposed_comm_ms_per_step") == Approx(4.0));
  CHECK(field(summary, "dp_exposed_comm_ms_per_step") == Approx(1.0));
  CHECK(field(summary, "tp_comm_ms_per_step") == Approx(10.0));

  // the rank table: a column per axis
  std::vector<std::string> names;
  for (const course::RankColumn& column : course::meter_columns(meters, {})) names.push_back(column.name);
  CHECK(std::count(names.begin(), names.end(), "tp_exposed_comm_ms_per_step") == 1);
  CHECK(std::count(names.begin(), names.end(), "dp_exposed_comm_ms_per_step") == 1);
  CHECK(std::count(names.begin(), names.end(), "exposed_comm_ms_per_step") == 0);
}

TEST_CASE("one exposed axis keeps the one column and the fields it always had", "[unit]") {
  course::StepMeters meters;
  course::OpStats dp;
  meters.add_axis("dp", [&] { return dp; });
  meters.start_step();
  dp.seconds += 0.004;
  meters.record_exposed(0.001);
  meters.end_step();
  CHECK(meters.exposed_axes() == std::vector<std::string>{""});
  CHECK(meters.hidden_fraction() == Approx(0.75));
  CHECK(field(meters.summary_fields(nullptr), "exposed_comm_ms_per_step") == Approx(1.0));
  std::vector<std::string> names;
  for (const course::RankColumn& column : course::meter_columns(meters, {})) names.push_back(column.name);
  CHECK(std::count(names.begin(), names.end(), "exposed_comm_ms_per_step") == 1);
}

TEST_CASE("a technique that names some exposed axes and not others is told at once", "[unit]") {
  course::StepMeters named_first;
  named_first.record_exposed(0.001, "tp");
  CHECK_THROWS_WITH(named_first.record_exposed(0.001), Catch::Contains("name every axis or none"));
  course::StepMeters unnamed_first;
  unnamed_first.record_exposed(0.001);
  CHECK_THROWS_WITH(unnamed_first.record_exposed(0.001, "dp"), Catch::Contains("name every axis or none"));
}
