#include "05_pipeline/schedule.h"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include "common/train/checkpoint.h"
#include "common/tensor/error.h"
#include "common/train/trace.h"

namespace course {

// ----------------------------------------------------------------------------
// names

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {"gpipe", "1f1b", "interleaved", "zb-h1"};
  return names;
}

ScheduleKind parse_schedule(const std::string& name) {
  const std::vector<ScheduleKind> kinds = {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved,
                                           ScheduleKind::ZeroBubbleH1};
  for (size_t i = 0; i < kinds.size(); i++) {
    if (schedule_names()[i] == name) return kinds[i];
  }
  throw FlagError("unknown --schedule '" + name + "' (choose gpipe, 1f1b, interleaved or zb-h1)");
}

const char* schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPipe: return "gpipe";
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::Interleaved: return "interleaved";
    case ScheduleKind::ZeroBubbleH1: return "zb-h1";
  }
  return "?";
}

void check_recompute_schedule(ScheduleKind kind, Recompute recompute) {
  if (kind == ScheduleKind::ZeroBubbleH1 && recompute == Recompute::Full) {
    throw FlagError("--schedule zb-h1 defers each block's weight gradients, which read the block's layer inputs, and "
                    "--recompute full keeps only the block's input (hint: --recompute selective keeps them, or use "
                    "--schedule 1f1b)");
  }
}

bool is_backward(ActionType type) {
  return type == ActionType::Backward || type == ActionType::BackwardInput || type == ActionType::BackwardWeight;
}

bool is_compute(ActionType type) { return type == ActionType::Forward || is_backward(type); }

std::string action_label(const Action& action, int chunks) {
  const std::string id = std::to_string(action.micro_batch) + (chunks > 1 ? std::string(1, 'a' + action.chunk) : "");
  switch (action.type) {
    case ActionType::Forward: return "F" + id;
    case ActionType::Backward: return "B" + id;
    case ActionType::BackwardInput: return "B" + id;
    case ActionType::BackwardWeight: return "W" + id;
    case ActionType::RecvActivation: return "recv activation " + id;
    case ActionType::SendActivation: return "send activation " + id;
    case ActionType::RecvGradient: return "recv gradient " + id;
    case ActionType::SendGradient: return "send gradient " + id;
  }
  return "?";
}

// ----------------------------------------------------------------------------
// building the lists: first the order of the compute actions, then the sends and
// receives they imply

