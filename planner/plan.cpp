// The planner's program: every layout chapter 07 can run for a model on a cluster,
// ranked, with the memory each device needs and what each axis sends (planner.h);
// on more than one node, the links each grid order puts each axis on. --with-cp adds
// chapter 08's dp x cp layouts (context parallelism) to the ranking.
//
//   ./build/bin/07_plan --model gpt2-1.5b --nodes 4        (4 nodes of 8 H100s)
//   ./build/bin/07_plan --layers 4 --d-model 128 --heads 4 --seq 128 --batch 8
//       --devices-per-node 8 --memory-gb 24 --precision fp32 --intra-gbps 5 --tflops 0.2
//   ./build/bin/07_plan ... --layout 2x2x2       (one layout: every pipeline rank's figures)
//   ./build/bin/07_plan ... --layout 2x1x1 --cp 4 --cp-mode a2a     (chapter 08's dp 2 x cp 4)
#include <cstdio>
#include <string>
#include <vector>

#include "planner/planner.h"
#include "common/train/cli.h"
#include "common/tensor/error.h"
#include "common/train/metrics.h"

using namespace course;

// The models of the README's tables. GPT-2's vocabulary is padded to a multiple
// of 64 (50304, as Megatron-LM and nanoGPT do) so that TP can split it; the
// "Llama-style" ones are this course's GPT blocks at Llama 3's shapes.
struct NamedModel {
  const char* name;
  GPTConfig config;  // vocab, seq, layers, d-model, heads
  int batch, micro_batches;
};
static const std::vector<NamedModel>& named_models() {
  static const std::vector<NamedModel> models = {
      {"gpt2-124m", {50304, 1024, 12, 768, 12}, 512, 16},
      {"gpt2-1.5b", {50304, 1024, 48, 1600, 25}, 512, 16},
      {"llama-8b", {128256, 8192, 32, 4096, 32}, 512, 32},
      {"llama-70b", {128256, 8192, 80, 8192, 64}, 1024, 64},
  };
  return models;
}

// --layout and the flags that go with it
struct LayoutFlags {
  std::string text;  // --layout DPxPPxTP; empty: rank every layout
  std::string schedule = "1f1b", cp_mode = "ring", cp_split = "zigzag";
  int chunks = 0, zero_stage = 0, cp = 1;
  bool sequence_parallel = false, reshard_after_forward = false;
};
static void add_layout_flags(ArgParser& parser, LayoutFlags& flags) {
  parser.add_string("--layout", &flags.text, "DPxPPxTP: one layout's figures per pipeline rank instead");
  parser.add_choice("--schedule", &flags.schedule, {"gpipe", "1f1b", "interleaved", "zb-h1"}, "with --layout");
  parser.add_int("--virtual-stages", &flags.chunks, 0, "with --layout: chunks per rank; 0 = 2 for interleaved");
  parser.add_int("--zero-stage", &flags.zero_stage, 0, "with --layout: 0 to 3");
  parser.add_switch("--reshard-after-forward", &flags.reshard_after_forward,
                    "with --layout and --zero-stage 3: gather around every forward and backward");
  parser.add_switch("--sp", &flags.sequence_parallel, "with --layout: sequence parallelism");
  parser.add_int("--cp", &flags.cp, 1, "with --layout DPx1x1: chapter 08's ranks per sequence");
  parser.add_choice("--cp-mode", &flags.cp_mode, {"ring", "a2a"}, "with --layout and --cp: chapter 08's attention");
  parser.add_choice("--cp-split", &flags.cp_split, {"contiguous", "zigzag"},
                    "with --layout and --cp: chapter 08's split");
}
static Layout parse_layout(const LayoutFlags& flags) {
  Layout layout;
  if (std::sscanf(flags.text.c_str(), "%dx%dx%d", &layout.dp, &layout.pp, &layout.tp) != 3) {
    throw FlagError("--layout " + flags.text + ": expected DPxPPxTP, e.g. 2x2x2");
  }
  layout.schedule = parse_schedule(flags.schedule);
  layout.chunks = flags.chunks > 0 ? flags.chunks : (layout.schedule == ScheduleKind::Interleaved ? 2 : 1);
  layout.zero_stage = flags.zero_stage;
  layout.reshard_after_forward = flags.reshard_after_forward;
  layout.sequence_parallel = flags.sequence_parallel;
  layout.cp = flags.cp;
  layout.cp_mode = flags.cp_mode == "a2a" ? CPMode::AllToAll : CPMode::Ring;
  layout.cp_split = parse_split_kind(flags.cp_split);
  return layout;
}

