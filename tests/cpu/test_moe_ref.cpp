// The float64 MoE oracle: a hand-computed layer, the FP8 pipeline assembled from the reference
// kernels within the tolerance of docs/design.md §Numerics and their bounds, the shared expert, bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/gating.h"
#include "moekit/layout.h"
#include "moekit/quant.h"
#include "moekit/reference.h"

using namespace moekit;

namespace {

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// Random FP8 weights of E experts (W1 [2·inter, d], W2 [d, inter] each) and their float64 copies.
struct Experts {
  int num_experts, hidden, inter;
  std::vector<uint8_t> w1, w2;
  std::vector<float> w1_scales, w2_scales;
  std::vector<double> w1_f64, w2_f64;

  Experts(int e, int d, int i, uint32_t seed) : num_experts(e), hidden(d), inter(i) {
    std::mt19937 rng(seed);
    fill(2 * i, d, 1.0f / std::sqrt(float(d)), rng, w1, w1_scales, w1_f64);
    fill(d, i, 1.0f / std::sqrt(float(i)), rng, w2, w2_scales, w2_f64);
  }
  void fill(int rows, int cols, float stddev, std::mt19937& rng, std::vector<uint8_t>& q, std::vector<float>& scales,
            std::vector<double>& f64) {
    const WeightLayout layout{num_experts, rows, cols};
    std::normal_distribution<float> normal(0.0f, stddev);
    std::vector<float> x(size_t(rows) * cols);
    q.resize(layout.w_elems());
    scales.resize(layout.scale_elems());
    f64.resize(layout.w_elems());
    for (int e = 0; e < num_experts; ++e) {
      for (float& v : x) v = normal(rng);
      quantize_blocks_fp8(x.data(), rows, cols, &q[layout.w_offset(e, 0)], &scales[layout.scale_offset(e, 0, 0)]);
      ref::dequantize_weights_f64(&q[layout.w_offset(e, 0)], &scales[layout.scale_offset(e, 0, 0)], rows, cols,
                                  &f64[layout.w_offset(e, 0)]);
    }
  }
  ref::ExpertFp8 expert(int e) const {
    const WeightLayout l1{num_experts, 2 * inter, hidden}, l2{num_experts, hidden, inter};
    return {hidden, inter, &w1[l1.w_offset(e, 0)], &w1_scales[l1.scale_offset(e, 0, 0)], &w2[l2.w_offset(e, 0)],
            &w2_scales[l2.scale_offset(e, 0, 0)]};
  }
};

std::vector<float> random_tokens(int num_tokens, int hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(num_tokens) * hidden);
  for (float& v : x) v = normal(rng);
  return x;
}

}  // namespace

// hidden = inter = 128. x = (448, 0, ...) quantises exactly with scale 1. W1 row j (gate) and
// row 128 + j (up) are g_j / 448 and u_j / 448 in column 0, so GEMM1 gives exactly g_j and u_j
// (chosen bf16-exact). W2 row c reads only v_0 = silu(g_0)·u_0, the largest |v|, which the FP8
// quantisation maps to ±448 · scale = v_0 up to fp32 rounding. Two experts with weights .25 and
// .75, plus a shared expert (expert 1's weights again): out[c] = (.25·v0(e0) + .75·v0(e1) + v0(e1))·c2[c].
TEST(MoeRef, HandComputedLayer) {
  const int d = 128, inter = 128;
  const double g[2] = {2.0, -0.5}, u[2] = {3.0, 1.5};
  std::vector<double> w1(size_t(2) * 2 * inter * d, 0.0), w2(size_t(2) * d * inter, 0.0);
  for (int e = 0; e < 2; ++e) {
    double* w1e = &w1[size_t(e) * 2 * inter * d];
    for (int j = 0; j < inter; ++j) {
      const double scale = j == 0 ? 1.0 : 0.01 * (j % 5);  // other v_j stay far below v_0
      w1e[size_t(j) * d] = scale * g[e] / 448.0;
      w1e[size_t(inter + j) * d] = scale * u[e] / 448.0;
    }
    for (int c = 0; c < d; ++c) w2[size_t(e) * d * inter + size_t(c) * inter] = 0.5 + c;
  }
  std::vector<float> x(d, 0.0f);
  x[0] = 448.0f;
  const int32_t idx[2] = {0, 1};
  const float weights[2] = {0.25f, 0.75f};
  ref::MoeWeightsF64 mw{d, inter, 2, w1.data(), w2.data(), inter, &w1[size_t(2) * inter * d], &w2[size_t(d) * inter]};
  std::vector<double> out(d);
  ref::moe_layer_f64(x.data(), 1, idx, weights, 2, mw, out.data());
  const double v0 = silu(g[0]) * u[0], v1 = silu(g[1]) * u[1];
  for (int c = 0; c < d; ++c) EXPECT_NEAR(out[c], (0.25 * v0 + 1.75 * v1) * (0.5 + c), 1e-6 * std::fabs(out[c])) << c;
}

