#include "common/train/trace.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "common/train/checkpoint.h"
#include "common/comm/comm.h"
#include "common/tensor/error.h"

namespace course {

namespace {

// The fixed first and last lines of every trace file; the events lie between them,
// one per line, each but the last followed by a comma.
const char* const kHeader = "{\"traceEvents\": [";
const char* const kFooter = "], \"displayTimeUnit\": \"ms\"}";

// At about 150 bytes an event, a million events are ~150 MB: thousands of steps of
// any chapter. Past that a forgotten --trace on a long run would eat the memory.
constexpr size_t kMaxEvents = 1'000'000;

// JSON forbids raw control characters inside strings, and a raw newline would also
// split an event over two lines of the file.
std::string escape_control_characters(const std::string& text) {
  std::string escaped;
  for (char c : text) {
    if (static_cast<unsigned char>(c) < 0x20) {
      char code[8];
      std::snprintf(code, sizeof(code), "\\u%04x", static_cast<unsigned>(c));
      escaped += code;
    } else {
      escaped += c;
    }
  }
  return escaped;
}

// `text` as a quoted JSON string.
std::string json_string(const std::string& text) {
  std::string escaped;
  for (char c : text) {
    if (c == '"' || c == '\\') escaped += '\\';
    escaped += c;
  }
  return "\"" + escape_control_characters(escaped) + "\"";
}

// Chrome's unit is the microsecond; three decimals keep nanoseconds.
std::string microseconds(double seconds) {
  char text[40];
  std::snprintf(text, sizeof(text), "%.3f", seconds * 1e6);
  return text;
}

// A metadata event ("ph": "M"): how the viewer names and orders ranks and lanes.
std::string metadata_event(const std::string& name, int pid, int tid, const JsonLine& args) {
  return "{\"name\": \"" + name + "\", \"ph\": \"M\", \"pid\": " + std::to_string(pid) +
         ", \"tid\": " + std::to_string(tid) + ", \"args\": " + args.str() + "}";
}

// "trace.json" + ".rank3" -> "trace.rank3.json". The extension starts at the file
// name's last '.', unless that is its first character (".trace" has none).
std::string insert_before_extension(const std::string& path, const std::string& tag) {
  const size_t slash = path.find_last_of('/');
  const size_t name_start = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = path.find_last_of('.');
  if (dot == std::string::npos || dot <= name_start) return path + tag;
  return path.substr(0, dot) + tag + path.substr(dot);
}

// Writes a whole trace file under a temporary name and renames it into place, so a
// reader (or the merge) never sees half a file.
void write_trace_file(const std::string& path, const std::vector<std::string>& events) {
  std::string text = std::string(kHeader) + "\n";
  for (size_t i = 0; i < events.size(); i++) text += events[i] + (i + 1 < events.size() ? ",\n" : "\n");
  text += std::string(kFooter) + "\n";
  write_file_atomically(path, "", text, "trace");
}

// The events of a file written by write_trace_file, each without its comma.
std::vector<std::string> read_trace_events(const std::string& path) {
  std::ifstream file(path);
  if (!file) {
    throw CourseError("cannot read trace '" + path + "': " + std::strerror(errno) +
                      " (hint: did every rank run with --trace and finish?)");
  }
  std::string line;
  if (!std::getline(file, line) || line != kHeader) {
    throw CourseError("'" + path + "' is not a course trace: its first line is not '" + kHeader + "'");
  }
  std::vector<std::string> events;
  bool complete = false;
  for (int number = 2; std::getline(file, line); number++) {
    if (line == kFooter) {
      complete = true;
      break;
    }
    if (!line.empty() && line.back() == ',') line.pop_back();
    if (line.size() < 2 || line.front() != '{' || line.back() != '}') {
      throw CourseError("trace '" + path + "' line " + std::to_string(number) +
                        " is not one whole event (is the file cut short?)");
    }
    events.push_back(line);
  }
  if (file.bad()) throw CourseError("reading trace '" + path + "' failed: " + std::strerror(errno));
  if (!complete) {
    throw CourseError("trace '" + path + "' is cut short: its last line '" + kFooter +
                      "' is missing (hint: did the rank stop before writing it?)");
  }
  return events;
}

}  // namespace

// ----------------------------------------------------------------------------
// one rank's trace

Trace::Trace(const std::string& path, int rank, int world_size) : enabled_(!path.empty()), rank_(rank) {
  if (!enabled_) return;
  path_ = rank_trace_path(path, rank, world_size);
  check_output_path("--trace", path_);
  events_.push_back(metadata_event("process_name", rank, 0, JsonLine().add("name", "rank " + std::to_string(rank))));
  events_.push_back(metadata_event("process_sort_index", rank, 0, JsonLine().add("sort_index", rank)));
  events_.push_back(metadata_event("thread_name", rank, kComputeLane, JsonLine().add("name", "compute")));
  events_.push_back(
      metadata_event("thread_name", rank, kCommunicationLane, JsonLine().add("name", "communication")));
  events_.push_back(metadata_event("thread_name", rank, kDataParallelLane,
                                   JsonLine().add("name", "data-parallel communication")));
}

Trace::~Trace() {
  if (!enabled_ || written_) return;
  try {
    write();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "warning: %s\n", error.what());
  }
}

