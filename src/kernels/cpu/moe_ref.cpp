// The dense float64 oracle of one MoE layer (see include/moekit/reference.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/fp8.h"
#include "moekit/layout.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"
#include "moekit/reference.h"

namespace moekit::ref {

void dequantize_weights_f64(const uint8_t* w, const float* scales, int rows, int cols, double* out) {
  MOEKIT_CHECK(rows > 0 && rows % kQuantBlock == 0 && cols > 0 && cols % kQuantBlock == 0,
               fmt::format("dequantize_weights_f64: shape [{}, {}], expected positive multiples of 128", rows, cols));
  const int col_blocks = cols / kQuantBlock;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      size_t i = size_t(r) * cols + c;
      out[i] = double(fp8_e4m3_to_float(w[i])) * double(scales[size_t(r / kQuantBlock) * col_blocks + c / kQuantBlock]);
    }
}

namespace {

// x [cols] fp32 -> its FP8 quantisation (1x128 or per token), dequantised exactly into float64.
void quantize_dequantize_f64(const float* x, int cols, std::vector<uint8_t>& q, std::vector<float>& scales,
                             std::vector<double>& out, Fp8Scaling scaling = Fp8Scaling::kPerBlock) {
  q.resize(cols);
  scales.resize(cols / kQuantBlock);
  out.resize(cols);
  quantize_row_fp8(x, cols, q.data(), scales.data(), 1, scaling);
  for (int i = 0; i < cols; ++i) out[i] = double(fp8_e4m3_to_float(q[i])) * double(scales[i / kQuantBlock]);
}

// One expert on one token (contract in reference.h), accumulating weight · expert(x) into out
// [hidden]. w1 [2·inter, hidden], w2 [hidden, inter] in float64; b1 [2·inter],
// b2 [hidden] or nullptr; xq the token's dequantised q1(x).
void expert_f64(const std::vector<double>& xq, int hidden, int inter, const double* w1, const double* w2,
                const float* b1, const float* b2, const Activation& act, double weight, double* out,
                Fp8Scaling scaling = Fp8Scaling::kPerBlock) {
  std::vector<float> h(2 * inter), v(inter);
  for (int r = 0; r < 2 * inter; ++r) {
    const double* w_row = w1 + size_t(r) * hidden;
    double sum = b1 ? double(b1[r]) : 0.0;
    for (int i = 0; i < hidden; ++i) sum += w_row[i] * xq[i];
    h[r] = bf16_to_float(float_to_bf16(float(sum)));
  }
  for (int j = 0; j < inter; ++j) v[j] = activate(act, h[j], h[inter + j]);
  std::vector<uint8_t> q;
  std::vector<float> scales;
  std::vector<double> vq;
  quantize_dequantize_f64(v.data(), inter, q, scales, vq, scaling);
  for (int c = 0; c < hidden; ++c) {
    const double* w_row = w2 + size_t(c) * inter;
    double sum = 0.0;
    for (int j = 0; j < inter; ++j) sum += w_row[j] * vq[j];
    if (b2) sum += double(b2[c]);
    out[c] += weight * sum;
  }
}

void check_oracle_input(const char* who, int num_tokens, const int32_t* topk_idx, int k, int hidden, int inter,
                        int num_experts) {
  MOEKIT_CHECK(hidden > 0 && hidden % kQuantBlock == 0 && inter > 0 && inter % kQuantBlock == 0,
               fmt::format("{}: hidden = {}, inter = {}, expected positive multiples of 128", who, hidden, inter));
  MOEKIT_CHECK(num_tokens >= 0 && k >= 1 && num_experts >= 1,
               fmt::format("{}: num_tokens = {}, k = {}, E = {}: expected T >= 0, k >= 1, E >= 1", who, num_tokens, k,
                           num_experts));
  for (int t = 0; t < num_tokens; ++t)
    for (int j = 0; j < k; ++j) {
      int32_t e = topk_idx[size_t(t) * k + j];
      MOEKIT_CHECK(e >= 0 && e < num_experts,
                   fmt::format("{}: topk_idx[{}, {}] = {}, expected an expert in [0, {})", who, t, j, e, num_experts));
    }
}

// One MXFP4 weight matrix of expert e, decoded exactly into float64 [rows, cols].
void decode_mxfp4_f64(const uint8_t* w, const uint8_t* scales, const Mxfp4WeightLayout& layout, int e,
                      std::vector<double>& out) {
  std::vector<float> row(layout.k);
  out.resize(size_t(layout.n) * layout.k);
  for (int r = 0; r < layout.n; ++r) {
    dequantize_row_mxfp4(w + layout.w_offset(e, r), scales + layout.scale_offset(e, r), layout.k, row.data());
    std::copy(row.begin(), row.end(), out.begin() + size_t(r) * layout.k);
  }
}

}  // namespace

