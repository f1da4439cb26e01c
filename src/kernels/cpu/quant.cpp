// FP8 quantisation reference (see include/moekit/quant.h).
#include "moekit/quant.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "moekit/check.h"
#include "moekit/fp8.h"
#include "moekit/layout.h"

namespace moekit {

const char* fp8_scaling_name(Fp8Scaling scaling) { return scaling == Fp8Scaling::kPerToken ? "per-token" : "1x128"; }

void quantize_row_fp8(const float* x, int k, uint8_t* q, float* scales, int64_t scale_stride, Fp8Scaling scaling) {
  MOEKIT_CHECK(k > 0 && k % kQuantBlock == 0, fmt::format("quantize_row_fp8: k = {} must be a positive multiple of 128", k));
  MOEKIT_CHECK(scaling == Fp8Scaling::kPerBlock || scaling == Fp8Scaling::kPerToken,
               fmt::format("quantize_row_fp8: scaling = {}, expected kPerBlock (0) or kPerToken (1)", int(scaling)));
  // Check the whole row first, so that bad input writes nothing.
  for (int i = 0; i < k; ++i)
    MOEKIT_CHECK(std::isfinite(x[i]), fmt::format("quantize_row_fp8: x[{}] = {} is not finite", i, x[i]));
  float row_amax = 0.0f;
  if (scaling == Fp8Scaling::kPerToken)
    for (int i = 0; i < k; ++i) row_amax = std::max(row_amax, std::fabs(x[i]));
  for (int b = 0; b < k / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    float amax = row_amax;
    if (scaling == Fp8Scaling::kPerBlock)
      for (int i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    float scale = std::max(amax, kMinAmax) / kFp8Max;
    scales[b * scale_stride] = scale;
    for (int i = 0; i < kQuantBlock; ++i) q[b * kQuantBlock + i] = float_to_fp8_e4m3(xb[i] / scale);
  }
}

void quantize_blocks_fp8(const float* x, int rows, int cols, uint8_t* q, float* scales) {
  MOEKIT_CHECK(rows > 0 && rows % kQuantBlock == 0 && cols > 0 && cols % kQuantBlock == 0,
               fmt::format("quantize_blocks_fp8: shape [{}, {}] must be positive multiples of 128", rows, cols));
  // Check the whole matrix first, so that bad input writes nothing.
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      float v = x[size_t(r) * cols + c];
      MOEKIT_CHECK(std::isfinite(v), fmt::format("quantize_blocks_fp8: x[{}, {}] = {} is not finite", r, c, v));
    }
  const int col_blocks = cols / kQuantBlock;
  for (int rb = 0; rb < rows / kQuantBlock; ++rb)
    for (int cb = 0; cb < col_blocks; ++cb) {
      float amax = 0.0f;
      for (int r = 0; r < kQuantBlock; ++r)
        for (int c = 0; c < kQuantBlock; ++c)
          amax = std::max(amax, std::fabs(x[size_t(rb * kQuantBlock + r) * cols + cb * kQuantBlock + c]));
      float scale = std::max(amax, kMinAmax) / kFp8Max;
      scales[size_t(rb) * col_blocks + cb] = scale;
      for (int r = 0; r < kQuantBlock; ++r)
        for (int c = 0; c < kQuantBlock; ++c) {
          size_t i = size_t(rb * kQuantBlock + r) * cols + cb * kQuantBlock + c;
          q[i] = float_to_fp8_e4m3(x[i] / scale);
        }
    }
}

void dequantize_row_fp8(const uint8_t* q, const float* scales, int64_t scale_stride, int k, float* x) {
  MOEKIT_CHECK(k > 0 && k % kQuantBlock == 0, fmt::format("dequantize_row_fp8: k = {} must be a positive multiple of 128", k));
  for (int i = 0; i < k; ++i) x[i] = fp8_e4m3_to_float(q[i]) * scales[(i / kQuantBlock) * scale_stride];
}

}  // namespace moekit
