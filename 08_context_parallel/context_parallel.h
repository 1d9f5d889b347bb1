// Context parallelism: every sequence split over the ranks of a cp group.
//
// Each rank of a cp group holds T/N of every sequence's tokens (sequence_split.h)
// and runs everything but attention on those alone: the embedding (of its own
// positions), the LayerNorms, the MLPs, the head and the loss. Attention is the one
// op whose queries need keys and values from the whole sequence; the rank's
// ContextAttention fetches them:
//
//   ring (default)   K/V blocks travel around the cp ring, N-1 hops, each hop's
//                    transfer overlapped with the current block's attention
//                    (ring_attention.h)
//   a2a (Ulysses)    all-to-all: sequence-split q/k/v become head-split ones, attention
//                    runs on whole sequences for NH/N heads, and back (ulysses_attention.h)
//
// With data parallelism beside it (--dp D --cp N, D x N ranks), rank = dp_rank N + cp_rank:
// cp varies fastest, so one sequence's ranks are neighbours (one node: the fast
// link, as Megatron-LM places cp next to tp). The parameters are replicated on all
// D x N ranks, so chapter 02's DDP averages the gradients over all of them: each
// rank's gradient is that of the mean loss over its own tokens, and every rank holds
// as many tokens as any other.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "02_ddp/ddp.h"
#include "08_context_parallel/context_attention.h"
#include "08_context_parallel/sequence_split.h"
#include "common/train/cli.h"
#include "common/model/data.h"
#include "common/comm/comm.h"
#include "common/model/model.h"
#include "common/train/rank_table.h"
#include "common/train/trainer.h"

namespace course {

// Chapter 08's own flags, and chapter 02's (--bucket-mb, --no-overlap) for the DDP beside it.
struct CPFlags : DDPFlags {
  int cp = 0;                    // --cp: ranks per sequence (0: the world over --dp)
  int dp = 0;                    // --dp: data-parallel replicas (0: the world over --cp)
  std::string split = "zigzag";  // --cp-split contiguous|zigzag
  std::string mode = "ring";     // --cp-mode ring|a2a
};
void add_cp_flags(ArgParser& parser, CPFlags& flags);

// Where a rank sits: its dp and cp coordinates and its cp group.
struct CPPlace {
  // Collective over the world (it splits off the cp groups); flags resolved first.
  CPPlace(Comm& world, const CPFlags& flags, const GPTConfig& config);
  // rows first_row.. of a step's global batch, this rank's chunks of each sequence:
  // tokens and targets (chunks, rows, Tc)
  void sample_local(BatchSampler& sampler, int step, int first_row, int rows, int* tokens, int* targets);
  // "dp0 cp1: 4-7,8-11" for every rank of the world, for the per-rank table
  std::vector<std::string> labels() const;
  int dp = 1, cp = 1;
  int dp_rank = 0, cp_rank = 0;
  SequenceSplit split;
  std::string mode;                // --cp-mode: ring or a2a
  std::unique_ptr<Comm> cp_group;  // the N ranks that share this rank's sequences

 private:
  std::vector<int> sequences_;  // (2, rows, T)  whole sequences and their targets, as sampled
};

// What the flags ask of the model, checked before anything is allocated (every rank
// finds the same: FlagError): the world factors as dp x cp (fills in the one left
// out), the sequence splits into the chunks, the heads divide for a2a, no --recompute.
void resolve_cp_flags(CPFlags& flags, const GPTConfig& config, int world_size);

// The attention of --cp-mode, over the place's cp group, on the run's device (the ring
// is CPU-only for now); with --trace, each transfer and each block of its math is a
// span, and every wait for a transfer goes into `meters` as exposed communication.
std::unique_ptr<ContextAttention> make_context_attention(const CPFlags& flags, const Run& run, CPPlace& place,
                                                         StepMeters& meters);

// rank 0, under the run header: "cp: 2 ranks per sequence (zigzag: chunks 0+3 | 1+2), ring attention, ..."
void print_cp_layout(const CPFlags& flags, const CPPlace& place, const std::string& backend);

// The per-rank table (collective; printed by rank 0): memory and the meters' columns,
// and attention compute per step (contiguous against zigzag shows here). Returns the
// summary's fields, with the bytes the formula says the cp group is sent per step.
JsonLine cp_rank_table(Comm& world, const CPPlace& place, const ContextAttention& attention, const StepMeters& meters,
                       int micro_batch, const TrainOptions& options);

}  // namespace course
