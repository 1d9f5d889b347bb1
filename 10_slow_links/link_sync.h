// What a worker sends over the link, and when: chapter 10's ways of talking less
// behind the three places a step calls them, so that the trainer's step reads the same
// whichever runs:
//
//   during the last backward   backward_hook      DDP's buckets (chapter 02), in fp32
//   before the optimizer step  average_gradients  DDP: the gradients averaged (or compressed)
//   after it                   after_update       DiLoCo: the fragments due, the outer step
//                                                 (fault tolerant: the quorum's)
//
// It also owns what these carry between steps (the outer model and its momentum, error
// feedback's residuals), so it saves and resumes them, and counts what they sent.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "02_ddp/ddp.h"
#include "10_slow_links/compression.h"
#include "10_slow_links/diloco.h"
#include "10_slow_links/fault_tolerance.h"
#include "10_slow_links/worker_state.h"
#include "common/model/adamw.h"
#include "common/model/model.h"
#include "common/train/trainer.h"

namespace course {

class LinkSync {
 public:
  // adamw: the inner optimizer, whose moments a checkpoint holds (nullptr: SGD)
  LinkSync(Run& run, GPT& model, AdamW* adamw, const SlowLinkFlags& flags, const DDPFlags& ddp_flags,
           const CommOptions& comm_options);

  // rank 0, under the run header: what crosses the link, and when
  void print_plan() const;

  // The step to continue at: 1; a checkpoint's next step (--resume, every worker its
  // own file); --init-from's step + 1; or, for a fault-tolerant worker the launcher
  // restarted, the step after the others' at the outer step it joins.
  int resume();
  void save(int step);

  std::function<void(int)> backward_hook(bool last_micro_batch);
  // DDP: every worker's gradients become their average, and `meters` learns how long
  // the step waited for it (DiLoCo: nothing is sent)
  void average_gradients(StepMeters& meters);
  // DiLoCo: after inner step `step`'s update
  void after_update(int step);

  // After the last step: DiLoCo's model is the outer one, copied into the worker's
  // weights; the workers' models checked equal; the summary's fields, the eval loss
  // with them (the final model's mean loss on 16 global batches no step trained on,
  // the sampler's steps 10^6 + 1 to 16, each worker its `rows` of them, averaged over
  // the workers: one number to hold every variant to).
  JsonLine finish(RowSlice rows);
  // rank 0, after the summary: the eval loss, and what the averages sent against the formula
  void print_conclusion() const;
  // what the averages sent so far (no loss crosses the link: the trainer's step says why)
  OpStats traffic() const;

 private:
  uint64_t formula_bytes_sent() const;  // the same, by the formulas
  // this worker's loss of the final model on 16 batches no step trained on
  float eval_loss(RowSlice rows);
  int start_from_checkpoint();          // --init-from
  std::vector<StateSection> state_sections();
  std::vector<std::pair<std::string, int>> state_meta() const;

  Run& run_;
  GPT& model_;
  AdamW* adamw_;
  const SlowLinkFlags flags_;
  std::unique_ptr<DDP> ddp_;                                 // --algorithm ddp, fp32: chapter 02's buckets
  std::unique_ptr<CompressedAverage> compressed_;            // --algorithm ddp, bf16 or int8
  std::unique_ptr<DiLoCo> diloco_;                           // --algorithm diloco
  std::unique_ptr<FaultTolerantOuterLoop> fault_tolerant_;  // --fault-tolerant: DiLoCo's averages, by quorum
  int steps_run_ = 0;      // by this process (a resumed run counts from its first step)
  OpStats sent_by_steps_;  // traffic() after the last of them (the summary's checks send a little more)
  float final_eval_loss_ = 0.0f;
};

}  // namespace course
