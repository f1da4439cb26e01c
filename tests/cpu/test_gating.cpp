// Gating: router GEMM, softmax top-k, DeepSeek-V3 group-limited sigmoid routing, ties, bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moekit/check.h"
#include "moekit/gating.h"
#include "moekit/spec.h"

using namespace moekit;

namespace {

struct Routed {
  std::vector<int32_t> idx;
  std::vector<float> weights;
};

Routed route(const std::vector<float>& logits, int num_experts, int k, const RouterSpec& router,
             const float* bias = nullptr) {
  const int num_tokens = int(logits.size()) / num_experts;
  Routed r{std::vector<int32_t>(size_t(num_tokens) * k, -7), std::vector<float>(size_t(num_tokens) * k, -7.0f)};
  ref::select_experts(logits.data(), num_tokens, num_experts, k, router, bias, r.idx.data(), r.weights.data());
  return r;
}

// The logit whose sigmoid is s: lets a test state its sigmoid scores directly.
float logit_of(double s) { return float(std::log(s / (1.0 - s))); }
double sigmoid(float logit) { return 1.0 / (1.0 + std::exp(-double(logit))); }

RouterSpec softmax_router(bool normalize) {
  RouterSpec r;
  r.scoring = "softmax";
  r.normalize_topk = normalize;
  return r;
}

}  // namespace

TEST(Gating, RouterLogitsMatchIntegerDotProducts) {
  const int tokens = 3, hidden = 256, experts = 5;
  std::vector<float> x(tokens * hidden), w(experts * hidden), logits(tokens * experts);
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < hidden; ++i) x[t * hidden + i] = float((i * (t + 3)) % 7 - 3);
  for (int e = 0; e < experts; ++e)
    for (int i = 0; i < hidden; ++i) w[e * hidden + i] = float((e + 1) * (i % 5 - 2));
  ref::router_logits(x.data(), tokens, hidden, w.data(), experts, logits.data());
  for (int t = 0; t < tokens; ++t)
    for (int e = 0; e < experts; ++e) {
      long long want = 0;
      for (int i = 0; i < hidden; ++i) want += (long long)((i * (t + 3)) % 7 - 3) * ((e + 1) * (i % 5 - 2));
      EXPECT_EQ(logits[t * experts + e], float(want)) << t << " " << e;
    }
}

