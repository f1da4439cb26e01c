// tests/gpu: what the FP8 and MXFP4 GEMM tests share: random operands drawn on the host (FP8 codes,
// never NaN, and fp32 activation scales), the output poison, the error statistics of a BF16
// output against a float64 reference, and a forced config.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "moekit/bf16.h"
#include "moekit/gemm.h"

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

constexpr uint16_t kPoison = 0xFFFF;  // a BF16 NaN: an unwritten element can never pass

// A BF16 output against its float64 reference: rms relative error, the largest error relative to
// its row's largest reference value, poison left in real rows (unwritten) and poison overwritten
// in padding rows (clobbered).
struct ErrorStats {
  double num = 0, den = 0, max_rel = 0;
  long unwritten = 0, clobbered = 0;
  double rel() const { return std::sqrt(num / den); }
  void add_row(const uint16_t* got, const std::vector<double>& ref) {
    double scale = 0;
    for (double r : ref) scale = std::max(scale, std::fabs(r));
    for (size_t i = 0; i < ref.size(); ++i) {
      if (got[i] == kPoison) ++unwritten;
      const double g = bf16_to_float(got[i]);
      const double d = std::isnan(g) ? 1e30 : g - ref[i];
      num += d * d;
      den += ref[i] * ref[i];
      max_rel = std::max(max_rel, std::fabs(d) / scale);
    }
  }
  void check_untouched(const uint16_t* got, int n) {
    for (int i = 0; i < n; ++i) clobbered += got[i] != kPoison;
  }
};

inline GemmConfig forced(bool swap, int block_m, int splits) {
  GemmConfig c;
  c.swap_ab = swap;
  c.block_m = block_m;
  c.block_n = 128;
  c.num_splits = splits;
  return c;
}

}  // namespace moekit
