// The routing simulator against values computed without it: exact expectations by brute-force
// enumeration of every outcome of small cases, the exact uniform forms, and known constants.
// Each statistical check allows 4.5 standard errors (a false alarm about once in 150,000 runs
// per check; the seeds are fixed, so a run is reproducible) and also shows that a wrong model
// is rejected, so the checks have the power to catch a wrong simulator.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <nlohmann/json.hpp>
#include <set>

#include "expect_error.h"
#include "moekit/check.h"
#include "moekit/plan.h"
#include "moekit/simulate.h"
#include "moekit/trace.h"

using namespace moekit;

namespace {

SimulateInput sim_input(int E, int k, int P, int64_t B, int64_t trials, const std::string& routing = "uniform",
                        uint64_t seed = 1) {
  SimulateInput in;
  in.num_experts = E;
  in.topk = k;
  in.num_ranks = P;
  in.batch = B;
  in.trials = trials;
  in.seed = seed;
  in.routing = parse_routing(routing);
  return in;
}

constexpr double kZ = 4.5;

void expect_agrees(const Metric& m, double exact, const char* what) {
  if (m.std_error == 0) {  // the figure never varies (e.g. k = 3 of 4 experts always reach both ranks)
    EXPECT_NEAR(m.simulated, exact, 1e-12) << what;
    return;
  }
  double z = (m.simulated - exact) / m.std_error;
  EXPECT_LT(std::abs(z), kZ) << what << ": simulated " << m.simulated << " +- " << m.std_error << ", exact " << exact;
}

void expect_rejects(const Metric& m, double wrong, const char* what) {
  double z = (m.simulated - wrong) / m.std_error;
  EXPECT_GT(std::abs(z), 3 * kZ) << what << ": a wrong value " << wrong << " was not rejected (z = " << z << ")";
}

// Exact expectations of the four figures, by enumerating every way B tokens can pick k
// distinct experts, each ordered pick sequence weighted by the successive-sampling law
// Π_j w_{e_j} / (W − w_{e_1} − … − w_{e_{j−1}}). With `with_replacement` each pick is instead
// independent (a wrong model, used to show the checks would catch it).
struct Exact {
  double coverage = 0, dedup = 0, s0 = 0, cv2 = 0;
};

Exact enumerate(const std::vector<double>& w, int k, int P, int B, bool with_replacement = false) {
  const int E = int(w.size());
  const double W = std::accumulate(w.begin(), w.end(), 0.0);
  // Every ordered k-sequence of experts with its probability.
  std::vector<std::pair<std::vector<int>, double>> picks;
  std::vector<int> seq;
  auto is_taken = [&](int e) { return std::find(seq.begin(), seq.end(), e) != seq.end(); };
  std::function<void(double)> rec = [&](double prob) {
    if (int(seq.size()) == k) {
      picks.push_back({seq, prob});
      return;
    }
    double left = 0;  // summed afresh, not W minus the taken: tiny weights keep their digits
    for (int e = 0; e < E; ++e)
      if (!is_taken(e)) left += w[e];
    for (int e = 0; e < E; ++e) {
      if (is_taken(e) && !with_replacement) continue;
      double p = w[e] / (with_replacement ? W : left);
      seq.push_back(e);
      rec(prob * p);
      seq.pop_back();
    }
  };
  rec(1.0);
  Exact x;
  const int per_rank = E / P;
  std::vector<int> choice(B, 0);
  while (true) {
    double prob = 1;
    std::vector<int> loads(E, 0);
    double distinct = 0;
    for (int t = 0; t < B; ++t) {
      const auto& [experts, p] = picks[choice[t]];
      prob *= p;
      std::set<int> ranks;
      for (int e : experts) ++loads[e], ranks.insert(e / per_rank);
      distinct += double(ranks.size());
    }
    int hit = 0, max_rank = 0;
    double ss = 0, mean = double(B) * k / E;
    for (int r = 0; r < P; ++r) {
      int rank_load = 0;
      for (int e = r * per_rank; e < (r + 1) * per_rank; ++e) rank_load += loads[e];
      max_rank = std::max(max_rank, rank_load);
    }
    for (int e = 0; e < E; ++e) hit += loads[e] > 0, ss += (loads[e] - mean) * (loads[e] - mean);
    x.coverage += prob * hit / E;
    x.dedup += prob * distinct / B;
    x.s0 += prob * max_rank / (double(B) * k / P);
    x.cv2 += prob * ss / E / (mean * mean);
    int t = 0;  // next combination (an odometer over tokens)
    while (t < B && ++choice[t] == int(picks.size())) choice[t++] = 0;
    if (t == B) break;
  }
  return x;
}

void expect_matches_enumeration(const SimulateResult& r, const Exact& x, const std::string& what) {
  SCOPED_TRACE(what);
  expect_agrees(r.coverage, x.coverage, "coverage");
  expect_agrees(r.dedup_targets, x.dedup, "dedup_targets");
  expect_agrees(r.s0, x.s0, "s0");
  expect_agrees(r.cv_expert, std::sqrt(x.cv2), "cv_expert");
}

}  // namespace

