// Load statistics (window and decay) and the rebalance gate, against hand-computed values and
// the reference figures of docs/theory.md §EPLB gain.
#include <gtest/gtest.h>

#include "moekit/check.h"
#include "moekit/eplb.h"

using namespace moekit;

TEST(EplbStats, SlidingWindow) {
  LoadRecorder rec = LoadRecorder::window(2, 3, 2);
  const std::vector<int32_t> s1 = {0, 1, 0, 2}, s2 = {2, 2}, s3 = {1, 1, 1, -1};
  rec.record(0, s1.data(), 2, 2);  // layer 0: 0,1 | 0,2
  rec.record(1, s2.data(), 1, 2);  // layer 1: 2,2
  rec.end_step();
  EXPECT_EQ(rec.loads(), (std::vector<std::vector<double>>{{2, 1, 1}, {0, 0, 2}}));
  rec.record(0, s3.data(), 2, 2);  // 1,1 | 1,dropped
  rec.end_step();
  EXPECT_EQ(rec.loads(), (std::vector<std::vector<double>>{{2, 4, 1}, {0, 0, 2}}));
  rec.record(1, s1.data(), 2, 2);
  rec.end_step();  // step 1 leaves the window
  EXPECT_EQ(rec.loads(), (std::vector<std::vector<double>>{{0, 3, 0}, {2, 1, 1}}));
  EXPECT_EQ(rec.num_steps_recorded(), 3);
}

TEST(EplbStats, ExponentialDecay) {
  LoadRecorder rec = LoadRecorder::decay(1, 2, 0.5);
  const std::vector<int32_t> a = {0, 0, 1}, b = {1};
  rec.record(0, a.data(), 3, 1);
  rec.end_step();  // [2, 1]
  rec.record(0, b.data(), 1, 1);
  rec.end_step();  // [1, 0.5] + [0, 1]
  EXPECT_EQ(rec.loads(), (std::vector<std::vector<double>>{{1, 1.5}}));
  rec.end_step();  // an empty step halves everything
  EXPECT_EQ(rec.loads(), (std::vector<std::vector<double>>{{0.5, 0.75}}));
}

TEST(EplbStats, RecorderRejectsBadInput) {
  LoadRecorder rec = LoadRecorder::window(1, 4, 3);
  const std::vector<int32_t> ok = {3}, bad = {1, 4};
  rec.record(0, ok.data(), 1, 1);
  EXPECT_THROW(rec.record(0, bad.data(), 2, 1), Error);
  EXPECT_THROW(rec.record(1, ok.data(), 1, 1), Error);
  rec.end_step();
  EXPECT_EQ(rec.loads(), (std::vector<std::vector<double>>{{0, 0, 0, 1}}));  // the bad batch counted nothing
  EXPECT_THROW(LoadRecorder::window(1, 4, 0), Error);
  EXPECT_THROW(LoadRecorder::decay(1, 4, 1.0), Error);
}

// Counts (what the GPU layer's take_expert_counts returns) add up exactly like the top-k
// arrays they summarise, and a negative count is refused without touching the step.
TEST(EplbStats, CountsEqualTheirTopkArrays) {
  LoadRecorder from_ids = LoadRecorder::window(1, 3, 2), from_counts = LoadRecorder::window(1, 3, 2);
  const std::vector<int32_t> ids = {0, 2, 2, 2, 1, -1};  // 3 tokens, top-2: expert 0 once, 1 once, 2 three times
  const std::vector<int64_t> counts = {1, 1, 3}, negative = {1, -1, 0};
  from_ids.record(0, ids.data(), 3, 2);
  from_counts.record_counts(0, counts.data());
  EXPECT_THROW(from_counts.record_counts(0, negative.data()), Error);
  EXPECT_THROW(from_counts.record_counts(1, counts.data()), Error);
  from_ids.end_step();
  from_counts.end_step();
  EXPECT_EQ(from_counts.loads(), (std::vector<std::vector<double>>{{1, 1, 3}}));
  EXPECT_EQ(from_counts.loads(), from_ids.loads());
}

TEST(EplbStats, GainMatchesTheory) {
  // docs/theory.md §EPLB gain: S0/S1 = 1.18, f = 0.6 -> 1.10x; S0/S1 = 2.6, f = 0.85 -> 2.10x.
  EXPECT_NEAR(end_to_end_gain(1.18, 0.6), 1.10, 0.005);
  EXPECT_NEAR(end_to_end_gain(2.6, 0.85), 2.10, 0.005);
  EXPECT_DOUBLE_EQ(end_to_end_gain(3.0, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(end_to_end_gain(3.0, 1.0), 3.0);
  EXPECT_THROW(end_to_end_gain(1.2, 1.5), Error);
}

TEST(EplbStats, GateSkipsSmallGains) {
  const std::vector<std::vector<double>> w = {{10, 6, 4, 2}};
  // Current slots [0, 1, 2 | 3, 0, 1]: experts 0 and 1 have 2 replicas: GPU loads 5+3+4 = 12
  // and 2+5+3 = 10, so S0 = 12/11. The rebalance gives [11, 11], S1 = 1.
  Placement current = placement_from_phy2log({0, 1, 2, 3, 0, 1}, 1, 4, 6, 1, 1, 2);
  Placement candidate = rebalance(w, 6, 1, 1, 2);
  GateDecision d = rebalance_gate(w, current, candidate, 0.5, 0.05);
  EXPECT_DOUBLE_EQ(d.s0, 12.0 / 11.0);
  EXPECT_DOUBLE_EQ(d.s1, 1.0);
  // 1 / (0.5 / (12/11) + 0.5) = 1 / (11/24 + 12/24) = 24/23 = 1.0435.
  EXPECT_NEAR(d.end_to_end, 24.0 / 23.0, 1e-12);
  EXPECT_FALSE(d.rebalance);
  EXPECT_TRUE(rebalance_gate(w, current, candidate, 0.5, 0.04).rebalance);
}