void Trace::span(const std::string& name, const std::string& category, double start_seconds, double end_seconds,
                 int lane, const JsonLine& args) {
  if (!enabled_) return;
  if (lane != kComputeLane && lane != kCommunicationLane && lane != kDataParallelLane) {
    throw CourseError("trace span '" + name + "': lane must be 0 (compute), 1 (communication) or 2 " +
                      "(data-parallel communication), got " + std::to_string(lane));
  }
  if (end_seconds < start_seconds) {
    throw CourseError("trace span '" + name + "' ends before it starts");
  }
  // JsonLine escapes quotes but not control characters; only its strings can hold them
  std::string event = "{\"name\": " + json_string(name) + ", \"cat\": " + json_string(category) +
                      ", \"ph\": \"X\", \"ts\": " + microseconds(start_seconds) +
                      ", \"dur\": " + microseconds(end_seconds - start_seconds) +
                      ", \"pid\": " + std::to_string(rank_) + ", \"tid\": " + std::to_string(lane) +
                      ", \"args\": " + escape_control_characters(args.str()) + "}";
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.size() >= kMaxEvents) {
    if (!full_) {
      std::fprintf(stderr, "warning: trace '%s' holds %zu events; later spans are not recorded"
                   " (hint: trace fewer steps)\n", path_.c_str(), kMaxEvents);
      full_ = true;
    }
    return;
  }
  events_.push_back(std::move(event));
  written_ = false;
}

void Trace::span_since(const std::string& name, double start_seconds, int lane, const JsonLine& args) {
  if (!enabled_) return;
  span(name, lane == kCommunicationLane ? "communication" : "compute", start_seconds, now_seconds(), lane, args);
}

void Trace::write() {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  written_ = true;  // a write that fails is not tried again by the destructor: its error is said once
  write_trace_file(path_, events_);
}

void trace_compute(Trace* trace, const std::string& name, double start_seconds, const JsonLine& args) {
  if (trace != nullptr) trace->span_since(name, start_seconds, Trace::kComputeLane, args);
}

void trace_communication(Trace* trace, const std::string& name, double start_seconds, double end_seconds,
                         const JsonLine& args, int lane) {
  if (trace == nullptr || end_seconds == 0) return;
  trace->span(name, "communication", start_seconds, end_seconds, lane, args);
}

void trace_collective(Trace* trace, const std::string& name, const OpInterval& ran, JsonLine args, int lane) {
  if (trace == nullptr || ran.end == 0) return;
  if (ran.issued == 0) {
    throw CourseError("trace span '" + name + "': the operation ran but its issue time is not set " +
                      "(hint: take the OpInterval from Work::wait, which fills it)");
  }
  trace_communication(trace, name, ran.start, ran.end, args.add("queued_us", (ran.start - ran.issued) * 1e6), lane);
}

// ----------------------------------------------------------------------------
// file names and the merge

const char* action_colour(const std::string& action) {
  const auto starts = [&](const char* prefix) { return action.rfind(prefix, 0) == 0; };
  if (starts("forward")) return "#3b6fb6";
  if (starts("backward weight")) return "#e08a2c";
  if (starts("backward")) return "#3a9a5b";
  if (starts("optimizer")) return "#b07aa1";
  if (starts("wait") || starts("recv")) return "#bab0ac";
  if (starts("send")) return "#9c755f";
  return "#e15759";
}

std::string rank_trace_path(const std::string& path, int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw CourseError("rank_trace_path: rank " + std::to_string(rank) + " is not in a world of " +
                      std::to_string(world_size));
  }
  if (world_size == 1) return path;
  return insert_before_extension(path, ".rank" + std::to_string(rank));
}

std::string merged_trace_path(const std::string& path) { return insert_before_extension(path, ".merged"); }

void merge_rank_traces(const std::string& path, int world_size, const std::string& merged_path) {
  if (world_size < 1) throw UsageError("the world size must be at least 1, got " + std::to_string(world_size));
  // every file is read (and checked) before anything is written
  std::vector<std::string> events;
  for (int rank = 0; rank < world_size; rank++) {
    std::vector<std::string> rank_events = read_trace_events(rank_trace_path(path, rank, world_size));
    events.insert(events.end(), rank_events.begin(), rank_events.end());
  }
  write_trace_file(merged_path, events);
}

}  // namespace course
