#include "09_expert_parallel/expert_model.h"

#include <cstdio>

#include "common/tensor/error.h"
#include "common/train/rank_table.h"
#include "common/train/sharded_checkpoint.h"
#include "common/train/trainer_parts.h"

namespace course {

void add_ep_flags(ArgParser& parser, EPFlags& flags) {
  parser.add_int("--ep", &flags.ep, 0, "ranks the experts are spread over (0: the world)");
  add_ddp_flags(parser, flags);
}

void check_ep_flags(const GPTConfig& config, int ranks) {
  if (config.n_experts == 0) {
    throw FlagError("chapter 09 spreads the experts of a mixture-of-experts model over the ranks: it needs "
                    "--experts E (hint: --experts 4 --top-k 2)");
  }
  expert_parallel_config(config, ranks, 0);  // E divisible by R, else its FlagError
  if (config.recompute != Recompute::None) {
    throw FlagError("chapter 09 does not recompute activations: its experts' layer sends tokens to other ranks, and "
                    "running it again in backward would send them again (hint: drop --recompute; chapter 00 "
                    "recomputes --experts on one process)");
  }
}

void print_expert_layout(const GPTConfig& my_experts, int ranks, const std::string& backend) {
  char capacity[32] = "none (dropless)";
  if (my_experts.capacity_factor > 0) std::snprintf(capacity, sizeof(capacity), "%g x fair share", my_experts.capacity_factor);
  std::printf("expert parallel: %d experts per block over %d rank(s), %d each; top-%d routing, capacity %s, "
              "backend %s\n",
              my_experts.n_experts, ranks, my_experts.local_experts(), my_experts.top_k, capacity, backend.c_str());
}

// the flat ranges every rank holds alike: all but the experts
static std::vector<FlatRange> replicated_ranges(const GPT& model) {
  std::vector<FlatRange> ranges;
  size_t begin = 0;
  for (const FlatRange& experts : expert_ranges(model)) {
    if (experts.begin > begin) ranges.push_back({begin, experts.begin});
    begin = experts.end;
  }
  if (model.params.size() > begin) ranges.push_back({begin, model.params.size()});
  return ranges;
}

// How --ep R cuts the model: rank r's experts, and every rank the replicated rest.
static ShardedCut expert_cut(const GPTConfig& config, int ranks) {
  const auto shards_of = [config, ranks](int rank) {
    return std::vector<ManifestShard>{
        {"", "params", "adam_m", "adam_v", expert_parallel_pieces(expert_parallel_config(config, ranks, rank))}};
  };
  return {"09_expert_parallel at --ep " + std::to_string(ranks) + ": every block's " +
              std::to_string(config.n_experts) + " experts in " + std::to_string(ranks) +
              " blocks, the rest replicated",
          ranks, shards_of};
}

void save_experts(const TrainOptions& options, int step, int rank, int ranks, const GPT& model,
                  const AdamW& optimizer) {
  save_sharded(options, step, rank, expert_cut(model.config(), ranks),
               {{model.params.data(), optimizer.m.data(), optimizer.v.data(), model.device()}},
               {{"expert_parallel", ranks}});
}

int resume_experts_if_asked(const TrainOptions& options, int rank, int ranks, GPT& model, AdamW& optimizer) {
  return resume_sharded(options, rank, expert_cut(model.config(), ranks),
                        {{model.params.data(), optimizer.m.data(), optimizer.v.data(), model.device()}}, rank == 0);
}

double expert_parallel_grad_norm_squared(Comm& world, const GPT& model) {
  double replicated = 0.0;
  for (const FlatRange& range : replicated_ranges(model)) {
    replicated += grad_norm_squared(model.grads.data() + range.begin, range.end - range.begin, model.device());
  }
  // every rank's experts are its own: their squares add up over the ranks
  float experts = 0.0f;
  for (const FlatRange& range : expert_ranges(model)) {
    experts += static_cast<float>(
        grad_norm_squared(model.grads.data() + range.begin, range.end - range.begin, model.device()));
  }
  world.all_reduce(&experts, 1, ReduceOp::Sum);
  return replicated + experts;
}

void check_replicated_agree(Comm& world, const GPT& model) {
  for (const FlatRange& range : replicated_ranges(model)) {
    check_copies_agree(world, model.params.data() + range.begin, range.end - range.begin, model.params.device(),
                       "the replicated parameters");
  }
}

JsonLine expert_rank_table(Comm& world, const ExpertParallel& experts, const GPT& model, const StepMeters& meters) {
  const ExpertCounters& c = experts.counters();
  const double per_step = meters.steps() > 0 ? 1.0 / meters.steps() : 0.0;
  const std::vector<RankColumn> columns = {
      {"ep_formula_per_step", "ep formula", static_cast<double>(c.formula_bytes) * per_step, ColumnUnit::Bytes},
      {"all_to_all_ms_per_step", "a2a ms/step", 1e3 * c.all_to_all_seconds * per_step, ColumnUnit::Milliseconds},
      {"expert_ms_per_step", "expert ms", 1e3 * c.expert_seconds * per_step, ColumnUnit::Milliseconds}};
  const GPTConfig& config = model.config();
  std::vector<std::string> labels;
  for (int rank = 0; rank < world.size(); rank++) {
    const int first = rank * config.local_experts();
    labels.push_back("experts " + std::to_string(first) + "-" + std::to_string(first + config.local_experts() - 1));
  }
  JsonLine fields = gather_rank_table(world, model.params.device(), meter_columns(meters, columns), labels);
  return fields.add("ep", world.size()).add("experts_per_rank", config.local_experts());
}

}  // namespace course
