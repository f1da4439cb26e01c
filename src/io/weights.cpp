// MoE layer weights: loading from DeepSeek-style FP8 checkpoints and writing random ones
// (see include/moekit/weights.h).
#include "moekit/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numbers>
#include <thread>
#include <tuple>

#include "io/file_io.h"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"
#include "moekit/safetensors.h"

namespace moekit {

// Tensor bytes are little-endian in the file and copied as they are.
static_assert(std::endian::native == std::endian::little, "moekit's safetensors I/O assumes a little-endian host");

namespace {

constexpr std::string_view kProjs[] = {"gate_proj", "up_proj", "down_proj"};
constexpr float kRouterBiasStd = 0.05f;
constexpr float kExpertBiasStd = 0.1f;  // gpt-oss expert biases: large enough that a lost bias shows

int64_t ceil_blocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

// The shapes of one layer's matrices, from the spec.
struct LayerDims {
  int64_t hidden = 0;
  int64_t inter = 0;         // per routed expert
  int64_t shared_inter = 0;  // of the merged shared-expert MLP, 0 when none
  int num_experts = 0;
  bool has_bias = false;  // DeepSeek-V3's e_score_correction_bias (sigmoid routers)
  bool mxfp4 = false;     // gpt-oss's layout (weights.h)
  bool expert_bias = false;
  bool logit_bias = false;
};

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


// (rows, cols) of a projection of an MLP with intermediate size `inter`.
std::pair<int64_t, int64_t> proj_shape(std::string_view proj, int64_t hidden, int64_t inter) {
  return proj == "down_proj" ? std::pair{hidden, inter} : std::pair{inter, hidden};
}

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

// ---- random weights ----

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A normal stream seeded by (seed, tensor name) alone, by Box-Muller over splitmix64: moekit's own
// algorithm, where std::normal_distribution's differs between standard libraries.
class NormalStream {
 public:
  NormalStream(uint64_t seed, std::string_view name) {
    uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a of the name
    for (char c : name) h = (h ^ uint8_t(c)) * 0x100000001B3ull;
    state_ = seed ^ h;
  }
  // fp32 is plenty for values that are quantised to fp8: 24 random bits per uniform, both from one
  // draw (so |z| <= sqrt(2 ln 2^24) = 5.8 standard deviations).
  float next(float stddev) {
    if (has_spare_) {
      has_spare_ = false;
      return spare_ * stddev;
    }
    const uint64_t bits = splitmix64(state_);
    const float u1 = float((bits >> 40) + 1) * 0x1p-24f;     // (0, 1]
    const float u2 = float((bits >> 8) & 0xFFFFFF) * 0x1p-24f;  // [0, 1)
    const float r = std::sqrt(-2.0f * std::log(u1));
    const float angle = 2.0f * std::numbers::pi_v<float> * u2;
    spare_ = r * std::sin(angle);
    has_spare_ = true;
    return r * std::cos(angle) * stddev;
  }

