// Token -> replica choice: own-GPU preference, even spread otherwise, determinism per seed,
// the rank rule of trace.h, and the per-rank entry point agreeing with the global one.
#include <gtest/gtest.h>

#include <map>

#include "moekit/check.h"
#include "moekit/eplb.h"

using namespace moekit;

namespace {

// Slots [0, 2, 3 | 0, 1, 1] on 2 GPUs: expert 0 on both GPUs (slots 0, 3), expert 1 twice on
// GPU 1 (slots 4, 5), experts 2 and 3 once on GPU 0.
Placement two_gpus() { return placement_from_phy2log({0, 2, 3, 0, 1, 1}, 1, 4, 6, 1, 1, 2); }

}  // namespace

TEST(EplbReplica, PrefersOwnGpu) {
  Placement p = two_gpus();
  // 4 tokens on 2 ranks: tokens 0, 1 on GPU 0, tokens 2, 3 on GPU 1; each picks experts 0 and 2.
  std::vector<int32_t> idx = {0, 2, 0, 2, 0, 2, 0, 2}, slot(8);
  choose_replicas(p, 0, idx.data(), 4, 2, 42, slot.data());
  EXPECT_EQ(slot, (std::vector<int32_t>{0, 1, 0, 1, 3, 1, 3, 1}));
}

TEST(EplbReplica, SpreadsEvenlyAndIsDeterministic) {
  Placement p = two_gpus();
  // 20000 tokens on 2 ranks, all picking expert 1 (two replicas, both on GPU 1).
  const int T = 20000;
  std::vector<int32_t> idx(T, 1), a(T), b(T), c(T);
  choose_replicas(p, 0, idx.data(), T, 1, 7, a.data());
  choose_replicas(p, 0, idx.data(), T, 1, 7, b.data());
  choose_replicas(p, 0, idx.data(), T, 1, 8, c.data());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::map<int, int> rank0, rank1;
  for (int t = 0; t < T; ++t) ++(t < T / 2 ? rank0 : rank1)[a[t]];
  // Off-GPU tokens (rank 0) and own-GPU tokens (rank 1, both replicas local) both split ~50/50.
  for (auto* m : {&rank0, &rank1}) {
    ASSERT_EQ(m->size(), 2u);
    EXPECT_NEAR((*m)[4], T / 4, T / 4 * 0.03);
    EXPECT_NEAR((*m)[5], T / 4, T / 4 * 0.03);
  }
}

TEST(EplbReplica, RankRuleWhenRanksDoNotDivideTokens) {
  // 5 tokens, 2 ranks: floor(t * 2 / 5) = 0, 0, 0, 1, 1.
  Placement p = two_gpus();
  std::vector<int32_t> idx(5, 0), slot(5);
  choose_replicas(p, 0, idx.data(), 5, 1, 0, slot.data());
  EXPECT_EQ(slot, (std::vector<int32_t>{0, 0, 0, 3, 3}));
}

TEST(EplbReplica, PerRankMatchesGlobal) {
  Placement p = rebalance({{50, 1, 1, 1, 30, 1, 1, 1}}, 16, 1, 1, 4);
  const int T = 64, k = 2;
  std::vector<int32_t> idx(T * k), all(T * k), local(T * k);
  for (int i = 0; i < T * k; ++i) idx[i] = (i * 5 + i / 3) % 8;
  choose_replicas(p, 0, idx.data(), T, k, 99, all.data());
  for (int r = 0; r < 4; ++r)
    choose_replicas_for_rank(p, 0, r, idx.data() + r * 16 * k, 16, k, r * 16, 99, local.data() + r * 16 * k);
  EXPECT_EQ(all, local);
  for (int i = 0; i < T * k; ++i) EXPECT_EQ(p.phy2log[all[i]], idx[i]) << i;  // a replica of the right expert
}

TEST(EplbReplica, DroppedAndBadIds) {
  Placement p = two_gpus();
  std::vector<int32_t> idx = {-1, 2}, slot = {7, 7};
  choose_replicas(p, 0, idx.data(), 1, 2, 0, slot.data());
  EXPECT_EQ(slot, (std::vector<int32_t>{-1, 1}));
  std::vector<int32_t> bad = {1, 4}, untouched = {7, 7};
  EXPECT_THROW(choose_replicas(p, 0, bad.data(), 1, 2, 0, untouched.data()), Error);
  EXPECT_EQ(untouched, (std::vector<int32_t>{7, 7}));
  EXPECT_THROW(choose_replicas(p, 1, idx.data(), 1, 2, 0, slot.data()), Error);
}