TEST(Gating, SoftmaxTopkRenormalised) {
  // logits 1, 2, 3, 0.5: top-2 is {2, 1}; renormalised weights e^3/(e^3+e^2) = sigmoid(1) and sigmoid(-1).
  Routed r = route({1.0f, 2.0f, 3.0f, 0.5f}, 4, 2, softmax_router(true));
  EXPECT_EQ(r.idx, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(r.weights[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-7);
  EXPECT_NEAR(r.weights[1], 1.0 / (1.0 + std::exp(1.0)), 1e-7);
}

TEST(Gating, SoftmaxTopkWithoutRenormalisation) {
  Routed r = route({1.0f, 2.0f, 3.0f, 0.5f}, 4, 2, softmax_router(false));
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + std::exp(0.5);
  EXPECT_EQ(r.idx, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(r.weights[0], std::exp(3.0) / z, 1e-7);
  EXPECT_NEAR(r.weights[1], std::exp(2.0) / z, 1e-7);
}

TEST(Gating, TiesGoToTheLowerIndex) {
  Routed r = route({1.0f, 5.0f, 1.0f, 5.0f, 1.0f, /*token 1*/ 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, 5, 3, softmax_router(true));
  EXPECT_EQ(r.idx, (std::vector<int32_t>{1, 3, 0, 0, 1, 2}));
  for (int j = 3; j < 6; ++j) EXPECT_NEAR(r.weights[j], 1.0 / 3.0, 1e-7);
  // Equal groups: the lower group wins too.
  RouterSpec grouped;
  grouped.scoring = "sigmoid";
  grouped.num_groups = 2;
  grouped.topk_groups = 1;
  Routed g = route({0.0f, 0.0f, 0.0f, 0.0f}, 4, 2, grouped);
  EXPECT_EQ(g.idx, (std::vector<int32_t>{0, 1}));
}

// DeepSeek-V3 style: 8 experts in 4 groups of 2, keep 2 groups, top-2, bias, factor 2.5.
// sigmoid scores    e0 .9  e1 .1 | e2 .6  e3 .6 | e4 .5  e5 .55 | e6 .2  e7 .3
// bias               0     0     |  0     0     | +.2    0      |  0    +.5
// biased (selection) .9    .1    | .6    .6     | .7    .55     | .2    .8
// group score (top-2 sum) 1.0    | 1.2          | 1.25          | 1.0   -> keep groups 2 and 1
// Within them: e4 (.7), then e2 and e3 tie at .6 -> e2. The globally best e0 (.9) and e7 (.8)
// sit in dropped groups; the unbiased ranking (e2 = e3 > e5 > e4) would pick e2, e3 instead.
TEST(Gating, DeepSeekGroupLimitedSelectionUsesBiasButUnbiasedWeights) {
  const std::vector<double> s = {0.9, 0.1, 0.6, 0.6, 0.5, 0.55, 0.2, 0.3};
  const std::vector<float> bias = {0, 0, 0, 0, 0.2f, 0, 0, 0.5f};
  std::vector<float> logits;
  for (double v : s) logits.push_back(logit_of(v));
  RouterSpec ds;
  ds.scoring = "sigmoid";
  ds.num_groups = 4;
  ds.topk_groups = 2;
  ds.routed_scaling_factor = 2.5;
  ds.normalize_topk = true;
  Routed r = route(logits, 8, 2, ds, bias.data());
  EXPECT_EQ(r.idx, (std::vector<int32_t>{4, 2}));
  const double s4 = sigmoid(logits[4]), s2 = sigmoid(logits[2]);
  EXPECT_NEAR(r.weights[0], 2.5 * s4 / (s4 + s2), 1e-6);  // 2.5 * .5 / 1.1
  EXPECT_NEAR(r.weights[1], 2.5 * s2 / (s4 + s2), 1e-6);
  EXPECT_NEAR(r.weights[0], 2.5 * 0.5 / 1.1, 1e-6);

  // No group limit: the biased top-2 is e0 (.9), e7 (.8); e7's weight is its unbiased .3.
  ds.num_groups = 1;
  ds.topk_groups = 1;
  r = route(logits, 8, 2, ds, bias.data());
  EXPECT_EQ(r.idx, (std::vector<int32_t>{0, 7}));
  EXPECT_NEAR(r.weights[0], 2.5 * 0.9 / 1.2, 1e-6);
  EXPECT_NEAR(r.weights[1], 2.5 * 0.3 / 1.2, 1e-6);

  // Without renormalisation the weights are the scaled sigmoids themselves.
  ds.normalize_topk = false;
  r = route(logits, 8, 2, ds, bias.data());
  EXPECT_NEAR(r.weights[0], 2.5 * 0.9, 1e-6);
  EXPECT_NEAR(r.weights[1], 2.5 * 0.3, 1e-6);
}

// A group's score is the sum of its top two, not its maximum: group 0 has the single best
// expert (.95) but a weak second; group 1 (.8 + .8) wins with one group kept.
TEST(Gating, GroupScoreIsTheSumOfTheTopTwo) {
  std::vector<float> logits;
  for (double v : {0.95, 0.05, 0.8, 0.8}) logits.push_back(logit_of(v));
  RouterSpec ds;
  ds.scoring = "sigmoid";
  ds.num_groups = 2;
  ds.topk_groups = 1;
  Routed r = route(logits, 4, 1, ds);
  EXPECT_EQ(r.idx, (std::vector<int32_t>{2}));
  EXPECT_NEAR(r.weights[0], 1.0, 1e-7);
}

// The embedded DeepSeek-V3 router on random logits: every pick lies in one of the 4 best
// groups (recomputed here by sorting), picks are the best biased scores there, weights sum to 2.5.
TEST(Gating, DeepSeekV3SpecOnRandomLogits) {
  const ModelSpec spec = load_model_spec("deepseek-v3");
  const int E = spec.num_routed_experts, k = spec.num_experts_per_token, T = 64;
  const int G = spec.router.num_groups, group_size = E / G;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(size_t(T) * E), bias(E);
  for (float& v : logits) v = normal(rng);
  for (float& v : bias) v = 0.1f * normal(rng);
  Routed r = route(logits, E, k, spec.router, bias.data());
  for (int t = 0; t < T; ++t) {
    std::vector<double> sel(E);
    for (int e = 0; e < E; ++e) sel[e] = sigmoid(logits[t * E + e]) + bias[e];
    std::vector<std::pair<double, int>> groups;
    for (int g = 0; g < G; ++g) {
      std::vector<double> m(sel.begin() + g * group_size, sel.begin() + (g + 1) * group_size);
      std::sort(m.rbegin(), m.rend());
      groups.push_back({m[0] + m[1], g});
    }
    std::sort(groups.rbegin(), groups.rend());
    std::vector<std::pair<double, int>> candidates;
    for (int i = 0; i < spec.router.topk_groups; ++i)
      for (int e = groups[i].second * group_size; e < (groups[i].second + 1) * group_size; ++e)
        candidates.push_back({sel[e], e});
    std::sort(candidates.rbegin(), candidates.rend());
    double sum = 0;
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(r.idx[t * k + j], candidates[j].second) << "token " << t << " rank " << j;
      sum += r.weights[t * k + j];
    }
    EXPECT_NEAR(sum, spec.router.routed_scaling_factor, 1e-5);
  }
}

TEST(Gating, NonFiniteLogitsNameTokenAndExpert) {
  std::vector<float> logits(3 * 4, 0.5f);
  logits[1 * 4 + 3] = NAN;
  std::vector<int32_t> idx(6, -7);
  std::vector<float> w(6, -7.0f);
  try {
    ref::select_experts(logits.data(), 3, 4, 2, softmax_router(true), nullptr, idx.data(), w.data());
    FAIL() << "NaN logit accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 1 expert 3"), std::string::npos) << e.what();
  }
  EXPECT_EQ(idx, std::vector<int32_t>(6, -7));  // nothing written
  logits[1 * 4 + 3] = -INFINITY;
  EXPECT_THROW(ref::select_experts(logits.data(), 3, 4, 2, softmax_router(true), nullptr, idx.data(), w.data()), Error);
}

TEST(Gating, BadRouterArgumentsAreErrors) {
  std::vector<float> logits(8, 0.0f), bias(8, 0.0f);
  std::vector<int32_t> idx(16);
  std::vector<float> w(16);
  auto call = [&](int k, RouterSpec router, const float* b = nullptr) {
    ref::select_experts(logits.data(), 1, 8, k, router, b, idx.data(), w.data());
  };
  EXPECT_THROW(call(9, softmax_router(true)), Error);  // k > E
  EXPECT_THROW(call(0, softmax_router(true)), Error);
  RouterSpec r = softmax_router(true);
  r.scoring = "relu";
  EXPECT_THROW(call(2, r), Error);
  r = softmax_router(true);
  r.num_groups = 3;  // does not divide 8
  EXPECT_THROW(call(2, r), Error);
  r.num_groups = 4;
  r.topk_groups = 5;
  EXPECT_THROW(call(2, r), Error);
  r.topk_groups = 1;  // one group of 2 experts cannot hold k = 3
  EXPECT_THROW(call(3, r), Error);
  r = softmax_router(true);
  r.routed_scaling_factor = 0.0;
  EXPECT_THROW(call(2, r), Error);
  bias[5] = NAN;
  EXPECT_THROW(call(2, softmax_router(true), bias.data()), Error);
}

// gpt-oss's router: a linear layer with bias, then top-k on the logits and a softmax over those k.
TEST(Gating, RouterLogitBiasIsAdded) {
  const int tokens = 2, hidden = 128, experts = 3;
  std::vector<float> x(tokens * hidden, 1.0f), w(experts * hidden, 0.5f), logits(tokens * experts);
  const float bias[experts] = {0.25f, -1.0f, 3.0f};
  ref::router_logits(x.data(), tokens, hidden, w.data(), experts, logits.data(), bias);
  for (int t = 0; t < tokens; ++t)
    for (int e = 0; e < experts; ++e) EXPECT_EQ(logits[t * experts + e], 64.0f + bias[e]) << t << " " << e;
  const float nan_bias[experts] = {0.0f, NAN, 0.0f};
  try {
    ref::router_logits(x.data(), tokens, hidden, w.data(), experts, logits.data(), nan_bias);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("logit bias of expert 1 is nan"), std::string::npos) << e.what();
  }
}

