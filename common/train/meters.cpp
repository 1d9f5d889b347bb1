#include "common/train/meters.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "common/tensor/error.h"

namespace course {

OpStats op_stats(const Comm& comm, const std::string& operation) {
  const std::map<std::string, OpStats> stats = comm.stats();
  const auto found = stats.find(operation);
  return found == stats.end() ? OpStats{} : found->second;
}

void StepMeters::add_axis(const std::string& name, std::function<OpStats()> counters) {
  axes_.push_back({name, std::move(counters), OpStats{}, 0, 0, 0.0});
}

void StepMeters::record_exposed(double seconds, const std::string& axis) {
  auto found = std::find_if(exposed_.begin(), exposed_.end(), [&](const Exposed& e) { return e.axis == axis; });
  if (found == exposed_.end()) {
    // the sum over every axis would count the named ones twice
    const bool mixed = !exposed_.empty() && (axis.empty() || exposed_.front().axis.empty());
    if (mixed) throw CourseError("record_exposed: the axis \"" + axis + "\" beside another: name every axis or none");
    found = exposed_.insert(exposed_.end(), Exposed{axis});
  }
  found->step += seconds;
  step_exposed_ += seconds;
}

std::vector<std::string> StepMeters::exposed_axes() const {
  std::vector<std::string> axes;
  for (const Exposed& e : exposed_) axes.push_back(e.axis);
  return axes;
}

void StepMeters::record_idle(double busy_seconds, double window_seconds) {
  idle_.push_back(window_seconds > 0.0 ? 1.0 - busy_seconds / window_seconds : 0.0);
}

void StepMeters::start_step() {
  routing.reset();
  for (Axis& axis : axes_) axis.before = axis.counters();
  step_comm_seconds_ = 0.0;
  step_exposed_ = 0.0;
  for (Exposed& e : exposed_) e.step = 0.0;
}

void StepMeters::end_step() {
  for (Axis& axis : axes_) {
    const OpStats this_step = axis.counters() - axis.before;
    axis.step_bytes = this_step.bytes_sent;
    axis.total_bytes += axis.step_bytes;
    axis.total_seconds += this_step.seconds;
    step_comm_seconds_ += this_step.seconds;
  }
  total_comm_seconds_ += step_comm_seconds_;
  total_exposed_ += step_exposed_;
  for (Exposed& e : exposed_) e.total += e.step;
  steps_++;
  last_routing_ = routing;
  run_choices_ += routing.choices;
  run_dropped_ += routing.dropped;
}

JsonLine StepMeters::routing_fields() const {
  if (routing.empty()) return JsonLine();
  JsonLine fields;
  fields.add("aux_loss", routing.aux_loss())
      .add("dropped", routing.dropped)
      .add("dropped_fraction", routing.dropped_fraction())
      .add("expert_imbalance", routing.imbalance());
  // one field per expert: the log's lines are flat objects (parse_json_line), no arrays
  for (size_t e = 0; e < routing.expert_choices.size(); e++) {
    fields.add("expert_choices_" + std::to_string(e), routing.expert_choices[e]);
  }
  return fields;
}

JsonLine StepMeters::step_fields() const {
  if (axes_.empty()) return routing_fields();  // one device: nothing to send
  uint64_t all_axes = 0;
  for (const Axis& axis : axes_) all_axes += axis.step_bytes;
  JsonLine fields;
  fields.add("bytes_sent", all_axes);
  if (axes_.size() > 1) {
    for (const Axis& axis : axes_) fields.add(axis.name + "_bytes_sent", axis.step_bytes);
  }
  fields.add("comm_ms", step_comm_seconds_ * 1e3);
  if (!exposed_.empty()) fields.add("exposed_comm_ms", step_exposed_ * 1e3);
  if (exposed_.size() > 1) {
    for (const Exposed& e : exposed_) fields.add(e.axis + "_exposed_comm_ms", e.step * 1e3);
  }
  if (!idle_.empty()) fields.add("idle_fraction", idle_.back());
  return fields.merge(routing_fields());
}

std::string StepMeters::step_text() const {
  if (routing.empty()) return comm_text();
  char figures[64];
  if (axes_.size() > 1) {
    // 100 columns hold the bytes of all axes together and the drops (the rest: the JSON line)
    uint64_t bytes = 0;
    for (const Axis& axis : axes_) bytes += axis.step_bytes;
    std::snprintf(figures, sizeof(figures), " | sent %s | dropped %.1f%%", format_bytes(static_cast<double>(bytes)).c_str(),
                  100.0 * routing.dropped_fraction());
    return figures;
  }
  std::snprintf(figures, sizeof(figures), " | aux %.4f, dropped %.1f%%", routing.aux_loss(),
                100.0 * routing.dropped_fraction());
  return comm_text() + figures;
}

std::string StepMeters::comm_text() const {
  if (axes_.empty()) return "";
  std::string text = " |";
  if (axes_.size() == 1) {
    text += " sent " + format_bytes(static_cast<double>(axes_[0].step_bytes));
  } else {  // one figure per axis, and nothing more: 100 columns are not enough
    for (const Axis& axis : axes_) text += " " + axis.name + " " + format_bytes(static_cast<double>(axis.step_bytes));
    return text;
  }
  char figure[48];
  if (!exposed_.empty()) {
    std::snprintf(figure, sizeof(figure), ", exposed %.1f ms", step_exposed_ * 1e3);
  } else if (idle_.empty()) {
    std::snprintf(figure, sizeof(figure), ", comm %.1f ms", step_comm_seconds_ * 1e3);
  } else {
    std::snprintf(figure, sizeof(figure), " | idle %2.0f%%", 100.0 * idle_.back());
  }
  return text + figure;
}

double StepMeters::bytes_per_step(const std::string& axis) const {
  uint64_t total = 0;
  for (const Axis& a : axes_) {
    if (axis.empty() || a.name == axis) total += a.total_bytes;
  }
  return steps_ ? static_cast<double>(total) / steps_ : 0.0;
}

std::vector<std::string> StepMeters::axis_names() const {
  std::vector<std::string> names;
  for (const Axis& axis : axes_) names.push_back(axis.name);
  return names;
}

double StepMeters::comm_ms_per_step() const { return steps_ ? total_comm_seconds_ * 1e3 / steps_ : 0.0; }

double StepMeters::axis_ms_per_step(const Axis& axis) const {
  return steps_ ? axis.total_seconds * 1e3 / steps_ : 0.0;
}

double StepMeters::exposed_ms_per_step(const std::string& axis) const {
  if (steps_ == 0) return 0.0;
  if (axis.empty()) return total_exposed_ * 1e3 / steps_;
  for (const Exposed& e : exposed_) {
    if (e.axis == axis) return e.total * 1e3 / steps_;
  }
  return 0.0;
}

double StepMeters::hidden_fraction() const {
  const bool all = std::any_of(exposed_.begin(), exposed_.end(), [](const Exposed& e) { return e.axis.empty(); });
  double seconds = 0.0;  // of the axes recorded, or of all
  for (const Axis& axis : axes_) {
    const bool recorded =
        std::any_of(exposed_.begin(), exposed_.end(), [&](const Exposed& e) { return e.axis == axis.name; });
    if (all || recorded) seconds += axis.total_seconds;
  }
  return seconds > 0.0 ? std::max(0.0, 1.0 - total_exposed_ / seconds) : 0.0;
}

double StepMeters::idle_fraction() const {
  if (idle_.empty()) return 0.0;
  // the first step also pays for warming up: left out when there are others
  const size_t first = idle_.size() > 1 ? 1 : 0;
  double sum = 0.0;
  for (size_t i = first; i < idle_.size(); i++) sum += idle_[i];
  return sum / static_cast<double>(idle_.size() - first);
}

JsonLine StepMeters::summary_fields(Comm* world) {
  JsonLine fields;
  fields.add("bytes_sent_per_step", bytes_per_step("")).merge(routing_summary_fields());
  if (axes_.empty()) return fields;
  if (axes_.size() > 1) {
    for (const Axis& axis : axes_) {
      fields.add(axis.name + "_bytes_sent_per_step", bytes_per_step(axis.name))
          .add(axis.name + "_comm_ms_per_step", axis_ms_per_step(axis));
    }
  }
  fields.add("comm_ms_per_step", comm_ms_per_step());
  if (!exposed_.empty()) {
    fields.add("exposed_comm_ms_per_step", exposed_ms_per_step()).add("comm_hidden_fraction", hidden_fraction());
    if (exposed_.size() > 1) {
      for (const Exposed& e : exposed_) fields.add(e.axis + "_exposed_comm_ms_per_step", exposed_ms_per_step(e.axis));
    }
  }
  if (records_idle() && world != nullptr) {
    float bubble = static_cast<float>(idle_fraction());
    world->all_reduce(&bubble, 1, ReduceOp::Average);
    world_idle_ = bubble;
    fields.add("bubble_measured", world_idle_);
  }
  return fields;
}

JsonLine StepMeters::routing_summary_fields() const {
  if (run_choices_ == 0) return JsonLine();
  return JsonLine()
      .add("dropped_fraction", static_cast<double>(run_dropped_) / static_cast<double>(run_choices_))
      .add("aux_loss", last_routing_.aux_loss())
      .add("expert_imbalance", last_routing_.imbalance());
}

void StepMeters::print_summary() const {
  if (run_choices_ > 0) {
    std::printf("experts: %.2f%% of the token-choices dropped over the run; at the last step aux loss %.4f, "
                "imbalance %.2f (max/mean)\n",
                100.0 * static_cast<double>(run_dropped_) / static_cast<double>(run_choices_),
                last_routing_.aux_loss(), last_routing_.imbalance());
  }
  if (axes_.empty()) return;
  // rank 0's figures: in a pipeline or a 3D grid the ranks send different amounts (their rank tables)
  std::printf("communication per step: %s sent by rank 0, %.1f ms on its communication thread(s)\n",
              format_bytes(bytes_per_step("")).c_str(), comm_ms_per_step());
  if (axes_.size() > 1) {
    std::string by_axis;
    for (const Axis& axis : axes_) {
      char time[32];
      std::snprintf(time, sizeof(time), " in %.1f ms", axis_ms_per_step(axis));
      by_axis += (by_axis.empty() ? "" : ", ") + axis.name + " " + format_bytes(bytes_per_step(axis.name)) + time;
    }
    std::printf("  by axis: %s\n", by_axis.c_str());
  }
  // measured on the training thread: on a busy machine it also counts the wait for
  // the communication thread to be scheduled
  if (!exposed_.empty()) {
    std::string what;  // "", "dp " or "tp and dp "
    for (const Exposed& e : exposed_) {
      if (!e.axis.empty()) what += (what.empty() ? "" : "and ") + e.axis + " ";
    }
    std::printf("exposed %scomm per step: %.1f ms waited for it, so %.0f%% of the %scommunication hidden\n",
                what.c_str(), exposed_ms_per_step(), 100.0 * hidden_fraction(), what.c_str());
    if (exposed_.size() > 1) {
      std::string by_axis;
      for (const Exposed& e : exposed_) {
        char figure[48];
        std::snprintf(figure, sizeof(figure), "%s %.1f ms", e.axis.c_str(), exposed_ms_per_step(e.axis));
        by_axis += (by_axis.empty() ? "" : ", ") + std::string(figure);
      }
      std::printf("  by axis: %s\n", by_axis.c_str());
    }
  }
}

}  // namespace course
