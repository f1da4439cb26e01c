// moekit/gating.h: the router on the CPU (the reference the CUDA gating matches).
//
// Two steps, as docs/design.md §Decode data flow draws them: the router GEMM
// x[T, d] -> logits[T, E], then the top-k selection logits -> topk_idx[T, k], topk_weights[T, k],
// driven by a RouterSpec.
//
// router_logits: logits[t, e] = sum_i x[t, i] * router_weight[e, i] (+ logit_bias[e] when given:
//   gpt-oss's router is a linear layer with bias), each dot product and its bias summed in
//   float64 and rounded once to fp32 (so the result does not depend on summation order).
//   x is fp32 (bf16 activations widened to fp32, as DeepSeek-V3's gate does).
//
// select_experts, per token t:
//   scoring "softmax": score[e] = softmax(logits[t, :])[e] (in float64).
//   scoring "sigmoid": score[e] = 1 / (1 + exp(-logits[t, e])) (in float64).
//   scoring "topk_softmax" (gpt-oss): score[e] = logits[t, e] for the selection; the weights are
//     a softmax over the k selected logits only (in float64), then × routed_scaling_factor. For
//     the same logits this is the "softmax" rule with normalize_topk (the k largest softmax
//     scores renormalised are the softmax of the k largest logits), computed the way gpt-oss's
//     reference computes it. It needs num_groups = 1 and normalize_topk (spec.h).
//   selection score: sel[e] = score[e] + bias[e] when `bias` is given (DeepSeek-V3's
//     e_score_correction_bias), else score[e]. The bias steers the SELECTION only.
//   group limit (num_groups > 1): the E experts form num_groups groups of E/num_groups
//     consecutive ids; a group's score is the sum of its two largest sel values (its largest
//     when a group has one expert); the topk_groups best groups are kept, the others masked.
//   top-k: the k largest sel among the kept experts.
//   weights (softmax, sigmoid): w_j = score[idx_j] (UNBIASED); if normalize_topk, w_j /= (sum_j w_j + 1e-20) (DeepSeek-V3's
//     guard against k underflowed sigmoids); then
//     w_j *= routed_scaling_factor; rounded once to fp32.
//   Mixtral/Qwen (softmax, 1 group, normalise, factor 1) and DeepSeek-V3 (sigmoid + bias,
//   8 groups, keep 4, normalise, factor 2.5) are both this one rule.
//   Order and ties: topk_idx[t, :] lists the chosen experts by descending sel; equal values
//   (experts or groups) go to the lower index first. The result is fully deterministic.
//   Errors (moekit::Error, nothing written): a NaN or infinite logit (the message names the
//   token and the expert), a non-finite bias, k outside [1, E], E not a multiple of
//   num_groups, topk_groups outside [1, num_groups], k > topk_groups * E/num_groups, an
//   unknown scoring, "topk_softmax" with groups or without normalize_topk, a routed_scaling_factor
//   that is not finite and positive.
#pragma once

#include <cstdint>

#include "moekit/spec.h"

namespace moekit::ref {

// logits [num_tokens, num_experts] = x [num_tokens, hidden] . router_weight [num_experts, hidden]^T
// (+ logit_bias [num_experts] when not null; a non-finite bias is an Error naming the expert).
void router_logits(const float* x, int num_tokens, int hidden, const float* router_weight, int num_experts,
                   float* logits, const float* logit_bias = nullptr);

// logits [num_tokens, num_experts] -> topk_idx [num_tokens, k] int32, topk_weights [num_tokens, k] fp32.
// bias: nullptr or [num_experts], added to the scores for selection only.
void select_experts(const float* logits, int num_tokens, int num_experts, int k, const RouterSpec& router,
                    const float* bias, int32_t* topk_idx, float* topk_weights);

}  // namespace moekit::ref
