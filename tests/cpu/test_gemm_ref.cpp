// FP8 grouped GEMM reference (masked and contiguous) and SiLU(gate)·up + quantisation:
// accuracy against float64 on the same quantised operands, the documented operation order bit
// for bit, two-level against single-level accumulation, untouched padding rows, bad shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/fp8.h"
#include "moekit/layout.h"
#include "moekit/quant.h"
#include "moekit/reference.h"

using namespace moekit;

namespace {

constexpr uint16_t kBf16Poison = 0xFFFF;  // a NaN: any write shows

// FP8 operands of a masked GEMM, made by quantising random fp32 data with quant.h.
struct MaskedProblem {
  MaskedLayout a_layout;
  WeightLayout w_layout;
  std::vector<int32_t> masked_m;
  std::vector<uint8_t> a, w;
  std::vector<float> a_scales, w_scales;
  std::vector<uint16_t> out;

  MaskedProblem(int experts, int max_m, int k, int n, std::vector<int32_t> m, bool positive, uint32_t seed)
      : a_layout{experts, max_m, k}, w_layout{experts, n, k}, masked_m(std::move(m)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    auto draw = [&] { return positive ? uniform(rng) : normal(rng); };
    a.resize(a_layout.a_elems());
    a_scales.assign(a_layout.scale_elems(), NAN);
    std::vector<float> row(k);
    for (int e = 0; e < experts; ++e)
      for (int r = 0; r < max_m; ++r) {
        for (float& v : row) v = draw();
        quantize_row_fp8(row.data(), k, a.data() + a_layout.a_offset(e, r), a_scales.data() + a_layout.scale_offset(e, r, 0),
                         max_m);
      }
    std::vector<float> wf(size_t(n) * k);
    w.resize(w_layout.w_elems());
    w_scales.resize(w_layout.scale_elems());
    for (int e = 0; e < experts; ++e) {
      for (float& v : wf) v = draw();
      quantize_blocks_fp8(wf.data(), n, k, w.data() + w_layout.w_offset(e, 0), w_scales.data() + w_layout.scale_offset(e, 0, 0));
    }
    out.assign(a_layout.out_elems(n), kBf16Poison);
  }

  void run() {
    ref::grouped_gemm_masked(a_layout, a.data(), a_scales.data(), masked_m.data(), w_layout, w.data(), w_scales.data(),
                             out.data());
  }
  double a_value(int e, int m, int i) const {
    return double(fp8_e4m3_to_float(a[a_layout.a_offset(e, m) + i])) * a_scales[a_layout.scale_offset(e, m, i / 128)];
  }
  double w_value(int e, int n, int i) const {
    return double(fp8_e4m3_to_float(w[w_layout.w_offset(e, n) + i])) * w_scales[w_layout.scale_offset(e, n, i)];
  }
  // Float64 on the dequantised operands (rows of expert e: dequantised once per call of error()).
  double f64(const std::vector<double>& a_row, const std::vector<double>& w_row) const {
    double sum = 0.0;
    for (int i = 0; i < a_layout.k; ++i) sum += a_row[i] * w_row[i];
    return sum;
  }
  // Relative Frobenius error of the computed rows against float64; `single_level` instead
  // evaluates the emulated single-level accumulation below. `bf16_differ` counts the outputs
  // that are not bf16(fp32(float64 value)).
  double error(bool single_level = false, int* bf16_differ = nullptr) const {
    const int k = a_layout.k;
    std::vector<double> got, want;
    std::vector<double> a_row(k);
    std::vector<std::vector<double>> w_rows(w_layout.n, std::vector<double>(k));
    for (int e = 0; e < a_layout.num_experts; ++e) {
      for (int n = 0; n < w_layout.n; ++n)
        for (int i = 0; i < k; ++i) w_rows[n][i] = w_value(e, n, i);
      for (int m = 0; m < masked_m[e]; ++m) {
        for (int i = 0; i < k; ++i) a_row[i] = a_value(e, m, i);
        for (int n = 0; n < w_layout.n; ++n) {
          want.push_back(f64(a_row, w_rows[n]));
          if (bf16_differ && out[a_layout.out_offset(e, m, w_layout.n) + n] != float_to_bf16(float(want.back())))
            ++*bf16_differ;
          got.push_back(single_level ? single_level_acc(a_row, w_rows[n])
                                     : bf16_to_float(out[a_layout.out_offset(e, m, w_layout.n) + n]));
        }
      }
    }
    return ref::relative_frobenius_error(got.data(), want.data(), got.size());
  }
  // A tensor core WITHOUT promotion: every scaled product is added into one accumulator that
  // keeps 14 significant bits (1 + 13 stored), truncating after each addition (DeepSeek-V3's
  // report: about 14 bits, and the hardware truncates rather than rounds).
  double single_level_acc(const std::vector<double>& a_row, const std::vector<double>& w_row) const {
    auto trunc14 = [](float v) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      bits &= ~0x3FFu;  // drop the low 10 of 23 stored mantissa bits
      std::memcpy(&v, &bits, 4);
      return v;
    };
    float acc = 0.0f;
    for (int i = 0; i < a_layout.k; ++i) acc = trunc14(acc + float(a_row[i] * w_row[i]));
    return acc;
  }
};

}  // namespace

