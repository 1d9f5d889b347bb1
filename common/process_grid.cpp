#include "common/process_grid.h"

#include <vector>

#include "common/error.h"

namespace course {

ProcessGrid::ProcessGrid(int world_size, int dp, int pp, int tp) : dp_(dp), pp_(pp), tp_(tp) {
  if (dp < 1 || pp < 1 || tp < 1 || static_cast<long long>(dp) * pp * tp != world_size) {
    throw UsageError("--dp " + std::to_string(dp) + " x --pp " + std::to_string(pp) + " x --tp " +
                     std::to_string(tp) + " is not the world size " + std::to_string(world_size) +
                     " (hint: dp x pp x tp must equal the number of ranks)");
  }
}

std::string ProcessGrid::describe(int rank) const {
  const GridCoords c = coords_of(rank);
  return "rank " + std::to_string(rank) + " = (dp " + std::to_string(c.dp) + ", pp " + std::to_string(c.pp) +
         ", tp " + std::to_string(c.tp) + ")";
}

ProcessGrid make_process_grid(int world_size, int dp, int pp, int tp) {
  const int unknown = (dp == 0) + (pp == 0) + (tp == 0);
  if (dp < 0 || pp < 0 || tp < 0 || unknown > 1) {
    throw FlagError("--dp, --pp and --tp must be at least 1, and at most one of them may be left out (0) to be " +
                    std::string("inferred from the world size"));
  }
  const auto flag = [](const char* name, int value) {
    return std::string(name) + (value ? " " + std::to_string(value) : " (inferred)");
  };
  const std::string asked = flag("--dp", dp) + " x " + flag("--pp", pp) + " x " + flag("--tp", tp);
  const int known = (dp ? dp : 1) * (pp ? pp : 1) * (tp ? tp : 1);
  const int inferred = known > 0 && world_size % known == 0 ? world_size / known : 0;
  if (dp == 0) dp = inferred;
  if (pp == 0) pp = inferred;
  if (tp == 0) tp = inferred;
  if (inferred != 0 && dp * pp * tp == world_size) return ProcessGrid(world_size, dp, pp, tp);

  // say what would work: keep pp and tp where they divide the world, and infer dp
  std::string hint;
  for (int t : {tp, 1}) {
    for (int p : {pp, 1}) {
      if (hint.empty() && t > 0 && p > 0 && world_size % (t * p) == 0) {
        hint = "--dp " + std::to_string(world_size / (t * p)) + " --pp " + std::to_string(p) + " --tp " +
               std::to_string(t);
      }
    }
  }
  throw FlagError(std::to_string(world_size) + " ranks cannot be split into " + asked + ": dp x pp x tp must be " +
                  std::to_string(world_size) + " (hint: for example " + hint + ")");
}

GridComms split_grid(Comm& world, const ProcessGrid& grid) {
  const GridCoords me = grid.coords_of(world.rank());
  const int PP = grid.pp_size(), TP = grid.tp_size();
  GridComms comms;
  // one color per group: the coordinates the group's ranks share; key = the position within it
  comms.tp = world.split(me.dp * PP + me.pp, me.tp);
  comms.pp = world.split(me.dp * TP + me.tp, me.pp);
  comms.dp = world.split(me.pp * TP + me.tp, me.dp);
  return comms;
}

}  // namespace course
