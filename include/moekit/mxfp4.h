// moekit/mxfp4.h: MXFP4, the 4-bit format of the OCP Microscaling (MX) specification v1.0, in
// which gpt-oss's checkpoints store their experts. Scalars host and device; rows on the host.
//
// A block of kMxfp4Group = 32 consecutive values of a weight row shares one scale X; each value is
// an e2m1 element P, and the weight is X · P.
//   e2m1 (4 bits): sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is
//     subnormal (0.5 · mantissa). The 16 codes are ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no infinity,
//     no NaN; code 8 is -0.
//   e8m0 (8 bits, the scale): 2^(s - 127) for s in [0, 254]; s = 255 is NaN.
// Exactness: an e2m1 value has at most 2 significant bits, so X · P is exact in fp32 (and in bf16,
// which has fp32's exponent range) whenever it is in range. For s <= kMxfp4MaxScale = 252 every
// value is finite (6 · 2^125 < 2^128) and exact (the smallest non-zero, 0.5 · 2^-127 = 2^-128, is an
// fp32 subnormal with bits to spare); moekit's loader refuses larger scales. Every e2m1 value is also
// exact in e4m3 (fp8.h), whose 3 mantissa bits and exponents 2^-6 .. 2^8 hold 0.5 .. 6.
//
// Packing (gpt-oss's checkpoint and layout.h's Mxfp4WeightLayout): element 2j of a row is the low
// nibble of byte j, element 2j + 1 the high nibble.
//
// Quantisation (the random-weight generator; the OCP rule): for a block with largest magnitude
// amax > 0, s = floor(log2(amax)) - 2 + 127 (2 is e2m1's largest exponent, so amax / X is in
// [4, 8)), clamped to [0, kMxfp4MaxScale]; then P = e2m1(x / X), rounded to the nearest value, ties
// to the even code, saturating at ±6 (so a block's largest |P| is 4 or 6). An all-zero block gets
// s = 127. Non-finite input is an Error naming its index, before anything is written.
#pragma once

#include <cstdint>
#include <cstring>

#include "moekit/layout.h"

#include "moekit/hd.h"

