// The report's pictures. Each is a gnuplot script (kept beside its SVG, so a reader can
// change it and run `gnuplot NAME.gp` again) whose data is inline, as datablocks.
#pragma once

#include <string>
#include <vector>

#include "tools/report/memory_model.h"
#include "tools/report/run_logs.h"
#include "tools/report/timeline.h"

namespace course::report {

// Throws CourseError with a hint to install it when `gnuplot` cannot be started.
void require_gnuplot();

// Writes DIR/NAME.gp, runs gnuplot on it and checks that DIR/NAME.svg came out;
// throws CourseError with gnuplot's own message otherwise. Returns "NAME.svg".
std::string run_gnuplot(const std::string& dir, const std::string& name, const std::string& script);

// Every chapter's loss per step under `title`; below it, each chapter's |loss - reference| /
// reference per step on a log scale with the tests' bound as a line (no panel without a
// reference). Drawn as "NAME.svg".
std::string plot_losses(const std::string& dir, const std::string& name, const std::string& title,
                        const std::vector<ChapterLog>& chapters, const ChapterLog* reference, double bound);

// Chapter 10's runs (and chapter 00's on the step axis): the loss (a running mean of
// 25 steps: a worker's own loss is on its small slice) against the step, against the
// MB rank 0 has sent, and against the seconds the steps took, one panel each: which
// way of talking less reaches a loss soonest, by each measure.
// Drawn as "slow_links.svg".
std::string plot_slow_links(const std::string& dir, const std::vector<ChapterLog>& runs, const ChapterLog* reference);

// With experts: each run's expert_imbalance per step (max over mean of the choices per
// expert, 1 = balanced), one line per run with experts. Drawn as "imbalance.svg".
std::string plot_expert_imbalance(const std::string& dir, const std::vector<ChapterLog>& chapters);

// With experts: one run's tokens per expert over the steps, one line per expert, each
// its share of the step's token-choices (1/E = balanced). Drawn as "experts_NAME.svg".
std::string plot_expert_shares(const std::string& dir, const ChapterLog& log);

// One group per (chapter, rank): the predicted bar (light) beside the measured one,
// each stacked by category.
struct MemoryGroup {
  std::string label;    // "02_ddp, 2 ranks\nrank 0": the picture's
  std::string chapter;  // "02_ddp": the table's, which has a rank column
  RankMemory memory;
};
// One picture of the groups, saved as `name`.svg: at most kMemoryGroupsPerPicture
// groups fit the report's page width with labels that can be read.
constexpr size_t kMemoryGroupsPerPicture = 8;
std::string plot_memory(const std::string& dir, const std::string& name, const std::vector<MemoryGroup>& groups);

// One bar per chapter, its value printed above it; the runs whose machine was busy
// (`busy`, empty: none) hatched in grey and labelled so, since their times are not the
// technique's. At most the page's width: the bars narrow as they grow in number.
std::string plot_bars(const std::string& dir, const std::string& name, const std::string& title,
                      const std::string& y_label, const std::vector<std::string>& labels,
                      const std::vector<double>& values, const char* value_format,
                      const std::vector<bool>& busy = {});

// A row per rank with its compute and communication lanes, a box per span.
std::string plot_timeline(const std::string& dir, const std::string& name, const std::string& title,
                          const Timeline& timeline);

}  // namespace course::report