namespace {

using ComputeOrder = std::vector<Action>;  // one rank's compute actions

Action forward(int micro_batch, int chunk = 0) { return {ActionType::Forward, micro_batch, chunk}; }
Action backward(int micro_batch, int chunk = 0) { return {ActionType::Backward, micro_batch, chunk}; }

// GPipe: every forward, then every backward. Each rank holds all M micro-batches'
// activations at the turn.
ComputeOrder gpipe(int M) {
  ComputeOrder order;
  for (int m = 0; m < M; m++) order.push_back(forward(m));
  for (int m = 0; m < M; m++) order.push_back(backward(m));
  return order;
}

// 1F1B: rank r runs N-1-r forwards ahead (the warm-up that fills the pipe), then
// alternates one forward and one backward, then drains the backwards. Rank r never
// holds more than N-r micro-batches: that is the memory 1F1B saves over GPipe.
ComputeOrder one_f_one_b(int N, int M, int r) {
  const int warmup = std::min(N - 1 - r, M);
  ComputeOrder order;
  for (int m = 0; m < warmup; m++) order.push_back(forward(m));
  for (int i = 0; i < M - warmup; i++) {
    order.push_back(forward(warmup + i));
    order.push_back(backward(i));
  }
  for (int i = M - warmup; i < M; i++) order.push_back(backward(i));
  return order;
}

// ZB-H1: 1F1B's order with each backward split into B (the input gradient, which
// the previous rank waits for) and W (the weight gradients, which nobody waits
// for). Rank r lets up to r W's wait: the later ranks, which would otherwise idle
// at the end of the step, finish their B's early (so gradients reach rank 0
// sooner) and do the waiting W's when they have nothing else. Every rank then
// holds at most N micro-batches: rank 0's 1F1B peak.
ComputeOrder zero_bubble_h1(int N, int M, int r) {
  ComputeOrder order;
  std::deque<int> waiting_w;
  for (const Action& action : one_f_one_b(N, M, r)) {
    if (action.type == ActionType::Forward) {
      order.push_back(action);
      continue;
    }
    order.push_back({ActionType::BackwardInput, action.micro_batch, 0});
    waiting_w.push_back(action.micro_batch);
    if (static_cast<int>(waiting_w.size()) > r) {
      order.push_back({ActionType::BackwardWeight, waiting_w.front(), 0});
      waiting_w.pop_front();
    }
  }
  for (int m : waiting_w) order.push_back({ActionType::BackwardWeight, m, 0});
  return order;
}

// Interleaved 1F1B (Narayanan et al., 2021, as Megatron-LM runs it): rank r does
// M x V chunk-forwards in groups of N micro-batches, chunk 0 then chunk 1 ...,
// warms up with 2 (N-1-r) + (V-1) N of them, then alternates as 1F1B does;
// backwards visit the chunks in reverse. Each chunk is 1/V of a stage, so the
// pipe fills V times faster and the bubble shrinks by V.
ComputeOrder interleaved(int N, int M, int V, int r) {
  const int total = M * V;
  const auto micro_batch = [&](int k) { return (k / (N * V)) * N + k % N; };
  const auto forward_k = [&](int k) { return forward(micro_batch(k), (k / N) % V); };
  const auto backward_k = [&](int k) { return backward(micro_batch(k), V - 1 - (k / N) % V); };
  const int warmup = std::min(2 * (N - 1 - r) + (V - 1) * N, total);
  ComputeOrder order;
  for (int k = 0; k < warmup; k++) order.push_back(forward_k(k));
  for (int i = 0; i < total - warmup; i++) {
    order.push_back(forward_k(warmup + i));
    order.push_back(backward_k(i));
  }
  for (int i = total - warmup; i < total; i++) order.push_back(backward_k(i));
  return order;
}

// A receive right before the compute that needs it, a send right after the
// compute that made it. (The sender's communication thread pushes the bytes as
// soon as the send is issued; a posted receive only says where they land.)
std::vector<Action> with_messages(const Schedule& schedule, int rank, const ComputeOrder& order) {
  std::vector<Action> actions;
  const int last_stage = schedule.stages() - 1;
  for (const Action& compute : order) {
    const int stage = schedule.stage(rank, compute.chunk);
    const int m = compute.micro_batch, c = compute.chunk;
    switch (compute.type) {
      case ActionType::Forward:
        if (stage > 0) actions.push_back({ActionType::RecvActivation, m, c});
        actions.push_back(compute);
        if (stage < last_stage) actions.push_back({ActionType::SendActivation, m, c});
        break;
      case ActionType::Backward:
      case ActionType::BackwardInput:
        if (stage < last_stage) actions.push_back({ActionType::RecvGradient, m, c});
        actions.push_back(compute);
        if (stage > 0) actions.push_back({ActionType::SendGradient, m, c});
        break;
      default:
        actions.push_back(compute);
    }
  }
  return actions;
}

}  // namespace

