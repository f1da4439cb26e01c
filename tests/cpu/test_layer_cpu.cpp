// The CPU MoE layer (layer_cpu.h) end to end, on weights written by the random checkpoint
// generator and read back by the loader, for a DeepSeek-style FP8 model and a gpt-oss-style MXFP4
// one: output against the float64 oracle for P in {1, 2, 4, 8}, both protocols, with and without
// redundant experts; the MXFP4 oracle against gpt-oss's block computed from the file's tensors; FP8 payloads, scales and expert outputs the
// same bits as one rank; the distinct-target count equal to the simulator's on the same routing;
// bad input rejected.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <random>
#include <tuple>

#include <unistd.h>

#include "expect_error.h"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/eplb.h"
#include "moekit/fp8.h"
#include "moekit/gating.h"
#include "moekit/layer_cpu.h"
#include "moekit/quant.h"
#include "moekit/rebalance.h"
#include "moekit/reference.h"
#include "moekit/simulate.h"
#include "moekit/weights.h"
#include "oss_test_model.h"

using namespace moekit;
namespace fs = std::filesystem;

namespace {

// A small DeepSeek-style model: sigmoid router with bias, 4 groups keep 2, one shared expert.
const char* kModelJson = R"({
  "name": "test-moe", "hidden_size": 256, "num_layers": 1, "num_moe_layers": 1,
  "moe_intermediate_size": 128, "num_routed_experts": 16, "num_experts_per_token": 4,
  "num_shared_experts": 1, "shared_intermediate_size": 128,
  "total_params": 1e7, "active_params": 1e6, "weight_bytes_per_param": 1.0, "kv_bytes_per_token": 1024,
  "router": {"scoring": "sigmoid", "num_groups": 4, "topk_groups": 2, "routed_scaling_factor": 2.5, "normalize_topk": true}
})";
using moekit::testing_models::kOssModelJson;  // the gpt-oss-style model (tests/oss_test_model.h)
constexpr int kTokens = 48;  // B, all ranks together
// The MXFP4 layer's bound against the oracle (docs/layer.md): three bf16 roundings the oracle does
// not make (each expert's y, each rank's partial sum, the output), each with an RMS relative error
// of at most 2^-8/sqrt(3) (half an ulp, uniform, over a mantissa >= 1): sqrt(3) * 2^-8/sqrt(3).
// Measured 2.4e-3 (P = 1: two roundings) to 2.94e-3; without a shared expert every output value
// takes all three, which puts gpt-oss closer to it than the DeepSeek-style model's 3e-3.
constexpr double kOssBound = 0x1p-8;

// The model, its checkpoint written once by the generator and loaded back, and B random tokens.
struct Fixture {
  ModelSpec model;
  // One directory per process: ctest runs the cases of this file as parallel processes.
  fs::path dir;
  MoeLayerWeights weights;
  std::vector<uint16_t> x;  // [B, d] bf16

  Fixture(const char* json, const char* tag)
      : model(parse_model_spec(json, tag)),
        dir(fs::path(MOEKIT_BINARY_DIR) / fmt::format("test_layer_cpu_{}_weights.{}", tag, getpid())) {
    fs::remove_all(dir);
    RandomWeightsOptions opt;
    opt.seed = 42;
    write_random_weights(model, opt, dir.string());
    weights = load_moe_layer(Checkpoint::open(dir.string()), model, 0, 0, model.num_routed_experts);
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    x.resize(size_t(kTokens) * model.hidden_size);
    for (auto& v : x) v = float_to_bf16(normal(rng));
  }
  ~Fixture() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

const Fixture& fixture() {
  static const Fixture f(kModelJson, "test");
  return f;
}

const Fixture& oss_fixture() {
  static const Fixture f(kOssModelJson, "oss");
  return f;
}

// The DeepSeek-style FP8 model with gpt-oss's clamped SwiGLU: the model's activation is also its
// shared expert's.
const char* kClampedModelJson = R"({
  "name": "test-moe-clamped", "hidden_size": 256, "num_layers": 1, "num_moe_layers": 1,
  "moe_intermediate_size": 128, "num_routed_experts": 16, "num_experts_per_token": 4,
  "num_shared_experts": 1, "shared_intermediate_size": 128,
  "total_params": 1e7, "active_params": 1e6, "weight_bytes_per_param": 1.0, "kv_bytes_per_token": 1024,
  "router": {"scoring": "sigmoid", "num_groups": 4, "topk_groups": 2, "routed_scaling_factor": 2.5, "normalize_topk": true},
  "activation": {"kind": "clamped_swiglu", "alpha": 1.702, "limit": 7.0}
})";

int first_token(int rank, int num_ranks, int num_tokens) { return (rank * num_tokens + num_ranks - 1) / num_ranks; }

