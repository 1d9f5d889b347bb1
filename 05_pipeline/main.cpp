// Chapter 05: pipeline parallelism.
//
// Chapter 04's cut, with the batch split into M micro-batches that flow through
// the ranks one behind the other, so that several ranks compute at once. In what
// order each rank runs its forwards and backwards is the schedule (schedule.h):
// a list of actions per rank, made by one function, that this trainer executes
// (pipeline.h), a simulator plays, and a timeline draws. The ranks still idle
// while the pipe fills and drains: that idle share is the bubble, measured here
// per rank next to the paper's formula and the simulator's figure.
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/05_pipeline --schedule 1f1b
//   ./build/bin/05_pipeline --pp 4 --micro-batches 8 --schedule zb-h1 --dry-run
//
//   1F1B, 2 ranks, 4 micro-batches (F forward, B backward, . idle):
//   rank 0 | F0 F1 .  .  B0 -- F2 B1 -- F3 B2 -- .  B3 --
//   rank 1 | .  F0 B0 -- F1 B1 -- F2 B2 -- F3 B3 -- .  .
#include <cblas.h>

#include <cstdio>
#include <string>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "common/rank_table.h"
#include "05_pipeline/pipeline.h"
#include "05_pipeline/schedule.h"
#include "common/adamw.h"
#include "common/checkpoint.h"
#include "common/cli.h"
#include "common/comm/comm.h"
#include "common/data.h"
#include "common/error.h"
#include "common/metrics.h"
#include "common/trace.h"
#include "common/training.h"

using namespace course;

// --dry-run: the schedule, its simulation and its timeline, without training.
static void print_dry_run(const Schedule& schedule, const std::string& timeline_path) {
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
  std::printf("\nsimulated with forward 1, backward 2%s:\n%s", V > 1 ? " (a chunk: 1/V of each)" : "",
              text_timeline(sim.spans, N, V, 1.0 / V).c_str());
  std::printf("makespan %.2f units, bubble %.1f%% (formula %.1f%%)\n", sim.makespan, 100.0 * sim.bubble_fraction(),
              100.0 * bubble_formula(schedule.kind, N, schedule.micro_batches, V));
  if (!timeline_path.empty()) {
    write_timeline_svg(timeline_path, std::string(schedule_name(schedule.kind)) + ", simulated", sim.spans, N, V,
                       "units");
    std::printf("timeline written to %s\n", timeline_path.c_str());
  }
}

