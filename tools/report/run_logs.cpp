#include "tools/report/run_logs.h"

#include <algorithm>
#include <map>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common/tensor/error.h"
#include "common/train/metrics.h"

namespace fs = std::filesystem;

namespace course::report {

double number(const Fields& fields, const std::string& key, double fallback) {
  auto found = fields.find(key);
  if (found == fields.end()) return fallback;
  try {
    return std::stod(found->second);
  } catch (const std::exception&) {
    return fallback;
  }
}

static StepLine read_step(const Fields& fields) {
  StepLine step;
  step.step = static_cast<int>(number(fields, "step"));
  step.loss = number(fields, "loss");
  step.tokens_per_s = number(fields, "tokens_per_s");
  step.ms = number(fields, "ms");
  step.bytes_sent = number(fields, "bytes_sent");
  step.expert_imbalance = number(fields, "expert_imbalance");
  for (int e = 0; fields.count("expert_choices_" + std::to_string(e)); e++) {
    step.expert_choices.push_back(number(fields, "expert_choices_" + std::to_string(e)));
  }
  return step;
}

// Reads one log. A line that does not parse is skipped and named: a run killed while
// writing leaves its last line cut short, and the steps before it are still good.
static ChapterLog read_log(const std::string& path, std::vector<std::string>& problems) {
  ChapterLog log;
  log.path = path;
  log.name = fs::path(path).stem().string();
  std::ifstream file(path);
  if (!file) {
    problems.push_back(path + ": cannot be read (missing? the chapter did not run or did not get --log)");
    return log;
  }
  std::string line;
  for (int number_of_line = 1; std::getline(file, line); number_of_line++) {
    if (line.empty()) continue;
    Fields fields;
    try {
      fields = parse_json_line(line);
    } catch (const CourseError&) {
      problems.push_back(path + ": line " + std::to_string(number_of_line) +
                         " is not a whole JSON object (cut short?); it is skipped");
      continue;
    }
    if (fields.count("summary")) {
      log.summary = fields;
    } else if (fields.count("step") && fields.count("loss")) {
      log.steps.push_back(read_step(fields));
    } else {
      problems.push_back(path + ": line " + std::to_string(number_of_line) +
                         " is neither a step nor a summary (not a course log?); it is skipped");
    }
  }
  if (log.steps.empty() && log.summary.empty()) {
    problems.push_back(path + ": no steps and no summary (empty, or not a course log); left out");
  } else if (log.summary.empty()) {
    problems.push_back(path + ": no summary line (did the run finish?): only its " + std::to_string(log.steps.size()) +
                       " step(s) of losses are shown");
  } else if (!log.has_model_shape()) {
    problems.push_back(path + ": an older log format (no model shape, machine or configuration in its summary): "
                       "no predicted memory for it (hint: run the chapter again with this version)");
  }
  const auto field = [&](const char* key) {
    auto found = log.summary.find(key);
    return found == log.summary.end() ? std::string() : found->second;
  };
  log.title = field("chapter").empty() ? log.name : field("chapter");
  if (!field("schedule").empty()) log.title += " (" + field("schedule") + ")";
  if (!field("recompute").empty()) log.title += " (recompute " + field("recompute") + ")";
  if (field("matmul_precision") == "bf16") log.title += " (bf16)";
  // two runs of one chapter with other experts or aux loss: their pictures' lines must differ
  if (!field("experts").empty()) {
    log.title += " (E" + field("experts") + " top-" + field("top_k");
    if (!field("aux_loss_coef").empty()) {
      char coef[32];  // the flag's float, logged as 0.00999999978: "0.01"
      std::snprintf(coef, sizeof(coef), "%g", number(log.summary, "aux_loss_coef"));
      log.title += std::string(", aux ") + coef;
    }
    log.title += ")";
  }
  // the tables have a world column; a picture's legend says it (02_ddp at 2 and at 4 ranks)
  const std::string world = field("world_size");
  log.legend = log.title + (world.empty() || world == "1" ? "" : ", " + world + " ranks");

  // the trace the chapter wrote beside its log: merged over ranks, or one rank's own
  for (const std::string& candidate : {log.name + ".trace.merged.json", log.name + ".trace.json"}) {
    const fs::path trace = fs::path(path).parent_path() / candidate;
    if (fs::exists(trace)) {
      log.trace_path = trace.string();
      break;
    }
  }
  return log;
}

RunSet read_run_directory(const std::string& directory, const std::vector<std::string>& logs) {
  if (!fs::is_directory(directory)) {
    throw CourseError("'" + directory + "' is not a directory (hint: give the run directory, runs/<stamp>)");
  }
  std::vector<std::string> paths = logs;
  if (paths.empty()) {
    for (const fs::directory_entry& entry : fs::directory_iterator(directory)) {
      if (entry.path().extension() == ".jsonl") paths.push_back(entry.path().string());
    }
    std::sort(paths.begin(), paths.end());
  }
  RunSet set;
  if (paths.empty()) set.problems.push_back(directory + ": no *.jsonl logs (hint: run the chapters with --log)");
  for (const std::string& path : paths) {
    ChapterLog log = read_log(path, set.problems);
    if (!log.steps.empty() || !log.summary.empty()) set.chapters.push_back(std::move(log));
  }
  // runs that nothing in their summaries tells apart (chapter 10 with and without a
  // worker killed): the file names do, in the pictures' legends
  std::map<std::string, int> runs_per_legend;
  for (const ChapterLog& log : set.chapters) runs_per_legend[log.legend]++;
  for (ChapterLog& log : set.chapters) {
    if (runs_per_legend[log.legend] > 1) log.legend += " (" + log.name + ")";
  }
  return set;
}

}  // namespace course::report
