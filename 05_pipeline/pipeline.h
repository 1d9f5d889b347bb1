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

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "05_pipeline/schedule.h"
#include "common/comm/comm.h"
#include "common/model/data.h"
#include "common/train/rank_table.h"
#include "common/model/step_loss.h"
#include "common/train/trace.h"
#include "common/train/trainer.h"

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
  OpStats total_stats() const;            // over all four, so far (bytes sent, seconds)
  uint64_t bytes_sent() const;
};

// ----------------------------------------------------------------------------
// what the executor needs of a chunk of the model
//
// The executor moves micro-batches and never looks inside a chunk, so anything
// with a forward and a backward can be pipelined: chapter 05's chunks are
// ModelParts (ModelPartChunk below); chapter 07's are tensor-parallel TPParts.

// One micro-batch's activations on a chunk: the executor fills the tokens and
// targets (first and last stage) and receives the previous stage's output into
// input; what else is kept belongs to the chunk that made it.
struct ChunkActivations {
  virtual ~ChunkActivations() = default;
  int* tokens = nullptr;   // (B, T)  on the host: the chunk copies them to its device
  int* targets = nullptr;  // (B, T)  on the host: the chunk copies them to its device
  float* input = nullptr;  // (boundary_floats)  on the run's device; unused on the first stage
};

class PipelineChunk {
 public:
  virtual ~PipelineChunk() = default;
  virtual std::unique_ptr<ChunkActivations> new_activations() = 0;
  // floats of Activations memory one micro-batch's set costs (what a pool slot holds)
  virtual size_t activation_floats() const = 0;
  // floats of Activations memory a rank's chunks share, however many micro-batches
  // they keep (--recompute's workspace: one block recomputes at a time)
  virtual size_t shared_activation_floats() const { return 0; }
  // floats that cross to the next stage, and whose gradient comes back (the
  // executor keeps those on the run's device: output, dout and dinput are there)
  virtual size_t boundary_floats() const = 0;
  // the last stage adds the micro-batch's mean loss to `loss`
  virtual void forward(ChunkActivations& acts, StepLoss& loss) = 0;
  virtual const float* output(const ChunkActivations& acts) const = 0;  // (boundary_floats)
  // dout = dL/d(output) (null on the last stage); dinput += dL/d(input) (null on the first)
  virtual void backward(ChunkActivations& acts, const float* dout, float* dinput, float dloss) = 0;
  // Zero bubble's two halves; together they must equal backward. A chunk that
  // cannot split its backward says so (and PipelineExecutor refuses zb-h1 for it).
  virtual bool splits_backward() const { return false; }
  virtual void backward_input(ChunkActivations& acts, const float* dout, float* dinput, float dloss);
  virtual void backward_weight(ChunkActivations& acts);
};

// Chapter 05's chunk: a ModelPart, sharing one BackwardWorkspace with the rank's
// other chunks (one forward or backward runs at a time).
class ModelPartChunk : public PipelineChunk {
 public:
  ModelPartChunk(ModelPart& part, BackwardWorkspace& workspace, const GPTConfig& config, int micro_batch);
  std::unique_ptr<ChunkActivations> new_activations() override;
  size_t activation_floats() const override;
  size_t shared_activation_floats() const override;
  size_t boundary_floats() const override { return part_.activation_floats(); }
  void forward(ChunkActivations& acts, StepLoss& loss) override;
  const float* output(const ChunkActivations& acts) const override;
  void backward(ChunkActivations& acts, const float* dout, float* dinput, float dloss) override;
  bool splits_backward() const override { return true; }
  void backward_input(ChunkActivations& acts, const float* dout, float* dinput, float dloss) override;
  void backward_weight(ChunkActivations& acts) override;

 private:
  ModelPart& part_;
  BackwardWorkspace& workspace_;
  GPTConfig config_;
  int micro_batch_;
};

// Chapter 05's flags besides --pp: which schedule, and what to draw.
struct ScheduleFlags {
  std::string schedule = "1f1b";  // --schedule
  int virtual_stages = 0;         // --virtual-stages: chunks per rank; 0 = 2 for interleaved, 1 otherwise
  bool dry_run = false;           // --dry-run: print the schedule, do not train
  std::string timeline;           // --timeline: where to draw the last step (or the simulated one) as SVG

