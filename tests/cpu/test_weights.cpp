// MoE layer weights: the random-checkpoint generator, the loader and its fused gate/up layout,
// its errors, and cross-checks against the `safetensors` Python package in both directions
// (tests/python/safetensors_interop.py).
#include "expect_error.h"
#include "moekit/weights.h"

#include <gtest/gtest.h>
#include <fmt/format.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <tuple>
#include <nlohmann/json.hpp>

#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/fp8.h"
#include "moekit/mxfp4.h"

namespace fs = std::filesystem;
using namespace moekit;

namespace {

fs::path test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(MOEKIT_BINARY_DIR) / "test_tmp" / "weights" / (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A small DeepSeek-style model: hidden 256, 8 experts of inter 128, one shared expert of 128,
// sigmoid router with bias, 2 MoE layers.
ModelSpec small_spec() {
  ModelSpec s = load_model_spec("tiny-moe");
  s.name = "small-test";
  s.hidden_size = 256;
  s.moe_intermediate_size = 128;
  s.num_routed_experts = 8;
  s.num_experts_per_token = 2;
  s.num_moe_layers = 2;
  s.num_layers = 2;
  s.num_shared_experts = 1;
  s.shared_intermediate_size = 128;
  return s;
}

// Shapes that are not multiples of 128 (as gpt-oss-120b's 2880): partial edge blocks.
ModelSpec odd_spec() {
  ModelSpec s = small_spec();
  s.name = "odd-test";
  s.hidden_size = 200;
  s.moe_intermediate_size = 72;
  s.num_routed_experts = 2;
  s.num_shared_experts = 0;
  s.shared_intermediate_size = 0;
  s.router.scoring = "softmax";
  s.num_moe_layers = 1;
  return s;
}

// A small gpt-oss-style model: hidden 160 and inter 96 (padded to 256 and 128), 4 experts, 2 MoE layers.
ModelSpec oss_spec() {
  ModelSpec s = load_model_spec("gpt-oss-20b");
  s.name = "oss-test";
  s.hidden_size = 160;
  s.moe_intermediate_size = 96;
  s.num_routed_experts = 4;
  s.num_experts_per_token = 2;
  s.num_layers = 2;
  s.num_moe_layers = 2;
  return s;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

float f32_at(std::span<const uint8_t> bytes, size_t i) {
  float v;
  std::memcpy(&v, bytes.data() + 4 * i, 4);
  return v;
}

uint16_t u16_at(std::span<const uint8_t> bytes, size_t i) {
  uint16_t v;
  std::memcpy(&v, bytes.data() + 2 * i, 2);
  return v;
}

// The dequantised values of an fp8 matrix of `ckpt`: fp8 value times its block's scale.
std::vector<double> dequantized(const Checkpoint& ckpt, const std::string& name) {
  const TensorInfo& info = ckpt.info(name);
  const int64_t rows = info.shape[0], cols = info.shape[1];
  auto w = ckpt.bytes(name, Dtype::kF8E4M3, info.shape);
  const auto sshape = block_scale_shape(rows, cols);
  auto s = ckpt.bytes(scale_inv_name(name), Dtype::kF32, sshape);
  std::vector<double> out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[size_t(r * cols + c)] =
          double(fp8_e4m3_to_float(w[size_t(r * cols + c)])) * double(f32_at(s, size_t(r / 128 * sshape[1] + c / 128)));
  return out;
}

// Rebuilds a checkpoint as one file, dropping or replacing tensors: edit(name) returns
// nullopt to keep a tensor, a TensorDecl with empty name to drop it, else the replacement
// (whose bytes are `replacement_bytes`).
void rewrite_checkpoint(const Checkpoint& ckpt, const fs::path& out,
                        const std::function<std::optional<TensorDecl>(const std::string&)>& edit,
                        const std::vector<uint8_t>& replacement_bytes = {}) {
  std::vector<TensorData> tensors;
  for (const auto& name : ckpt.tensor_names()) {
    const TensorInfo& info = ckpt.info(name);
    auto e = edit(name);
    if (!e) {
      tensors.push_back({{name, info.dtype, info.shape}, ckpt.bytes(name, info.dtype, info.shape)});
    } else if (!e->name.empty()) {
      tensors.push_back({*e, replacement_bytes});
    }
  }
  write_safetensors(out.string(), tensors);
}

// ---- the Python side ----

struct PythonRun {
  int status = -1;
  std::string output;
};

PythonRun run_python(const std::string& args) {
  const std::string script = std::string(MOEKIT_SOURCE_DIR) + "/tests/python/safetensors_interop.py";
  const std::string cmd = "python3 '" + script + "' " + args + " 2>&1";
  PythonRun r;
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

bool skip_python() {
  const char* v = std::getenv("MOEKIT_SKIP_PYTHON");
  return v && std::string(v) == "1";
}

std::string quoted(const fs::path& p) { return fmt::format("'{}'", p.string()); }

// Fails the test (never skips it, unless MOEKIT_SKIP_PYTHON=1) when python3 or its packages are missing.
#define RUN_PYTHON(result, args)                                                                                   \
  if (skip_python()) GTEST_SKIP() << "MOEKIT_SKIP_PYTHON=1: the cross-check against the safetensors package is skipped"; \
  const PythonRun result = run_python(args);                                                                       \
  ASSERT_NE(result.status, 127) << "python3 is not on PATH: " << result.output;                                   \
  ASSERT_NE(result.status, 3) << result.output << "\n(run scripts/setup, or set MOEKIT_SKIP_PYTHON=1 to skip)";     \
  ASSERT_EQ(result.status, 0) << "python3 safetensors_interop.py " << args << " failed:\n" << result.output

}  // namespace

TEST(WeightNames, FollowDeepSeekV3) {
  EXPECT_EQ(expert_weight_name(3, 7, "gate_proj"), "model.layers.3.mlp.experts.7.gate_proj.weight");
  EXPECT_EQ(scale_inv_name(expert_weight_name(60, 255, "down_proj")), "model.layers.60.mlp.experts.255.down_proj.weight_scale_inv");
  EXPECT_EQ(shared_expert_weight_name(3, "up_proj"), "model.layers.3.mlp.shared_experts.up_proj.weight");
  EXPECT_EQ(router_weight_name(3), "model.layers.3.mlp.gate.weight");
  EXPECT_EQ(router_bias_name(3), "model.layers.3.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(block_scale_shape(2048, 7168), (std::vector<int64_t>{16, 56}));
  EXPECT_EQ(block_scale_shape(2880, 2880), (std::vector<int64_t>{23, 23}));
  EXPECT_EQ(block_scale_shape(1, 129), (std::vector<int64_t>{1, 2}));
}

// The plan tells the size before anything is written; sizes worked out by hand.
TEST(RandomWeights, PlanSaysTheBytesBeforeWriting) {
  // Per layer of small_spec: router 8*256 bf16 = 4096 B, bias 8 f32 = 32 B, and 9 MLPs (8 experts +
  // the shared one) of 3 fp8 matrices of 128*256 = 32768 B with 2 scales (8 B) each = 98328 B.
  const RandomWeightsPlan small = plan_random_weights(small_spec(), {});
  EXPECT_EQ(small.tensor_bytes, 2u * (4096 + 32 + 9 * 98328));
  ASSERT_EQ(small.shards.size(), 1u);
  EXPECT_EQ(small.shards[0].file_name, "model-00001-of-00001.safetensors");
  EXPECT_GT(small.file_bytes, small.tensor_bytes);

  // DeepSeek-V3, all 58 MoE layers: per MLP 3 * 2048 * 7168 fp8 + 3 * 16 * 56 f32 scales = 44050944 B;
  // per layer 257 MLPs + router 256 * 7168 * 2 + bias 1024.
  const ModelSpec v3 = load_model_spec("deepseek-v3");
  const RandomWeightsPlan full = plan_random_weights(v3, {});
  const uint64_t per_layer = 257ull * 44050944 + 256ull * 7168 * 2 + 1024;
  EXPECT_EQ(full.tensor_bytes, 58 * per_layer);  // 657 GB
  uint64_t files = 0;
  for (const auto& s : full.shards) {
    EXPECT_LE(s.file_bytes, (uint64_t(4) << 30) + (1 << 20)) << s.file_name;
    files += s.file_bytes;
  }
  EXPECT_EQ(files, full.file_bytes);
  EXPECT_EQ(full.shards.back().file_name, fmt::format("model-{:05d}-of-{:05d}.safetensors", full.shards.size(), full.shards.size()));

  // One layer, experts [0, 8): 8 experts + the shared one, router and bias.
  const RandomWeightsPlan part = plan_random_weights(v3, {.first_layer = 3, .num_layers = 1, .first_expert = 0, .num_experts = 8});
  EXPECT_EQ(part.tensor_bytes, 9ull * 44050944 + 256ull * 7168 * 2 + 1024);
  EXPECT_EQ(part.shards[0].tensors[0].name, "model.layers.3.mlp.gate.weight");

  expect_error([&] { plan_random_weights(load_model_spec("llama-3-70b"), {}); }, {"is dense"});
  expect_error([&] { plan_random_weights(v3, {.first_expert = 250, .num_experts = 8}); }, {"experts [250, 258) must lie inside [0, 256)"});
  expect_error([&] { plan_random_weights(v3, {.num_layers = 0}); }, {"layers [0, 0) must be a non-empty range"});
}

TEST(RandomWeights, WriteThenLoadBitForBit) {
  const fs::path dir = test_dir();
  const ModelSpec spec = small_spec();
  uint64_t last_done = 0, calls = 0;
  const RandomWeightsPlan plan = write_random_weights(spec, {.seed = 7, .max_shard_bytes = 300000}, dir.string(),
                                                      [&](uint64_t done, uint64_t total) {
                                                        EXPECT_GT(done, last_done);
                                                        EXPECT_EQ(total, 2u * (4096 + 32 + 9 * 98328));
                                                        last_done = done;
                                                        ++calls;
                                                      });
  EXPECT_EQ(last_done, plan.tensor_bytes);
  EXPECT_GT(calls, 50u);
  ASSERT_GE(plan.shards.size(), 6u);  // 1.78 MB in files of at most 300 kB
  uint64_t on_disk = 0;
  for (const auto& s : plan.shards) {
    const uint64_t size = fs::file_size(dir / s.file_name);
    EXPECT_EQ(size, s.file_bytes) << s.file_name;
    EXPECT_LE(size, 300000u + 4096) << s.file_name;  // tensors within the bound, plus the header
    on_disk += size;
  }
  EXPECT_EQ(on_disk, plan.file_bytes);

  const Checkpoint ckpt = Checkpoint::open(dir.string());
  EXPECT_EQ(ckpt.tensor_names().size(), 2u * (2 + 9 * 6));
  for (const auto& name : ckpt.tensor_names()) {  // a matrix and its scales share a file
    if (name.ends_with(".weight") && ckpt.info(name).dtype == Dtype::kF8E4M3) {
      EXPECT_EQ(ckpt.file_of(name).path(), ckpt.file_of(scale_inv_name(name)).path()) << name;
    }
  }

  const MoeLayerWeights w = load_moe_layer(ckpt, spec, 1, 2, 3);
  EXPECT_EQ(w.layer, 1);
  EXPECT_EQ(w.first_expert, 2);
  EXPECT_EQ(w.num_local_experts(), 3);
  EXPECT_EQ(w.num_experts, 8);
  EXPECT_EQ(w.w1.layout.n, 256);
  EXPECT_EQ(w.w1.layout.k, 256);
  EXPECT_EQ(w.w2.layout.n, 256);
  EXPECT_EQ(w.w2.layout.k, 128);
  ASSERT_EQ(w.w1.w.size(), 3u * 256 * 256);
  ASSERT_EQ(w.w1.scales.size(), 3u * 2 * 2);
  ASSERT_EQ(w.w2.w.size(), 3u * 256 * 128);
  ASSERT_EQ(w.w2.scales.size(), 3u * 2 * 1);

  // Each file tensor, read by name, sits where the fused convention puts it: gate rows
  // [0, 128), up rows [128, 256) of W1; scales likewise by block rows.
  auto expect_block = [&](const std::string& name, const ExpertWeights& ew, int e, int row0) {
    const TensorInfo& info = ckpt.info(name);
    auto src = ckpt.bytes(name, Dtype::kF8E4M3, info.shape);
    EXPECT_EQ(std::memcmp(&ew.w[ew.layout.w_offset(e, row0)], src.data(), src.size()), 0) << name;
    auto sshape = block_scale_shape(info.shape[0], info.shape[1]);
    auto ssrc = ckpt.bytes(scale_inv_name(name), Dtype::kF32, sshape);
    EXPECT_EQ(std::memcmp(&ew.scales[ew.layout.scale_offset(e, row0, 0)], ssrc.data(), ssrc.size()), 0) << name;
  };
  for (int i = 0; i < 3; ++i) {
    expect_block(expert_weight_name(1, 2 + i, "gate_proj"), w.w1, i, 0);
    expect_block(expert_weight_name(1, 2 + i, "up_proj"), w.w1, i, 128);
    expect_block(expert_weight_name(1, 2 + i, "down_proj"), w.w2, i, 0);
  }
  ASSERT_TRUE(w.has_shared_experts());
  expect_block(shared_expert_weight_name(1, "gate_proj"), w.shared_w1, 0, 0);
  expect_block(shared_expert_weight_name(1, "up_proj"), w.shared_w1, 0, 128);
  expect_block(shared_expert_weight_name(1, "down_proj"), w.shared_w2, 0, 0);

  const int64_t router_shape[] = {8, 256}, bias_shape[] = {8};
  auto router = ckpt.bytes(router_weight_name(1), Dtype::kBF16, router_shape);
  ASSERT_EQ(w.router_weight.size(), 8u * 256);
  for (size_t i = 0; i < w.router_weight.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &w.router_weight[i], 4);
    ASSERT_EQ(bits, uint32_t(u16_at(router, i)) << 16) << i;  // bf16 is the top half of the fp32
  }
  auto bias = ckpt.bytes(router_bias_name(1), Dtype::kF32, bias_shape);
  ASSERT_EQ(w.router_bias.size(), 8u);
  EXPECT_EQ(std::memcmp(w.router_bias.data(), bias.data(), 32), 0);
}

// Normal(0, 1/fan_in) before quantisation; every 128x128 block's largest magnitude is 448 (scale = amax/448).
TEST(RandomWeights, ValuesHaveTheIntendedScale) {
  const fs::path dir = test_dir();
  const ModelSpec spec = small_spec();
  write_random_weights(spec, {.num_layers = 1, .seed = 3}, dir.string());
  const Checkpoint ckpt = Checkpoint::open(dir.string());
  for (const std::string proj : {"gate_proj", "up_proj", "down_proj"}) {
    double sum = 0, sumsq = 0;
    size_t n = 0;
    for (int e = 0; e < 8; ++e) {
      const std::string name = expert_weight_name(0, e, proj);
      for (double v : dequantized(ckpt, name)) {
        sum += v;
        sumsq += v * v;
        ++n;
      }
      const TensorInfo& info = ckpt.info(name);
      auto q = ckpt.bytes(name, Dtype::kF8E4M3, info.shape);
      for (int64_t rb = 0; rb < info.shape[0] / 128; ++rb)
        for (int64_t cb = 0; cb < info.shape[1] / 128; ++cb) {
          float amax = 0;
          for (int r = 0; r < 128; ++r)
            for (int c = 0; c < 128; ++c)
              amax = std::max(amax, std::fabs(fp8_e4m3_to_float(q[size_t((rb * 128 + r) * info.shape[1] + cb * 128 + c)])));
          EXPECT_EQ(amax, 448.0f) << name << " block " << rb << "," << cb;
        }
    }
    const double fan_in = proj == "down_proj" ? 128 : 256;
    const double stddev = std::sqrt(sumsq / double(n));
    EXPECT_NEAR(stddev * std::sqrt(fan_in), 1.0, 0.03) << proj;      // 262144 samples: sampling error ~0.2%
    EXPECT_NEAR(sum / double(n) * std::sqrt(fan_in), 0.0, 0.01) << proj;  // ~5 standard errors
  }
  const MoeLayerWeights w = load_moe_layer(ckpt, spec, 0, 0, 8);
  double sumsq = 0;
  for (float v : w.router_weight) sumsq += double(v) * v;
  EXPECT_NEAR(std::sqrt(sumsq / double(w.router_weight.size())) * 16.0, 1.0, 0.06);  // 2048 samples
  for (float b : w.router_bias) EXPECT_LT(std::fabs(b), 0.3f);                      // 6 sigma of N(0, 0.05^2)
}

TEST(RandomWeights, DeterministicAndIndependentOfSubsetAndSharding) {
  const fs::path dir = test_dir();
  const ModelSpec spec = small_spec();
  write_random_weights(spec, {.seed = 11, .max_shard_bytes = 300000}, (dir / "a").string());
  write_random_weights(spec, {.seed = 11, .max_shard_bytes = 300000}, (dir / "b").string());
  write_random_weights(spec, {.seed = 11}, (dir / "one_file").string());
  write_random_weights(spec, {.first_layer = 1, .num_layers = 1, .first_expert = 5, .num_experts = 2, .seed = 11},
                       (dir / "subset").string());
  write_random_weights(spec, {.num_layers = 1, .seed = 12}, (dir / "other_seed").string());

  for (const auto& entry : fs::directory_iterator(dir / "a"))
    EXPECT_EQ(read_file(entry.path()), read_file(dir / "b" / entry.path().filename())) << entry.path();

  const Checkpoint a = Checkpoint::open((dir / "a").string());
  auto same_as_a = [&](const Checkpoint& c) {
    for (const auto& name : c.tensor_names()) {
      const TensorInfo& info = c.info(name);
      auto x = c.bytes(name, info.dtype, info.shape);
      auto y = a.bytes(name, info.dtype, info.shape);
      ASSERT_EQ(x.size(), y.size()) << name;
      EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size()), 0) << name;
    }
  };
  const Checkpoint one = Checkpoint::open((dir / "one_file").string());
  EXPECT_EQ(one.tensor_names(), a.tensor_names());
  same_as_a(one);
  const Checkpoint subset = Checkpoint::open((dir / "subset").string());
  // router, bias, 2 experts and the shared MLP, 3 matrices each with scales.
  EXPECT_EQ(subset.tensor_names().size(), 2u + 3 * 3 * 2);
  EXPECT_TRUE(subset.contains(expert_weight_name(1, 6, "down_proj")));
  EXPECT_FALSE(subset.contains(expert_weight_name(1, 4, "down_proj")));
  EXPECT_FALSE(subset.contains(router_weight_name(0)));
  same_as_a(subset);
  // The subset loads as the local experts [5, 7).
  EXPECT_NO_THROW(load_moe_layer(subset, spec, 1, 5, 2));
  expect_error([&] { load_moe_layer(subset, spec, 1, 4, 2); }, {"tensor 'model.layers.1.mlp.experts.4.gate_proj.weight' not found"});

  const Checkpoint other = Checkpoint::open((dir / "other_seed").string());
  const std::string g = expert_weight_name(0, 0, "gate_proj");
  const int64_t shape[] = {128, 256};
  EXPECT_NE(std::memcmp(other.bytes(g, Dtype::kF8E4M3, shape).data(), a.bytes(g, Dtype::kF8E4M3, shape).data(), 128 * 256), 0);
}

// Item: regenerating into a directory and being interrupted left shards of two runs and no
// index, which opened as "a directory of *.safetensors" mixing both seeds.
TEST(RandomWeights, AnInterruptedRegenerationIsRefusedNotGuessedAt) {
  const fs::path dir = test_dir();
  const ModelSpec spec = small_spec();
  const RandomWeightsOptions first = {.seed = 1, .max_shard_bytes = 300000};
  const RandomWeightsPlan plan = write_random_weights(spec, first, dir.string());
  ASSERT_GE(plan.shards.size(), 4u);
  EXPECT_NO_THROW(Checkpoint::open(dir.string()));

  // The second run (another seed) stops half-way: the progress callback plays the interrupt.
  struct Interrupted {};
  const RandomWeightsOptions second = {.seed = 2, .max_shard_bytes = 300000};
  EXPECT_THROW(write_random_weights(spec, second, dir.string(),
                                    [&](uint64_t done, uint64_t total) {
                                      if (done > total / 2) throw Interrupted{};
                                    }),
               Interrupted);
  EXPECT_FALSE(fs::exists(dir / kIndexFileName)) << "the old index must go before any shard is replaced";
  for (const auto& e : fs::directory_iterator(dir)) EXPECT_NE(e.path().extension(), ".tmp") << e.path();
  // Shard 1 is the second run's; the first run's shards went with its index (none is left for
  // the new index not to name), so the last one is not there yet.
  EXPECT_EQ(SafetensorsFile::open((dir / plan.shards.front().file_name).string()).metadata().at("seed"), "2");
  EXPECT_FALSE(fs::exists(dir / plan.shards.back().file_name));
  expect_error([&] { Checkpoint::open(dir.string()); },
               {"checkpoint '" + dir.string() + "'", plan.shards.front().file_name, "was written by moekit random weights",
                "has no model.safetensors.index.json", "interrupted write"});

  // Run to the end, the directory opens again, all of it the second seed.
  write_random_weights(spec, second, dir.string());
  const Checkpoint c = Checkpoint::open(dir.string());
  for (const auto& s : plan.shards) EXPECT_EQ(c.file_of(s.tensors.front().name).metadata().at("seed"), "2");
  // A single shard named directly is complete and opens (it was renamed into place when whole).
  EXPECT_NO_THROW(Checkpoint::open((dir / plan.shards.back().file_name).string()));

  // Interrupted again with another shard size: the file names differ from the old ones, and
  // the old ones are gone; still the interrupted write is what the error says. Run to the end,
  // no file of the earlier runs is left beside the new index's.
  EXPECT_THROW(write_random_weights(spec, {.seed = 3, .max_shard_bytes = 700000}, dir.string(),
                                    [&](uint64_t done, uint64_t total) {
                                      if (done > total / 2) throw Interrupted{};
                                    }),
               Interrupted);
  expect_error([&] { Checkpoint::open(dir.string()); }, {"was written by moekit random weights", "interrupted write"});
  const RandomWeightsPlan third = write_random_weights(spec, {.seed = 3, .max_shard_bytes = 700000}, dir.string());
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.path().extension() == ".safetensors";
  EXPECT_EQ(files, third.shards.size());
  EXPECT_LT(third.shards.size(), plan.shards.size());
}

TEST(RandomWeights, ShapesThatAreNotMultiplesOf128) {
  const fs::path dir = test_dir();
  const ModelSpec spec = odd_spec();
  write_random_weights(spec, {.seed = 5}, dir.string());
  const Checkpoint ckpt = Checkpoint::open(dir.string());
  const std::string gate = expert_weight_name(0, 1, "gate_proj"), down = expert_weight_name(0, 1, "down_proj");
  EXPECT_EQ(ckpt.info(gate).shape, (std::vector<int64_t>{72, 200}));
  EXPECT_EQ(ckpt.info(scale_inv_name(gate)).shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ckpt.info(scale_inv_name(down)).shape, (std::vector<int64_t>{2, 1}));
  EXPECT_FALSE(ckpt.contains(router_bias_name(0)));  // softmax router: no bias
  // A partial block [72 rows, 72 columns] has its own scale: its largest magnitude is 448 too.
  auto q = ckpt.bytes(gate, Dtype::kF8E4M3, ckpt.info(gate).shape);
  float amax = 0;
  for (int r = 0; r < 72; ++r)
    for (int c = 128; c < 200; ++c) amax = std::max(amax, std::fabs(fp8_e4m3_to_float(q[size_t(r * 200 + c)])));
  EXPECT_EQ(amax, 448.0f);
  expect_error([&] { load_moe_layer(ckpt, spec, 0, 0, 2); }, {"hidden_size = 200 is not a multiple of 128"});
}

TEST(LoadMoeLayer, BadCheckpointsAreClearErrors) {
  const fs::path dir = test_dir();
  const ModelSpec spec = small_spec();
  write_random_weights(spec, {.num_layers = 1, .seed = 1, .max_shard_bytes = 200000}, (dir / "gen").string());
  const Checkpoint gen = Checkpoint::open((dir / "gen").string());
  EXPECT_NO_THROW(load_moe_layer(gen, spec, 0, 0, 8));

  auto variant = [&](const std::string& file, const std::function<std::optional<TensorDecl>(const std::string&)>& edit,
                     const std::vector<uint8_t>& bytes = {}) {
    const fs::path p = dir / file;
    rewrite_checkpoint(gen, p, edit, bytes);
    return Checkpoint::open(p.string());
  };
  const std::string up3 = expert_weight_name(0, 3, "up_proj"), gate1 = expert_weight_name(0, 1, "gate_proj"),
                    down2s = scale_inv_name(expert_weight_name(0, 2, "down_proj"));
  using D = std::optional<TensorDecl>;

  const Checkpoint missing = variant("missing.safetensors", [&](const std::string& n) { return n == up3 ? D(TensorDecl{}) : D(); });
  expect_error([&] { load_moe_layer(missing, spec, 0, 0, 8); },
               {"tensor 'model.layers.0.mlp.experts.3.up_proj.weight' not found in checkpoint '" + (dir / "missing.safetensors").string() + "'"});
  EXPECT_NO_THROW(load_moe_layer(missing, spec, 0, 4, 4));  // experts that are all there

  const Checkpoint shape = variant(
      "shape.safetensors", [&](const std::string& n) { return n == gate1 ? D(TensorDecl{gate1, Dtype::kF8E4M3, {128, 384}}) : D(); },
      std::vector<uint8_t>(128 * 384));
  expect_error([&] { load_moe_layer(shape, spec, 0, 0, 8); },
               {"tensor 'model.layers.0.mlp.experts.1.gate_proj.weight' in '" + (dir / "shape.safetensors").string() +
                "': expected dtype F8_E4M3 shape [128, 256], got F8_E4M3 [128, 384]"});

  const Checkpoint dtype = variant(
      "dtype.safetensors", [&](const std::string& n) { return n == down2s ? D(TensorDecl{down2s, Dtype::kBF16, {2, 1}}) : D(); },
      std::vector<uint8_t>(4));
  expect_error([&] { load_moe_layer(dtype, spec, 0, 0, 8); },
               {"tensor '" + down2s + "' in '", "expected dtype F32 shape [2, 1], got BF16 [2, 1]"});

  const std::string router = router_weight_name(0);
  const Checkpoint f16 = variant(
      "f16.safetensors", [&](const std::string& n) { return n == router ? D(TensorDecl{router, Dtype::kF16, {8, 256}}) : D(); },
      std::vector<uint8_t>(8 * 256 * 2));
  expect_error([&] { load_moe_layer(f16, spec, 0, 0, 8); },
               {"tensor 'model.layers.0.mlp.gate.weight' in '", "expected dtype BF16 or F32 shape [8, 256], got F16 [8, 256]"});

  // An F32 router is read as it is: 0.5 * i.
  std::vector<float> f32_router(8 * 256);
  for (size_t i = 0; i < f32_router.size(); ++i) f32_router[i] = 0.5f * float(i);
  const Checkpoint f32 = variant(
      "f32.safetensors", [&](const std::string& n) { return n == router ? D(TensorDecl{router, Dtype::kF32, {8, 256}}) : D(); },
      std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(f32_router.data()),
                           reinterpret_cast<const uint8_t*>(f32_router.data() + f32_router.size())));
  EXPECT_EQ(load_moe_layer(f32, spec, 0, 0, 8).router_weight, f32_router);