TEST(GemmRef, MaskedMatchesFloat64AtK7168) {
  MaskedProblem p(3, 6, 7168, 128, {4, 6, 0}, /*positive=*/false, 1);
  p.run();
  int differ = 0;
  const double err = p.error(false, &differ);
  std::printf("masked GEMM, random normal data, K = 7168: relative Frobenius error %.3g; %d of %d bf16 outputs "
              "differ from bf16(float64)\n", err, differ, 10 * 128);
  EXPECT_LE(err, 3e-3);
  EXPECT_LE(differ, 10 * 128 / 100);  // the fp32 accumulator straddles a bf16 rounding boundary only rarely
  EXPECT_GT(err, 0.0);  // bf16 output rounding is there
  for (int e = 0; e < 3; ++e)
    for (int m = p.masked_m[e]; m < 6; ++m)
      for (int n = 0; n < 128; ++n) ASSERT_EQ(p.out[p.a_layout.out_offset(e, m, 128) + n], kBf16Poison) << e << " " << m;
}

TEST(GemmRef, TwoLevelAccumulationHoldsOnAllPositiveDataAtK16384) {
  MaskedProblem p(1, 4, 16384, 128, {4}, /*positive=*/true, 2);
  p.run();
  const double two_level = p.error(), single_level = p.error(/*single_level=*/true);
  std::printf("all-positive data, K = 16384: two-level %.3g, single-level (14-bit truncating accumulator) %.3g\n",
              two_level, single_level);
  EXPECT_LE(two_level, 5e-3);
  EXPECT_GT(single_level, 20 * two_level);
}

// The contract in reference.h, computed another way: the block partial as an integer sum of
// products of e4m3 values times 2^9 (exact in int64), scaled by 2^-18, rounded once to fp32.
TEST(GemmRef, FollowsTheDocumentedOperationOrderBitForBit) {
  MaskedProblem p(2, 4, 512, 256, {4, 3}, false, 3);
  p.run();
  for (int e = 0; e < 2; ++e)
    for (int m = 0; m < p.masked_m[e]; ++m)
      for (int n = 0; n < 256; ++n) {
        float acc = 0.0f;
        for (int kb = 0; kb < 4; ++kb) {
          int64_t sum = 0;
          for (int i = kb * 128; i < (kb + 1) * 128; ++i) {
            auto as_int = [](uint8_t code) { return int64_t(std::ldexp(fp8_e4m3_to_float(code), 9)); };
            sum += as_int(p.a[p.a_layout.a_offset(e, m) + i]) * as_int(p.w[p.w_layout.w_offset(e, n) + i]);
          }
          float partial = float(std::ldexp(double(sum), -18));
          float scale = p.a_scales[p.a_layout.scale_offset(e, m, kb)] * p.w_scales[p.w_layout.scale_offset(e, n, kb * 128)];
          acc = std::fmaf(scale, partial, acc);
        }
        ASSERT_EQ(p.out[p.a_layout.out_offset(e, m, 256) + n], float_to_bf16(acc)) << e << " " << m << " " << n;
      }
}