// One layer step over P ranks on the fixture's B tokens.
struct LayerRun {
  std::vector<uint16_t> out;            // [B, d] bf16
  std::vector<int32_t> topk_idx;        // [B, k] logical, as the layer chose
  std::vector<float> topk_weights;
  // (global token, logical expert) -> the FP8 row, its scales and the expert's bf16 output row.
  std::map<std::pair<int, int>, std::vector<uint8_t>> rows;
  int64_t messages = 0;  // dispatch messages over all ranks
  Fp8Scaling scaling = Fp8Scaling::kPerBlock;  // the layer's x_scaling()
};

LayerRun run_layer(int p, EpProtocol protocol, const Placement& placement, const std::vector<int32_t>* routing_idx = nullptr,
              const std::vector<float>* routing_w = nullptr, const Fixture& f = fixture()) {
  const int d = int(f.model.hidden_size), k = f.model.num_experts_per_token, B = kTokens;
  CpuLayerConfig cfg;
  cfg.num_ranks = p;
  cfg.max_tokens = (B + p - 1) / p;
  cfg.protocol = protocol;
  cfg.block_m = 8;
  CpuMoeLayer layer(f.model, f.weights, placement, 0, cfg);
  LocalEpGroup group(layer.ep_config());
  LayerRun run;
  run.scaling = layer.x_scaling();
  run.out.assign(size_t(B) * d, 0);
  run_ranks(group, [&](int r) {
    const int t0 = first_token(r, p, B), t1 = first_token(r + 1, p, B);
    layer.forward(group, r, t1 - t0, t0, f.x.data() + size_t(t0) * d, run.out.data() + size_t(t0) * d,
                  routing_idx ? routing_idx->data() + size_t(t0) * k : nullptr,
                  routing_w ? routing_w->data() + size_t(t0) * k : nullptr);
  });
  // The receive side holds rows of the GEMMs' hidden size (MXFP4: padded to 128).
  const int e_loc = layer.num_local_experts(), d_p = layer.ep_config().hidden, kb = d_p / 128;
  for (int r = 0; r < p; ++r) {
    const RankStep& st = layer.last_step(r);
    run.topk_idx.insert(run.topk_idx.end(), st.topk_idx.begin(), st.topk_idx.end());
    run.topk_weights.insert(run.topk_weights.end(), st.topk_weights.begin(), st.topk_weights.end());
    run.messages += st.ep.dispatch_messages;
    const auto buf = layer.buffers(r);
    auto add_row = [&](int e, int row, size_t scale_index, size_t scale_stride) {
      const int code = buf.recv_src[row];
      const int src = code / cfg.max_tokens, token = code % cfg.max_tokens;
      const int global = first_token(src, p, B) + token;
      const int logical = placement.phy2log_row(0)[r * e_loc + e];
      std::vector<uint8_t> bytes(buf.recv_x + size_t(row) * d_p, buf.recv_x + size_t(row + 1) * d_p);
      for (int b = 0; b < kb; ++b) {
        const float s = buf.recv_scales[scale_index + b * scale_stride];
        bytes.insert(bytes.end(), reinterpret_cast<const uint8_t*>(&s), reinterpret_cast<const uint8_t*>(&s) + 4);
      }
      const uint8_t* y = reinterpret_cast<const uint8_t*>(buf.y + size_t(row) * d_p);
      bytes.insert(bytes.end(), y, y + 2 * d_p);
      EXPECT_TRUE(run.rows.emplace(std::make_pair(global, logical), bytes).second) << "pair delivered twice";
    };
    if (protocol == EpProtocol::kLowLatency) {
      for (int e = 0; e < e_loc; ++e)
        for (int m = 0; m < st.recv_count[e]; ++m)  // masked layout: scales [E_loc, d/128, M_max]
          add_row(e, e * buf.rows + m, size_t(e) * kb * buf.rows + m, size_t(buf.rows));
    } else {
      // The contiguous GEMM's contract: segments padded to block_m, one expert per block.
      ref::check_contiguous_segments(buf.row_expert, buf.rows, cfg.block_m, e_loc);
      for (int m = 0; m < buf.rows; ++m)  // contiguous: scales [d/128, M_total]
        if (buf.row_expert[m] >= 0) add_row(buf.row_expert[m], m, size_t(m), size_t(buf.rows));
    }
  }
  return run;
}

// The float64 oracle on all B tokens with the given routing.
std::vector<double> oracle(const std::vector<int32_t>& topk_idx, const std::vector<float>& topk_weights,
                           const Fixture& f = fixture(), Fp8Scaling scaling = Fp8Scaling::kPerBlock) {
  const LayerOracle o(f.model, f.weights);
  std::vector<float> xf(f.x.size());
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_float(f.x[i]);
  std::vector<double> out(f.x.size());
  o.run(xf.data(), kTokens, topk_idx.data(), topk_weights.data(), out.data(), scaling);
  return out;
}

double error_vs_oracle(const LayerRun& run, const Fixture& f = fixture()) {
  const auto want = oracle(run.topk_idx, run.topk_weights, f, run.scaling);
  std::vector<double> got(run.out.size());
  for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_float(run.out[i]);
  return ref::relative_frobenius_error(got.data(), want.data(), got.size());
}

