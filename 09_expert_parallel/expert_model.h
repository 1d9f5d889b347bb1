// What chapter 09's trainer needs around the expert-parallel layer (expert_parallel.h):
// its flags, where a rank's experts are, the checkpoint of a rank that holds some
// experts and the replicated rest, the gradient norm over all ranks' experts, and the
// end-of-run table.
#pragma once

#include <string>
#include <vector>

#include "02_ddp/ddp.h"
#include "09_expert_parallel/expert_parallel.h"
#include "common/model/adamw.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/train/meters.h"
#include "common/train/metrics.h"
#include "common/model/model.h"

namespace course {

// Chapter 09's own flag, and chapter 02's (--bucket-mb, --no-overlap) for the DDP of the rest.
struct EPFlags : DDPFlags {
  int ep = 0;  // --ep: ranks the experts are spread over (0: the world)
};
void add_ep_flags(ArgParser& parser, EPFlags& flags);

// FlagErrors every rank finds alike: no --experts (nothing to spread), E not divisible by R,
// --recompute.
void check_ep_flags(const GPTConfig& config, int ranks);

// rank 0, under the run header: "expert parallel: 4 experts per block over 2 ranks, 2 each, ..."
void print_expert_layout(const GPTConfig& my_experts, int ranks, const std::string& backend);

// Every rank writes its experts and its copy of the replicated parameters (with AdamW's
// moments) through the manifest; any --ep (or chapter 00) reads it back.
void save_experts(const TrainOptions& options, int step, int rank, int ranks, const GPT& model,
                  const AdamW& optimizer);
int resume_experts_if_asked(const TrainOptions& options, int rank, int ranks, GPT& model, AdamW& optimizer);

// The squared norm of the whole model's gradient: the replicated part (the same on every
// rank after DDP) once, and every rank's experts (collective over `world`).
double expert_parallel_grad_norm_squared(Comm& world, const GPT& model);

// After training: the replicated parameters are the same on every rank.
void check_replicated_agree(Comm& world, const GPT& model);

// The per-rank table (collective; rank 0 prints): memory, the meters' columns, time in
// the all-to-alls and in the experts per step, the bytes the formula gives next to
// those sent. Returns the summary's fields (with ep and the experts per rank).
JsonLine expert_rank_table(Comm& world, const ExpertParallel& experts, const GPT& model, const StepMeters& meters);

}  // namespace course
