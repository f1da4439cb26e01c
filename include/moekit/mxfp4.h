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

#ifndef MOEKIT_HD
#if defined(__CUDACC__)
#define MOEKIT_HD __host__ __device__ __forceinline__
#else
#define MOEKIT_HD inline
#endif
#endif

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

}  // namespace moekit