// The whole FP8 layer from the reference kernels on one rank: DeepSeek-style gating, tokens
// quantised into the masked layout, GEMM1, SiLU·up + quantisation, GEMM2, combine in fp32,
// plus the shared expert; against the oracle on the same weights.
TEST(MoeRef, Fp8PipelineMatchesOracle) {
  const int E = 8, d = 256, inter = 128, T = 24, k = 2;
  Experts experts(E, d, inter, 1), shared(1, d, inter, 2);
  std::vector<float> x = random_tokens(T, d, 3), router_w = random_tokens(E, d, 4), logits(size_t(T) * E);
  RouterSpec router;
  router.scoring = "sigmoid";
  router.num_groups = 4;
  router.topk_groups = 2;
  router.routed_scaling_factor = 2.5;
  std::vector<int32_t> topk_idx(size_t(T) * k);
  std::vector<float> topk_weights(size_t(T) * k);
  ref::router_logits(x.data(), T, d, router_w.data(), E, logits.data());
  ref::select_experts(logits.data(), T, E, k, router, nullptr, topk_idx.data(), topk_weights.data());

  // Dispatch: row masked_m[e] of expert e gets the token; remember where each (t, j) went.
  const MaskedLayout a_layout{E, T, d}, h_layout{E, T, inter};
  std::vector<uint8_t> a(a_layout.a_elems()), h(h_layout.a_elems());
  std::vector<float> a_scales(a_layout.scale_elems()), h_scales(h_layout.scale_elems());
  std::vector<int32_t> masked_m(E, 0), row_of(size_t(T) * k);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int e = topk_idx[t * k + j], m = masked_m[e]++;
      row_of[t * k + j] = m;
      quantize_row_fp8(&x[size_t(t) * d], d, &a[a_layout.a_offset(e, m)], &a_scales[a_layout.scale_offset(e, m, 0)], T);
    }
  std::vector<uint16_t> gate_up(a_layout.out_elems(2 * inter)), y(h_layout.out_elems(d));
  ref::grouped_gemm_masked(a_layout, a.data(), a_scales.data(), masked_m.data(), {E, 2 * inter, d}, experts.w1.data(),
                           experts.w1_scales.data(), gate_up.data());
  ref::silu_mul_quant_masked(h_layout, gate_up.data(), masked_m.data(), h.data(), h_scales.data());
  ref::grouped_gemm_masked(h_layout, h.data(), h_scales.data(), masked_m.data(), {E, d, inter}, experts.w2.data(),
                           experts.w2_scales.data(), y.data());
  std::vector<uint16_t> shared_out(size_t(T) * d);
  ref::shared_expert(x.data(), T, shared.expert(0), shared_out.data());

  std::vector<double> got(size_t(T) * d), got_fp32(size_t(T) * d), want(size_t(T) * d);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) {
      float sum = 0.0f;
      for (int j = 0; j < k; ++j)
        sum += topk_weights[t * k + j] * bf16_to_float(y[h_layout.out_offset(topk_idx[t * k + j], row_of[t * k + j], d) + c]);
      got_fp32[size_t(t) * d + c] = sum + bf16_to_float(shared_out[size_t(t) * d + c]);
      got[size_t(t) * d + c] = bf16_to_float(float_to_bf16(float(got_fp32[size_t(t) * d + c])));
    }
  ref::MoeWeightsF64 mw{d, inter, E, experts.w1_f64.data(), experts.w2_f64.data(), inter, shared.w1_f64.data(),
                        shared.w2_f64.data()};
  ref::moe_layer_f64(x.data(), T, topk_idx.data(), topk_weights.data(), k, mw, want.data());
  const double err = ref::relative_frobenius_error(got.data(), want.data(), got.size());
  const double err_fp32 = ref::relative_frobenius_error(got_fp32.data(), want.data(), got.size());
  std::printf("FP8 pipeline against the float64 oracle: relative Frobenius error %.3g (fp32 sum), %.3g (bf16 output)\n",
              err_fp32, err);
  EXPECT_LE(err, 3e-3);
  EXPECT_LE(err_fp32, err);  // the final bf16 rounding only adds error
}

