// FP8 grouped GEMMs with two-level accumulation, SiLU(gate)·up + quantisation, and the shared
// expert: the CPU reference (see include/moekit/reference.h for the exact operation order).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/fp8.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"
#include "moekit/reference.h"

namespace moekit::ref {

namespace {

// One row of A as the GEMM sees it: its fp8 values, its K/128 scales (scale kb at
// scales[kb * scale_stride]) and where its N outputs go.
struct RowRef {
  const uint8_t* a;
  const float* scales;
  int64_t scale_stride;
  uint16_t* out;
};

// The fp8 e4m3 values as floats, looked up instead of decoded in the inner loops.
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int c = 0; c < 256; ++c) t[c] = fp8_e4m3_to_float(uint8_t(c));
    return t;
  }();
  return table.data();
}

// The tensor core's 128-deep partial: the exact sum of 128 products, rounded once to fp32.
// FP8 weights: each product of two e4m3 values has at most 8 significant bits and every partial
// sum is a multiple of 2^-18 below 2^25, so float64 holds all of them exactly, in any order. MXFP4
// weights (e2m1 times a power of two): exact under the condition reference.h states. The lanes
// just give the CPU independent additions (and let the compiler vectorise).
float block_partial(const float* a, const float* w) {
  constexpr int kLanes = 8;
  double lane[kLanes] = {};
  for (int i = 0; i < kQuantBlock; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += double(a[i + l]) * double(w[i + l]);
  double sum = 0.0;
  for (int l = 0; l < kLanes; ++l) sum += lane[l];
  return float(sum);
}

// One expert's FP8 weight rows as gemm_rows reads them: the K values of a row as floats (exact)
// and the factor of each K block that multiplies the activations' scale.
struct Fp8Rows {
  const uint8_t* w;         // [n, k]
  const float* w_scales;    // [n/128, k/128]
  int k;
  void decode(int row, float* values, float* block_scales) const {
    const float* lut = fp8_table();
    const uint8_t* w_row = w + size_t(row) * k;
    for (int i = 0; i < k; ++i) values[i] = lut[w_row[i]];
    const int k_blocks = k / kQuantBlock;
    std::copy_n(w_scales + size_t(row / kQuantBlock) * k_blocks, k_blocks, block_scales);
  }
};

// MXFP4 rows: the values carry their scales (exact in fp32, mxfp4.h), so each block's factor is 1.
struct Mxfp4Rows {
  const uint8_t* w;         // [n, k/2]
  const uint8_t* w_scales;  // [n, k/32]
  int k;
  void decode(int row, float* values, float* block_scales) const {
    dequantize_row_mxfp4(w + size_t(row) * (k / 2), w_scales + size_t(row) * (k / kMxfp4Group), k, values);
    std::fill_n(block_scales, k / kQuantBlock, 1.0f);
  }
};

// out[row, n] for all rows of one expert, whose weight rows `weights` decodes; bias [n] or nullptr.
// Rows go in chunks whose widened values stay in cache while every weight row (widened once per
// chunk) passes over them.
template <class Rows>
void gemm_rows(const std::vector<RowRef>& rows, const Rows& weights, const float* bias, int n, int k) {
  constexpr int kChunk = 32;
  const float* lut = fp8_table();
  const int k_blocks = k / kQuantBlock;
  std::vector<float> a_vals(size_t(kChunk) * k), a_scales(size_t(kChunk) * k_blocks), w_vals(k), w_block_scales(k_blocks);
  for (size_t r0 = 0; r0 < rows.size(); r0 += kChunk) {
    const int chunk = int(std::min<size_t>(kChunk, rows.size() - r0));
    for (int r = 0; r < chunk; ++r) {
      const RowRef& row = rows[r0 + r];
      for (int i = 0; i < k; ++i) a_vals[size_t(r) * k + i] = lut[row.a[i]];
      for (int kb = 0; kb < k_blocks; ++kb) a_scales[size_t(r) * k_blocks + kb] = row.scales[kb * row.scale_stride];
    }
    for (int col = 0; col < n; ++col) {
      weights.decode(col, w_vals.data(), w_block_scales.data());
      for (int r = 0; r < chunk; ++r) {
        const float* a_row = a_vals.data() + size_t(r) * k;
        float acc = 0.0f;
        for (int kb = 0; kb < k_blocks; ++kb) {
          float partial = block_partial(a_row + kb * kQuantBlock, w_vals.data() + kb * kQuantBlock);
          float scale = a_scales[size_t(r) * k_blocks + kb] * w_block_scales[kb];
          acc = std::fma(scale, partial, acc);
        }
        rows[r0 + r].out[col] = float_to_bf16(bias ? acc + bias[col] : acc);
      }
    }
  }
}

void check_weights(const char* who, int num_experts, int k, const WeightLayout& w_layout) {
  MOEKIT_CHECK(k > 0 && k % kQuantBlock == 0, fmt::format("{}: K = {}, expected a positive multiple of 128", who, k));
  MOEKIT_CHECK(w_layout.n > 0 && w_layout.n % kQuantBlock == 0,
               fmt::format("{}: N = {}, expected a positive multiple of 128", who, w_layout.n));
  MOEKIT_CHECK(w_layout.k == k, fmt::format("{}: weights have K = {}, activations K = {}", who, w_layout.k, k));
  MOEKIT_CHECK(w_layout.num_experts == num_experts,
               fmt::format("{}: weights hold {} experts, activations {}", who, w_layout.num_experts, num_experts));
}

void check_weights_mxfp4(const char* who, int num_experts, int k, const Mxfp4WeightLayout& w_layout,
                         const uint8_t* w_scales) {
  check_weights(who, num_experts, k, WeightLayout{w_layout.num_experts, w_layout.n, w_layout.k});
  for (size_t i = 0; i < w_layout.scale_elems(); ++i)
    MOEKIT_CHECK(w_scales[i] <= kMxfp4MaxScale,
                 fmt::format("{}: weight scale [{}, {}, {}] is the e8m0 byte {}, expected at most {}", who,
                             i / w_layout.row_scales() / w_layout.n, i / w_layout.row_scales() % w_layout.n,
                             i % w_layout.row_scales(), w_scales[i], kMxfp4MaxScale));
}

void check_masked_m(const char* who, const MaskedLayout& layout, const int32_t* masked_m) {
  MOEKIT_CHECK(layout.num_experts > 0 && layout.max_m >= 0,
               fmt::format("{}: E_loc = {}, M_max = {}: expected E_loc > 0, M_max >= 0", who, layout.num_experts,
                           layout.max_m));
  for (int e = 0; e < layout.num_experts; ++e)
    MOEKIT_CHECK(masked_m[e] >= 0 && masked_m[e] <= layout.max_m,
                 fmt::format("{}: masked_m[{}] = {}, expected 0 <= masked_m <= M_max = {}", who, e, masked_m[e],
                             layout.max_m));
}

void check_row_expert(const char* who, const int32_t* row_expert, int total_m, int num_experts) {
  MOEKIT_CHECK(total_m >= 0, fmt::format("{}: M_total = {}, expected >= 0", who, total_m));
  for (int m = 0; m < total_m; ++m)
    MOEKIT_CHECK(row_expert[m] >= -1 && row_expert[m] < num_experts,
                 fmt::format("{}: row_expert[{}] = {}, expected -1 (padding) or a local expert in [0, {})", who, m,
                             row_expert[m], num_experts));
}

void activation_quant_row(const Activation& act, const uint16_t* gate_up, int inter, float* v, uint8_t* q,
                          float* scales, int64_t scale_stride, Fp8Scaling scaling = Fp8Scaling::kPerBlock) {
  for (int j = 0; j < inter; ++j) v[j] = activate(act, bf16_to_float(gate_up[j]), bf16_to_float(gate_up[inter + j]));
  quantize_row_fp8(v, inter, q, scales, scale_stride, scaling);
}

void check_inter(const char* who, int inter) {
  MOEKIT_CHECK(inter > 0 && inter % kQuantBlock == 0,
               fmt::format("{}: inter = {}, expected a positive multiple of 128", who, inter));
}

}  // namespace