  const std::string bias = router_bias_name(0);
  const Checkpoint no_bias = variant("no_bias.safetensors", [&](const std::string& n) { return n == bias ? D(TensorDecl{}) : D(); });
  expect_error([&] { load_moe_layer(no_bias, spec, 0, 0, 8); }, {"tensor 'model.layers.0.mlp.gate.e_score_correction_bias' not found"});
  ModelSpec softmax = spec;
  softmax.router.scoring = "softmax";
  EXPECT_TRUE(load_moe_layer(no_bias, softmax, 0, 0, 8).router_bias.empty());

  const std::string gate5s = scale_inv_name(expert_weight_name(0, 5, "gate_proj"));
  std::vector<float> nan_scales = {0.01f, std::nanf("")};
  const Checkpoint nan = variant(
      "nan.safetensors", [&](const std::string& n) { return n == gate5s ? D(TensorDecl{gate5s, Dtype::kF32, {1, 2}}) : D(); },
      std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(nan_scales.data()), reinterpret_cast<const uint8_t*>(nan_scales.data() + 2)));
  expect_error([&] { load_moe_layer(nan, spec, 0, 0, 8); }, {"tensor '" + gate5s + "'", "block [0, 1] holds nan, expected a finite positive scale"});

  expect_error([&] { load_moe_layer(gen, spec, 1, 0, 8); }, {"tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' not found in checkpoint"});
  expect_error([&] { load_moe_layer(gen, spec, 0, 6, 3); }, {"experts [6, 9) must be a non-empty range inside [0, 8)"});
  expect_error([&] { load_moe_layer(gen, spec, 0, 0, 0); }, {"experts [0, 0)"});
  expect_error([&] { load_moe_layer(gen, load_model_spec("llama-3-70b"), 0, 0, 1); }, {"is dense"});
  ModelSpec bigger = spec;
  bigger.hidden_size = 384;
  expect_error([&] { load_moe_layer(gen, bigger, 0, 0, 8); }, {"expected dtype F8_E4M3 shape [128, 384], got F8_E4M3 [128, 256]"});

  // A truncated shard: the error names the file and says so.
  const fs::path shard = dir / "gen" / "model-00002-of-00005.safetensors";
  ASSERT_TRUE(fs::exists(shard));
  fs::resize_file(shard, fs::file_size(shard) - 1000);
  const Checkpoint cut = Checkpoint::open((dir / "gen").string());
  expect_error([&] { load_moe_layer(cut, spec, 0, 0, 8); }, {shard.string(), "truncated"});
}

