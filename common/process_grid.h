// The process grid of 3D parallelism: world rank <-> (dp, pp, tp) coordinates, and
// the sub-communicators of each axis.
//
// One formula, tp fastest-varying (as Megatron orders it), so that the ranks of a
// tensor-parallel group are neighbours in the world numbering and sit on one node
// when a launcher fills nodes in order:
//
//   rank = (dp * PP + pp) * TP + tp
//
//   DP = 2, PP = 2, TP = 2:   rank  0  1  2  3  4  5  6  7
//                             dp    0  0  0  0  1  1  1  1
//                             pp    0  0  1  1  0  0  1  1
//                             tp    0  1  0  1  0  1  0  1
//
// The tensor-parallel group of a rank: the TP ranks with its (dp, pp); its
// pipeline: the PP ranks with its (dp, tp); its data-parallel group: the DP ranks
// with its (pp, tp). Passed around explicitly, never a global.
#pragma once

#include <memory>
#include <string>

#include "common/comm/comm.h"

namespace course {

struct GridCoords {
  int dp = 0;
  int pp = 0;
  int tp = 0;
};

class ProcessGrid {
 public:
  // UsageError unless dp * pp * tp == world_size and each is at least 1.
  ProcessGrid(int world_size, int dp, int pp, int tp);

  int dp_size() const { return dp_; }
  int pp_size() const { return pp_; }
  int tp_size() const { return tp_; }
  int world_size() const { return dp_ * pp_ * tp_; }

  int rank_of(GridCoords coords) const { return (coords.dp * pp_ + coords.pp) * tp_ + coords.tp; }
  GridCoords coords_of(int rank) const { return {rank / (pp_ * tp_), (rank / tp_) % pp_, rank % tp_}; }
  std::string describe(int rank) const;  // "rank 5 = (dp 1, pp 0, tp 1)"

 private:
  int dp_, pp_, tp_;
};

// --dp, --pp and --tp as given, at most one of them 0 (= inferred from the world
// size). FlagError naming the sizes that would work when the world does not
// factor: "8 ranks cannot be split into --dp 3 x --pp 2: dp x pp x tp must be 8
// (with --pp 2 and --tp 2, --dp 2)".
ProcessGrid make_process_grid(int world_size, int dp, int pp, int tp);

// This rank's three sub-communicators, made with Comm::split (collective over the
// world: every rank calls it).
struct GridComms {
  std::unique_ptr<Comm> tp;  // the TP group: ranks with this rank's (dp, pp), ordered by tp
  std::unique_ptr<Comm> pp;  // the pipeline: ranks with this rank's (dp, tp), ordered by pp
  std::unique_ptr<Comm> dp;  // the DP group: ranks with this rank's (pp, tp), ordered by dp
};
GridComms split_grid(Comm& world, const ProcessGrid& grid);

}  // namespace course
