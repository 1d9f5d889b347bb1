// Running one rank's part of a pipeline schedule (schedule.h).
//
// The executor walks its rank's action list once per training step:
//
//   recv activation m  ->  wait for the previous stage's output of micro-batch m
//   F m                ->  forward through this chunk, keep the activations
//   send activation m  ->  hand the output to the communication thread, go on
//   recv gradient m    ->  wait for dL/d(output) from the next stage
//   B m  (or B + W)    ->  backward; W later for zero bubble
//   send gradient m    ->  hand dL/d(input) to the communication thread, go on
//
// A micro-batch's activations take a slot from the chunk's pool at its first
// action there and give it back after its last. The pool only grows when every
// slot is taken, so it ends as large as the schedule keeps alive at once
// (peak_live_slots) and the memory tracker's peak is exactly that. (Allocating a
// slot anew for every micro-batch, and touching its fresh pages, took 11 ms per
// 21 MB slot here, a third of a forward: the timelines showed it as gaps.)
#pragma once

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "05_pipeline/schedule.h"
#include "common/comm/comm.h"
#include "common/data.h"
#include "common/trace.h"

namespace course {

// One Comm per direction per neighbour, so that no message ever queues behind a
// message going the other way (each Comm runs its operations in order on its own
// thread). Each is a group of two: the sender and the receiver.
struct PipelineChannels {
  // Collective over world: builds the channels `schedule` needs (rank N-1 sends to
  // rank 0 only when chunks wrap around, in the interleaved schedule).
  PipelineChannels(Comm& world, const Schedule& schedule);

  std::unique_ptr<Comm> activations_in;   // from the previous rank (null if none)
  std::unique_ptr<Comm> activations_out;  // to the next rank
  std::unique_ptr<Comm> gradients_in;     // from the next rank
  std::unique_ptr<Comm> gradients_out;    // to the previous rank
  uint64_t bytes_sent() const;            // over all four, so far
};

// What one rank measured in one step.
struct PipelineStepStats {
  float loss = 0.0f;            // the mean over the step's micro-batches (the last stage's rank only)
  double window_seconds = 0.0;  // from the step's start to its end, the same for every rank
  double busy_seconds = 0.0;    // computing
  std::vector<TimedAction> spans;  // this rank's compute actions, seconds from the step's start
  ActionCosts mean_costs;          // mean seconds of each kind of compute action
};

// Collective: every rank's spans of one step (the same number on every rank: the
// schedule gives each rank as many compute actions), gathered on every rank.
std::vector<TimedAction> gather_spans(Comm& world, const std::vector<TimedAction>& mine);
// Collective: every rank's mean action costs, [rank].
std::vector<ActionCosts> gather_costs(Comm& world, const ActionCosts& mine);

class PipelineExecutor {
 public:
  // chunks[c] is this rank's part for stage schedule.stage(rank, c).
  PipelineExecutor(const Schedule& schedule, int rank, std::vector<ModelPart*> chunks, PipelineChannels& channels,
                   const GPTConfig& config, int micro_batch);

  // Runs this rank's list for training step `step`: micro-batch m is rows
  // [m B, (m+1) B) of the global batch. Gradients accumulate (+=) into the chunks.
  // Collective over world (a barrier opens and closes the step, so every rank's
  // measured window is the same).
  PipelineStepStats run_step(Comm& world, int step, BatchSampler& sampler, float dloss, Trace& trace);

  // bytes of activations one micro-batch costs chunk c (PartActivations::floats)
  double slot_bytes(int chunk) const;
  // the activation memory this rank's pools grow to: sum over its chunks of
  // peak_live_slots(chunk) x slot_bytes(chunk)
  double predicted_activation_bytes() const;

 private:
  struct Slot {
    std::unique_ptr<PartActivations> acts;
    Buffer dout;         // (B, T, C)  received from the next stage
    Buffer dinput;       // (B, T, C)  sent to the previous stage
    Work activation_sent;
  };
  Slot& slot(int micro_batch, int chunk);
  void run_action(const Action& action, int step, BatchSampler& sampler, float dloss, PipelineStepStats& stats,
                  Trace& trace, double step_start);
  void release(int micro_batch, int chunk);

  const Schedule& schedule_;
  int rank_;
  std::vector<ModelPart*> chunks_;
  PipelineChannels& channels_;
  GPTConfig config_;
  int micro_batch_;
  BackwardWorkspace workspace_;
  std::vector<bool> last_use_;  // [action index]: the last action of its (micro-batch, chunk)
  std::map<std::pair<int, int>, Slot> slots_;                    // (micro-batch, chunk) in flight
  std::vector<std::vector<std::unique_ptr<PartActivations>>> pool_;  // [chunk]: free slots
  // gradients on their way to the previous stage: the buffer lives until the send is done
  std::vector<std::pair<Work, Buffer>> gradients_in_flight_;
};

}  // namespace course
