// moekit/fp8.h: FP8 e4m3 ("e4m3fn") scalar conversion, host and device.
//
// e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; largest finite 448;
// 0x7F / 0xFF are NaN. Encoding rounds to nearest, ties to even, and saturates: any finite
// |x| above 448 becomes ±448 (what DeepSeek-V3's quantisation and the tensor core expect).
// NaN encodes to 0x7F. These are the bit-exact definitions both the CPU reference and the
// CUDA kernels use, so quantised payloads can be compared bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "moekit/hd.h"

namespace moekit {

constexpr float kFp8Max = 448.0f;  // largest finite e4m3 value

MOEKIT_HD float fp8_e4m3_to_float(uint8_t v) {
  uint32_t sign = uint32_t(v & 0x80) << 24;
  uint32_t exp = (v >> 3) & 0xF;
  uint32_t man = v & 0x7;
  float out;
  if (exp == 0xF && man == 0x7) {
    uint32_t bits = 0x7FC00000u | sign;
    memcpy(&out, &bits, 4);
    return out;
  }
  if (exp == 0) {
    out = float(man) * (1.0f / 512.0f);  // subnormal: man * 2^-9
  } else {
    uint32_t bits = ((exp + 120u) << 23) | (man << 20);  // rebias 7 -> 127
    memcpy(&out, &bits, 4);
  }
  return sign ? -out : out;
}

MOEKIT_HD uint8_t float_to_fp8_e4m3(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  uint8_t sign = uint8_t((bits >> 24) & 0x80);
  uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return 0x7F;          // NaN
  if (abs_bits >= 0x43E00000u) return sign | 0x7E;  // >= 448 (and inf): saturate to 448
  if (abs_bits < 0x3C800000u) {
    // Below the smallest normal 2^-6: subnormal grid of 2^-9, round half to even.
    float a;
    memcpy(&a, &abs_bits, 4);
    float q = a * 512.0f;  // exact scaling by a power of two
    uint32_t n = uint32_t(q);
    float frac = q - float(n);
    if (frac > 0.5f || (frac == 0.5f && (n & 1))) ++n;
    return sign | uint8_t(n);  // n == 8 is the smallest normal, encoded the same way
  }
  // Normal: keep 3 mantissa bits, round half to even on the 20 dropped bits.
  uint32_t exp = (abs_bits >> 23) - 120u;  // e4m3 biased exponent, 1..15
  uint32_t man = abs_bits & 0x7FFFFFu;
  uint32_t keep = man >> 20;
  uint32_t rest = man & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (keep & 1))) ++keep;
  if (keep == 8) {
    keep = 0;
    ++exp;
  }
  if (exp > 15 || (exp == 15 && keep == 7)) return sign | 0x7E;  // rounded past 448
  return sign | uint8_t((exp << 3) | keep);
}

}  // namespace moekit
