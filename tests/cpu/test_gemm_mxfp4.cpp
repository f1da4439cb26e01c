// The MXFP4 grouped GEMMs of reference.h (FP8 activations, gpt-oss's MXFP4 weights, a bias) and
// the clamped SwiGLU: the documented operation order bit for bit, with the weights decoded here
// from the format's definition (the e2m1 table and ldexp); float64 accuracy; contiguous = masked;
// padding rows untouched; bad scales refused before anything is written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "expect_error.h"
#include "moekit/bf16.h"
#include "moekit/fp8.h"
#include "moekit/layout.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"
#include "moekit/reference.h"

using namespace moekit;

namespace {

constexpr uint16_t kBf16Poison = 0xFFFF;
constexpr double kE2m1[16] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};

struct Problem {
  MaskedLayout a_layout;
  Mxfp4WeightLayout w_layout;
  std::vector<int32_t> masked_m;
  std::vector<uint8_t> a, w, w_scales;
  std::vector<float> a_scales, bias;
  std::vector<uint16_t> out;

  Problem(int experts, int max_m, int k, int n, std::vector<int32_t> m, uint32_t seed)
      : a_layout{experts, max_m, k}, w_layout{experts, n, k}, masked_m(std::move(m)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    a.resize(a_layout.a_elems());
    a_scales.resize(a_layout.scale_elems());
    std::vector<float> row(k);
    for (int e = 0; e < experts; ++e)
      for (int r = 0; r < max_m; ++r) {
        for (float& v : row) v = normal(rng);
        quantize_row_fp8(row.data(), k, a.data() + a_layout.a_offset(e, r), a_scales.data() + a_layout.scale_offset(e, r, 0),
                         max_m);
      }
    // Weight groups of different magnitudes (2^-6 .. 2^1), so a block's four scales differ.
    w.resize(w_layout.w_bytes());
    w_scales.resize(w_layout.scale_elems());
    for (int e = 0; e < experts; ++e)
      for (int r = 0; r < n; ++r) {
        for (int i = 0; i < k; ++i) row[i] = normal(rng) * std::ldexp(1.0f, (i / kMxfp4Group + r) % 8 - 6);
        quantize_row_mxfp4(row.data(), k, w.data() + w_layout.w_offset(e, r), w_scales.data() + w_layout.scale_offset(e, r));
      }
    bias.resize(size_t(experts) * n);
    for (float& b : bias) b = 0.1f * normal(rng);
    out.assign(a_layout.out_elems(n), kBf16Poison);
  }

  void run(bool with_bias = true) {
    ref::grouped_gemm_masked_mxfp4(a_layout, a.data(), a_scales.data(), masked_m.data(), w_layout, w.data(),
                                   w_scales.data(), with_bias ? bias.data() : nullptr, out.data());
  }
  double a_value(int e, int m, int i) const {
    return double(fp8_e4m3_to_float(a[a_layout.a_offset(e, m) + i])) * a_scales[a_layout.scale_offset(e, m, i / 128)];
  }
  // The weight from the format's definition: the table value of its nibble times ldexp(1, s - 127).
  double w_value(int e, int n, int i) const {
    const uint8_t byte = w[w_layout.w_offset(e, n) + i / 2];
    const int code = i % 2 == 0 ? byte & 0xF : byte >> 4;
    return kE2m1[code] * std::ldexp(1.0, w_scales[w_layout.scale_offset(e, n) + i / kMxfp4Group] - 127);
  }
};

}  // namespace

// reference.h: partial_kb = fp32(exact sum of the block), acc = fmaf(a_scale, partial_kb, acc),
// out = bf16(acc + bias). The test's sums are exact: a block's four scales here span at most 7.
TEST(GemmMxfp4, FollowsTheDocumentedOperationOrderBitForBit) {
  Problem p(3, 9, 512, 256, {9, 0, 5}, 1);
  p.run();
  for (int e = 0; e < 3; ++e)
    for (int m = 0; m < p.a_layout.max_m; ++m)
      for (int n = 0; n < 256; ++n) {
        const uint16_t got = p.out[p.a_layout.out_offset(e, m, 256) + n];
        if (m >= p.masked_m[e]) {
          ASSERT_EQ(got, kBf16Poison) << "row past masked_m written: " << e << " " << m;
          continue;
        }
        float acc = 0.0f;
        for (int kb = 0; kb < 4; ++kb) {
          double sum = 0.0;
          for (int i = kb * 128; i < (kb + 1) * 128; ++i)
            sum += double(fp8_e4m3_to_float(p.a[p.a_layout.a_offset(e, m) + i])) * p.w_value(e, n, i);
          acc = std::fmaf(p.a_scales[p.a_layout.scale_offset(e, m, kb)], float(sum), acc);
        }
        ASSERT_EQ(got, float_to_bf16(acc + p.bias[size_t(e) * 256 + n])) << e << " " << m << " " << n;
      }
}