namespace moekit {

constexpr uint8_t kMxfp4MaxScale = 252;  // the largest e8m0 byte whose every value is finite in fp32
constexpr uint8_t kMxfp4UnitScale = 127; // 2^0: the scale of an all-zero block (and of padding)

// The value of an e2m1 code (its low 4 bits).
MOEKIT_HD float e2m1_to_float(uint8_t code) {
  const uint32_t exp = (code >> 1) & 3u, man = code & 1u;
  // Subnormal: 0.5 · m. Normal: 2^(exp - 1) · (1 + m/2) = (2 + m) · 2^exp / 4.
  const float mag = exp == 0 ? 0.5f * float(man) : float((2u + man) << exp) * 0.25f;
  return (code & 8u) ? -mag : mag;
}

// The value of an e8m0 scale byte: 2^(s - 127), NaN for 255.
MOEKIT_HD float e8m0_to_float(uint8_t s) {
  const uint32_t bits = s == 255 ? 0x7FC00000u : s == 0 ? 0x00400000u : uint32_t(s) << 23;
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

// x (finite) -> the e2m1 code of its nearest value, ties to the even code, saturating at ±6.
MOEKIT_HD uint8_t float_to_e2m1(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  const uint8_t sign = (bits >> 31) ? 8 : 0;
  const float a = x < 0 ? -x : x;
  // Codes 0..7 in order of magnitude; the midpoint between codes c - 1 and c goes to the even one.
  constexpr float kMidpoints[8] = {0.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint8_t c = 0;
  while (c < 7 && (a > kMidpoints[c + 1] || (a == kMidpoints[c + 1] && (c + 1) % 2 == 0))) ++c;
  return sign | c;
}

// One row of k values (k a multiple of kMxfp4Group) -> packed [k/2] bytes and scales [k/32].
void quantize_row_mxfp4(const float* x, int k, uint8_t* packed, uint8_t* scales);

// The inverse: packed [k/2] bytes and scales [k/32] -> out [k] fp32, exact (see above). A scale
// byte above kMxfp4MaxScale is an Error naming it (the loader refuses them before they get here).
void dequantize_row_mxfp4(const uint8_t* packed, const uint8_t* scales, int k, float* out);

// ---- The GPU GEMM's encodings (gemm.h; the kernel's side is kernels/cuda/mxfp4_convert.cuh) ----
// Both are tile-major: the run of 128 rows x one 128-deep block of expert e, 128-row block
// row_block and k block kb is run number mxfp4_gemm_run (64 bytes a row of codes, one word a row
// of scales).
MOEKIT_HD constexpr size_t mxfp4_gemm_run(int e, int row_block, int kb, int n_blocks, int k_blocks) {
  return (size_t(e) * n_blocks + row_block) * k_blocks + kb;
}

// The GEMM widens each 32-value group to e4m3 as P · 2^shift_g, shift_g = s_g - s_row + 6, where
// s_row is the row's largest scale byte over the groups that hold a non-zero value (an all-zero
// group, such as the loader's padding, is zero whatever its scale; an all-zero row takes 127), and
// applies 2^(s_row - 6 - 127) once per row after the K loop. The loader rewrites a checkpoint's
// codes and scales once for it, with the same number of bytes (4.25 bits per weight).
//
// Scales: the checkpoint's [E, N, K/32] (and its codes, to find the all-zero groups) -> one 32-bit
// word per (expert, row, 128-deep block), tile-major as the codes below: [E, N/128, K/128, 128],
// so that a stage's words are one run of 512 bytes and a tile's stages read adjacent runs. Word
// bits: 0..7 s_row (the same in every block of the row); then four 5-bit fields, group
// g's shift + kGemmShiftBias at bit kGemmShiftFirstBit + 5g, the shift clamped at -kGemmShiftBias
// (every e2m1 value times 2^-13 or less rounds to e4m3's 0, so the clamp changes no widened value;
// an all-zero group gets shift 0); bit kGemmScaleFastBit is set when every shift is >= -5 (the
// widening's table is then one add). Needs n, k multiples of 128 and every scale byte <=
// kMxfp4MaxScale (an Error naming the value otherwise).
constexpr int kGemmShiftBias = 13, kGemmShiftBits = 5, kGemmShiftFirstBit = 8, kGemmScaleFastBit = 28;
void mxfp4_scales_for_gemm(const Mxfp4WeightLayout& layout, const uint8_t* codes, const uint8_t* scales,
                           uint32_t* out);

// The MXFP4 GEMM's K order ("lane groups"). In a k32 slice of a wgmma, lane q of a tensor-core
// quad holds the A fragment's positions 4q..4q+3 and 16+4q..19+4q, so over the four slices of a
// 128-deep block it would hold a piece of each of the block's four 32-value scale groups, and
// widen with four groups' tables. The GEMM therefore multiplies K in a permuted order inside each
// 128-deep block, chosen so that everything lane q holds is group q: position p (4-byte unit
// m = p / 4, byte p % 4) holds the original K index mxfp4_k_source(p); unit m = 8s + 4h + q (slice
// s, half h, lane q) holds original unit 8q + 2s + h, a rotation of the unit index by two bits.
// Both operands are in that order: the loader writes the codes so (mxfp4_codes_for_gemm), and the
// FP8 activations an MXFP4 GEMM reads (gemm.h) are written so by whoever quantises them (the EP
// dispatch of an MXFP4 layer, EpConfig::mxfp4_k_order, and its activation kernel); mxfp4_k_position
// is the inverse. The 1x128 activation scales do not move (the order stays inside each block).
MOEKIT_HD constexpr int mxfp4_unit_source(int m) { return ((m & 3) << 3) | (m >> 2); }
MOEKIT_HD constexpr int mxfp4_unit_position(int o) { return ((o & 7) << 2) | (o >> 3); }
MOEKIT_HD constexpr int mxfp4_k_source(int p) { return (p & ~127) | mxfp4_unit_source((p & 127) >> 2) << 2 | (p & 3); }
MOEKIT_HD constexpr int mxfp4_k_position(int k) { return (k & ~127) | mxfp4_unit_position((k & 127) >> 2) << 2 | (k & 3); }
// The GEMM position (inside its 128-deep block) of value i (0..7) of the code word of lane q and k32
// slice s (mxfp4_codes_for_gemm below): the A fragment's 4q + i of the slice for values 0..3, 16 + 4q +
// (i - 4) for 4..7. The FP8 copy of an MXFP4 plan (gemm.h GemmConfig::mxfp4_fp8_copy) writes each
// widened word there.
MOEKIT_HD constexpr int mxfp4_fragment_position(int q, int s, int i) {
  return s * 32 + (i < 4 ? 4 * q + i : 16 + 4 * q + i - 4);
}
// rows x k FP8 bytes (k a multiple of 128) from the natural order into the GEMM's (host).
void mxfp4_permute_k(const uint8_t* in, int64_t rows, int k, uint8_t* out);

// Codes: the checkpoint's [E, N, K/2] packed codes -> the same number of bytes, tile-major: the
// 64-byte run of (expert e, row n, 128-deep block kb) goes to run ((e · N/128 + n/128) · K/128 + kb)
// · 128 + n % 128, so that the 128 rows x 128 K a GEMM stage holds are one contiguous 8 KB (one
// sequential read from HBM instead of 128 runs of 64 bytes, K/2 bytes apart). Within a run, one
// 32-bit word per (k32 slice s, lane q of a tensor-core quad) holds the values at the GEMM's
// positions s·32 + 4q + {0..3} (values 0..3) and s·32 + 16 + 4q + {0..3} (values 4..7): the
// thread's A fragment, which in the GEMM's K order (above) is the original K q·32 + 8s + {0..7},
// all of group q; word q·4 + s is that of lane q and slice s, so a thread reads its 16 bytes at
// once. Word bits: nibble i (bits 4i..4i+3) has value i's magnitude (code & 7) in bits 0..2; the
// sign (code & 8) of value i < 4 is bit 8i + 7, of value i >= 4 bit 8(i - 4) + 3. Needs n and k
// multiples of 128.
void mxfp4_codes_for_gemm(const Mxfp4WeightLayout& layout, const uint8_t* codes, uint8_t* out);

}  // namespace moekit
