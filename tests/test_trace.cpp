// Chrome/Perfetto traces: what a span records comes back from the file (names, times
// in microseconds, rank, lane, args), the file is valid JSON whatever the names hold,
// per-rank files are named and merged, and a missing, cut-short or foreign rank file
// is refused with a message that names it.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/tensor/error.h"
#include "common/train/metrics.h"
#include "common/train/trace.h"
#include "support/trace_json.h"
#include "support/matchers.h"
#include "support/process.h"

namespace fs = std::filesystem;
using course::CourseError;
using course::JsonLine;
using course::Trace;
using course::UsageError;
using course_test::events_of_phase;
using course_test::Json;
using course_test::JsonReader;
using course_test::MessageContains;
using course_test::read_json;
using course_test::TempDir;

namespace {

// The metadata event `name` of process `pid` (and lane `tid`).
Json metadata(const Json& trace, const std::string& name, int pid, int tid = 0) {
  for (const Json& event : events_of_phase(trace, "M")) {
    if (event.at("name").text == name && event.at("pid").number == pid && event.at("tid").number == tid) return event;
  }
  throw std::runtime_error("no metadata event " + name + " for pid " + std::to_string(pid));
}

}  // namespace

TEST_CASE("the JSON reader the trace tests rely on refuses what is not JSON", "[unit]") {
  CHECK_NOTHROW(JsonReader(R"({"a": [1, -2.5e3, "x\"y\u0001", true, null], "b": {}})").document());
  CHECK_THROWS(JsonReader(R"({"a": 1,})").document());
  CHECK_THROWS(JsonReader(R"({"a": "x\y"})").document());
  CHECK_THROWS(JsonReader("{\"a\": \"line\nbreak\"}").document());
  CHECK_THROWS(JsonReader(R"({"a": 01})").document());
  CHECK_THROWS(JsonReader(R"([1, 2)").document());
}

TEST_CASE("a disabled trace records nothing and writes no file", "[unit]") {
  TempDir dir;
  {
    Trace trace("", 0, 1);
    CHECK_FALSE(trace.enabled());
    trace.span("forward", "compute", 1.0, 2.0);
    trace.span("ignored", "compute", 2.0, 1.0, 7);  // not even checked: tracing is off
    trace.write();
  }
  CHECK(fs::is_empty(dir.path()));
}

TEST_CASE("trace spans come back from the file with their names, times, rank, lane and args", "[unit]") {
  TempDir dir;
  Trace trace(dir.file("trace.json"), 2, 4);
  REQUIRE(trace.enabled());
  CHECK(trace.file_path() == dir.file("trace.rank2.json"));
  trace.span("forward", "compute", 10.0, 10.0015, Trace::kComputeLane,
             JsonLine().add("micro_batch", 3).add("chunk", 0));
  trace.span("send activations", "communication", 10.002, 10.0025, Trace::kCommunicationLane);
  trace.write();

  const std::string text = course_test::read_file(trace.file_path());
  // microseconds with three decimals, as Chrome reads them
  CHECK(text.find("\"ts\": 10000000.000") != std::string::npos);
  CHECK(text.find("\"dur\": 1500.000") != std::string::npos);

  const Json file = read_json(trace.file_path());
  CHECK(file.at("displayTimeUnit").text == "ms");
  const std::vector<Json> spans = events_of_phase(file, "X");
  REQUIRE(spans.size() == 2);

  const Json& forward = spans[0];
  CHECK(forward.at("name").text == "forward");
  CHECK(forward.at("cat").text == "compute");
  CHECK(forward.at("ts").number == Approx(10.0e6).margin(1e-3));
  CHECK(forward.at("dur").number == Approx(1500.0).margin(1e-3));
  CHECK(forward.at("pid").number == 2);
  CHECK(forward.at("tid").number == 0);
  CHECK(forward.at("args").at("micro_batch").number == 3);
  CHECK(forward.at("args").at("chunk").number == 0);

  const Json& send = spans[1];
  CHECK(send.at("name").text == "send activations");
  CHECK(send.at("cat").text == "communication");
  CHECK(send.at("ts").number == Approx(10.002e6).margin(1e-3));
  CHECK(send.at("dur").number == Approx(500.0).margin(1e-3));
  CHECK(send.at("tid").number == 1);
  CHECK(send.at("args").items.empty());

  // the viewer's names and order for this rank's row and its two lanes
  CHECK(metadata(file, "process_name", 2).at("args").at("name").text == "rank 2");
  CHECK(metadata(file, "process_sort_index", 2).at("args").at("sort_index").number == 2);
  CHECK(metadata(file, "thread_name", 2, 0).at("args").at("name").text == "compute");
  CHECK(metadata(file, "thread_name", 2, 1).at("args").at("name").text == "communication");
  CHECK(metadata(file, "thread_name", 2, 2).at("args").at("name").text == "data-parallel communication");
}

