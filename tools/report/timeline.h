// A chapter's trace (common/train/trace.h: Chrome's format, one event per line) read back
// as spans for the report's timeline picture.
#pragma once

#include <string>
#include <vector>

namespace course::report {

struct Span {
  int rank = 0;
  int lane = 0;           // 0 compute, 1 communication (the trace's "tid")
  std::string name;       // "F3", "B3", "recv activation 3", ...
  std::string action;     // the span's "action" argument when it has one ("forward", ...), else its category
  double start_ms = 0.0;  // from the start of the window
  double end_ms = 0.0;
};

struct Timeline {
  std::vector<Span> spans;
  int ranks = 0;
  int step = 0;             // the step shown (the trace's last), 0 when its spans carry no step
  double length_ms = 0.0;   // the window's length
};

// The last step of the trace (spans whose "step" argument is the largest), or every
// span when they carry no step. Throws CourseError naming the file when it is not a
// whole course trace.
Timeline read_timeline(const std::string& path);

}  // namespace course::report