// Expected loads that make EPLB replicate experts 0..3 (hot), so replicas do serve tokens.
Placement redundant_placement(int p) {
  std::vector<double> load(16, 1.0);
  for (int e = 0; e < 4; ++e) load[e] = 8.0;
  return balanced_placement(load, 16, p);
}

const LayerRun& one_rank_reference() {
  static const LayerRun run = run_layer(1, EpProtocol::kLowLatency, identity_placement(16, 1));
  return run;
}

}  // namespace

std::string layer_case_name(const ::testing::TestParamInfo<std::tuple<int, EpProtocol, bool>>& info) {
  const int p = std::get<0>(info.param);
  const bool low_latency = std::get<1>(info.param) == EpProtocol::kLowLatency, redundant = std::get<2>(info.param);
  return fmt::format("P{}_{}{}", p, low_latency ? "LowLatency" : "Normal", redundant ? "_Redundant" : "");
}

class LayerRanks : public ::testing::TestWithParam<std::tuple<int, EpProtocol, bool>> {};

TEST_P(LayerRanks, MatchesOracleAndOneRankBitForBit) {
  const auto [p, protocol, redundant] = GetParam();
  const Fixture& f = fixture();
  const Placement placement = redundant ? redundant_placement(p) : identity_placement(16, p);
  const LayerRun run = run_layer(p, protocol, placement);

  // The gate, computed here on all tokens at once, picks what the ranks picked.
  const int d = int(f.model.hidden_size), k = f.model.num_experts_per_token, E = f.model.num_routed_experts;
  std::vector<float> xf(f.x.size()), logits(size_t(kTokens) * E), w(size_t(kTokens) * k);
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_float(f.x[i]);
  std::vector<int32_t> idx(size_t(kTokens) * k);
  ref::router_logits(xf.data(), kTokens, d, f.weights.router_weight.data(), E, logits.data());
  ref::select_experts(logits.data(), kTokens, E, k, f.model.router, f.weights.router_bias.data(), idx.data(), w.data());
  ASSERT_EQ(run.topk_idx, idx);
  ASSERT_EQ(run.topk_weights, w);

  const double err = error_vs_oracle(run);
  RecordProperty("relative_error", std::to_string(err));
  EXPECT_LE(err, 3e-3) << "relative Frobenius error against the float64 oracle";
  EXPECT_GT(err, 0.0);  // bf16 outputs cannot match float64 exactly: a zero means the oracle was not compared

  // Every (token, logical expert) pair once, with the same FP8 bytes, scales and expert output as one rank.
  const LayerRun& one = one_rank_reference();
  EXPECT_EQ(run.rows.size(), size_t(kTokens) * k);
  EXPECT_TRUE(run.rows == one.rows) << "payloads, scales or expert outputs differ from P = 1";
  if (redundant) {
    // The placement has replicas of the hot experts, and tokens reached more than one of them.
    EXPECT_EQ(placement.num_slots, 32);
    EXPECT_GT(placement.max_replicas, 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Layer, LayerRanks,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(EpProtocol::kLowLatency, EpProtocol::kNormal),
                                            ::testing::Bool()),
                         layer_case_name);

// A layer of MXFP4 experts refuses moves (they would need its scale words and biases moved too,
// and the GPU layer moves none while serving), naming the model, and keeps serving.
TEST(Layer, Mxfp4LayerRefusesMoves) {
  const Fixture& f = oss_fixture();
  const int p = 4;
  std::vector<double> load(16, 1.0);
  for (int e = 8; e < 12; ++e) load[e] = 8.0;
  const Placement before = redundant_placement(p), after = balanced_placement(load, 16, p);
  const std::vector<ExpertMove> moves = plan_moves(before, after);
  ASSERT_FALSE(moves.empty());
  CpuLayerConfig cfg;
  cfg.num_ranks = p;
  cfg.max_tokens = kTokens / p;
  CpuMoeLayer layer(f.model, f.weights, before, 0, cfg);
  expect_error([&] { layer.apply_moves(after, moves); }, {"MXFP4", f.model.name});
}

// An FP8 model with another activation than SiLU·up: the routed and the shared experts both take
// it (with SiLU·up in the shared expert the CPU layer read 0.43 from the oracle).
TEST(Layer, Fp8ModelWithClampedSwigluMatchesOracle) {
  const Fixture f(kClampedModelJson, "clamped");
  for (const EpProtocol protocol : {EpProtocol::kLowLatency, EpProtocol::kNormal}) {
    const LayerRun run = run_layer(2, protocol, identity_placement(16, 2), nullptr, nullptr, f);
    const double err = error_vs_oracle(run, f);
    EXPECT_LE(err, 3e-3) << (protocol == EpProtocol::kLowLatency ? "low latency" : "normal");
    EXPECT_GT(err, 0.0);
  }
}

// With replicas, hot experts' tokens are spread over several slots (several ranks).
TEST(Layer, ReplicasServeTokens) {
  const int p = 4;
  const Placement placement = redundant_placement(p);
  const Fixture& f = fixture();
  CpuLayerConfig cfg;
  cfg.num_ranks = p;
  cfg.max_tokens = kTokens / p;
  CpuMoeLayer layer(f.model, f.weights, placement, 0, cfg);
  LocalEpGroup group(layer.ep_config());
  // Every token picks the hot experts 0..3.
  std::vector<int32_t> idx(size_t(kTokens) * 4);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = int32_t(i % 4);
  std::vector<float> w(idx.size(), 0.25f);
  std::vector<uint16_t> out(f.x.size());
  const int d = int(f.model.hidden_size);
  run_ranks(group, [&](int r) {
    const int t0 = r * kTokens / p;
    layer.forward(group, r, kTokens / p, t0, f.x.data() + size_t(t0) * d, out.data() + size_t(t0) * d,
                  idx.data() + size_t(t0) * 4, w.data() + size_t(t0) * 4);
  });
  std::map<int, std::set<int>> slots_of_expert;
  for (int r = 0; r < p; ++r)
    for (size_t i = 0; i < layer.last_step(r).topk_slot.size(); ++i)
      slots_of_expert[layer.last_step(r).topk_idx[i]].insert(layer.last_step(r).topk_slot[i]);
  for (int e = 0; e < 4; ++e) {
    EXPECT_GE(int(slots_of_expert[e].size()), 2) << "expert " << e;
    EXPECT_LE(int(slots_of_expert[e].size()), placement.replica_count_row(0)[e]) << "expert " << e;
    for (int s : slots_of_expert[e]) EXPECT_EQ(placement.phy2log_row(0)[s], e);
  }
  LayerRun r;
  r.out = out;
  r.topk_idx = idx;
  r.topk_weights = w;
  EXPECT_LE(error_vs_oracle(r), 3e-3);
}

// apply_moves() between two steps gives the layer a fresh layer's weights for the new
// placement: the same step afterwards has the same output bits. A move with a wrong source is
// refused and the layer keeps serving the old placement.
TEST(Layer, MovesBetweenStepsEqualAFreshLayer) {
  const int p = 4;
  const Fixture& f = fixture();
  const int d = int(f.model.hidden_size), inter = int(f.model.moe_intermediate_size);
  std::vector<double> load(16, 1.0);
  for (int e = 8; e < 12; ++e) load[e] = 8.0;
  const Placement before = redundant_placement(p), after = balanced_placement(load, 16, p);
  const std::vector<ExpertMove> moves = plan_moves(before, after);
  ASSERT_GT(moves.size(), 4u);
  CpuLayerConfig cfg;
  cfg.num_ranks = p;
  cfg.max_tokens = kTokens / p;
  auto step = [&](CpuMoeLayer& layer) {
    LocalEpGroup group(layer.ep_config());
    std::vector<uint16_t> out(f.x.size());
    run_ranks(group, [&](int r) {
      const int t0 = r * kTokens / p;
      layer.forward(group, r, kTokens / p, t0, f.x.data() + size_t(t0) * d, out.data() + size_t(t0) * d);
    });
    return out;
  };
  CpuMoeLayer fresh_before(f.model, f.weights, before, 0, cfg), fresh_after(f.model, f.weights, after, 0, cfg);
  CpuMoeLayer layer(f.model, f.weights, before, 0, cfg);
  const std::vector<uint16_t> out_before = step(layer);
  EXPECT_EQ(out_before, step(fresh_before));
  std::vector<int32_t> slots_before;
  for (int r = 0; r < p; ++r)
    slots_before.insert(slots_before.end(), layer.last_step(r).topk_slot.begin(), layer.last_step(r).topk_slot.end());

  std::vector<ExpertMove> wrong = moves;
  while (before.phy2log_row(0)[wrong.back().src_slot] == wrong.back().expert)
    wrong.back().src_slot = (wrong.back().src_slot + 1) % before.num_slots;
  wrong.back().src_gpu = wrong.back().src_slot / before.slots_per_gpu();
  EXPECT_THROW(layer.apply_moves(after, wrong), Error);
  EXPECT_EQ(step(layer), out_before);  // nothing changed

  const int64_t bytes = layer.apply_moves(after, moves);
  const int64_t per_expert = 3 * int64_t(inter) * d + 3 * int64_t(inter / 128) * (d / 128) * 4;
  EXPECT_EQ(bytes, int64_t(moves.size()) * per_expert);
  const std::vector<uint16_t> out_after = step(layer);
  EXPECT_EQ(out_after, step(fresh_after));
  std::vector<int32_t> slots_after;
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(layer.last_step(r).topk_slot, fresh_after.last_step(r).topk_slot);
    slots_after.insert(slots_after.end(), layer.last_step(r).topk_slot.begin(), layer.last_step(r).topk_slot.end());
  }
  EXPECT_NE(slots_after, slots_before);  // the step did run on other slots
}

