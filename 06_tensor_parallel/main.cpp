// Chapter 06: tensor parallelism.
//
// Chapters 02-03 split the batch, 04-05 the layers; this one splits every layer's
// matrices. Each of the N ranks holds 1/N of every block's qkv, proj, fc and
// fcproj weights (and of the vocabulary's embedding rows and LM head), runs the
// whole batch through its slices, and the ranks add up their partial results with
// Megatron's f and g operators (tensor_parallel.h): two all-reduces per block in
// forward and two in backward. With --sp (sequence parallelism) the LayerNorm and
// residual regions keep only 1/N of the sequence per rank, and the all-reduces
// become reduce-scatters and all-gathers.
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/06_tensor_parallel
//
//   rank 0: heads 0-1, hidden 0..2C-1, vocab 0-127  ──┐ all-reduce (B,T,C) after every
//   rank 1: heads 2-3, hidden 2C..4C-1, vocab 128-255 ─┘ row-parallel layer, and in backward
//                                                        before every column-parallel one
#include <cblas.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "02_ddp/ddp.h"
#include "06_tensor_parallel/tensor_parallel.h"
#include "06_tensor_parallel/tp_model.h"
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

static int train(int argc, char** argv) {
  // ---- flags -----------------------------------------------------------------
  TrainOptions options;
  CommOptions comm_options;
  int tp = 0;
  bool sequence_parallel = false;
  ArgParser parser("06_tensor_parallel", "Chapter 06: tensor parallelism: every matrix split across the ranks.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  parser.add_int("--tp", &tp, 0, "tensor-parallel ranks (each holds 1/tp of every matrix); 0 = the world size");
  parser.add_switch("--sp", &sequence_parallel,
                    "sequence parallelism: LayerNorms and residuals on 1/tp of the sequence");
  parser.parse(argc, argv);
  const Device device = setup_device(options, /*gpu_ready=*/false);
  openblas_set_num_threads(options.threads);

  // ---- ranks -----------------------------------------------------------------
  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), comm_options);
  const int rank = world->rank(), ranks = world->size();
  tp = whole_world_degree("--tp", tp, ranks);
  validate_common(options);  // every rank sees the whole batch: there is no data parallelism here
  check_tp_shape(options.model, tp, sequence_parallel);
  const bool is_rank0 = rank == 0;
  MetricsLog log(is_rank0 ? options.log : "");
  if (!options.checkpoint_dir.empty()) ensure_checkpoint_dir(options.checkpoint_dir);

  const GPTConfig& config = options.model;
  const int T = config.seq_len, L = config.n_layer;
  const int micro_batch = options.batch / options.micro_batches;

  // ---- data: every rank reads the whole micro-batch --------------------------------
  TextData data = load_text_data(options.data, T);
  BatchSampler sampler(data, T, options.batch, options.seed);

  // ---- this rank's slices of the model, its optimizer --------------------------------
  TPGroup group(*world, sequence_parallel, micro_batch, T, config.d_model);
  Trace trace(options.trace, rank, ranks);
  group.set_trace(&trace);  // every f and g inside forward and backward on the communication lane
  TPPart part(config, group, 0, L + 1, options.seed);
  AdamW optimizer({options.lr, 0.9f, 0.95f, 1e-8f, options.weight_decay}, part.params.size());
  TPActivations acts(config, group, 0, L + 1);
  TPWorkspace workspace(config, group);
  if (is_rank0) {
    print_run_header(options, data, count_parameters(config), micro_batch);
    std::printf("tensor parallel: %d ranks%s, backend %s\n  each rank: %d of %d heads, %d of %d MLP features, "
                "%d of %d vocabulary rows\n",
                tp, sequence_parallel ? ", sequence parallel" : "", world->backend().c_str(), config.n_head / tp,
                config.n_head, 4 * config.d_model / tp, 4 * config.d_model, config.vocab_size / tp,
                config.vocab_size);
  }
  const int first_step = resume_tp_if_asked(options, *world, part, optimizer, is_rank0);

  // ---- training loop -------------------------------------------------------------
  RunReport report(sequence_parallel ? "06_tensor_parallel +sp" : "06_tensor_parallel", config, options.batch, ranks,
                   device);
  const float dloss = 1.0f / (static_cast<float>(options.batch) * T);  // as chapter 00
  uint64_t total_bytes_sent = 0;
  double total_comm_seconds = 0.0;

  for (int step = first_step; step <= options.steps; step++) {
    const double start = now_seconds();
    const OpStats before = world->total_stats();
    part.grads.zero();
    float loss = 0.0f;
    for (int micro = 0; micro < options.micro_batches; micro++) {
      sampler.fill(step, micro * micro_batch, micro_batch, acts.tokens.data(), acts.targets.data());
      const JsonLine at = JsonLine().add("step", step).add("micro_batch", micro);
      double span_start = now_seconds();
      loss += part.forward(acts, workspace) / options.micro_batches;  // the same loss on every rank
      trace.span_since("forward", span_start, Trace::kComputeLane, at);
      span_start = now_seconds();
      part.backward(acts, nullptr, nullptr, dloss, workspace);
      trace.span_since("backward", span_start, Trace::kComputeLane, at);
    }
    part.finish_gradients();
    const double update_start = now_seconds();
    if (options.grad_clip > 0.0f) clip_tp_gradients(part, options.grad_clip);
    optimizer.update(part.params.data(), part.grads.data(), step);
    trace.span_since("optimizer step", update_start, Trace::kComputeLane, JsonLine().add("step", step));

    const OpStats after = world->total_stats();
    const uint64_t sent = after.bytes_sent - before.bytes_sent;
    const double comm_seconds = after.seconds - before.seconds;
    total_bytes_sent += sent;
    total_comm_seconds += comm_seconds;
    char comm_text[64];
    std::snprintf(comm_text, sizeof(comm_text), " | sent %s, comm %.1f ms",
                  format_bytes(static_cast<double>(sent)).c_str(), comm_seconds * 1e3);
    report.step(step, options.steps, loss, now_seconds() - start, is_rank0 && !options.quiet ? options.print_every : 0,
                log, JsonLine().add("bytes_sent", sent).add("comm_ms", comm_seconds * 1e3), comm_text);

    // ---- checkpoint: every rank writes its own slices -----------------------------------
    if (checkpoint_due(options, step)) {
      save_tp_checkpoint(options, *world, step, part, optimizer);
      world->barrier();  // nobody exits before every slice is on disk
      prune_checkpoints(options.checkpoint_dir, /*keep=*/2, rank_suffix(rank));
    }
  }

  // ---- summary ---------------------------------------------------------------------
  // the LayerNorms, the row-parallel biases and wpe live on every rank: they must agree
  if (!replicas_identical(*world, part.replicated_params(), part.replicated_count())) {
    throw CourseError("rank " + std::to_string(rank) + ": the replicated parameters differ between the ranks after " +
                      "training (a bug: every rank must apply the same gradients to them)");
  }
  const int steps_run = options.steps - first_step + 1;
  const double full_logits = 4.0 * micro_batch * T * config.vocab_size;  // chapter 00's (B, T, V), per buffer
  if (is_rank0) {
    report.finish(log, run_configuration(options, world->backend())
                           .add("bytes_sent_per_step", total_bytes_sent / steps_run)
                           .add("comm_ms_per_step", total_comm_seconds * 1e3 / steps_run)
                           .add("tp", tp)
                           .add("sequence_parallel", sequence_parallel ? 1 : 0)
                           .add("params_per_rank", part.params.size())
                           .add("replicated_params", part.replicated_count()));
    std::printf("tensor parallel per step: %s sent by each rank, %.1f ms in communication\n",
                format_bytes(static_cast<double>(total_bytes_sent) / steps_run).c_str(),
                total_comm_seconds * 1e3 / steps_run);
    std::printf("logits and their probabilities: %s per rank instead of chapter 00's %s (never gathered)\n",
                format_bytes(2 * full_logits / tp).c_str(), format_bytes(2 * full_logits).c_str());
  }
  finish_trace(trace, options.trace, world.get());
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("06_tensor_parallel", [&] { return train(argc, argv); });
}