// Contiguous layout, block M 4: expert 0 has 3 rows, expert 1 none, expert 2 five rows.
TEST(GemmRef, ContiguousEqualsMaskedAndSkipsPaddingRows) {
  MaskedProblem p(3, 5, 256, 128, {3, 0, 5}, false, 4);
  p.run();
  const std::vector<int32_t> row_expert = {0, 0, 0, -1, 2, 2, 2, 2, 2, -1, -1, -1};
  const std::vector<int> masked_row = {0, 1, 2, -1, 0, 1, 2, 3, 4, -1, -1, -1};
  const int total_m = int(row_expert.size());
  ref::check_contiguous_segments(row_expert.data(), total_m, 4, 3);
  const ContiguousLayout layout{total_m, 256};
  std::vector<uint8_t> a(layout.a_elems(), 0x7F);
  std::vector<float> scales(layout.scale_elems(), NAN);
  for (int m = 0; m < total_m; ++m) {
    if (row_expert[m] < 0) continue;
    std::memcpy(&a[layout.a_offset(m)], &p.a[p.a_layout.a_offset(row_expert[m], masked_row[m])], 256);
    for (int kb = 0; kb < 2; ++kb) scales[layout.scale_offset(m, kb)] = p.a_scales[p.a_layout.scale_offset(row_expert[m], masked_row[m], kb)];
  }
  std::vector<uint16_t> out(size_t(total_m) * 128, kBf16Poison);
  ref::grouped_gemm_contiguous(layout, a.data(), scales.data(), row_expert.data(), p.w_layout, p.w.data(),
                               p.w_scales.data(), out.data());
  for (int m = 0; m < total_m; ++m)
    for (int n = 0; n < 128; ++n) {
      uint16_t want = row_expert[m] < 0 ? kBf16Poison : p.out[p.a_layout.out_offset(row_expert[m], masked_row[m], 128) + n];
      ASSERT_EQ(out[size_t(m) * 128 + n], want) << "row " << m << " col " << n;
    }
}

TEST(GemmRef, BadShapesAndIndicesAreErrors) {
  MaskedProblem p(2, 4, 256, 128, {4, 2}, false, 5);
  auto masked = [&](MaskedLayout al, WeightLayout wl, std::vector<int32_t> m) {
    ref::grouped_gemm_masked(al, p.a.data(), p.a_scales.data(), m.data(), wl, p.w.data(), p.w_scales.data(), p.out.data());
  };
  EXPECT_THROW(masked({2, 4, 200}, {2, 128, 200}, {1, 1}), Error);     // K not a multiple of 128
  EXPECT_THROW(masked({2, 4, 256}, {2, 100, 256}, {1, 1}), Error);     // N not a multiple of 128
  EXPECT_THROW(masked({2, 4, 256}, {2, 128, 128}, {1, 1}), Error);     // K differs
  EXPECT_THROW(masked({2, 4, 256}, {3, 128, 256}, {1, 1}), Error);     // expert counts differ
  EXPECT_THROW(masked({2, 4, 256}, {2, 128, 256}, {5, 1}), Error);     // masked_m > M_max
  EXPECT_THROW(masked({2, 4, 256}, {2, 128, 256}, {1, -1}), Error);    // negative masked_m
  for (uint16_t v : p.out) ASSERT_EQ(v, kBf16Poison);                  // nothing written
  std::vector<int32_t> bad_rows = {0, 2, -1, 1};                       // 2 is not a local expert of 2
  std::vector<uint16_t> out(4 * 128, kBf16Poison);
  EXPECT_THROW(ref::grouped_gemm_contiguous({4, 256}, p.a.data(), p.a_scales.data(), bad_rows.data(), p.w_layout,
                                            p.w.data(), p.w_scales.data(), out.data()),
               Error);
  bad_rows = {0, -2, -1, 1};
  EXPECT_THROW(ref::grouped_gemm_contiguous({4, 256}, p.a.data(), p.a_scales.data(), bad_rows.data(), p.w_layout,
                                            p.w.data(), p.w_scales.data(), out.data()),
               Error);
  for (uint16_t v : out) ASSERT_EQ(v, kBf16Poison);
}