TEST_CASE("trace names with quotes, backslashes and control characters stay valid JSON", "[unit]") {
  TempDir dir;
  const std::string name = "say \"hi\" to C:\\runs\\x\nsecond line\ttab";
  const std::string category = "odd\"category\\";
  const std::string note = "two\nlines, \"quoted\"";
  {
    Trace trace(dir.file("trace.json"), 0, 1);
    trace.span(name, category, 1.0, 1.25, 0, JsonLine().add("note", note));
  }  // written by the destructor

  const Json file = read_json(dir.file("trace.json"));
  const std::vector<Json> spans = events_of_phase(file, "X");
  REQUIRE(spans.size() == 1);
  CHECK(spans[0].at("name").text == name);
  CHECK(spans[0].at("cat").text == category);
  CHECK(spans[0].at("args").at("note").text == note);
  // and still one event per line: the line-based merge reads it back
  CHECK_NOTHROW(course::merge_rank_traces(dir.file("trace.json"), 1, dir.file("merged.json")));
}

TEST_CASE("a trace span on an unknown lane or ending before it starts is refused", "[unit]") {
  TempDir dir;
  Trace trace(dir.file("trace.json"), 0, 1);
  REQUIRE_THROWS_MATCHES(trace.span("forward", "compute", 1.0, 2.0, 3), CourseError, MessageContains("lane"));
  REQUIRE_THROWS_MATCHES(trace.span("forward", "compute", 2.0, 1.0), CourseError,
                         MessageContains("ends before it starts"));
}

TEST_CASE("each rank's trace file has the rank before the extension", "[unit]") {
  using course::merged_trace_path;
  using course::rank_trace_path;
  CHECK(rank_trace_path("trace.json", 3, 4) == "trace.rank3.json");
  CHECK(rank_trace_path("runs/x/trace.json", 0, 2) == "runs/x/trace.rank0.json");
  CHECK(rank_trace_path("runs/a.b.json", 1, 2) == "runs/a.b.rank1.json");
  CHECK(rank_trace_path("runs/x/trace", 1, 2) == "runs/x/trace.rank1");
  CHECK(rank_trace_path("runs.v1/trace", 1, 2) == "runs.v1/trace.rank1");
  CHECK(rank_trace_path(".trace", 1, 2) == ".trace.rank1");
  CHECK(rank_trace_path("trace.json", 0, 1) == "trace.json");
  CHECK(merged_trace_path("runs/x/trace.json") == "runs/x/trace.merged.json");
  CHECK_THROWS_AS(rank_trace_path("trace.json", 4, 4), CourseError);
}

TEST_CASE("merging three ranks' traces keeps every event and every rank's names", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("trace.json");
  for (int rank = 0; rank < 3; rank++) {
    Trace trace(path, rank, 3);
    trace.span("forward", "compute", 1.0 + rank, 1.5 + rank, 0, JsonLine().add("rank_seen", rank));
    trace.span("all-reduce", "communication", 1.5 + rank, 1.75 + rank, 1);
    trace.write();
  }
  const std::string merged = dir.file("trace.merged.json");
  course::merge_rank_traces(path, 3, merged);

  const Json file = read_json(merged);
  CHECK(file.at("displayTimeUnit").text == "ms");
  const std::vector<Json> spans = events_of_phase(file, "X");
  CHECK(spans.size() == 6);
  for (int rank = 0; rank < 3; rank++) {
    int spans_of_rank = 0;
    for (const Json& span : spans) {
      if (span.at("pid").number != rank) continue;
      spans_of_rank++;
      if (span.at("name").text == "forward") {
        CHECK(span.at("ts").number == Approx((1.0 + rank) * 1e6).margin(1e-3));
        CHECK(span.at("args").at("rank_seen").number == rank);
      }
    }
    CHECK(spans_of_rank == 2);
    CHECK(metadata(file, "process_name", rank).at("args").at("name").text == "rank " + std::to_string(rank));
    CHECK(metadata(file, "process_sort_index", rank).at("args").at("sort_index").number == rank);
    CHECK(metadata(file, "thread_name", rank, 1).at("args").at("name").text == "communication");
  }
}

