// DiLoCo and streaming DiLoCo (diloco.h).
#include "10_slow_links/diloco.h"

#include <algorithm>

#include "10_slow_links/link_ops.h"
#include "common/comm/ring_volume.h"
#include "common/tensor/device.h"
#include "common/tensor/error.h"

namespace course {

void add_slow_link_flags(ArgParser& parser, SlowLinkFlags& flags) {
  parser.add_choice("--algorithm", &flags.algorithm, {"ddp", "diloco"},
                    "ddp: gradients averaged every step; diloco: weights averaged every --inner-steps");
  parser.add_int("--inner-steps", &flags.inner_steps, 1, "DiLoCo's H: inner steps between two outer steps");
  parser.add_int("--fragments", &flags.fragments, 1, "streaming DiLoCo's P: fragments synced on staggered steps");
  parser.add_int("--overlap-steps", &flags.overlap_steps, 0,
                 "streaming DiLoCo's tau: inner steps a fragment's average travels before it is mixed in");
  parser.add_float("--mixing", &flags.mixing, 0.0f, false,
                   "the local weights' share when an overlapped fragment arrives (0 = take the global ones)");
  parser.add_float("--outer-lr", &flags.outer_lr, 0.0f, true, "the outer optimizer's learning rate");
  parser.add_float("--outer-momentum", &flags.outer_momentum, 0.0f, false,
                   "the outer optimizer's Nesterov momentum (0 = plain SGD)");
  parser.add_choice("--inner-optimizer", &flags.inner_optimizer, {"adamw", "sgd"},
                    "the optimizer of every step (DDP's, DiLoCo's inner steps); sgd: params -= lr * grads");
  parser.add_choice("--grad-compression", &flags.compression, {"none", "bf16", "int8"},
                    "what the averages send: fp32, bf16, or int8 with a scale per 256 values");
  parser.add_switch("--no-error-feedback", &flags.no_error_feedback,
                    "drop what compression rounds away instead of carrying it to the next message");
  parser.add_switch("--fault-tolerant", &flags.fault_tolerant,
                    "DiLoCo whose workers may die and rejoin: a quorum of the live ones at each outer step "
                    "(launch with --restart-policy worker)");
  parser.add_string("--init-from", &flags.init_from,
                    "start from the weights and step of this whole-model checkpoint (chapter 00's or 02's file), "
                    "with fresh optimizer state: DiLoCo as its paper runs it, from a pretrained model");
  parser.add_float("--quorum-timeout", &flags.quorum_timeout, 0.0f, true,
                   "seconds an outer step's quorum waits for missing workers before going on without them");
}

void validate_slow_link_flags(const SlowLinkFlags& flags, const TrainOptions& options, const CommOptions& comm) {
  const GPTConfig& model = options.model;
  const bool diloco = flags.algorithm == "diloco";
  const auto given = [&](const char* flag) { return options.given.count(flag) > 0; };
  if (!diloco && (given("--fragments") || given("--overlap-steps"))) {
    throw FlagError("--fragments and --overlap-steps are streaming DiLoCo's (hint: add --algorithm diloco)");
  }
  if (!diloco && (given("--inner-steps") || given("--outer-lr") || given("--outer-momentum") || given("--mixing"))) {
    throw FlagError("--inner-steps, --outer-lr, --outer-momentum and --mixing shape DiLoCo's outer steps, and "
                    "--algorithm ddp has none: it averages the gradients of every step (hint: --algorithm diloco, "
                    "or leave them out)");
  }
  if (flags.overlap_steps == 0 && given("--mixing")) {
    throw FlagError("--mixing weighs an overlapped fragment's arrival, and this run overlaps none (hint: add "
                    "--overlap-steps, or leave it out)");
  }
  if (!flags.fault_tolerant && given("--quorum-timeout")) {
    throw FlagError("--quorum-timeout is the wait of --fault-tolerant's quorums, and this run has none (hint: add "
                    "--fault-tolerant, or leave it out)");
  }
  if (model.n_layer % flags.fragments != 0) {
    throw FlagError("--fragments " + std::to_string(flags.fragments) + " does not divide the " +
                    std::to_string(model.n_layer) + " layers: a fragment is a run of whole blocks (hint: --fragments " +
                    "1, or a divisor of --layers)");
  }
  if (flags.overlap_steps >= flags.inner_steps) {
    throw FlagError("--overlap-steps " + std::to_string(flags.overlap_steps) + " must be below --inner-steps " +
                    std::to_string(flags.inner_steps) + ": a fragment's average must arrive before its next sync");
  }
  if (flags.mixing >= 1.0f) throw FlagError("--mixing must be below 1: at 1 the global weights are never taken");
  if (flags.overlap_steps > 0 && flags.compression != "none") {
    throw FlagError("--overlap-steps needs --grad-compression none: the compressed average is two exchanges with a "
                    "sum between them, run in the step, not on the communication thread");
  }
  if (flags.fault_tolerant) {
    if (!diloco || flags.fragments != 1 || flags.compression != "none") {
      throw FlagError("--fault-tolerant is DiLoCo's, with one fragment and fp32 averages (hint: --algorithm diloco, "
                      "no --fragments or --grad-compression)");
    }
    if (!options.checkpoint_dir.empty()) {
      throw FlagError("--fault-tolerant with --checkpoint-dir: a restarted worker takes the global weights from the "
                      "others, not from a file (hint: leave out --checkpoint-dir)");
    }
    if (comm.backend != "auto" && comm.backend != "tcp") {
      throw FlagError("--fault-tolerant makes a tcp group per outer step (hint: --backend tcp)");
    }
  }
  if (!flags.init_from.empty() && options.resume) {
    throw FlagError("--init-from and --resume: a run starts from one of them (hint: --resume alone continues it)");
  }
  if (flags.no_error_feedback && flags.compression == "none") {
    throw FlagError("--no-error-feedback with --grad-compression none: nothing is rounded away (hint: bf16 or int8)");
  }
}

std::string variant_name(const SlowLinkFlags& flags) {
  std::string name = flags.algorithm == "diloco" ? "diloco H" + std::to_string(flags.inner_steps) : "ddp";
  if (flags.fragments > 1) name += " P" + std::to_string(flags.fragments);
  if (flags.compression != "none") name += " " + flags.compression;
  if (flags.fault_tolerant) name += " fault-tolerant";
  return name;
}

InnerOptimizer::InnerOptimizer(const std::string& kind, const AdamWConfig& config, size_t count, Device device)
    : adamw_(kind == "adamw" ? std::make_unique<AdamW>(config, count, device) : nullptr),
      lr_(config.lr),
      count_(count),
      device_(device) {}

void InnerOptimizer::update(float* params, const float* grads, int step) {
  if (adamw_) {
    adamw_->update(params, grads, step);
    return;
  }
  // p -= lr * g
  link_ops_for(device_).sgd_update(params, grads, static_cast<int64_t>(count_), lr_);
}

std::vector<Fragment> cut_fragments(const GPT& model, int fragments) {
  const int L = model.config().n_layer;
  const size_t total = model.params.size();
  std::vector<Fragment> cut(fragments);
  for (int p = 0; p < fragments; p++) {
    // stage 1 + l is block l; the embedding (stage 0) goes with the first, the head with the last
    cut[p].begin = p == 0 ? 0 : model.stage_offset(1 + p * L / fragments);
    cut[p].end = p == fragments - 1 ? total : model.stage_offset(1 + (p + 1) * L / fragments);
  }
  return cut;
}

bool fragment_due(int fragment, int fragments, int inner_steps, int step) {
  return (step + fragment * inner_steps / fragments) % inner_steps == 0;
}

DiLoCo::DiLoCo(Comm* workers, const GPT& model, const SlowLinkFlags& flags)
    : global(model.params.size(), MemCategory::OptimizerState, model.device()),
      momentum(model.params.size(), MemCategory::OptimizerState, model.device()),
      delta(model.params.size(), MemCategory::CommBuffers, model.device()),
      workers_(workers),
      device_(model.device()),
      flags_(flags),
      compression_(parse_compression(flags.compression)),
      fragments_(cut_fragments(model, flags.fragments)) {
  start_from(model.params.data());
  if (compression_ != Compression::None) {
    for (const Fragment& fragment : fragments_) {
      compressed.push_back(std::make_unique<CompressedAverage>(*workers, compression_, fragment.end - fragment.begin,
                                                               !flags.no_error_feedback, device_));
    }
  }
}

void DiLoCo::after_inner_step(float* local_params, int step, bool drain) {
  const int P = static_cast<int>(fragments_.size());
  for (int p = 0; p < P; p++) {
    if (fragment_due(p, P, flags_.inner_steps, step)) start_sync(p, local_params, step);
  }
  for (auto sync = in_flight_.begin(); sync != in_flight_.end();) {
    if (drain || sync->arrives_after_step <= step) {
      finish_sync(*sync, local_params);
      sync = in_flight_.erase(sync);
    } else {
      ++sync;
    }
  }
}

void DiLoCo::start_from(const float* params) {
  copy_bytes(global.data(), device_, params, device_, global.bytes());
  momentum.zero();
}

void DiLoCo::pseudo_gradient(int fragment, const float* local_params, float* delta) const {
  const Fragment& f = fragments_[fragment];
  // delta = global - local: how far this worker moved since the last sync
  link_ops_for(device_).difference(delta, global.data() + f.begin, local_params + f.begin,
                                   static_cast<int64_t>(f.end - f.begin));
}

void DiLoCo::outer_step(int fragment, const float* average_delta, float* local_params) {
  const Fragment& f = fragments_[fragment];
  // overlapped: the worker moved on while the average travelled, and keeps a share of that
  const float keep = flags_.overlap_steps > 0 ? flags_.mixing : 0.0f;
  // Nesterov: m = mu m + delta;  global -= lr (delta + mu m);
  // local = a local + (1 - a) global  (a = 0: every worker restarts from the global weights)
  link_ops_for(device_).outer_step(global.data() + f.begin, momentum.data() + f.begin, local_params + f.begin,
                                   average_delta, static_cast<int64_t>(f.end - f.begin), flags_.outer_lr,
                                   flags_.outer_momentum, keep);
  syncs_++;
}

void DiLoCo::start_sync(int fragment, const float* local_params, int step) {
  const Fragment& f = fragments_[fragment];
  float* fragment_delta = delta.data() + f.begin;
  pseudo_gradient(fragment, local_params, fragment_delta);
  InFlight sync{fragment, step + flags_.overlap_steps, Work()};
  if (compression_ != Compression::None) {
    compressed[fragment]->average(fragment_delta);
  } else {
    sync.work = workers_->all_reduce_async(fragment_delta, f.end - f.begin, ReduceOp::Average);
  }
  in_flight_.push_back(std::move(sync));
  formula_bytes_sent_ += formula_bytes(fragment);
}

void DiLoCo::finish_sync(InFlight& sync, float* local_params) {
  sync.work.wait();  // (compressed: already done in start_sync, and this returns at once)
  outer_step(sync.fragment, delta.data() + fragments_[sync.fragment].begin, local_params);
}

uint64_t DiLoCo::formula_bytes(int fragment) const {
  if (compression_ != Compression::None) return compressed[fragment]->formula_bytes();
  const size_t count = fragments_[fragment].end - fragments_[fragment].begin;
  return workers_ ? ring_all_reduce_bytes(count * sizeof(float), workers_->size()) : 0;
}

}  // namespace course