// Against float64 on the dequantised operands: the error is the bf16 output's rounding.
TEST(GemmMxfp4, MatchesFloat64AtK2944) {
  Problem p(2, 8, 2944, 128, {8, 3}, 2);
  p.run(false);
  std::vector<double> got, want;
  int differ = 0;
  for (int e = 0; e < 2; ++e)
    for (int m = 0; m < p.masked_m[e]; ++m)
      for (int n = 0; n < 128; ++n) {
        double sum = 0.0;
        for (int i = 0; i < 2944; ++i) sum += p.a_value(e, m, i) * p.w_value(e, n, i);
        want.push_back(sum);
        const uint16_t out = p.out[p.a_layout.out_offset(e, m, 128) + n];
        got.push_back(bf16_to_float(out));
        differ += out != float_to_bf16(float(sum));
      }
  const double err = ref::relative_frobenius_error(got.data(), want.data(), got.size());
  EXPECT_LT(err, 2.5e-3) << "bf16 rounding is about 1.6e-3 RMS relative";
  EXPECT_LT(differ, int(got.size()) / 20) << "outputs not bf16 of the float64 value";
}

TEST(GemmMxfp4, ContiguousEqualsMaskedAndSkipsPaddingRows) {
  Problem p(2, 6, 256, 128, {6, 4}, 3);
  p.run();
  // The same rows in the contiguous layout: expert 1's 4 rows, 2 padding rows, expert 0's 6 rows.
  const std::vector<int32_t> row_expert = {1, 1, 1, 1, -1, -1, 0, 0, 0, 0, 0, 0};
  const int total = int(row_expert.size());
  const ContiguousLayout c{total, 256};
  std::vector<uint8_t> a(c.a_elems());
  std::vector<float> scales(c.scale_elems());
  int next[2] = {0, 0};
  std::vector<int> row_m(total, -1);  // each row's masked-layout row
  for (int r = 0; r < total; ++r) {
    if (row_expert[r] < 0) continue;
    const int e = row_expert[r], m = row_m[r] = next[e]++;
    std::copy_n(p.a.begin() + ptrdiff_t(p.a_layout.a_offset(e, m)), 256, a.begin() + ptrdiff_t(c.a_offset(r)));
    for (int kb = 0; kb < 2; ++kb) scales[c.scale_offset(r, kb)] = p.a_scales[p.a_layout.scale_offset(e, m, kb)];
  }
  std::vector<uint16_t> out(size_t(total) * 128, kBf16Poison);
  ref::grouped_gemm_contiguous_mxfp4(c, a.data(), scales.data(), row_expert.data(), p.w_layout, p.w.data(),
                                     p.w_scales.data(), p.bias.data(), out.data());
  for (int r = 0; r < total; ++r)
    for (int n = 0; n < 128; ++n) {
      if (row_expert[r] < 0)
        ASSERT_EQ(out[size_t(r) * 128 + n], kBf16Poison) << "padding row written";
      else
        ASSERT_EQ(out[size_t(r) * 128 + n], p.out[p.a_layout.out_offset(row_expert[r], row_m[r], 128) + n]) << r << " " << n;
    }
}

TEST(GemmMxfp4, BadScalesAndShapesAreErrorsBeforeAnyWrite) {
  Problem p(2, 4, 256, 128, {4, 4}, 4);
  p.w_scales[p.w_layout.scale_offset(1, 5) + 3] = 255;
  expect_error([&] { p.run(); }, {"grouped_gemm_masked_mxfp4", "weight scale [1, 5, 3]", "e8m0 byte 255"});
  for (uint16_t v : p.out) ASSERT_EQ(v, kBf16Poison);
  p.w_scales[p.w_layout.scale_offset(1, 5) + 3] = 127;
  Mxfp4WeightLayout bad = p.w_layout;
  bad.n = 100;
  expect_error([&] {
    ref::grouped_gemm_masked_mxfp4(p.a_layout, p.a.data(), p.a_scales.data(), p.masked_m.data(), bad, p.w.data(),
                                   p.w_scales.data(), nullptr, p.out.data());
  }, {"N = 100"});
}

