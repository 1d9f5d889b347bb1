// A timeline of what each rank did: timed spans written as a Chrome trace, which
// Perfetto (ui.perfetto.dev -> Open trace file) and chrome://tracing draw as one row
// per rank with a "compute" and a "communication" lane. This is where a reader sees
// overlap (DDP's all-reduce under backward) and bubbles (a pipeline's idle stages).
//
//   Trace trace(options.trace, rank, world_size);   // empty path: tracing off
//   double start = now_seconds();
//   ... forward ...
//   trace.span_since("forward", start, Trace::kComputeLane, JsonLine().add("micro_batch", m));
//   finish_trace(trace, options.trace, world);       // common/train/trainer_parts.h: write, merge on rank 0
//
// Each rank writes its own file (trace.rank3.json); merge_rank_traces (and the
// merge_traces tool) joins them so one timeline shows every rank. All ranks on one
// machine read the same steady clock, so their spans line up without any offset.
//
// The file is Chrome's "JSON object format", {"traceEvents": [...], "displayTimeUnit": "ms"},
// written one event per line between a fixed first and last line, so the merge can read
// it line by line and tell a complete file from a truncated or foreign one.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "common/train/metrics.h"

namespace course {

struct OpInterval;  // common/comm/comm.h: when a Comm's operation was issued and ran

class Trace {
 public:
  static constexpr int kComputeLane = 0;
  static constexpr int kCommunicationLane = 1;
  // Reductions that run on their own Comm's thread while the training thread's
  // collectives go on (chapter 07's DP buckets under the pipeline's TP and PP
  // traffic): a row of their own, since one row cannot draw spans half over each other.
  static constexpr int kDataParallelLane = 2;

  // An empty path disables tracing: every call is then a cheap no-op.
  // With world_size > 1 each rank writes its own file, rank_trace_path(path, rank, world_size).
  // Throws UsageError when the file's directory does not exist: found at the start, not after the run.
  Trace(const std::string& path, int rank, int world_size);
  // Writes the file if spans were recorded since the last write(); a failure here is
  // printed as one line on stderr (a destructor must not throw).
  ~Trace();
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;

  bool enabled() const { return enabled_; }

  // One complete span ("ph": "X") from start to end, both now_seconds() values.
  // lane: 0 = compute, 1 = communication, 2 = data-parallel communication (Chrome's
  // "tid"); the rank is Chrome's "pid".
  // args: extra fields the viewer shows when the span is selected.
  // Throws CourseError (when enabled) for another lane or an end before the start.
  void span(const std::string& name, const std::string& category, double start_seconds, double end_seconds,
            int lane = 0, const JsonLine& args = JsonLine());

  // The usual case: a span from start_seconds until now, its category the lane's name
  // ("compute" or "communication").
  void span_since(const std::string& name, double start_seconds, int lane, const JsonLine& args = JsonLine());

  // Writes the file atomically (temp file + rename); throws CourseError naming the path.
  void write();
  const std::string& file_path() const { return path_; }  // the file this rank writes

 private:
  bool enabled_;
  int rank_;
  std::string path_;
  std::mutex mutex_;                 // a chapter may time communication on another thread
  std::vector<std::string> events_;  // one JSON object per event, metadata first
  bool full_ = false;                // kMaxEvents reached (trace.cpp): later spans are dropped
  bool written_ = false;             // nothing recorded since the last write() (or its try)
};

// For the technique classes that take an optional Trace* (set_trace; nullptr: none):
// a compute span from start until now, and a communication span from start to end
// on `lane` (kCommunicationLane or kDataParallelLane), for communication timed by
// the caller; an operation that has a Work goes through trace_collective below.
// An end of 0 is an operation that never ran: nothing is recorded.
void trace_compute(Trace* trace, const std::string& name, double start_seconds, const JsonLine& args = JsonLine());
void trace_communication(Trace* trace, const std::string& name, double start_seconds, double end_seconds,
                         const JsonLine& args = JsonLine(), int lane = Trace::kCommunicationLane);
// A Comm operation's span, from when its thread began running it to when it ended,
// with args.queued_us: how long it waited on that thread after it was issued. The
// issue time (ts - queued_us) is on the issuing thread's program order, so a test
// can check what was issued before what without relying on when the OS ran the
// communication thread. An empty Work's interval (all 0) records nothing; one that
// ran but has no issue time (not from Work::wait) throws CourseError.
void trace_collective(Trace* trace, const std::string& name, const OpInterval& ran, JsonLine args = JsonLine(),
                      int lane = Trace::kCommunicationLane);

// "trace.json" -> "trace.rank3.json" (".rank<r>" before the extension, appended when
// there is none). World size 1: the path unchanged.
// The colour of a kind of span in every timeline the course draws (chapter 05's
// SVGs, the course report): forward blue, backward green, the deferred weight
// gradients orange, the optimizer step purple, waiting for a peer grey, a send
// brown, any other communication red. `action` is a span's kind ("forward",
// "backward input", "wait for activation", "all-reduce bucket 0", ...).
const char* action_colour(const std::string& action);

std::string rank_trace_path(const std::string& path, int rank, int world_size);
// "trace.json" -> "trace.merged.json": merge_traces' default output.
std::string merged_trace_path(const std::string& path);

// Reads rank_trace_path(path, r, world_size) for every rank r and writes one file at
// merged_path with all their events. Throws CourseError naming a missing, truncated or
// foreign file.
void merge_rank_traces(const std::string& path, int world_size, const std::string& merged_path);

}  // namespace course
