#include "tools/report/timeline.h"

#include <algorithm>
#include <fstream>

#include "common/tensor/error.h"
#include "common/train/metrics.h"
#include "tools/report/run_logs.h"

namespace course::report {

namespace {

// Trace events are flat JSON objects but for their last field, "args": {...}, which
// is flat itself. parse_json_line reads flat objects, so an event is read in two parts.
bool parse_event(std::string line, Fields* event, Fields* args) {
  if (!line.empty() && line.back() == ',') line.pop_back();
  const std::string marker = ", \"args\": ";
  const size_t at = line.find(marker);
  if (at == std::string::npos || line.size() < 2 || line.back() != '}') return false;
  *event = parse_json_line(line.substr(0, at) + "}");
  *args = parse_json_line(line.substr(at + marker.size(), line.size() - 1 - at - marker.size()));
  return true;
}

}  // namespace

Timeline read_timeline(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw CourseError("cannot read trace '" + path + "'");
  struct Raw {
    Span span;
    double start_us, duration_us;
    int step;
  };
  std::vector<Raw> raw;
  std::string line;
  bool header = false, footer = false;
  for (int number_of_line = 1; std::getline(file, line); number_of_line++) {
    if (number_of_line == 1) {
      header = line == "{\"traceEvents\": [";
      if (!header) throw CourseError("'" + path + "' is not a course trace (its first line is not {\"traceEvents\": [)");
      continue;
    }
    if (line.rfind("], ", 0) == 0) {
      footer = true;
      break;
    }
    Fields event, args;
    try {
      if (!parse_event(line, &event, &args)) throw CourseError("no args");
    } catch (const CourseError&) {
      throw CourseError("trace '" + path + "' line " + std::to_string(number_of_line) +
                        " is not one whole event (is the file cut short?)");
    }
    if (event["ph"] != "X") continue;  // metadata: the viewer's names for ranks and lanes
    Raw r;
    r.span.rank = static_cast<int>(number(event, "pid"));
    r.span.lane = static_cast<int>(number(event, "tid"));
    r.span.name = event["name"];
    r.span.action = args.count("action") ? args["action"] : event["cat"];
    r.start_us = number(event, "ts");
    r.duration_us = number(event, "dur");
    r.step = static_cast<int>(number(args, "step", 0));
    raw.push_back(r);
  }
  if (!footer) throw CourseError("trace '" + path + "' is cut short (its last line is missing)");

  Timeline timeline;
  for (const Raw& r : raw) timeline.step = std::max(timeline.step, r.step);
  double start = 0.0, end = 0.0;
  bool first = true;
  for (const Raw& r : raw) {
    if (r.step != timeline.step) continue;
    start = first ? r.start_us : std::min(start, r.start_us);
    end = first ? r.start_us + r.duration_us : std::max(end, r.start_us + r.duration_us);
    first = false;
  }
  for (const Raw& r : raw) {
    if (r.step != timeline.step) continue;
    Span span = r.span;
    span.start_ms = (r.start_us - start) / 1e3;
    span.end_ms = (r.start_us + r.duration_us - start) / 1e3;
    timeline.ranks = std::max(timeline.ranks, span.rank + 1);
    timeline.spans.push_back(span);
  }
  timeline.length_ms = (end - start) / 1e3;
  return timeline;
}

}  // namespace course::report
