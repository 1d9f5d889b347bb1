#include "common/train/rank_table.h"

#include <cstdio>
#include <cstring>
#include <tuple>

#include "common/tensor/memory.h"

namespace course {

static std::string format_value(double value, ColumnUnit unit) {
  char text[32];
  switch (unit) {
    case ColumnUnit::Bytes: return format_bytes(value);
    case ColumnUnit::Percent: std::snprintf(text, sizeof(text), "%.1f%%", 100.0 * value); break;
    case ColumnUnit::Milliseconds: std::snprintf(text, sizeof(text), "%.1f ms", value); break;
    case ColumnUnit::Count: std::snprintf(text, sizeof(text), "%.0f", value); break;
  }
  return text;
}

JsonLine gather_rank_table(Comm& world, Device device, const std::vector<RankColumn>& columns,
                           const std::vector<std::string>& labels) {
  // the memory columns every model-parallel table shows
  const MemoryTotals& memory = memory_totals(device);
  const auto peak = [&](MemCategory category) { return static_cast<double>(memory.peak[static_cast<int>(category)]); };
  std::vector<RankColumn> all = {
      {"peak_parameters", "params", peak(MemCategory::Parameters), ColumnUnit::Bytes},
      {"peak_gradients", "grads", peak(MemCategory::Gradients), ColumnUnit::Bytes},
      {"peak_optimizer_state", "optimizer", peak(MemCategory::OptimizerState), ColumnUnit::Bytes},
      {"peak_activations", "activations", peak(MemCategory::Activations), ColumnUnit::Bytes},
      {"peak_comm_buffers", "comm bufs", peak(MemCategory::CommBuffers), ColumnUnit::Bytes},
  };
  all.insert(all.end(), columns.begin(), columns.end());

  // all_gather moves bits and never does arithmetic on them, so a double travels
  // exactly as two floats: byte counts arrive exact, however large
  const size_t per_rank = 2 * all.size();
  std::vector<float> mine(per_rank), everyone(per_rank * world.size());
  for (size_t i = 0; i < all.size(); i++) std::memcpy(&mine[2 * i], &all[i].value, sizeof(double));
  world.all_gather(mine.data(), everyone.data(), per_rank);
  if (world.rank() != 0) return JsonLine();

  const auto value = [&](int rank, size_t column) {
    double v;
    std::memcpy(&v, &everyone[rank * per_rank + 2 * column], sizeof(double));
    return v;
  };
  // two tables, memory then the chapter's own figures, so each fits 100 columns
  const size_t memory_columns = all.size() - columns.size();
  JsonLine fields;
  for (const auto& [title, first, end] : {std::make_tuple("peak memory per rank:", size_t{0}, memory_columns),
                                          std::make_tuple("per rank:", memory_columns, all.size())}) {
    std::printf("%s\n  %-4s  %-30s", title, "rank", "stages");
    for (size_t c = first; c < end; c++) std::printf(" %11s", all[c].header.c_str());
    std::printf("\n");
    for (int rank = 0; rank < world.size(); rank++) {
      std::printf("  %-4d  %-30s", rank, labels[rank].c_str());
      for (size_t c = first; c < end; c++) {
        std::printf(" %11s", format_value(value(rank, c), all[c].unit).c_str());
        fields.add("rank" + std::to_string(rank) + "_" + all[c].name, value(rank, c));
      }
      std::printf("\n");
    }
  }
  std::fflush(stdout);
  return fields;
}

std::vector<RankColumn> meter_columns(const StepMeters& meters, const std::vector<RankColumn>& more) {
  std::vector<RankColumn> columns;
  const std::vector<std::string> axes = meters.axis_names();
  if (axes.size() == 1) {
    columns.push_back({"sent_per_step", "sent/step", meters.bytes_per_step(""), ColumnUnit::Bytes});
  } else {
    for (const std::string& axis : axes) {
      columns.push_back({axis + "_sent_per_step", axis + " sent", meters.bytes_per_step(axis), ColumnUnit::Bytes});
    }
    columns.push_back({"comm_ms_per_step", "comm/step", meters.comm_ms_per_step(), ColumnUnit::Milliseconds});
  }
  // what the training thread waited for, of comm/step (or of one axis's, each axis's): the part nothing hid
  const std::vector<std::string> exposed = meters.exposed_axes();
  if (exposed.size() == 1) {
    columns.push_back({"exposed_comm_ms_per_step", exposed[0].empty() ? "exposed" : exposed[0] + " exposed",
                       meters.exposed_ms_per_step(), ColumnUnit::Milliseconds});
  } else {
    for (const std::string& axis : exposed) {
      columns.push_back({axis + "_exposed_comm_ms_per_step", axis + " exposed", meters.exposed_ms_per_step(axis),
                         ColumnUnit::Milliseconds});
    }
  }
  if (meters.records_idle()) {
    columns.push_back({"idle_fraction", "idle", meters.idle_fraction(), ColumnUnit::Percent});
  }
  columns.insert(columns.end(), more.begin(), more.end());
  return columns;
}

}  // namespace course
