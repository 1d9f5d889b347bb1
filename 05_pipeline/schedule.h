// Pipeline schedules as data.
//
// A schedule is, for every pipeline rank, the ordered list of what it does in one
// training step: forward(micro-batch, chunk), backward(...), and the sends and
// receives those imply. One function, make_schedule, builds the lists; everything
// else only reads them:
//
//   the trainer (pipeline.h)  executes its own rank's list, action by action;
//   the simulator (below)     plays all the lists with given costs: makespan, idle
//                             time, bubble, and deadlocks found, never hung on;
//   the timelines (below)     draw what the simulator (or a real run) did.
//
// Virtual stages. The model is cut into S = N x V consecutive stages. Rank r owns
// V of them, chunk c being stage c N + r (V = 1 except for the interleaved
// schedule), so activations go rank 0 -> 1 -> ... -> N-1 -> 0 -> ... and gradients
// come back the other way.
//
// Channels. Between two neighbouring ranks each direction is its own FIFO channel
// (activations r -> r+1, gradients r+1 -> r; pipeline.h gives each a Comm), and a
// receiver takes messages in the order its sender sent them. make_schedule's lists
// keep that order, and the simulator checks it.
#pragma once

#include <string>
#include <vector>

#include "common/model/model.h"

namespace course {

enum class ScheduleKind {
  GPipe,         // all forwards, then all backwards
  OneFOneB,      // warm up, then one forward one backward (PipeDream-flush / Megatron)
  Interleaved,   // 1F1B over V chunks per rank (Megatron's interleaved schedule)
  ZeroBubbleH1,  // 1F1B with backward split into input and weight halves (Qi et al., 2023)
};

// "gpipe", "1f1b", "interleaved", "zb-h1"; UsageError listing them for anything else
ScheduleKind parse_schedule(const std::string& name);
const char* schedule_name(ScheduleKind kind);
// A FlagError for --recompute full with zb-h1: the deferred weight halves read every
// block's layer inputs, which full recomputation does not keep.
void check_recompute_schedule(ScheduleKind kind, Recompute recompute);
const std::vector<std::string>& schedule_names();

enum class ActionType {
  Forward,         // F: a chunk's forward of one micro-batch
  Backward,        // B: its whole backward (input and weight gradients)
  BackwardInput,   // B: zero bubble's first half, the input gradient the previous stage waits for
  BackwardWeight,  // W: zero bubble's second half, the weight gradients, deferred into idle time
  RecvActivation,  // the chunk's input, from the previous stage
  SendActivation,  // the chunk's output, to the next stage
  RecvGradient,    // dL/d(output), from the next stage
  SendGradient,    // dL/d(input), to the previous stage
};

struct Action {
  ActionType type;
  int micro_batch;
  int chunk;  // which of the rank's chunks (0 .. V-1)
};

bool is_compute(ActionType type);
bool is_backward(ActionType type);  // B, or zero bubble's B or W half
// "F3", "B3", "W3" (chunk 1 of an interleaved rank: "F3b"), "recv activation 3", ...
std::string action_label(const Action& action, int chunks);

struct Schedule {
  ScheduleKind kind;
  int ranks;          // N
  int micro_batches;  // M
  int chunks;         // V: model chunks per rank
  std::vector<std::vector<Action>> actions;  // [rank]: that rank's step, in order

  int stages() const { return ranks * chunks; }
  int stage(int rank, int chunk) const { return chunk * ranks + rank; }
  int rank_of_stage(int stage) const { return stage % ranks; }
};

// The lists for (kind, N, M, V). UsageError when the combination cannot be
// scheduled: N or M < 1, V != 1 for a non-interleaved schedule, or interleaved with
// V < 2 or M not a multiple of N (Megatron's schedule fills the pipeline in groups
// of N micro-batches per chunk).
Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks = 1);

