// The random-weights generator (include/moekit/weights.h): checkpoints of any spec in the layout
// the loader reads (weights.cpp), drawn from moekit's own normal stream so that the bytes depend
// on the seed and the tensor name alone.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numbers>
#include <thread>
#include <tuple>

#include "io/file_io.h"
#include "io/weights_layout.h"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"
#include "moekit/safetensors.h"
#include "moekit/weights.h"

namespace moekit {

using namespace weights_detail;

namespace {

constexpr float kRouterBiasStd = 0.05f;
constexpr float kExpertBiasStd = 0.1f;  // gpt-oss expert biases: large enough that a lost bias shows

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