// ---- Small cases: every outcome enumerated --------------------------------------------------

TEST(SimulateExact, UniformSmallCaseMatchesEnumeration) {
  // E = 4, k = 2, P = 2, B = 3: 12^3 ordered outcomes.
  SimulateResult r = simulate(sim_input(4, 2, 2, 3, 20000));
  Exact x = enumerate({1, 1, 1, 1}, 2, 2, 3);
  expect_matches_enumeration(r, x, "uniform E4 k2 P2 B3");
  // By hand: a token's 2 distinct experts share a rank with probability 1/3 (its partner on
  // the same rank is 1 of the 3 others): dedup = 2 − 1/3 = 5/3. Sampling with replacement would
  // give 2 − 1/2 = 1.5; the simulator must be far from that.
  EXPECT_NEAR(x.dedup, 5.0 / 3.0, 1e-12);
  expect_rejects(r.dedup_targets, enumerate({1, 1, 1, 1}, 2, 2, 3, true).dedup, "with replacement");
  // Coverage: an expert is missed by a token with probability 1 − 2/4, by all 3 with 1/8.
  EXPECT_NEAR(x.coverage, 1 - 1.0 / 8, 1e-12);
}

TEST(SimulateExact, SkewedSmallCasesMatchEnumeration) {
  // Successive sampling without replacement by weight, checked against the exact law.
  struct Case {
    std::string routing;
    std::vector<double> weights;
    int k;
  };
  for (const Case& c : {Case{"hot:1:3", {3, 1, 1, 1}, 2}, Case{"zipf:1", {1, 1.0 / 2, 1.0 / 3, 1.0 / 4}, 2},
                        Case{"hot:2:5", {5, 5, 1, 1}, 3}}) {
    SimulateResult r = simulate(sim_input(4, c.k, 2, 3, 15000, c.routing, 7));
    Exact x = enumerate(c.weights, c.k, 2, 3);
    expect_matches_enumeration(r, x, c.routing);
    // Drawing the k experts independently by weight (with replacement) is a different law.
    expect_rejects(r.dedup_targets, enumerate(c.weights, c.k, 2, 3, true).dedup, "with replacement");
    expect_rejects(r.coverage, enumerate(c.weights, c.k, 2, 3, true).coverage, "with replacement");
  }
}