Schedule make_schedule(ScheduleKind kind, int ranks, int micro_batches, int chunks) {
  const std::string name = schedule_name(kind);
  if (ranks < 1 || micro_batches < 1) {
    throw FlagError("a pipeline needs at least one rank and one micro-batch (got --pp " + std::to_string(ranks) +
                    ", --micro-batches " + std::to_string(micro_batches) + ")");
  }
  if (kind == ScheduleKind::Interleaved) {
    if (ranks < 2) {
      throw FlagError("the interleaved schedule needs --pp 2 or more: its chunks go round the ranks");
    }
    if (chunks < 2) {
      throw FlagError("the interleaved schedule needs --virtual-stages 2 or more (chunks per rank; got " +
                      std::to_string(chunks) + ")");
    }
    if (micro_batches % ranks != 0) {
      throw FlagError("the interleaved schedule runs micro-batches in groups of --pp: --micro-batches " +
                      std::to_string(micro_batches) + " is not a multiple of --pp " + std::to_string(ranks) +
                      " (hint: use --micro-batches " + std::to_string(ranks * ((micro_batches + ranks - 1) / ranks)) +
                      ", or another schedule)");
    }
  } else if (chunks != 1) {
    throw FlagError("--virtual-stages " + std::to_string(chunks) + " is for the interleaved schedule only (" + name +
                    " runs one chunk per rank)");
  }
  Schedule schedule{kind, ranks, micro_batches, chunks, {}};
  for (int r = 0; r < ranks; r++) {
    ComputeOrder order;
    switch (kind) {
      case ScheduleKind::GPipe: order = gpipe(micro_batches); break;
      case ScheduleKind::OneFOneB: order = one_f_one_b(ranks, micro_batches, r); break;
      case ScheduleKind::Interleaved: order = interleaved(ranks, micro_batches, chunks, r); break;
      case ScheduleKind::ZeroBubbleH1: order = zero_bubble_h1(ranks, micro_batches, r); break;
    }
    schedule.actions.push_back(with_messages(schedule, r, order));
  }
  return schedule;
}

double bubble_formula(ScheduleKind kind, int ranks, int micro_batches, int chunks) {
  return bubble_formula(kind, ranks, micro_batches, chunks, unit_costs(chunks));
}

double bubble_formula(ScheduleKind kind, int ranks, int micro_batches, int chunks, const ActionCosts& costs) {
  const double idle = ranks - 1;
  switch (kind) {
    case ScheduleKind::GPipe:
    case ScheduleKind::OneFOneB: return idle / (micro_batches + idle);
    case ScheduleKind::Interleaved: return idle / (static_cast<double>(chunks) * micro_batches + idle);
    case ScheduleKind::ZeroBubbleH1: {
      const double F = costs.forward, B = costs.backward_input, W = costs.backward_weight;
      const double idle_time = idle * (F + B - W);
      return idle_time / (micro_batches * (F + B + W) + idle_time);
    }
  }
  return 0.0;
}

// ----------------------------------------------------------------------------
// memory: which slots are alive where in a rank's list

int peak_live_slots(const Schedule& schedule, int rank, int chunk) {
  const std::vector<Action>& actions = schedule.actions[rank];
  std::map<std::pair<int, int>, size_t> last_use;  // (micro-batch, chunk) -> index of its last action
  for (size_t i = 0; i < actions.size(); i++) last_use[{actions[i].micro_batch, actions[i].chunk}] = i;
  std::set<std::pair<int, int>> live;
  int peak = 0;
  for (size_t i = 0; i < actions.size(); i++) {
    const std::pair<int, int> slot{actions[i].micro_batch, actions[i].chunk};
    if (chunk >= 0 && slot.second != chunk) continue;
    live.insert(slot);
    peak = std::max(peak, static_cast<int>(live.size()));
    if (last_use[slot] == i) live.erase(slot);
  }
  return peak;
}

// ----------------------------------------------------------------------------
// the simulator

double ActionCosts::of(ActionType type) const {
  switch (type) {
    case ActionType::Forward: return forward;
    case ActionType::Backward: return backward;
    case ActionType::BackwardInput: return backward_input;
    case ActionType::BackwardWeight: return backward_weight;
    default: return 0.0;
  }
}

ActionCosts unit_costs(int chunks) {
  const double v = chunks;
  return {1.0 / v, 2.0 / v, 1.0 / v, 1.0 / v};
}

double Simulation::bubble_fraction() const {
  if (makespan <= 0.0 || busy.empty()) return 0.0;
  double total_busy = 0.0;
  for (double b : busy) total_busy += b;
  return 1.0 - total_busy / (makespan * busy.size());
}