// ---- cross-checks against the safetensors package ----

TEST(PythonInterop, PackageWritesMoekitReads) {
  const fs::path p = test_dir() / "python.safetensors";
  RUN_PYTHON(r, "write-basic " + quoted(p));
  const SafetensorsFile f = SafetensorsFile::open(p.string());
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"origin", "python"}, {"format", "pt"}}));
  EXPECT_EQ(f.tensors().size(), 5u);
  const int64_t s37[] = {3, 7}, s23[] = {2, 3}, s5[] = {5}, s2[] = {2}, s04[] = {0, 4};
  auto fp8 = f.bytes("fp8", Dtype::kF8E4M3, s37);
  for (size_t i = 0; i < 21; ++i) EXPECT_EQ(fp8[i], uint8_t((37 * i + 5) % 256)) << i;
  auto f32 = f.bytes("f32", Dtype::kF32, s23);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(f32_at(f32, i), 0.25f * float(i) - 1.0f) << i;
  auto bf16 = f.bytes("bf16", Dtype::kBF16, s5);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(u16_at(bf16, i), 0x3F80 + i) << i;
  auto i64 = f.bytes("i64", Dtype::kI64, s2);
  int64_t v[2];
  std::memcpy(v, i64.data(), 16);
  EXPECT_EQ(v[0], -3);
  EXPECT_EQ(v[1], int64_t(1) << 40);
  EXPECT_EQ(f.bytes("empty", Dtype::kF32, s04).size(), 0u);
}