// The layer's measured distinct-target count, on the simulator's own routing samples, equals the
// simulator's estimate (the same mean over tokens, then over steps).
TEST(Layer, DistinctTargetsEqualTheSimulators) {
  const Fixture& f = fixture();
  SimulateInput sim;
  sim.num_experts = 16;
  sim.topk = 4;
  sim.num_ranks = 4;
  sim.batch = kTokens;
  sim.trials = 3;
  sim.seed = 11;
  sim.routing = parse_routing("zipf:1.2");
  sim.num_threads = 1;
  const SimulateResult res = simulate(sim);
  double measured = 0;
  for (int64_t step = 0; step < sim.trials; ++step) {
    const std::vector<int32_t> idx = sample_step(sim, step);
    const std::vector<float> w(idx.size(), 2.5f / 4);
    const LayerRun run = run_layer(4, EpProtocol::kLowLatency, identity_placement(16, 4), &idx, &w);
    measured += double(run.messages) / kTokens / double(sim.trials);
    EXPECT_LE(error_vs_oracle(run), 3e-3);
    (void)f;
  }
  EXPECT_NEAR(measured, res.dedup_targets.simulated, 1e-12);
  EXPECT_LT(measured, 4.0);  // de-duplication happened: fewer messages than k per token
}

TEST(Layer, BadInputIsRejected) {
  const Fixture& f = fixture();
  const int p = 2, d = int(f.model.hidden_size);
  CpuLayerConfig cfg;
  cfg.num_ranks = p;
  cfg.max_tokens = 8;
  cfg.timeout_s = 30;
  CpuMoeLayer layer(f.model, f.weights, identity_placement(16, p), 0, cfg);
  LocalEpGroup group(layer.ep_config());
  std::vector<uint16_t> out(f.x.size());

  // More tokens than T_max.
  expect_error([&] { layer.forward(group, 0, 9, 0, f.x.data(), out.data()); }, {"9 tokens", "T_max = 8"});
  // Expert ids out of range (routing given by the caller).
  std::vector<int32_t> idx(8 * 4, 1);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = int32_t(i % 4);
  idx[6] = 16;
  std::vector<float> w(idx.size(), 0.5f);
  expect_error([&] { layer.forward(group, 0, 8, 0, f.x.data(), out.data(), idx.data(), w.data()); },
               {"topk_idx[1, 2] = 16", "0..15"});
  // NaN logits: a NaN activation on rank 1 fails in its gate; rank 0 stops waiting at once and
  // the error reported is rank 1's.
  std::vector<uint16_t> xbad(f.x.begin(), f.x.begin() + 16 * d);
  xbad[size_t(8 + 3) * d + 5] = float_to_bf16(NAN);
  expect_error([&] { run_ranks(group, [&](int r) { layer.forward(group, r, 8, 8 * r, xbad.data() + size_t(8 * r) * d, out.data()); }); },
               {"token 3"});
  // K not a multiple of 128.
  ModelSpec bad = f.model;
  bad.hidden_size = 200;
  expect_error([&] { CpuMoeLayer l(bad, f.weights, identity_placement(16, p), 0, cfg); }, {"hidden_size", "200", "multiple of 128"});
  // masked_m over M_max: the GEMM that reads recv_count refuses it.
  const MaskedLayout a{1, 4, 256};
  const WeightLayout wl{1, 256, 256};
  std::vector<uint8_t> av(a.a_elems()), wv(wl.w_elems());
  std::vector<float> as(a.scale_elems(), 1.0f), ws(wl.scale_elems(), 1.0f);
  std::vector<uint16_t> o(a.out_elems(256));
  const int32_t masked_m = 5;
  expect_error([&] { ref::grouped_gemm_masked(a, av.data(), as.data(), &masked_m, wl, wv.data(), ws.data(), o.data()); },
               {"5"});
}