TEST(SimulateExact, ExtremeWeightsUseTheExactFallback) {
  // hot:2:1e12 with k = 3: the two hot experts are nearly certain, and the third pick must
  // come from the two cold ones, which a redraw from the full weights almost never reaches
  // (the sampler then draws among the untaken experts directly). Experts 0, 1 on rank 0,
  // 2, 3 on rank 1: every token reaches both ranks, and GPU 0 holds 2 of 3 picks per token.
  SimulateResult r = simulate(sim_input(4, 3, 2, 3, 5000, "hot:2:1e12", 3));
  Exact x = enumerate({1e12, 1e12, 1, 1}, 3, 2, 3);
  EXPECT_NEAR(x.s0, 4.0 / 3.0, 1e-9);  // max load 2·3 = 6 over the mean 3·3/2 = 4.5
  EXPECT_NEAR(r.s0.simulated, 4.0 / 3.0, 1e-9);
  EXPECT_NEAR(r.dedup_targets.simulated, 2.0, 1e-12);
  expect_agrees(r.coverage, x.coverage, "coverage");  // 1/2 + 1/2·(1 − (1/2)^3) = 0.9375
  EXPECT_NEAR(x.coverage, 0.9375, 1e-9);
  // zipf:30 (weights 1, 2^−30, 3^−30, 4^−30): picks 2 and 3 come from the fallback, and the
  // third must still follow the weights, 3^−30 : 4^−30 = 5600 : 1.
  r = simulate(sim_input(4, 3, 2, 3, 5000, "zipf:30", 3));
  x = enumerate(expert_weights(parse_routing("zipf:30"), 4), 3, 2, 3);
  expect_matches_enumeration(r, x, "zipf:30");
  EXPECT_NEAR(x.coverage, 0.75 + 0.25 * (1 - std::pow(1 - 1 / (1 + std::pow(4.0 / 3, 30)), 3)), 1e-9);
}

// Routing parameters at the ends of their range keep their law. hot:8:1e308's weights sum to
// inf as doubles (the alias table then drew every expert alike); zipf:1000's weights of experts
// 2 and up underflow to 0 (the untaken fallback then always took the last expert).
TEST(SimulateExact, ExtremeRoutingParametersKeepTheirLaw) {
  // Experts 0-7 are the hot ones, 10^308 times as likely: every pick is one of them, and they
  // all sit on rank 0 of 2, so S0 is exactly 2 and every token reaches one rank.
  SimulateResult r = simulate(sim_input(16, 2, 2, 4, 200, "hot:8:1e308", 5));
  EXPECT_DOUBLE_EQ(r.s0.simulated, 2.0);
  EXPECT_DOUBLE_EQ(r.dedup_targets.simulated, 1.0);
  for (int64_t i = 0; i < 20; ++i)
    for (int32_t e : sample_step(sim_input(16, 2, 2, 64, 200, "hot:8:1e308", 5), i)) EXPECT_LT(e, 8) << "sample " << i;
  // zipf:1000: each next expert is 2^1000 times likelier than the one after, so every token
  // takes experts 0, 1, 2, 3 (the chance of anything else is below 10^-120).
  const std::vector<double> lw = expert_log_weights(parse_routing("zipf:1000"), 8);
  EXPECT_DOUBLE_EQ(lw[7], -1000 * std::log(8.0));
  EXPECT_EQ(expert_weights(parse_routing("zipf:1000"), 8)[7], 0.0);  // as plain doubles
  // hot:8:1e308's weights, scaled by 2^-1023, keep the ratio 1e308 exactly and sum to a finite value.
  const std::vector<double> hot = expert_weights(parse_routing("hot:8:1e308"), 16);
  EXPECT_EQ(hot[0] / hot[15], 1e308);
  EXPECT_TRUE(std::isfinite(std::accumulate(hot.begin(), hot.end(), 0.0)));
  const SimulateInput z = sim_input(8, 4, 2, 32, 200, "zipf:1000", 3);
  for (int64_t i = 0; i < 20; ++i) {
    const std::vector<int32_t> idx = sample_step(z, i);
    for (size_t t = 0; t < idx.size(); t += 4)
      EXPECT_EQ(std::set<int32_t>(idx.begin() + t, idx.begin() + t + 4), (std::set<int32_t>{0, 1, 2, 3}))
          << "sample " << i << " token " << t / 4;
  }
  r = simulate(z);
  // Experts 0-3 sit on rank 0 of 2: all of a token's picks land there, and half the experts are hit.
  EXPECT_DOUBLE_EQ(r.s0.simulated, 2.0);
  EXPECT_DOUBLE_EQ(r.coverage.simulated, 0.5);
}