TEST(PythonInterop, MoekitWritesPackageReads) {
  const fs::path p = test_dir() / "moekit.safetensors";
  std::vector<uint8_t> fp8(21);
  for (size_t i = 0; i < fp8.size(); ++i) fp8[i] = uint8_t((37 * i + 5) % 256);
  std::vector<float> f32(6);
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = 0.25f * float(i) - 1.0f;
  std::vector<uint16_t> bf16(5);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = uint16_t(0x3F80 + i);
  const std::vector<int64_t> i64 = {-3, int64_t(1) << 40};
  const double scalar = 2.5;
  auto bytes = [](const auto* data, size_t n) { return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data), n); };
  const std::vector<TensorData> tensors = {{{"fp8", Dtype::kF8E4M3, {3, 7}}, fp8},
                                           {{"f32", Dtype::kF32, {2, 3}}, bytes(f32.data(), 24)},
                                           {{"bf16", Dtype::kBF16, {5}}, bytes(bf16.data(), 10)},
                                           {{"i64", Dtype::kI64, {2}}, bytes(i64.data(), 16)},
                                           {{"empty", Dtype::kF32, {0, 4}}, {}},
                                           {{"scalar", Dtype::kF64, {}}, bytes(&scalar, 8)}};
  write_safetensors(p.string(), tensors, {{"origin", "moekit"}, {"format", "pt"}});
  RUN_PYTHON(r, "check-basic " + quoted(p));
  EXPECT_NE(r.output.find("OK: 6 tensors checked"), std::string::npos) << r.output;
}

