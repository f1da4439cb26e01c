// Router GEMM and top-k selection (see include/moekit/gating.h).
#include "moekit/gating.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "moekit/check.h"

namespace moekit::ref {

void router_logits(const float* x, int num_tokens, int hidden, const float* router_weight, int num_experts,
                   float* logits, const float* logit_bias) {
  MOEKIT_CHECK(num_tokens >= 0 && hidden > 0 && num_experts > 0,
               fmt::format("router_logits: tokens {}, hidden {}, experts {}: expected tokens >= 0 and positive sizes",
                           num_tokens, hidden, num_experts));
  if (logit_bias)
    for (int e = 0; e < num_experts; ++e)
      MOEKIT_CHECK(std::isfinite(logit_bias[e]),
                   fmt::format("router_logits: logit bias of expert {} is {}, expected a finite value", e, logit_bias[e]));
  for (int t = 0; t < num_tokens; ++t) {
    const float* xt = x + size_t(t) * hidden;
    for (int e = 0; e < num_experts; ++e) {
      const float* we = router_weight + size_t(e) * hidden;
      double sum = logit_bias ? double(logit_bias[e]) : 0.0;
      for (int i = 0; i < hidden; ++i) sum += double(xt[i]) * double(we[i]);
      logits[size_t(t) * num_experts + e] = float(sum);
    }
  }
}

namespace {

void check_router(int num_experts, int k, const RouterSpec& router) {
  MOEKIT_CHECK(router.scoring == "softmax" || router.scoring == "sigmoid" || router.scoring == "topk_softmax",
               fmt::format("select_experts: scoring '{}', expected 'softmax', 'sigmoid' or 'topk_softmax'", router.scoring));
  MOEKIT_CHECK(router.scoring != "topk_softmax" || (router.num_groups == 1 && router.normalize_topk),
               fmt::format("select_experts: scoring 'topk_softmax' needs num_groups = 1 and normalize_topk, got {} and {}",
                           router.num_groups, router.normalize_topk));
  MOEKIT_CHECK(k >= 1 && k <= num_experts,
               fmt::format("select_experts: k = {}, expected 1 <= k <= E = {}", k, num_experts));
  MOEKIT_CHECK(router.num_groups >= 1 && num_experts % router.num_groups == 0,
               fmt::format("select_experts: num_groups = {} must divide E = {}", router.num_groups, num_experts));
  MOEKIT_CHECK(router.topk_groups >= 1 && router.topk_groups <= router.num_groups,
               fmt::format("select_experts: topk_groups = {}, expected 1 <= topk_groups <= num_groups = {}",
                           router.topk_groups, router.num_groups));
  const int group_size = num_experts / router.num_groups;
  MOEKIT_CHECK(k <= router.topk_groups * group_size,
               fmt::format("select_experts: k = {} exceeds the {} experts of the {} kept groups", k,
                           router.topk_groups * group_size, router.topk_groups));
  MOEKIT_CHECK(std::isfinite(router.routed_scaling_factor) && router.routed_scaling_factor > 0,
               fmt::format("select_experts: routed_scaling_factor = {}, expected a finite positive number",
                           router.routed_scaling_factor));
}

// Indices [0, n) of the `count` largest values, largest first; equal values: lower index first.
void top_indices(const std::vector<double>& values, int count, std::vector<int>& order) {
  order.resize(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + count, order.end(), [&](int a, int b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  order.resize(count);
}

}  // namespace

void select_experts(const float* logits, int num_tokens, int num_experts, int k, const RouterSpec& router,
                    const float* bias, int32_t* topk_idx, float* topk_weights) {
  MOEKIT_CHECK(num_tokens >= 0, fmt::format("select_experts: num_tokens = {}, expected >= 0", num_tokens));
  check_router(num_experts, k, router);
  for (int t = 0; t < num_tokens; ++t)
    for (int e = 0; e < num_experts; ++e) {
      float v = logits[size_t(t) * num_experts + e];
      MOEKIT_CHECK(std::isfinite(v), fmt::format("select_experts: logit of token {} expert {} is {}, expected a "
                                                 "finite value", t, e, v));
    }
  if (bias)
    for (int e = 0; e < num_experts; ++e)
      MOEKIT_CHECK(std::isfinite(bias[e]),
                   fmt::format("select_experts: bias of expert {} is {}, expected a finite value", e, bias[e]));

  const bool sigmoid = router.scoring == "sigmoid", topk_softmax = router.scoring == "topk_softmax";
  const int num_groups = router.num_groups;
  const int group_size = num_experts / num_groups;
  std::vector<double> score(num_experts), sel(num_experts), group_score(num_groups), member(group_size);
  std::vector<int> order, group_order, member_order;
  for (int t = 0; t < num_tokens; ++t) {
    const float* lt = logits + size_t(t) * num_experts;
    if (sigmoid) {
      for (int e = 0; e < num_experts; ++e) score[e] = 1.0 / (1.0 + std::exp(-double(lt[e])));
    } else if (topk_softmax) {
      for (int e = 0; e < num_experts; ++e) score[e] = double(lt[e]);
    } else {
      double max_logit = *std::max_element(lt, lt + num_experts), sum = 0.0;
      for (int e = 0; e < num_experts; ++e) sum += score[e] = std::exp(double(lt[e]) - max_logit);
      for (int e = 0; e < num_experts; ++e) score[e] /= sum;
    }
    for (int e = 0; e < num_experts; ++e) sel[e] = score[e] + (bias ? double(bias[e]) : 0.0);

    if (num_groups > 1) {
      const int best = std::min(2, group_size);
      for (int g = 0; g < num_groups; ++g) {
        std::copy(sel.begin() + g * group_size, sel.begin() + (g + 1) * group_size, member.begin());
        top_indices(member, best, member_order);
        group_score[g] = 0.0;
        for (int i : member_order) group_score[g] += member[i];
      }
      top_indices(group_score, router.topk_groups, group_order);
      std::vector<bool> kept(num_groups, false);
      for (int g : group_order) kept[g] = true;
      // Masked experts can never win: every kept group has at least k candidates in total.
      for (int e = 0; e < num_experts; ++e)
        if (!kept[e / group_size]) sel[e] = -INFINITY;
    }
    top_indices(sel, k, order);

    if (topk_softmax) {
      // The softmax of the k chosen logits (normalised below), shifted by the first chosen one
      // (the largest without a selection bias) so that exp cannot overflow.
      const double shift = score[order[0]];
      for (int j = 0; j < k; ++j) score[order[j]] = std::exp(score[order[j]] - shift);
    }
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += score[order[j]];
    // DeepSeek-V3 adds 1e-20 so that k sigmoids that all underflowed to 0 give weights 0, not NaN.
    const double norm = router.normalize_topk ? 1.0 / (sum + 1e-20) : 1.0;
    for (int j = 0; j < k; ++j) {
      topk_idx[size_t(t) * k + j] = order[j];
      topk_weights[size_t(t) * k + j] = float(score[order[j]] * norm * router.routed_scaling_factor);
    }
  }
}

}  // namespace moekit::ref