// ---- Large uniform cases against the closed forms ----------------------------------------------

TEST(SimulateUniform, CoverageDedupAndCvAgreeWithTheClosedForms) {
  // The EP32 case of docs/theory.md §All-to-all bytes: E = 256, k = 8, P = 32, B = 64.
  SimulateResult r = simulate(sim_input(256, 8, 32, 64, 2000));
  // Coverage: 1 − (31/32)^64 = 0.868916, exact for uniform top-k.
  expect_agrees(r.coverage, 1 - std::pow(31.0 / 32, 64), "coverage");
  // CV_e = sqrt((1 − 1/32)/(64/32)) = 0.695971, exact (one expert's load is Binomial(64, 1/32)).
  expect_agrees(r.cv_expert, std::sqrt((1 - 1.0 / 32) / 2.0), "cv_expert");
  // Distinct ranks: exact for k distinct experts, 32·[1 − Π_{i<8} (248 − i)/(256 − i)] = 7.2668;
  // The closed form's 7.18 assumes picks with replacement and is rejected at this precision.
  double none = 1;
  for (int i = 0; i < 8; ++i) none *= (248.0 - i) / (256.0 - i);
  expect_agrees(r.dedup_targets, 32 * (1 - none), "dedup exact");
  ASSERT_TRUE(r.dedup_targets.reference.has_value());
  EXPECT_NEAR(*r.dedup_targets.reference, 32 * (1 - none), 1e-12);
  EXPECT_NEAR(r.dedup_targets.closed_form, 7.18, 0.005);
  expect_rejects(r.dedup_targets, r.dedup_targets.closed_form, "with-replacement closed form");
  // A CV off by 2% would be caught too.
  expect_rejects(r.cv_expert, 1.02 * std::sqrt((1 - 1.0 / 32) / 2.0), "CV off by 2%");
}

TEST(SimulateUniform, ImbalanceBelowTheSqrt2LnPBound) {
  // docs/theory.md §Statistical skew at B/P = 48, P = 32: the closed form says 1.132. E[max of 32 standard
  // normals] is 2.0697, below sqrt(2 ln 32) = 2.6328, so the true S₀ is lower: with the GPU
  // loads' hypergeometric variance 1536·8·(1/32)(31/32)(248/255) = 361.75 (σ = 19.02 on a mean
  // of 384) and their fixed sum (factor sqrt(32/31)), S₀ ≈ 1 + 2.0697·1.01600·19.020/384 = 1.1042.
  SimulateResult r = simulate(sim_input(256, 8, 32, 1536, 400));
  const double gaussian = 1 + 2.0697 * std::sqrt(32.0 / 31) * std::sqrt(361.7506) / 384;
  ASSERT_TRUE(r.s0.reference.has_value());
  EXPECT_NEAR(*r.s0.reference, gaussian, 2e-4);
  // The Gaussian reference ignores the loads' small skewness: allow 0.004 on top of the noise.
  EXPECT_LT(std::abs(r.s0.simulated - gaussian), kZ * r.s0.std_error + 0.004)
      << r.s0.simulated << " +- " << r.s0.std_error;
  EXPECT_NEAR(r.s0.closed_form, 1.132237, 1e-6);
  expect_rejects(r.s0, r.s0.closed_form, "sqrt(2 ln P) form");
}

TEST(SimulateUniform, ExpectedMaxOfNormals) {
  // Exact: n = 2: 1/sqrt(π); n = 3: 3/(2 sqrt(π)). Tabulated (Harter 1961): n = 4: 1.029375,
  // n = 5: 1.162964, n = 10: 1.538753.
  EXPECT_NEAR(expected_max_std_normal(1), 0.0, 1e-12);
  EXPECT_NEAR(expected_max_std_normal(2), 1 / std::sqrt(M_PI), 1e-9);
  EXPECT_NEAR(expected_max_std_normal(3), 1.5 / std::sqrt(M_PI), 1e-9);
  EXPECT_NEAR(expected_max_std_normal(4), 1.029375, 2e-6);
  EXPECT_NEAR(expected_max_std_normal(5), 1.162964, 2e-6);
  EXPECT_NEAR(expected_max_std_normal(10), 1.538753, 2e-6);
}

