#include "05_pipeline/pipeline.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>

#include "common/train/checkpoint.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"
#include "common/train/metrics.h"
#include "common/train/trainer_parts.h"

namespace course {

// ----------------------------------------------------------------------------
// channels

PipelineChannels::PipelineChannels(Comm& world, const Schedule& schedule) {
  const int N = schedule.ranks, rank = world.rank();
  // link l carries activations from rank l to rank l+1 and gradients back; the
  // last link, N-1 -> 0, exists only when chunks wrap around
  const int links = schedule.chunks > 1 ? N : N - 1;
  for (int link = 0; link < links; link++) {
    const int low = link, high = (link + 1) % N;
    const bool member = rank == low || rank == high;
    // key 0 = the sender: inside each two-rank Comm the sender is rank 0, the receiver rank 1
    std::unique_ptr<Comm> activations = world.split(member ? 0 : -1, rank == low ? 0 : 1);
    std::unique_ptr<Comm> gradients = world.split(member ? 0 : -1, rank == high ? 0 : 1);
    if (rank == low) {
      activations_out = std::move(activations);
      gradients_in = std::move(gradients);
    } else if (rank == high) {
      activations_in = std::move(activations);
      gradients_out = std::move(gradients);
    }
  }
}

OpStats PipelineChannels::total_stats() const {
  OpStats total;
  for (const std::unique_ptr<Comm>* comm : {&activations_in, &activations_out, &gradients_in, &gradients_out}) {
    if (!*comm) continue;
    const OpStats stats = (*comm)->total_stats();
    total.calls += stats.calls;
    total.bytes_sent += stats.bytes_sent;
    total.bytes_received += stats.bytes_received;
    total.seconds += stats.seconds;
  }
  return total;
}

uint64_t PipelineChannels::bytes_sent() const { return total_stats().bytes_sent; }

// ----------------------------------------------------------------------------
// chunks

void PipelineChunk::backward_input(ChunkActivations&, const float*, float*, float) {
  throw CourseError("this pipeline chunk cannot split its backward (splits_backward() is false)");
}

void PipelineChunk::backward_weight(ChunkActivations&) {
  throw CourseError("this pipeline chunk cannot split its backward (splits_backward() is false)");
}

namespace {
struct PartSlot : ChunkActivations {
  PartSlot(const GPTConfig& config, StageRange range, int micro_batch, Device device)
      : part(config, range, micro_batch, device) {
    tokens = part.batch.tokens();
    targets = part.batch.targets();
    input = part.input.data();
  }
  PartActivations part;
};
PartActivations& part_of(ChunkActivations& acts) { return static_cast<PartSlot&>(acts).part; }
const PartActivations& part_of(const ChunkActivations& acts) { return static_cast<const PartSlot&>(acts).part; }
}  // namespace

ModelPartChunk::ModelPartChunk(ModelPart& part, BackwardWorkspace& workspace, const GPTConfig& config,
                               int micro_batch)
    : part_(part), workspace_(workspace), config_(config), micro_batch_(micro_batch) {}

std::unique_ptr<ChunkActivations> ModelPartChunk::new_activations() {
  return std::make_unique<PartSlot>(config_, part_.range(), micro_batch_, part_.device());
}

size_t ModelPartChunk::activation_floats() const {
  return PartActivations::floats(config_, part_.range(), micro_batch_);
}

size_t ModelPartChunk::shared_activation_floats() const { return RecomputeWorkspace::floats(config_, micro_batch_); }

void ModelPartChunk::forward(ChunkActivations& acts, StepLoss& loss) {
  part_.forward(part_of(acts), loss, workspace_);
}

const float* ModelPartChunk::output(const ChunkActivations& acts) const { return part_.output(part_of(acts)); }

void ModelPartChunk::backward(ChunkActivations& acts, const float* dout, float* dinput, float dloss) {
  part_.backward(part_of(acts), dout, dinput, dloss, workspace_);
}

void ModelPartChunk::backward_input(ChunkActivations& acts, const float* dout, float* dinput, float dloss) {
  part_.backward_input(part_of(acts), dout, dinput, dloss, workspace_);
}

void ModelPartChunk::backward_weight(ChunkActivations& acts) { part_.backward_weight(part_of(acts)); }

// ----------------------------------------------------------------------------
// flags

static int chunks_per_rank(const ScheduleFlags& flags, ScheduleKind kind) {
  return flags.virtual_stages > 0 ? flags.virtual_stages : (kind == ScheduleKind::Interleaved ? 2 : 1);
}

void add_schedule_flags(ArgParser& parser, ScheduleFlags& flags) {
  parser.add_choice("--schedule", &flags.schedule, schedule_names(), "the order of forwards and backwards");
  parser.add_int("--virtual-stages", &flags.virtual_stages, 0,
                 "model chunks per rank (interleaved); 0 = 2 for interleaved");
  parser.add_switch("--dry-run", &flags.dry_run, "print the schedule, its simulation and timeline; do not train");
  parser.add_string("--timeline", &flags.timeline,
                    "write the last step's timeline (or, with --dry-run, the simulated one) as SVG");
}

Schedule ScheduleFlags::make(int ranks, const TrainOptions& options) const {
  const ScheduleKind kind = parse_schedule(schedule);
  check_interleaved_cut(kind, options.model.n_layer, ranks, chunks_per_rank(*this, kind));
  return make_schedule(kind, ranks, options.micro_batches, chunks_per_rank(*this, kind));
}

int ScheduleFlags::print_schedule(int pp, int micro_batches) const {
  if (pp == 0) throw FlagError("--dry-run needs --pp: how many ranks to schedule");
  const ScheduleKind kind = parse_schedule(schedule);
  print_dry_run(make_schedule(kind, pp, micro_batches, chunks_per_rank(*this, kind)), timeline);
  return 0;
}

// ----------------------------------------------------------------------------
// a rank's chunks

void add_pipeline_flags(ArgParser& parser, PipelineFlags& flags) {
  parser.add_int("--pp", &flags.pp, 0, "pipeline ranks (model parts); 0 = the world size");
  add_schedule_flags(parser, flags);
}

// the model in schedule.stages() parts, rank r's chunk c being stage schedule.stage(r, c)
static std::vector<std::vector<StageRange>> every_rank_chunks(const GPTConfig& config, const Schedule& schedule) {
  const std::vector<StageRange> stages = split_stages(config, schedule.stages());
  std::vector<std::vector<StageRange>> every_rank(schedule.ranks);
  for (int r = 0; r < schedule.ranks; r++) {
    for (int c = 0; c < schedule.chunks; c++) every_rank[r].push_back(stages[schedule.stage(r, c)]);
  }
  return every_rank;
}

static Schedule pipeline_schedule(const Run& run, const PipelineFlags& flags) {
  const Schedule schedule = flags.make(whole_world_degree("--pp", flags.pp, run.ranks), run.options);
  check_recompute_schedule(schedule.kind, run.options.model.recompute);
  return schedule;
}

PipelinePlace::PipelinePlace(Run& run, const PipelineFlags& flags)
    : PipelinePlace(*run.world, pipeline_schedule(run, flags), run.options.model) {}

PipelinePlace::PipelinePlace(Comm& world_comm, Schedule pipeline_schedule, const GPTConfig& config)
    : StageCut(config, every_rank_chunks(config, pipeline_schedule)),
      world(world_comm),
      rank(world_comm.rank()),
      schedule(std::move(pipeline_schedule)) {}

void PipelinePlace::print(const std::string& backend, int micro_batch) const {
  std::printf("pipeline: schedule %s, %d ranks x %d chunk(s), %d micro-batches of %d sequence(s), backend %s\n",
              schedule_name(schedule.kind), schedule.ranks, schedule.chunks, schedule.micro_batches, micro_batch,
              backend.c_str());
  print_ranks();
}

RankChunks::RankChunks(const TrainOptions& options, const std::vector<StageRange>& ranges, int micro_batch,
                       Device device)
    : RankParts(options, ranges, micro_batch, device) {
  for (ModelPart* part : parts) {
    owned_chunks_.push_back(std::make_unique<ModelPartChunk>(*part, workspace, options.model, micro_batch));
    pipeline_chunks.push_back(owned_chunks_.back().get());
  }
}

// ----------------------------------------------------------------------------
// the executor

void check_interleaved_cut(ScheduleKind kind, int layers, int ranks, int chunks) {
  if (kind == ScheduleKind::Interleaved && layers % (ranks * chunks) != 0) {
    throw FlagError("interleaved: --layers " + std::to_string(layers) + " does not cut into " +
                    std::to_string(ranks) + " ranks x " + std::to_string(chunks) + " chunks of equal size (hint: " +
                    "use --layers " + std::to_string(ranks * chunks) + " or a multiple)");
  }
}

PipelineExecutor::PipelineExecutor(const Schedule& schedule, int rank, std::vector<PipelineChunk*> chunks,
                                   PipelineChannels& channels, int micro_batch, int first_row, Device device,
                                   DType message_type)
    : schedule_(schedule),
      rank_(rank),
      chunks_(std::move(chunks)),
      channels_(channels),
      micro_batch_(micro_batch),
      first_row_(first_row),
      device_(device),
      message_type_(message_type),
      pool_(chunks_.size()),
      loss_(schedule.micro_batches, device) {
  for (const PipelineChunk* chunk : chunks_) {
    if (schedule.kind == ScheduleKind::ZeroBubbleH1 && !chunk->splits_backward()) {
      throw FlagError("--schedule zb-h1 needs a backward split into input and weight halves, which these model "
                       "chunks do not have (hint: use --schedule 1f1b or interleaved)");
    }
  }
  // walking the list backwards, the first time a (micro-batch, chunk) is seen is its last use
  const std::vector<Action>& actions = schedule_.actions[rank_];
  last_use_.assign(actions.size(), false);
  std::set<std::pair<int, int>> seen;
  for (size_t i = actions.size(); i-- > 0;) {
    last_use_[i] = seen.insert({actions[i].micro_batch, actions[i].chunk}).second;
  }
  // the same walk: the first backward-type action seen of a chunk is its last
  last_gradient_.assign(actions.size(), false);
  std::set<int> finished;
  for (size_t i = actions.size(); i-- > 0;) {
    last_gradient_[i] = is_backward(actions[i].type) && finished.insert(actions[i].chunk).second;
  }
}

double PipelineExecutor::slot_bytes(int chunk) const {
  return 4.0 * chunks_[chunk]->activation_floats();
}

double PipelineExecutor::predicted_activation_bytes() const {
  double bytes = 0.0;
  for (int c = 0; c < static_cast<int>(chunks_.size()); c++) {
    bytes += peak_live_slots(schedule_, rank_, c) * slot_bytes(c);
  }
  return bytes + 4.0 * chunks_[0]->shared_activation_floats();
}

std::vector<RankColumn> PipelineExecutor::memory_columns() const {
  return {{"live_micro_batches", "live mbs", static_cast<double>(peak_live_slots(schedule_, rank_)), ColumnUnit::Count},
          {"predicted_activations", "predicted", predicted_activation_bytes(), ColumnUnit::Bytes}};
}

PipelineExecutor::Slot& PipelineExecutor::slot(int micro_batch, int chunk) {
  Slot& slot = slots_[{micro_batch, chunk}];
  if (!slot.acts) {
    std::vector<std::unique_ptr<ChunkActivations>>& free_slots = pool_[chunk];
    if (free_slots.empty()) {
      slot.acts = chunks_[chunk]->new_activations();
    } else {
      slot.acts = std::move(free_slots.back());
      free_slots.pop_back();
    }
  }
  return slot;
}

void PipelineExecutor::release(int micro_batch, int chunk) {
  auto found = slots_.find({micro_batch, chunk});
  // the activation we sent lives in these buffers: the send must be over first
  found->second.activation_sent.wait();
  pool_[chunk].push_back(std::move(found->second.acts));
  slots_.erase(found);
}

static const char* span_name(ActionType type) {
  switch (type) {
    case ActionType::Forward: return "forward";
    case ActionType::Backward: return "backward";
    case ActionType::BackwardInput: return "backward input";
    case ActionType::BackwardWeight: return "backward weight";
    case ActionType::RecvActivation: return "wait for activation";
    case ActionType::SendActivation: return "send activation";
    case ActionType::RecvGradient: return "wait for gradient";
    case ActionType::SendGradient: return "send gradient";
  }
  return "?";
}

void PipelineExecutor::run_action(const Action& a, int step, BatchSampler& sampler, float dloss,
                                  PipelineStepStats& stats, Trace& trace, double step_start) {
  PipelineChunk& chunk = *chunks_[a.chunk];
  const size_t boundary = chunk.boundary_floats();  // (B, T, C) for chapter 05
  const int stage = schedule_.stage(rank_, a.chunk);
  const bool first_stage = stage == 0, last_stage = stage == schedule_.stages() - 1;
  const double start = now_seconds();
  Slot& s = slot(a.micro_batch, a.chunk);

  switch (a.type) {
    case ActionType::RecvActivation:
      recv_boundary(*channels_.activations_in, s.acts->input, boundary, /*sender=*/0, message_type_,
                    received_message_, device_);
      break;
    case ActionType::Forward: {
      if (first_stage || last_stage) {
        sampler.fill(step, first_row_ + a.micro_batch * micro_batch_, micro_batch_, s.acts->tokens, s.acts->targets);
      }
      chunk.forward(*s.acts, loss_);  // the last stage's: in micro-batch order, as chapter 00 adds them
      break;
    }
    case ActionType::SendActivation:
      s.activation_sent = send_boundary(*channels_.activations_out, chunk.output(*s.acts), boundary, /*receiver=*/1,
                                        message_type_, s.activation_message, device_);
      break;
    case ActionType::RecvGradient:
      s.dout = Buffer(boundary, MemCategory::CommBuffers, device_);
      recv_boundary(*channels_.gradients_in, s.dout.data(), boundary, /*sender=*/0, message_type_, received_message_,
                    device_);
      break;
    case ActionType::Backward:
    case ActionType::BackwardInput: {
      // backward_input reuses the output's buffer: the send that reads it must be over
      s.activation_sent.wait();
      s.activation_message = TypedBuffer<bf16>();  // sent
      // zeroed: backward adds into it
      if (!first_stage) s.dinput = Buffer(boundary, MemCategory::CommBuffers, device_);
      const float* dout = last_stage ? nullptr : s.dout.data();
      float* dinput = first_stage ? nullptr : s.dinput.data();
      if (a.type == ActionType::Backward) {
        chunk.backward(*s.acts, dout, dinput, dloss);
      } else {
        chunk.backward_input(*s.acts, dout, dinput, dloss);
      }
      s.dout = Buffer();  // used up
      break;
    }
    case ActionType::BackwardWeight:
      chunk.backward_weight(*s.acts);
      break;
    case ActionType::SendGradient: {
      GradientInFlight gradient;
      gradient.sent = send_boundary(*channels_.gradients_out, s.dinput.data(), boundary, /*receiver=*/1,
                                    message_type_, gradient.message, device_);
      // fp32: the gradient's own buffer is the message; bf16: its copy is, and it can go
      if (message_type_ == DType::F32) gradient.values = std::move(s.dinput);
      s.dinput = Buffer();
      gradients_in_flight_.push_back(std::move(gradient));
      break;
    }
  }

  // a compute span ends when the device has finished, not when its ops are queued
  if (is_compute(a.type)) synchronize(device_);
  const double end = now_seconds();
  if (is_compute(a.type)) {
    stats.busy_seconds += end - start;
    stats.spans.push_back({rank_, a, start - step_start, end - step_start});
  }
  if (trace.enabled()) {
    // a receive lasts as long as this rank waited for it (the bubble, on the timeline);
    // a send only hands the bytes to the channel's thread: it shows as the moment it was issued
    const bool receive = a.type == ActionType::RecvActivation || a.type == ActionType::RecvGradient;
    trace.span(action_label(a, schedule_.chunks), is_compute(a.type) ? "compute" : "communication", start,
               is_compute(a.type) || receive ? end : start,
               is_compute(a.type) ? Trace::kComputeLane : Trace::kCommunicationLane,
               JsonLine().add("action", span_name(a.type)).add("micro_batch", a.micro_batch).add("chunk", a.chunk)
                   .add("step", step));
  }
}

const PipelineStepStats& PipelineExecutor::run_step(Comm& world, int step, BatchSampler& sampler, float dloss,
                                                    Trace& trace) {
  PipelineStepStats stats;
  // No barrier opens the step: the channels are FIFO, so a rank that starts early
  // only waits in its first receive, and that wait is the bubble's fill, measured.
  const double step_start = now_seconds();
  const std::vector<Action>& actions = schedule_.actions[rank_];
  for (size_t i = 0; i < actions.size(); i++) {
    const bool compute = is_compute(actions[i].type);
    if (compute && before_compute_) before_compute_(actions[i]);
    run_action(actions[i], step, sampler, dloss, stats, trace, step_start);
    if (last_use_[i]) release(actions[i].micro_batch, actions[i].chunk);
    if (last_gradient_[i] && gradients_done_) gradients_done_(actions[i].chunk);
  }
  for (GradientInFlight& gradient : gradients_in_flight_) gradient.sent.wait();
  gradients_in_flight_.clear();
  // The one barrier: the ranks that finish first wait here for the pipeline to drain.
  // That wait is the bubble's drain, and only a common end makes it part of every
  // window (the idle share, and the timeline's rows ending together). Chapter 07's
  // data-parallel reductions, started by gradients_done_, run under it.
  world.barrier();
  stats.window_seconds = now_seconds() - step_start;
  // the spans' times counted back from that common end (negative), so that every
  // rank's row of the timeline lines up: gather_spans moves the origin to the earliest
  for (TimedAction& span : stats.spans) {
    span.start -= stats.window_seconds;
    span.end -= stats.window_seconds;
  }
  stats.loss = loss_.read();  // 0 but on the last stage's rank

  // the mean cost of each kind of action, for the simulator
  std::map<ActionType, std::pair<double, int>> totals;
  for (const TimedAction& span : stats.spans) {
    totals[span.action.type].first += span.end - span.start;
    totals[span.action.type].second++;
  }
  const auto mean = [&](ActionType type) {
    return totals.count(type) ? totals[type].first / totals[type].second : 0.0;
  };
  stats.mean_costs = {mean(ActionType::Forward), mean(ActionType::Backward), mean(ActionType::BackwardInput),
                      mean(ActionType::BackwardWeight)};
  last_step_ = std::move(stats);
  return last_step_;
}

// ----------------------------------------------------------------------------
// gathering what every rank measured
//
// all_gather moves bits and never does arithmetic on them, so a double travels
// exactly as two floats.

static void put_double(std::vector<float>& out, double value) {
  float halves[2];
  std::memcpy(halves, &value, sizeof(double));
  out.insert(out.end(), halves, halves + 2);
}

static double get_double(const float* in) {
  double value;
  std::memcpy(&value, in, sizeof(double));
  return value;
}

std::vector<TimedAction> gather_spans(Comm& world, const std::vector<TimedAction>& mine) {
  const size_t per_span = 7;  // type, micro-batch, chunk, start (2 floats), end (2 floats)
  std::vector<float> packed;
  for (const TimedAction& span : mine) {
    packed.push_back(static_cast<float>(span.action.type));
    packed.push_back(static_cast<float>(span.action.micro_batch));
    packed.push_back(static_cast<float>(span.action.chunk));
    put_double(packed, span.start);
    put_double(packed, span.end);
  }
  std::vector<float> everyone(packed.size() * world.size());
  world.all_gather(packed.data(), everyone.data(), packed.size());
  std::vector<TimedAction> spans;
  for (size_t i = 0; i < everyone.size(); i += per_span) {
    const Action action{static_cast<ActionType>(static_cast<int>(everyone[i])), static_cast<int>(everyone[i + 1]),
                        static_cast<int>(everyone[i + 2])};
    spans.push_back({static_cast<int>(i / packed.size()), action, get_double(&everyone[i + 3]),
                     get_double(&everyone[i + 5])});
  }
  // run_step's times count back from the step's common end: the earliest span starts at 0
  double origin = 0.0;
  for (const TimedAction& span : spans) origin = std::min(origin, span.start);
  for (TimedAction& span : spans) {
    span.start -= origin;
    span.end -= origin;
  }
  return spans;
}

std::vector<ActionCosts> gather_costs(Comm& world, const ActionCosts& mine) {
  std::vector<float> packed;
  for (double cost : {mine.forward, mine.backward, mine.backward_input, mine.backward_weight}) {
    put_double(packed, cost);
  }
  std::vector<float> everyone(packed.size() * world.size());
  world.all_gather(packed.data(), everyone.data(), packed.size());
  std::vector<ActionCosts> costs;
  for (int r = 0; r < world.size(); r++) {
    const float* p = &everyone[r * packed.size()];
    costs.push_back({get_double(p), get_double(p + 2), get_double(p + 4), get_double(p + 6)});
  }
  return costs;
}

// ----------------------------------------------------------------------------
// the bubble three ways

BubbleReport::BubbleReport(const Schedule& schedule, std::string timeline_path)
    : schedule_(schedule), timeline_path_(std::move(timeline_path)) {
  if (!timeline_path_.empty()) check_output_path("--timeline", timeline_path_);  // at the start, not after the run
}

JsonLine BubbleReport::gather(Comm& world, const PipelineStepStats& last) {
  const int N = schedule_.ranks;
  const std::vector<ActionCosts> measured_costs = gather_costs(world, last.mean_costs);
  simulated_ = simulate(schedule_, measured_costs).bubble_fraction();
  // zb-h1's formula needs the forward, backward-input and weight times: the ranks' means
  mean_costs_ = {0.0, 0.0, 0.0, 0.0};
  for (const ActionCosts& costs : measured_costs) {
    mean_costs_.forward += costs.forward / N;
    mean_costs_.backward_input += costs.backward_input / N;
    mean_costs_.backward_weight += costs.backward_weight / N;
  }
  formula_ = bubble_formula(schedule_.kind, N, schedule_.micro_batches, schedule_.chunks, mean_costs_);
  spans_ = gather_spans(world, last.spans);
  return JsonLine()
      .add("schedule", schedule_name(schedule_.kind))
      .add("chunks", schedule_.chunks)
      .add("bubble_simulated", simulated_)
      .add("bubble_formula", formula_);
}

void BubbleReport::print(double measured) const {
  // zb-h1's formula takes the measured F, B and W, so it moves from run to run as they do
  std::printf("bubble (idle share of the step, mean over ranks): measured %.1f%%\n"
              "  simulated with the measured costs %.1f%% | formula%s %.1f%%\n",
              100.0 * measured, 100.0 * simulated_,
              schedule_.kind == ScheduleKind::ZeroBubbleH1 ? " with the measured F, B, W" : "", 100.0 * formula_);
  if (schedule_.kind == ScheduleKind::ZeroBubbleH1) {
    std::printf("(zb-h1's formula with the measured F %.1f ms, B %.1f ms, W %.1f ms; with F = B = W: %.1f%%)\n",
                1e3 * mean_costs_.forward, 1e3 * mean_costs_.backward_input, 1e3 * mean_costs_.backward_weight,
                100.0 * bubble_formula(schedule_.kind, schedule_.ranks, schedule_.micro_batches, schedule_.chunks));
  }
  if (!timeline_path_.empty()) {
    write_timeline_svg(timeline_path_, std::string(schedule_name(schedule_.kind)) + ", measured (last step)", spans_,
                       schedule_.ranks, schedule_.chunks, "s");
    std::printf("timeline of the last step written to %s\n", timeline_path_.c_str());
  }
}

}  // namespace course
