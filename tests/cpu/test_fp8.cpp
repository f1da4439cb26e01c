// FP8 e4m3 conversion: every code round-trips, rounding is to nearest-even, saturation at 448.
#include <gtest/gtest.h>

#include <cmath>

#include "moekit/fp8.h"

using namespace moekit;

TEST(Fp8, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    float f = fp8_e4m3_to_float(uint8_t(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f)) << c;
      continue;
    }
    uint8_t back = float_to_fp8_e4m3(f);
    if (c == 0x80) EXPECT_EQ(back, 0x80);  // -0 keeps its sign
    else EXPECT_EQ(back, c) << "code " << c << " value " << f;
  }
}

TEST(Fp8, KnownValues) {
  EXPECT_EQ(fp8_e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(float_to_fp8_e4m3(1000.0f), 0x7E);
  EXPECT_EQ(float_to_fp8_e4m3(-1e30f), 0xFE);
  EXPECT_EQ(float_to_fp8_e4m3(INFINITY), 0x7E);
  EXPECT_EQ(float_to_fp8_e4m3(NAN), 0x7F);
}

// Brute force: the encoder picks the nearest representable value, ties to the even code.
TEST(Fp8, NearestEvenAgainstBruteForce) {
  std::vector<float> grid;
  for (int c = 0; c < 0x7F; ++c) grid.push_back(fp8_e4m3_to_float(uint8_t(c)));
  uint32_t state = 12345;
  for (int i = 0; i < 200000; ++i) {
    state = state * 1664525u + 1013904223u;
    float x = std::ldexp(float(state >> 8) / float(1 << 24), int(state % 22) - 12);  // [2^-12, 2^10)
    if (i % 7 == 0) {  // exact midpoints between neighbours
      int c = int(state % 0x7D);
      x = 0.5f * (grid[c] + grid[c + 1]);
    }
    int best = 0;
    for (int c = 1; c < 0x7F; ++c) {
      double d = std::fabs(double(grid[c]) - x), db = std::fabs(double(grid[best]) - x);
      if (d < db || (d == db && (c % 2 == 0))) best = c;
    }
    if (x > 448.0f) best = 0x7E;
    EXPECT_EQ(float_to_fp8_e4m3(x), best) << "x = " << x;
    EXPECT_EQ(float_to_fp8_e4m3(-x), 0x80 | best) << "x = " << -x;
  }
}
