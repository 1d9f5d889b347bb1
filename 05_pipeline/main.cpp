// Chapter 05: pipeline parallelism, chapter 04's trainer with micro-batches in flight.
//
// The model is cut by layers across the ranks instead of the batch: rank r owns a
// contiguous range of stages (model_split.h), rank 0 the embedding, the last rank
// the head and the loss. Each micro-batch's (B, T, C) activation flows forward rank
// by rank, its gradient back the same way.
// M micro-batches at once, in the order of a schedule that pipeline.h's executor
// runs (schedule.h), so several ranks compute at once, except in the bubble.
//
//   ./build/bin/launch --nproc-per-node 2 -- ./build/bin/05_pipeline --schedule zb-h1
//
//   rank 0                 rank 1
//   [emb, blocks 0-1] --activation (B,T,C)--> [blocks 2-3, head, loss]
//                     <--gradient   (B,T,C)--
#include <cstdio>
#include <vector>

#include "04_naive_model_parallel/model_split.h"
#include "05_pipeline/pipeline.h"
#include "common/checkpoint.h"
#include "common/rank_table.h"
#include "common/trainer.h"
#include "common/training.h"

using namespace course;

// ---- the technique: the model cut by layers, a range of stages per rank ------------------
class PipelineParallel : public Technique {
 public:
  PipelineParallel(Run& run, const Schedule& schedule, const std::string& timeline_path)
      : run_(run),
        options_(run.options),
        cut_(pipeline_cut(options_.model, schedule)),
        micro_batch_(options_.batch / options_.micro_batches),
        parts_(options_, cut_.every_rank[run.rank], micro_batch_),
        channels_(*run.world, schedule),
        executor_(schedule, run.rank, parts_.pipeline_chunks, channels_, micro_batch_),
        bubble_(schedule, timeline_path) {
    // bytes sent: the activations and gradients, not the loss's broadcast nor clipping's all-reduce
    meters.add_axis("pp", [this] { return channels_.total_stats(); });
    if (run.is_rank0()) {
      print_run_header(options_, *run.data, count_parameters(options_.model), micro_batch_);
      print_pipeline(schedule, micro_batch_, run.backend());
      cut_.print_ranks();
    }
  }

  int resume() override {
    return resume_parts_if_asked(options_, parts_.parts, parts_.optimizers, cut_.every_rank, run_.is_rank0());
  }

  float step(int step) override {
    const int T = options_.model.seq_len;
    const float dloss = 1.0f / (static_cast<float>(options_.batch) * T);  // as chapter 00: every rank sees the batch
    parts_.zero_grad();
    float loss = executor_.run_step(*run_.world, step, *run_.sampler, dloss, *run_.trace).loss;
    // the loss exists only on the rank with the head: it broadcasts it for the report
    run_.world->broadcast(&loss, 1, cut_.head_rank);
    if (options_.grad_clip > 0.0f) clip_part_gradients(*run_.world, parts_.parts, options_.grad_clip);
    parts_.update(step);
    meters.record_idle(executor_.last_step().busy_seconds, executor_.last_step().window_seconds);
    return loss;
  }

  void save(int step) override {
    save_parts(options_, *run_.world, step, parts_.parts, parts_.optimizers, cut_.every_rank);
  }

  // every rank's share of the memory and of the time
  JsonLine summary() override {
    return gather_rank_table(*run_.world, part_columns(meters, executor_.memory_columns()), cut_.labels)
        .merge(bubble_.gather(*run_.world, executor_.last_step()));  // and the bubble three ways
  }

  void conclude() const override { bubble_.print(meters.world_idle_fraction()); }

 private:
  Run& run_;
  const TrainOptions& options_;
  const StageCut cut_;     // every rank's stages
  const int micro_batch_;  // sequences per forward/backward
  RankChunks parts_;       // this rank's chunks of the model, and their optimizers
  PipelineChannels channels_;  // to and from its neighbours
  PipelineExecutor executor_;  // runs this rank's list of the schedule
  BubbleReport bubble_;
};

// ---- the trainer ---------------------------------------------------------------------
static int train(int argc, char** argv) {
  TrainOptions options;
  options.micro_batches = 8;  // this chapter's subject: a pipeline needs micro-batches to overlap
  CommOptions comm_options;
  int pp = 0;
  ScheduleFlags schedule_flags;
  ArgParser parser("05_pipeline", "Chapter 05: pipeline parallelism with micro-batches and a schedule.");
  add_common_flags(parser, options);
  add_comm_flags(parser, comm_options);
  parser.add_int("--pp", &pp, 0, "pipeline ranks (model parts); 0 = the world size");
  add_schedule_flags(parser, schedule_flags);
  parser.parse(argc, argv);
  if (schedule_flags.dry_run) return schedule_flags.print_schedule(pp, options.micro_batches);

  Run run("05_pipeline", options, &comm_options, /*gpu_ready=*/false);
  pp = whole_world_degree("--pp", pp, run.ranks);
  const Schedule schedule = schedule_flags.make(pp, options);
  run.start(/*data_parallel_ranks=*/1);  // every rank sees the whole batch: no data parallelism here
  PipelineParallel technique(run, schedule, schedule_flags.timeline);
  return train(run, technique);
}

int main(int argc, char** argv) {
  return guarded_main("05_pipeline", [&] { return train(argc, argv); });
}
