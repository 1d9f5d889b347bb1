// The end-of-run table of a model-parallel run: one row per rank, because each
// rank holds a different part of the model and does different work. Every rank's
// figures are gathered to rank 0, which prints them and logs them in its summary.
#pragma once

#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/train/meters.h"
#include "common/train/metrics.h"

namespace course {

enum class ColumnUnit { Bytes, Percent, Milliseconds, Count };

struct RankColumn {
  std::string name;    // "sent_per_step": the JSON key is "rank<r>_<name>"
  std::string header;  // "sent/step": the printed column's title (12 characters at most)
  double value;        // this rank's value
  ColumnUnit unit;
};

// Collective. Every rank passes its own columns (the same names in the same order);
// the table also gets each rank's peak memory by category on `device`. On rank 0: prints
// "rank | <label> | memory... | columns..." and returns the figures as JSON fields
// for the run summary (empty elsewhere). labels[r] describes rank r (its stages).
JsonLine gather_rank_table(Comm& world, Device device, const std::vector<RankColumn>& columns,
                           const std::vector<std::string>& labels);

// The meters' figures as columns: the bytes sent per step (sent_per_step; with
// several axes one column per axis, <axis>_sent_per_step, and the time in
// communication, comm_ms_per_step), the part of it this rank waited for
// (exposed_comm_ms_per_step) and its idle share when the technique records them
// (idle_fraction); then `more`.
std::vector<RankColumn> meter_columns(const StepMeters& meters, const std::vector<RankColumn>& more = {});

}  // namespace course
