// MXFP4 (mxfp4.h) against an independent decoder written here from the format's definition (OCP
// Microscaling v1.0): the e2m1 table and ldexp. Every code with every scale, value by value; the
// packing order; rounding and saturation of the encoder; the quantisation rule; bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "expect_error.h"
#include "moekit/mxfp4.h"

using namespace moekit;

namespace {

// e2m1: bit 3 sign, then the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7.
constexpr double kE2m1[16] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};

// e8m0: 2^(s - 127).
double e8m0(int s) { return std::ldexp(1.0, s - 127); }

// The independent encoder: the nearest table magnitude, a tie to the even code, above 6 -> 6.
int nearest_code(double x) {
  const double a = std::fabs(x);
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(kE2m1[c] - a), d_best = std::fabs(kE2m1[best] - a);
    if (d < d_best || (d == d_best && c % 2 == 0)) best = c;
  }
  return (std::signbit(x) ? 8 : 0) | best;
}

}  // namespace

TEST(Mxfp4, EveryCodeIsTheTableValue) {
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_to_float(uint8_t(c));
    EXPECT_EQ(double(v), kE2m1[c]) << "code " << c;
    EXPECT_EQ(std::signbit(v), std::signbit(kE2m1[c])) << "code " << c;  // code 8 is -0
    EXPECT_EQ(e2m1_to_float(uint8_t(c | 0xF0)), v) << "only the low 4 bits count";
  }
}

TEST(Mxfp4, EveryScaleIsAPowerOfTwo) {
  for (int s = 0; s < 255; ++s) EXPECT_EQ(double(e8m0_to_float(uint8_t(s))), e8m0(s)) << "scale byte " << s;
  EXPECT_TRUE(std::isnan(e8m0_to_float(255)));
}

// Every (code, scale) pair the loader accepts, decoded by dequantize_row_mxfp4, equals the table
// value times ldexp exactly: the product is exact in fp32 (2 significant bits) for scales up to 252.
TEST(Mxfp4, RowsDecodeEveryCodeWithEveryScaleExactly) {
  // A row of 256 values: 8 groups of 32; every code appears in both nibbles of the 128 bytes.
  const int k = 256;
  std::vector<uint8_t> packed(k / 2), scales(k / kMxfp4Group);
  for (int j = 0; j < k / 2; ++j) packed[j] = uint8_t(j % 16 | (((j / 16 + j) % 16) << 4));
  std::vector<float> out(k);
  for (int s0 = 0; s0 <= kMxfp4MaxScale; s0 += int(scales.size())) {
    for (size_t g = 0; g < scales.size(); ++g) scales[g] = uint8_t(std::min<int>(s0 + int(g), kMxfp4MaxScale));
    dequantize_row_mxfp4(packed.data(), scales.data(), k, out.data());
    for (int i = 0; i < k; ++i) {
      const uint8_t byte = packed[i / 2];
      const int code = i % 2 == 0 ? byte & 0xF : byte >> 4;  // element 2j is the low nibble of byte j
      const double want = kE2m1[code] * e8m0(scales[i / kMxfp4Group]);
      ASSERT_EQ(double(out[i]), want) << "element " << i << " code " << code << " scale " << int(scales[i / kMxfp4Group]);
      ASSERT_TRUE(std::isfinite(out[i]));
    }
  }
}

TEST(Mxfp4, ScalesAboveTheLimitAreRefused) {
  std::vector<uint8_t> packed(16, 0x77), scales = {253};
  std::vector<float> out(32);
  expect_error([&] { dequantize_row_mxfp4(packed.data(), scales.data(), 32, out.data()); }, {"e8m0 byte 253", "at most 252"});
  scales[0] = 255;
  expect_error([&] { dequantize_row_mxfp4(packed.data(), scales.data(), 32, out.data()); }, {"e8m0 byte 255"});
  expect_error([&] { dequantize_row_mxfp4(packed.data(), scales.data(), 48, out.data()); }, {"k = 48", "multiple of 32"});
}