// A DeepSeek-style layer written by the package (two shards and an index, values by formula, see
// the script) loads into the fused layout with every value where the convention says.
TEST(PythonInterop, DeepSeekCheckpointFromThePackageLoads) {
  const fs::path dir = test_dir();
  const int layer = 3, num_experts = 4, hidden = 256, inter = 128, shared_inter = 128;
  RUN_PYTHON(r, fmt::format("write-deepseek {} {} {} {} {} {}", quoted(dir), layer, num_experts, hidden, inter, shared_inter));
  ModelSpec spec = small_spec();
  spec.num_routed_experts = num_experts;
  const Checkpoint ckpt = Checkpoint::open(dir.string());
  const MoeLayerWeights w = load_moe_layer(ckpt, spec, layer, 1, 2);

  auto weight = [&](int64_t r, int64_t c, int e, int p) { return uint8_t((31 * r + 7 * c + 13 * e + 101 * p + layer) % 256); };
  auto scale = [&](int64_t rb, int64_t cb, int e, int p) { return float(1 + 4 * rb + cb + 16 * e + 64 * p) / 1024.0f; };
  // W1 row n of local expert i: gate row n (p = 0) below inter, up row n - inter (p = 1) above.
  auto check_mlp = [&](const ExpertWeights& w1, const ExpertWeights& w2, int i, int e, int mlp_inter) {
    for (int n = 0; n < 2 * mlp_inter; ++n) {
      const int p = n < mlp_inter ? 0 : 1, row = n % mlp_inter;
      for (int k = 0; k < hidden; ++k) ASSERT_EQ(w1.w[w1.layout.w_offset(i, n) + k], weight(row, k, e, p)) << e << " " << n << " " << k;
      for (int k = 0; k < hidden; k += 128) ASSERT_EQ(w1.scales[w1.layout.scale_offset(i, n, k)], scale(row / 128, k / 128, e, p));
    }
    for (int n = 0; n < hidden; ++n) {
      for (int k = 0; k < mlp_inter; ++k) ASSERT_EQ(w2.w[w2.layout.w_offset(i, n) + k], weight(n, k, e, 2)) << e << " " << n << " " << k;
      for (int k = 0; k < mlp_inter; k += 128) ASSERT_EQ(w2.scales[w2.layout.scale_offset(i, n, k)], scale(n / 128, k / 128, e, 2));
    }
  };
  check_mlp(w.w1, w.w2, 0, 1, inter);
  check_mlp(w.w1, w.w2, 1, 2, inter);
  ASSERT_TRUE(w.has_shared_experts());
  check_mlp(w.shared_w1, w.shared_w2, 0, 99, shared_inter);
  for (int e = 0; e < num_experts; ++e) {
    for (int i = 0; i < hidden; ++i)
      ASSERT_EQ(w.router_weight[size_t(e * hidden + i)], bf16_to_float(uint16_t(0x0100 + (e * hidden + i) % 0x3E00)));
    EXPECT_EQ(w.router_bias[size_t(e)], 0.125f * float(e) - 0.25f);
  }
  EXPECT_NO_THROW(load_moe_layer(ckpt, spec, layer, 0, num_experts));
  expect_error([&] { load_moe_layer(ckpt, spec, 2, 0, 1); }, {"tensor 'model.layers.2.mlp.experts.0.gate_proj.weight' not found"});
}

// The package reads moekit's generated checkpoints (index, shards, every tensor) and its own
// dequantisation of each fp8 matrix agrees with moekit's.
TEST(PythonInterop, GeneratedCheckpointsReadByThePackage) {
  const fs::path dir = test_dir();
  for (const ModelSpec& spec : {small_spec(), odd_spec(), oss_spec()}) {
    SCOPED_TRACE(spec.name);
    const fs::path out = dir / spec.name;
    write_random_weights(spec, {.seed = 21, .max_shard_bytes = 250000}, out.string());
    RUN_PYTHON(r, "summarize " + quoted(out));
    const auto summary = nlohmann::json::parse(r.output);
    const Checkpoint ckpt = Checkpoint::open(out.string());
    ASSERT_EQ(summary.size(), ckpt.tensor_names().size());
    for (const auto& name : ckpt.tensor_names()) {
      ASSERT_TRUE(summary.contains(name)) << name;
      const auto& s = summary[name];
      const TensorInfo& info = ckpt.info(name);
      EXPECT_EQ(s["dtype"], dtype_name(info.dtype)) << name;
      EXPECT_EQ(s["shape"].get<std::vector<int64_t>>(), info.shape) << name;
      std::vector<double> values;
      auto bytes = ckpt.bytes(name, info.dtype, info.shape);
      if (info.dtype == Dtype::kF8E4M3) {
        values = dequantized(ckpt, name);
      } else if (name.ends_with("_blocks")) {  // MXFP4, decoded by mxfp4.h against the script's numpy decoder
        const int k = int(info.shape[2] * 32);
        std::vector<float> row(k);
        auto scales = ckpt.bytes(name.substr(0, name.size() - 7) + "_scales", Dtype::kU8, {info.shape.data(), 3});
        for (int64_t r = 0; r < info.shape[0] * info.shape[1]; ++r) {
          dequantize_row_mxfp4(bytes.data() + r * k / 2, scales.data() + r * (k / 32), k, row.data());
          values.insert(values.end(), row.begin(), row.end());
        }
      } else if (info.dtype == Dtype::kU8) {
        values.assign(bytes.begin(), bytes.end());
      } else if (info.dtype == Dtype::kBF16) {
        for (size_t i = 0; i < bytes.size() / 2; ++i) values.push_back(bf16_to_float(u16_at(bytes, i)));
      } else {
        for (size_t i = 0; i < bytes.size() / 4; ++i) values.push_back(f32_at(bytes, i));
      }
      double sum = 0, sumsq = 0, sumabs = 0;
      for (double v : values) {
        sum += v;
        sumsq += v * v;
        sumabs += std::fabs(v);
      }
      // Both sums are float64 over the same exact values, in different orders.
      EXPECT_NEAR(s["sum"].get<double>(), sum, 1e-12 * sumabs + 1e-300) << name;
      EXPECT_NEAR(s["sumsq"].get<double>(), sumsq, 1e-12 * sumsq + 1e-300) << name;
      EXPECT_GT(sumsq, 0.0) << name;
    }
  }
}

