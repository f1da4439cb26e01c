// MXFP4 rows on the host: the OCP quantisation rule and exact dequantisation (see include/moekit/mxfp4.h).
#include "moekit/mxfp4.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "moekit/check.h"

namespace moekit {

namespace {

void check_row_length(const char* who, int k) {
  MOEKIT_CHECK(k > 0 && k % kMxfp4Group == 0, fmt::format("{}: k = {} must be a positive multiple of {}", who, k, kMxfp4Group));
}

}  // namespace

void quantize_row_mxfp4(const float* x, int k, uint8_t* packed, uint8_t* scales) {
  check_row_length("quantize_row_mxfp4", k);
  for (int i = 0; i < k; ++i)
    MOEKIT_CHECK(std::isfinite(x[i]), fmt::format("quantize_row_mxfp4: x[{}] = {} is not finite", i, x[i]));
  for (int g = 0; g < k / kMxfp4Group; ++g) {
    const float* xg = x + g * kMxfp4Group;
    float amax = 0.0f;
    for (int i = 0; i < kMxfp4Group; ++i) amax = std::max(amax, std::fabs(xg[i]));
    int s = kMxfp4UnitScale;
    if (amax > 0.0f) {
      int e = 0;
      std::frexp(amax, &e);  // amax = f · 2^e, f in [0.5, 1): floor(log2(amax)) = e - 1
      s = std::clamp(e - 1 - 2 + 127, 0, int(kMxfp4MaxScale));
    }
    scales[g] = uint8_t(s);
    const float scale = e8m0_to_float(uint8_t(s));
    for (int i = 0; i < kMxfp4Group; i += 2) {
      const uint8_t lo = float_to_e2m1(xg[i] / scale), hi = float_to_e2m1(xg[i + 1] / scale);
      packed[(g * kMxfp4Group + i) / 2] = uint8_t(lo | (hi << 4));
    }
  }
}

void dequantize_row_mxfp4(const uint8_t* packed, const uint8_t* scales, int k, float* out) {
  check_row_length("dequantize_row_mxfp4", k);
  for (int g = 0; g < k / kMxfp4Group; ++g)
    MOEKIT_CHECK(scales[g] <= kMxfp4MaxScale,
                 fmt::format("dequantize_row_mxfp4: scale {} of the row is the e8m0 byte {}, expected at most {} "
                             "(2^125; 255 is NaN)", g, scales[g], kMxfp4MaxScale));
  for (int g = 0; g < k / kMxfp4Group; ++g) {
    const float scale = e8m0_to_float(scales[g]);
    for (int i = g * kMxfp4Group; i < (g + 1) * kMxfp4Group; i += 2) {
      const uint8_t byte = packed[i / 2];
      out[i] = e2m1_to_float(byte & 0xF) * scale;
      out[i + 1] = e2m1_to_float(byte >> 4) * scale;
    }
  }
}

}  // namespace moekit
