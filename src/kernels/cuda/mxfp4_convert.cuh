// mxfp4_convert.cuh: MXFP4 weights (mxfp4.h) to FP8 e4m3 on the chip, for the MXFP4 grouped
// GEMM (gemm_mxfp4.cuh). Device only; checked value by value against mxfp4.h in test_gemm_mxfp4.
//
// Hopper's tensor cores have no 4-bit type, so the GEMM streams the packed e2m1 codes and their
// e8m0 scales from HBM (4.25 bits per weight) and widens them to e4m3 in the registers that feed
// a register-sourced wgmma. The scale of a 32-value group cannot go into the tensor core (a
// 128-deep block partial spans four groups), so it is split in two powers of two:
//   w = P · 2^(s_g - 127) = [P · 2^(s_g - base)] · 2^(base - 127),   base = s_row - 6
// with s_row the row's largest scale over its non-zero groups (mxfp4.h). The bracket is the e4m3
// value the tensor core multiplies: its shift s_g - base is at most 6 (6 · 2^6 = 384 <= 448,
// e4m3's largest), so nothing saturates, and the row factor 2^(base - 127), the same for the whole
// row, is applied once after the K loop; the block's promotion multiplies by the activation's
// scale alone (gemm_fp8.cuh's two-level accumulation). A base per 128-deep block would fit the
// groups closer, but its factor changes every block and costs one more multiply per accumulator
// and stage, which is what limits the 128-token kernel (docs/gemm-mxfp4.md, runs 14 and 15).
// Exactness: every e2m1 value times 2^shift is exact in e4m3 for shift >= -8 (0.5 · 2^-8 = 2^-9,
// e4m3's smallest subnormal), i.e. for groups within 2^14 of the row's largest scale; a group
// further below is rounded to e4m3's subnormal grid (an error below 2^-10 · 2^(base-127), against
// values up to 448 · 2^(base-127) in the same row).
//
// The widening is a table lookup: the eight e4m3 codes of the magnitudes {0, .5, 1, 1.5, 2, 3, 4,
// 6} · 2^shift sit in two registers, and one `prmt` maps four 3-bit magnitudes to four bytes.
// The loader stores the codes re-encoded for this (mxfp4_codes_for_gemm, mxfp4.h): a 32-bit word
// holds 8 values, nibble i has value i's magnitude in its low 3 bits, and the spare fourth bits
// carry the signs where the widened bytes need them (value 0..3's sign at bit 8i + 7, value
// 4..7's at bit 8(i-4) + 3), so the sign is one masked OR: 7 instructions for 8 values. For
// shift >= -5 every table entry is a normal e4m3 number and the table is the shift-0 table
// with shift added to each exponent field (one multiply-add per register); below, the entries
// are rounded one by one. The shifts come precomputed with the scales (mxfp4_scales_for_gemm):
// one word per row and 128-deep block holds s_row and the block's four shifts, clamped at -13 (from
// there on every entry rounds to 0, so the clamp changes nothing), plus a flag for "all >= -5".
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moekit/mxfp4.h"

namespace moekit::mxfp4_detail {

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// The scale word of a row's 128-deep block (mxfp4.h's kGemmScale* layout).
__device__ __forceinline__ int row_max_scale(uint32_t word) { return int(word & 0xFF); }
__device__ __forceinline__ bool block_shifts_fast(uint32_t word) { return (word >> kGemmScaleFastBit) & 1u; }
__device__ __forceinline__ int group_shift_field(uint32_t word, int g) {  // shift + kGemmShiftBias
  return int((word >> (kGemmShiftFirstBit + kGemmShiftBits * g)) & ((1u << kGemmShiftBits) - 1));
}

// The row's factor 2^(base - 127), base = s_row - 6; exact for base in [-6, 246] (base <= 0: an
// fp32 subnormal).
__device__ __forceinline__ float row_factor(uint32_t word) {
  const int base = row_max_scale(word) - 6;
  return base >= 1 ? __int_as_float(base << 23) : __int_as_float(1 << (22 + base));
}

// e4m3 codes of the e2m1 magnitudes 0..7 times 2^shift (shift <= 6): bytes of .x for 0..3, of .y
// for 4..7; magnitude 0 stays code 0. `field` = shift + kGemmShiftBias.
__device__ __forceinline__ uint2 e4m3_table_fast(int field) {
  // Shift 0: 0, 0.5, 1, 1.5 = 0x00 0x30 0x38 0x3C and 2, 3, 4, 6 = 0x40 0x44 0x48 0x4C. Adding
  // 8·shift to a byte adds shift to its exponent field; for shift in [-5, 6] no byte leaves
  // [0x08, 0x7C], so no carry or borrow crosses a byte (the constants are taken mod 2^32).
  constexpr uint32_t kLo = 0x08080800u, kHi = 0x08080808u;
  return make_uint2(0x3C383000u - uint32_t(kGemmShiftBias) * kLo + uint32_t(field) * kLo,
                    0x4C484440u - uint32_t(kGemmShiftBias) * kHi + uint32_t(field) * kHi);
}
__device__ __forceinline__ uint2 e4m3_table_rounded(int field) {
  uint32_t t[2] = {0, 0};
#pragma unroll
  for (int i = 1; i < 8; ++i) {
    const float v = ldexpf(e2m1_to_float(uint8_t(i)), field - kGemmShiftBias);
    t[i / 4] |= uint32_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)) << (8 * (i % 4));
  }
  return make_uint2(t[0], t[1]);
}
__device__ __forceinline__ uint2 e4m3_table(int field) {
  return field >= kGemmShiftBias - 5 ? e4m3_table_fast(field) : e4m3_table_rounded(field);
}
// The same as a call: for the GEMM's rarely taken path, whose code would otherwise sit in every
// copy of its hot loops (the instruction fetch is what the decode kernel waits on most).
static __device__ __noinline__ uint2 e4m3_table_outlined(int field) { return e4m3_table(field); }

// A word of eight re-encoded codes (see the header) -> eight e4m3 bytes in value order (.x: values
// 0..3, .y: 4..7), through a table of e4m3_table.
__device__ __forceinline__ uint2 e2m1x8_to_e4m3(uint32_t word, uint2 table) {
  const uint32_t mag = word & 0x77777777u;
  const uint32_t lo = prmt(table.x, table.y, mag) | (word & 0x80808080u);
  const uint32_t hi = prmt(table.x, table.y, mag >> 16) | ((word << 4) & 0x80808080u);
  return make_uint2(lo, hi);
}

}  // namespace moekit::mxfp4_detail