// The differential mode (issue: "accepts exactly what the package accepts"): a few hundred files
// made by mutating small valid ones (header bytes, lengths, offsets, dtypes, shapes, NUL, byte
// order mark, whitespace, repeated names and fields, nesting, truncation; see the script), each
// opened by moekit and by the package. moekit must refuse exactly the files the package refuses,
// with a moekit::Error, and read the same tensors and metadata from the others. The one allowed
// difference is a dimension above 2^63 - 1 in an empty tensor (shapes are int64_t here).
TEST(PythonInterop, MutatedFilesAcceptedExactlyAsThePackageAcceptsThem) {
  const fs::path dir = test_dir();
  // MOEKIT_MUTANTS=COUNT:SEED runs another corpus (docs/fuzzing.md); the default is fixed.
  int num_mutants = 600;
  uint64_t seed = 20261130;
  if (const char* env = std::getenv("MOEKIT_MUTANTS")) {
    ASSERT_EQ(std::sscanf(env, "%d:%lu", &num_mutants, &seed), 2) << env;
  }
  RUN_PYTHON(r, fmt::format("mutants {} {} {}", quoted(dir), num_mutants, seed));
  std::ifstream in(dir / "verdicts.json");
  const auto verdicts = nlohmann::json::parse(in);
  ASSERT_EQ(verdicts.size(), size_t(num_mutants));
  int accepted = 0, refused = 0;
  std::vector<std::string> mismatches;
  for (const auto& v : verdicts) {
    const std::string file = v["file"].get<std::string>();
    const std::string what = file + " (" + v["mutations"].dump() + ")";
    std::optional<SafetensorsFile> f;
    std::string error;
    try {
      f.emplace(SafetensorsFile::open((dir / file).string()));
    } catch (const Error& e) {
      error = e.what();
    } catch (const std::exception& e) {
      mismatches.push_back(what + ": threw something other than moekit::Error: " + e.what());
      continue;
    }
    if (!v["accepted"].get<bool>()) {
      ++refused;
      if (f) mismatches.push_back(what + ": the package refuses it (" + v["error"].get<std::string>() + "), moekit opens it");
      continue;
    }
    ++accepted;
    if (v["int64_deviation"].get<bool>()) {
      if (f || error.find("is above 2^63 - 1") == std::string::npos)
        mismatches.push_back(what + ": a dimension above 2^63 - 1 must be refused as such, got: " + (f ? "opened" : error));
      continue;
    }
    if (!f) {
      mismatches.push_back(what + ": the package accepts it, moekit refuses: " + error);
      continue;
    }
    const auto& want = v["tensors"];
    std::string diff;
    if (f->tensors().size() != want.size()) diff += fmt::format(" {} tensors, the package {};", f->tensors().size(), want.size());
    for (const auto& [name, t] : want.items()) {
      if (!f->contains(name)) {
        diff += " no tensor '" + name + "';";
        continue;
      }
      const TensorInfo& info = f->info(name);
      auto bytes = f->bytes(name);
      std::string hex;
      for (uint8_t b : bytes) hex += fmt::format("{:02x}", b);
      if (dtype_name(info.dtype) != t["dtype"].get<std::string>() || info.shape != t["shape"].get<std::vector<int64_t>>() ||
          hex != t["hex"].get<std::string>())
        diff += " tensor '" + name + "' differs;";
    }
    const std::map<std::string, std::string> meta =
        v["metadata"].is_null() ? std::map<std::string, std::string>{} : v["metadata"].get<std::map<std::string, std::string>>();
    if (f->metadata() != meta) diff += " metadata differs;";
    if (!diff.empty()) mismatches.push_back(what + ":" + diff);
  }
  EXPECT_TRUE(mismatches.empty()) << mismatches.size() << " of " << num_mutants << " files differ, the first:\n"
                                  << fmt::format("{}", fmt::join(mismatches.begin(),
                                                                 mismatches.begin() + std::min<size_t>(mismatches.size(), 20), "\n"));
  // A corpus that tests both sides: many files of each kind.
  EXPECT_GE(accepted, num_mutants / 10);
  EXPECT_GE(refused, num_mutants / 2);
  std::cout << "mutants: " << accepted << " accepted and " << refused << " refused by both\n";
}

// ---- gpt-oss's MXFP4 checkpoints ----

namespace {


// The format's definition, independent of mxfp4.h: the e2m1 table and ldexp.
constexpr double kE2m1[16] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};
double mxfp4_value(const uint8_t* row_bytes, const uint8_t* row_scales, int64_t i) {
  const uint8_t byte = row_bytes[i / 2];
  return kE2m1[i % 2 == 0 ? byte & 0xF : byte >> 4] * std::ldexp(1.0, int(row_scales[i / 32]) - 127);
}

// File matrix `proj` of expert e, row r, column c, decoded from the checkpoint's blocks and scales.
double file_value(const Checkpoint& ckpt, int layer, const std::string& proj, int e, int64_t r, int64_t c) {
  const std::string blocks = gpt_oss_expert_tensor_name(layer, proj, "blocks"), scales = gpt_oss_expert_tensor_name(layer, proj, "scales");
  const TensorInfo& bi = ckpt.info(blocks);
  const int64_t rows = bi.shape[1], groups = bi.shape[2];
  auto b = ckpt.bytes(blocks, Dtype::kU8, bi.shape);
  auto s = ckpt.bytes(scales, Dtype::kU8, ckpt.info(scales).shape);
  const size_t row = size_t(e * rows + r);
  return mxfp4_value(b.data() + row * groups * 16, s.data() + row * groups, c);
}

double bf16_tensor_value(const Checkpoint& ckpt, const std::string& name, size_t i) {
  auto bytes = ckpt.bytes(name, Dtype::kBF16, ckpt.info(name).shape);
  return bf16_to_float(u16_at(bytes, i));
}

}  // namespace

TEST(WeightNames, FollowGptOss) {
  EXPECT_EQ(gpt_oss_expert_tensor_name(3, "gate_up_proj", "blocks"), "model.layers.3.mlp.experts.gate_up_proj_blocks");
  EXPECT_EQ(gpt_oss_expert_tensor_name(35, "down_proj", "scales"), "model.layers.35.mlp.experts.down_proj_scales");
  EXPECT_EQ(gpt_oss_expert_tensor_name(0, "down_proj", "bias"), "model.layers.0.mlp.experts.down_proj_bias");
  EXPECT_EQ(gpt_oss_router_weight_name(7), "model.layers.7.mlp.router.weight");
  EXPECT_EQ(gpt_oss_router_bias_name(7), "model.layers.7.mlp.router.bias");
}

// Sizes worked out by hand from weights.h's table.
TEST(RandomWeights, GptOssPlanSaysTheBytes) {
  // oss_spec, per layer: router 4*160*2 = 1280, bias 8; gate_up blocks 4*192*5*16 = 61440, scales
  // 3840, bias 4*192*2 = 1536; down blocks 4*160*3*16 = 30720, scales 1920, bias 1280.
  const RandomWeightsPlan small = plan_random_weights(oss_spec(), {});
  EXPECT_EQ(small.tensor_bytes, 2u * 102024);
  EXPECT_EQ(small.shards[0].tensors[0].name, "model.layers.0.mlp.router.weight");
  // gpt-oss-20b, one layer: 423,751,744 B (of which blocks 398 MB); gpt-oss-120b, 36 layers: 61.0 GB.
  EXPECT_EQ(plan_random_weights(load_model_spec("gpt-oss-20b"), {.num_layers = 1}).tensor_bytes, 423751744u);
  EXPECT_EQ(plan_random_weights(load_model_spec("gpt-oss-120b"), {}).tensor_bytes, 61020251136u);
  expect_error([&] { plan_random_weights(oss_spec(), {.first_expert = 1, .num_experts = 2}); },
               {"experts [1, 3) of model 'oss-test'", "holds all 4 experts of a layer in one tensor"});
}

