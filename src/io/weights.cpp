// MoE layer weights: loading from DeepSeek-style FP8 and gpt-oss MXFP4 checkpoints, and the
// tensor names and sizes (see include/moekit/weights.h). The random-weights generator is in
// weights_random.cpp.
#include "moekit/weights.h"

#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cstring>

#include "io/weights_layout.h"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"
#include "moekit/safetensors.h"

namespace moekit {

// Tensor bytes are little-endian in the file and copied as they are.
static_assert(std::endian::native == std::endian::little, "moekit's safetensors I/O assumes a little-endian host");

namespace weights_detail {

LayerDims layer_dims(const ModelSpec& spec) {
  MOEKIT_CHECK(spec.is_moe(), fmt::format("model '{}' is dense: it has no MoE weights", spec.name));
  const bool mxfp4 = spec.expert_format == "mxfp4";
  MOEKIT_CHECK(mxfp4 || spec.expert_format == "fp8",
               fmt::format("model '{}': expert_format '{}', expected fp8 or mxfp4", spec.name, spec.expert_format));
  LayerDims d{spec.hidden_size, spec.moe_intermediate_size, int64_t(spec.num_shared_experts) * spec.shared_intermediate_size,
              spec.num_routed_experts, spec.router.scoring == "sigmoid"};
  d.mxfp4 = mxfp4;
  d.expert_bias = spec.expert_bias;
  d.logit_bias = spec.router.logit_bias;
  if (mxfp4) {
    MOEKIT_CHECK(d.shared_inter == 0,
                 fmt::format("model '{}': the MXFP4 (gpt-oss) layout has no shared experts, the spec has {}", spec.name,
                             spec.num_shared_experts));
    for (auto [what, v] : {std::pair{"hidden_size", d.hidden}, {"moe_intermediate_size", d.inter}})
      MOEKIT_CHECK(v % kMxfp4Group == 0,
                   fmt::format("model '{}': {} = {} is not a multiple of {} (one e8m0 scale per {} values)", spec.name,
                               what, v, kMxfp4Group, kMxfp4Group));
  }
  return d;
}

}  // namespace weights_detail

using namespace weights_detail;

namespace {

void copy_bytes(std::span<const uint8_t> src, void* dst) { std::memcpy(dst, src.data(), src.size()); }

// Copies one fp8 matrix and its block scales into an ExpertWeights slot (rows, cols multiples of 128).
void load_matrix(const Checkpoint& ckpt, const std::string& name, int64_t rows, int64_t cols, uint8_t* w, float* scales) {
  const int64_t shape[] = {rows, cols};
  copy_bytes(ckpt.bytes(name, Dtype::kF8E4M3, shape), w);
  const std::string scale_name = scale_inv_name(name);
  const auto scale_shape = block_scale_shape(rows, cols);
  copy_bytes(ckpt.bytes(scale_name, Dtype::kF32, scale_shape), scales);
  const int64_t n = scale_shape[0] * scale_shape[1];
  for (int64_t i = 0; i < n; ++i)
    MOEKIT_CHECK(std::isfinite(scales[i]) && scales[i] > 0.0f,
                 fmt::format("tensor '{}' in '{}': block [{}, {}] holds {}, expected a finite positive scale", scale_name,
                             ckpt.file_of(scale_name).path(), i / scale_shape[1], i % scale_shape[1], scales[i]));
}

ExpertWeights make_expert_weights(int num_experts, int64_t n, int64_t k) {
  ExpertWeights out;
  out.layout = {num_experts, int(n), int(k)};
  out.w.resize(out.layout.w_elems());
  out.scales.resize(out.layout.scale_elems());
  return out;
}

// Loads an MLP's gate/up into w1 slot `i` (fused, gate first) and its down into w2 slot `i`.
void load_mlp(const Checkpoint& ckpt, const std::vector<std::string>& names, int64_t hidden, int64_t inter, int i,
              ExpertWeights& w1, ExpertWeights& w2) {
  load_matrix(ckpt, names[0], inter, hidden, &w1.w[w1.layout.w_offset(i, 0)], &w1.scales[w1.layout.scale_offset(i, 0, 0)]);
  load_matrix(ckpt, names[1], inter, hidden, &w1.w[w1.layout.w_offset(i, int(inter))],
              &w1.scales[w1.layout.scale_offset(i, int(inter), 0)]);
  load_matrix(ckpt, names[2], hidden, inter, &w2.w[w2.layout.w_offset(i, 0)], &w2.scales[w2.layout.scale_offset(i, 0, 0)]);
}

// A BF16 or F32 tensor of the given shape, widened to fp32 (exact).
std::vector<float> read_float_tensor(const Checkpoint& ckpt, const std::string& name, std::span<const int64_t> shape) {
  const TensorInfo& info = ckpt.info(name);
  MOEKIT_CHECK(info.dtype == Dtype::kBF16 || info.dtype == Dtype::kF32,
               fmt::format("tensor '{}' in '{}': expected dtype BF16 or F32 shape {}, got {} {}", name,
                           ckpt.file_of(name).path(), shape_string(shape), dtype_name(info.dtype),
                           shape_string(info.shape)));
  auto bytes = ckpt.bytes(name, info.dtype, shape);
  std::vector<float> out(bytes.size() / dtype_size(info.dtype));
  if (info.dtype == Dtype::kF32) {
    copy_bytes(bytes, out.data());
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = bf16_to_float(h);
    }
  }
  return out;
}

// bias: rows [first_row, ...) of a [*, cols] tensor, or a vector when cols == 0.
void check_finite_bias(const Checkpoint& ckpt, const std::string& name, const std::vector<float>& bias, int64_t cols,
                       int64_t first_row = 0) {
  for (size_t i = 0; i < bias.size(); ++i)
    MOEKIT_CHECK(std::isfinite(bias[i]),
                 fmt::format("tensor '{}' in '{}': element {} holds {}, expected a finite bias", name,
                             ckpt.file_of(name).path(),
                             cols > 0 ? fmt::format("[{}, {}]", first_row + int64_t(i) / cols, int64_t(i) % cols)
                                      : fmt::format("[{}]", i),
                             bias[i]));
}

Mxfp4ExpertWeights make_mxfp4_weights(int num_experts, int64_t n, int64_t k, bool with_bias) {
  Mxfp4ExpertWeights out;
  out.layout = {num_experts, int(n), int(k)};
  out.w.assign(out.layout.w_bytes(), 0);  // zero codes: the padding
  out.scales.assign(out.layout.scale_elems(), kMxfp4UnitScale);
  if (with_bias) out.bias.assign(size_t(num_experts) * n, 0.0f);
  return out;
}

// Copies file matrix `proj` ([E, rows, cols] in blocks, scales and bias) of the experts
// [first_expert, first_expert + E_loc) into `dst`, file row r going to dst row row_of(r) and its
// cols/2 bytes to the start of that row (the rest is padding).
template <class RowOf>
void load_mxfp4_matrix(const Checkpoint& ckpt, int layer, std::string_view proj, int num_experts, int64_t rows,
                       int64_t cols, int first_expert, const RowOf& row_of, Mxfp4ExpertWeights& dst) {
  const int64_t groups = cols / kMxfp4Group;
  const std::string blocks_name = gpt_oss_expert_tensor_name(layer, proj, "blocks"),
                    scales_name = gpt_oss_expert_tensor_name(layer, proj, "scales");
  const int64_t blocks_shape[] = {num_experts, rows, groups, kMxfp4Group / 2}, scales_shape[] = {num_experts, rows, groups};
  auto blocks = ckpt.bytes(blocks_name, Dtype::kU8, blocks_shape);
  auto scales = ckpt.bytes(scales_name, Dtype::kU8, scales_shape);
  const Mxfp4WeightLayout& l = dst.layout;
  for (int i = 0; i < l.num_experts; ++i) {
    const int64_t e = first_expert + i;
    for (int64_t r = 0; r < rows; ++r) {
      const size_t src = size_t(e * rows + r);
      for (int64_t g = 0; g < groups; ++g)
        MOEKIT_CHECK(scales[src * groups + g] <= kMxfp4MaxScale,
                     fmt::format("tensor '{}' in '{}': expert {} row {} block {} holds the e8m0 byte {}, expected a "
                                 "scale of at most {} (2^125; 255 is NaN)",
                                 scales_name, ckpt.file_of(scales_name).path(), e, r, g, scales[src * groups + g],
                                 kMxfp4MaxScale));
      const int row = int(row_of(r));
      std::memcpy(&dst.w[l.w_offset(i, row)], blocks.data() + src * (cols / 2), size_t(cols / 2));
      std::memcpy(&dst.scales[l.scale_offset(i, row)], scales.data() + src * groups, size_t(groups));
    }
  }
  if (dst.bias.empty()) return;
  const std::string bias_name = gpt_oss_expert_tensor_name(layer, proj, "bias");
  const int64_t bias_shape[] = {num_experts, rows};
  const std::vector<float> bias = read_float_tensor(ckpt, bias_name, bias_shape);
  // Only the local experts' part is checked, as for the scales.
  const auto local = std::vector<float>(bias.begin() + ptrdiff_t(first_expert * rows),
                                        bias.begin() + ptrdiff_t((first_expert + l.num_experts) * rows));
  check_finite_bias(ckpt, bias_name, local, rows, first_expert);
  for (int i = 0; i < l.num_experts; ++i)
    for (int64_t r = 0; r < rows; ++r) dst.bias[size_t(i) * l.n + row_of(r)] = local[size_t(i * rows + r)];
}

void load_moe_layer_mxfp4(const Checkpoint& ckpt, const LayerDims& d, int layer, int first_expert,
                          int num_local_experts, MoeLayerWeights& out) {
  const int64_t hidden_p = out.padded_hidden, inter_p = out.padded_intermediate;
  out.w1_mxfp4 = make_mxfp4_weights(num_local_experts, 2 * inter_p, hidden_p, d.expert_bias);
  out.w2_mxfp4 = make_mxfp4_weights(num_local_experts, hidden_p, inter_p, d.expert_bias);
  // gate_up's even rows are gate rows, its odd rows up rows (weights.h).
  load_mxfp4_matrix(ckpt, layer, "gate_up_proj", d.num_experts, 2 * d.inter, d.hidden, first_expert,
                    [&](int64_t r) { return r % 2 == 0 ? r / 2 : inter_p + r / 2; }, out.w1_mxfp4);
  load_mxfp4_matrix(ckpt, layer, "down_proj", d.num_experts, d.hidden, d.inter, first_expert,
                    [](int64_t r) { return r; }, out.w2_mxfp4);
  const int64_t router_shape[] = {d.num_experts, d.hidden}, bias_shape[] = {d.num_experts};
  out.router_weight = read_float_tensor(ckpt, gpt_oss_router_weight_name(layer), router_shape);
  if (d.logit_bias) {
    out.router_logit_bias = read_float_tensor(ckpt, gpt_oss_router_bias_name(layer), bias_shape);
    check_finite_bias(ckpt, gpt_oss_router_bias_name(layer), out.router_logit_bias, 0);
  }
}

}  // namespace

