// Chapter 03: ZeRO, stages 1, 2 and 3 (sharded data parallelism).
//
// Chapter 02's trainer, with the training state cut into N shards. Every rank
// still builds the whole model and trains on its slice of the global batch; but
// each rank keeps AdamW's moments only for its own contiguous 1/N of the flat
// parameter buffer, updates only that slice, and an all-gather hands every rank
// the others' updated slices (zero.h). Stage 2 also keeps only the gradient shard
// each rank needs: backward reduce-scatters each model stage's gradient as soon as
// it is computed (fsdp.h, with the parameters replicated). Stage 3 (FSDP)
// does not keep the whole model at all: each rank holds its shard of every model
// stage, and gathers a stage's parameters just before using them (fsdp.h).
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/03_fsdp      # stage 3 unless --zero-stage 1 or 2
#include <cblas.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "02_ddp/ddp.h"
#include "03_fsdp/fsdp.h"
#include "03_fsdp/zero.h"
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

// This Comm's counters for one kind of operation (zero before its first call).
// Read them when nothing is in flight.
static OpStats op_stats(const Comm& comm, const std::string& operation) {
  const std::map<std::string, OpStats> stats = comm.stats();
  const auto found = stats.find(operation);
  return found == stats.end() ? OpStats{} : found->second;
}

static CommCost op_cost_since(const Comm& comm, const std::string& operation, const OpStats& before) {
  const OpStats now = op_stats(comm, operation);
  return {now.bytes_sent - before.bytes_sent, now.seconds - before.seconds};
}

