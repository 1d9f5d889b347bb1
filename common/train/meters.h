// What a step of a parallel technique costs, measured the same way in every
// chapter, so that the chapters can be compared side by side:
//
//   sent        bytes this rank put on the wire, per axis of communication (02's
//               gradient all-reduces; 03's gradients and parameters; 07's tp, pp, dp)
//   comm        time the communication threads spent in those operations
//   exposed     time the training thread waited for communication it had started
//               earlier (DDP's buckets; 07's DP reductions, one axis of three): the
//               part of comm that did not overlap compute
//   idle        the share of a step a rank had nothing to compute (pipelines)
//   routing     with MoE blocks: the load-balancing loss, the token-choices dropped
//               over capacity and the experts' load imbalance (common/model/moe.h)
//
// The technique names its axes once and, during a step, records what only it
// knows (exposed, idle); the training loop (trainer.h) reads the counters around
// every step and prints the figures on the step line, in the JSON log, and per
// step in the summary.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/train/metrics.h"
#include "common/model/moe.h"

namespace course {

// One kind of operation's counters on `comm` (zero before its first call). Read
// them when nothing is in flight.
OpStats op_stats(const Comm& comm, const std::string& operation);

class StepMeters {
 public:
  // An axis of communication. `name` prefixes its JSON fields ("dp" -> dp_bytes_sent)
  // and labels it on the step line; `counters` returns what it has cost so far (a
  // Comm's total_stats, one kind of operation's op_stats, a technique's own count).
  // The loop takes the difference around each step.
  void add_axis(const std::string& name, std::function<OpStats()> counters);

  // ---- recorded by the technique during a step ----------------------------------
  // `axis`: the axis whose operations the wait was for, when each axis is counted on
  // its own (07: the TP collectives and the DP reductions; its pipeline's receives
  // are its idle time); "" = all axes
  // (CourseError when a technique names some axes and not others)
  void record_exposed(double seconds, const std::string& axis = "");
  void record_idle(double busy_seconds, double window_seconds);
  // what the MoE routers did in this step: the model adds each forward's layers
  // (GPT's routing argument); emptied when a step starts
  RoutingStats routing;

  // ---- read by the training loop ---------------------------------------------------
  void start_step();
  void end_step();
  // this step: bytes_sent (all axes), <axis>_bytes_sent (with several axes), comm_ms,
  // and exposed_comm_ms (and <axis>_exposed_comm_ms with several axes recorded) /
  // idle_fraction when the technique records them; with
  // routing: aux_loss, dropped (token-choices), dropped_fraction, expert_imbalance, and
  // expert_choices_0 .. expert_choices_<E-1>: the token-choices routed to each expert
  // (before capacity), summed over the step's layers and micro-batches
  JsonLine step_fields() const;
  // this step for the printed line: " | sent 1.2 MB, exposed 3.0 ms | idle 40%",
  // with routing " | aux 1.0123, dropped 0.0%" (with several axes " | sent 5.6 MB | dropped 0.0%")
  std::string step_text() const;
  // per step over the run: bytes_sent_per_step, <axis>_bytes_sent_per_step and
  // <axis>_comm_ms_per_step (with several axes),
  // comm_ms_per_step, exposed_comm_ms_per_step (and <axis>_exposed_comm_ms_per_step
  // with several axes recorded) and comm_hidden_fraction, and
  // bubble_measured: the idle share, mean over the world's ranks (collective); with
  // routing, dropped_fraction over the run and the last step's aux_loss.
  JsonLine summary_fields(Comm* world);
  // rank 0, after the summary: what was sent per step, by axis, and how much of it
  // the step waited for; what the routers dropped
  void print_summary() const;

  // Over the run, per step:
  double bytes_per_step(const std::string& axis) const;  // "" = all axes
  double comm_ms_per_step() const;
  double exposed_ms_per_step(const std::string& axis = "") const;  // "" = every axis recorded
  double hidden_fraction() const;  // of the comm time (of the axes recorded), the part not exposed
  // the axes record_exposed named, in the order they were first named ("" = all axes)
  std::vector<std::string> exposed_axes() const;
  // this rank's mean idle share, leaving out the first step (it also pays for warming
  // up) when there are others
  double idle_fraction() const;
  bool records_idle() const { return !idle_.empty(); }
  bool records_exposed() const { return !exposed_.empty(); }
  int steps() const { return steps_; }  // measured so far
  std::vector<std::string> axis_names() const;
  // after summary_fields: bubble_measured, for a technique's closing lines
  double world_idle_fraction() const { return world_idle_; }

 private:
  struct Axis {
    std::string name;
    std::function<OpStats()> counters;
    OpStats before;          // at the start of this step
    uint64_t step_bytes = 0;
    uint64_t total_bytes = 0;
    double total_seconds = 0.0;
  };
  double axis_ms_per_step(const Axis& axis) const;  // its time on the communication threads
  std::vector<Axis> axes_;
  int steps_ = 0;
  double step_comm_seconds_ = 0.0, total_comm_seconds_ = 0.0;
  struct Exposed {
    std::string axis;  // record_exposed's ("" = all)
    double step = 0.0, total = 0.0;
  };
  std::vector<Exposed> exposed_;
  double step_exposed_ = 0.0, total_exposed_ = 0.0;  // every axis recorded
  std::vector<double> idle_;  // one per step that recorded it
  double world_idle_ = 0.0;   // idle_fraction, mean over the world's ranks
  RoutingStats last_routing_;                     // the last step's, after end_step
  int64_t run_choices_ = 0, run_dropped_ = 0;     // token-choices over the run, and those dropped
  JsonLine routing_fields() const;                // this step's, for step_fields
  std::string comm_text() const;                  // step_text's communication figures
  JsonLine routing_summary_fields() const;        // the run's, for summary_fields
};

}  // namespace course
