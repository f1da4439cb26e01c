// The reference placement: EPLB.md's test vector entry for entry, then properties that must
// hold on many random loads (checked by independent counting, not by re-running the algorithm).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "moekit/check.h"
#include "moekit/eplb.h"

using namespace moekit;
using Loads = std::vector<std::vector<double>>;

namespace {

const Loads kExampleWeight = {{90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86},
                              {20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27}};

}  // namespace

TEST(EplbReference, MatchesEplbMdExample) {
  Placement p = rebalance(kExampleWeight, 16, 4, 2, 8);
  const std::vector<int32_t> want = {5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1,  //
                                     7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1};
  EXPECT_EQ(p.phy2log, want);
  EXPECT_TRUE(p.hierarchical());

  BalanceReport r = balance_report(p, kExampleWeight);
  const std::vector<double> want_loads = {121.5, 86.5, 125, 113, 147.5, 131.5, 156, 152,  //
                                          173, 179.5, 120.5, 172, 123, 152, 118.5, 117.5};
  ASSERT_EQ(r.gpu_load_after.size(), want_loads.size());
  for (size_t i = 0; i < want_loads.size(); ++i) EXPECT_DOUBLE_EQ(r.gpu_load_after[i], want_loads[i]) << i;
  EXPECT_NEAR(r.balancedness_after[0], 0.828, 5e-4);
  EXPECT_NEAR(r.balancedness_after[1], 0.805, 5e-4);
}