static int train(int argc, char** argv) {
  // ---- flags -----------------------------------------------------------------
  TrainOptions options;
  CommOptions comm_options;
  int zero_stage = 3;  // the chapter's subject; 1 and 2 are the steps towards it
  bool no_reshard_after_forward = false;
  bool no_prefetch = false;
  ArgParser parser("03_fsdp",
                   "Chapter 03: ZeRO: data parallelism with the optimizer state, gradients and parameters sharded.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  parser.add_int("--zero-stage", &zero_stage, 1,
                 "1: shard the AdamW state; 2: also reduce-scatter the gradients; 3 (FSDP): also shard the "
                 "parameters, all-gathered stage by stage in forward and again in backward");
  parser.add_switch("--no-reshard-after-forward", &no_reshard_after_forward,
                    "stage 3: keep each stage gathered from forward to backward (one all-gather per stage "
                    "and step instead of two, for P floats of comm buffers)");
  parser.add_switch("--no-prefetch", &no_prefetch,
                    "stage 3: start each stage's all-gather only when the stage needs it, instead of while the "
                    "stage before it computes (to measure what prefetching saves)");
  parser.parse(argc, argv);
  if (zero_stage < 1 || zero_stage > 3) {
    throw FlagError("--zero-stage must be 1 (shard the optimizer state), 2 (and the gradients) or 3 (and the "
                    "parameters), got " + std::to_string(zero_stage));
  }
  if (no_reshard_after_forward && zero_stage != 3) {
    throw FlagError("--no-reshard-after-forward needs --zero-stage 3 (only stage 3 shards the parameters), got "
                    "--zero-stage " + std::to_string(zero_stage));
  }
  if (no_prefetch && zero_stage != 3) {
    throw FlagError("--no-prefetch needs --zero-stage 3 (only stage 3 gathers parameters before a stage runs), got "
                    "--zero-stage " + std::to_string(zero_stage));
  }
  // stages 2 and 3 run FSDP's stage loop (stage 2 with the parameters replicated)
  const bool fsdp_mode = zero_stage >= 2;
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
  // this rank's rows of every global batch, cut into micro-batches (as in DDP)
  const RowSlice my_rows = data_parallel_slice(options.batch, rank, ranks);
  const int micro_batch = my_rows.rows / options.micro_batches;

  // ---- data ------------------------------------------------------------------
  TextData data = load_text_data(options.data, T);
  BatchSampler sampler(data, T, options.batch, options.seed);

  // ---- model and the sharded optimizer ---------------------------------------------
  // Stage 1: a whole GPT on every rank, and ZeRO over its flat buffers.
  // Stages 2 and 3: no GPT anywhere; FSDP holds this rank's shards (and, at stage 2,
  // the whole parameters) and runs the stages itself.
  const AdamWConfig adamw = {options.lr, 0.9f, 0.95f, 1e-8f, options.weight_decay};
  std::unique_ptr<GPT> model;
  std::unique_ptr<ZeRO> zero;
  std::unique_ptr<FSDP> fsdp;
  if (fsdp_mode) {
    fsdp = std::make_unique<FSDP>(*world, config, micro_batch, options.seed, zero_stage, !no_reshard_after_forward,
                                  !no_prefetch, adamw);
  } else {
    model = std::make_unique<GPT>(config, micro_batch, options.seed);
    zero = std::make_unique<ZeRO>(*world, *model, adamw);
  }
  // --trace: stage 1's collectives and step are ZeRO's, stages 2-3's every span FSDP's
  Trace trace(options.trace, rank, ranks);
  if (fsdp_mode) {
    fsdp->set_trace(&trace);
  } else {
    zero->set_trace(&trace);
  }
  // the largest shard any rank holds: S = ceil(P/N) (rank 0's, stages 1 and 2), or at
  // stage 3 rank 0's shards of every stage
  const size_t shard_floats = fsdp_mode ? fsdp->local_floats() : zero->layout().shard_floats;
  if (is_rank0) {
    print_run_header(options, data, count_parameters(config), micro_batch, ranks);
    if (zero_stage == 3) {
      std::printf("zero: stage 3, each of %zu model stages cut in %d shard(s): %zu parameters on rank 0\n",
                  fsdp->stages().size(), ranks, shard_floats);
      std::printf("zero: gathered stages %s after forward, %s, backend %s\n",
                  no_reshard_after_forward ? "kept" : "resharded",
                  no_prefetch ? "each gathered when needed" : "the next stage prefetched", world->backend().c_str());
    } else {
      std::printf("zero: stage %d, %d shard(s) of %zu parameters, gradients %s, backend %s\n", zero_stage, ranks,
                  shard_floats, zero_stage == 1 ? "all-reduced" : "reduce-scattered", world->backend().c_str());
    }
  }
  // each rank reads its own shard; at stages 1 and 2 the shards are then gathered into every replica
  const int first_step = fsdp_mode ? fsdp->resume_if_asked(options, is_rank0) : zero->resume_if_asked(options, is_rank0);

  // ---- training loop -------------------------------------------------------------
  RunReport report("03_fsdp zero-" + std::to_string(zero_stage), config, options.batch, ranks, device);
  std::vector<int> tokens(static_cast<size_t>(micro_batch) * T);   // (micro_batch, T)
  std::vector<int> targets(static_cast<size_t>(micro_batch) * T);  // (micro_batch, T)
  // the mean over this rank's tokens; averaging over ranks then gives the global mean
  const float dloss = 1.0f / (static_cast<float>(my_rows.rows) * T);
  uint64_t total_grad_bytes = 0, total_param_bytes = 0;
  double total_comm_seconds = 0.0;

  for (int step = first_step; step <= options.steps; step++) {
    const double start = now_seconds();
    float loss = 0.0f;
    CommCost grads, gather;
    if (fsdp_mode) {
      // the collectives run inside forward, backward and (stage 2) step: count them by kind
      const OpStats scatter_before = op_stats(*world, "reduce_scatter");
      const OpStats gather_before = op_stats(*world, "all_gather");
      fsdp->zero_grad();
      for (int micro = 0; micro < options.micro_batches; micro++) {
        sampler.fill(step, my_rows.first_row + micro * micro_batch, micro_batch, tokens.data(), targets.data());
        loss += fsdp->forward(tokens.data(), targets.data()) / options.micro_batches;
        fsdp->backward(dloss);
      }
      grads = op_cost_since(*world, "reduce_scatter", scatter_before);
      world->all_reduce(&loss, 1, ReduceOp::Average);  // for the report: the global batch's mean loss
      if (options.grad_clip > 0.0f) fsdp->clip_gradients(options.grad_clip);
      fsdp->step(step);
      gather = op_cost_since(*world, "all_gather", gather_before);
    } else {
      model->zero_grad();
      for (int micro = 0; micro < options.micro_batches; micro++) {
        sampler.fill(step, my_rows.first_row + micro * micro_batch, micro_batch, tokens.data(), targets.data());
        double span_start = now_seconds();
        loss += model->forward(tokens.data(), targets.data()) / options.micro_batches;
        trace.span_since("forward", span_start, Trace::kComputeLane, JsonLine().add("micro_batch", micro));
        span_start = now_seconds();
        model->backward(dloss);
        trace.span_since("backward", span_start, Trace::kComputeLane, JsonLine().add("micro_batch", micro));
      }
      grads = zero->reduce_gradients();
      world->all_reduce(&loss, 1, ReduceOp::Average);  // for the report: the global batch's mean loss
      if (options.grad_clip > 0.0f) zero->clip_gradients(options.grad_clip);
      gather = zero->step(step);
    }
    const double comm_seconds = grads.seconds + gather.seconds;

    total_grad_bytes += grads.bytes_sent;
    total_param_bytes += gather.bytes_sent;
    total_comm_seconds += comm_seconds;
    // all bytes sent, to compare with chapter 02's, and the parameters' part of
    // them; the rest (the gradients' part, the communication thread's time) is in
    // the JSON line and the summary
    char comm_text[64];
    std::snprintf(comm_text, sizeof(comm_text), " | sent %s (params %s)",
                  format_bytes(static_cast<double>(grads.bytes_sent + gather.bytes_sent)).c_str(),
                  format_bytes(static_cast<double>(gather.bytes_sent)).c_str());
    report.step(step, options.steps, loss, now_seconds() - start, is_rank0 && !options.quiet ? options.print_every : 0,
                log,
                JsonLine()
                    .add("bytes_sent", grads.bytes_sent + gather.bytes_sent)
                    .add("grad_bytes_sent", grads.bytes_sent)
                    .add("param_bytes_sent", gather.bytes_sent)
                    .add("comm_ms", comm_seconds * 1e3),
                comm_text);

    // ---- checkpoint: every rank writes its own shard ------------------------------
    if (checkpoint_due(options, step)) {
      if (fsdp_mode) {
        fsdp->save(options, step);
      } else {
        zero->save(options, step);
      }
      prune_checkpoints(options.checkpoint_dir, /*keep=*/2, rank_suffix(rank));
      world->barrier();  // nobody runs ahead (or exits) before every shard exists
    }
  }

  // ---- summary ---------------------------------------------------------------------
  // (stage 3 has no replicas to compare: each rank holds only its shards)
  const Buffer* replica = zero_stage == 1 ? &model->params : zero_stage == 2 ? &fsdp->replicated_params() : nullptr;
  if (replica && !replicas_identical(*world, replica->data(), replica->size())) {
    throw CourseError("rank " + std::to_string(rank) + ": the gathered parameters differ between ranks after " +
                      "training (a bug: every rank must end each step with all the updated shards)");
  }
  const int steps_run = options.steps - first_step + 1;
  if (is_rank0) {
    report.finish(log, run_configuration(options, world->backend())
                           .add("zero_stage", zero_stage)
                           .add("shard_floats", shard_floats)
                           .add("bytes_sent_per_step", (total_grad_bytes + total_param_bytes) / steps_run)
                           .add("grad_bytes_sent_per_step", total_grad_bytes / steps_run)
                           .add("param_bytes_sent_per_step", total_param_bytes / steps_run)
                           .add("comm_ms_per_step", total_comm_seconds * 1e3 / steps_run)
                           .add("prefetch", zero_stage == 3 && !no_prefetch ? 1 : 0));
    std::printf("each rank sent per step: gradients %s (%s), parameters %s (all-gather)\n",
                format_bytes(static_cast<double>(total_grad_bytes) / steps_run).c_str(),
                zero_stage == 1 ? "all-reduce" : "reduce-scatter",
                format_bytes(static_cast<double>(total_param_bytes) / steps_run).c_str());
    // at stage 3 this includes the prefetched gathers that run while a stage computes
    std::printf("communication thread busy %.1f ms per step%s\n", total_comm_seconds * 1e3 / steps_run,
                zero_stage == 3 && !no_prefetch ? ", prefetches included (they overlap compute)" : "");
  }
  finish_trace(trace, options.trace, world.get());
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("03_fsdp", [&] { return train(argc, argv); });
}
