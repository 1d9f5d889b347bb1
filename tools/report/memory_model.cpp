// The formulas are the chapters' READMEs' ("Memory" sections), in floats of 4 bytes,
// with V = vocabulary, T = sequence, C = d_model, L = layers, NH = heads, N = ranks,
// b = sequences per micro-batch on a rank; E experts of which k per token with
// --experts (common/model/moe.h; E = 0: dense blocks).
#include "tools/report/memory_model.h"

#include <cmath>

#include "planner/planner.h"

namespace course::report {

const std::array<const char*, kCategories> kCategoryKeys = {"parameters",  "gradients",    "optimizer_state",
                                                            "activations", "comm_buffers", "workspace"};
const std::array<const char*, kCategories> kCategoryTitles = {"parameters",  "gradients",    "optimizer state",
                                                              "activations", "comm buffers", "workspace"};

namespace {

enum Category { Parameters, Gradients, OptimizerState, Activations, CommBuffers, Workspace };

struct Shape {
  double V, T, C, L, NH, B, M, N, E, k;
  std::string recompute;  // --recompute: "none", "selective" or "full"
  bool bf16;              // --dtype bf16: the linear layers' saved inputs stored in bf16
};

Shape shape_of(const Fields& s) {
  return {number(s, "vocab_size"),   number(s, "seq_len"),       number(s, "d_model"),
          number(s, "layers"),       number(s, "heads"),         number(s, "global_batch"),
          number(s, "micro_batches", 1), number(s, "world_size", 1), number(s, "experts"),
          number(s, "top_k"),        s.count("recompute") ? s.at("recompute") : "none",
          s.count("matmul_precision") != 0 && s.at("matmul_precision") == "bf16"};
}

// chapter 00: the model's stages, and one micro-batch of b sequences
double embedding_params(const Shape& m) { return m.V * m.C + m.T * m.C; }
// one MLP: fc (C x 4C + 4C) and proj (4C x C + C)
double mlp_params(const Shape& m) { return 8 * m.C * m.C + 5 * m.C; }
// the attention half's, then the MLP's (or a router and E expert MLPs)
double block_params(const Shape& m) {
  return 4 * m.C * m.C + 8 * m.C + (m.E > 0 ? m.E * m.C + m.E * mlp_params(m) : mlp_params(m));
}
double head_params(const Shape& m) { return 2 * m.C + m.V * m.C; }
double all_params(const Shape& m) { return embedding_params(m) + m.L * block_params(m) + head_params(m); }
// the MLP's share of a block's activations, and of the backward scratch
double mlp_activations(const Shape& m, double b) {
  return m.E > 0 ? b * m.T * (m.E + 3 * m.k + 10 * m.k * m.C) + 2 * m.E + 1 : 8 * b * m.T * m.C;
}
double mlp_scratch(const Shape& m, double b) {
  return m.E > 0 ? b * m.T * (10 * m.k * m.C + m.k + 2 * m.E) : 8 * b * m.T * m.C;
}
// floats the bf16 storage of the linear layers' saved inputs spares (common/model/model.h's
// LinearInput): half of ln1's, and of a dense block's ln2 and fch_gelu (C + C + 4C a token)
double bf16_spared_in_block(const Shape& m, double b) { return m.bf16 ? b * m.T * (m.E > 0 ? m.C : 6 * m.C) / 2 : 0; }
double block_activations(const Shape& m, double b) {
  return 8 * b * m.T * m.C + 4 * b * m.T + b * m.NH * m.T * m.T + mlp_activations(m, b) - bf16_spared_in_block(m, b);
}
// `blocks` blocks as --recompute keeps them, and the one buffer they share
// (common/model/model.h's RecomputeWorkspace): none, all but the attention matrix, the output
double kept_blocks(const Shape& m, double b, double blocks) {
  const double block = block_activations(m, b), scores = b * m.NH * m.T * m.T;
  if (m.recompute == "full") return blocks * b * m.T * m.C + block;
  if (m.recompute == "selective") return blocks * (block - scores) + scores;
  return blocks * block;
}
// lnf (half of it in bf16), its two statistics rows, the losses, logits and probabilities
double head_activations(const Shape& m, double b) {
  return (m.bf16 ? 0.5 : 1.0) * b * m.T * m.C + 3 * b * m.T + 2 * b * m.T * m.V;
}
double all_activations(const Shape& m, double b) {
  return b * m.T * m.C + kept_blocks(m, b, m.L) + head_activations(m, b);
}
double workspace(const Shape& m, double b) {
  return 8 * b * m.T * m.C + mlp_scratch(m, b) + m.T * m.T + b * m.T * m.V + 2 * b * m.T * m.C;
}

void set(CategoryBytes& memory, Category category, double floats) {
  memory.bytes[category] = 4 * floats;
  memory.known[category] = true;
}

// whether the summary's `key` is `value`
bool field_is(const Fields& s, const std::string& key, const std::string& value) {
  auto found = s.find(key);
  return found != s.end() && found->second == value;
}

// parameters, their gradients and AdamW's two moments
void set_states(CategoryBytes& memory, double params, double grads, double optimizer) {
  set(memory, Parameters, params);
  set(memory, Gradients, grads);
  set(memory, OptimizerState, optimizer);
}

// Chapters 04 and 05: the blocks cut into `parts` contiguous groups (the first L mod
// parts one block longer), the embedding with the first, the head with the last
// (04_naive_model_parallel/model_split.cpp). Returns part p's parameters and blocks.
void part_of_model(const Shape& m, int parts, int p, double* params, double* blocks) {
  const int L = static_cast<int>(m.L);
  *blocks = L / parts + (p < L % parts ? 1 : 0);
  *params = *blocks * block_params(m) + (p == 0 ? embedding_params(m) : 0) +
            (p == parts - 1 ? head_params(m) : 0);
}

void set_bytes(CategoryBytes& memory, Category category, double bytes) {
  memory.bytes[category] = bytes;
  memory.known[category] = true;
}

// Chapters 07 and 08: the planner's figures for this rank (planner/planner.h), which
// tests/test_3d.cpp proves against these chapters' runs: parameters, gradients, AdamW
// state and activations exactly, and for 08 (every rank alike) the workspace and the
// communication buffers too (07's are an upper bound, left out).
CategoryBytes predict_with_planner(const Fields& s, const Shape& m, int rank) {
  PlanJob job;
  job.model.vocab_size = static_cast<int>(m.V);
  job.model.seq_len = static_cast<int>(m.T);
  job.model.n_layer = static_cast<int>(m.L);
  job.model.d_model = static_cast<int>(m.C);
  job.model.n_head = static_cast<int>(m.NH);
  job.model.recompute = parse_recompute(m.recompute);
  job.recompute = job.model.recompute;
  job.precision = m.bf16 ? Precision::BF16 : Precision::FP32;  // this trainer's bf16 (planner.h)
  job.global_batch = static_cast<int>(m.B);
  job.micro_batches = static_cast<int>(m.M);
  Layout layout;
  layout.dp = static_cast<int>(number(s, "dp", 1));
  const bool context_parallel = s.at("chapter") == "08_context_parallel";
  GridCoords coords;
  if (context_parallel) {
    layout.cp = static_cast<int>(number(s, "cp", 1));
    layout.cp_mode = s.count("cp_mode") && s.at("cp_mode") == "a2a" ? CPMode::AllToAll : CPMode::Ring;
    layout.cp_split = parse_split_kind(s.count("cp_split") ? s.at("cp_split") : "zigzag");
  } else {
    layout.pp = static_cast<int>(number(s, "pp", 1));
    layout.tp = static_cast<int>(number(s, "tp", 1));
    layout.zero_stage = static_cast<int>(number(s, "zero_stage"));
    layout.schedule = parse_schedule(s.count("schedule") ? s.at("schedule") : "1f1b");
    layout.chunks = static_cast<int>(number(s, "chunks", 1));
    layout.sequence_parallel = number(s, "sequence_parallel") != 0;
    layout.reshard_after_forward = number(s, "reshard_after_forward") != 0;
    layout.order = parse_grid_order(s.count("grid_order") ? s.at("grid_order") : "dp-pp-tp");
    coords = ProcessGrid(layout.dp * layout.pp * layout.tp, layout.dp, layout.pp, layout.tp, layout.order)
                 .coords_of(rank);
  }
  CategoryBytes memory;
  try {
    const RankPlan plan = plan_rank(job, layout, coords);
    set_bytes(memory, Parameters, plan.parameters);
    set_bytes(memory, Gradients, plan.gradients);
    set_bytes(memory, OptimizerState, plan.optimizer_state);
    set_bytes(memory, Activations, plan.activations);
    if (context_parallel) {
      set_bytes(memory, Workspace, plan.workspace);
      set_bytes(memory, CommBuffers, plan.comm_buffers);
    }
  } catch (const CourseError&) {
    // a layout the planner does not know (an older log): no predicted bar
  }
  return memory;
}

CategoryBytes predict(const Fields& s, int rank) {
  CategoryBytes memory;
  const Shape m = shape_of(s);
  const std::string chapter = s.count("chapter") ? s.at("chapter") : "";
  const double P = all_params(m);
  if (chapter == "00_single_gpu" || chapter == "02_ddp") {
    // 02: every rank holds everything; its micro-batch is B / (N M)
    const double b = m.B / (m.N * m.M);
    set_states(memory, P, P, 2 * P);
    set(memory, Activations, all_activations(m, b));
    if (!m.bf16) set(memory, Workspace, workspace(m, b));  // (bf16's GEMM copies: as the CPU has bf16 instructions)
    set(memory, CommBuffers, 0);  // buckets are slices of the gradient buffer
  } else if (chapter.rfind("03_fsdp", 0) == 0) {
    // ZeRO-1/2/3 divide optimizer state, then gradients, then parameters by N: S = ceil(P/N)
    const double stage = number(s, "zero_stage"), S = std::ceil(P / m.N);
    const double b = m.B / (m.N * m.M);
    set_states(memory, stage >= 3 ? S : P, stage >= 2 ? S : P, 2 * S);
    set(memory, Activations, all_activations(m, b));
    if (!m.bf16) set(memory, Workspace, workspace(m, b));  // (bf16's GEMM copies: as the CPU has bf16 instructions)
  } else if (chapter == "04_naive_model_parallel" || chapter == "05_pipeline") {
    // a rank's stages: one part (04), or V chunks at stages r, r + N, ... (05)
    const int N = static_cast<int>(m.N), V = static_cast<int>(number(s, "chunks", 1));
    if (N * V > m.L) return memory;  // not a cut the chapters make
    double params = 0, blocks = 0;
    for (int c = 0; c < V; c++) {
      double part_params = 0, part_blocks = 0;
      part_of_model(m, N * V, c * N + rank, &part_params, &part_blocks);
      params += part_params;
      blocks += part_blocks;
    }
    set_states(memory, params, params, 2 * params);
    const std::string predicted = "rank" + std::to_string(rank) + "_predicted_activations";
    if (s.count(predicted)) {
      memory.bytes[Activations] = number(s, predicted);  // 05 logs its schedule's prediction
      memory.known[Activations] = true;
    } else if (chapter == "04_naive_model_parallel") {
      // one micro-batch in flight: the part's input, its blocks, the head on the last rank
      const double b = m.B / m.M;
      set(memory, Activations,
          b * m.T * m.C + kept_blocks(m, b, blocks) + (rank == N - 1 ? head_activations(m, b) : 0));
    }
  } else if (chapter.rfind("06_tensor_parallel", 0) == 0) {
    // 06: (P - R)/N + R parameters (the log has it); activations split inside f..g, and
    // outside it too with sequence parallelism (Tl = T/N)
    const double N = number(s, "tp", m.N), b = m.B / m.M;
    const double Tl = number(s, "sequence_parallel") != 0 ? m.T / N : m.T;
    const double Cl = m.C / N, NHl = m.NH / N, Fl = 4 * m.C / N, Vl = m.V / N;
    const double params = number(s, "params_per_rank");
    set_states(memory, params, params, 2 * params);
    // (bf16: ln1, ln2 and fch_gelu, and lnf, stored in half, as chapter 00's)
    const double block = b * Tl * (4 * m.C + 4) + b * m.T * (3 * Cl + Cl + 2 * Fl) + b * NHl * m.T * m.T -
                         (m.bf16 ? b * Tl * m.C + b * m.T * Fl / 2 : 0);
    const double head = b * Tl * ((m.bf16 ? 0.5 : 1.0) * m.C + 2) + 2 * b * m.T * Vl + b * m.T;
    set(memory, Activations, m.L * block + head + b * Tl * m.C);
  } else if (chapter == "07_3d" || chapter == "08_context_parallel") {
    return predict_with_planner(s, m, rank);
  } else if (chapter.rfind("10_slow_links", 0) == 0 && field_is(s, "compression", "none")) {
    // 10: 02's replica, AdamW's moments (SGD has none), and DiLoCo's outer state: the
    // global weights and their momentum (2P), its pseudo-gradient (P) a communication
    // buffer. (Compressed runs add error feedback's residuals: no prediction for those.)
    const bool diloco = field_is(s, "algorithm", "diloco");
    const double inner = field_is(s, "inner_optimizer", "sgd") ? 0 : 2 * P;
    const double b = m.B / (m.N * m.M);
    set_states(memory, P, P, inner + (diloco ? 2 * P : 0));
    set(memory, Activations, all_activations(m, b));
    if (!m.bf16) set(memory, Workspace, workspace(m, b));  // (bf16's GEMM copies: as the CPU has bf16 instructions)
    set(memory, CommBuffers, diloco ? P : 0);
  } else if (chapter == "09_expert_parallel") {
    // 09: the replicated parameters and E/R of each block's experts: P_r + L (E/R) P_e.
    // Its README gives no formula for the activations or buffers: no predicted bar there.
    const double R = number(s, "ep", m.N);
    const double params = P - m.L * (m.E - m.E / R) * mlp_params(m);
    set_states(memory, params, params, 2 * params);
  }
  return memory;
}

}  // namespace

std::vector<RankMemory> rank_memory(const ChapterLog& log) {
  const Fields& s = log.summary;
  std::vector<RankMemory> ranks;
  if (s.empty()) return ranks;
  const int world = static_cast<int>(number(s, "world_size", 1));
  const bool per_rank = s.count("rank0_peak_parameters") != 0;
  for (int rank = 0; rank < (per_rank ? world : 1); rank++) {
    RankMemory memory;
    memory.rank = rank;
    for (int c = 0; c < kCategories; c++) {
      // rank 0's summary has every category; the per-rank tables have all but workspace
      const std::string key = rank == 0 ? std::string("peak_") + kCategoryKeys[c]
                                        : "rank" + std::to_string(rank) + "_peak_" + kCategoryKeys[c];
      memory.measured.known[c] = s.count(key) != 0;
      memory.measured.bytes[c] = number(s, key);
    }
    if (log.has_model_shape()) memory.predicted = predict(s, rank);
    ranks.push_back(memory);
  }
  return ranks;
}

}  // namespace course::report
