// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): every big matrix of the
// model split across the N ranks of a tensor-parallel (TP) group, so that each
// rank holds and multiplies 1/N of it.
//
// Two ways to cut a linear layer y = x W^T + b, W of shape (out, in):
//
//   column-parallel   rank r holds rows [r out/N, (r+1) out/N) of W (the output
//                     features; "columns" of W^T) and of b. Input x whole on every
//                     rank, output y_r = x W_r^T + b_r: a slice of y's features.
//   row-parallel      rank r holds columns [r in/N, (r+1) in/N) of W. Input x_r: a
//                     slice of x's features (what a column-parallel layer made),
//                     output x_r W_r^T: a partial sum; y = sum over ranks + b.
//
// A column-parallel layer followed by a row-parallel one needs no communication in
// between (the MLP's GELU and attention's heads are local to a feature slice), and
// exactly two operators around the pair, f before and g after (Megatron's names):
//
//        f                                          g
//   x ──────> [column-parallel] -> local op -> [row-parallel] ──────> y (+ b)
//   forward:  identity                               all-reduce (sum the partials)
//   backward: all-reduce (sum dx over ranks)         identity
//
// f's backward sums the input gradients because every rank's slice of the layer
// used the same x and contributed a part of dL/dx; g's forward sums because every
// rank computed a partial product. Each is the other's transpose.
//
// Sequence parallelism (Korthikanti et al. 2022, --sp): outside the f..g region
// (LayerNorms, residual adds, dropout if there were any) every rank used to hold
// the same whole (B, T, C) activations. With SP each rank keeps only its chunk of
// the sequence there, (B, T/N, C), and
//
//   f becomes   forward all-gather (chunks -> whole sequence), backward reduce-scatter
//   g becomes   forward reduce-scatter (sum, and keep my chunk), backward all-gather
//
// An all-reduce is a reduce-scatter plus an all-gather, so the bytes of f and g do
// not change, while the activations outside the region shrink by N.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "06_tensor_parallel/tp_ops.h"
#include "common/comm/comm.h"
#include "common/tensor/memory.h"
#include "common/train/meters.h"
#include "common/model/model.h"
#include "common/tensor/ops.h"
#include "common/train/trace.h"

namespace course {

// ----------------------------------------------------------------------------
// the group, and f and g

class TPGroup {
 public:
  // comm: the ranks that split the matrices (chapter 06: the world; chapter 07: one
  // row of the process grid). B, T, C: the micro-batch's shape where f and g act.
  // device: where the group's layers keep their buffers and compute (ops_for(device)).
  // message_type: what f's and g's collectives move (bf16 under --dtype bf16: half the
  // bytes, rounded before and widened after; an all-reduce adds in fp32 and rounds at
  // each hop, as NCCL's bf16 all-reduce does). The cross-entropy's stay fp32.
  TPGroup(Comm& comm, bool sequence_parallel, int B, int T, int C, Device device = Device::CPU,
          DType message_type = DType::F32);

  Comm& comm() const { return comm_; }
  Device device() const { return device_; }
  const OpTable& ops() const { return ops_for(device_); }
  const TPOpTable& tp_ops() const { return tp_ops_for(device_); }  // this chapter's own (tp_ops.h)
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  bool sequence_parallel() const { return sequence_parallel_; }
  // T/N with sequence parallelism, T without: the rows each rank holds outside f..g
  int local_seq() const { return sequence_parallel_ ? T_ / size() : T_; }
  int first_position() const { return sequence_parallel_ ? rank() * local_seq() : 0; }
  int batch() const { return B_; }
  int seq() const { return T_; }
  int width() const { return C_; }

  // --trace: every collective of f, g and the cross-entropy becomes a communication
  // span named after what it is ("g all-reduce", "f all-gather (sp)", ...), drawn
  // when it ran. Chapter 07 sets the same hook to show them inside pipeline
  // micro-batches. nullptr (the default): none.
  void set_trace(Trace* trace) { trace_ = trace; }
  // Every wait for one of the group's collectives goes to `meters` as exposed
  // communication (the time the training thread waited for it), on `axis` (chapter
  // 07: "tp"; "" = the meters' only axis). nullptr: none.
  void set_meters(StepMeters* meters, const std::string& axis = "") {
    meters_ = meters;
    meters_axis_ = axis;
  }