// --layout: one layout's figures, a row per pipeline rank (with cp, its one kind of rank,
// whose cp bytes take the pp column: pp is 1)
static void print_pipeline_ranks(const PlanJob& job, const Layout& layout, const Cluster& cluster) {
  const LayoutPlan p = plan_layout(job, layout, cluster);  // the trainer's error for one it cannot run
  const bool cp = layout.cp > 1;
  std::printf("  %-4s %10s %10s %10s %10s %10s %10s %10s %10s %10s\n", "pp", "params", "grads", "optimizer",
              "activ.", "lent", "total", "tp/step", cp ? "cp/step" : "pp/step", "dp/step");
  for (int pp = 0; pp < layout.pp; pp++) {
    const RankPlan& r = p.pipeline_ranks[pp];
    std::printf("  %-4d %10s %10s %10s %10s %10s %10s %10s %10s %10s\n", pp, format_bytes(r.parameters).c_str(),
                format_bytes(r.gradients).c_str(), format_bytes(r.optimizer_state).c_str(),
                format_bytes(r.activations).c_str(), format_bytes(r.lent).c_str(), format_bytes(r.memory()).c_str(),
                format_bytes(r.tp_bytes).c_str(), format_bytes(cp ? r.cp_bytes : r.pp_bytes).c_str(),
                format_bytes(r.dp_bytes).c_str());
  }
  std::printf("(lent: ZeRO-2/3's whole gradients and gathered stages at the peak, part of the total)\n");
  std::printf("\nfits: %s; bubble %.1f%%; step %.3f s (compute %.3f s, exposed communication %.3f s)\n",
              p.fits ? "yes" : "no", 100.0 * p.bubble, p.step_seconds, p.compute_seconds, p.exposed_comm_seconds);
}

// every layout of the cluster's devices, ranked, the first `rows` of them
static void print_ranked_layouts(const PlanJob& job, const Cluster& cluster, int rows, bool with_cp) {
  const std::vector<LayoutPlan> plans = plan_all(job, cluster, with_cp);
  if (plans.empty()) throw FlagError("no layout of " + std::to_string(cluster.devices()) + " devices suits this model");
  std::printf("%s", format_plans(plans, static_cast<size_t>(rows)).c_str());
  size_t fitting = 0;
  for (const LayoutPlan& p : plans) fitting += p.fits ? 1 : 0;
  std::printf("\n%zu layouts, %zu fit; memory = the fullest device; activ. = its activations;\n"
              "i2 = interleaved with 2 chunks, zb-h1 = zero bubble, zN = ZeRO-N (z3 = FSDP, z3r: resharded\n"
              "after forward), sp = sequence parallel;\n"
              "NV/IB = the link the axis crosses\n",
              plans.size(), fitting);
  if (with_cp) {
    std::printf("cpN = chapter 08, N ranks per sequence (zigzag ring; a2a: all-to-all): its bytes and link\n"
                "under tp|cp (and tp below); its dp/step is DDP over all dp x cp ranks\n");
  }
  // across nodes, which ranks share a node matters: the same rows in either grid order
  if (cluster.nodes > 1) {
    std::printf("\n%s", format_grid_orders(plans, static_cast<size_t>(rows), job, cluster).c_str());
  }
}