static int train(int argc, char** argv) {
  // ---- flags -----------------------------------------------------------------
  TrainOptions options;
  options.micro_batches = 8;  // this chapter's subject: a pipeline needs micro-batches to overlap
  CommOptions comm_options;
  int pp = 0, virtual_stages = 0;
  std::string schedule_flag = "1f1b", timeline_path;
  bool dry_run = false;
  ArgParser parser("05_pipeline", "Chapter 05: pipeline parallelism with micro-batches and a schedule.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  parser.add_int("--pp", &pp, 0, "pipeline ranks; 0 = the world size");
  parser.add_choice("--schedule", &schedule_flag, schedule_names(), "the order of forwards and backwards");
  parser.add_int("--virtual-stages", &virtual_stages, 0, "model chunks per rank (interleaved); 0 = 2 for interleaved");
  parser.add_switch("--dry-run", &dry_run, "print the schedule, its simulation and timeline; do not train");
  parser.add_string("--timeline", &timeline_path, "write the last step's timeline (or, with --dry-run, the simulated one) as SVG");
  parser.parse(argc, argv);
  const ScheduleKind kind = parse_schedule(schedule_flag);
  const int V = virtual_stages > 0 ? virtual_stages : (kind == ScheduleKind::Interleaved ? 2 : 1);
  if (dry_run) {
    if (pp == 0) throw FlagError("--dry-run needs --pp: how many ranks to schedule");
    print_dry_run(make_schedule(kind, pp, options.micro_batches, V), timeline_path);
    return 0;
  }
  const Device device = setup_device(options, /*gpu_ready=*/false);
  openblas_set_num_threads(options.threads);

  // ---- ranks, the cut, the schedule -------------------------------------------------
  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), comm_options);
  const int rank = world->rank(), ranks = world->size();
  pp = whole_world_degree("--pp", pp, ranks);
  validate_common(options);
  const GPTConfig& config = options.model;
  check_interleaved_cut(kind, config.n_layer, pp, V);
  const Schedule schedule = make_schedule(kind, pp, options.micro_batches, V);
  const std::vector<StageRange> cut = split_stages(config, schedule.stages());
  // [r][c]: rank r's chunk c, for the checkpoint manifest
  std::vector<std::vector<StageRange>> every_rank_chunks(ranks);
  for (int r = 0; r < ranks; r++) {
    for (int c = 0; c < V; c++) every_rank_chunks[r].push_back(cut[schedule.stage(r, c)]);
  }
  const bool is_rank0 = rank == 0;
  const int last_stage_rank = schedule.rank_of_stage(schedule.stages() - 1);
  MetricsLog log(is_rank0 ? options.log : "");
  Trace trace(options.trace, rank, ranks);
  if (!options.checkpoint_dir.empty()) ensure_checkpoint_dir(options.checkpoint_dir);
  const int T = config.seq_len;
  const int micro_batch = options.batch / options.micro_batches;

  // ---- data, this rank's chunks of the model, their optimizers ------------------------
  TextData data = load_text_data(options.data, T);
  BatchSampler sampler(data, T, options.batch, options.seed);
  std::vector<std::unique_ptr<ModelPart>> owned;
  std::vector<std::unique_ptr<AdamW>> owned_optimizers;
  std::vector<std::unique_ptr<ModelPartChunk>> owned_chunks;
  std::vector<ModelPart*> chunks;
  std::vector<AdamW*> optimizers;
  std::vector<PipelineChunk*> pipeline_chunks;  // the same chunks, as the executor drives them
  BackwardWorkspace workspace(config, micro_batch);
  for (int c = 0; c < V; c++) {
    owned.push_back(std::make_unique<ModelPart>(config, cut[schedule.stage(rank, c)], micro_batch, options.seed));
    owned_optimizers.push_back(std::make_unique<AdamW>(
        AdamWConfig{options.lr, 0.9f, 0.95f, 1e-8f, options.weight_decay}, owned.back()->params.size()));
    owned_chunks.push_back(std::make_unique<ModelPartChunk>(*owned.back(), workspace, config, micro_batch));
    chunks.push_back(owned.back().get());
    optimizers.push_back(owned_optimizers.back().get());
    pipeline_chunks.push_back(owned_chunks.back().get());
  }
  PipelineChannels channels(*world, schedule);
  PipelineExecutor executor(schedule, rank, pipeline_chunks, channels, micro_batch);
  std::vector<std::string> labels(ranks);
  for (int r = 0; r < ranks; r++) {
    for (int c = 0; c < V; c++) labels[r] += (c ? "; " : "") + describe_stages(config, cut[schedule.stage(r, c)]);
  }
  if (is_rank0) {
    print_run_header(options, data, count_parameters(config), micro_batch);
    std::printf("pipeline: schedule %s, %d ranks x %d chunk(s), %d micro-batches of %d sequence(s), backend %s\n",
                schedule_name(kind), pp, V, options.micro_batches, micro_batch, world->backend().c_str());
    for (int r = 0; r < ranks; r++) std::printf("  rank %d: %s\n", r, labels[r].c_str());
  }
  const int first_step = resume_parts_if_asked(options, chunks, optimizers, every_rank_chunks, is_rank0);

  // ---- training loop -------------------------------------------------------------
  RunReport report("05_pipeline", config, options.batch, ranks, device);
  const float dloss = 1.0f / (static_cast<float>(options.batch) * T);  // as chapter 00
  double idle_sum = 0.0;  // this rank's idle share, summed over the measured steps
  int measured_steps = 0;
  PipelineStepStats last;

  for (int step = first_step; step <= options.steps; step++) {
    const double start = now_seconds();
    const uint64_t sent_before = channels.bytes_sent();
    for (ModelPart* chunk : chunks) chunk->grads.zero();
    last = executor.run_step(*world, step, sampler, dloss, trace);
    // the loss exists only where the last stage is: that rank broadcasts it
    world->broadcast(&last.loss, 1, last_stage_rank);
    if (options.grad_clip > 0.0f) clip_part_gradients(*world, chunks, options.grad_clip);
    for (int c = 0; c < V; c++) optimizers[c]->update(chunks[c]->params.data(), chunks[c]->grads.data(), step);

    const double idle = 1.0 - last.busy_seconds / last.window_seconds;
    if (step > first_step || first_step == options.steps) {  // the first step also pays for warming up
      idle_sum += idle;
      measured_steps++;
    }
    const uint64_t sent = channels.bytes_sent() - sent_before;
    char text[64];
    std::snprintf(text, sizeof(text), " | sent %s | idle %2.0f%%", format_bytes(static_cast<double>(sent)).c_str(),
                  100.0 * idle);
    report.step(step, options.steps, last.loss, now_seconds() - start,
                is_rank0 && !options.quiet ? options.print_every : 0, log,
                JsonLine().add("bytes_sent", sent).add("idle_fraction", idle), text);

    // ---- checkpoint: every rank writes its own chunks -----------------------------------
    if (checkpoint_due(options, step)) {
      save_parts(options, *world, step, chunks, optimizers, every_rank_chunks);
      world->barrier();  // nobody exits before every part is on disk
      prune_checkpoints(options.checkpoint_dir, /*keep=*/2, rank_suffix(rank));
    }
  }

  // ---- summary: the bubble three ways, and every rank's share ----------------------------
  const int steps_run = options.steps - first_step + 1;
  const double my_idle = idle_sum / measured_steps;
  const double sent_per_step = static_cast<double>(channels.bytes_sent()) / steps_run;
  const JsonLine table = gather_rank_table(
      *world,
      {{"sent_per_step", "sent/step", sent_per_step, ColumnUnit::Bytes},
       {"idle_fraction", "idle", my_idle, ColumnUnit::Percent},
       {"live_micro_batches", "live mbs", static_cast<double>(peak_live_slots(schedule, rank)), ColumnUnit::Count},
       {"predicted_activations", "predicted", executor.predicted_activation_bytes(), ColumnUnit::Bytes}},
      labels);
  const std::vector<ActionCosts> measured_costs = gather_costs(*world, last.mean_costs);
  const Simulation measured_sim = simulate(schedule, measured_costs);
  float bubble = static_cast<float>(my_idle);
  world->all_reduce(&bubble, 1, ReduceOp::Average);
  const std::vector<TimedAction> spans = gather_spans(*world, last.spans);
  if (is_rank0) {
    // zb-h1's formula needs the forward, backward-input and weight times: the ranks' means
    ActionCosts mean_costs{0.0, 0.0, 0.0, 0.0};
    for (const ActionCosts& costs : measured_costs) {
      mean_costs.forward += costs.forward / pp;
      mean_costs.backward_input += costs.backward_input / pp;
      mean_costs.backward_weight += costs.backward_weight / pp;
    }
    const double formula = bubble_formula(kind, pp, options.micro_batches, V, mean_costs);
    report.finish(log, run_configuration(options, world->backend())
                           .add("schedule", schedule_name(kind))
                           .add("chunks", V)
                           .add("bytes_sent_per_step", sent_per_step)
                           .add("bubble_measured", static_cast<double>(bubble))
                           .add("bubble_simulated", measured_sim.bubble_fraction())
                           .add("bubble_formula", formula)
                           .merge(table));
    std::printf("bubble (idle share of the step, mean over ranks): measured %.1f%%\n"
                "  simulated with the measured costs %.1f%% | formula %.1f%%\n",
                100.0 * bubble, 100.0 * measured_sim.bubble_fraction(), 100.0 * formula);
    if (kind == ScheduleKind::ZeroBubbleH1) {
      std::printf("(zb-h1's formula with the measured F %.1f ms, B %.1f ms, W %.1f ms; with F = B = W: %.1f%%)\n",
                  1e3 * mean_costs.forward, 1e3 * mean_costs.backward_input, 1e3 * mean_costs.backward_weight,
                  100.0 * bubble_formula(kind, pp, options.micro_batches, V));
    }
    if (!timeline_path.empty()) {
      write_timeline_svg(timeline_path, std::string(schedule_name(kind)) + ", measured (last step)", spans, pp, V,
                         "s");
      std::printf("timeline of the last step written to %s\n", timeline_path.c_str());
    }
  }
  finish_trace(trace, options.trace, world.get());
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("05_pipeline", [&] { return train(argc, argv); });
}