  // f, forward: the input of a column-parallel layer, whole on every rank.
  //   without SP: identity (returns x, which already is whole)
  //   with SP:    all-gather the ranks' sequence chunks into `whole` (returns whole)
  // x is a saved LinearInput (model.h): fp32, or under --dtype bf16 stored in bf16, which
  // the gather sends as it is (its bf16 message, no rounding copy) and widens into whole.
  LinearInput f_forward(const LinearInput& x,  // (B, local_seq, C)
                        float* whole);         // (B, T, C)
  // f_forward in two halves: start the gather, compute something else, then finish
  // (wait, and put the chunks in sequence order in `whole`). Backward uses it to gather
  // x again for dW while dL/dx's GEMM runs. Without SP the Work is empty and finish
  // returns x.
  Work f_forward_start(const LinearInput& x);  // (B, local_seq, C)
  LinearInput f_forward_finish(Work& gathered, const LinearInput& x, float* whole);
  // f, backward: dL/dx from every rank's partial contribution.
  //   without SP: all-reduce d_partial in place (returns d_partial)
  //   with SP:    reduce-scatter it: this rank's chunk of the sum into d_local
  const float* f_backward(float* d_partial,  // (B, T, C)  this rank's contribution
                          float* d_local);   // (B, local_seq, C)
  // f_backward in two halves: start the sum, compute something else, then wait for
  // the returned Work; the result is then at f_backward_result. Backward uses it to
  // overlap the sum of dL/dx with the layer's weight-gradient GEMM, which does not
  // need it (Megatron overlaps them the same way). The gather and the sum stage
  // through buffers of their own, so one of each may be in flight at once, and
  // neither's result depends on the order the communication thread runs them in.
  Work f_backward_start(float* d_partial, float* d_local);
  const float* f_backward_result(float* d_partial, float* d_local) const {
    return sequence_parallel_ ? d_local : d_partial;
  }
  // Waits for f_backward_start's Work (and traces it).
  void f_backward_wait(Work& sum);
  // g, forward: the output of a row-parallel layer, summed over the ranks.
  //   without SP: all-reduce y_partial in place (returns y_partial)
  //   with SP:    reduce-scatter: this rank's chunk of the sum into y_local
  const float* g_forward(float* y_partial,  // (B, T, C)
                         float* y_local);   // (B, local_seq, C)
  // g, backward: the gradient of the row-parallel layer's output, whole.
  //   without SP: identity (returns dy)
  //   with SP:    all-gather the chunks into `whole`
  const float* g_backward(const float* dy,  // (B, local_seq, C)
                          float* whole);    // (B, T, C)

  // A collective of the group outside f and g (the vocabulary-parallel
  // cross-entropy's), traced as `name`.
  void all_reduce(float* data, size_t count, ReduceOp op, const char* name);

  // --trace: a compute span from start until now (the parallel layers' GEMMs, to see
  // what the collectives overlap); nothing without a trace.
  void trace_compute_since(const char* name, double start_seconds) const;

 private:
  // The sequence chunks of (B, T, C) are not contiguous (each sequence has one per
  // rank), while a collective's blocks are: the staging buffers hold them rank-major,
  // (N, B, T/N, C), and these copy between the two orders (one copy_strided per
  // rank, on the group's device).
  void to_rank_major(const float* whole, float* rank_major) const;
  void from_rank_major(const float* rank_major, float* whole) const;
  // f's forward and g's backward: with SP, all-gather the chunks (traced as `name`)
  const float* gather(const float* chunk, float* whole, const char* name);
  Work gather_start(const float* chunk);
  Work gather_start(const bf16* chunk);  // a bf16 chunk, sent as it is (bf16 messages only)
  const float* gather_finish(Work& gathered, const float* chunk, float* whole, const char* name);
  // f's backward and g's forward: waits for the sum (traced as `name`); bf16 messages are
  // then widened to where f_backward_start said the result goes
  void finish_sum(Work& sum, const char* name);
  void wait_traced(Work& work, const char* name);