TEST_CASE("a missing, cut-short or foreign rank trace stops the merge and is named", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("trace.json");
  const std::string merged = dir.file("merged.json");
  for (int rank = 0; rank < 3; rank++) {
    Trace trace(path, rank, 3);
    trace.span("forward", "compute", 1.0, 2.0);
    trace.write();
  }
  const std::string rank1 = dir.file("trace.rank1.json");
  const std::string whole = course_test::read_file(rank1);

  SECTION("missing") {
    fs::remove(rank1);
    REQUIRE_THROWS_MATCHES(course::merge_rank_traces(path, 3, merged), CourseError, MessageContains(rank1));
  }
  SECTION("cut in the middle of an event") {
    course_test::write_file(rank1, whole.substr(0, whole.size() / 2));
    REQUIRE_THROWS_MATCHES(course::merge_rank_traces(path, 3, merged), CourseError, MessageContains(rank1));
  }
  SECTION("cut before its last line") {
    const size_t footer = whole.rfind("], ");
    course_test::write_file(rank1, whole.substr(0, footer));
    REQUIRE_THROWS_MATCHES(course::merge_rank_traces(path, 3, merged), CourseError, MessageContains("cut short"));
    REQUIRE_THROWS_MATCHES(course::merge_rank_traces(path, 3, merged), CourseError, MessageContains(rank1));
  }
  SECTION("foreign") {
    course_test::write_file(rank1, "{\"traceEvents\": []}\n");
    REQUIRE_THROWS_MATCHES(course::merge_rank_traces(path, 3, merged), CourseError,
                           MessageContains("'" + rank1 + "' is not a course trace"));
  }
  CHECK_FALSE(fs::exists(merged));
}

TEST_CASE("a trace that cannot be written: write() throws naming it, the destructor only warns", "[unit]") {
  TempDir dir;
  const std::string subdir = dir.file("gone");
  fs::create_directory(subdir);
  REQUIRE_THROWS_AS(Trace(dir.file("missing/trace.json"), 0, 1), UsageError);
  // a directory where no file can be made (even root cannot create one in /proc) is
  // found at the start, not after the whole run
  REQUIRE_THROWS_MATCHES(Trace("/proc/course_trace.json", 0, 1), UsageError,
                         MessageContains("--trace: cannot write '/proc/course_trace.json': no file can be created"));
  {
    Trace trace(subdir + "/trace.json", 0, 1);
    CHECK(fs::is_empty(subdir));  // the probe of the start is gone
    trace.span("forward", "compute", 1.0, 2.0);
    fs::remove(subdir);
    REQUIRE_THROWS_MATCHES(trace.write(), CourseError, MessageContains(subdir + "/trace.json"));
  }  // the destructor does not try again: the error is said once (tests/test_training.cpp)
  {
    fs::create_directory(subdir);
    Trace trace(subdir + "/trace.json", 0, 1);
    trace.span("forward", "compute", 1.0, 2.0);
    fs::remove(subdir);
  }  // never written (a run that failed before its end): the destructor tries, warns and does not throw
  CHECK_FALSE(fs::exists(subdir));
}

TEST_CASE("merge_traces merges a run's files and refuses bad usage with exit 2", "[unit]") {
  TempDir dir;
  const std::string path = dir.file("trace.json");
  for (int rank = 0; rank < 2; rank++) {
    Trace trace(path, rank, 2);
    trace.span("forward", "compute", 1.0, 2.0);
  }
  const course_test::ProcessResult merged =
      course_test::run_process({course_test::course_binary("merge_traces"), path, "2"}, 60);
  CHECK(merged.exit_code == 0);
  CHECK(merged.out.find(dir.file("trace.merged.json")) != std::string::npos);
  CHECK(merged.out.find("ui.perfetto.dev") != std::string::npos);
  CHECK(events_of_phase(read_json(dir.file("trace.merged.json")), "X").size() == 2);

  for (const std::vector<std::string>& arguments :
       std::vector<std::vector<std::string>>{{}, {path}, {path, "two"}, {path, "0"}, {path, "2", "out", "extra"}}) {
    std::vector<std::string> argv = {course_test::course_binary("merge_traces")};
    argv.insert(argv.end(), arguments.begin(), arguments.end());
    const course_test::ProcessResult bad = course_test::run_process(argv, 60);
    CHECK(bad.exit_code == 2);
    CHECK(bad.err.find("merge_traces: error: ") == 0);
    CHECK(bad.err.find('\n') == bad.err.size() - 1);  // one line
  }
  const course_test::ProcessResult missing =
      course_test::run_process({course_test::course_binary("merge_traces"), dir.file("other.json"), "2"}, 60);
  CHECK(missing.exit_code == 1);
  CHECK(missing.err.find(dir.file("other.rank0.json")) != std::string::npos);
}