// Generate, load, and compare every loaded value with the file's, both decoded here: gate rows from
// the file's even rows, up rows from its odd rows, the padding zero, biases de-interleaved alike.
TEST(RandomWeights, GptOssWriteThenLoadValueByValue) {
  const fs::path dir = test_dir();
  const ModelSpec spec = oss_spec();
  write_random_weights(spec, {.seed = 7, .max_shard_bytes = 40000}, dir.string());
  const Checkpoint ckpt = Checkpoint::open(dir.string());
  EXPECT_EQ(ckpt.tensor_names().size(), 2u * 8);
  EXPECT_EQ(ckpt.info(gpt_oss_expert_tensor_name(1, "gate_up_proj", "blocks")).dtype, Dtype::kU8);
  EXPECT_EQ(ckpt.info(gpt_oss_expert_tensor_name(1, "gate_up_proj", "blocks")).shape, (std::vector<int64_t>{4, 192, 5, 16}));
  EXPECT_EQ(ckpt.info(gpt_oss_expert_tensor_name(1, "down_proj", "scales")).shape, (std::vector<int64_t>{4, 160, 3}));
  EXPECT_EQ(ckpt.info(gpt_oss_expert_tensor_name(1, "down_proj", "bias")).dtype, Dtype::kBF16);
  EXPECT_EQ(ckpt.file_of(gpt_oss_expert_tensor_name(1, "down_proj", "blocks")).path(),
            ckpt.file_of(gpt_oss_expert_tensor_name(1, "down_proj", "scales")).path());

  const int layer = 1, first = 1, e_loc = 2, hidden = 160, inter = 96, hidden_p = 256, inter_p = 128;
  const MoeLayerWeights w = load_moe_layer(ckpt, spec, layer, first, e_loc);
  ASSERT_TRUE(w.is_mxfp4());
  EXPECT_EQ(w.num_local_experts(), 2);
  EXPECT_EQ(w.padded_hidden, hidden_p);
  EXPECT_EQ(w.padded_intermediate, inter_p);
  // The sizes the GPU layer and the benchmarks take from the spec alone are the loaded ones.
  EXPECT_EQ(loaded_expert_sizes(spec).hidden, hidden_p);
  EXPECT_EQ(loaded_expert_sizes(spec).intermediate, inter_p);
  EXPECT_EQ(loaded_expert_sizes(small_spec()).hidden, small_spec().hidden_size);
  EXPECT_EQ(loaded_expert_sizes(small_spec()).intermediate, small_spec().moe_intermediate_size);
  EXPECT_TRUE(w.w1.w.empty() && !w.has_shared_experts());
  const Mxfp4ExpertWeights &w1 = w.w1_mxfp4, &w2 = w.w2_mxfp4;
  ASSERT_EQ(w1.layout.n, 2 * inter_p);
  ASSERT_EQ(w1.layout.k, hidden_p);
  ASSERT_EQ(w2.layout.n, hidden_p);
  ASSERT_EQ(w2.layout.k, inter_p);
  ASSERT_EQ(w1.bias.size(), size_t(e_loc) * 2 * inter_p);
  ASSERT_EQ(w2.bias.size(), size_t(e_loc) * hidden_p);
  const std::string b1 = gpt_oss_expert_tensor_name(layer, "gate_up_proj", "bias"), b2 = gpt_oss_expert_tensor_name(layer, "down_proj", "bias");
  size_t nonzero = 0;
  for (int i = 0; i < e_loc; ++i) {
    const int e = first + i;
    for (int n = 0; n < 2 * inter_p; ++n) {
      const bool up = n >= inter_p;
      const int j = up ? n - inter_p : n;  // intermediate column
      const int64_t file_row = 2 * j + (up ? 1 : 0);
      const uint8_t* row = &w1.w[w1.layout.w_offset(i, n)];
      const uint8_t* scales = &w1.scales[w1.layout.scale_offset(i, n)];
      for (int c = 0; c < hidden_p; ++c) {
        const double want = j < inter && c < hidden ? file_value(ckpt, layer, "gate_up_proj", e, file_row, c) : 0.0;
        ASSERT_EQ(mxfp4_value(row, scales, c), want) << "expert " << e << " W1 row " << n << " col " << c;
        nonzero += want != 0.0;
      }
      const double want_bias = j < inter ? bf16_tensor_value(ckpt, b1, size_t(e) * 2 * inter + size_t(file_row)) : 0.0;
      ASSERT_EQ(double(w1.bias[size_t(i) * 2 * inter_p + n]), want_bias) << "expert " << e << " W1 bias " << n;
    }
    for (int n = 0; n < hidden_p; ++n) {
      for (int c = 0; c < inter_p; ++c) {
        const double want = n < hidden && c < inter ? file_value(ckpt, layer, "down_proj", e, n, c) : 0.0;
        ASSERT_EQ(mxfp4_value(&w2.w[w2.layout.w_offset(i, n)], &w2.scales[w2.layout.scale_offset(i, n)], c), want)
            << "expert " << e << " W2 row " << n << " col " << c;
      }
      const double want_bias = n < hidden ? bf16_tensor_value(ckpt, b2, size_t(e) * hidden + n) : 0.0;
      ASSERT_EQ(double(w2.bias[size_t(i) * hidden_p + n]), want_bias) << "expert " << e << " W2 bias " << n;
    }
  }
  EXPECT_GT(nonzero, size_t(e_loc) * 2 * inter * hidden * 9 / 10);  // the real part is not zero
  // Padding blocks carry the unit scale.
  EXPECT_EQ(w1.scales[w1.layout.scale_offset(0, 0) + hidden / 32], kMxfp4UnitScale);
  EXPECT_EQ(w2.scales[w2.layout.scale_offset(0, hidden)], kMxfp4UnitScale);
  ASSERT_EQ(w.router_weight.size(), 4u * hidden);
  ASSERT_EQ(w.router_logit_bias.size(), 4u);
  for (size_t i = 0; i < w.router_weight.size(); ++i)
    ASSERT_EQ(double(w.router_weight[i]), bf16_tensor_value(ckpt, gpt_oss_router_weight_name(layer), i));
  for (size_t e = 0; e < 4; ++e)
    EXPECT_EQ(double(w.router_logit_bias[e]), bf16_tensor_value(ckpt, gpt_oss_router_bias_name(layer), e));
  EXPECT_TRUE(w.router_bias.empty());  // no DeepSeek-style selection bias
}

// N(0, 1/fan_in) before quantisation, quantised per 32 by the OCP rule: each block's largest |code| is 4 or 6.
TEST(RandomWeights, GptOssValuesHaveTheIntendedScale) {
  const fs::path dir = test_dir();
  ModelSpec spec = oss_spec();
  spec.hidden_size = 512;
  spec.moe_intermediate_size = 256;
  spec.num_moe_layers = 1;
  write_random_weights(spec, {.seed = 3}, dir.string());
  const Checkpoint ckpt = Checkpoint::open(dir.string());
  for (auto [proj, rows, cols] : {std::tuple{"gate_up_proj", 512, 512}, {"down_proj", 512, 256}}) {
    const std::string blocks = gpt_oss_expert_tensor_name(0, proj, "blocks");
    auto b = ckpt.bytes(blocks, Dtype::kU8, ckpt.info(blocks).shape);
    double sumsq = 0;
    for (int e = 0; e < 4; ++e)
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) sumsq += std::pow(file_value(ckpt, 0, proj, e, r, c), 2);
    // MXFP4's rounding adds about 10% of noise variance to the N(0, 1/fan_in) values.
    EXPECT_NEAR(std::sqrt(sumsq / (4.0 * rows * cols) * cols), 1.0, 0.08) << proj;
    for (size_t block = 0; block < b.size() / 16; ++block) {
      int largest = 0;
      for (int i = 0; i < 16; ++i) largest = std::max({largest, b[block * 16 + i] & 7, (b[block * 16 + i] >> 4) & 7});
      ASSERT_TRUE(largest == 6 || largest == 7) << proj << " block " << block;
    }
  }
}