TEST(SimulateSkewed, HotExpertsOnOneGpu) {
  // hot:8:4 on DeepSeek-V3's E = 256, k = 8 over 8 GPUs: GPU 0 holds the 8 hot experts and 24
  // cold ones, weight 8·4 + 24 = 56 of 8·4 + 248 = 280, against 35 for an even share: about
  // 1.6 with independent picks; picking distinct experts caps the hot ones at one pick each per
  // token, which pulls S₀ a little lower.
  SimulateResult r = simulate(sim_input(256, 8, 8, 1024, 200, "hot:8:4"));
  EXPECT_GT(r.s0.simulated, 1.5);
  EXPECT_LT(r.s0.simulated, 1.6);
  EXPECT_GT(r.s0.gap(), 0.4);  // far above the uniform closed form
  EXPECT_FALSE(r.s0.reference.has_value());  // no uniform reference for skewed routing
}

// ---- Determinism, samples and traces ---------------------------------------------------------

TEST(SimulateDeterminism, SeedNotThreads) {
  SimulateInput in = sim_input(64, 6, 8, 128, 700, "zipf:0.8", 42);
  in.num_threads = 1;
  SimulateResult a = simulate(in);
  in.num_threads = 3;
  SimulateResult b = simulate(in);
  EXPECT_EQ(simulate_to_json(a), simulate_to_json(b));  // every digit
  in.seed = 43;
  EXPECT_NE(simulate(in).s0.simulated, a.s0.simulated);
  // A fixed seed gives the same first indices on every machine (mt19937_64 and moekit's own
  // distributions are fully specified). Recorded once; a change here breaks saved traces' reproducibility.
  std::vector<int32_t> s = sample_step(sim_input(256, 8, 8, 1, 2, "uniform", 1), 0);
  std::vector<int32_t> again = sample_step(sim_input(256, 8, 8, 1, 2, "uniform", 1), 0);
  EXPECT_EQ(s, again);
}

TEST(SimulateTrace, SamplesAreDistinctAndTheTraceHoldsThem) {
  SimulateInput in = sim_input(64, 6, 8, 32, 5, "hot:4:10", 9);
  for (int64_t i = 0; i < 5; ++i) {
    std::vector<int32_t> s = sample_step(in, i);
    ASSERT_EQ(s.size(), 32u * 6);
    for (int t = 0; t < 32; ++t) {
      std::set<int32_t> picked(s.begin() + t * 6, s.begin() + (t + 1) * 6);
      EXPECT_EQ(picked.size(), 6u) << "token " << t << " picked an expert twice";
      for (int32_t e : picked) EXPECT_TRUE(e >= 0 && e < 64);
    }
  }
  // layers[l][s] is sample s·L + l.
  RoutingTrace t = sample_trace(in, 2, 3);
  ASSERT_EQ(t.num_layers(), 2);
  ASSERT_EQ(t.num_steps(0), 3);
  EXPECT_EQ(t.num_ranks, 8);
  for (int l = 0; l < 2; ++l)
    for (int s = 0; s < 3; ++s) EXPECT_EQ(t.layers[l][s], sample_step(in, s * 2 + l));
  // With one layer and steps = trials the trace holds exactly the samples of the statistics.
  RoutingTrace one = sample_trace(in, 1, in.trials);
  double coverage = 0;
  for (const auto& step : one.layers[0]) {
    std::set<int32_t> hit(step.begin(), step.end());
    coverage += double(hit.size()) / 64 / double(in.trials);
  }
  EXPECT_NEAR(simulate(in).coverage.simulated, coverage, 1e-12);
  // Through the file format and back.
  std::string path = ::testing::TempDir() + "moekit_simulate_trace.json";
  write_trace(t, path);
  RoutingTrace back = read_trace(path);
  EXPECT_EQ(back.layers, t.layers);
  EXPECT_EQ(back.num_experts, 64);
  EXPECT_EQ(back.topk, 6);
  std::remove(path.c_str());
}

