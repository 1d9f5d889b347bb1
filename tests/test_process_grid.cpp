// The process grid's formula in each of its orders, and what make_process_grid infers or refuses.
// (Its sub-communicators are checked with real processes in tests/comm_worker.cpp.)
#include <catch2/catch.hpp>

#include <set>

#include "common/tensor/error.h"
#include "07_3d/process_grid.h"
#include "support/process.h"

using namespace course;

TEST_CASE("rank <-> (dp, pp, tp) is one formula with tp fastest, a bijection for every grid", "[unit]") {
  const ProcessGrid grid(8, 2, 2, 2);
  // the header's table
  const int expected[8][3] = {{0, 0, 0}, {0, 0, 1}, {0, 1, 0}, {0, 1, 1}, {1, 0, 0}, {1, 0, 1}, {1, 1, 0}, {1, 1, 1}};
  for (int rank = 0; rank < 8; rank++) {
    const GridCoords c = grid.coords_of(rank);
    CHECK(c.dp == expected[rank][0]);
    CHECK(c.pp == expected[rank][1]);
    CHECK(c.tp == expected[rank][2]);
  }
  CHECK(grid.describe(5) == "rank 5 = (dp 1, pp 0, tp 1)");
  for (int dp : {1, 2, 3}) {
    for (int pp : {1, 2, 4}) {
      for (int tp : {1, 2, 3}) {
        const ProcessGrid g(dp * pp * tp, dp, pp, tp);
        std::set<int> seen;
        for (int rank = 0; rank < g.world_size(); rank++) {
          const GridCoords c = g.coords_of(rank);
          REQUIRE(g.rank_of(c) == rank);
          REQUIRE((c.dp < dp && c.pp < pp && c.tp < tp));
          seen.insert(c.dp * 100 + c.pp * 10 + c.tp);
        }
        CHECK(seen.size() == static_cast<size_t>(g.world_size()));
      }
    }
  }
}

TEST_CASE("the grid's order: pp outermost (pp-dp-tp) is the same kind of formula, tp fastest in both", "[unit]") {
  const ProcessGrid grid(8, 2, 2, 2, GridOrder::PpDpTp);
  // the header's table, rank = (pp x DP + dp) x TP + tp, as (dp, pp, tp) of ranks 0-7
  const GridCoords table[8] = {{0, 0, 0}, {0, 0, 1}, {1, 0, 0}, {1, 0, 1}, {0, 1, 0}, {0, 1, 1}, {1, 1, 0}, {1, 1, 1}};
  for (int rank = 0; rank < 8; rank++) CHECK(grid.rank_of(table[rank]) == rank);
  CHECK(grid.describe(5) == "rank 5 = (pp 1, dp 0, tp 1)");  // outermost first, as the rank's digits
  CHECK(grid.formula() == "rank = (pp x 2 + dp) x 2 + tp");
  CHECK(ProcessGrid(8, 2, 2, 2).formula() == "rank = (dp x 2 + pp) x 2 + tp");
  CHECK(ProcessGrid(12, 3, 2, 2, GridOrder::PpDpTp).formula() == "rank = (pp x 3 + dp) x 2 + tp");

  for (int dp : {1, 2, 3}) {
    for (int pp : {1, 2, 4}) {
      for (int tp : {1, 2, 3}) {
        const ProcessGrid g(dp * pp * tp, dp, pp, tp, GridOrder::PpDpTp);
        std::set<int> seen;
        for (int rank = 0; rank < g.world_size(); rank++) {
          const GridCoords c = g.coords_of(rank);
          REQUIRE(g.rank_of(c) == rank);
          REQUIRE(c.pp == rank / (dp * tp));  // pp is the leading digit
          REQUIRE(c.tp == rank % tp);         // and tp the last: a TP group is tp consecutive ranks
          REQUIRE((c.dp < dp && c.pp < pp && c.tp < tp));
          seen.insert(c.dp * 100 + c.pp * 10 + c.tp);
        }
        CHECK(seen.size() == static_cast<size_t>(g.world_size()));
      }
    }
  }
  CHECK(parse_grid_order("pp-dp-tp") == GridOrder::PpDpTp);
  CHECK(grid_order_name(parse_grid_order("dp-pp-tp")) == std::string("dp-pp-tp"));
  CHECK_THROWS_WITH(parse_grid_order("tp-pp-dp"), Catch::Contains("choose dp-pp-tp or pp-dp-tp"));
  CHECK(make_process_grid(8, 0, 2, 2, GridOrder::PpDpTp).order() == GridOrder::PpDpTp);
  CHECK(make_process_grid(8, 0, 2, 2).order() == GridOrder::DpPpTp);
}

TEST_CASE("one left-out size is inferred, and a world that does not factor is refused with sizes that would work",
          "[unit]") {
  const ProcessGrid inferred = make_process_grid(8, 0, 2, 2);
  CHECK(inferred.dp_size() == 2);
  CHECK(make_process_grid(12, 3, 0, 2).pp_size() == 2);
  CHECK(make_process_grid(6, 1, 2, 0).tp_size() == 3);
  CHECK_THROWS_WITH(make_process_grid(8, 3, 2, 0),
                    Catch::Contains("8 ranks cannot be split into --dp 3 x --pp 2 x --tp (inferred)") &&
                        Catch::Contains("--dp 4 --pp 2 --tp 1"));
  CHECK_THROWS_WITH(make_process_grid(8, 2, 2, 3), Catch::Contains("--dp 2 x --pp 2 x --tp 3") &&
                                                       Catch::Contains("dp x pp x tp must be 8"));
  CHECK_THROWS_AS(make_process_grid(8, 0, 0, 2), FlagError);
  CHECK_THROWS_AS(make_process_grid(8, -1, 2, 4), FlagError);
}
