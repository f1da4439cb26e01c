// FP8 quantisation: the round-trip bound, scales, saturation, zero groups, layout.h scale order.
//
// The bound (docs/numerics.md): with s = max(amax, kMinAmax) / 448 and y = fp32(x / s),
//   |y| >= 2^-6 (e4m3 normal):    |fp8(y) - y| <= half an ulp = 2^(e-4) <= 2^-4 |y|   (2^e <= |y|)
//   |y| <  2^-6 (e4m3 subnormal): |fp8(y) - y| <= 2^-10                              (grid 2^-9)
// so |x - deq(q(x))| <= max(2^-4 |x|, 2^-10 s), plus the fp32 roundings of x / s and of
// fp8 * s (each 2^-24 relative), covered here by a 2^-21 |x| allowance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "moekit/check.h"
#include "moekit/fp8.h"
#include "moekit/layout.h"
#include "moekit/quant.h"

using namespace moekit;

namespace {

double round_trip_bound(float x, float scale) {
  return std::max(std::ldexp(std::fabs(double(x)), -4), std::ldexp(double(scale), -10)) +
         std::ldexp(std::fabs(double(x)), -21);
}

// Values over 24 binades with random signs, so every group has normals and subnormals.
std::vector<float> wide_random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-20, 3), sign(0, 1);
  std::vector<float> x(n);
  for (float& v : x) v = (sign(rng) ? -1.0f : 1.0f) * std::ldexp(mant(rng), expo(rng));
  return x;
}

}  // namespace

TEST(Quant, RowRoundTripWithinHalfUlpBound) {
  const int k = 1024;
  double worst = 0.0;  // largest error / bound seen: the bound must be reached, not just respected
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::vector<float> x = wide_random(k, seed), back(k), scales(k / 128);
    std::vector<uint8_t> q(k);
    quantize_row_fp8(x.data(), k, q.data(), scales.data(), 1);
    dequantize_row_fp8(q.data(), scales.data(), 1, k, back.data());
    for (int i = 0; i < k; ++i) {
      double err = std::fabs(double(back[i]) - double(x[i])), bound = round_trip_bound(x[i], scales[i / 128]);
      ASSERT_LE(err, bound) << "x = " << x[i] << " scale = " << scales[i / 128];
      worst = std::max(worst, err / bound);
    }
  }
  EXPECT_GT(worst, 0.9);
}

TEST(Quant, ScaleIsGroupAmaxOver448AndAmaxMapsTo448) {
  const int k = 384;
  std::vector<float> x = wide_random(k, 3), scales(3);
  x[200] = -1000.0f;  // the amax of group 1, negative
  std::vector<uint8_t> q(k);
  quantize_row_fp8(x.data(), k, q.data(), scales.data(), 1);
  for (int b = 0; b < 3; ++b) {
    float amax = 0.0f;
    int arg = 0;
    for (int i = b * 128; i < (b + 1) * 128; ++i)
      if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), arg = i;
    EXPECT_EQ(scales[b], amax / 448.0f);
    EXPECT_EQ(q[arg], x[arg] < 0 ? 0xFE : 0x7E);  // ±448
  }
  EXPECT_EQ(q[200], 0xFE);
}