// The loader refuses a truncated shard and a checkpoint that does not match the spec.
TEST(Layer, BadCheckpointIsRejected) {
  const Fixture& f = fixture();
  const fs::path dir = fs::path(MOEKIT_BINARY_DIR) / fmt::format("test_layer_cpu_truncated.{}", getpid());
  fs::remove_all(dir);
  fs::copy(f.dir, dir);
  fs::path shard;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") shard = entry.path();
  ASSERT_FALSE(shard.empty());
  fs::resize_file(shard, fs::file_size(shard) - 100);
  expect_error([&] { load_moe_layer(Checkpoint::open(dir.string()), f.model, 0, 0, 16); }, {shard.filename().string()});
  // Mismatched: a spec whose experts are twice as wide as the checkpoint's.
  ModelSpec wider = f.model;
  wider.moe_intermediate_size = 256;
  expect_error([&] { load_moe_layer(Checkpoint::open(f.dir.string()), wider, 0, 0, 16); }, {"gate_proj", "256"});
  fs::remove_all(dir);
}

// ---- gpt-oss: MXFP4 experts with biases, router with bias, top-k then softmax, clamped SwiGLU ----

class OssLayerRanks : public ::testing::TestWithParam<std::tuple<int, EpProtocol, bool>> {};

TEST_P(OssLayerRanks, MatchesOracleAndOneRankBitForBit) {
  const auto [p, protocol, redundant] = GetParam();
  const Fixture& f = oss_fixture();
  const Placement placement = redundant ? redundant_placement(p) : identity_placement(16, p);
  const LayerRun run = run_layer(p, protocol, placement, nullptr, nullptr, f);

  // The ranks' gate is the router on all tokens at once: logits with the router's bias, top-4, softmax over the 4.
  const int d = int(f.model.hidden_size), k = f.model.num_experts_per_token, E = f.model.num_routed_experts;
  std::vector<float> xf(f.x.size()), logits(size_t(kTokens) * E), w(size_t(kTokens) * k);
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_float(f.x[i]);
  std::vector<int32_t> idx(size_t(kTokens) * k);
  ref::router_logits(xf.data(), kTokens, d, f.weights.router_weight.data(), E, logits.data(),
                     f.weights.router_logit_bias.data());
  ref::select_experts(logits.data(), kTokens, E, k, f.model.router, nullptr, idx.data(), w.data());
  ASSERT_EQ(run.topk_idx, idx);
  ASSERT_EQ(run.topk_weights, w);

  const double err = error_vs_oracle(run, f);
  RecordProperty("relative_error", std::to_string(err));
  EXPECT_LE(err, kOssBound) << "relative Frobenius error against the float64 oracle";
  EXPECT_GT(err, 0.0);

  // One rank of the same protocol: the normal mode scales per token, the low-latency one per 1x128.
  static const LayerRun one_ll = run_layer(1, EpProtocol::kLowLatency, identity_placement(16, 1), nullptr, nullptr, f);
  static const LayerRun one_normal = run_layer(1, EpProtocol::kNormal, identity_placement(16, 1), nullptr, nullptr, f);
  const LayerRun& one = protocol == EpProtocol::kNormal ? one_normal : one_ll;
  EXPECT_EQ(run.rows.size(), size_t(kTokens) * k);
  EXPECT_TRUE(run.rows == one.rows) << "payloads, scales or expert outputs differ from P = 1";
}

