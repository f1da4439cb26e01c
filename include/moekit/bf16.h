// moekit/bf16.h: BF16 scalar conversion, host and device.
//
// BF16 is the top 16 bits of an IEEE fp32 (1 sign, 8 exponent, 7 mantissa bits). moekit
// stores it as uint16_t bits so the CPU reference and the CUDA kernels share one type
// without depending on cuda_bf16.h. Encoding rounds to nearest, ties to even (finite values
// past the largest bf16 round to ±inf, as IEEE does); NaN stays NaN (quiet, sign kept).
// Decoding is exact. These are the bit-exact definitions both sides use, so a GEMM's bf16
// output can be compared bit for bit where the fp32 values agree.
#pragma once

#include <cstdint>
#include <cstring>

#include "moekit/hd.h"

namespace moekit {

MOEKIT_HD float bf16_to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

MOEKIT_HD uint16_t float_to_bf16(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x0040u);  // NaN: keep it quiet
  // Round half to even on the 16 dropped bits: add 0x7FFF plus the lowest kept bit.
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

}  // namespace moekit
