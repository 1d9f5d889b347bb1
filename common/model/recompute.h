// Activation recomputation (--recompute): the one policy of the course, for chapter 00's
// blocks (common/model/model.h: block_forward_kept, block_recompute) and chapter 06's
// tensor-parallel blocks (TPBlock::forward and backward) alike.
//
// A block's tensors are a struct of pointers (model.h's BlockTensors, chapter 06's
// TPBlockTensors) with att, the attention probabilities, and out, the block's output,
// among them. What each block keeps is its own; what it does not keep lives in one
// shared set of tensors per rank, which the block at hand fills:
//
//               forward writes into                     just before backward
//   none        the block's own tensors                 nothing
//   selective   its own, att in the shared att          attention's forward again, from
//                                                       the kept qkv: att (B, NH, T, T)
//   full        the shared tensors, out in its own      the block's whole forward again,
//                                                       from its kept input
//
// Backward then reads the very values forward made, computed again by the same ops in
// the same order, so the losses are bit for bit those of keeping everything (what each
// costs in time and saves in memory: chapter 00's README).
#pragma once

#include <string>

namespace course {

// What backward computes again instead of forward keeping it (Megatron-LM's recompute
// granularity, Korthikanti et al. 2022).
enum class Recompute { None, Selective, Full };
Recompute parse_recompute(const std::string& name);  // "none" | "selective" | "full"
const char* recompute_name(Recompute recompute);     // and back

// The tensors a block's forward writes, as `recompute` keeps them.
template <typename Tensors>
Tensors tensors_forward_writes(Recompute recompute, const Tensors& kept, const Tensors& shared) {
  Tensors written = kept;
  if (recompute == Recompute::Selective) written.att = shared.att;
  if (recompute == Recompute::Full) {
    written = shared;
    written.out = kept.out;
  }
  return written;
}

// The tensors a block's backward reads, what forward did not keep computed again first:
// attention_again(tensors) runs attention's forward into them (selective),
// forward_again(tensors) the block's whole forward (full).
template <typename Tensors, typename AttentionAgain, typename ForwardAgain>
Tensors tensors_backward_reads(Recompute recompute, const Tensors& kept, const Tensors& shared,
                               AttentionAgain&& attention_again, ForwardAgain&& forward_again) {
  Tensors read = kept;
  if (recompute == Recompute::Selective) {
    read.att = shared.att;
    attention_again(read);  // it also rewrites atty with the values it already holds (the op makes both)
  }
  if (recompute == Recompute::Full) {
    read = shared;  // its own out: the kept output stays as it is
    forward_again(read);
  }
  return read;
}

}  // namespace course