std::string gpt_oss_expert_tensor_name(int layer, std::string_view proj, std::string_view part) {
  return fmt::format("model.layers.{}.mlp.experts.{}_{}", layer, proj, part);
}
std::string gpt_oss_router_weight_name(int layer) { return fmt::format("model.layers.{}.mlp.router.weight", layer); }
std::string gpt_oss_router_bias_name(int layer) { return fmt::format("model.layers.{}.mlp.router.bias", layer); }

std::string expert_weight_name(int layer, int expert, std::string_view proj) {
  return fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", layer, expert, proj);
}
std::string shared_expert_weight_name(int layer, std::string_view proj) {
  return fmt::format("model.layers.{}.mlp.shared_experts.{}.weight", layer, proj);
}
std::string router_weight_name(int layer) { return fmt::format("model.layers.{}.mlp.gate.weight", layer); }
std::string router_bias_name(int layer) { return fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", layer); }
std::string scale_inv_name(std::string_view weight_name) { return fmt::format("{}_scale_inv", weight_name); }
std::vector<int64_t> block_scale_shape(int64_t rows, int64_t cols) { return {ceil_blocks(rows), ceil_blocks(cols)}; }

ExpertWeightSizes loaded_expert_sizes(const ModelSpec& spec) {
  if (spec.expert_format != "mxfp4") return {spec.hidden_size, spec.moe_intermediate_size};
  return {ceil_blocks(spec.hidden_size) * kQuantBlock, ceil_blocks(spec.moe_intermediate_size) * kQuantBlock};
}

MoeLayerWeights load_moe_layer(const Checkpoint& ckpt, const ModelSpec& spec, int layer, int first_expert,
                               int num_local_experts) {
  const LayerDims d = layer_dims(spec);
  MOEKIT_CHECK(layer >= 0, fmt::format("load_moe_layer: layer = {} must be >= 0", layer));
  MOEKIT_CHECK(first_expert >= 0 && num_local_experts > 0 && first_expert + num_local_experts <= d.num_experts,
               fmt::format("load_moe_layer: experts [{}, {}) must be a non-empty range inside [0, {}) of model '{}'",
                           first_expert, first_expert + num_local_experts, d.num_experts, spec.name));
  MoeLayerWeights out;
  out.layer = layer;
  out.first_expert = first_expert;
  out.num_experts = d.num_experts;
  out.hidden_size = d.hidden;
  out.intermediate_size = d.inter;
  const ExpertWeightSizes padded = loaded_expert_sizes(spec);
  out.padded_hidden = padded.hidden;
  out.padded_intermediate = padded.intermediate;
  if (d.mxfp4) {
    load_moe_layer_mxfp4(ckpt, d, layer, first_expert, num_local_experts, out);
    return out;
  }
  for (auto [what, v] : {std::pair{"hidden_size", d.hidden}, {"moe_intermediate_size", d.inter},
                         {"shared intermediate size", d.shared_inter}})
    MOEKIT_CHECK(v % kQuantBlock == 0,
                 fmt::format("load_moe_layer: model '{}' {} = {} is not a multiple of {}: the grouped GEMM's weight "
                             "layout needs whole 128x128 blocks",
                             spec.name, what, v, kQuantBlock));

  out.w1 = make_expert_weights(num_local_experts, 2 * d.inter, d.hidden);
  out.w2 = make_expert_weights(num_local_experts, d.hidden, d.inter);
  for (int i = 0; i < num_local_experts; ++i) {
    std::vector<std::string> names;
    for (auto proj : kProjs) names.push_back(expert_weight_name(layer, first_expert + i, proj));
    load_mlp(ckpt, names, d.hidden, d.inter, i, out.w1, out.w2);
  }

  const int64_t router_shape[] = {d.num_experts, d.hidden};
  out.router_weight = read_float_tensor(ckpt, router_weight_name(layer), router_shape);
  if (d.has_bias) {
    const int64_t bias_shape[] = {d.num_experts};
    out.router_bias.resize(size_t(d.num_experts));
    copy_bytes(ckpt.bytes(router_bias_name(layer), Dtype::kF32, bias_shape), out.router_bias.data());
  }

  if (d.shared_inter > 0) {
    out.shared_w1 = make_expert_weights(1, 2 * d.shared_inter, d.hidden);
    out.shared_w2 = make_expert_weights(1, d.hidden, d.shared_inter);
    std::vector<std::string> names;
    for (auto proj : kProjs) names.push_back(shared_expert_weight_name(layer, proj));
    load_mlp(ckpt, names, d.hidden, d.shared_inter, 0, out.shared_w1, out.shared_w2);
  }
  return out;
}

}  // namespace moekit