// An MXFP4 layer scales each dispatched token once (x_scaling()), in both modes: every received
// row's d/128 scales are one value, the quant.h rule over the token's whole row (under 1x128 the
// test's random rows give groups of different amax, so the rule's value tells the two apart).
TEST(Layer, OssLayerScalesPerTokenInBothModes) {
  const Fixture& f = oss_fixture();
  for (const EpProtocol protocol : {EpProtocol::kLowLatency, EpProtocol::kNormal}) {
    CpuLayerConfig cfg;
    cfg.num_ranks = 1;
    cfg.max_tokens = kTokens;
    cfg.protocol = protocol;
    CpuMoeLayer layer(f.model, f.weights, identity_placement(16, 1), 0, cfg);
    EXPECT_EQ(layer.x_scaling(), Fp8Scaling::kPerToken);
    LocalEpGroup group(layer.ep_config());
    const int d_model = int(f.model.hidden_size), d = layer.ep_config().hidden, k_blocks = d / kQuantBlock;
    ASSERT_GE(k_blocks, 2) << "the test needs rows of several 128-column groups";
    std::vector<uint16_t> out(f.x.size());
    run_ranks(group, [&](int r) { layer.forward(group, r, kTokens, 0, f.x.data(), out.data()); });
    const CpuMoeLayer::RankBuffers b = layer.buffers(0);
    // Each valid row as (its scale of group kb, its token): normal [d/128, M_total], low latency
    // [E_loc, d/128, M_max] with recv_count rows per expert.
    struct Row {
      const float* scales;
      size_t stride;
      int token;
    };
    std::vector<Row> rows;
    if (protocol == EpProtocol::kNormal) {
      for (int m = 0; m < b.rows; ++m)
        if (b.row_expert[m] >= 0) rows.push_back({b.recv_scales + m, size_t(b.rows), b.recv_src[m]});
    } else {
      const std::vector<int32_t>& count = layer.last_step(0).recv_count;
      for (size_t e = 0; e < count.size(); ++e)
        for (int m = 0; m < count[e]; ++m)
          rows.push_back({b.recv_scales + e * k_blocks * b.rows + m, size_t(b.rows), b.recv_src[e * b.rows + m]});
    }
    ASSERT_EQ(rows.size(), size_t(kTokens) * f.model.num_experts_per_token);
    int mixed = 0;  // rows whose 128-column groups have different amax: 1x128 would differ there
    for (const Row& row : rows) {
      bool same = true;
      for (int kb = 1; kb < k_blocks; ++kb) same = same && row.scales[kb * row.stride] == row.scales[0];
      EXPECT_TRUE(same) << "token " << row.token << ": its " << k_blocks << " scales differ";
      std::vector<float> group_amax(k_blocks, 0.0f);  // the padded columns are zeros
      for (int c = 0; c < d_model; ++c)
        group_amax[c / kQuantBlock] =
            std::max(group_amax[c / kQuantBlock], std::fabs(bf16_to_float(f.x[size_t(row.token) * d_model + c])));
      const float amax = *std::max_element(group_amax.begin(), group_amax.end());
      mixed += *std::min_element(group_amax.begin(), group_amax.end()) != amax;
      EXPECT_EQ(row.scales[0], std::max(amax, kMinAmax) / kFp8Max) << "token " << row.token;
    }
    EXPECT_GT(mixed, 0) << "rows of one amax in every group: the test's data cannot tell the scalings apart";
  }
}