  // The schedule on `ranks` pipeline ranks; FlagError when the interleaved
  // schedule's chunks cannot be equal (check_interleaved_cut) or make_schedule refuses.
  Schedule make(int ranks, const TrainOptions& options) const;
  // --dry-run: print_dry_run of the schedule on --pp ranks (FlagError without
  // --pp). Returns the exit code.
  int print_schedule(int pp, int micro_batches) const;
};
void add_schedule_flags(ArgParser& parser, ScheduleFlags& flags);

// Chapter 05's own flags: how many pipeline ranks, and the schedule's.
struct PipelineFlags : ScheduleFlags {
  int pp = 0;  // --pp: pipeline ranks; 0 = the world size
};
void add_pipeline_flags(ArgParser& parser, PipelineFlags& flags);

// Where every rank sits in chapter 05: --pp checked against the world, the schedule
// over the pp ranks, and the cut, the model in schedule.stages() parts, rank r's
// chunk c being stage schedule.stage(r, c) (every_rank, labels, head_rank).
struct PipelinePlace : StageCut {
  PipelinePlace(Run& run, const PipelineFlags& flags);
  int pp_rank() const { return rank; }
  Comm& pp_group() const { return world; }  // the ranks of the pipeline: all of them
  // rank 0, under the run header: "pipeline: schedule 1f1b, 2 ranks x 1 chunk(s), ...",
  // then every rank's stages (in place of chapter 04's line)
  void print(const std::string& backend, int micro_batch) const;

  Comm& world;
  int rank;
  Schedule schedule;

 private:
  PipelinePlace(Comm& world, Schedule schedule, const GPTConfig& config);
};

// What one rank of chapter 05 holds: its chunks' ModelParts with their AdamWs, and
// the same chunks as the executor drives them.
class RankChunks : public RankParts {
 public:
  RankChunks(const TrainOptions& options, const std::vector<StageRange>& ranges, int micro_batch, Device device);

  std::vector<PipelineChunk*> pipeline_chunks;  // [chunk]: parts[chunk], as the executor sees it

 private:
  std::vector<std::unique_ptr<ModelPartChunk>> owned_chunks_;
};

// What one rank measured in one step.
struct PipelineStepStats {
  float loss = 0.0f;            // the mean over the step's micro-batches (the last stage's rank only)
  double window_seconds = 0.0;  // from this rank's start to the step's end, which is the same for every rank
  double busy_seconds = 0.0;    // computing
  std::vector<TimedAction> spans;  // this rank's compute actions, seconds before the step's common end (negative)
  ActionCosts mean_costs;          // mean seconds of each kind of compute action
};

// Collective: every rank's spans of one step (the same number on every rank: the
// schedule gives each rank as many compute actions), gathered on every rank, in
// seconds from the earliest span's start.
std::vector<TimedAction> gather_spans(Comm& world, const std::vector<TimedAction>& mine);
// Collective: every rank's mean action costs, [rank].
std::vector<ActionCosts> gather_costs(Comm& world, const ActionCosts& mine);

// The bubble of a run's last step, besides the measured one (the meters' idle
// share): the schedule played with every rank's measured costs, and the papers'
// formula; and the step's timeline.
class BubbleReport {
 public:
  // A timeline_path where no file can be created is a UsageError now, not after the run.
  BubbleReport(const Schedule& schedule, std::string timeline_path);
  // Collective: the figures from every rank's last step. Returns the summary fields
  // schedule, chunks, bubble_simulated and bubble_formula.
  JsonLine gather(Comm& world, const PipelineStepStats& last);
  // rank 0: the three figures side by side (measured: the world's mean idle share),
  // and the timeline drawn when there is a path
  void print(double measured) const;

 private:
  const Schedule& schedule_;
  std::string timeline_path_;
  double simulated_ = 0.0;
  double formula_ = 0.0;            // zb-h1's with the ranks' mean F, B and W
  ActionCosts mean_costs_;          // over the ranks
  std::vector<TimedAction> spans_;  // every rank's compute actions
};

// FlagError unless the interleaved schedule's S = ranks x chunks stages get the same
// number of blocks each (Megatron's interleaving assumes equal chunks).
void check_interleaved_cut(ScheduleKind kind, int layers, int ranks, int chunks);