namespace {

// The masked GEMM over every expert; weights_of(e) gives expert e's rows (Fp8Rows or Mxfp4Rows).
template <class WeightsOf>
void masked_gemm(const MaskedLayout& a_layout, const uint8_t* a, const float* a_scales, const int32_t* masked_m, int n,
                 const WeightsOf& weights_of, const float* bias, uint16_t* out) {
  std::vector<RowRef> rows;
  for (int e = 0; e < a_layout.num_experts; ++e) {
    rows.clear();
    for (int m = 0; m < masked_m[e]; ++m)
      rows.push_back({a + a_layout.a_offset(e, m), a_scales + a_layout.scale_offset(e, m, 0), a_layout.max_m,
                      out + a_layout.out_offset(e, m, n)});
    gemm_rows(rows, weights_of(e), bias ? bias + size_t(e) * n : nullptr, n, a_layout.k);
  }
}

// The contiguous GEMM: each row goes to the expert row_expert names (padding rows, -1, nowhere).
template <class WeightsOf>
void contiguous_gemm(const ContiguousLayout& a_layout, const uint8_t* a, const float* a_scales,
                     const int32_t* row_expert, int num_experts, int n, const WeightsOf& weights_of, const float* bias,
                     uint16_t* out) {
  std::vector<std::vector<RowRef>> rows(num_experts);
  for (int m = 0; m < a_layout.total_m; ++m)
    if (row_expert[m] >= 0)
      rows[row_expert[m]].push_back({a + a_layout.a_offset(m), a_scales + a_layout.scale_offset(m, 0),
                                     a_layout.total_m, out + size_t(m) * n});
  for (int e = 0; e < num_experts; ++e) gemm_rows(rows[e], weights_of(e), bias ? bias + size_t(e) * n : nullptr, n, a_layout.k);
}

}  // namespace

