// The end-of-run table of a model-parallel run: one row per rank, because each
// rank holds a different part of the model and does different work. Every rank's
// figures are gathered to rank 0, which prints them and logs them in its summary.
#pragma once

#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/metrics.h"

namespace course {

enum class ColumnUnit { Bytes, Percent, Milliseconds, Count };

struct RankColumn {
  std::string name;    // "sent_per_step": the JSON key is "rank<r>_<name>"
  std::string header;  // "sent/step": the printed column's title (12 characters at most)
  double value;        // this rank's value
  ColumnUnit unit;
};

// Collective. Every rank passes its own columns (the same names in the same order);
// the table also gets each rank's peak memory by category. On rank 0: prints
// "rank | <label> | memory... | columns..." and returns the figures as JSON fields
// for the run summary (empty elsewhere). labels[r] describes rank r (its stages).
JsonLine gather_rank_table(Comm& world, const std::vector<RankColumn>& columns, const std::vector<std::string>& labels);

}  // namespace course