// The bubble fraction the papers give, for equal stages:
//   GPipe and 1F1B  (N-1)/(M+N-1)            whatever the forward and backward cost;
//   interleaved     (N-1)/(V M + N-1);
//   zb-h1           (N-1)(F+B-W) / (M(F+B+W) + (N-1)(F+B-W)), with F, B, W the
//                   forward, backward-input and weight times (costs): the idle time
//                   the W's cannot fill. With F = B = W, (N-1)/(3M + N-1).
// The zb-h1 formula holds for M >= N.
double bubble_formula(ScheduleKind kind, int ranks, int micro_batches, int chunks);
struct ActionCosts;
double bubble_formula(ScheduleKind kind, int ranks, int micro_batches, int chunks, const ActionCosts& costs);

// The most micro-batches whose activations `rank` keeps at once: a micro-batch's
// slot on a chunk is taken by its first action there and given back after its
// last (its backward, or its W). chunk = -1: all the rank's chunks together (the
// papers' count: GPipe M, 1F1B N - r); chunk = c: chunk c alone, which is how many
// slots the trainer's pool for that chunk grows to.
int peak_live_slots(const Schedule& schedule, int rank, int chunk = -1);

// ---- the simulator -------------------------------------------------------------

// How long each compute action takes, in any unit, per chunk (a chunk of an
// interleaved rank holds 1/V of the blocks: pass costs divided by V for the
// papers' figures). Sends and receives take no time; a message is there as soon
// as its sender has produced it.
struct ActionCosts {
  double forward = 1.0;
  double backward = 2.0;         // Backward (input + weight)
  double backward_input = 1.0;   // BackwardInput
  double backward_weight = 1.0;  // BackwardWeight
  double of(ActionType type) const;
};
// The papers' costs: forward 1, backward 2 (1 + 1 when split), each divided by V.
ActionCosts unit_costs(int chunks);

struct TimedAction {
  int rank;
  Action action;
  double start, end;
};

struct Simulation {
  bool deadlocked = false;
  std::string deadlock;  // when deadlocked: every stuck rank and what it waits for
  double makespan = 0.0;
  std::vector<double> busy;  // [rank] time spent computing
  std::vector<TimedAction> spans;  // compute actions as they ran
  double bubble_fraction() const;  // idle / (ranks x makespan)
  double idle_fraction(int rank) const;
};

// Plays every rank's list: a rank runs its next action as soon as the message it
// needs has been sent. If at some point no rank can run anything, the schedule
// deadlocks; the result says which ranks are stuck on which action. A CourseError
// is thrown for lists that are wrong rather than stuck (a receive that takes
// another message than its channel's next one, an action on a micro-batch that is
// not in the schedule).
Simulation simulate(const Schedule& schedule, const ActionCosts& costs);
// The same with each rank's own costs (a run's measured ones: the last rank's
// chunk also computes the head and the loss).
Simulation simulate(const Schedule& schedule, const std::vector<ActionCosts>& costs_per_rank);

// ---- timelines -----------------------------------------------------------------

// One row per rank, one cell of `cell` characters per `unit` of time: the action's
// label where it starts, '-' while it runs on, '.' while the rank idles.
//   rank 0 | F0 F1 F2 F3 .  .  .  B0 -- B1 -- ...
std::string text_timeline(const std::vector<TimedAction>& spans, int ranks, int chunks, double unit);

// The same as an SVG picture (forward blue, backward green, weight orange; later
// chunks of an interleaved rank lighter). time_unit names the x axis ("unit" for a
// simulation, "ms" for a run), written atomically: CourseError naming the path if it cannot be.
void write_timeline_svg(const std::string& path, const std::string& title, const std::vector<TimedAction>& spans,
                        int ranks, int chunks, const std::string& time_unit);

// --dry-run: each rank's list, the simulated timeline with its makespan and bubble
// next to the formula, and with a path its SVG. CourseError if the schedule deadlocks.
void print_dry_run(const Schedule& schedule, const std::string& timeline_path);

}  // namespace course
