#include "common/train/trainer.h"

#include <cmath>
#include <cstdio>
#include <string>

#include "common/model/adamw.h"
#include "common/train/checkpoint.h"
#include "common/comm/env.h"
#include "common/comm/test_faults.h"
#include "common/tensor/error.h"
#include "common/tensor/gemm_cpu.h"
#include "common/train/trainer_parts.h"

namespace course {

Run::Run(std::string run_name, TrainOptions& run_options, const CommOptions* comm_options, bool trains_experts)
    : name(std::move(run_name)), options(run_options) {
  validate_flags(options);  // the flags' own mistakes first, before a device or a peer is involved
  options.model.recompute = parse_recompute(options.recompute);  // what the model's blocks keep
  // the linear layers' saved inputs in the precision their GEMMs read (model.h's LinearInput)
  options.model.linear_inputs = options.dtype == "bf16" ? DType::BF16 : DType::F32;
  if (options.model.n_experts > 0 && !trains_experts) {
    throw FlagError("--experts is trained by chapter 00 and chapter 09 (hint: ./build/bin/00_single_gpu --experts " +
                    std::to_string(options.model.n_experts) + " trains this mixture of experts on one process; " +
                    name + " trains dense blocks)");
  }
  device = setup_device(options);
  cpu::set_gemm_threads(options.threads);
  if (comm_options != nullptr) {
    CommOptions on_this_device = *comm_options;
    on_this_device.buffers = device;  // device buffers go to nccl, or are staged through the host
    world = create_world_comm(read_launch_env(), on_this_device);
    rank = world->rank();
    ranks = world->size();
  }
}

void Run::ranks_from_launch_environment() {
  if (world) throw CourseError("Run::ranks_from_launch_environment on a Run that has a world Comm (a bug)");
  const LaunchEnv env = read_launch_env();
  rank = env.rank;
  ranks = env.world_size;
}

void Run::start(int data_parallel_ranks) {
  validate_common(options, data_parallel_ranks);
  cpu_at_start = read_cpu_clock();
  log = std::make_unique<MetricsLog>(is_rank0() ? options.log : "");
  trace = std::make_unique<Trace>(options.trace, rank, ranks);
  if (!options.checkpoint_dir.empty()) ensure_checkpoint_dir(options.checkpoint_dir);
  data = std::make_unique<TextData>(load_text_data(options.data, options.model.seq_len));
  sampler = std::make_unique<BatchSampler>(*data, options.model.seq_len, options.batch, options.seed);
}

void Run::trace_compute(const char* span_name, double start, const JsonLine& where) {
  if (!trace->enabled()) return;
  synchronize(device);  // on a GPU, the span ends when the work is done, not when it was queued
  trace->span_since(span_name, start, Trace::kComputeLane, where);
}

// The CPU time the job's ranks on rank 0's machine spent since the run started: their
// sum over the world (a collective: every rank calls this), where the ranks are
// numbered machine by machine, as every launcher numbers them (ranks 0 .. ranks_here-1
// on rank 0's). Without a world (one process, or chapter 10's fault-tolerant workers)
// this rank's time stands for each rank's.
static double job_cpu_seconds(const Run& run, int ranks_here) {
  float mine = static_cast<float>(process_cpu_seconds() - run.cpu_at_start.process_seconds);
  if (!run.world) return static_cast<double>(mine) * ranks_here;
  if (run.rank >= ranks_here) mine = 0.0f;
  run.world->all_reduce(&mine, 1, ReduceOp::Sum);
  return mine;
}

static JsonLine machine_load_fields(const MachineLoad& load) {
  return JsonLine()
      .add("cores", load.cores)
      .add("job_cores", load.job_cores)
      .add("other_processes_cores", load.other_cores)
      .add("machine_busy", load.busy() ? 1 : 0);
}

// Why the times of a busy run are not to be trusted: the job's own ranks want more
// cores than there are, or other processes took the cores it needed.
static std::string busy_note(const MachineLoad& load) {
  char why[160];
  if (load.job_cores > load.cores) {
    std::snprintf(why, sizeof why, "this job's ranks want %d cores, the machine has %d", load.job_cores, load.cores);
  } else {
    std::snprintf(why, sizeof why, "other processes kept %.1f of its %d cores busy, beside this job's %d",
                  load.other_cores, load.cores, load.job_cores);
  }
  return std::string("note: the machine was busy (") + why +
         "): times, bubbles and overlap are not reliable; losses, memory and bytes are";
}

// A NaN or an infinity would only spread into the weights and the next checkpoint,
// so the run stops at the first one, before that step's save (a gradient norm: before
// its update too). Every rank finds it (the loss and the norm are global), and rank 0
// says it.
static Diverged diverged(const std::string& what, double value, int step, int rank, const std::string& hint) {
  return Diverged(what + " of step " + std::to_string(step) + " is " + std::to_string(value) + " on rank " +
                  std::to_string(rank) + ": training diverged (hint: " + hint + "); the checkpoints of the steps " +
                  "before it are untouched");
}

float checked_step(Technique& technique, int step, int rank) {
  test_faults_at_step(step);  // for a test's overflowing gradient (common/comm/test_faults.h)
  float loss = 0.0f;
  try {
    loss = technique.step(step);
  } catch (const NonFiniteGradientNorm& error) {
    throw diverged("the global gradient norm", error.norm, step, rank, "lower --lr");
  }
  if (!std::isfinite(loss)) throw diverged("the loss", loss, step, rank, "lower --lr, or clip with --grad-clip");
  return loss;
}

StepReport::StepReport(Run& run, Technique& technique)
    : run_(run),
      technique_(technique),
      report_(run.name, run.options.model, run.options.batch, run.ranks, run.device) {}

void StepReport::start_step() {
  start_ = now_seconds();
  technique_.meters.start_step();
}

void StepReport::end_step(int step, float loss) {
  synchronize(run_.device);  // the step's time is the device's, not just the time to queue its work
  technique_.meters.end_step();
  report_.step(step, run_.options.steps, loss, now_seconds() - start_, run_.print_every(), *run_.log,
               technique_.meters.step_fields(), technique_.meters.step_text());
}

void save_checkpoint(Run& run, Technique& technique, int step) {
  const std::string& dir = run.options.checkpoint_dir;
  const int kept = 2;  // the newest two: one to resume from if the newest was cut short
  if (technique.per_rank_checkpoint) {
    technique.save(step);
    prune_checkpoints(dir, kept, rank_suffix(run.rank));
  } else if (run.is_rank0()) {
    technique.save(step);
    prune_checkpoints(dir, kept);
  }
  if (run.world) run.world->barrier();  // nobody runs ahead (or exits) before every file is on disk
  if (run.is_rank0()) {
    remove_stale_checkpoint_files(dir, technique.per_rank_checkpoint);
    // said where the step lines are, so a reader sees where --resume would start
    if (run.print_every() > 0) {
      std::printf("checkpoint: step %d saved in %s (the newest %d are kept)\n", step, dir.c_str(), kept);
    }
  }
}

int StepReport::finish() {
  const JsonLine chapter_fields = technique_.summary();
  const JsonLine meter_fields = technique_.meters.summary_fields(run_.world.get());
  const int ranks_here = read_launch_env().local_world_size;
  const double job_seconds = job_cpu_seconds(run_, ranks_here);
  if (run_.is_rank0()) {
    const MachineLoad load = machine_load_since(run_.cpu_at_start, job_seconds, ranks_here, run_.options.threads);
    report_.finish(*run_.log, run_configuration(run_.options, run_.backend())
                                  .merge(meter_fields)
                                  .merge(chapter_fields)
                                  .merge(machine_load_fields(load)));
    if (load.busy()) std::printf("%s\n", busy_note(load).c_str());
    technique_.meters.print_summary();
    technique_.conclude();
  }
  finish_trace(*run_.trace, run_.options.trace, run_.world.get());
  return 0;
}

}  // namespace course
