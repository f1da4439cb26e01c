// MXFP4 rows on the host: the OCP quantisation rule and exact dequantisation (see include/moekit/mxfp4.h).
#include "moekit/mxfp4.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

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

void mxfp4_scales_for_gemm(const Mxfp4WeightLayout& l, const uint8_t* codes, const uint8_t* scales, uint32_t* out) {
  MOEKIT_CHECK(l.num_experts > 0 && l.n > 0 && l.n % kQuantBlock == 0 && l.k > 0 && l.k % kQuantBlock == 0,
               fmt::format("mxfp4_scales_for_gemm: E = {}, N = {}, K = {}; expected E >= 1 and N, K positive "
                           "multiples of {}", l.num_experts, l.n, l.k, kQuantBlock));
  const int groups = int(l.row_scales()), k_blocks = l.k / kQuantBlock, per_block = kQuantBlock / kMxfp4Group;
  std::vector<char> nonzero(groups);
  for (int e = 0; e < l.num_experts; ++e)
    for (int n = 0; n < l.n; ++n) {
      const uint8_t* s = scales + l.scale_offset(e, n);
      const uint8_t* c = codes + l.w_offset(e, n);
      // The row's base: its largest scale over the groups that hold a non-zero value. An all-zero
      // group (the loader's padding, or a checkpoint's) is zero at any scale, so it must not pull
      // the base up and push the row's real groups into e4m3's rounded range.
      int smax = -1;
      for (int g = 0; g < groups; ++g) {
        MOEKIT_CHECK(s[g] <= kMxfp4MaxScale,
                     fmt::format("mxfp4_scales_for_gemm: expert {} row {} scale {} is the e8m0 byte {}, expected at "
                                 "most {}", e, n, g, s[g], kMxfp4MaxScale));
        bool any = false;
        for (int b = 0; b < kMxfp4Group / 2; ++b) any = any || (c[g * kMxfp4Group / 2 + b] & 0x77) != 0;
        nonzero[g] = any;
        if (any) smax = std::max(smax, int(s[g]));
      }
      if (smax < 0) smax = kMxfp4UnitScale;  // an all-zero row: any base gives zeros
      for (int kb = 0; kb < k_blocks; ++kb) {
        uint32_t word = uint32_t(smax);
        bool fast = true;
        for (int g = 0; g < per_block; ++g) {
          const int gg = kb * per_block + g;
          const int shift = nonzero[gg] ? std::max(int(s[gg]) - smax + 6, -kGemmShiftBias) : 0;
          fast = fast && shift >= -5;
          word |= uint32_t(shift + kGemmShiftBias) << (kGemmShiftFirstBit + kGemmShiftBits * g);
        }
        const size_t run = mxfp4_gemm_run(e, n / kQuantBlock, kb, l.n / kQuantBlock, k_blocks);
        out[run * kQuantBlock + n % kQuantBlock] = word | (fast ? 1u << kGemmScaleFastBit : 0u);
      }
    }
}

void mxfp4_permute_k(const uint8_t* in, int64_t rows, int k, uint8_t* out) {
  MOEKIT_CHECK(rows >= 0 && k > 0 && k % kQuantBlock == 0,
               fmt::format("mxfp4_permute_k: rows = {}, k = {}; expected rows >= 0 and k a positive multiple of {}",
                           rows, k, kQuantBlock));
  for (int64_t r = 0; r < rows; ++r)
    for (int p = 0; p < k; ++p) out[r * k + p] = in[r * k + mxfp4_k_source(p)];
}

void mxfp4_codes_for_gemm(const Mxfp4WeightLayout& l, const uint8_t* codes, uint8_t* out) {
  MOEKIT_CHECK(l.num_experts > 0 && l.n > 0 && l.n % kQuantBlock == 0 && l.k > 0 && l.k % kQuantBlock == 0,
               fmt::format("mxfp4_codes_for_gemm: E = {}, N = {}, K = {}; expected E >= 1 and N, K positive "
                           "multiples of {}", l.num_experts, l.n, l.k, kQuantBlock));
  const size_t runs = l.w_bytes() / 64;  // 128 values each
  const int k_blocks = l.k / kQuantBlock, n_blocks = l.n / kQuantBlock;
  for (size_t r = 0; r < runs; ++r) {
    const uint8_t* in = codes + r * 64;
    const int row = int(r / k_blocks), kb = int(r % k_blocks);  // row = e · N + n
    const int e = row / l.n, n = row % l.n;
    const size_t run = mxfp4_gemm_run(e, n / kQuantBlock, kb, n_blocks, k_blocks);
    uint8_t* run_out = out + (run * kQuantBlock + n % kQuantBlock) * 64;
    auto code = [&](int k) { return (in[k / 2] >> (4 * (k % 2))) & 0xF; };
    for (int q = 0; q < 4; ++q)
      for (int s = 0; s < 4; ++s) {
        uint32_t word = 0;
        for (int i = 0; i < 8; ++i) {
          const int c = code(mxfp4_k_source(s * 32 + (i < 4 ? 4 * q + i : 16 + 4 * q + i - 4)));
          word |= uint32_t(c & 7) << (4 * i);
          if (c & 8) word |= 1u << (i < 4 ? 8 * i + 7 : 8 * (i - 4) + 3);
        }
        uint8_t* o = run_out + (q * 4 + s) * 4;
        for (int b = 0; b < 4; ++b) o[b] = uint8_t(word >> (8 * b));
      }
  }
}

}  // namespace moekit
