// The process grid of 3D parallelism: world rank <-> (dp, pp, tp) coordinates, and
// the sub-communicators of each axis.
//
// A rank is its coordinates written as one mixed-radix number, tp always the last
// digit (fastest-varying), so that the ranks of a tensor-parallel group are
// neighbours in the world numbering and sit on one node when a launcher fills
// nodes in order: TP's all-reduces run inside every micro-batch and want the
// fastest link (NVLink within a node). The order of the two outer digits is a
// choice, the grid's order:
//
//   dp-pp-tp (the default, as picotron):   rank = (dp * PP + pp) * TP + tp
//   pp-dp-tp (as Megatron-LM, torchtitan): rank = (pp * DP + dp) * TP + tp
//
//   DP = 2, PP = 2, TP = 2:   rank  0  1  2  3  4  5  6  7
//     dp-pp-tp                dp    0  0  0  0  1  1  1  1
//                             pp    0  0  1  1  0  0  1  1
//     pp-dp-tp                pp    0  0  0  0  1  1  1  1
//                             dp    0  0  1  1  0  0  1  1
//     both                    tp    0  1  0  1  0  1  0  1
//
// The outer axis's groups span the whole world, the middle one's a block of
// (middle x TP) neighbours: which one stays inside a node is what the order
// decides (planner/planner.h compares them). In either order the tensor-parallel
// group of a rank is the TP ranks with its (dp, pp); its pipeline: the PP ranks
// with its (dp, tp); its data-parallel group: the DP ranks with its (pp, tp). The
// order changes only which world ranks fill them. Passed around explicitly, never
// a global.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/comm/comm.h"

namespace course {

struct GridCoords {
  int dp = 0;
  int pp = 0;
  int tp = 0;
};

// The order of the axes in the rank formula, outermost first; tp is innermost in both
enum class GridOrder { DpPpTp, PpDpTp };
GridOrder parse_grid_order(const std::string& name);  // FlagError unless one of grid_order_names()
const char* grid_order_name(GridOrder order);          // "dp-pp-tp", "pp-dp-tp"
const std::vector<std::string>& grid_order_names();

class ProcessGrid {
 public:
  // UsageError unless dp * pp * tp == world_size and each is at least 1.
  ProcessGrid(int world_size, int dp, int pp, int tp, GridOrder order = GridOrder::DpPpTp);

  int dp_size() const { return dp_; }
  int pp_size() const { return pp_; }
  int tp_size() const { return tp_; }
  int world_size() const { return dp_ * pp_ * tp_; }
  GridOrder order() const { return order_; }

  int rank_of(GridCoords coords) const;
  GridCoords coords_of(int rank) const;
  std::string describe(int rank) const;  // outermost first: "rank 5 = (dp 1, pp 0, tp 1)"
  std::string formula() const;           // "rank = (dp x 2 + pp) x 2 + tp"

 private:
  int dp_, pp_, tp_;
  GridOrder order_;
};

// --dp, --pp and --tp as given, at most one of them 0 (= inferred from the world
// size). FlagError naming the sizes that would work when the world does not
// factor: "8 ranks cannot be split into --dp 3 x --pp 2: dp x pp x tp must be 8
// (with --pp 2 and --tp 2, --dp 2)".
ProcessGrid make_process_grid(int world_size, int dp, int pp, int tp, GridOrder order = GridOrder::DpPpTp);

// This rank's three sub-communicators, made with Comm::split (collective over the
// world: every rank calls it). The same groups in either order; only which world
// ranks they hold changes.
struct GridComms {
  std::unique_ptr<Comm> tp;  // the TP group: ranks with this rank's (dp, pp), ordered by tp
  std::unique_ptr<Comm> pp;  // the pipeline: ranks with this rank's (dp, tp), ordered by pp
  std::unique_ptr<Comm> dp;  // the DP group: ranks with this rank's (pp, tp), ordered by dp
};
GridComms split_grid(Comm& world, const ProcessGrid& grid);

}  // namespace course
