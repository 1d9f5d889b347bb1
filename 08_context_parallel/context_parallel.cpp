#include "08_context_parallel/context_parallel.h"

#include <algorithm>
#include <cstdio>

#include "08_context_parallel/ring_attention.h"
#include "08_context_parallel/ulysses_attention.h"
#include "common/tensor/error.h"
#include "common/train/metrics.h"
#include "common/train/trainer_parts.h"

namespace course {

void add_cp_flags(ArgParser& parser, CPFlags& flags) {
  parser.add_int("--cp", &flags.cp, 0, "ranks per sequence (0: the world over --dp)");
  parser.add_int("--dp", &flags.dp, 0, "data-parallel replicas (0: the world over --cp)");
  parser.add_choice("--cp-split", &flags.split, {"contiguous", "zigzag"},
                    "which chunks of a sequence a rank holds (zigzag: the same attention work on every rank)");
  parser.add_choice("--cp-mode", &flags.mode, {"ring", "a2a"},
                    "how attention gets the other ranks' keys and values: around a ring, or all-to-all (Ulysses)");
  add_ddp_flags(parser, flags);
}

void resolve_cp_flags(CPFlags& flags, const GPTConfig& config, int world_size) {
  if (config.recompute != Recompute::None) {
    throw FlagError("chapter 08 does not recompute activations: its attention fetches the other ranks' keys and "
                    "values, and running it again in backward would fetch them again (hint: drop --recompute)");
  }
  if (flags.cp == 0 && flags.dp == 0) flags.cp = world_size;  // one sequence over every rank
  if (flags.cp == 0 && world_size % flags.dp == 0) flags.cp = world_size / flags.dp;
  if (flags.dp == 0 && world_size % flags.cp == 0) flags.dp = world_size / flags.cp;
  if (flags.dp == 0 || flags.cp == 0) {  // one given, and it does not divide the world
    const std::string given = flags.dp != 0 ? "--dp " + std::to_string(flags.dp) : "--cp " + std::to_string(flags.cp);
    throw FlagError(given + " does not divide this run's " + std::to_string(world_size) + " ranks (hint: launch with " +
                    "--nproc-per-node " + std::to_string(flags.dp + flags.cp) + ", or a multiple of it)");
  }
  if (flags.dp * flags.cp != world_size) {
    throw FlagError("--dp " + std::to_string(flags.dp) + " x --cp " + std::to_string(flags.cp) +
                    " is not this run's " + std::to_string(world_size) + " ranks (hint: launch with --nproc-per-node " +
                    std::to_string(flags.dp * flags.cp) + ", or leave one of them out)");
  }
  const SequenceSplit check_split(config.seq_len, flags.cp, parse_split_kind(flags.split));
  if (flags.mode == "a2a") check_ulysses_heads(config.n_head, flags.cp);
}

CPPlace::CPPlace(Comm& world, const CPFlags& flags, const GPTConfig& config)
    : dp(flags.dp),
      cp(flags.cp),
      dp_rank(world.rank() / flags.cp),
      cp_rank(world.rank() % flags.cp),
      split(config.seq_len, flags.cp, parse_split_kind(flags.split)),
      mode(flags.mode),
      cp_group(world.split(/*color=*/dp_rank, /*key=*/cp_rank)) {}

void CPPlace::sample_local(BatchSampler& sampler, int step, int first_row, int rows, int* tokens,
                           int* targets) {
  const size_t whole = static_cast<size_t>(rows) * split.seq_len();
  sequences_.resize(2 * whole);
  sampler.fill(step, first_row, rows, sequences_.data(), sequences_.data() + whole);
  split.take_local(sequences_.data(), tokens, rows, cp_rank);
  split.take_local(sequences_.data() + whole, targets, rows, cp_rank);
}

std::vector<std::string> CPPlace::labels() const {
  std::vector<std::string> labels;
  for (int rank = 0; rank < dp * cp; rank++) {
    std::string label = "dp" + std::to_string(rank / cp) + " cp" + std::to_string(rank % cp) + ":";
    const char* separator = " ";
    for (const PositionChunk& chunk : split.chunks_of(rank % cp)) {
      label += separator + std::to_string(chunk.start) + "-" + std::to_string(chunk.start + chunk.length - 1);
      separator = ",";
    }
    labels.push_back(label);
  }
  return labels;
}

std::unique_ptr<ContextAttention> make_context_attention(const CPFlags& flags, const Run& run, CPPlace& place,
                                                         StepMeters& meters) {
  const GPTConfig& config = run.options.model;
  std::unique_ptr<ContextAttention> attention;
  if (flags.mode == "a2a") {
    attention = std::make_unique<UlyssesAttention>(config, place.split, *place.cp_group, run.device,
                                                   message_dtype(run.options));
  } else {
    attention = std::make_unique<RingAttention>(config, place.split, *place.cp_group, run.device,
                                                message_dtype(run.options));
  }
  attention->set_trace(run.trace.get());
  attention->set_meters(&meters);
  return attention;
}

void print_cp_layout(const CPFlags& flags, const CPPlace& place, const std::string& backend) {
  std::printf("context parallel: %d rank(s) per sequence x %d data-parallel, %s split, %s attention, backend %s\n",
              place.cp, place.dp, flags.split.c_str(), flags.mode == "a2a" ? "all-to-all (Ulysses)" : "ring",
              backend.c_str());
  std::printf("  each rank: %d of %d tokens of every sequence (%d chunk(s) of %d)\n", place.split.local_len(),
              place.split.seq_len(), place.split.chunks_per_rank(), place.split.chunk_len());
}

JsonLine cp_rank_table(Comm& world, const CPPlace& place, const ContextAttention& attention, const StepMeters& meters,
                       int micro_batch, const TrainOptions& options) {
  const double per_step = meters.steps() > 0 ? 1e3 / meters.steps() : 0.0;  // seconds -> ms per step
  const std::vector<RankColumn> attention_columns = {
      {"attention_ms_per_step", "attn ms/step", attention.compute_seconds() * per_step, ColumnUnit::Milliseconds},
      {"cp_exposed_ms_per_step", "cp exposed", attention.exposed_comm_seconds() * per_step,
       ColumnUnit::Milliseconds}};
  JsonLine fields = gather_rank_table(world, Device::CPU, meter_columns(meters, attention_columns), place.labels());
  // of the time the cp group's transfers took, the part attention's compute hid (a
  // wait also counts the time a slower peer took to send: none hidden, not less)
  const double cp_comm_seconds = place.cp_group->total_stats().seconds;
  const double exposed_share = cp_comm_seconds > 0 ? attention.exposed_comm_seconds() / cp_comm_seconds : 1.0;
  fields.add("cp_hidden_fraction", std::max(0.0, 1.0 - exposed_share));
  fields.add("dp", place.dp).add("cp", place.cp).add("cp_split", split_kind_name(place.split.kind()));
  fields.add("cp_mode", place.mode);
  return fields.add("cp_bytes_formula_per_step",
                    attention.bytes_per_layer(micro_batch) * options.model.n_layer * options.micro_batches);
}

}  // namespace course