// The experts of an MXFP4 tensor are drawn on several threads, each from its own stream: two
// writes give the same bytes (no race), and no two experts share a stream.
TEST(RandomWeights, GptOssExpertsDrawnInParallelAreDeterministicAndDistinct) {
  const fs::path dir = test_dir();
  const ModelSpec spec = oss_spec();
  write_random_weights(spec, {.num_layers = 1, .seed = 5}, (dir / "a").string());
  write_random_weights(spec, {.num_layers = 1, .seed = 5}, (dir / "b").string());
  for (const auto& entry : fs::directory_iterator(dir / "a"))
    EXPECT_EQ(read_file(entry.path()), read_file(dir / "b" / entry.path().filename())) << entry.path();
  const Checkpoint ckpt = Checkpoint::open((dir / "a").string());
  for (const char* proj : {"gate_up_proj", "down_proj"}) {
    const std::string blocks = gpt_oss_expert_tensor_name(0, proj, "blocks");
    const TensorInfo& info = ckpt.info(blocks);
    auto b = ckpt.bytes(blocks, Dtype::kU8, info.shape);
    const size_t per_expert = b.size() / size_t(info.shape[0]);
    for (int64_t e = 1; e < info.shape[0]; ++e)
      EXPECT_NE(std::memcmp(b.data(), b.data() + size_t(e) * per_expert, per_expert), 0) << proj << " expert " << e;
  }
}

TEST(LoadMoeLayer, BadGptOssCheckpointsAreClearErrors) {
  const fs::path dir = test_dir();
  const ModelSpec spec = oss_spec();
  write_random_weights(spec, {.num_layers = 1, .seed = 1, .max_shard_bytes = 20000}, (dir / "gen").string());
  const Checkpoint gen = Checkpoint::open((dir / "gen").string());
  EXPECT_NO_THROW(load_moe_layer(gen, spec, 0, 0, 4));
  auto variant = [&](const std::string& file, const std::function<std::optional<TensorDecl>(const std::string&)>& edit,
                     const std::vector<uint8_t>& bytes = {}) {
    rewrite_checkpoint(gen, dir / file, edit, bytes);
    return Checkpoint::open((dir / file).string());
  };
  using D = std::optional<TensorDecl>;
  const std::string gu_blocks = gpt_oss_expert_tensor_name(0, "gate_up_proj", "blocks"),
                    gu_scales = gpt_oss_expert_tensor_name(0, "gate_up_proj", "scales"),
                    down_bias = gpt_oss_expert_tensor_name(0, "down_proj", "bias"), router = gpt_oss_router_weight_name(0),
                    router_bias = gpt_oss_router_bias_name(0);
  auto drop = [&](const std::string& name) { return [name](const std::string& n) { return n == name ? D(TensorDecl{}) : D(); }; };
  auto bytes_of = [&](const std::string& name) {
    auto b = gen.bytes(name, gen.info(name).dtype, gen.info(name).shape);
    return std::vector<uint8_t>(b.begin(), b.end());
  };

  for (const std::string& name : {gu_blocks, gu_scales, down_bias, router, router_bias}) {
    const Checkpoint c = variant("missing.safetensors", drop(name));
    expect_error([&] { load_moe_layer(c, spec, 0, 0, 4); }, {"tensor '" + name + "' not found in checkpoint"});
  }
  // A spec without biases does not read them.
  ModelSpec no_bias = spec;
  no_bias.expert_bias = false;
  no_bias.router.logit_bias = false;
  const Checkpoint without = variant("without.safetensors", [&](const std::string& n) {
    return n.ends_with("_bias") || n == router_bias ? D(TensorDecl{}) : D();
  });
  const MoeLayerWeights plain = load_moe_layer(without, no_bias, 0, 0, 4);
  EXPECT_TRUE(plain.w1_mxfp4.bias.empty() && plain.router_logit_bias.empty());

  const Checkpoint shape = variant("shape.safetensors", [&](const std::string& n) {
    return n == gu_blocks ? D(TensorDecl{gu_blocks, Dtype::kU8, {4, 192, 6, 16}}) : D();
  }, std::vector<uint8_t>(4 * 192 * 6 * 16));
  expect_error([&] { load_moe_layer(shape, spec, 0, 0, 4); },
               {"tensor '" + gu_blocks + "' in '", "expected dtype U8 shape [4, 192, 5, 16], got U8 [4, 192, 6, 16]"});
  const Checkpoint dtype = variant("dtype.safetensors", [&](const std::string& n) {
    return n == gu_scales ? D(TensorDecl{gu_scales, Dtype::kI8, {4, 192, 5}}) : D();
  }, bytes_of(gu_scales));
  expect_error([&] { load_moe_layer(dtype, spec, 0, 0, 4); }, {"expected dtype U8 shape [4, 192, 5], got I8 [4, 192, 5]"});
  const Checkpoint f16 = variant("f16.safetensors", [&](const std::string& n) {
    return n == down_bias ? D(TensorDecl{down_bias, Dtype::kF16, {4, 160}}) : D();
  }, bytes_of(down_bias));
  expect_error([&] { load_moe_layer(f16, spec, 0, 0, 4); },
               {"tensor '" + down_bias + "' in '", "expected dtype BF16 or F32 shape [4, 160], got F16 [4, 160]"});

  // A NaN scale byte (255) at expert 2, row 7, block 1; and 253, whose 6 would overflow fp32.
  for (uint8_t bad : {uint8_t(255), uint8_t(253)}) {
    std::vector<uint8_t> scales = bytes_of(gu_scales);
    scales[(2 * 192 + 7) * 5 + 1] = bad;
    const Checkpoint c = variant("scale.safetensors", [&](const std::string& n) {
      return n == gu_scales ? D(TensorDecl{gu_scales, Dtype::kU8, {4, 192, 5}}) : D();
    }, scales);
    expect_error([&] { load_moe_layer(c, spec, 0, 0, 4); },
                 {"tensor '" + gu_scales + "'", fmt::format("expert 2 row 7 block 1 holds the e8m0 byte {}", bad), "at most 252"});
    EXPECT_NO_THROW(load_moe_layer(c, spec, 0, 3, 1));  // expert 3 alone is fine
  }
  // A NaN bias (F32 here: BF16 biases widen, F32 ones are read as they are).
  std::vector<float> nan_bias(4 * 160, 0.5f);
  nan_bias[1 * 160 + 9] = std::nanf("");
  const Checkpoint nan = variant("nan.safetensors", [&](const std::string& n) {
    return n == down_bias ? D(TensorDecl{down_bias, Dtype::kF32, {4, 160}}) : D();
  }, std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(nan_bias.data()), reinterpret_cast<const uint8_t*>(nan_bias.data() + nan_bias.size())));
  expect_error([&] { load_moe_layer(nan, spec, 0, 0, 4); }, {"tensor '" + down_bias + "'", "element [1, 9] holds nan, expected a finite bias"});
  EXPECT_EQ(load_moe_layer(nan, spec, 0, 2, 2).w2_mxfp4.bias[0], 0.5f);

  // A model whose sizes are not the file's, and a truncated shard.
  ModelSpec wider = spec;
  wider.hidden_size = 192;
  expect_error([&] { load_moe_layer(gen, wider, 0, 0, 4); }, {"expected dtype U8 shape [4, 192, 6, 16], got U8 [4, 192, 5, 16]"});
  ModelSpec odd = spec;
  odd.hidden_size = 170;
  expect_error([&] { load_moe_layer(gen, odd, 0, 0, 4); }, {"hidden_size = 170 is not a multiple of 32"});
  expect_error([&] { load_moe_layer(gen, spec, 0, 3, 2); }, {"experts [3, 5) must be a non-empty range inside [0, 4)"});
  const Checkpoint one = variant("one.safetensors", [](const std::string&) { return D(); });
  const fs::path file = dir / "one.safetensors";
  fs::resize_file(file, fs::file_size(file) - 100);
  expect_error([&] { load_moe_layer(Checkpoint::open(file.string()), spec, 0, 0, 4); }, {file.string(), "truncated"});
}