void grouped_gemm_masked(const MaskedLayout& a_layout, const uint8_t* a, const float* a_scales,
                         const int32_t* masked_m, const WeightLayout& w_layout, const uint8_t* w,
                         const float* w_scales, uint16_t* out) {
  const char* who = "grouped_gemm_masked";
  check_weights(who, a_layout.num_experts, a_layout.k, w_layout);
  check_masked_m(who, a_layout, masked_m);
  masked_gemm(a_layout, a, a_scales, masked_m, w_layout.n, [&](int e) {
    return Fp8Rows{w + w_layout.w_offset(e, 0), w_scales + w_layout.scale_offset(e, 0, 0), a_layout.k};
  }, nullptr, out);
}

void grouped_gemm_contiguous(const ContiguousLayout& a_layout, const uint8_t* a, const float* a_scales,
                             const int32_t* row_expert, const WeightLayout& w_layout, const uint8_t* w,
                             const float* w_scales, uint16_t* out) {
  const char* who = "grouped_gemm_contiguous";
  check_weights(who, w_layout.num_experts, a_layout.k, w_layout);
  check_row_expert(who, row_expert, a_layout.total_m, w_layout.num_experts);
  contiguous_gemm(a_layout, a, a_scales, row_expert, w_layout.num_experts, w_layout.n, [&](int e) {
    return Fp8Rows{w + w_layout.w_offset(e, 0), w_scales + w_layout.scale_offset(e, 0, 0), a_layout.k};
  }, nullptr, out);
}

void grouped_gemm_masked_mxfp4(const MaskedLayout& a_layout, const uint8_t* a, const float* a_scales,
                               const int32_t* masked_m, const Mxfp4WeightLayout& w_layout, const uint8_t* w,
                               const uint8_t* w_scales, const float* bias, uint16_t* out) {
  const char* who = "grouped_gemm_masked_mxfp4";
  check_weights_mxfp4(who, a_layout.num_experts, a_layout.k, w_layout, w_scales);
  check_masked_m(who, a_layout, masked_m);
  masked_gemm(a_layout, a, a_scales, masked_m, w_layout.n, [&](int e) {
    return Mxfp4Rows{w + w_layout.w_offset(e, 0), w_scales + w_layout.scale_offset(e, 0), a_layout.k};
  }, bias, out);
}

void grouped_gemm_contiguous_mxfp4(const ContiguousLayout& a_layout, const uint8_t* a, const float* a_scales,
                                   const int32_t* row_expert, const Mxfp4WeightLayout& w_layout, const uint8_t* w,
                                   const uint8_t* w_scales, const float* bias, uint16_t* out) {
  const char* who = "grouped_gemm_contiguous_mxfp4";
  check_weights_mxfp4(who, w_layout.num_experts, a_layout.k, w_layout, w_scales);
  check_row_expert(who, row_expert, a_layout.total_m, w_layout.num_experts);
  contiguous_gemm(a_layout, a, a_scales, row_expert, w_layout.num_experts, w_layout.n, [&](int e) {
    return Mxfp4Rows{w + w_layout.w_offset(e, 0), w_scales + w_layout.scale_offset(e, 0), a_layout.k};
  }, bias, out);
}

void check_contiguous_segments(const int32_t* row_expert, int total_m, int block_m, int num_experts) {
  MOEKIT_CHECK(block_m > 0 && total_m % block_m == 0,
               fmt::format("contiguous layout: M_total = {} is not a multiple of the block M = {}", total_m, block_m));
  check_row_expert("contiguous layout", row_expert, total_m, num_experts);
  for (int b = 0; b < total_m; b += block_m) {
    int expert = -1;
    for (int m = b; m < b + block_m; ++m) {
      if (row_expert[m] < 0) continue;
      MOEKIT_CHECK(expert < 0 || row_expert[m] == expert,
                   fmt::format("contiguous layout: block of rows [{}, {}) mixes experts {} and {} (row {}): each "
                               "expert's segment must be padded to a multiple of {}",
                               b, b + block_m, expert, row_expert[m], m, block_m));
      expert = row_expert[m];
    }
  }
}