class PipelineExecutor {
 public:
  // chunks[c] is this rank's chunk for stage schedule.stage(rank, c). Micro-batch m
  // is rows [first_row + m B, first_row + (m+1) B) of the global batch, B =
  // micro_batch (first_row: where a data-parallel rank's slice starts, chapter 07).
  // The gradients it receives and sends live on `device`, the chunks' device.
  // `message_type`: what the boundary's activations and gradients travel as (bf16 under
  // --dtype bf16: half the bytes; rounded by the sender, widened by the receiver).
  // FlagError for zb-h1 with chunks that cannot split their backward.
  PipelineExecutor(const Schedule& schedule, int rank, std::vector<PipelineChunk*> chunks, PipelineChannels& channels,
                   int micro_batch, int first_row, Device device, DType message_type);

  // Runs this rank's list for training step `step`. Gradients accumulate (+=) into the chunks.
  // Collective over world (a barrier closes the step, so every rank's window ends
  // together). Returns what it measured, kept until the next step.
  const PipelineStepStats& run_step(Comm& world, int step, BatchSampler& sampler, float dloss, Trace& trace);
  // Called with chunk c as soon as c's last backward of the step has run (with zb-h1
  // its last weight half): its gradients are final, while the backwards of the
  // rank's other chunks, and of the stages before it, still run. Chapter 07 starts
  // the chunk's data-parallel reduction there, as Megatron's overlap_grad_reduce
  // does under a pipeline. Empty: none (chapter 05).
  void on_gradients_done(std::function<void(int chunk)> hook) { gradients_done_ = std::move(hook); }
  // Called with each compute action (forward, backward or a half) just before it
  // runs. Chapter 07's ZeRO-2/3 give a chunk its whole gradient buffer there, at its
  // first backward of the step.
  void before_compute(std::function<void(const Action&)> hook) { before_compute_ = std::move(hook); }
  const PipelineStepStats& last_step() const { return last_step_; }

  // bytes of activations one micro-batch costs chunk c (its activation_floats)
  double slot_bytes(int chunk) const;
  // the activation memory this rank's pools grow to: sum over its chunks of
  // peak_live_slots(chunk) x slot_bytes(chunk), plus what the chunks share (once)
  double predicted_activation_bytes() const;
  // for the per-rank table: the most micro-batches this rank keeps at once, and
  // predicted_activation_bytes
  std::vector<RankColumn> memory_columns() const;

 private:
  struct Slot {
    std::unique_ptr<ChunkActivations> acts;
    Buffer dout;         // (boundary_floats)  received from the next stage, on the device
    Buffer dinput;       // (boundary_floats)  sent to the previous stage, on the device
    TypedBuffer<bf16> activation_message;  // (boundary_floats)  bf16 messages: the output as sent
    Work activation_sent;
  };
  // A gradient on its way to the previous stage: its buffer lives until the send is done.
  struct GradientInFlight {
    Work sent;
    Buffer values;              // fp32 messages: the gradient itself
    TypedBuffer<bf16> message;  // bf16 messages: its bf16 copy
  };
  Slot& slot(int micro_batch, int chunk);
  void run_action(const Action& action, int step, BatchSampler& sampler, float dloss, PipelineStepStats& stats,
                  Trace& trace, double step_start);
  void release(int micro_batch, int chunk);

  const Schedule& schedule_;
  int rank_;
  std::vector<PipelineChunk*> chunks_;
  PipelineChannels& channels_;
  int micro_batch_;
  int first_row_;
  Device device_;
  DType message_type_;
  std::vector<bool> last_use_;  // [action index]: the last action of its (micro-batch, chunk)
  std::vector<bool> last_gradient_;  // [action index]: the last backward (or W) of its chunk
  std::function<void(int)> gradients_done_;
  std::function<void(const Action&)> before_compute_;
  std::map<std::pair<int, int>, Slot> slots_;                    // (micro-batch, chunk) in flight
  std::vector<std::vector<std::unique_ptr<ChunkActivations>>> pool_;  // [chunk]: free slots
  std::vector<GradientInFlight> gradients_in_flight_;
  TypedBuffer<bf16> received_message_;  // (boundary_floats)  bf16 messages: what a receive brings, then widened
  PipelineStepStats last_step_;
  StepLoss loss_;  // the last stage's chunk adds each micro-batch's; read once, at the step's end
};

}  // namespace course