// gpt-oss's activation: (clamp(up, -L, L) + 1) · g · sigmoid(alpha · g), g = min(gate, L).
TEST(ActivationRef, ClampedSwigluFollowsTheReference) {
  const float alpha = 1.702f, limit = 7.0f;
  auto want = [&](double g, double u) {
    g = std::min(g, double(limit));
    u = std::clamp(u, -double(limit), double(limit));
    return g / (1.0 + std::exp(-double(alpha) * g)) * (u + 1.0);
  };
  for (float g : {-20.0f, -7.5f, -1.0f, 0.0f, 0.5f, 6.9f, 7.0f, 30.0f})
    for (float u : {-30.0f, -7.0f, -1.0f, 0.0f, 2.0f, 8.0f})
      EXPECT_NEAR(ref::clamped_swiglu(g, u, alpha, limit), want(g, u), 1e-6 * (1.0 + std::fabs(want(g, u)))) << g << " " << u;
  // The gate is clamped from above only: a very negative gate is not lifted to -7.
  EXPECT_LT(std::fabs(ref::clamped_swiglu(-20.0f, 1.0f, alpha, limit)), 1e-12f * 1e6f);
  EXPECT_NE(ref::clamped_swiglu(-20.0f, 1.0f, alpha, limit), ref::clamped_swiglu(-7.0f, 1.0f, alpha, limit));
  EXPECT_EQ(ref::clamped_swiglu(30.0f, 1.0f, alpha, limit), ref::clamped_swiglu(7.0f, 1.0f, alpha, limit));
  EXPECT_EQ(ref::clamped_swiglu(1.0f, 30.0f, alpha, limit), ref::clamped_swiglu(1.0f, 7.0f, alpha, limit));
  EXPECT_EQ(ref::clamped_swiglu(1.0f, -30.0f, alpha, limit), ref::clamped_swiglu(1.0f, -7.0f, alpha, limit));
  EXPECT_EQ(ref::clamped_swiglu(1.0f, -1.0f, alpha, limit), 0.0f);  // the up branch's +1
  EXPECT_TRUE(std::isnan(ref::clamped_swiglu(NAN, 1.0f, alpha, limit)));
  EXPECT_TRUE(std::isnan(ref::clamped_swiglu(1.0f, NAN, alpha, limit)));
  EXPECT_EQ(ref::clamped_swiglu(0.0f, 0.0f, alpha, limit), 0.0f);  // padded columns stay zero
}

TEST(ActivationRef, ClampedSwigluQuantisedIsTheFormulaQuantised) {
  const ref::Activation act{ref::Activation::Kind::kClampedSwiglu, 1.702f, 7.0f};
  const int inter = 256, max_m = 3;
  const MaskedLayout o{1, max_m, inter};
  std::mt19937 rng(6);
  std::normal_distribution<float> normal(0.0f, 5.0f);
  std::vector<uint16_t> gate_up(o.out_elems(2 * inter));
  for (auto& v : gate_up) v = float_to_bf16(normal(rng));
  const int32_t masked_m[1] = {2};
  std::vector<uint8_t> q(o.a_elems(), 0xAB);
  std::vector<float> s(o.scale_elems(), -1.0f);
  ref::activation_quant_masked(act, o, gate_up.data(), masked_m, q.data(), s.data());
  std::vector<float> v(inter);
  std::vector<uint8_t> want_q(inter);
  std::vector<float> want_s(inter / 128);
  for (int m = 0; m < 2; ++m) {
    const uint16_t* row = gate_up.data() + o.out_offset(0, m, 2 * inter);
    for (int j = 0; j < inter; ++j) v[j] = ref::clamped_swiglu(bf16_to_float(row[j]), bf16_to_float(row[inter + j]), 1.702f, 7.0f);
    quantize_row_fp8(v.data(), inter, want_q.data(), want_s.data(), 1);
    for (int j = 0; j < inter; ++j) ASSERT_EQ(q[o.a_offset(0, m) + j], want_q[j]) << m << " " << j;
    for (int b = 0; b < inter / 128; ++b) ASSERT_EQ(s[o.scale_offset(0, m, b)], want_s[b]);
  }
  for (int j = 0; j < inter; ++j) ASSERT_EQ(q[o.a_offset(0, 2) + j], 0xAB) << "row past masked_m written";
}
