// What a chapter's trainer is made of, around the step loop its main.cpp writes out:
//
//   a chapter's main.cpp                          common/train/trainer.h
//   -------------------------------------------   ------------------------------------------
//   flags: the common ones and its own       -->  Run: the device, the world's ranks
//   its flags checked against the ranks      -->  Run::start: data, log, trace, checkpoints
//   class X : public Technique                    Technique: what the loop asks of X
//     X(run): what this rank holds
//     resume(): load this rank's part
//     step(s): sample, forward, backward,
//              the gradients made whole, update
//     save(s): write this rank's part
//     summary(): checks, the chapter's figures
//   the loop:
//     StepReport report(run, technique)       -->  the step's time and meters, the step line
//     for step = technique.resume() .. steps:        and the JSON line, the summary, the trace
//       report.start_step()
//       loss = checked_step(technique, step)  -->  technique.step(s), stopped by a NaN
//       report.end_step(step, loss)
//       if checkpoint_due: save_checkpoint    -->  every rank its part, or rank 0 the model
//     return report.finish()
//
// The loop is the chapter's; what is here sets up, measures and saves, and decides
// nothing about the order of the work.
#pragma once

#include <memory>
#include <string>

#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/model/data.h"
#include "common/tensor/device.h"
#include "common/train/meters.h"
#include "common/train/metrics.h"
#include "common/train/trace.h"

namespace course {

// What every trainer sets up before its technique, in the same order everywhere.
class Run {
 public:
  // The device (--device, --dtype, --tf32) and the BLAS threads, and with
  // comm_options the world's ranks from the launch environment (without: one
  // process, chapter 00). --experts is refused with a clear message in a chapter
  // that does not pass trains_experts = true: a chapter trains a mixture of experts
  // only once it has been written for one.
  Run(std::string name, TrainOptions& options, const CommOptions* comm_options = nullptr, bool trains_experts = false);
  // Once the chapter has checked its own flags against the ranks: the common flags
  // with the batch split over `data_parallel_ranks`, then the data, the log (rank
  // 0's), the trace and the checkpoint directory.
  void start(int data_parallel_ranks);

  // For a trainer that forms its own groups as it goes (chapter 10's fault-tolerant
  // workers, which a fixed world would lose with the first dead worker): this
  // process's rank and the job's size from the launch environment, and no world Comm.
  // Call it on a Run made without comm options, before start().
  void ranks_from_launch_environment();

  bool is_rank0() const { return rank == 0; }
  std::string backend() const { return world ? world->backend() : "none"; }
  // --print-every on rank 0, 0 (no step lines) elsewhere and with --quiet
  int print_every() const { return is_rank0() && !options.quiet ? options.print_every : 0; }
  // --trace: a compute span from `start` until now, once the device has finished
  void trace_compute(const char* name, double start, const JsonLine& where);

  std::string name;  // the report's: the chapter, and a variant a technique may add ("03_fsdp zero-1")
  TrainOptions& options;
  Device device = Device::CPU;
  std::unique_ptr<Comm> world;  // nullptr on one device
  int rank = 0, ranks = 1;
  std::unique_ptr<TextData> data;         // after start()
  std::unique_ptr<BatchSampler> sampler;  // the global batches, the same on every rank
  std::unique_ptr<MetricsLog> log;
  std::unique_ptr<Trace> trace;
  CpuClock cpu_at_start;  // the machine's and this process's CPU clocks when the run started (MachineLoad)
};

// A chapter's technique: what one rank holds and how it takes one step.
class Technique {
 public:
  virtual ~Technique() = default;
  // The step to continue at: 1, or the one after the checkpoint this run resumes.
  virtual int resume() = 0;
  // One optimizer step over the global batch: this rank's forwards and backwards,
  // the gradients made whole, the update. Returns the global batch's mean loss, the
  // same on every rank (rank 0 reports it; every rank stops if it is not finite).
  virtual float step(int step) = 0;
  // This rank's part of the checkpoint of `step` (with per_rank_checkpoint false,
  // called on rank 0 only: it writes the whole model).
  virtual void save(int step) = 0;
  // After the last step, on every rank (it may communicate): the checks (replicas
  // that must agree) and the chapter's summary fields; rank 0 prints any table.
  virtual JsonLine summary() { return JsonLine(); }
  // After the run's summary, on rank 0: the chapter's closing lines.
  virtual void conclude() const {}

  // Whether every rank writes its own file (03-07), or rank 0 the whole model (00, 02).
  bool per_rank_checkpoint = true;
  // The costs the loop reports: the technique names its axes and records what only it knows.
  StepMeters meters;
};

// technique.step(step), stopped at a NaN or an infinite loss or global gradient norm
// (Diverged, naming the step and the rank; the norm stops it before the step's update,
// the loss before its save). Returns the global batch's mean loss.
float checked_step(Technique& technique, int step, int rank);

// A step's measures and report: start_step and end_step around a step (end_step waits for
// the device, so the time is the step's, then prints the step line on rank 0 and writes
// the JSON line), finish after the last (the technique's summary and checks, the meters'
// and the machine's load, the trace). finish returns the process's exit code.
class StepReport {
 public:
  StepReport(Run& run, Technique& technique);
  void start_step();
  void end_step(int step, float loss);
  int finish();

 private:
  Run& run_;
  Technique& technique_;
  RunReport report_;
  double start_ = 0.0;  // now_seconds() at start_step
};

// The checkpoint of `step` (when checkpoint_due says one is due): every rank writes its
// part (per_rank_checkpoint), or rank 0 the whole replicated model; the two newest are
// kept, and no rank goes on before every file is on disk.
void save_checkpoint(Run& run, Technique& technique, int step);

}  // namespace course
