// The planner: which (dp, pp, tp) layout for this model on these devices, will it
// fit, and what will it cost? And, for long sequences, which dp x cp layout of
// chapter 08 (context parallelism).
//
// A cost model made only of the formulas the chapter READMEs state: parameters,
// gradients and AdamW state per rank (chapters 00, 03), activations kept per
// micro-batch times the micro-batches a schedule keeps alive (05, 06), bytes sent
// per step on each axis (the ring formulas of 01, with 02's buckets, 05's
// boundaries and 06's f and g), the bubble (05). For the course's own fp32 trainer
// plan_rank is exact: tests/test_3d.cpp runs layouts and compares its figures
// with what chapter 07 measured.
//
// The step time is an estimate: compute at the device's FLOP/s (with recomputation's
// extra forward), stretched by the bubble, plus the communication that nothing hides
// (TP's collectives are on the critical path; DP's average overlaps the last
// micro-batch's backward, and only what is left of it counts; the pipeline's fill and
// drain wait for 2 (pp - 1) boundary transfers).
//
// The cp axis (Layout::cp > 1) is chapter 08's trainer, which runs it with dp only:
// every rank is chapter 00's model on Tl = T/N tokens of each sequence, with an
// attention that fetches the other ranks' keys and values (ring or all-to-all), the
// parameters replicated and DDP's buckets averaged over all dp x cp ranks.
// tests/test_3d.cpp runs chapter 08 and finds its figures equal to plan_rank's. In
// the step estimate, the ring's hops overlap attention's compute (12 L T C FLOPs per
// token, split evenly by zigzag), so only the part of their time beyond it is
// exposed; a2a's all-to-alls are all exposed (attention needs their results at once).
#pragma once

#include <string>
#include <vector>

#include "05_pipeline/schedule.h"
#include "common/tensor/bf16.h"
#include "06_tensor_parallel/tp_model.h"
#include "08_context_parallel/sequence_split.h"
#include "common/model/model.h"
#include "07_3d/process_grid.h"

