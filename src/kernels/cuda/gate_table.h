// gate_table.h: where the activation kernel finds a gate's activation_gate value (silu_fp8.cuh): in
// the part of the 65536-entry table (one float per bf16 bit pattern, 256 KB in global memory) that
// each CTA copies into shared memory, or else in the global table itself.
//
// Why a table: the gate half of an activation (g / (1 + exp(-g)), or gpt-oss's clamped form) is a
// function of one bf16 value, and computing it the reference's way on the GPU takes an fp64 exp, an
// IEEE division and their conversions per value: ncu found the activation kernel issue-bound
// (0.75 warp-instructions per cycle per scheduler, DRAM 8.6% busy; docs/layer-gpu.md item 39). A
// look-up is one shared-memory load, of the bits the computation gives (the table is computed once).
// Why a window: gathers from L1 serve one cache line per cycle (~20 distinct lines per warp for
// gates spread over a few binades), gathers from shared memory ~32 banks per cycle. The window is
// the gates with |g| in [2^-9, 2^7), both signs: 16 binades x 128 mantissas x 2 signs = 4096
// floats, 16 KB per CTA. Beyond 2^7 the values are g, 0 or their limits; below 2^-9 they are
// rare in a GEMM output; both are right from the global table, only slower.
#pragma once

#include <cstdint>

#include "moekit/hd.h"

namespace moekit {

constexpr int kBf16Values = 65536;             // the table's entries
constexpr int kGateWindowFirstExponent = 118;  // bf16 exponent field of 2^-9 (bias 127)
constexpr int kGateWindowBinades = 16;         // up to 2^7
constexpr int kGateWindowHalf = kGateWindowBinades * 128;  // one sign's entries
constexpr int kGateWindow = 2 * kGateWindowHalf;           // 4096 floats
constexpr int kGateWindowFirstBits = kGateWindowFirstExponent << 7;
static_assert((kGateWindowHalf & (kGateWindowHalf - 1)) == 0, "gate_window_offset's all-in test ORs offsets");

// gate_window_index in two halves, for a caller that tests several gates at once: b's magnitude
// bits past the window's first (wrapping below it), in the window when < kGateWindowHalf (a power
// of two, so several gates are all in it when their offsets OR-ed together are); and b's entry
// when it is in.
MOEKIT_HD unsigned gate_window_offset(uint16_t b) { return unsigned(b & 0x7FFF) - unsigned(kGateWindowFirstBits); }
MOEKIT_HD int gate_window_entry(uint16_t b) { return int(gate_window_offset(b)) + (b >> 15) * kGateWindowHalf; }

// The window entry of gate bits b, or -1 when b is outside it (then: the global table's entry b).
// Entry i of each half is table entry first_bits + i of that sign, so the window is two contiguous
// runs of the table (gate_window_bits) and a CTA fills it with 16-byte copies.
MOEKIT_HD int gate_window_index(uint16_t b) {
  return gate_window_offset(b) < unsigned(kGateWindowHalf) ? gate_window_entry(b) : -1;
}

// The gate bits of window entry i in [0, kGateWindow): gate_window_index's inverse.
MOEKIT_HD uint16_t gate_window_bits(int i) {
  return uint16_t((i / kGateWindowHalf) * 0x8000 + kGateWindowFirstBits + i % kGateWindowHalf);
}

}  // namespace moekit
