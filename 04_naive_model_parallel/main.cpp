// Chapter 04: naive model parallelism.
//
// Chapters 02-03 split the batch; this one splits the model. Rank r owns a
// contiguous range of stages (model_split.h): rank 0 the embedding and the first
// blocks, the last rank the last blocks and the head with the loss. A micro-batch
// flows forward rank by rank (each sends its (B, T, C) output to the next) and its
// gradient flows back the same way. Nothing overlaps, on purpose: while one rank
// computes, the others wait, and the table at the end shows each rank idle about
// (N-1)/N of the time. Chapter 05 keeps the cut and fills that idle time.
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/04_naive_model_parallel
//
//   rank 0                 rank 1
//   [emb, blocks 0-1] --activation (B,T,C)--> [blocks 2-3, head, loss]
//                     <--gradient   (B,T,C)--
#include <cblas.h>

#include <cmath>
#include <map>
#include <cstdio>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "common/rank_table.h"
#include "common/adamw.h"
#include "common/checkpoint.h"
#include "common/cli.h"
#include "common/comm/comm.h"
#include "common/data.h"
#include "common/error.h"
#include "common/metrics.h"
#include "common/ops.h"
#include "common/trace.h"
#include "common/training.h"

using namespace course;

static int train(int argc, char** argv) {
  // ---- flags -----------------------------------------------------------------
  TrainOptions options;
  CommOptions comm_options;
  int pp = 0;
  ArgParser parser("04_naive_model_parallel", "Chapter 04: the model cut by layers across ranks, one rank busy at a time.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  parser.add_int("--pp", &pp, 0, "pipeline ranks (model parts); 0 = the world size");
  parser.parse(argc, argv);
  const Device device = setup_device(options, /*gpu_ready=*/false);
  openblas_set_num_threads(options.threads);

  // ---- ranks and the cut ---------------------------------------------------------
  std::unique_ptr<Comm> world = create_world_comm(read_launch_env(), comm_options);
  const int rank = world->rank(), ranks = world->size();
  pp = whole_world_degree("--pp", pp, ranks);
  validate_common(options);  // every rank sees the whole batch: there is no data parallelism here
  const std::vector<StageRange> cut = split_stages(options.model, pp);
  std::vector<std::vector<StageRange>> every_rank_part;  // [r]: rank r's one part, for the checkpoint manifest
  for (const StageRange& range : cut) every_rank_part.push_back({range});
  const bool first = rank == 0, last = rank == pp - 1, is_rank0 = rank == 0;
  MetricsLog log(is_rank0 ? options.log : "");
  Trace trace(options.trace, rank, ranks);
  if (!options.checkpoint_dir.empty()) ensure_checkpoint_dir(options.checkpoint_dir);

  const GPTConfig& config = options.model;
  const int T = config.seq_len;
  const int micro_batch = options.batch / options.micro_batches;

  // ---- data: the first rank reads tokens, the last rank targets ------------------
  TextData data = load_text_data(options.data, T);
  BatchSampler sampler(data, T, options.batch, options.seed);

  // ---- this rank's part of the model, its optimizer ---------------------------------
  ModelPart part(config, cut[rank], micro_batch, options.seed);
  AdamW optimizer({options.lr, 0.9f, 0.95f, 1e-8f, options.weight_decay}, part.params.size());
  PartActivations acts(config, cut[rank], micro_batch);
  BackwardWorkspace workspace(config, micro_batch);
  const size_t BTC = part.activation_floats();
  Buffer dout(last ? 0 : BTC, MemCategory::CommBuffers);     // (B, T, C)  received from the next rank
  Buffer dinput(first ? 0 : BTC, MemCategory::CommBuffers);  // (B, T, C)  sent to the previous rank
  std::vector<std::string> labels;
  for (const StageRange& range : cut) labels.push_back(describe_stages(config, range));
  if (is_rank0) {
    print_run_header(options, data, count_parameters(config), micro_batch);
    std::printf("model parallel: %d ranks, backend %s:", pp, world->backend().c_str());
    for (int r = 0; r < pp; r++) std::printf("%s rank %d = %s", r ? ";" : "", r, labels[r].c_str());
    std::printf("\n");
  }
  const int first_step = resume_parts_if_asked(options, {&part}, {&optimizer}, every_rank_part, is_rank0);

  // ---- training loop -------------------------------------------------------------
  RunReport report("04_naive_model_parallel", config, options.batch, ranks, device);
  const float dloss = 1.0f / (static_cast<float>(options.batch) * T);  // as chapter 00
  double total_busy = 0.0, total_step = 0.0;

  for (int step = first_step; step <= options.steps; step++) {
    const double start = now_seconds();
    const OpStats sent_before = world->total_stats();
    double busy = 0.0;  // seconds this rank computed
    part.grads.zero();
    float loss = 0.0f;
    for (int micro = 0; micro < options.micro_batches; micro++) {
      sampler.fill(step, micro * micro_batch, micro_batch, acts.tokens.data(), acts.targets.data());
      // --trace: each wait, send and computation as a span; the waits are the idle time
      const JsonLine at = JsonLine().add("step", step).add("micro_batch", micro);
      double span_start = now_seconds();

      // forward: wait for the previous rank's activation, compute, pass ours on
      if (!first) {
        world->recv(acts.input.data(), BTC, rank - 1);
        trace.span_since("recv activation", span_start, Trace::kCommunicationLane, at);
      }
      double compute_start = now_seconds();
      const float micro_loss = part.forward(acts);
      busy += now_seconds() - compute_start;
      trace.span_since("forward", compute_start, Trace::kComputeLane, at);
      if (last) loss += micro_loss / options.micro_batches;
      if (!last) {
        span_start = now_seconds();
        world->send(part.output(acts), BTC, rank + 1);
        trace.span_since("send activation", span_start, Trace::kCommunicationLane, at);
      }

      // backward: wait for the next rank's gradient, compute, pass ours back
      if (!last) {
        span_start = now_seconds();
        world->recv(dout.data(), BTC, rank + 1);
        trace.span_since("recv gradient", span_start, Trace::kCommunicationLane, at);
      }
      compute_start = now_seconds();
      if (!first) dinput.zero();
      part.backward(acts, last ? nullptr : dout.data(), first ? nullptr : dinput.data(), dloss, workspace);
      busy += now_seconds() - compute_start;
      trace.span_since("backward", compute_start, Trace::kComputeLane, at);
      if (!first) {
        span_start = now_seconds();
        world->send(dinput.data(), BTC, rank - 1);
        trace.span_since("send gradient", span_start, Trace::kCommunicationLane, at);
      }
    }
    // the loss exists only on the last rank: it broadcasts it for the report
    world->broadcast(&loss, 1, pp - 1);
    if (options.grad_clip > 0.0f) clip_part_gradients(*world, {&part}, options.grad_clip);
    const double update_start = now_seconds();
    optimizer.update(part.params.data(), part.grads.data(), step);
    trace.span_since("optimizer step", update_start, Trace::kComputeLane, JsonLine().add("step", step));

    const double seconds = now_seconds() - start;
    total_busy += busy;
    total_step += seconds;
    const uint64_t sent = world->total_stats().bytes_sent - sent_before.bytes_sent;
    char text[64];
    std::snprintf(text, sizeof(text), " | sent %s | idle %2.0f%%", format_bytes(static_cast<double>(sent)).c_str(),
                  100.0 * (1.0 - busy / seconds));
    report.step(step, options.steps, loss, seconds, is_rank0 && !options.quiet ? options.print_every : 0, log,
                JsonLine().add("bytes_sent", sent).add("busy_fraction", busy / seconds), text);

    // ---- checkpoint: every rank writes its own part -----------------------------------
    if (checkpoint_due(options, step)) {
      save_parts(options, *world, step, {&part}, {&optimizer}, every_rank_part);
      world->barrier();  // nobody exits before every part is on disk
      prune_checkpoints(options.checkpoint_dir, /*keep=*/2, rank_suffix(rank));
    }
  }

  // ---- summary: every rank's share of the memory and of the time -----------------------
  const int steps_run = options.steps - first_step + 1;
  const std::map<std::string, OpStats> by_op = world->stats();
  const auto p2p_bytes = [&](const char* op) { return by_op.count(op) ? by_op.at(op).bytes_sent : 0; };
  const double p2p_per_step = static_cast<double>(p2p_bytes("send")) / steps_run;
  const JsonLine table = gather_rank_table(
      *world,
      {{"sent_per_step", "sent/step", p2p_per_step, ColumnUnit::Bytes},
       {"busy_fraction", "busy", total_busy / total_step, ColumnUnit::Percent},
       {"idle_fraction", "idle", 1.0 - total_busy / total_step, ColumnUnit::Percent}},
      labels);
  float idle = static_cast<float>(1.0 - total_busy / total_step);
  world->all_reduce(&idle, 1, ReduceOp::Average);
  if (is_rank0) {
    report.finish(log, run_configuration(options, world->backend())
                           .add("bytes_sent_per_step", p2p_per_step)
                           .add("bubble_measured", static_cast<double>(idle))
                           .merge(table));
    std::printf("idle share of the step, mean over ranks: measured %.1f%%, (N-1)/N = %.1f%% expected at N = %d\n",
                100.0 * idle, 100.0 * (pp - 1) / pp, pp);
  }
  finish_trace(trace, options.trace, world.get());
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("04_naive_model_parallel", [&] { return train(argc, argv); });
}