// Per token: one scale, the whole row's amax / 448, in every slot (stride included), the row's
// largest value at +-448, each group's codes those of 1x128 quantisation under that one scale,
// and the round trip within the same bound.
TEST(Quant, PerTokenOneScaleInEverySlot) {
  const int k = 512;
  std::vector<float> x = wide_random(k, 5), back(k);
  x[300] = 900.0f;  // the row's amax, in group 2
  const int64_t stride = 3;
  std::vector<float> scales(size_t(k / 128) * stride, -1.0f);
  std::vector<uint8_t> q(k), q_block(k);
  quantize_row_fp8(x.data(), k, q.data(), scales.data(), stride, Fp8Scaling::kPerToken);
  for (int b = 0; b < k / 128; ++b) {
    EXPECT_EQ(scales[b * stride], 900.0f / 448.0f) << "slot " << b;
    if (b + 1 < k / 128) {
      EXPECT_EQ(scales[b * stride + 1], -1.0f) << "between slots " << b << " and " << b + 1;
    }
  }
  EXPECT_EQ(q[300], 0x7E);
  for (int i = 0; i < k; ++i) {
    EXPECT_EQ(q[i], float_to_fp8_e4m3(x[i] / scales[0])) << i;
    back[i] = fp8_e4m3_to_float(q[i]) * scales[0];
    EXPECT_LE(std::fabs(double(back[i]) - double(x[i])), round_trip_bound(x[i], scales[0])) << i;
  }
  // 1x128 on the same row: groups 0, 1 and 3 have their own (smaller) scales, so other codes.
  std::vector<float> block_scales(k / 128);
  quantize_row_fp8(x.data(), k, q_block.data(), block_scales.data(), 1, Fp8Scaling::kPerBlock);
  EXPECT_LT(block_scales[0], scales[0]);
  EXPECT_EQ(block_scales[2], scales[0]);
  EXPECT_TRUE(std::equal(q.begin() + 256, q.begin() + 384, q_block.begin() + 256));
  EXPECT_FALSE(std::equal(q.begin(), q.begin() + 128, q_block.begin()));
  EXPECT_STREQ(fp8_scaling_name(Fp8Scaling::kPerToken), "per-token");
  EXPECT_STREQ(fp8_scaling_name(Fp8Scaling::kPerBlock), "1x128");
  try {  // a value outside the enum (a cast from an integer) is named, and nothing is written
    std::vector<float> untouched(k / 128, -1.0f);
    quantize_row_fp8(x.data(), k, q.data(), untouched.data(), 1, Fp8Scaling(7));
    FAIL() << "scaling 7 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scaling = 7"), std::string::npos) << e.what();
  }
}

// fp32(amax / fp32(amax / 448)) can land just above 448; it must saturate to 448, not become NaN.
TEST(Quant, AmaxRoundingAbove448Saturates) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(0.5f, 1000.0f);
  int found = 0;
  for (int i = 0; i < 100000 && found < 5; ++i) {
    float amax = dist(rng);
    volatile float scale = amax / 448.0f;  // volatile: the division the quantiser does, in fp32
    if (amax / scale <= 448.0f) continue;
    ++found;
    std::vector<float> x(128, 0.25f), s(1);
    x[77] = amax;
    std::vector<uint8_t> q(128);
    quantize_row_fp8(x.data(), 128, q.data(), s.data(), 1);
    EXPECT_EQ(q[77], 0x7E) << "amax " << amax;
  }
  EXPECT_GT(found, 0) << "no amax whose x / scale rounds above 448";
}

TEST(Quant, AllZeroGroupGetsFiniteScaleAndZeros) {
  std::vector<float> x(256, 0.0f), back(256), scales(2);
  x[130] = 3.0f;
  std::vector<uint8_t> q(256, 0x55);
  quantize_row_fp8(x.data(), 256, q.data(), scales.data(), 1);
  EXPECT_EQ(scales[0], kMinAmax / 448.0f);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(q[i], 0);
  dequantize_row_fp8(q.data(), scales.data(), 1, 256, back.data());
  for (int i = 0; i < 256; ++i) EXPECT_EQ(back[i], x[i]);  // 0 and the amax 3.0 are exact
}