void moe_layer_f64(const float* x, int num_tokens, const int32_t* topk_idx, const float* topk_weights, int k,
                   const MoeWeightsF64& weights, double* out) {
  const int hidden = weights.hidden, inter = weights.inter;
  check_oracle_input("moe_layer_f64", num_tokens, topk_idx, k, hidden, inter, weights.num_experts);
  MOEKIT_CHECK(weights.shared_inter >= 0 && weights.shared_inter % kQuantBlock == 0,
               fmt::format("moe_layer_f64: shared_inter = {}, expected 0 or a multiple of 128", weights.shared_inter));

  std::vector<uint8_t> q;
  std::vector<float> scales;
  std::vector<double> xq;
  for (int t = 0; t < num_tokens; ++t) {
    double* out_t = out + size_t(t) * hidden;
    std::fill(out_t, out_t + hidden, 0.0);
    quantize_dequantize_f64(x + size_t(t) * hidden, hidden, q, scales, xq);
    for (int j = 0; j < k; ++j) {
      const int e = topk_idx[size_t(t) * k + j];
      expert_f64(xq, hidden, inter, weights.w1 + size_t(e) * 2 * inter * hidden, weights.w2 + size_t(e) * hidden * inter,
                 nullptr, nullptr, weights.activation, double(topk_weights[size_t(t) * k + j]), out_t);
    }
    if (weights.shared_inter > 0)
      expert_f64(xq, hidden, weights.shared_inter, weights.shared_w1, weights.shared_w2, nullptr, nullptr,
                 weights.activation, 1.0, out_t);
  }
}

void moe_layer_mxfp4_f64(const float* x, int num_tokens, const int32_t* topk_idx, const float* topk_weights, int k,
                         const MoeWeightsMxfp4& weights, double* out, Fp8Scaling scaling) {
  const int hidden = weights.hidden, inter = weights.inter, num_experts = weights.num_experts;
  check_oracle_input("moe_layer_mxfp4_f64", num_tokens, topk_idx, k, hidden, inter, num_experts);
  const Mxfp4WeightLayout l1{num_experts, 2 * inter, hidden}, l2{num_experts, hidden, inter};
  for (size_t i = 0; i < l1.scale_elems(); ++i)
    MOEKIT_CHECK(weights.w1_scales[i] <= kMxfp4MaxScale,
                 fmt::format("moe_layer_mxfp4_f64: w1 scale {} is the e8m0 byte {}, expected at most {}", i,
                             weights.w1_scales[i], kMxfp4MaxScale));
  for (size_t i = 0; i < l2.scale_elems(); ++i)
    MOEKIT_CHECK(weights.w2_scales[i] <= kMxfp4MaxScale,
                 fmt::format("moe_layer_mxfp4_f64: w2 scale {} is the e8m0 byte {}, expected at most {}", i,
                             weights.w2_scales[i], kMxfp4MaxScale));

  // Expert by expert, so that each expert is decoded once: y[t, j] = expert_{topk_idx[t, j]}(x[t]),
  // then out[t] = sum_j topk_weights[t, j] · y[t, j] in j order, as moe_layer_f64 sums.
  std::vector<std::vector<double>> xq(num_tokens);
  std::vector<uint8_t> q;
  std::vector<float> scales;
  for (int t = 0; t < num_tokens; ++t) quantize_dequantize_f64(x + size_t(t) * hidden, hidden, q, scales, xq[t], scaling);
  std::vector<double> y(size_t(num_tokens) * k * hidden, 0.0), w1, w2;
  for (int e = 0; e < num_experts; ++e) {
    bool used = false;
    for (size_t i = 0; i < size_t(num_tokens) * k && !used; ++i) used = topk_idx[i] == e;
    if (!used) continue;
    decode_mxfp4_f64(weights.w1, weights.w1_scales, l1, e, w1);
    decode_mxfp4_f64(weights.w2, weights.w2_scales, l2, e, w2);
    for (size_t i = 0; i < size_t(num_tokens) * k; ++i)
      if (topk_idx[i] == e)
        expert_f64(xq[i / k], hidden, inter, w1.data(), w2.data(), weights.b1 ? weights.b1 + size_t(e) * 2 * inter : nullptr,
                   weights.b2 ? weights.b2 + size_t(e) * hidden : nullptr, weights.activation, 1.0,
                   y.data() + i * hidden, scaling);
  }
  for (int t = 0; t < num_tokens; ++t) {
    double* out_t = out + size_t(t) * hidden;
    std::fill(out_t, out_t + hidden, 0.0);
    for (int j = 0; j < k; ++j) {
      const double w = double(topk_weights[size_t(t) * k + j]);
      const double* y_tj = y.data() + (size_t(t) * k + j) * hidden;
      for (int c = 0; c < hidden; ++c) out_t[c] += w * y_tj[c];
    }
  }
}

double relative_frobenius_error(const double* got, const double* want, size_t n) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  MOEKIT_CHECK(norm > 0.0, fmt::format("relative_frobenius_error: the reference ({} values) is all zero", n));
  return std::sqrt(diff / norm);
}

}  // namespace moekit::ref
