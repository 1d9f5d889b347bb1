// Per-rank memory by category: what a run measured (its log) and what the chapters'
// README formulas predict from the run's configuration (also in its log).
#pragma once

#include <array>
#include <string>
#include <vector>

#include "tools/report/run_logs.h"

namespace course::report {

// The memory tracker's categories (common/tensor/memory.h), in its order: the summary's
// fields are "peak_" + each.
constexpr int kCategories = 6;
extern const std::array<const char*, kCategories> kCategoryKeys;    // "parameters", ..., "workspace"
extern const std::array<const char*, kCategories> kCategoryTitles;  // "parameters", ..., "workspace"

// Bytes per category; a category is "known" when the log has it (measured) or a
// README formula gives it (predicted). Unknown categories are left out of the bars.
struct CategoryBytes {
  std::array<double, kCategories> bytes{};
  std::array<bool, kCategories> known{};
};

struct RankMemory {
  int rank = 0;
  CategoryBytes measured;
  CategoryBytes predicted;  // nothing known: no formula for this chapter (or an older log)
};

// One entry per rank the log describes: every rank for chapters 04 and 05 (their
// rank<r>_* fields), rank 0 for the others (their ranks hold the same amounts).
std::vector<RankMemory> rank_memory(const ChapterLog& log);

}  // namespace course::report
