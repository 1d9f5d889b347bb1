// Reading a run directory for the report: the chapters' --log files (JSON lines) and
// the traces beside them. Nothing here throws for a bad log: every problem becomes a
// line naming the file, and the report shows what is there.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace course::report {

using Fields = std::map<std::string, std::string>;

struct StepLine {
  int step = 0;
  double loss = 0.0;
  double tokens_per_s = 0.0;
  double ms = 0.0;          // the step's wall-clock time
  double bytes_sent = 0.0;  // by rank 0 in the step
  // with experts (common/train/meters.h's routing fields); 0 and empty for a dense run
  double expert_imbalance = 0.0;       // max over mean of the choices per expert
  std::vector<double> expert_choices;  // (E) the step's token-choices routed to each expert
};

// One chapter's run: one --log file.
struct ChapterLog {
  std::string path;        // the log file
  std::string name;        // its name without ".jsonl": names the run's pictures and finds its trace
  std::string title;       // "05_pipeline (1f1b)": the chapter, and the schedule or the experts when there are
                           // ("00_single_gpu (E4 top-2, aux 0.01)")
  std::string legend;      // "02_ddp, 4 ranks": the title and the world size, for the pictures
  Fields summary;          // the {"summary": 1, ...} line; empty when the run did not finish
  std::vector<StepLine> steps;
  std::string trace_path;  // NAME.trace.merged.json (or NAME.trace.json for one rank) when it exists
  bool has_experts() const { return !steps.empty() && !steps.front().expert_choices.empty(); }
  bool has_model_shape() const { return summary.count("layers") != 0; }  // older logs lack it
};

struct RunSet {
  std::vector<ChapterLog> chapters;   // in file-name order: 00, 02, 03, ...
  std::vector<std::string> problems;  // "FILE: what is wrong (and what the report does about it)"
};

// Every *.jsonl in `directory`, or only `logs` when given (a named log that does not
// exist is a problem, not an error). Throws CourseError only when `directory` is not one.
RunSet read_run_directory(const std::string& directory, const std::vector<std::string>& logs);

// A summary's number, or `fallback` when the field is missing or not a number.
double number(const Fields& fields, const std::string& key, double fallback = 0.0);

}  // namespace course::report
