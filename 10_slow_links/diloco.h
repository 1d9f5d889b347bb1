// DiLoCo (Douillard et al., 2023) and streaming DiLoCo (Douillard et al., 2025):
// workers that talk every H steps instead of every step.
//
// Each of the W workers trains its own copy of the model on its slice of every
// global batch, with its own (inner) optimizer and no communication. Every H
// steps the workers average how far they moved, the pseudo-gradient, and an outer
// optimizer (SGD with Nesterov momentum) moves the global weights by it; every
// worker then starts again from the new global weights:
//
//   worker 0:  inner x H  --.                     .--> inner x H --> ...
//   worker 1:  inner x H  --+-- average(global - local) --+--> inner x H --> ...
//   worker W:  inner x H  --'   outer Nesterov step       '--> inner x H --> ...
//
// So a worker sends the model's size once every H steps instead of once every step.
//
// Streaming DiLoCo cuts the model into P fragments (consecutive blocks; the embedding
// goes with the first, the head with the last) and syncs fragment p at the steps
// where (step + p H / P) is a multiple of H: one P-th of the model at a time, P times
// as often, so the link's peak load is a P-th of DiLoCo's. With --overlap-steps tau the
// fragment's average travels while the next tau inner steps compute, and when it
// arrives the worker mixes it in: local = a local + (1 - a) global.
//
//   step:         1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16
//   fragment 0:   .  .  .  .  .  .  .  *  .  .  .  .  .  .  .  *
//   fragment 1:   .  .  .  .  .  *  .  .  .  .  .  .  .  *  .  .
//   fragment 2:   .  .  .  *  .  .  .  .  .  .  .  *  .  .  .  .
//   fragment 3:   .  *  .  .  .  .  .  .  .  *  .  .  .  .  .  .
//   (H 8, P 4: fragment p at the steps where step + 2p is a multiple of 8)
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "10_slow_links/compression.h"
#include "common/comm/comm.h"
#include "common/comm/flags.h"
#include "common/model/adamw.h"
#include "common/model/model.h"
#include "common/train/cli.h"
#include "common/tensor/memory.h"

namespace course {

// Chapter 10's own flags.
struct SlowLinkFlags {
  std::string algorithm = "diloco";      // --algorithm ddp|diloco
  int inner_steps = 10;                  // --inner-steps: H, inner steps between outer steps
  int fragments = 1;                     // --fragments: P (streaming DiLoCo when > 1)
  int overlap_steps = 0;                 // --overlap-steps: tau, inner steps a fragment's average travels
  float mixing = 0.5f;                   // --mixing: a, the local share when an overlapped fragment arrives
  float outer_lr = 0.7f;                 // --outer-lr
  float outer_momentum = 0.9f;           // --outer-momentum (Nesterov; 0 = plain SGD)
  std::string inner_optimizer = "adamw";  // --inner-optimizer adamw|sgd
  std::string compression = "none";      // --grad-compression none|bf16|int8
  bool no_error_feedback = false;        // --no-error-feedback
  bool fault_tolerant = false;           // --fault-tolerant: a quorum per outer step (fault_tolerance.h)
  float quorum_timeout = 5.0f;           // --quorum-timeout: seconds a quorum waits for missing workers
  std::string init_from;                 // --init-from: a whole-model checkpoint's weights and step to start at
};
void add_slow_link_flags(ArgParser& parser, SlowLinkFlags& flags);
// The rules between them and the run (H >= 1, P divides the layers, ...): FlagError.
void validate_slow_link_flags(const SlowLinkFlags& flags, const TrainOptions& options, const CommOptions& comm);

// "ddp", "diloco H10", "diloco H50 P2 int8", "diloco H10 fault-tolerant": a run's name in the report
std::string variant_name(const SlowLinkFlags& flags);

// The optimizer of every step: DDP's, or DiLoCo's inner one. AdamW, as in every
// chapter, or plain SGD (--inner-optimizer sgd: params -= lr grads), with which DiLoCo
// at H 1 and an outer SGD at lr 1 is exactly DDP with SGD. On the model's device.
class InnerOptimizer {
 public:
  InnerOptimizer(const std::string& kind, const AdamWConfig& config, size_t count, Device device);
  void update(float* params, const float* grads, int step);
  AdamW* adamw() { return adamw_.get(); }  // its moments, for a checkpoint; nullptr for SGD

 private:
  std::unique_ptr<AdamW> adamw_;
  float lr_;
  size_t count_;
  Device device_;
};

// [begin, end) of the flat parameter buffer for each of P fragments (see above)
struct Fragment {
  size_t begin = 0;
  size_t end = 0;
};
std::vector<Fragment> cut_fragments(const GPT& model, int fragments);
// whether fragment p starts its sync after inner step `step` (counting from 1)
bool fragment_due(int fragment, int fragments, int inner_steps, int step);

// The outer loop: the global weights, the outer optimizer's momentum, the pseudo-
// gradients in flight, on the model's device (where the worker's weights are: the outer
// step reads and writes both). Collective over the workers' communicator.
class DiLoCo {
 public:
  // workers: nullptr when the caller moves the averages itself (fault_tolerance.h)
  DiLoCo(Comm* workers, const GPT& model, const SlowLinkFlags& flags);

  // After inner step `step`: starts the sync of every fragment due at it, and
  // finishes those whose average is due: the outer step on the global weights, then
  // the worker's copy replaced (or mixed) by them. `drain`: finish every sync in
  // flight now (before a checkpoint, which holds no messages on their way).
  void after_inner_step(float* local_params, int step, bool drain);

  // The worker's weights were replaced before the first step (--init-from): so is the outer model.
  void start_from(const float* params);

  // The pieces of a sync, for a caller that moves the averages itself (fault_tolerance.h):
  // delta = global - local over fragment p, and the outer step with the workers'
  // average of it, after which the worker's copy is replaced (or mixed) by the result.
  void pseudo_gradient(int fragment, const float* local_params, float* delta) const;
  void outer_step(int fragment, const float* average_delta, float* local_params);

  // How many fragment syncs so far, and the bytes they sent by the formula.
  int syncs() const { return syncs_; }
  uint64_t formula_bytes_sent() const { return formula_bytes_sent_; }
  // One sync of fragment p, by the formula: a ring all-reduce of its floats, or the
  // compressed average's two exchanges.
  uint64_t formula_bytes(int fragment) const;
  const std::vector<Fragment>& fragments() const { return fragments_; }
  Device device() const { return device_; }  // where the buffers below are

  Buffer global;    // (P)  the outer model: what the workers' averages built, the same on every worker
  Buffer momentum;  // (P)  the outer optimizer's Nesterov momentum
  Buffer delta;     // (P)  the pseudo-gradients on their way: global - local, averaged in place
  // what error feedback carries, per fragment (empty without compression or feedback)
  std::vector<std::unique_ptr<CompressedAverage>> compressed;

 private:
  struct InFlight {
    int fragment;
    int arrives_after_step;  // the inner step after which it is applied
    Work work;               // the all-reduce (none: already done when compressed)
  };
  void start_sync(int fragment, const float* local_params, int step);
  void finish_sync(InFlight& sync, float* local_params);

  Comm* workers_;
  Device device_;
  SlowLinkFlags flags_;
  Compression compression_;
  std::vector<Fragment> fragments_;
  std::vector<InFlight> in_flight_;
  int syncs_ = 0;
  uint64_t formula_bytes_sent_ = 0;
};

}  // namespace course