INSTANTIATE_TEST_SUITE_P(Layer, OssLayerRanks,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(EpProtocol::kLowLatency, EpProtocol::kNormal),
                                            ::testing::Bool()),
                         layer_case_name);

// The oracle against gpt-oss's MoE block written here from the reference implementation, straight
// from the checkpoint's tensors (interleaved gate/up, unpadded, decoded with the e2m1 table and
// ldexp), with the pipeline's three activation roundings reproduced: FP8 of x (per token, as an
// MXFP4 layer quantises), the bf16 GEMM1 output, FP8 of the activation. Checks the loader's
// de-interleaving and padding, the biases, the clamps and the router together. The layer's output then agrees with both.
TEST(Layer, OssOracleIsTheReferenceBlock) {
  const Fixture& f = oss_fixture();
  const Checkpoint ckpt = Checkpoint::open(f.dir.string());
  const int d = 160, inter = 96, E = 16, k = 4, T = 6;
  constexpr double kE2m1[16] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};
  auto tensor = [&](const std::string& name) { return ckpt.bytes(name, ckpt.info(name).dtype, ckpt.info(name).shape); };
  auto bf16_at = [&](std::span<const uint8_t> b, size_t i) {
    uint16_t h;
    std::memcpy(&h, b.data() + 2 * i, 2);
    return double(bf16_to_float(h));
  };
  // Matrix `proj` [E, rows, cols] of the file, decoded.
  auto matrix = [&](const std::string& proj, int rows, int cols) {
    auto blocks = tensor(gpt_oss_expert_tensor_name(0, proj, "blocks")), scales = tensor(gpt_oss_expert_tensor_name(0, proj, "scales"));
    std::vector<double> m(size_t(E) * rows * cols);
    for (size_t i = 0; i < m.size(); ++i) {
      const uint8_t byte = blocks[i / 2];
      m[i] = kE2m1[i % 2 == 0 ? byte & 0xF : byte >> 4] * std::ldexp(1.0, int(scales[i / 32]) - 127);
    }
    return m;
  };
  const std::vector<double> gate_up = matrix("gate_up_proj", 2 * inter, d), down = matrix("down_proj", d, inter);
  auto gate_up_bias = tensor(gpt_oss_expert_tensor_name(0, "gate_up_proj", "bias")),
       down_bias = tensor(gpt_oss_expert_tensor_name(0, "down_proj", "bias")), router = tensor(gpt_oss_router_weight_name(0)),
       router_bias = tensor(gpt_oss_router_bias_name(0));
  // FP8 as the layer quantises (per token: layer_fp8_scaling) over a row zero-padded to a multiple
  // of 128 (the layer's), dequantised, cropped.
  const Fp8Scaling scaling = layer_fp8_scaling(f.model);
  ASSERT_EQ(scaling, Fp8Scaling::kPerToken);
  auto q = [&](std::vector<float> v) {
    const size_t n = v.size();
    v.resize((n + 127) / 128 * 128, 0.0f);
    std::vector<uint8_t> codes(v.size());
    std::vector<float> scales(v.size() / 128);
    quantize_row_fp8(v.data(), int(v.size()), codes.data(), scales.data(), 1, scaling);
    std::vector<double> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = double(fp8_e4m3_to_float(codes[i])) * scales[i / 128];
    return out;
  };

  std::vector<double> want(size_t(T) * d, 0.0);
  std::vector<int32_t> idx(size_t(T) * k);
  std::vector<float> weights(size_t(T) * k);
  for (int t = 0; t < T; ++t) {
    std::vector<float> xt(d);
    for (int c = 0; c < d; ++c) xt[c] = bf16_to_float(f.x[size_t(t) * d + c]);
    // Router: logits = x W^T + b, the 4 largest, softmax over them.
    std::vector<std::pair<double, int>> logits(E);
    for (int e = 0; e < E; ++e) {
      double sum = bf16_at(router_bias, size_t(e));
      for (int c = 0; c < d; ++c) sum += double(xt[c]) * bf16_at(router, size_t(e) * d + c);
      logits[e] = {double(float(sum)), -e};  // ties to the lower index
    }
    std::sort(logits.rbegin(), logits.rend());
    double norm = 0;
    for (int j = 0; j < k; ++j) norm += std::exp(logits[j].first - logits[0].first);
    const std::vector<double> xq = q(xt);
    for (int j = 0; j < k; ++j) {
      const int e = -logits[j].second;
      idx[size_t(t) * k + j] = e;
      weights[size_t(t) * k + j] = float(std::exp(logits[j].first - logits[0].first) / norm);
      // MLP 1: row 2i is the gate of column i, row 2i + 1 its up; bf16 output; the clamped SwiGLU in fp32.
      std::vector<float> act(inter);
      for (int i = 0; i < inter; ++i) {
        double h[2];
        for (int part = 0; part < 2; ++part) {
          const size_t row = size_t(e) * 2 * inter + 2 * i + part;
          double sum = bf16_at(gate_up_bias, row);
          for (int c = 0; c < d; ++c) sum += gate_up[row * d + c] * xq[c];
          h[part] = bf16_to_float(float_to_bf16(float(sum)));
        }
        const float g = std::min(float(h[0]), 1.0f), u = std::clamp(float(h[1]), -1.0f, 1.0f);
        act[i] = g / (1.0f + std::exp(-(1.702f * g))) * (u + 1.0f);
      }
      const std::vector<double> aq = q(act);
      for (int c = 0; c < d; ++c) {
        double sum = bf16_at(down_bias, size_t(e) * d + c);
        for (int i = 0; i < inter; ++i) sum += down[(size_t(e) * d + c) * inter + i] * aq[i];
        want[size_t(t) * d + c] += double(weights[size_t(t) * k + j]) * sum;
      }
    }
  }
  std::vector<float> xf(size_t(T) * d);
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_float(f.x[i]);
  std::vector<double> got(want.size());
  LayerOracle(f.model, f.weights).run(xf.data(), T, idx.data(), weights.data(), got.data(), scaling);
  EXPECT_LT(ref::relative_frobenius_error(got.data(), want.data(), want.size()), 1e-5);

  // The layer chose the same experts and weights for these tokens, and its output is within bf16 noise.
  const LayerRun run = run_layer(2, EpProtocol::kLowLatency, identity_placement(16, 2), nullptr, nullptr, f);
  EXPECT_EQ(std::vector<int32_t>(run.topk_idx.begin(), run.topk_idx.begin() + T * k), idx);
  for (int i = 0; i < T * k; ++i) EXPECT_NEAR(run.topk_weights[i], weights[i], 1e-6f) << i;
  std::vector<double> layer(want.size());
  for (size_t i = 0; i < layer.size(); ++i) layer[i] = bf16_to_float(run.out[i]);
  EXPECT_LT(ref::relative_frobenius_error(layer.data(), want.data(), want.size()), kOssBound);
}