// Quantising token rows into the masked layout with scale_stride = M_max writes each scale at
// MaskedLayout::scale_offset and nothing else.
TEST(Quant, ScaleStrideProducesLayoutOrder) {
  const MaskedLayout layout{3, 5, 384};
  std::vector<uint8_t> a(layout.a_elems(), 0x7F);
  std::vector<float> scales(layout.scale_elems(), NAN);
  std::vector<float> x = wide_random(size_t(layout.num_experts) * layout.max_m * layout.k, 5);
  const int rows_written[3] = {2, 5, 0};
  auto src = [&](int e, int m) { return x.data() + (size_t(e) * layout.max_m + m) * layout.k; };
  for (int e = 0; e < 3; ++e)
    for (int m = 0; m < rows_written[e]; ++m)
      quantize_row_fp8(src(e, m), layout.k, a.data() + layout.a_offset(e, m), scales.data() + layout.scale_offset(e, m, 0),
                       layout.max_m);
  for (int e = 0; e < 3; ++e)
    for (int m = 0; m < layout.max_m; ++m)
      for (int kb = 0; kb < layout.k_blocks(); ++kb) {
        // Independently: [E, K/128, M_max] means kb strides by M_max and e by K/128 * M_max.
        float got = scales[(size_t(e) * 3 + kb) * 5 + m];
        if (m >= rows_written[e]) {
          EXPECT_TRUE(std::isnan(got));
          continue;
        }
        float amax = 0.0f;
        for (int i = kb * 128; i < (kb + 1) * 128; ++i) amax = std::max(amax, std::fabs(src(e, m)[i]));
        EXPECT_EQ(got, amax / 448.0f) << e << " " << m << " " << kb;
        float back[128];
        dequantize_row_fp8(a.data() + layout.a_offset(e, m) + kb * 128, &got, 1, 128, back);
        for (int i = 0; i < 128; ++i) EXPECT_LE(std::fabs(back[i] - src(e, m)[kb * 128 + i]), round_trip_bound(src(e, m)[kb * 128 + i], got));
      }
  EXPECT_EQ(a[layout.a_offset(0, 2)], 0x7F);  // an unquantised row keeps its poison
  EXPECT_EQ(a[layout.a_offset(2, 0) + 17], 0x7F);
}

TEST(Quant, BlockQuantisationScalesAndBound) {
  const int rows = 256, cols = 384;
  std::vector<float> x = wide_random(size_t(rows) * cols, 9), scales(2 * 3);
  std::vector<uint8_t> q(x.size());
  quantize_blocks_fp8(x.data(), rows, cols, q.data(), scales.data());
  for (int rb = 0; rb < 2; ++rb)
    for (int cb = 0; cb < 3; ++cb) {
      float amax = 0.0f;
      for (int r = rb * 128; r < (rb + 1) * 128; ++r)
        for (int c = cb * 128; c < (cb + 1) * 128; ++c) amax = std::max(amax, std::fabs(x[size_t(r) * cols + c]));
      const float s = scales[rb * 3 + cb];
      EXPECT_EQ(s, amax / 448.0f);
      for (int r = rb * 128; r < (rb + 1) * 128; ++r)
        for (int c = cb * 128; c < (cb + 1) * 128; ++c) {
          size_t i = size_t(r) * cols + c;
          ASSERT_LE(std::fabs(fp8_e4m3_to_float(q[i]) * s - x[i]), round_trip_bound(x[i], s)) << r << " " << c;
        }
    }
}

TEST(Quant, BadInputIsAnError) {
  std::vector<float> x(256, 1.0f), s(2);
  std::vector<uint8_t> q(256);
  EXPECT_THROW(quantize_row_fp8(x.data(), 100, q.data(), s.data(), 1), Error);
  EXPECT_THROW(quantize_blocks_fp8(x.data(), 2, 128, q.data(), s.data()), Error);
  EXPECT_THROW(dequantize_row_fp8(q.data(), s.data(), 1, 130, x.data()), Error);
  x[200] = NAN;  // in the second group: the first must not be written either
  std::fill(q.begin(), q.end(), 0x55);
  EXPECT_THROW(quantize_row_fp8(x.data(), 256, q.data(), s.data(), 1), Error);
  for (uint8_t v : q) ASSERT_EQ(v, 0x55);
  x[200] = 1.0f;
  x[5] = NAN;
  x[5] = INFINITY;
  EXPECT_THROW(quantize_row_fp8(x.data(), 256, q.data(), s.data(), 1), Error);
  std::vector<float> m(128 * 256, 0.5f), ms(2, -1.0f);
  std::vector<uint8_t> mq(m.size(), 0x55);
  m[127 * 256 + 200] = NAN;  // in the last block: the first must not be written either
  EXPECT_THROW(quantize_blocks_fp8(m.data(), 128, 256, mq.data(), ms.data()), Error);
  for (uint8_t v : mq) ASSERT_EQ(v, 0x55);
  EXPECT_EQ(ms[0], -1.0f);
}