TEST(GemmRef, ContiguousSegmentCheck) {
  const std::vector<int32_t> ok = {1, 1, -1, -1, 0, 0, 0, 0};
  EXPECT_NO_THROW(ref::check_contiguous_segments(ok.data(), 8, 4, 2));
  EXPECT_THROW(ref::check_contiguous_segments(ok.data(), 8, 3, 2), Error);  // 8 not a multiple of 3
  const std::vector<int32_t> mixed = {1, 1, 0, -1, 0, 0, 0, 0};             // block 0 holds experts 1 and 0
  EXPECT_THROW(ref::check_contiguous_segments(mixed.data(), 8, 4, 2), Error);
  EXPECT_THROW(ref::check_contiguous_segments(ok.data(), 8, 4, 1), Error);  // expert 1 out of range
}

namespace {

// GEMM1 output rows [rows, 2·inter] of random bf16 values (gate columns then up columns).
std::vector<uint16_t> random_gate_up(size_t rows, int inter, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<uint16_t> v(rows * 2 * inter);
  for (uint16_t& x : v) x = float_to_bf16(normal(rng));
  return v;
}

// SiLU(g)·u in float64 from the definition g · sigmoid(g) · u.
double silu_up_f64(const uint16_t* row, int inter, int j) {
  double g = bf16_to_float(row[j]), u = bf16_to_float(row[inter + j]);
  return g / (1.0 + std::exp(-g)) * u;
}

}  // namespace

TEST(ActivationRef, MaskedSiluUpQuantisedWithinBound) {
  const MaskedLayout layout{2, 4, 256};
  const std::vector<int32_t> masked_m = {3, 1};
  std::vector<uint16_t> gate_up = random_gate_up(size_t(2) * 4, 256, 6);
  std::vector<uint8_t> q(layout.a_elems(), 0x7F);
  std::vector<float> scales(layout.scale_elems(), NAN);
  ref::silu_mul_quant_masked(layout, gate_up.data(), masked_m.data(), q.data(), scales.data());
  for (int e = 0; e < 2; ++e)
    for (int m = 0; m < 4; ++m) {
      const uint16_t* row = gate_up.data() + layout.out_offset(e, m, 512);
      for (int j = 0; j < 256; ++j) {
        const uint8_t code = q[layout.a_offset(e, m) + j];
        const float s = scales[layout.scale_offset(e, m, j / 128)];
        if (m >= masked_m[e]) {
          ASSERT_EQ(code, 0x7F);
          ASSERT_TRUE(std::isnan(s));
          continue;
        }
        const double want = silu_up_f64(row, 256, j);
        // The quantisation bound of test_quant.cpp plus fp32 rounding of SiLU·up (a few ulps).
        const double bound = std::max(std::ldexp(std::fabs(want), -4), std::ldexp(double(s), -10)) + 1e-6 * std::fabs(want);
        ASSERT_LE(std::fabs(double(fp8_e4m3_to_float(code)) * s - want), bound) << e << " " << m << " " << j;
      }
    }
}

