// The program every rank runs in the expert-parallel tests: chapter 09's ExpertParallel
// on this rank's rows of a batch and its slice of the experts, checked against moe.h's
// layer over the whole batch with every expert, computed on every rank from the same
// inputs (chapter 00's one process).
//
//   ep_worker [--backend auto|tcp|mpi] [--comm-timeout S] [--experts E] [--top-k k]
//             [--capacity-factor F] [the trainers' other model flags]
//
// The world is the ep group. The model flags are the trainers', refused as theirs (exit
// 2, one message), and E must divide over the ranks. Checks, for 2 sequences per rank
// and then 1 (the layer's buffers are made once), as a trainer would see them: this
// rank's loss is the mean over its own tokens, so its dout is R x the reference's rows.
// - out equals the reference's rows of this rank;
// - dx equals R x the reference's rows;
// - the router gradient averaged over the ranks (DDP) equals the reference's;
// - this rank's experts' gradients / R (average_expert_gradients) equal the reference's;
// - the aux loss (1e-5 relative), the dropped choices and the tokens per expert equal
//   the reference's; a capacity factor above 0 must drop some (the case tests drops);
// - the all-to-alls' bytes sent and received in forward, and in backward, equal
//   expert_parallel_bytes of the kept counts the reference's rows give, and the
//   layer's counters say the same.
// And a whole GPT step (2 blocks, 2 sequences per rank): the model with this rank's
// experts and the ExpertParallel layer plugged in, DDP over the replicated gradients
// (not the experts'), average_expert_gradients, against chapter 00's GPT on the global
// batch: the loss averaged over the ranks, the routing (aux loss, dropped) and every
// gradient, each of this rank's parameters found in chapter 00's by
// expert_parallel_pieces; the initial parameters are chapter 00's.
// Bound: 1e-5 of the largest magnitude of the reference's tensor (the loss: relative).
// Prints "rank R: all checks passed (...)".
#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "09_expert_parallel/expert_parallel.h"
#include "02_ddp/ddp.h"
#include "common/train/checkpoint_manifest.h"
#include "common/train/cli.h"
#include "common/comm/comm.h"
#include "common/train/meters.h"
#include "common/model/moe.h"
#include "support/forward_loss.h"
#include "support/random.h"
#include "support/worker_checks.h"

using namespace course;
using course_test::forward_loss;
using course_test::random_floats;
using course_test::random_ints;
using course_test::WorkerChecks;