  Comm& comm_;
  bool sequence_parallel_;
  int B_, T_, C_;
  Device device_;
  Buffer gather_staging_;   // (N, B, T/N, C) with SP, empty without: every all-gather's output
  Buffer scatter_staging_;  // (N, B, T/N, C) with SP, empty without: every reduce-scatter's input
  // bf16 messages only (empty for fp32): what goes on the wire
  DType message_type_;
  TypedBuffer<bf16> sum_message_;        // (B, T, C)  the all-reduce's data, or with SP the reduce-scatter's input
  TypedBuffer<bf16> scattered_message_;  // (B, T/N, C)  with SP: the reduce-scatter's output
  TypedBuffer<bf16> chunk_message_;      // (B, T/N, C)  with SP: this rank's chunk, to be gathered
  TypedBuffer<bf16> gathered_message_;   // (N, B, T/N, C)  with SP: the all-gather's output
  float* sum_destination_ = nullptr;     // where the sum in flight is widened to
  Trace* trace_ = nullptr;
  StepMeters* meters_ = nullptr;
  std::string meters_axis_;
};

// ----------------------------------------------------------------------------
// the parallel linear layers: chapter 00's linear op between f and g
//
// Each is a layer object, as Megatron-LM and picotron present them: it points at its
// slice of the weight and bias and at their gradients (views into the rank's
// parameter and gradient buffers, made once) and does its own f or g through the
// TPGroup. What differs per micro-batch comes with each call: the input saved by
// forward, the output's gradient, and the buffers f and g work in (TPScratch, one set
// per rank that every layer shares).
//
// Rows = B T; x_local, dx_local: (B, local_seq, C), the rows this rank holds outside
// f..g; OCl, ICl: this rank's slice of the output / input features.

// The buffers of f and g. One layer runs at a time, so every layer of a rank shares
// one set (chapter 06's TPWorkspace holds it).
struct TPScratch {
  float* whole;    // (B, T, C)          f's gathered input, g's gathered gradient (SP only)
  float* partial;  // (B, T, C)          a row-parallel output before g; a column-parallel dx before f
  float* dlocal;   // (B, local_seq, C)  f_backward's chunk of the sum (SP only)
};

// A parallel layer's slice of its weight and bias, and their gradients (shapes: each
// layer's constructor).
struct LinearSlice {
  const float* weight;
  const float* bias;
  float* dweight;
  float* dbias;
};

// y = f(x) W_local^T + b_local: W_local, b_local are this rank's rows (output features).
class ColumnParallelLinear {
 public:
  // weight and dweight (OCl, C), bias and dbias (OCl) or null (none)
  ColumnParallelLinear(TPGroup& tp, const LinearSlice& slice, int OCl);

  // (x_local, here and below: a saved LinearInput, fp32 or bf16-stored, model.h)
  void forward(float* y,                    // (B, T, OCl)
               const LinearInput& x_local,  // (B, local_seq, C)
               TPScratch& scratch);
  // dW_local += dy^T f(x), db_local += sum_rows(dy); returns dL/dx_local = f_backward(dy
  // W_local), in scratch (with SP, f(x) is all-gathered again here: forward kept only
  // the local chunk). Megatron's order, each collective under a GEMM that does not
  // need it:
  //   start gathering x          | dx = dy W_local (dgrad GEMM)
  //   start summing dx           | dW += dy^T x    (wgrad GEMM)
  // Zero bubble's split: with kept_dy, dW is left to backward_weight (and the gather
  // with it) and dy is copied to kept_dy for it.
  const float* backward(const float* dy,             // (B, T, OCl)
                        const LinearInput& x_local,  // (B, local_seq, C)
                        TPScratch& scratch,
                        float* kept_dy = nullptr);  // (B, T, OCl)
  // the deferred half: dW_local += kept_dy^T f(x)
  void backward_weight(const float* kept_dy, const LinearInput& x_local, TPScratch& scratch);

 private:
  // dW_local += dy^T x (the wgrad GEMM, traced)
  void weight_gradient(const float* dy,        // (B, T, OCl)
                       const LinearInput& x);  // (B, T, C)

  TPGroup& tp_;
  LinearSlice slice_;
  int out_features_;  // OCl
};

// out = residual + (g(x W_local^T) + b): W_local is this rank's columns (input
// features); the bias is whole and added once, after the sum. Every row-parallel
// layer of the model is followed by a residual add, so the two are fused (Megatron
// fuses the bias into its bias-dropout-add the same way). out: the sum over the ranks,
// (B, T, C), or with SP this rank's chunk (B, local_seq, C).
class RowParallelLinear {
 public:
  // weight and dweight (C, ICl), bias and dbias (C)
  RowParallelLinear(TPGroup& tp, const LinearSlice& slice, int ICl);

