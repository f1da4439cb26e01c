// The activation kernel's shared-memory window of the gate table (src/kernels/cuda/gate_table.h):
// its index math is plain integer code shared with the host, so it is checked here on every bf16
// bit pattern. A wrong index would give a CTA another gate's value; the GPU tests would see it
// only for the gates their data happen to hold.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cuda/gate_table.h"
#include "moekit/bf16.h"

using namespace moekit;

// Every bf16 gate with |g| in the window's range (gate_table.h's kGateWindowFirstExponent and
// kGateWindowBinades) has exactly one window entry, whose bits are its own; every other gate
// (zeros, subnormals, smaller or larger magnitudes, infinities, NaNs) has none.
TEST(GateWindow, EveryGateInRangeHasOneEntryAndNoOtherHasAny) {
  std::vector<int> hits(kGateWindow, 0);
  int inside = 0;
  for (int b = 0; b < kBf16Values; ++b) {
    const float g = bf16_to_float(uint16_t(b));
    const bool in_range = std::isfinite(g) && std::fabs(g) >= std::ldexp(1.0f, kGateWindowFirstExponent - 127) &&
                          std::fabs(g) < std::ldexp(1.0f, kGateWindowFirstExponent - 127 + kGateWindowBinades);
    const int i = gate_window_index(uint16_t(b));
    if (!in_range) {
      EXPECT_EQ(i, -1) << "bits 0x" << std::hex << b << " (" << g << ") are outside the window";
      continue;
    }
    ++inside;
    ASSERT_GE(i, 0) << "bits 0x" << std::hex << b << " (" << g << ")";
    ASSERT_LT(i, kGateWindow);
    EXPECT_EQ(gate_window_bits(i), uint16_t(b)) << "entry " << i;
    ++hits[size_t(i)];
  }
  EXPECT_EQ(inside, kGateWindow);
  for (int i = 0; i < kGateWindow; ++i) EXPECT_EQ(hits[size_t(i)], 1) << "entry " << i;
}

// The fill copies 4 entries at a time from table + gate_window_bits(i), i a multiple of 4: the
// 4 must be consecutive table entries (one half of the window, one 16-byte aligned run).
TEST(GateWindow, FillCopiesAreAlignedRunsOfTheTable) {
  for (int i = 0; i < kGateWindow; i += 4) {
    const int first = gate_window_bits(i);
    EXPECT_EQ(first % 4, 0) << "entry " << i;
    for (int j = 1; j < 4; ++j) EXPECT_EQ(int(gate_window_bits(i + j)), first + j) << "entry " << i + j;
  }
}

// The activation kernel asks whether a lane's four gates are all in the window with one test of
// their offsets OR-ed together (gate_window_offset), and then takes each entry unchecked
// (gate_window_entry). Checked against gate_window_index on every gate paired with gates at and
// around both edges of both halves of the window.
TEST(GateWindow, OffsetsOredTellWhetherAllAreInAndEntriesAgree) {
  std::vector<uint16_t> partners;
  for (int sign : {0, 0x8000})
    for (int edge : {kGateWindowFirstBits, kGateWindowFirstBits + kGateWindowHalf})
      for (int d = -3; d <= 3; ++d) partners.push_back(uint16_t(sign + edge + d));
  partners.push_back(0);
  partners.push_back(0x7F80);  // +inf
  partners.push_back(0xFFC0);  // a NaN
  for (int b = 0; b < kBf16Values; ++b) {
    const uint16_t a = uint16_t(b);
    if (gate_window_index(a) >= 0) EXPECT_EQ(gate_window_entry(a), gate_window_index(a)) << "bits 0x" << std::hex << b;
    for (uint16_t p : partners) {
      const bool all_in = gate_window_index(a) >= 0 && gate_window_index(p) >= 0;
      const bool ored_in = (gate_window_offset(a) | gate_window_offset(p)) < unsigned(kGateWindowHalf);
      ASSERT_EQ(ored_in, all_in) << "bits 0x" << std::hex << b << " and 0x" << p;
    }
  }
}