double Simulation::idle_fraction(int rank) const { return makespan > 0.0 ? 1.0 - busy[rank] / makespan : 0.0; }

namespace {

// A message between stages: (activation or gradient, micro-batch, the stage it goes to).
using Message = std::tuple<bool, int, int>;

// The channel a message travels on: (is gradient, sending rank).
using Channel = std::pair<bool, int>;

// CourseError unless every channel's receiver took its messages in the order its
// sender sent them (a FIFO channel would otherwise deliver the wrong micro-batch).
void check_channel_order(std::map<Channel, std::vector<Message>>& send_order,
                         const std::map<Channel, std::vector<Message>>& recv_order) {
  for (const auto& [channel, received] : recv_order) {
    const std::vector<Message>& in_order = send_order[channel];
    for (size_t i = 0; i < received.size(); i++) {
      if (i >= in_order.size() || received[i] != in_order[i]) {
        throw CourseError("schedule: rank " + std::to_string(channel.second) + " sends its " +
                          (channel.first ? "gradients" : "activations") +
                          " in another order than its neighbour receives them (message " + std::to_string(i) +
                          " on that channel): a FIFO channel would deliver the wrong micro-batch");
      }
    }
  }
}

// Where the play stopped (next[r]: rank r's next action): every rank that did not
// reach the end of its list waits for a message that never comes.
void describe_deadlock(const Schedule& schedule, const std::vector<size_t>& next, Simulation& sim) {
  for (int r = 0; r < schedule.ranks; r++) {
    if (next[r] < schedule.actions[r].size()) {
      sim.deadlocked = true;
      const Action& stuck = schedule.actions[r][next[r]];
      const int stage = schedule.stage(r, stuck.chunk);
      const bool gradient = stuck.type == ActionType::RecvGradient;
      const int peer = schedule.rank_of_stage(gradient ? stage + 1 : stage - 1);
      sim.deadlock += "rank " + std::to_string(r) + " waits at '" + action_label(stuck, schedule.chunks) +
                      "' (from rank " + std::to_string(peer) + ", which never sends it); ";
    }
  }
  if (sim.deadlocked) {
    sim.deadlock = "deadlock: " + sim.deadlock.substr(0, sim.deadlock.size() - 2);
  }
}

}  // namespace

Simulation simulate(const Schedule& schedule, const ActionCosts& costs) {
  return simulate(schedule, std::vector<ActionCosts>(schedule.ranks, costs));
}

Simulation simulate(const Schedule& schedule, const std::vector<ActionCosts>& costs_per_rank) {
  const int N = schedule.ranks;
  Simulation sim;
  sim.busy.assign(N, 0.0);
  std::vector<size_t> next(N, 0);      // each rank's next action
  std::vector<double> clock(N, 0.0);   // when each rank is free
  std::map<Message, double> sent;      // message -> when it was sent
  // the FIFO order on every channel, seen by its sender and by its receiver
  std::map<Channel, std::vector<Message>> send_order, recv_order;

  // where a send goes and which message a receive takes, from the rank's view
  const auto message_of = [&](int rank, const Action& a) -> std::pair<Message, Channel> {
    const int stage = schedule.stage(rank, a.chunk);
    switch (a.type) {
      case ActionType::SendActivation: return {{false, a.micro_batch, stage + 1}, {false, rank}};
      case ActionType::RecvActivation: return {{false, a.micro_batch, stage}, {false, schedule.rank_of_stage(stage - 1)}};
      case ActionType::SendGradient: return {{true, a.micro_batch, stage - 1}, {true, rank}};
      default: return {{true, a.micro_batch, stage}, {true, schedule.rank_of_stage(stage + 1)}};
    }
  };

  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < N; r++) {
      const std::vector<Action>& actions = schedule.actions[r];
      while (next[r] < actions.size()) {
        const Action& a = actions[next[r]];
        if (a.micro_batch < 0 || a.micro_batch >= schedule.micro_batches || a.chunk < 0 || a.chunk >= schedule.chunks) {
          throw CourseError("schedule: rank " + std::to_string(r) + "'s " + action_label(a, schedule.chunks) +
                            " is outside the schedule's micro-batches or chunks");
        }
        if (is_compute(a.type)) {
          const double cost = costs_per_rank[r].of(a.type);
          sim.spans.push_back({r, a, clock[r], clock[r] + cost});
          clock[r] += cost;
          sim.busy[r] += cost;
        } else if (a.type == ActionType::SendActivation || a.type == ActionType::SendGradient) {
          const auto [message, channel] = message_of(r, a);
          sent[message] = clock[r];
          send_order[channel].push_back(message);
        } else {
          const auto [message, channel] = message_of(r, a);
          auto found = sent.find(message);
          if (found == sent.end()) break;  // not sent yet: this rank waits here
          clock[r] = std::max(clock[r], found->second);
          recv_order[channel].push_back(message);
        }
        next[r]++;
        progress = true;
      }
    }
  }

  check_channel_order(send_order, recv_order);
  describe_deadlock(schedule, next, sim);
  sim.makespan = *std::max_element(clock.begin(), clock.end());
  return sim;
}