 private:
  uint64_t state_ = 0;
  float spare_ = 0.0f;
  bool has_spare_ = false;
};

// One unit of generation: an fp8 matrix with its scales (two tensors, kept in one file), or a
// plain BF16/F32 tensor of normal values.
struct GenItem {
  std::vector<TensorDecl> tensors;
  float stddev = 0.0f;
  uint64_t bytes() const {
    uint64_t b = 0;
    for (const auto& t : tensors) b += t.num_bytes();
    return b;
  }
};

GenItem matrix_item(const std::string& name, int64_t rows, int64_t cols) {
  return {{{name, Dtype::kF8E4M3, {rows, cols}}, {scale_inv_name(name), Dtype::kF32, block_scale_shape(rows, cols)}},
          float(1.0 / std::sqrt(double(cols)))};
}

// gpt-oss's layer: the router, then each projection's blocks and scales (one item, one file) and bias.
void plan_items_mxfp4(const LayerDims& d, int l, std::vector<GenItem>& items) {
  const float router_std = float(1.0 / std::sqrt(double(d.hidden)));
  items.push_back({{{gpt_oss_router_weight_name(l), Dtype::kBF16, {d.num_experts, d.hidden}}}, router_std});
  if (d.logit_bias) items.push_back({{{gpt_oss_router_bias_name(l), Dtype::kBF16, {d.num_experts}}}, kRouterBiasStd});
  for (auto [proj, rows, cols] : {std::tuple{"gate_up_proj", 2 * d.inter, d.hidden}, {"down_proj", d.hidden, d.inter}}) {
    const int64_t groups = cols / kMxfp4Group;
    items.push_back({{{gpt_oss_expert_tensor_name(l, proj, "blocks"), Dtype::kU8, {d.num_experts, rows, groups, kMxfp4Group / 2}},
                      {gpt_oss_expert_tensor_name(l, proj, "scales"), Dtype::kU8, {d.num_experts, rows, groups}}},
                     float(1.0 / std::sqrt(double(cols)))});
    if (d.expert_bias)
      items.push_back({{{gpt_oss_expert_tensor_name(l, proj, "bias"), Dtype::kBF16, {d.num_experts, rows}}}, kExpertBiasStd});
  }
}

std::vector<GenItem> plan_items(const ModelSpec& spec, const RandomWeightsOptions& o, int num_layers, int num_experts) {
  const LayerDims d = layer_dims(spec);
  std::vector<GenItem> items;
  for (int l = o.first_layer; l < o.first_layer + num_layers; ++l) {
    if (d.mxfp4) {
      plan_items_mxfp4(d, l, items);
      continue;
    }
    items.push_back({{{router_weight_name(l), Dtype::kBF16, {d.num_experts, d.hidden}}}, float(1.0 / std::sqrt(double(d.hidden)))});
    if (d.has_bias) items.push_back({{{router_bias_name(l), Dtype::kF32, {d.num_experts}}}, kRouterBiasStd});
    for (int e = o.first_expert; e < o.first_expert + num_experts; ++e)
      for (auto proj : kProjs) {
        auto [rows, cols] = proj_shape(proj, d.hidden, d.inter);
        items.push_back(matrix_item(expert_weight_name(l, e, proj), rows, cols));
      }
    if (d.shared_inter > 0)
      for (auto proj : kProjs) {
        auto [rows, cols] = proj_shape(proj, d.hidden, d.shared_inter);
        items.push_back(matrix_item(shared_expert_weight_name(l, proj), rows, cols));
      }
  }
  return items;
}

std::map<std::string, std::string> shard_metadata(const ModelSpec& spec, const RandomWeightsOptions& o) {
  return {{"format", "pt"}, {"generator", std::string(kGeneratorName)}, {"model", spec.name}, {"seed", std::to_string(o.seed)}};
}

// The bytes of one item's tensors, drawn and quantised.
std::vector<std::vector<uint8_t>> draw_item(const GenItem& item, uint64_t seed) {
  const TensorDecl& t = item.tensors[0];
  NormalStream rng(seed, t.name);
  std::vector<std::vector<uint8_t>> out(item.tensors.size());
  if (t.dtype == Dtype::kBF16) {
    out[0].resize(t.num_bytes());
    for (size_t i = 0; i < out[0].size(); i += 2) {
      const uint16_t h = float_to_bf16(rng.next(item.stddev));
      std::memcpy(&out[0][i], &h, 2);
    }
    return out;
  }
  if (t.dtype == Dtype::kF32) {
    out[0].resize(t.num_bytes());
    for (size_t i = 0; i < out[0].size(); i += 4) {
      const float v = rng.next(item.stddev);
      std::memcpy(&out[0][i], &v, 4);
    }
    return out;
  }
  if (t.dtype == Dtype::kU8) {
    // An MXFP4 matrix [E, rows, cols/32, 16] and its scales: drawn row by row, each row quantised
    // per 32 (mxfp4.h), straight into the file's bytes. One tensor holds every expert of a layer
    // (gpt-oss-120b: 1.1 GB), so its experts are drawn on several threads, each expert from its
    // own stream ("<name>#<expert>"): the bytes do not depend on the thread count.
    const int64_t cols = t.shape[2] * kMxfp4Group, num_experts = t.shape[0], rows = t.shape[1];
    out[0].resize(t.num_bytes());
    out[1].resize(item.tensors[1].num_bytes());
    const int64_t num_threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, num_experts);
    std::vector<std::exception_ptr> errors(static_cast<size_t>(num_threads));
    {
      std::vector<std::jthread> threads;
      for (int64_t w = 0; w < num_threads; ++w)
        threads.emplace_back([&, w] {
          try {
            std::vector<float> row(static_cast<size_t>(cols));
            for (int64_t e = w; e < num_experts; e += num_threads) {
              NormalStream expert_rng(seed, fmt::format("{}#{}", t.name, e));
              for (int64_t r = e * rows; r < (e + 1) * rows; ++r) {
                for (auto& v : row) v = expert_rng.next(item.stddev);
                quantize_row_mxfp4(row.data(), int(cols), &out[0][size_t(r * cols / 2)],
                                   &out[1][size_t(r * t.shape[2])]);
              }
            }
          } catch (...) {
            errors[size_t(w)] = std::current_exception();
          }
        });
    }
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    return out;
  }
  // An fp8 matrix: draw row-major, quantise in 128x128 blocks over the matrix zero-padded to
  // whole blocks (so an edge block's scale is the amax of its real values), then crop.
  const int64_t rows = t.shape[0], cols = t.shape[1];
  const int64_t prow = ceil_blocks(rows) * kQuantBlock, pcol = ceil_blocks(cols) * kQuantBlock;
  MOEKIT_CHECK(prow <= INT32_MAX && pcol <= INT32_MAX,
               fmt::format("random weights: tensor '{}' shape {} is too large", t.name, shape_string(t.shape)));
  std::vector<float> x(size_t(prow * pcol), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) x[size_t(r * pcol + c)] = rng.next(item.stddev);
  std::vector<uint8_t>& q = out[0];
  q.resize(x.size());
  std::vector<float> scales(size_t(prow / kQuantBlock * (pcol / kQuantBlock)));
  quantize_blocks_fp8(x.data(), int(prow), int(pcol), q.data(), scales.data());
  if (pcol != cols)
    for (int64_t r = 0; r < rows; ++r) std::memmove(&q[size_t(r * cols)], &q[size_t(r * pcol)], size_t(cols));
  q.resize(size_t(rows * cols));
  out[1].resize(scales.size() * 4);
  std::memcpy(out[1].data(), scales.data(), out[1].size());
  return out;
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

RandomWeightsPlan plan_random_weights(const ModelSpec& spec, const RandomWeightsOptions& o) {
  const LayerDims d = layer_dims(spec);
  const int num_layers = o.num_layers < 0 ? spec.num_moe_layers : o.num_layers;
  const int num_experts = o.num_experts < 0 ? d.num_experts - o.first_expert : o.num_experts;
  MOEKIT_CHECK(o.first_layer >= 0 && num_layers > 0,
               fmt::format("random weights: layers [{}, {}) must be a non-empty range of non-negative indices",
                           o.first_layer, o.first_layer + num_layers));
  MOEKIT_CHECK(o.first_expert >= 0 && num_experts >= 0 && o.first_expert + num_experts <= d.num_experts,
               fmt::format("random weights: experts [{}, {}) must lie inside [0, {}) of model '{}'", o.first_expert,
                           o.first_expert + num_experts, d.num_experts, spec.name));
  MOEKIT_CHECK(o.max_shard_bytes > 0, "random weights: max_shard_bytes must be > 0");
  MOEKIT_CHECK(!d.mxfp4 || (o.first_expert == 0 && num_experts == d.num_experts),
               fmt::format("random weights: experts [{}, {}) of model '{}': its MXFP4 (gpt-oss) layout holds all {} "
                           "experts of a layer in one tensor, so all are written",
                           o.first_expert, o.first_expert + num_experts, spec.name, d.num_experts));

  RandomWeightsPlan plan;
  uint64_t shard_bytes = 0;
  for (const GenItem& item : plan_items(spec, o, num_layers, num_experts)) {
    if (plan.shards.empty() || (shard_bytes > 0 && shard_bytes + item.bytes() > o.max_shard_bytes)) {
      plan.shards.emplace_back();
      shard_bytes = 0;
    }
    for (const auto& t : item.tensors) plan.shards.back().tensors.push_back(t);
    shard_bytes += item.bytes();
    plan.tensor_bytes += item.bytes();
  }
  const auto metadata = shard_metadata(spec, o);
  for (size_t i = 0; i < plan.shards.size(); ++i) {
    WeightShard& s = plan.shards[i];
    s.file_name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, plan.shards.size());
    s.file_bytes = safetensors_header_bytes(s.tensors, metadata);
    for (const auto& t : s.tensors) s.file_bytes += t.num_bytes();
    plan.file_bytes += s.file_bytes;
  }
  return plan;
}

namespace {

// A directory the generator may write into: new, empty, or holding only what an earlier run of it
// left (its shards, which carry kGeneratorName, its index, and .tmp files of either). Anything
// else may be a real checkpoint, whose index the generator would remove and whose shards
// ("model-00001-of-000NN.safetensors") it would overwrite. Returns the earlier run's shards.
std::vector<std::filesystem::path> check_generator_directory(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> shards;
  if (!fs::exists(fs::symlink_status(dir, ec))) return shards;
  MOEKIT_CHECK(fs::is_directory(dir, ec), fmt::format("random weights: '{}' exists and is not a directory", dir));
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const auto refuse = [&](std::string_view why) {
      throw Error(fmt::format("random weights: directory '{}' holds '{}', {}; the generator would replace what is "
                              "there: give a new or empty directory",
                              dir, name, why));
    };
    if (name == kIndexFileName || (name.ends_with(".tmp") && name.starts_with("model"))) continue;
    if (!name.ends_with(".safetensors") || !it->is_regular_file()) refuse("which moekit's generator did not write");
    const SafetensorsFile file = SafetensorsFile::open(it->path().string());
    const auto gen = file.metadata().find("generator");
    if (gen == file.metadata().end())
      refuse("a safetensors file without a generator in its metadata (moekit's generator did not write it)");
    if (gen->second != kGeneratorName)
      refuse(fmt::format("a safetensors file written by '{}', not by moekit's generator", gen->second));
    shards.push_back(it->path());
  }
  MOEKIT_CHECK(!ec, fmt::format("random weights: cannot list directory '{}': {}", dir, ec.message()));
  return shards;
}

}  // namespace

