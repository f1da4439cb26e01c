// tests/gpu: random GEMM operands shared by the FP8 and MXFP4 GEMM tests: FP8 codes (never NaN)
// and fp32 activation scales, drawn on the host.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace moekit {

// Random FP8 codes: every finite e4m3 value, or only the positive ones; never NaN.
inline std::vector<uint8_t> random_fp8(size_t n, std::mt19937& rng, bool positive = false) {
  std::vector<uint8_t> v(n);
  std::uniform_int_distribution<int> d(0, 255);
  for (auto& x : v) {
    int c;
    do c = d(rng); while ((c & 0x7F) == 0x7F || (positive && (c & 0x80)));
    x = uint8_t(c);
  }
  return v;
}

inline std::vector<float> random_scales(size_t n, std::mt19937& rng) {
  std::vector<float> v(n);
  std::uniform_real_distribution<float> d(0.5e-3f, 2e-3f);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace moekit