// ----------------------------------------------------------------------------
// timelines

std::string text_timeline(const std::vector<TimedAction>& spans, int ranks, int chunks, double unit) {
  size_t label_width = 2;
  double end = 0.0;
  for (const TimedAction& span : spans) {
    label_width = std::max(label_width, action_label(span.action, chunks).size());
    end = std::max(end, span.end);
  }
  const size_t cell = label_width + 1;
  const size_t cells = static_cast<size_t>(end / unit + 0.5);
  std::vector<std::string> rows(ranks);
  for (std::string& row : rows) {
    for (size_t i = 0; i < cells; i++) row += "." + std::string(cell - 1, ' ');
  }
  for (const TimedAction& span : spans) {
    const size_t first = static_cast<size_t>(span.start / unit + 0.5);
    const size_t last = std::max(first + 1, static_cast<size_t>(span.end / unit + 0.5));
    for (size_t i = first; i < last && i < cells; i++) {
      std::string text = i == first ? action_label(span.action, chunks) : std::string(label_width, '-');
      text.resize(cell, ' ');
      rows[span.rank].replace(i * cell, cell, text);
    }
  }
  std::string out;
  for (int r = 0; r < ranks; r++) {
    while (!rows[r].empty() && rows[r].back() == ' ') rows[r].pop_back();
    out += "rank " + std::to_string(r) + " | " + rows[r] + "\n";
  }
  return out;
}

static std::string fill_colour(const Action& action) {
  // the course's colour of the action (common/train/trace.h), later chunks lighter: each
  // chunk mixes another 40% of white in, up to the third
  const char* base = action_colour(action.type == ActionType::Forward          ? "forward"
                                   : action.type == ActionType::BackwardWeight ? "backward weight"
                                                                               : "backward");
  const double white = 0.4 * std::min(action.chunk, 2);
  char colour[8] = "#";
  for (int channel = 0; channel < 3; channel++) {
    const int value = std::stoi(std::string(base + 1 + 2 * channel, 2), nullptr, 16);
    std::snprintf(colour + 1 + 2 * channel, 3, "%02x", static_cast<int>(value + (255 - value) * white + 0.5));
  }
  return colour;
}