void activation_quant_masked(const Activation& act, const MaskedLayout& out_layout, const uint16_t* gate_up,
                             const int32_t* masked_m, uint8_t* out, float* out_scales, Fp8Scaling scaling) {
  const char* who = "activation_quant_masked";
  check_inter(who, out_layout.k);
  check_masked_m(who, out_layout, masked_m);
  const int inter = out_layout.k;
  std::vector<float> v(inter);
  for (int e = 0; e < out_layout.num_experts; ++e)
    for (int m = 0; m < masked_m[e]; ++m)
      activation_quant_row(act, gate_up + out_layout.out_offset(e, m, 2 * inter), inter, v.data(),
                           out + out_layout.a_offset(e, m), out_scales + out_layout.scale_offset(e, m, 0),
                           out_layout.max_m, scaling);
}

void activation_quant_contiguous(const Activation& act, const ContiguousLayout& out_layout, const uint16_t* gate_up,
                                 const int32_t* row_expert, uint8_t* out, float* out_scales, Fp8Scaling scaling) {
  const char* who = "activation_quant_contiguous";
  check_inter(who, out_layout.k);
  MOEKIT_CHECK(out_layout.total_m >= 0, fmt::format("{}: M_total = {}, expected >= 0", who, out_layout.total_m));
  for (int m = 0; m < out_layout.total_m; ++m)
    MOEKIT_CHECK(row_expert[m] >= -1,
                 fmt::format("{}: row_expert[{}] = {}, expected -1 (padding) or an expert", who, m, row_expert[m]));
  const int inter = out_layout.k;
  std::vector<float> v(inter);
  for (int m = 0; m < out_layout.total_m; ++m)
    if (row_expert[m] >= 0)
      activation_quant_row(act, gate_up + size_t(m) * 2 * inter, inter, v.data(), out + out_layout.a_offset(m),
                           out_scales + out_layout.scale_offset(m, 0), out_layout.total_m, scaling);
}

void silu_mul_quant_masked(const MaskedLayout& out_layout, const uint16_t* gate_up, const int32_t* masked_m,
                           uint8_t* out, float* out_scales) {
  activation_quant_masked(Activation{}, out_layout, gate_up, masked_m, out, out_scales);
}

void silu_mul_quant_contiguous(const ContiguousLayout& out_layout, const uint16_t* gate_up,
                               const int32_t* row_expert, uint8_t* out, float* out_scales) {
  activation_quant_contiguous(Activation{}, out_layout, gate_up, row_expert, out, out_scales);
}

void shared_expert(const float* x, int num_tokens, const ExpertFp8& weights, uint16_t* out, const Activation& act) {
  const char* who = "shared_expert";
  MOEKIT_CHECK(num_tokens >= 0, fmt::format("{}: num_tokens = {}, expected >= 0", who, num_tokens));
  MOEKIT_CHECK(weights.hidden > 0 && weights.hidden % kQuantBlock == 0,
               fmt::format("{}: hidden = {}, expected a positive multiple of 128", who, weights.hidden));
  check_inter(who, weights.inter);
  if (num_tokens == 0) return;
  const int d = weights.hidden, inter = weights.inter;
  const int32_t masked_m[1] = {num_tokens};

  // The tokens are one expert's rows in the masked layout with M_max = T.
  const MaskedLayout x_layout{1, num_tokens, d};
  std::vector<uint8_t> xq(x_layout.a_elems());
  std::vector<float> xs(x_layout.scale_elems());
  for (int t = 0; t < num_tokens; ++t)
    quantize_row_fp8(x + size_t(t) * d, d, xq.data() + x_layout.a_offset(0, t), xs.data() + x_layout.scale_offset(0, t, 0),
                     num_tokens);

  std::vector<uint16_t> gate_up(x_layout.out_elems(2 * inter));
  grouped_gemm_masked(x_layout, xq.data(), xs.data(), masked_m, WeightLayout{1, 2 * inter, d}, weights.w1,
                      weights.w1_scales, gate_up.data());

  const MaskedLayout h_layout{1, num_tokens, inter};
  std::vector<uint8_t> hq(h_layout.a_elems());
  std::vector<float> hs(h_layout.scale_elems());
  activation_quant_masked(act, h_layout, gate_up.data(), masked_m, hq.data(), hs.data());

  grouped_gemm_masked(h_layout, hq.data(), hs.data(), masked_m, WeightLayout{1, d, inter}, weights.w2,
                      weights.w2_scales, out);
}

}  // namespace moekit::ref