// ---- Parsing and bad input ---------------------------------------------------------------------

TEST(SimulateParse, Routing) {
  EXPECT_EQ(parse_routing("uniform").kind, Routing::Kind::uniform);
  Routing z = parse_routing("zipf:1.2");
  EXPECT_EQ(z.kind, Routing::Kind::zipf);
  EXPECT_DOUBLE_EQ(z.zipf_s, 1.2);
  Routing h = parse_routing("hot:4:3.5");
  EXPECT_EQ(h.kind, Routing::Kind::hot);
  EXPECT_EQ(h.hot_count, 4);
  EXPECT_DOUBLE_EQ(h.hot_ratio, 3.5);
  EXPECT_EQ(to_string(h), "hot:4:3.5");
  // Weights: zipf (i + 1)^−s, hot first H experts × R, scaled by a power of two to put the
  // largest in [1, 2).
  std::vector<double> w = expert_weights(parse_routing("zipf:2"), 3);
  EXPECT_DOUBLE_EQ(w[0], 1.0);
  EXPECT_DOUBLE_EQ(w[1], 0.25);
  EXPECT_DOUBLE_EQ(w[2], 1.0 / 9);
  EXPECT_EQ(expert_weights(h, 6), (std::vector<double>{1.75, 1.75, 1.75, 1.75, 0.5, 0.5}));  // 3.5 : 1, / 2
  expect_error([] { parse_routing("gauss"); }, {"'gauss' is unknown", "uniform, zipf:S or hot:H:R"});
  expect_error([] { parse_routing("zipf:"); }, {"is not a number"});
  expect_error([] { parse_routing("zipf:-1"); }, {"zipf:-1", ">= 0"});
  expect_error([] { parse_routing("hot:4"); }, {"expected hot:H:R"});
  expect_error([] { parse_routing("hot:x:2"); }, {"'x' is not an integer"});
  expect_error([] { parse_routing("hot:0:2"); }, {"H (hot experts) must be >= 1"});
  expect_error([] { parse_routing("hot:4:0"); }, {"must be > 0"});
  expect_error([] { expert_weights(parse_routing("hot:300:2"), 256); }, {"H = 300", "exceeds E = 256"});
}

// drift:H:R:PERIOD: hot:H:R whose hot block moves on by H experts every PERIOD steps.
TEST(SimulateParse, DriftRouting) {
  const Routing d = parse_routing("drift:2:4.5:10");
  EXPECT_EQ(d.kind, Routing::Kind::drift);
  EXPECT_EQ(d.hot_count, 2);
  EXPECT_DOUBLE_EQ(d.hot_ratio, 4.5);
  EXPECT_EQ(d.drift_period, 10);
  EXPECT_EQ(to_string(d), "drift:2:4.5:10");
  EXPECT_EQ(expert_weights(d, 6), (std::vector<double>{1.125, 1.125, 0.25, 0.25, 0.25, 0.25}));  // 4.5 : 1, / 4
  EXPECT_EQ(routing_shift(d, 6, 9), 0);
  EXPECT_EQ(routing_shift(d, 6, 10), 2);
  EXPECT_EQ(routing_shift(d, 6, 29), 4);
  EXPECT_EQ(routing_shift(d, 6, 30), 0);  // (3 * 2) mod 6
  EXPECT_EQ(expert_weights_at(d, 6, 25), (std::vector<double>{0.25, 0.25, 0.25, 0.25, 1.125, 1.125}));
  EXPECT_EQ(routing_shift(parse_routing("hot:2:4.5"), 6, 25), 0);
  expect_error([] { parse_routing("drift:2:3"); }, {"'drift:2:3'", "expected drift:H:R:PERIOD"});
  expect_error([] { parse_routing("drift:2:3:x"); }, {"PERIOD 'x' is not an integer"});
  expect_error([] { parse_routing("drift:2:3:0"); }, {"drift:2:3:0", "PERIOD (steps between two drifts) must be >= 1"});
  expect_error([] { parse_routing("drift:0:3:5"); }, {"H (hot experts) must be >= 1"});
  expect_error([] { parse_routing("drift:2:-1:5"); }, {"R (how much likelier a hot expert is) must be > 0"});
  expect_error([] { expert_weights(parse_routing("drift:9:2:5"), 8); }, {"H = 9", "exceeds E = 8"});
}