namespace course {

// fp32: the course at --dtype fp32 (4-byte weights, gradients, activations and
// messages; AdamW moments 8 bytes).
// bf16: the course at --dtype bf16, as it runs today: fp32 weights, gradients,
// activations and moments, but the linear layers' saved inputs (ln1, ln2, fch_gelu, lnf:
// bf16, common/model/model.h's LinearInput); bf16 messages (activations on tp, pp and cp, ZeRO's parameter
// gathers) and their bf16 copies; ZeRO-1/2 keep their shard's fp32 master values (4
// bytes more of optimizer state), their replicas holding the bf16 values gathered.
// bf16-stored: mixed precision as Megatron-LM and the ZeRO paper count it: 2-byte
// weights, gradients, activations and messages; fp32 master weights and moments, 12
// bytes. What a trainer that stores bf16 holds: no chapter does yet.
enum class Precision { FP32, BF16, BF16Stored };
const char* precision_name(Precision precision);  // "fp32" | "bf16" | "bf16-stored", 07_plan's flag values
Precision parse_precision(const std::string& name);  // FlagError for another name

struct PlanJob {
  GPTConfig model;
  int global_batch = 8;     // sequences per step
  int micro_batches = 4;    // per pipeline per step
  double bucket_mb = 25.0;  // chapter 02's gradient buckets (DDP over dp)
  Precision precision = Precision::FP32;
  // chapter 07's --recompute (tp_model.h): selective keeps no (b, heads/N, T, T)
  // attention matrix per block, one per rank; full keeps each block's input and one
  // block's activations per rank, and repeats the blocks' forward (and its TP
  // collectives) in backward
  Recompute recompute = Recompute::None;
  // chapter 07's --grad-comm-dtype: what the dp axis's gradient reductions send (bf16:
  // 2 bytes a value, and the bf16 copy they travel in: DDP's and ZeRO-1's kept, ZeRO-2/3's
  // lent from a chunk's last backward to the step's end)
  DType grad_comm_dtype = DType::F32;
};

struct Cluster {
  int devices_per_node = 8;
  int nodes = 1;
  double device_memory = 80e9;          // bytes
  double intra_node_bandwidth = 450e9;  // bytes/s one device sends, per direction (NVLink 4)
  double inter_node_bandwidth = 50e9;   // bytes/s (one 400 Gb/s InfiniBand NIC per device)
  double device_flops = 400e12;         // achieved FLOP/s (H100 bf16 at 40% of its 989 TFLOP/s)
  std::string intra_name = "NVLink";
  std::string inter_name = "IB";
  int devices() const { return devices_per_node * nodes; }
};

// How chapter 08's attention reaches the other cp ranks' keys and values (--cp-mode)
enum class CPMode { Ring, AllToAll };
const char* cp_mode_name(CPMode mode);  // "ring" | "a2a", chapter 08's flag values

struct Layout {
  int dp = 1, pp = 1, tp = 1;
  // 0 DDP; 1 ZeRO-1 (AdamW state sharded over dp); 2 and the gradients; 3 (FSDP) and the
  // parameters, each chunk gathered once a step, or around every forward and backward
  // with reshard_after_forward
  int zero_stage = 0;
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  int chunks = 1;      // virtual stages per pipeline rank (interleaved)
  bool sequence_parallel = false;
  // which ranks share a node: only the links, and so the step, depend on it
  GridOrder order = GridOrder::DpPpTp;
  // chapter 08: ranks per sequence (pp = tp = 1 then), its attention and split. The
  // split changes neither the bytes nor the activations, only the balance of
  // attention's work (which the step estimate takes as even) and the ring's block
  // scratch; zigzag (chapter 08's default) needs T divisible by 2 cp.
  int cp = 1;
  CPMode cp_mode = CPMode::Ring;
  SplitKind cp_split = SplitKind::Zigzag;
  bool reshard_after_forward = false;  // ZeRO-3 only
};
// "2x2x2 z1 i2 sp": dp x pp x tp, then the ZeRO stage (z3r: resharded after forward),
// the schedule unless 1f1b (i2: interleaved with 2 chunks), sequence parallelism;
// "4x1x1 cp2 a2a": dp 4 x cp 2, all-to-all attention (ring unsaid), and "contiguous"
// for that split (zigzag unsaid)
std::string describe(const Layout& layout);

// Unless chapter 07 can run the layout for this job, the error chapter 07 gives
// (its own checks: check_tp_shape, check_interleaved_cut, the process grid; and
// make_schedule and split_stages refuse the rest when the planner calls them). With
// cp > 1, chapter 08's: dp only, and resolve_cp_flags (the split, a2a's heads).
void check_layout(const PlanJob& job, const Layout& layout);

// One rank's figures, in bytes; comm_buffers is an upper bound (how many
// boundaries a pipeline rank holds at once depends on timing).
struct RankPlan {
  double parameters = 0, gradients = 0, optimizer_state = 0, activations = 0, workspace = 0, comm_buffers = 0;
  // ZeRO-2/3: the most bytes of whole buffers lent at once (a chunk's gradients from
  // its first backward to the step's end; stage 3's gathered stages), exact; part of
  // comm_buffers
  double lent = 0;
  double tp_bytes = 0, pp_bytes = 0, dp_bytes = 0, cp_bytes = 0;  // sent per step, on each axis
  // of dp_bytes, ZeRO-3's all-gathers, all counted exposed: an upper bound, since each
  // stage's is prefetched while the stage before it computes
  double dp_gather_bytes = 0;
  double memory() const;                            // the six categories added
};
// (UsageError, from check_layout and the cut, for a layout chapter 07 cannot run.)
// With cp > 1 every rank holds and sends the same: exact, communication buffers
// and workspace included (chapter 08's on the CPU).
RankPlan plan_rank(const PlanJob& job, const Layout& layout, GridCoords coords);

struct LayoutPlan {
  Layout layout;
  std::vector<RankPlan> pipeline_ranks;  // [pp]: the ranks (0, pp, 0); the others repeat them
  RankPlan worst;      // each figure's largest value over the ranks
  double peak_memory;  // the largest rank's total
  bool fits;
  // which link each axis crosses; with cp, DDP's dp_link is the whole dp x cp world's
  std::string tp_link, pp_link, dp_link, cp_link;
  double bubble;
  double compute_seconds, exposed_comm_seconds, step_seconds, tokens_per_second;
};
LayoutPlan plan_layout(const PlanJob& job, const Layout& layout, const Cluster& cluster);

// Every layout of cluster.devices() that chapter 07 can run: each factorisation,
// schedules 1f1b and interleaved (2 chunks), with and without SP, ZeRO 0 and 1 (not
// 2 and 3: with a pipeline chunk as the unit they lend, they hold more than ZeRO-1 at
// the peak and send as much or more, so they never rank above it; 07_3d/README.md);
// with_cp: also chapter 08's dp x cp (cp >= 2, ring and a2a, zigzag); fastest first,
// the ones that do not fit after them.
std::vector<LayoutPlan> plan_all(const PlanJob& job, const Cluster& cluster, bool with_cp = false);

// The ranked table, at most `rows` lines, fitting 100 columns. When a row has cp,
// the tp column is "tp|cp/step": a cp row's cp bytes (its tp is 1).
std::string format_plans(const std::vector<LayoutPlan>& plans, size_t rows);

// The same rows under each grid order (07_3d/process_grid.h): the link each axis's
// groups cross, and the step. What it changes when a job spans nodes: dp-pp-tp keeps
// a pipeline inside a node while pp x tp fits in it, pp-dp-tp keeps a DP group
// there while dp x tp does; the outer axis crosses nodes. A cp row shows its cp link
// under tp, the same in both: chapter 08 has one order, cp fastest.
std::string format_grid_orders(const std::vector<LayoutPlan>& plans, size_t rows, const PlanJob& job,
                               const Cluster& cluster);

}  // namespace course