TEST(Gating, TopkThenSoftmaxOverTheK) {
  RouterSpec r;
  r.scoring = "topk_softmax";
  // Logits 1, 4, 2, 3: the top-2 are experts 1 and 3, weights softmax(4, 3) = e/(e+1), 1/(e+1).
  const Routed got = route({1.0f, 4.0f, 2.0f, 3.0f}, 4, 2, r);
  EXPECT_EQ(got.idx, (std::vector<int32_t>{1, 3}));
  const double e = std::exp(1.0);
  EXPECT_EQ(got.weights[0], float(e / (e + 1)));
  EXPECT_EQ(got.weights[1], float(1 / (e + 1)));
  // The same choice as softmax + renormalisation, and the same weights within fp32 rounding, on
  // random logits.
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(200 * 32);
  for (auto& v : logits) v = normal(rng);
  const Routed a = route(logits, 32, 4, r), b = route(logits, 32, 4, softmax_router(true));
  EXPECT_EQ(a.idx, b.idx);
  for (size_t i = 0; i < a.weights.size(); ++i) EXPECT_NEAR(a.weights[i], b.weights[i], 1e-6f * b.weights[i]) << i;
  // A huge logit does not overflow (the softmax is shifted by the largest chosen), and the other
  // three chosen are still the next largest logits (a softmax over all E would have underflowed
  // them to equal zeros).
  logits[5] = 1e30f;
  const Routed c = route(std::vector<float>(logits.begin(), logits.begin() + 32), 32, 4, r);
  std::vector<int32_t> order(32);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int x, int y) { return logits[x] > logits[y]; });
  EXPECT_EQ(c.idx, std::vector<int32_t>(order.begin(), order.begin() + 4));
  EXPECT_EQ(c.weights, (std::vector<float>{1.0f, 0.0f, 0.0f, 0.0f}));
  // It needs one group and normalisation.
  r.num_groups = 2;
  r.topk_groups = 2;
  EXPECT_THROW(route({1.0f, 4.0f, 2.0f, 3.0f}, 4, 2, r), Error);
  r.num_groups = 1;
  r.topk_groups = 1;
  r.normalize_topk = false;
  EXPECT_THROW(route({1.0f, 4.0f, 2.0f, 3.0f}, 4, 2, r), Error);
}