TEST(Layer, OssBadInputIsRejected) {
  const Fixture& f = oss_fixture();
  CpuLayerConfig cfg;
  cfg.num_ranks = 2;
  cfg.max_tokens = 8;
  // FP8 weights for an MXFP4 model, and the other way round.
  expect_error([&] { CpuMoeLayer l(f.model, fixture().weights, identity_placement(16, 2), 0, cfg); },
               {"layer weights are FP8", "expert_format mxfp4"});
  expect_error([&] { CpuMoeLayer l(fixture().model, f.weights, identity_placement(16, 2), 0, cfg); },
               {"layer weights are MXFP4", "expert_format fp8"});
  ModelSpec wider = f.model;
  wider.hidden_size = 192;
  expect_error([&] { CpuMoeLayer l(wider, f.weights, identity_placement(16, 2), 0, cfg); }, {"hidden 160", "192"});
  expect_error([&] { dequantize_layer_f64(f.weights); }, {"MXFP4", "LayerOracle"});
  // Per-token activations exist only in MXFP4 layers; an FP8 layer's oracle refuses them by name.
  const std::vector<float> x(256, 1.0f), w(4, 0.25f);
  const std::vector<int32_t> idx = {0, 1, 2, 3};
  std::vector<double> out(256);
  expect_error([&] { LayerOracle(fixture().model, fixture().weights).run(x.data(), 1, idx.data(), w.data(), out.data(),
                                                                          Fp8Scaling::kPerToken); },
               {"per-token", "FP8 weights"});
}

// FP8 weights made by hand (the GPU benchmarks do) leave the padded sizes 0: the layer uses the model's.
TEST(Layer, Fp8WeightsNeedNoPaddedSizes) {
  MoeLayerWeights w = fixture().weights;
  w.padded_hidden = w.padded_intermediate = 0;
  CpuLayerConfig cfg;
  cfg.num_ranks = 2;
  cfg.max_tokens = 8;
  const CpuMoeLayer layer(fixture().model, w, identity_placement(16, 2), 0, cfg);
  EXPECT_EQ(layer.ep_config().hidden, 256);
  MoeLayerWeights oss = oss_fixture().weights;
  oss.padded_hidden = 0;
  expect_error([&] { CpuMoeLayer l(oss_fixture().model, oss, identity_placement(16, 2), 0, cfg); },
               {"padded to hidden 0", "multiples of 128"});
}