TEST(Mxfp4, EncoderRoundsToNearestTiesToEvenAndSaturates) {
  // Midpoints and neighbours of every step, and values past 6.
  for (double a : {0.0, 0.1, 0.25, 0.3, 0.75, 1.0, 1.25, 1.3, 1.75, 2.2, 2.5, 2.9, 3.5, 4.9, 5.0, 5.1, 6.0, 7.9, 1e6})
    for (double x : {a, -a})
      EXPECT_EQ(int(float_to_e2m1(float(x))), nearest_code(x)) << "x = " << x;
  EXPECT_EQ(float_to_e2m1(0.25f), 0);    // tie between 0 (code 0) and 0.5 (code 1)
  EXPECT_EQ(float_to_e2m1(0.75f), 2);    // tie between 0.5 (1) and 1 (2)
  EXPECT_EQ(float_to_e2m1(5.0f), 6);     // tie between 4 (6) and 6 (7)
  EXPECT_EQ(float_to_e2m1(-100.0f), 15); // -6
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-8.0f, 8.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = u(rng);
    ASSERT_EQ(int(float_to_e2m1(x)), nearest_code(x)) << "x = " << x;
  }
}

// The OCP rule: X = 2^(floor(log2 amax) - 2), each value the nearest e2m1 of x / X.
TEST(Mxfp4, QuantisationFollowsTheRule) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int k = 4096;
  std::vector<float> x(k), back(k);
  for (int i = 0; i < k; ++i) x[i] = normal(rng) * std::ldexp(1.0f, i / 512 - 4);  // groups of different magnitudes
  x[100] = 0.0f;
  std::fill(x.begin() + 64, x.begin() + 96, 0.0f);  // an all-zero group
  std::vector<uint8_t> packed(k / 2), scales(k / kMxfp4Group);
  quantize_row_mxfp4(x.data(), k, packed.data(), scales.data());
  dequantize_row_mxfp4(packed.data(), scales.data(), k, back.data());
  for (int g = 0; g < k / kMxfp4Group; ++g) {
    double amax = 0;
    for (int i = 0; i < kMxfp4Group; ++i) amax = std::max(amax, std::fabs(double(x[g * kMxfp4Group + i])));
    if (amax == 0) {
      EXPECT_EQ(scales[g], kMxfp4UnitScale) << "group " << g;
      for (int i = 0; i < kMxfp4Group; ++i) EXPECT_EQ(back[g * kMxfp4Group + i], 0.0f);
      continue;
    }
    const int s = int(std::floor(std::log2(amax))) - 2 + 127;
    ASSERT_EQ(int(scales[g]), s) << "group " << g;
    int largest = 0;
    for (int i = 0; i < kMxfp4Group; ++i) {
      const int idx = g * kMxfp4Group + i;
      const int code = nearest_code(double(x[idx]) / e8m0(s));
      EXPECT_EQ(double(back[idx]), kE2m1[code] * e8m0(s)) << "element " << idx;
      largest = std::max(largest, code & 7);
    }
    EXPECT_TRUE(largest == 6 || largest == 7) << "group " << g << ": the largest |value| is 4 or 6 times the scale";
  }
  x[7] = NAN;
  expect_error([&] { quantize_row_mxfp4(x.data(), k, packed.data(), scales.data()); }, {"x[7] = nan", "not finite"});
}

