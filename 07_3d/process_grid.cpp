#include "07_3d/process_grid.h"

#include <vector>

#include "common/tensor/error.h"

namespace course {

const char* grid_order_name(GridOrder order) {
  return order == GridOrder::DpPpTp ? "dp-pp-tp" : "pp-dp-tp";
}

const std::vector<std::string>& grid_order_names() {
  static const std::vector<std::string> names = {grid_order_name(GridOrder::DpPpTp),
                                                 grid_order_name(GridOrder::PpDpTp)};
  return names;
}

GridOrder parse_grid_order(const std::string& name) {
  for (const GridOrder order : {GridOrder::DpPpTp, GridOrder::PpDpTp}) {
    if (name == grid_order_name(order)) return order;
  }
  throw FlagError("unknown --grid-order '" + name + "' (choose dp-pp-tp or pp-dp-tp)");
}

ProcessGrid::ProcessGrid(int world_size, int dp, int pp, int tp, GridOrder order)
    : dp_(dp), pp_(pp), tp_(tp), order_(order) {
  if (dp < 1 || pp < 1 || tp < 1 || static_cast<long long>(dp) * pp * tp != world_size) {
    throw FlagError("--dp " + std::to_string(dp) + " x --pp " + std::to_string(pp) + " x --tp " +
                     std::to_string(tp) + " is not the world size " + std::to_string(world_size) +
                     " (hint: dp x pp x tp must equal the number of ranks)");
  }
}

// (outer x MIDDLE + middle) x TP + tp, and back: the outer and middle axes are dp
// and pp in the grid's order
int ProcessGrid::rank_of(GridCoords c) const {
  if (order_ == GridOrder::DpPpTp) return (c.dp * pp_ + c.pp) * tp_ + c.tp;
  return (c.pp * dp_ + c.dp) * tp_ + c.tp;
}

GridCoords ProcessGrid::coords_of(int rank) const {
  const int tp = rank % tp_, outer_and_middle = rank / tp_;
  if (order_ == GridOrder::DpPpTp) return {outer_and_middle / pp_, outer_and_middle % pp_, tp};
  return {outer_and_middle % dp_, outer_and_middle / dp_, tp};
}

std::string ProcessGrid::describe(int rank) const {
  const GridCoords c = coords_of(rank);
  const std::string dp = "dp " + std::to_string(c.dp), pp = "pp " + std::to_string(c.pp);
  const std::string outer_first = order_ == GridOrder::DpPpTp ? dp + ", " + pp : pp + ", " + dp;
  return "rank " + std::to_string(rank) + " = (" + outer_first + ", tp " + std::to_string(c.tp) + ")";
}

std::string ProcessGrid::formula() const {
  const bool dp_outer = order_ == GridOrder::DpPpTp;
  return std::string("rank = (") + (dp_outer ? "dp" : "pp") + " x " + std::to_string(dp_outer ? pp_ : dp_) +
         " + " + (dp_outer ? "pp" : "dp") + ") x " + std::to_string(tp_) + " + tp";
}

ProcessGrid make_process_grid(int world_size, int dp, int pp, int tp, GridOrder order) {
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
  if (inferred != 0 && dp * pp * tp == world_size) return ProcessGrid(world_size, dp, pp, tp, order);

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
  const GridCoords me = grid.coords_of(world.rank());  // in the grid's order
  const int PP = grid.pp_size(), TP = grid.tp_size();
  GridComms comms;
  // one color per group: the coordinates the group's ranks share; key = the position within it
  comms.tp = world.split(me.dp * PP + me.pp, me.tp);
  comms.pp = world.split(me.dp * TP + me.tp, me.pp);
  comms.dp = world.split(me.pp * TP + me.tp, me.dp);
  return comms;
}

}  // namespace course