void write_timeline_svg(const std::string& path, const std::string& title, const std::vector<TimedAction>& spans,
                        int ranks, int chunks, const std::string& time_unit) {
  double end = 0.0;
  for (const TimedAction& span : spans) end = std::max(end, span.end);
  if (end <= 0.0) end = 1.0;
  const double left = 70, top = 40, row_height = 34, width = 900;
  const double scale = width / end;
  const double height = top + ranks * row_height + 60;
  std::string svg;  // the whole picture, written at once (write_file_atomically)
  char line[512];
  std::snprintf(line, sizeof(line),
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                "font-family=\"sans-serif\" font-size=\"11\">\n",
                left + width + 20, height);
  svg += std::string(line) + "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  std::snprintf(line, sizeof(line), "<text x=\"%.0f\" y=\"22\" font-size=\"14\">", left);
  svg += line + title + "</text>\n";
  for (int r = 0; r < ranks; r++) {
    const double y = top + r * row_height;
    std::snprintf(line, sizeof(line),
                  "<text x=\"8\" y=\"%.1f\">rank %d</text>\n"
                  "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#f0f0f0\"/>\n",
                  y + row_height / 2 + 4, r, left, y + 3, width, row_height - 6);
    svg += line;
  }
  for (const TimedAction& span : spans) {
    const double x = left + span.start * scale, w = std::max(0.5, (span.end - span.start) * scale);
    const double y = top + span.rank * row_height + 3;
    std::snprintf(line, sizeof(line),
                  "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\" stroke=\"white\" "
                  "stroke-width=\"0.5\"/>\n",
                  x, y, w, row_height - 6, fill_colour(span.action).c_str());
    svg += line;
    const std::string label = action_label(span.action, chunks);
    if (w > 7.0 * label.size()) {
      std::snprintf(line, sizeof(line), "<text x=\"%.2f\" y=\"%.1f\" text-anchor=\"middle\" fill=\"%s\">%s</text>\n",
                    x + w / 2, y + row_height / 2 + 1, span.action.chunk == 0 ? "white" : "black", label.c_str());
      svg += line;
    }
  }
  // the time axis: 0, its middle and its end
  const double axis_y = top + ranks * row_height + 14;
  for (double fraction : {0.0, 0.5, 1.0}) {
    std::snprintf(line, sizeof(line), "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.3g %s</text>\n",
                  left + fraction * width, axis_y, fraction * end, time_unit.c_str());
    svg += line;
  }
  std::snprintf(line, sizeof(line),
                "<text x=\"%.1f\" y=\"%.1f\">F forward (blue), B backward (green), W weight gradients (orange); "
                "grey: idle (the bubble)</text>\n",
                left, axis_y + 20);
  svg += std::string(line) + "</svg>\n";
  write_file_atomically(path, "", svg, "timeline");
}

// ----------------------------------------------------------------------------
// the dry run

void print_dry_run(const Schedule& schedule, const std::string& timeline_path) {
  const int N = schedule.ranks, V = schedule.chunks;
  std::printf("schedule %s: %d ranks, %d micro-batches, %d chunk(s) per rank\n", schedule_name(schedule.kind), N,
              schedule.micro_batches, V);
  for (int r = 0; r < N; r++) {
    std::printf("rank %d:", r);
    for (const Action& action : schedule.actions[r]) {
      if (is_compute(action.type)) std::printf(" %s", action_label(action, V).c_str());
    }
    std::printf("   (activations of at most %d micro-batch chunk(s) at once)\n", peak_live_slots(schedule, r));
  }
  const Simulation sim = simulate(schedule, unit_costs(V));
  if (sim.deadlocked) throw CourseError(sim.deadlock);
  std::printf("\nsimulated with forward 1, backward 2%s%s:\n%s",
              schedule.kind == ScheduleKind::ZeroBubbleH1 ? " (its B 1 and its W 1)" : "",
              V > 1 ? " (a chunk: 1/V of each)" : "",
              text_timeline(sim.spans, N, V, 1.0 / V).c_str());
  std::printf("makespan %.2f units, bubble %.1f%% (formula %.1f%%)\n", sim.makespan, 100.0 * sim.bubble_fraction(),
              100.0 * bubble_formula(schedule.kind, N, schedule.micro_batches, V));
  if (!timeline_path.empty()) {
    write_timeline_svg(timeline_path, std::string(schedule_name(schedule.kind)) + ", simulated", sim.spans, N, V,
                       "units");
    std::printf("timeline written to %s\n", timeline_path.c_str());
  }
}

}  // namespace course