// The shared expert against the oracle: one routed expert with weight 1 is the same function,
// with SiLU·up and with gpt-oss's clamped SwiGLU (the model's activation applies to the shared
// expert too; the two outputs must differ, or the activation was ignored).
TEST(MoeRef, SharedExpertMatchesOracle) {
  const int d = 384, inter = 256, T = 5;
  Experts w(1, d, inter, 5);
  std::vector<float> x = random_tokens(T, d, 6);
  std::vector<int32_t> idx(T, 0);
  std::vector<float> weights(T, 1.0f);
  std::vector<std::vector<double>> outputs;
  for (const ref::Activation act : {ref::Activation{}, ref::Activation{ref::Activation::Kind::kClampedSwiglu, 1.702f, 7.0f}}) {
    std::vector<uint16_t> out(size_t(T) * d, 0xFFFF);
    ref::shared_expert(x.data(), T, w.expert(0), out.data(), act);
    std::vector<double> got(out.size()), want(out.size());
    for (size_t i = 0; i < out.size(); ++i) got[i] = bf16_to_float(out[i]);
    ref::MoeWeightsF64 mw{d, inter, 1, w.w1_f64.data(), w.w2_f64.data()};
    mw.activation = act;
    ref::moe_layer_f64(x.data(), T, idx.data(), weights.data(), 1, mw, want.data());
    const double err = ref::relative_frobenius_error(got.data(), want.data(), got.size());
    EXPECT_LE(err, 3e-3) << (act.kind == ref::Activation::Kind::kSilu ? "silu" : "clamped swiglu");
    EXPECT_GT(err, 0.0);
    outputs.push_back(got);
  }
  EXPECT_GT(ref::relative_frobenius_error(outputs[0].data(), outputs[1].data(), outputs[0].size()), 0.1);
}

TEST(MoeRef, BadInputIsAnError) {
  const int d = 128, inter = 128;
  Experts w(2, d, inter, 7);
  std::vector<float> x = random_tokens(1, d, 8);
  std::vector<double> out(d);
  const float weights[2] = {0.5f, 0.5f};
  ref::MoeWeightsF64 mw{d, inter, 2, w.w1_f64.data(), w.w2_f64.data()};
  const int32_t bad[2] = {0, 2};
  EXPECT_THROW(ref::moe_layer_f64(x.data(), 1, bad, weights, 2, mw, out.data()), Error);
  const int32_t ok[2] = {0, 1};
  mw.inter = 100;
  EXPECT_THROW(ref::moe_layer_f64(x.data(), 1, ok, weights, 2, mw, out.data()), Error);
  ref::ExpertFp8 e = w.expert(0);
  e.hidden = 130;
  std::vector<uint16_t> y(d);
  EXPECT_THROW(ref::shared_expert(x.data(), 1, e, y.data()), Error);
}

TEST(MoeRef, RelativeFrobeniusError) {
  const double want[2] = {3.0, 4.0}, got[2] = {3.0, 4.05}, zero[2] = {0.0, 0.0};
  EXPECT_NEAR(ref::relative_frobenius_error(got, want, 2), 0.05 / 5.0, 1e-15);
  EXPECT_EQ(ref::relative_frobenius_error(want, want, 2), 0.0);
  EXPECT_THROW(ref::relative_frobenius_error(got, zero, 2), Error);
}