namespace {

const float kDaux = 0.5f;

// An MoE layer's parameters for `experts` experts (or their gradients)
struct MoeParams {
  MoeParams(const GPTConfig& config, int experts)
      : router_w(static_cast<size_t>(config.n_experts) * config.d_model),
        fc_w(static_cast<size_t>(experts) * 4 * config.d_model * config.d_model),
        fc_b(static_cast<size_t>(experts) * 4 * config.d_model),
        fcproj_w(fc_w.size()),
        fcproj_b(static_cast<size_t>(experts) * config.d_model) {}
  MoeWeights view() { return {router_w.data(), fc_w.data(), fc_b.data(), fcproj_w.data(), fcproj_b.data()}; }
  std::vector<float*> experts() { return {fc_w.data(), fc_b.data(), fcproj_w.data(), fcproj_b.data()}; }
  std::vector<std::vector<float>*> all() { return {&router_w, &fc_w, &fc_b, &fcproj_w, &fcproj_b}; }
  std::vector<float> router_w;  // (E, C)
  std::vector<float> fc_w;      // (experts, 4C, C)
  std::vector<float> fc_b;      // (experts, 4C)
  std::vector<float> fcproj_w;  // (experts, C, 4C)
  std::vector<float> fcproj_b;  // (experts, C)
};

// every expert; a router sharp enough (std 4 logits) that the experts' loads differ
MoeParams random_params(const GPTConfig& config) {
  MoeParams p(config, config.n_experts);
  const double scales[5] = {1.0, 0.25, 0.1, 0.25, 0.1};
  std::vector<std::vector<float>*> all = p.all();
  for (size_t i = 0; i < all.size(); i++) *all[i] = random_floats(7, all[i]->size(), 10 + i, scales[i]);
  return p;
}

// the router, and experts [first, first + count): row blocks of the stacked tensors
MoeParams expert_slice(MoeParams& whole, const GPTConfig& config) {
  const int first = config.expert_first, count = config.local_experts();
  MoeParams slice(config, count);
  slice.router_w = whole.router_w;
  std::vector<std::vector<float>*> from = whole.all(), to = slice.all();
  for (size_t i = 1; i < from.size(); i++) {
    const size_t per_expert = from[i]->size() / config.n_experts;
    std::copy(from[i]->begin() + first * per_expert, from[i]->begin() + (first + count) * per_expert,
              to[i]->begin());
  }
  return slice;
}

// rows [first, first + count) of a (rows, width) array, times `scale`
std::vector<float> rows_of(const std::vector<float>& whole, size_t first, size_t count, size_t width, float scale) {
  std::vector<float> part(whole.begin() + first * width, whole.begin() + (first + count) * width);
  for (float& value : part) value *= scale;
  return part;
}

// moe.h's layer over all ranks' tokens, every expert, in one process
struct Reference {
  std::vector<float> x, dout, out, dx;  // (R N, C) each
  MoeParams grads;
  float aux_loss = 0.0f;
  int dropped = 0;
  std::vector<int64_t> routed;  // (E)
  std::vector<int> kept;        // (R, E) kept choices of each rank's tokens for each expert
};

Reference reference(const GPTConfig& config, MoeParams& w, int ranks, int B) {
  const int N = B * config.seq_len, C = config.d_model, E = config.n_experts, k = config.top_k;
  const MoeSizes s{ranks * N, C, E, k, moe_capacity(config.capacity_factor, ranks * N, E, k)};
  Reference ref{random_floats(8, static_cast<size_t>(s.tokens) * C, 1, 1.0),
                random_floats(8, static_cast<size_t>(s.tokens) * C, 2, 1.0),
                std::vector<float>(static_cast<size_t>(s.tokens) * C),
                std::vector<float>(static_cast<size_t>(s.tokens) * C, 0.0f),
                MoeParams(config, E), 0.0f, 0, {}, {}};
  std::vector<float> saved(MoeActivations::floats(s)), scratch_storage(MoeScratch::floats(s));
  Carver carve_saved(saved.data()), carve_scratch(scratch_storage.data());
  MoeActivations a;
  a.carve(carve_saved, s);
  MoeScratch scratch;
  scratch.carve(carve_scratch, s);
  moe_forward(ref.out.data(), ref.x.data(), w.view(), a, s, Device::CPU);
  moe_backward(ref.dx.data(), ref.grads.view(), scratch, ref.dout.data(), kDaux, ref.x.data(), w.view(), a, s,
               Device::CPU);
  ref.aux_loss = a.aux_loss;
  ref.dropped = a.dropped;
  ref.routed.assign(a.routed, a.routed + E);
  ref.kept.assign(static_cast<size_t>(ranks) * E, 0);
  for (int i = 0; i < s.rows(); i++) {
    if (a.row[i] >= 0) ref.kept[static_cast<size_t>(i / k / N) * E + a.expert[i]]++;
  }
  return ref;
}

void check_bytes(WorkerChecks& check, const std::string& pass, const OpStats& stats, uint64_t formula) {
  check.equal(pass + " all_to_all bytes sent", static_cast<long long>(stats.bytes_sent),
              static_cast<long long>(formula));
  check.equal(pass + " all_to_all bytes received", static_cast<long long>(stats.bytes_received),
              static_cast<long long>(formula));
}

void check_pass(WorkerChecks& check, Comm& ep, ExpertParallel& layer, const GPTConfig& config, int B) {
  const int R = ep.size(), r = ep.rank(), N = B * config.seq_len, C = config.d_model;
  const std::string name = "B " + std::to_string(B) + ": ";
  MoeParams whole = random_params(config);
  Reference ref = reference(config, whole, R, B);
  MoeParams mine = expert_slice(whole, config), grads(config, config.local_experts());
  const std::vector<float> x = rows_of(ref.x, static_cast<size_t>(r) * N, N, C, 1.0f),
                           dout = rows_of(ref.dout, static_cast<size_t>(r) * N, N, C, static_cast<float>(R));
  std::vector<float> out(x.size()), dx(x.size(), 0.0f), saved(layer.saved_floats(B)),
      scratch(layer.scratch_floats(B));
  layer.reset_counters();
  ep.reset_stats();
  layer.forward(out.data(), saved.data(), x.data(), mine.view(), B);
  const OpStats forward = op_stats(ep, "all_to_all");
  ep.reset_stats();
  layer.backward(dx.data(), grads.view(), scratch.data(), dout.data(), kDaux, x.data(), mine.view(), saved.data(), B);
  const OpStats backward = op_stats(ep, "all_to_all");

  check.close(name + "out", out, rows_of(ref.out, static_cast<size_t>(r) * N, N, C, 1.0f));
  check.close(name + "dx", dx, rows_of(ref.dx, static_cast<size_t>(r) * N, N, C, static_cast<float>(R)));
  ep.all_reduce(grads.router_w.data(), grads.router_w.size(), ReduceOp::Average);
  check.close(name + "router gradient, averaged over the ranks", grads.router_w, ref.grads.router_w);
  MoeParams expected = expert_slice(ref.grads, config);
  const char* names[5] = {"router_w", "expert_fc_w", "expert_fc_b", "expert_fcproj_w", "expert_fcproj_b"};
  std::vector<std::vector<float>*> got = grads.all();
  for (size_t i = 1; i < got.size(); i++) {
    for (float& value : *got[i]) value /= static_cast<float>(R);
    check.close(name + names[i] + " gradient / R", *got[i], *expected.all()[i]);
  }
  check.relative(name + "aux loss", layer.last_aux_loss(), ref.aux_loss);
  check.equal(name + "dropped", layer.last_dropped(), ref.dropped);
  if (config.capacity_factor > 0.0f && ref.dropped == 0) check.fail(name + "the capacity drops nothing here");
  for (int e = 0; e < config.n_experts; e++) {
    check.equal(name + "tokens of expert " + std::to_string(e), layer.counters().tokens_per_expert[e], ref.routed[e]);
  }
  const uint64_t formula = expert_parallel_bytes(ref.kept, R, r, C).forward();
  check_bytes(check, name + "forward", forward, formula);
  check_bytes(check, name + "backward", backward, formula);
  check_bytes(check, name + "the layer's counters", layer.counters().all_to_all, 2 * formula);
  check.equal(name + "the layer's formula bytes", static_cast<long long>(layer.counters().formula_bytes),
              static_cast<long long>(2 * formula));
}

// chapter 00's flat buffer's elements at this rank's pieces (its layout's order)
std::vector<float> pieces_of(const std::vector<float>& whole, const GPTConfig& whole_config,
                             const GPTConfig& rank_config) {
  std::map<std::string, size_t> offset;
  for (const ManifestParam& param : manifest_params(whole_config)) offset[param.name] = param.offset;
  std::vector<float> mine;
  for (const ManifestPiece& piece : expert_parallel_pieces(rank_config)) {
    const auto first = whole.begin() + static_cast<std::ptrdiff_t>(offset.at(piece.param) + piece.first);
    mine.insert(mine.end(), first, first + static_cast<std::ptrdiff_t>(piece.count));
  }
  return mine;
}

void check_gpt(WorkerChecks& check, Comm& ep, GPTConfig config) {
  const int R = ep.size(), B = 2, T = config.seq_len;
  const uint64_t seed = 5;
  config.vocab_size = 32;
  config.n_layer = 2;
  config.n_head = 2;
  const std::vector<int> tokens = random_ints(9, static_cast<size_t>(R) * B * (T + 1), 1, 32);
  std::vector<int> inputs, targets;  // (R B, T) each: sequence s is tokens[s (T+1) ..], shifted by one
  for (int sequence = 0; sequence < R * B; sequence++) {
    const auto first = tokens.begin() + sequence * (T + 1);
    inputs.insert(inputs.end(), first, first + T);
    targets.insert(targets.end(), first + 1, first + T + 1);
  }
  RoutingStats whole_routing, ep_routing;
  GPT whole(config, R * B, seed, Device::CPU, &whole_routing);
  const float whole_loss = forward_loss(whole, Device::CPU, inputs.data(), targets.data());
  whole.backward(1.0f / (static_cast<float>(R * B) * T));

  const GPTConfig mine = expert_parallel_config(config, R, ep.rank());
  ExpertParallel layer(mine, ep, B, Device::CPU);
  layer.set_routing(&ep_routing);
  GPT model(mine, B, seed, Device::CPU, nullptr, GPTPlugins{{}, nullptr, &layer});
  const std::vector<float> whole_params(whole.params.data(), whole.params.data() + whole.params.size());
  const std::vector<float> params(model.params.data(), model.params.data() + model.params.size());
  check.close("GPT: initial parameters", params, pieces_of(whole_params, config, mine));
  const size_t first = static_cast<size_t>(ep.rank()) * B * T;
  float loss = forward_loss(model, Device::CPU, inputs.data() + first, targets.data() + first);
  model.backward(1.0f / (static_cast<float>(B) * T));
  DDP ddp(ep, model, /*bucket_mb=*/0.01, /*overlap=*/false, expert_ranges(model));
  ddp.synchronize_gradients();
  average_expert_gradients(model, R);
  ep.all_reduce(&loss, 1, ReduceOp::Average);

  check.relative("GPT: loss averaged over the ranks", loss, whole_loss);
  check.relative("GPT: aux loss", ep_routing.aux_loss(), whole_routing.aux_loss());
  check.equal("GPT: dropped", ep_routing.dropped, whole_routing.dropped);
  if (config.capacity_factor > 0.0f && whole_routing.dropped == 0) check.fail("GPT: the capacity drops nothing here");
  const std::vector<float> whole_grads(whole.grads.data(), whole.grads.data() + whole.grads.size());
  const std::vector<float> expected = pieces_of(whole_grads, config, mine);
  for (int stage = 0; stage < static_cast<int>(model.layout().size()); stage++) {
    for (const ParamSpec& spec : model.layout()[stage].params) {
      const size_t at = model.stage_offset(stage) + spec.offset;
      check.close("GPT: " + spec.name + " gradient",
                  std::vector<float>(model.grads.data() + at, model.grads.data() + at + spec.numel),
                  std::vector<float>(expected.begin() + at, expected.begin() + at + spec.numel));
    }
  }
}

int run(int argc, char** argv) {
  CommOptions comm_options;
  TrainOptions options;
  options.model.seq_len = 8;
  options.model.d_model = 16;
  options.model.n_layer = 1;
  options.model.n_experts = 4;
  ArgParser parser("ep_worker", "Checks chapter 09's expert-parallel layer against moe.h's (the ep tests' worker).");
  add_comm_flags(parser, comm_options);
  add_common_flags(parser, options);
  parser.parse(argc, argv);
  validate_flags(options);
  std::unique_ptr<Comm> ep = create_world_comm(read_launch_env(), comm_options);
  const GPTConfig config = expert_parallel_config(options.model, ep->size(), ep->rank());
  WorkerChecks check(ep->rank());
  ExpertParallel layer(config, *ep, /*micro_batch=*/2, Device::CPU);
  check_pass(check, *ep, layer, config, 2);
  check_pass(check, *ep, layer, config, 1);
  check_gpt(check, *ep, options.model);
  ep->barrier();
  char what[120];
  std::snprintf(what, sizeof(what), "(%s, %d ranks, E %d, top-%d, capacity factor %g, %d of %d choices dropped)",
                ep->backend().c_str(), ep->size(), config.n_experts, config.top_k, config.capacity_factor,
                layer.last_dropped(), ep->size() * config.seq_len * config.top_k);
  return check.finish(what);
}

}  // namespace

int main(int argc, char** argv) {
  return guarded_main("ep_worker", [&] { return run(argc, argv); });
}