// Per token (an MXFP4 layer's prefill): each valid row is quantize_row_fp8 per token of its
// activation values, one scale in all of its inter/128 slots; padding rows untouched.
TEST(ActivationRef, ContiguousPerTokenScalesEachRowOnce) {
  const int inter = 384, total_m = 4;
  std::vector<uint16_t> gate_up = random_gate_up(total_m, inter, 8);
  const std::vector<int32_t> row_expert = {0, -1, 1, 1};
  const ContiguousLayout layout{total_m, inter};
  std::vector<uint8_t> q(layout.a_elems(), 0x7F);
  std::vector<float> scales(layout.scale_elems(), NAN);
  ref::activation_quant_contiguous(ref::Activation{}, layout, gate_up.data(), row_expert.data(), q.data(),
                                   scales.data(), Fp8Scaling::kPerToken);
  int mixed_in_1x128 = 0;
  for (int m = 0; m < total_m; ++m) {
    if (row_expert[m] < 0) {
      for (int g = 0; g < inter / 128; ++g) EXPECT_TRUE(std::isnan(scales[layout.scale_offset(m, g)]));
      for (int j = 0; j < inter; ++j) ASSERT_EQ(q[layout.a_offset(m) + j], 0x7F);
      continue;
    }
    std::vector<float> v(inter), want_s(inter / 128), block_s(inter / 128);
    std::vector<uint8_t> want_q(inter), block_q(inter);
    const uint16_t* row = gate_up.data() + size_t(m) * 2 * inter;
    for (int j = 0; j < inter; ++j) v[j] = ref::silu_mul(bf16_to_float(row[j]), bf16_to_float(row[inter + j]));
    quantize_row_fp8(v.data(), inter, want_q.data(), want_s.data(), 1, Fp8Scaling::kPerToken);
    quantize_row_fp8(v.data(), inter, block_q.data(), block_s.data(), 1);
    for (int g = 0; g < inter / 128; ++g) EXPECT_EQ(scales[layout.scale_offset(m, g)], want_s[0]) << m << " " << g;
    for (int j = 0; j < inter; ++j) ASSERT_EQ(q[layout.a_offset(m) + j], want_q[j]) << m << " " << j;
    mixed_in_1x128 += block_s[0] != block_s[1] || block_s[1] != block_s[2];
  }
  EXPECT_GT(mixed_in_1x128, 0) << "rows whose 1x128 scales are all equal cannot tell the two apart";
}

TEST(ActivationRef, ContiguousEqualsMaskedAndSkipsPadding) {
  const int inter = 128, total_m = 4;
  std::vector<uint16_t> gate_up = random_gate_up(total_m, inter, 7);
  const std::vector<int32_t> row_expert = {0, 0, -1, 1};
  const ContiguousLayout layout{total_m, inter};
  std::vector<uint8_t> q(layout.a_elems(), 0x7F);
  std::vector<float> scales(layout.scale_elems(), NAN);
  ref::silu_mul_quant_contiguous(layout, gate_up.data(), row_expert.data(), q.data(), scales.data());
  // The same rows as one expert of a masked layout with masked_m = 4.
  const MaskedLayout masked{1, total_m, inter};
  const int32_t masked_m[1] = {total_m};
  std::vector<uint8_t> mq(masked.a_elems());
  std::vector<float> ms(masked.scale_elems());
  ref::silu_mul_quant_masked(masked, gate_up.data(), masked_m, mq.data(), ms.data());
  for (int m = 0; m < total_m; ++m) {
    if (row_expert[m] < 0) {
      EXPECT_TRUE(std::isnan(scales[layout.scale_offset(m, 0)]));
      for (int j = 0; j < inter; ++j) ASSERT_EQ(q[layout.a_offset(m) + j], 0x7F);
      continue;
    }
    EXPECT_EQ(scales[layout.scale_offset(m, 0)], ms[masked.scale_offset(0, m, 0)]);
    for (int j = 0; j < inter; ++j) ASSERT_EQ(q[layout.a_offset(m) + j], mq[masked.a_offset(0, m) + j]);
  }
  EXPECT_THROW(ref::silu_mul_quant_contiguous({total_m, 100}, gate_up.data(), row_expert.data(), q.data(), scales.data()),
               Error);
  const int32_t too_many[1] = {5};
  EXPECT_THROW(ref::silu_mul_quant_masked(masked, gate_up.data(), too_many, mq.data(), ms.data()), Error);
}