RandomWeightsPlan write_random_weights(const ModelSpec& spec, const RandomWeightsOptions& o, const std::string& dir,
                                       const std::function<void(uint64_t, uint64_t)>& progress) {
  namespace fs = std::filesystem;
  const RandomWeightsPlan plan = plan_random_weights(spec, o);
  const std::vector<fs::path> old_shards = check_generator_directory(dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  MOEKIT_CHECK(fs::is_directory(dir), fmt::format("random weights: cannot create directory '{}': {}", dir, ec.message()));

  // Regroup the plan's tensors into items (a matrix's scales follow it in the same file).
  const auto metadata = shard_metadata(spec, o);
  const int num_layers = o.num_layers < 0 ? spec.num_moe_layers : o.num_layers;
  const int num_experts = o.num_experts < 0 ? spec.num_routed_experts - o.first_expert : o.num_experts;
  const std::vector<GenItem> items = plan_items(spec, o, num_layers, num_experts);
  // Items are drawn in parallel (each from its own seed, so the bytes do not depend on the
  // thread count) and written in order. A batch holds at most `workers` items and, beyond its
  // first, at most kDrawBudgetBytes of drawing buffers (fp32 values plus fp8 codes).
  const size_t workers = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16);
  constexpr uint64_t kDrawBudgetBytes = uint64_t(1) << 30;
  // fp32 values plus fp8 codes; an MXFP4 matrix is drawn a row at a time into its own bytes.
  auto draw_bytes = [](const GenItem& item) {
    return item.tensors[0].dtype == Dtype::kU8 ? item.bytes()
                                               : item.tensors[0].num_bytes() / dtype_size(item.tensors[0].dtype) * 5;
  };
  // An index left from an earlier run must not describe a half-written directory. Without it,
  // Checkpoint::open refuses the directory (its files carry kGeneratorName) until the new index
  // is written, last, after every shard is complete on disk.
  const fs::path index_path = fs::path(dir) / kIndexFileName;
  fs::remove(index_path, ec);
  MOEKIT_CHECK(!ec, fmt::format("random weights: cannot remove the old '{}': {}", index_path.string(), ec.message()));
  // An earlier run's shards (check_generator_directory found them all the generator's) go too:
  // one with more shards would otherwise leave files the new index does not name.
  for (const fs::path& f : old_shards) {
    fs::remove(f, ec);
    MOEKIT_CHECK(!ec, fmt::format("random weights: cannot remove the old '{}': {}", f.string(), ec.message()));
  }
  sync_directory(dir);
  size_t next_item = 0;
  uint64_t done = 0;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (const WeightShard& s : plan.shards) {
    SafetensorsWriter w((fs::path(dir) / s.file_name).string(), s.tensors, metadata);
    for (size_t t = 0; t < s.tensors.size();) {
      std::vector<size_t> batch;  // the next items of this shard
      uint64_t batch_bytes = 0;
      for (size_t tt = t; tt < s.tensors.size() && batch.size() < workers;) {
        const GenItem& item = items[next_item + batch.size()];
        if (!batch.empty() && batch_bytes + draw_bytes(item) > kDrawBudgetBytes) break;
        batch.push_back(next_item + batch.size());
        batch_bytes += draw_bytes(item);
        tt += item.tensors.size();
      }
      std::vector<std::vector<std::vector<uint8_t>>> drawn(batch.size());
      std::vector<std::exception_ptr> errors(batch.size());
      {
        std::vector<std::jthread> threads;
        for (size_t b = 0; b < batch.size(); ++b)
          threads.emplace_back([&, b] {
            try {
              drawn[b] = draw_item(items[batch[b]], o.seed);
            } catch (...) {
              errors[b] = std::current_exception();
            }
          });
      }
      for (size_t b = 0; b < batch.size(); ++b) {
        if (errors[b]) std::rethrow_exception(errors[b]);
        const GenItem& item = items[batch[b]];
        for (const auto& bytes : drawn[b]) w.write(bytes);
        for (const auto& decl : item.tensors) weight_map[decl.name] = s.file_name;
        t += item.tensors.size();
        done += item.bytes();
        if (progress) progress(done, plan.tensor_bytes);
      }
      next_item += batch.size();
    }
    w.finish();
  }
  nlohmann::ordered_json index = {{"metadata", {{"total_size", plan.tensor_bytes}}}, {"weight_map", weight_map}};
  write_file_atomically(index_path.string(), index.dump(2) + "\n", "checkpoint index");
  return plan;
}

}  // namespace moekit