// A drifting trace: every step's most picked experts are the hot block of the step's phase,
// in every layer; each phase's samples are hot:H:R's with the ids rotated.
TEST(SimulateTrace, DriftMovesTheHotBlock) {
  SimulateInput in = sim_input(16, 2, 4, 64, 2, "drift:2:50:3", 7);
  const RoutingTrace t = sample_trace(in, 2, 9);
  for (int l = 0; l < 2; ++l)
    for (int s = 0; s < 9; ++s) {
      std::vector<int> count(16, 0);
      for (int32_t e : t.layers[l][s]) ++count[e];
      const int first = (s / 3) * 2 % 16;
      std::vector<int> order(16);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return count[a] > count[b]; });
      EXPECT_EQ(std::set<int>({order[0], order[1]}), std::set<int>({first, first + 1})) << "layer " << l << " step " << s;
    }
  // Phase 1 of the trace is phase 0's law rotated by 2: sample 2·3 + 1 (step 3, layer 1) of the
  // drift equals the same sample of hot:2:50 with every id + 2.
  SimulateInput hot = in;
  hot.routing = parse_routing("hot:2:50");
  const RoutingTrace h = sample_trace(hot, 2, 9);
  std::vector<int32_t> rotated = h.layers[1][3];
  for (int32_t& e : rotated) e = (e + 2) % 16;
  EXPECT_EQ(t.layers[1][3], rotated);
  EXPECT_EQ(t.layers[0][0], h.layers[0][0]);
}

TEST(SimulateParse, BadInputIsNamed) {
  expect_error([] { simulate(sim_input(256, 8, 3, 64, 10)); }, {"--ranks = 3", "divide E = 256"});
  expect_error([] { simulate(sim_input(256, 0, 8, 64, 10)); }, {"--topk = 0"});
  expect_error([] { simulate(sim_input(8, 9, 8, 64, 10)); }, {"--topk = 9", "[1, E = 8]"});
  expect_error([] { simulate(sim_input(256, 8, 8, 0, 10)); }, {"--batch = 0"});
  expect_error([] { simulate(sim_input(256, 8, 8, 64, 1)); }, {"--trials = 1", ">= 2"});
  expect_error([] { simulate(sim_input(256, 8, 0, 64, 10)); }, {"--ranks = 0"});
  expect_error([] { sample_trace(sim_input(256, 8, 8, 12, 10), 1, 10); }, {"--batch = 12", "multiple of --ranks = 8"});
  expect_error([] { sample_trace(sim_input(256, 8, 8, 16, 10), 0, 10); }, {"--layers = 0"});
}

// Trials and batch are bounded alone, and their product too: 2^22 trials of 2^24 tokens top-8
// would take weeks.
TEST(SimulateParse, WorkIsBounded) {
  expect_error([] { simulate(sim_input(256, 8, 8, int64_t(1) << 24, int64_t(1) << 22)); },
               {"--trials = 4194304 x --batch = 16777216 x topk = 8 = 562949953421312 expert picks",
                "more than the limit of 17179869184", "lower --trials or --batch"});
  // Just past the bound: 1025 x 2^21 x 8 = 2^34 + 2^24.
  expect_error([] { simulate(sim_input(256, 8, 8, int64_t(1) << 21, 1025)); }, {"--trials = 1025", "--batch = 2097152"});
  // One sample is one sample: sample_step (moekit run's routing) does not count the trials.
  EXPECT_EQ(sample_step(sim_input(16, 8, 1, 1 << 16, int64_t(1) << 22), 0).size(), size_t(8) << 16);
}