static int plan(int argc, char** argv) {
  // ---- flags -----------------------------------------------------------------
  PlanJob job;
  Cluster cluster;
  LayoutFlags layout_flags;
  std::string model_name = "custom", precision = "bf16-stored";
  int layers = 4, d_model = 128, heads = 4, seq = 128, vocab = 256, rows = 20;
  float memory_gb = 80, intra_gbps = 450, inter_gbps = 50, tflops = 400;
  bool with_cp = false;
  std::vector<std::string> model_names = {"custom"};
  for (const NamedModel& m : named_models()) model_names.push_back(m.name);
  ArgParser parser("07_plan", "Chapter 07's planner: which dp x pp x tp layout, will it fit, what it sends.");
  parser.add_choice("--model", &model_name, model_names,
                    "a named model: its shape, batch and micro-batches replace the custom-model flags");
  parser.add_int("--layers", &layers, 1, "custom model: blocks");
  parser.add_int("--d-model", &d_model, 1, "custom model: width");
  parser.add_int("--heads", &heads, 1, "custom model: attention heads");
  parser.add_int("--seq", &seq, 1, "custom model: sequence length");
  parser.add_int("--vocab", &vocab, 1, "custom model: vocabulary");
  parser.add_int("--batch", &job.global_batch, 1, "custom model: global batch (sequences per step)");
  parser.add_int("--micro-batches", &job.micro_batches, 1, "custom model: micro-batches per pipeline per step");
  float bucket_mb = 25.0f;
  parser.add_float("--bucket-mb", &bucket_mb, 0.0f, true, "DDP gradient bucket size in MB, as chapter 07's flag");
  parser.add_int("--devices-per-node", &cluster.devices_per_node, 1, "devices in a node");
  parser.add_int("--nodes", &cluster.nodes, 1, "nodes");
  parser.add_float("--memory-gb", &memory_gb, 0.0f, true, "device memory, GB (10^9 bytes)");
  parser.add_float("--intra-gbps", &intra_gbps, 0.0f, true, "bandwidth inside a node, GB/s per device");
  parser.add_float("--inter-gbps", &inter_gbps, 0.0f, true, "bandwidth between nodes, GB/s per device");
  parser.add_float("--tflops", &tflops, 0.0f, true, "achieved TFLOP/s per device");
  parser.add_string("--intra-name", &cluster.intra_name, "the link inside a node, as the table names it");
  parser.add_string("--inter-name", &cluster.inter_name, "the link between nodes");
  parser.add_choice("--precision", &precision, {"fp32", "bf16", "bf16-stored"},
                    "fp32 or bf16: the course's trainer at that --dtype (its runs' figures); bf16-stored: a trainer "
                    "that stores bf16 weights, gradients and activations (Megatron-LM's count)");
  parser.add_dtype("--grad-comm-dtype", &job.grad_comm_dtype,
                   "what the dp axis's gradient reductions send, as chapter 07's flag");
  std::string recompute = "none";
  parser.add_choice("--recompute", &recompute, {"none", "selective", "full"},
                    "chapter 07's activation recomputation: selective = attention's T x T part, full = every block");
  parser.add_int("--rows", &rows, 1, "how many layouts to list");
  parser.add_switch("--with-cp", &with_cp, "rank chapter 08's dp x cp layouts (context parallelism) too");
  add_layout_flags(parser, layout_flags);
  parser.parse(argc, argv);

  job.model = {vocab, seq, layers, d_model, heads};
  for (const NamedModel& m : named_models()) {
    if (model_name == m.name) {
      job.model = m.config;
      job.global_batch = m.batch;
      job.micro_batches = m.micro_batches;
    }
  }
  job.bucket_mb = bucket_mb;
  job.recompute = parse_recompute(recompute);
  job.precision = parse_precision(precision);
  cluster.device_memory = memory_gb * 1e9;
  cluster.intra_node_bandwidth = intra_gbps * 1e9;
  cluster.inter_node_bandwidth = inter_gbps * 1e9;
  cluster.device_flops = tflops * 1e12;

  std::printf("model: %d layers, d-model %d, %d heads, seq %d, vocab %d: %.3g parameters\n", job.model.n_layer,
              job.model.d_model, job.model.n_head, job.model.seq_len, job.model.vocab_size,
              static_cast<double>(count_parameters(job.model)));
  std::printf("  batch %d sequences in %d micro-batches per pipeline, %s, recompute %s%s\n", job.global_batch,
              job.micro_batches, precision.c_str(), recompute.c_str(),
              job.grad_comm_dtype == DType::BF16 ? ", dp gradients sent as bf16" : "");
  std::printf("cluster: %d node(s) x %d devices of %g GB, %g TFLOP/s each\n", cluster.nodes,
              cluster.devices_per_node, memory_gb, tflops);
  std::printf("  %g GB/s per device inside a node (%s), %g GB/s between nodes (%s)\n\n", intra_gbps,
              cluster.intra_name.c_str(), inter_gbps, cluster.inter_name.c_str());

  if (!layout_flags.text.empty()) {  // one layout: its pipeline ranks
    print_pipeline_ranks(job, parse_layout(layout_flags), cluster);
  } else {
    print_ranked_layouts(job, cluster, rows, with_cp);
  }
  return 0;
}

int main(int argc, char** argv) {
  return guarded_main("07_plan", [&] { return plan(argc, argv); });
}
