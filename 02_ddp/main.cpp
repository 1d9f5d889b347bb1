// Chapter 02: distributed data parallel (DDP).
//
// Chapter 00's trainer, on N ranks. Every rank builds the same model (same seed,
// layout-independent initialisation: identical replicas without a broadcast),
// takes its contiguous slice of the same global batch, and before the optimizer
// step the ranks average their gradients (ddp.h), bucket by bucket, overlapped
// with backward. Every replica then takes the same AdamW step, so the run computes
// what chapter 00 computes on the whole batch, only split N ways.
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/02_ddp
#include <cblas.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

#include "02_ddp/ddp.h"
#include "common/adamw.h"
#include "common/checkpoint.h"
#include "common/cli.h"
#include "common/comm/comm.h"
#include "common/data.h"
#include "common/device.h"
#include "common/error.h"
#include "common/metrics.h"
#include "common/model.h"
#include "common/trace.h"
#include "common/training.h"

using namespace course;

static int train(int argc, char** argv) {
  // ---- flags -----------------------------------------------------------------
  TrainOptions options;
  CommOptions comm_options;
  float bucket_mb = 1.0f;
  bool no_overlap = false;
  ArgParser parser("02_ddp", "Chapter 02: data-parallel training: every rank a replica, gradients averaged.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  parser.add_float("--bucket-mb", &bucket_mb, 0.0f, true, "gradient bucket size in MB (10^6 bytes)");
  parser.add_switch("--no-overlap", &no_overlap, "all-reduce after backward instead of during it");
  parser.parse(argc, argv);
  const Device device = setup_device(options, /*gpu_ready=*/false);
  openblas_set_num_threads(options.threads);

  // ---- ranks -----------------------------------------------------------------
  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), comm_options);
  const int rank = world->rank(), ranks = world->size();
  validate_common(options, ranks);
  const bool is_rank0 = rank == 0;
  MetricsLog log(is_rank0 ? options.log : "");
  if (!options.checkpoint_dir.empty()) ensure_checkpoint_dir(options.checkpoint_dir);

  const GPTConfig& config = options.model;
  const int T = config.seq_len;
  // this rank's rows of every global batch, cut into micro-batches
  const RowSlice my_rows = data_parallel_slice(options.batch, rank, ranks);
  const int micro_batch = my_rows.rows / options.micro_batches;

  // ---- data ------------------------------------------------------------------
  TextData data = load_text_data(options.data, T);
  BatchSampler sampler(data, T, options.batch, options.seed);

  // ---- model, optimizer, DDP -----------------------------------------------------
  GPT model(config, micro_batch, options.seed);
  AdamW optimizer({options.lr, 0.9f, 0.95f, 1e-8f, options.weight_decay}, model.params.size());
  DDP ddp(*world, model, bucket_mb, /*overlap=*/!no_overlap);
  Trace trace(options.trace, rank, ranks);
  ddp.set_trace(&trace);  // the buckets' all-reduces on the communication lane
  if (is_rank0) {
    print_run_header(options, data, model.params.size(), micro_batch, ranks);
    std::printf("ddp: %zu gradient bucket(s) of up to %.2f MB, %s, backend %s\n", ddp.buckets().size(), bucket_mb,
                no_overlap ? "all-reduced after backward" : "all-reduced during backward", world->backend().c_str());
    std::printf("exposed comm = the time a step waits after backward for the all-reduces to finish\n");
  }
  // every rank reads the same checkpoint: the replicas stay identical
  const int first_step = resume_if_asked(options, model.params.data(), optimizer, is_rank0);

  // ---- training loop -------------------------------------------------------------
  RunReport report("02_ddp", config, options.batch, ranks, device);
  std::vector<int> tokens(static_cast<size_t>(micro_batch) * T);   // (micro_batch, T)
  std::vector<int> targets(static_cast<size_t>(micro_batch) * T);  // (micro_batch, T)
  // the mean over this rank's tokens; averaging over ranks then gives the global mean
  const float dloss = 1.0f / (static_cast<float>(my_rows.rows) * T);
  const std::function<void(int)> stage_done = [&](int stage) { ddp.on_stage_done(stage); };
  const std::function<void(int)> no_sync;  // accumulate locally, send nothing
  uint64_t total_bytes_sent = 0;
  double total_comm_seconds = 0.0, total_exposed_seconds = 0.0;

  for (int step = first_step; step <= options.steps; step++) {
    const double start = now_seconds();
    model.zero_grad();
    float loss = 0.0f;
    for (int micro = 0; micro < options.micro_batches; micro++) {
      sampler.fill(step, my_rows.first_row + micro * micro_batch, micro_batch, tokens.data(), targets.data());
      const JsonLine where = JsonLine().add("step", step).add("micro_batch", micro);
      double span_start = now_seconds();
      loss += model.forward(tokens.data(), targets.data()) / options.micro_batches;
      trace.span_since("forward", span_start, Trace::kComputeLane, where);
      // only the last micro-batch communicates; the others accumulate locally (no_sync)
      const bool last = micro == options.micro_batches - 1;
      span_start = now_seconds();
      model.backward(dloss, last ? stage_done : no_sync);
      trace.span_since("backward", span_start, Trace::kComputeLane, where);
    }
    // on the timeline, the gap between the last backward and the optimizer step is the exposed comm
    const GradSyncStats sync = ddp.synchronize_gradients();
    world->all_reduce(&loss, 1, ReduceOp::Average);  // for the report: the global batch's mean loss
    const double update_start = now_seconds();
    if (options.grad_clip > 0.0f) {
      double norm = std::sqrt(grad_norm_squared(model.grads.data(), model.grads.size()));
      clip_grads(model.grads.data(), model.grads.size(), norm, options.grad_clip);
    }
    optimizer.update(model.params.data(), model.grads.data(), step);
    trace.span_since("optimizer step", update_start, Trace::kComputeLane, JsonLine().add("step", step));

    total_bytes_sent += sync.bytes_sent;
    total_comm_seconds += sync.comm_seconds;
    total_exposed_seconds += sync.exposed_seconds;
    // the communication thread's own time (comm_ms) is in the JSON line and the summary
    char comm_text[64];
    std::snprintf(comm_text, sizeof(comm_text), " | sent %s, exposed comm %.1f ms",
                  format_bytes(static_cast<double>(sync.bytes_sent)).c_str(), sync.exposed_seconds * 1e3);
    report.step(step, options.steps, loss, now_seconds() - start, is_rank0 && !options.quiet ? options.print_every : 0,
                log,
                JsonLine()
                    .add("bytes_sent", sync.bytes_sent)
                    .add("comm_ms", sync.comm_seconds * 1e3)
                    .add("exposed_comm_ms", sync.exposed_seconds * 1e3),
                comm_text);

    // ---- checkpoint: the replicas are identical, so rank 0 writes for everyone ---
    if (checkpoint_due(options, step)) {
      if (is_rank0) {
        save_training_state(checkpoint_path(options.checkpoint_dir, step), options, step, model.params.data(),
                            optimizer);
        prune_checkpoints(options.checkpoint_dir, /*keep=*/2);
      }
      world->barrier();  // nobody runs ahead (or exits) before the checkpoint exists
    }
  }

  // ---- summary ---------------------------------------------------------------------
  if (!replicas_identical(*world, model.params.data(), model.params.size())) {
    throw CourseError("rank " + std::to_string(rank) + ": the replicas' parameters differ after training " +
                      "(a bug: every rank must apply the same averaged gradients)");
  }
  const int steps_run = options.steps - first_step + 1;
  const double hidden = total_comm_seconds > 0 ? 1.0 - total_exposed_seconds / total_comm_seconds : 0.0;
  if (is_rank0) {
    report.finish(log, run_configuration(options, world->backend())
                           .add("bytes_sent_per_step", total_bytes_sent / steps_run)
                           .add("comm_ms_per_step", total_comm_seconds * 1e3 / steps_run)
                           .add("exposed_comm_ms_per_step", total_exposed_seconds * 1e3 / steps_run)
                           .add("comm_hidden_fraction", std::max(0.0, hidden)));
    // Exposed time is measured on the training thread, the communication thread's
    // time inside the all-reduces on that thread; the exposed time also counts the
    // wait for that thread to be scheduled, so on a busy machine it can be larger.
    std::printf("gradient all-reduce per step: %s sent by each rank, %.1f ms on the comm thread\n",
                format_bytes(static_cast<double>(total_bytes_sent) / steps_run).c_str(),
                total_comm_seconds * 1e3 / steps_run);
    std::printf("exposed comm per step: %.1f ms waited after backward, so %.0f%% of the communication hidden\n",
                total_exposed_seconds * 1e3 / steps_run, 100.0 * std::max(0.0, hidden));
  }
  finish_trace(trace, options.trace, world.get());
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("02_ddp", [&] { return train(argc, argv); });
}