  // (x, here and below: a saved LinearInput, model.h: fcproj's bf16-stored fch_gelu under
  // --dtype bf16, or proj's fp32 atty)
  void forward(float* out,             // (B, local_seq, C)  not residual itself
               const LinearInput& x,   // (B, T, ICl)
               const float* residual,  // (B, local_seq, C)
               TPScratch& scratch);
  // db += sum_rows(dout), dx += g_backward(dout) W_local, dW_local += g_backward(dout)^T x
  // (dL/d(residual) is dout itself: the caller's). With kept_dy, dW is left to
  // backward_weight and g_backward(dout) is copied to kept_dy for it.
  void backward(float* dx,                // (B, T, ICl)
                const float* dout_local,  // (B, local_seq, C)
                const LinearInput& x,     // (B, T, ICl)
                TPScratch& scratch,
                float* kept_dy = nullptr);  // (B, T, C)
  // the deferred half: dW_local += kept_dy^T x
  void backward_weight(const float* kept_dy, const LinearInput& x);

 private:
  TPGroup& tp_;
  LinearSlice slice_;
  int in_features_;  // ICl
};

// ----------------------------------------------------------------------------
// how each parameter is split

enum class Split {
  Replicated,  // every rank holds all of it (LayerNorms, row-parallel biases, wpe)
  Rows,        // rank r holds rows [r R/N, (r+1) R/N): column-parallel weights and biases, vocabulary rows
  Columns,     // rank r holds columns [r K/N, (r+1) K/N): row-parallel weights
};

// One parameter of a TP rank: which part of chapter 00's parameter it holds.
struct TPParam {
  ParamSpec global;    // chapter 00's parameter (name, full shape, init)
  Split split = Split::Replicated;
  int row_groups = 1;  // Rows only: qkv_w's rows are 3 groups (q, k, v), each split on its own
  std::vector<int64_t> local_shape;
  size_t local_numel = 0;
  size_t local_offset = 0;  // within the rank's parameter buffer
};

// The split of every parameter of stages [first_stage, last_stage] (model_layout's
// numbering) over `ranks` ranks (every rank's slices have the same shapes). The buffer holds every split parameter
// first, then every replicated one: the replicated parameters are one contiguous
// range [replicated_offset, numel), which sequence parallelism all-reduces in one
// call and the gradient norm counts once.
struct TPLayout {
  std::vector<TPParam> params;
  size_t numel = 0;
  size_t replicated_offset = 0;
  const TPParam& find(const std::string& name) const;  // CourseError if absent
};
TPLayout tp_layout(const GPTConfig& config, int first_stage, int last_stage, int ranks);

// Index, in chapter 00's parameter, of element `local_index` of this rank's part of
// it. How the qkv rows map: local row i of group p (q, k or v) is global row
// p C + rank C/N + i, so rank r gets the q, k and v rows of heads [r NH/N, (r+1) NH/N).
size_t global_index(const TPParam& param, int rank, int ranks, size_t local_index);
// Writes this rank's part of every parameter, each element the value chapter 00
// gives it (common/model/model.h's init_value of its global index). params: host memory
// (TPPart copies it to its device).
void init_tp_params(const TPLayout& layout, uint64_t seed, int rank, int ranks, float* params);

// FlagError (a usage error every rank finds) unless N divides what it must split: heads, d-model, vocabulary, and
// with sequence parallelism the sequence length.
void check_tp_shape(const GPTConfig& config, int tp, bool sequence_parallel);
// Rank 0's lines on how the group splits the model: "tensor parallel: 2 ranks, backend tcp"
// and each rank's share of the heads, the MLP features and the vocabulary.
void print_tp_split(const GPTConfig& config, const TPGroup& tp, const std::string& backend);

// ----------------------------------------------------------------------------
// the vocabulary-parallel cross-entropy (the other pieces of the split layers that
// chapter 00's ops do not compute are ops too: common/tensor/ops.h's tensor parallelism)

// Cross-entropy over logits split by vocabulary (Megatron's vocab-parallel
// cross-entropy). No rank ever holds a whole row of logits:
//   m = max over ranks of each row's local max            (all-reduce, max; BT floats)
//   s = sum over ranks of sum_v exp(z_v - m)               (all-reduce, sum; with
//   z_t = the target's logit, from the rank that holds it  (    the next: 2 BT floats)
//   loss = -(z_t - m - log s),  probs_local = exp(z - m) / s
// reduce_scratch: 3 BT floats for the reductions. Every pointer on tp's device; the
// steps between the all-reduces are ops (ops::vocab_crossentropy_*), and so is the
// backward, which needs no communication: ops::vocab_crossentropy_backward.
void vocab_crossentropy_forward(TPGroup& tp, float* losses,  // (B, T) the same on every rank
                                float* probs_local,        // (B, T, Vl)
                                const float* logits_local, // (B, T, Vl)
                                const int* targets,        // (B, T)
                                float* reduce_scratch,     // (3, B, T)
                                int vocab_start, int B, int T, int Vl);

}  // namespace course