namespace moekit {
namespace {

// The GEMM's scale words, field by field from the definition in mxfp4.h: the row's base is its
// largest scale over the groups holding a non-zero value.
TEST(Mxfp4, ScalesForGemmEncodeEachBlock) {
  const Mxfp4WeightLayout l{3, 256, 384};
  std::vector<uint8_t> scales(l.scale_elems()), codes(l.w_bytes());
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> d(90, 140), byte(0, 255);
  for (auto& x : scales) x = uint8_t(d(rng));
  for (auto& c : codes) c = uint8_t(byte(rng));
  scales[0] = 0;  // a group far below its row's largest: the shift is clamped at -13
  // Row 1 of expert 0: every group zero (+0 and -0 codes) but two; the zero groups get the largest
  // scale bytes and must not set the base.
  const int groups = int(l.row_scales());
  uint8_t* c1 = &codes[l.w_offset(0, 1)];
  uint8_t* s1 = &scales[l.scale_offset(0, 1)];
  for (int i = 0; i < int(l.row_bytes()); ++i) c1[i] = (i % 3) ? 0x00 : 0x88;
  for (int g = 0; g < groups; ++g) s1[g] = 200;
  c1[3 * 16 + 5] = 0x12, s1[3] = 101;    // group 3: base 101
  c1[10 * 16 + 0] = 0x70, s1[10] = 95;   // group 10: shift 95 - 101 + 6 = 0
  // Row 2 of expert 1: all zero: base 127, every shift 0, fast.
  std::fill_n(&codes[l.w_offset(1, 2)], l.row_bytes(), uint8_t(0));
  std::vector<uint32_t> out(l.scale_elems() / 4, 0xEEEEEEEEu);
  mxfp4_scales_for_gemm(l, codes.data(), scales.data(), out.data());
  int clamped = 0, slow = 0;
  for (int e = 0; e < l.num_experts; ++e)
    for (int n = 0; n < l.n; ++n) {
      const uint8_t* s = &scales[l.scale_offset(e, n)];
      const uint8_t* c = &codes[l.w_offset(e, n)];
      auto nonzero = [&](int g) {
        for (int i = 0; i < 32; ++i)
          if (((c[(g * 32 + i) / 2] >> (4 * (i % 2))) & 7) != 0) return true;
        return false;
      };
      int smax = -1;
      for (int g = 0; g < groups; ++g)
        if (nonzero(g)) smax = std::max(smax, int(s[g]));
      if (smax < 0) smax = 127;
      if (e == 0 && n == 1) {
        ASSERT_EQ(smax, 101);
      }
      if (e == 1 && n == 2) {
        ASSERT_EQ(smax, 127);
      }
      for (int kb = 0; kb < l.k / 128; ++kb) {
        const uint32_t w = out[((size_t(e) * (l.n / 128) + n / 128) * (l.k / 128) + kb) * 128 + n % 128];
        ASSERT_EQ(int(w & 0xFF), smax) << "e " << e << " n " << n << " kb " << kb;
        bool fast = true;
        for (int g = 0; g < 4; ++g) {
          const int gg = kb * 4 + g;
          const int shift = nonzero(gg) ? int(s[gg]) - smax + 6 : 0;
          const int field = int((w >> (kGemmShiftFirstBit + 5 * g)) & 31);
          EXPECT_EQ(field - kGemmShiftBias, std::max(shift, -13)) << "e " << e << " n " << n << " group " << gg;
          clamped += shift < -13;
          fast = fast && shift >= -5;
        }
        EXPECT_EQ(bool(w >> kGemmScaleFastBit & 1), fast);
        EXPECT_EQ(w >> (kGemmScaleFastBit + 1), 0u);
        slow += !fast;
      }
    }
  EXPECT_GT(clamped, 0) << "the draw must reach the clamp";
  EXPECT_GT(slow, 0) << "and the rounded tables";
  // The zero-group row: groups 3 (shift 6) and 10 (shift 0) and the zero groups (shift 0) all fast.
  EXPECT_TRUE(out[0 * 128 + 1] >> kGemmScaleFastBit & 1);  // expert 0, rows 0..127, block 0; row 1
  EXPECT_TRUE(out[2 * 128 + 1] >> kGemmScaleFastBit & 1);  // block 2
  expect_error([&] { mxfp4_scales_for_gemm(Mxfp4WeightLayout{1, 2880, 128}, codes.data(), scales.data(), out.data()); },
               {"N = 2880"});
  scales[5] = 253;
  expect_error([&] { mxfp4_scales_for_gemm(l, codes.data(), scales.data(), out.data()); }, {"e8m0 byte 253"});
}

// The GEMM's code words: decoding each word by its definition gives back every code of the row.
TEST(Mxfp4, CodesForGemmHoldEachFragmentWithItsSigns) {
  const Mxfp4WeightLayout l{2, 256, 384};
  std::vector<uint8_t> codes(l.w_bytes()), out(l.w_bytes());
  std::mt19937 rng(7);
  for (auto& c : codes) c = uint8_t(rng());
  mxfp4_codes_for_gemm(l, codes.data(), out.data());
  auto code_at = [&](size_t row_byte0, int k) { return (codes[row_byte0 + k / 2] >> (4 * (k % 2))) & 0xF; };
  for (int e = 0; e < l.num_experts; ++e)
    for (int n = 0; n < l.n; ++n)
      for (int kb = 0; kb < l.k / 128; ++kb)
        for (int q = 0; q < 4; ++q)
          for (int s = 0; s < 4; ++s) {
            // Tile-major: the run of (e, n, kb) is run ((e · N/128 + n/128) · K/128 + kb) · 128 + n % 128.
            const size_t run = ((size_t(e) * (l.n / 128) + n / 128) * (l.k / 128) + kb) * 128 + n % 128;
            const uint8_t* b = &out[run * 64 + (q * 4 + s) * 4];
            const uint32_t w = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
            for (int i = 0; i < 8; ++i) {
              // Lane q's word of slice s holds original K q·32 + 8s + i: all of scale group q.
              const int k = kb * 128 + q * 32 + 8 * s + i;
              const int sign_bit = i < 4 ? 8 * i + 7 : 8 * (i - 4) + 3;
              const int got = int((w >> (4 * i)) & 7) | int((w >> sign_bit) & 1) << 3;
              ASSERT_EQ(got, code_at(l.w_offset(e, n), k)) << "e " << e << " n " << n << " k " << k;
            }
          }
  expect_error([&] { mxfp4_codes_for_gemm(Mxfp4WeightLayout{1, 128, 96}, codes.data(), out.data()); }, {"K = 96"});
  expect_error([&] { mxfp4_codes_for_gemm(Mxfp4WeightLayout{1, 3, 128}, codes.data(), out.data()); }, {"N = 3"});
}

// The GEMM's K order inside a 128-deep block: a permutation (source and position inverse to each
// other), blocks stay in place, 4-byte units move whole, and every position a quad lane q holds in
// the four k32 slices of a wgmma fragment (4q..4q+3 and 16+4q..19+4q of each slice) is in group q.
TEST(Mxfp4, KOrderPutsEachLanesFragmentInOneGroup) {
  std::vector<int> seen(256, 0);
  for (int p = 0; p < 256; ++p) {
    const int k = mxfp4_k_source(p);
    ASSERT_EQ(k / 128, p / 128) << p;
    ASSERT_EQ(k % 4, p % 4) << p;
    ASSERT_EQ(mxfp4_k_position(k), p) << p;
    ++seen[k];
  }
  for (int k = 0; k < 256; ++k) ASSERT_EQ(seen[k], 1) << k;
  for (int q = 0; q < 4; ++q)
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 8; ++i) {
        const int p = s * 32 + (i < 4 ? 4 * q + i : 16 + 4 * q + i - 4);
        EXPECT_EQ(mxfp4_k_source(p) / 32, q) << "lane " << q << " slice " << s << " value " << i;
        // The code word's value i (CodesForGemmHoldEachFragmentWithItsSigns: original K q·32 + 8s + i)
        // sits at GEMM position p, where the FP8 copy writes it.
        EXPECT_EQ(mxfp4_fragment_position(q, s, i), p);
        EXPECT_EQ(mxfp4_k_source(p) % 128, q * 32 + 8 * s + i) << "lane " << q << " slice " << s << " value " << i;
      }
  const std::vector<uint8_t> row = [] {
    std::vector<uint8_t> r(2 * 256);
    for (size_t i = 0; i < r.size(); ++i) r[i] = uint8_t(i * 7 + 3);
    return r;
  }();
  std::vector<uint8_t> out(row.size());
  mxfp4_permute_k(row.data(), 2, 256, out.data());
  for (int r = 0; r < 2; ++r)
    for (int p = 0; p < 256; ++p) ASSERT_EQ(out[r * 256 + p], row[r * 256 + mxfp4_k_source(p)]);
  expect_error([&] { mxfp4_permute_k(row.data(), 1, 96, out.data()); }, {"k = 96"});
}

}  // namespace
}  // namespace moekit
