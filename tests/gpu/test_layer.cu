// The GPU MoE layer (layer.h) against the CPU layer (layer_cpu.h), its oracle: tiny-moe shapes
// (hidden 1024, 64 experts, top-6, group-limited sigmoid router, one shared expert), random weights
// written by the checkpoint generator and read back, fresh random tokens, outputs poisoned first.
// Decode and prefill for P in {1, 2, 4, 8} virtual ranks (the `local` transport), with and without
// redundant experts; a whole step of P ranks captured in one CUDA Graph and replayed with new data
// and new routing; the layer's kernels alone against the reference kernels; bad input; staged
// weight moves while serving (every step before the switch on the old placement, after it on the
// new one, eager and from a graph), their errors, and an aborted move.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device_buffer.h"
#include "expect_error.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/gate_table.h"
#include "kernels/cuda/gating.cuh"
#include "kernels/cuda/silu_fp8.cuh"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/cuda_graph.h"
#include "moekit/ep_cpu.h"
#include "moekit/eplb.h"
#include "moekit/fp8.h"
#include "moekit/gating.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/quant.h"
#include "moekit/rebalance.h"
#include "moekit/reference.h"
#include "moekit/weights.h"
#include "test_layer_reference.h"

using namespace moekit;
using namespace layer_test;

namespace {

// The layer's weights in float64, for the oracle (reference.h moe_layer_f64).
const LayerWeightsF64& oracle_weights() {
  static const std::unique_ptr<LayerWeightsF64> w = dequantize_layer_f64(fixture().weights);
  return *w;
}

// Ordered distance of two bf16 values in units in the last place.
int ulp_distance(uint16_t a, uint16_t b) {
  auto ord = [](uint16_t v) { return (v & 0x8000) ? -int(v & 0x7FFF) : int(v); };
  return std::abs(ord(a) - ord(b));
}

struct Agreement {
  size_t n = 0, same = 0, over_one = 0;
  std::vector<std::pair<float, float>> values;  // (got, want)
  void add(uint16_t got, uint16_t want) {
    const int d = ulp_distance(got, want);
    ++n;
    same += d == 0;
    over_one += d > 1;
    values.emplace_back(bf16_to_float(got), bf16_to_float(want));
  }
  // Outputs outside the GEMM library's own tolerance (tests/gpu/test_gemm.cu, docs/gemm.md):
  // the tensor core sums a 128-deep block with fewer bits than the reference's exact partial,
  // so near-zero outputs can be several bf16 ulps off; 4e-3 of the RMS output plus two bf16
  // ulps of the value bounds that (measured on the H200: ~1% of the layer's GEMM outputs are
  // more than one ulp off, which is why a one-ulp bound was wrong).
  size_t outside() const {
    double sq = 0;
    for (const auto& v : values) sq += double(v.second) * v.second;
    const double rms = std::sqrt(sq / double(std::max<size_t>(n, 1)));
    size_t bad = 0;
    for (const auto& [got, want] : values)
      bad += std::fabs(double(got) - want) > 4e-3 * rms + std::ldexp(std::fabs(double(want)), -6);
    return bad;
  }
};

// One rank's local experts' operand, as the layer gathers it (slot r E_loc + i holds phy2log).
void gather_rank(const ExpertWeights& all, const int32_t* phy2log, int first_slot, int e_loc, std::vector<uint8_t>& w,
                 std::vector<float>& scales) {
  const WeightLayout& l = all.layout;
  const size_t w_per = size_t(l.n) * l.k, s_per = size_t(l.n / 128) * (l.k / 128);
  w.resize(w_per * e_loc);
  scales.resize(s_per * e_loc);
  for (int i = 0; i < e_loc; ++i) {
    const int e = phy2log[first_slot + i];
    std::memcpy(w.data() + i * w_per, all.w.data() + e * w_per, w_per);
    std::memcpy(scales.data() + i * s_per, all.scales.data() + e * s_per, s_per * sizeof(float));
  }
}

// Each stage of rank r's routed experts against the reference kernel run on the GPU's own input
// of that stage: GEMM1 on the received rows, the activation on GEMM1's output, GEMM2 on the
// activation. GEMMs: within one bf16 ulp (the tensor core's rounding) and mostly the same bits;
// the activation: the same bits (a rare expf halfway case aside).
void check_stages(GpuRig& rig, int r, const Placement& placement, bool decode, const char* what) {
  const Fixture& f = fixture();
  const int d = int(f.model.hidden_size), inter = int(f.model.moe_intermediate_size);
  const int e_loc = rig.layers[r]->num_local_experts();
  gpu::EpBuffer& ep = rig.group->rank(r);
  const auto eb = rig.layers[r]->expert_buffers();
  const int rows = eb.rows;
  const size_t total = decode ? size_t(e_loc) * rows : size_t(rows);
  const auto recv_x = download(ep.recv_x(), total * d);
  const auto recv_scales = download(ep.recv_scales(), total * (d / 128));
  const auto count = download(ep.recv_count(), size_t(e_loc));
  const auto row_expert = decode ? std::vector<int32_t>() : download(ep.row_expert(), size_t(rows));
  const bool fused = eb.gate_up == nullptr;  // GEMM1 wrote act itself (GpuPipeline::kFused)
  const auto gate_up = fused ? std::vector<uint16_t>() : download(eb.gate_up, total * 2 * inter);
  const auto act = download(eb.act, total * inter);
  const auto act_scales = download(eb.act_scales, total * (inter / 128));
  const auto y = download(eb.y, total * d);
  std::vector<uint8_t> w1, w2;
  std::vector<float> w1s, w2s;
  gather_rank(f.weights.w1, placement.phy2log_row(0), r * e_loc, e_loc, w1, w1s);
  gather_rank(f.weights.w2, placement.phy2log_row(0), r * e_loc, e_loc, w2, w2s);
  const WeightLayout l1{e_loc, 2 * inter, d}, l2{e_loc, d, inter};
  std::vector<uint16_t> want_gate_up(gate_up.size()), want_y(y.size());
  std::vector<uint8_t> want_act(act.size());
  std::vector<float> want_scales(act_scales.size());
  std::vector<size_t> valid;  // row indices
  if (decode) {
    const MaskedLayout a1{e_loc, rows, d}, a2{e_loc, rows, inter};
    want_gate_up.resize(total * 2 * inter);
    ref::grouped_gemm_masked(a1, recv_x.data(), recv_scales.data(), count.data(), l1, w1.data(), w1s.data(),
                             want_gate_up.data());
    // Staged: the activation on the GPU's own GEMM1 output; fused: on the reference GEMM1's.
    ref::silu_mul_quant_masked(a2, fused ? want_gate_up.data() : gate_up.data(), count.data(), want_act.data(),
                               want_scales.data());
    ref::grouped_gemm_masked(a2, act.data(), act_scales.data(), count.data(), l2, w2.data(), w2s.data(), want_y.data());
    for (int e = 0; e < e_loc; ++e)
      for (int m = 0; m < count[e]; ++m) valid.push_back(size_t(e) * rows + m);
  } else {
    const ContiguousLayout a1{rows, d}, a2{rows, inter};
    ref::grouped_gemm_contiguous(a1, recv_x.data(), recv_scales.data(), row_expert.data(), l1, w1.data(), w1s.data(),
                                 want_gate_up.data());
    ref::silu_mul_quant_contiguous(a2, gate_up.data(), row_expert.data(), want_act.data(), want_scales.data());
    ref::grouped_gemm_contiguous(a2, act.data(), act_scales.data(), row_expert.data(), l2, w2.data(), w2s.data(),
                                 want_y.data());
    for (int m = 0; m < rows; ++m)
      if (row_expert[m] >= 0) valid.push_back(size_t(m));
  }
  Agreement g1, g2;
  size_t act_diff = 0, scale_diff = 0, act_n = 0;
  const int kb2 = inter / 128;
  double act_num = 0, act_den = 0;  // fused: dequantised act against the reference's
  for (size_t row : valid) {
    if (!fused)
      for (int c = 0; c < 2 * inter; ++c) g1.add(gate_up[row * 2 * inter + c], want_gate_up[row * 2 * inter + c]);
    for (int c = 0; c < inter; ++c) {
      const size_t i = decode ? (row / rows * kb2 + c / 128) * rows + row % rows : size_t(c / 128) * rows + row;
      const double got_v = double(fp8_e4m3_to_float(act[row * inter + c])) * act_scales[i];
      const double want_v = double(fp8_e4m3_to_float(want_act[row * inter + c])) * want_scales[i];
      act_num += std::isnan(got_v) ? 1e30 : (got_v - want_v) * (got_v - want_v);
      act_den += want_v * want_v;
    }
    for (int c = 0; c < inter; ++c) act_diff += act[row * inter + c] != want_act[row * inter + c];
    act_n += inter;
    for (int b = 0; b < kb2; ++b) {
      // masked: [E_loc, inter/128, M_max]; contiguous: [inter/128, rows]
      const size_t i = decode ? (row / rows * kb2 + b) * rows + row % rows : size_t(b) * rows + row;
      scale_diff += std::memcmp(&act_scales[i], &want_scales[i], 4) != 0;
    }
    for (int c = 0; c < d; ++c) g2.add(y[row * d + c], want_y[row * d + c]);
  }
  std::printf("[layer] %s rank %d stages: %zu rows; GEMM1 %.1f%% same bits, %zu > 1 ulp; activation %zu of %zu bytes "
              "and %zu scales differ; GEMM2 %.1f%% same bits, %zu > 1 ulp\n",
              what, r, valid.size(), g1.n ? 100.0 * g1.same / g1.n : 100.0, g1.over_one, act_diff, act_n, scale_diff,
              g2.n ? 100.0 * g2.same / g2.n : 100.0, g2.over_one);
  EXPECT_EQ(g2.outside(), 0u) << what << ": GEMM2 of rank " << r;
  EXPECT_GE(g2.same, g2.n * 7 / 10) << what << ": GEMM2 of rank " << r;
  if (fused) {
    // GEMM1 and the activation are one kernel: its FP8 output against the reference GEMM1's
    // activation, dequantised (one bf16 ulp of GEMM1 moves an FP8 code by one step, ~9%).
    const double act_err = act_den > 0 ? std::sqrt(act_num / act_den) : 0.0;
    std::printf("[layer] %s rank %d: fused GEMM1+activation vs reference %.3e (%zu of %zu codes differ)\n", what, r,
                act_err, act_diff, act_n);
    EXPECT_LE(act_err, kLayerTolerance) << what << ": fused GEMM1 + activation of rank " << r;
    return;
  }
  EXPECT_EQ(g1.outside(), 0u) << what << ": GEMM1 of rank " << r;
  EXPECT_GE(g1.same, g1.n * 7 / 10) << what << ": GEMM1 of rank " << r;
  EXPECT_LE(act_diff, 4 + act_n / 1000) << what << ": activation of rank " << r;
  EXPECT_LE(scale_diff, 1 + valid.size() * kb2 / 1000) << what << ": activation scales of rank " << r;
}

// The GPU step against the CPU layer: routing, recv_count, output; and both against the oracle.
void compare_step(GpuRig& rig, const CpuResult& cpu, const std::vector<uint16_t>& x, bool decode, const char* what) {
  const Fixture& f = fixture();
  const int d = int(f.model.hidden_size), k = f.model.num_experts_per_token;
  const std::vector<uint16_t> got = rig.gather_out();
  size_t nan = 0;
  for (uint16_t v : got) nan += std::isnan(bf16_to_float(v));
  ASSERT_EQ(nan, 0u) << what << ": output values left poisoned or NaN";

  size_t same_w = 0;
  expect_same_routing(rig, cpu, what, &same_w);
  if (::testing::Test::HasFatalFailure()) return;
  const size_t num_w = cpu.topk_weights.size();
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);
  std::vector<double> oracle(x.size());
  ref::moe_layer_f64(xf.data(), kBatch, cpu.topk_idx.data(), cpu.topk_weights.data(), k, oracle_weights().view,
                     oracle.data());
  // The shared expert alone (it is the combine's `add` term) against reference.h's.
  const MoeLayerWeights& lw = f.weights;
  const ref::ExpertFp8 sw{d, lw.shared_w1.layout.n / 2, lw.shared_w1.w.data(), lw.shared_w1.scales.data(),
                          lw.shared_w2.w.data(), lw.shared_w2.scales.data()};
  std::vector<uint16_t> shared_got, shared_want(x.size());
  ref::shared_expert(xf.data(), kBatch, sw, shared_want.data());
  for (int r = 0; r < rig.P; ++r) {
    auto part = download(rig.layers[r]->shared_out(), size_t(rig.tokens(r)) * d);
    shared_got.insert(shared_got.end(), part.begin(), part.end());
  }
  const double shared_err = rel_error(shared_got, to_double(shared_want));
  std::printf("[layer] %s: shared expert GPU vs reference.h %.3e\n", what, shared_err);
  EXPECT_LE(shared_err, kLayerTolerance) << what << ": shared expert";

  const double vs_cpu = rel_error(got, to_double(cpu.out));
  const double gpu_err = rel_error(got, oracle), cpu_err = rel_error(cpu.out, oracle);
  size_t same_out = 0;
  for (size_t i = 0; i < got.size(); ++i) same_out += got[i] == cpu.out[i];
  std::printf("[layer] %s: GPU vs CPU layer %.3e, GPU vs f64 oracle %.3e, CPU vs oracle %.3e; %zu/%zu outputs and "
              "%zu/%zu weights the same bits\n",
              what, vs_cpu, gpu_err, cpu_err, same_out, got.size(), same_w, num_w);
  EXPECT_LE(vs_cpu, kLayerTolerance) << what;
  EXPECT_LE(gpu_err, kLayerTolerance) << what;
  (void)decode;
}

struct Case {
  int P;
  bool redundant;
  bool decode;
  gpu::GpuPipeline pipeline = gpu::GpuPipeline::kStaged;
  int shared_ctas = 0;  // GpuLayerConfig::shared_ctas (staged decode: the shared expert's own SMs); < 0: SMs less -n
};
constexpr gpu::GpuPipeline kStaged = gpu::GpuPipeline::kStaged;
constexpr gpu::GpuPipeline kFused = gpu::GpuPipeline::kFused;

class GpuLayer : public ::testing::TestWithParam<Case> {};

TEST_P(GpuLayer, EqualsCpuLayer) {
  const Case c = GetParam();
  const Fixture& f = fixture();
  const Placement placement = make_placement(c.P, c.redundant);
  const uint64_t seed = 11;
  const int shared_ctas = c.shared_ctas < 0 ? query_device().num_sms + c.shared_ctas : c.shared_ctas;
  GpuRig rig(c.P, c.decode ? gpu::EpMode::kLowLatency : gpu::EpMode::kNormal, placement, seed, nullptr, c.pipeline,
             true, 0, size_t(4) << 20, fixture(), true, true, true,
             [&](gpu::GpuLayerConfig& cfg) { cfg.shared_ctas = shared_ctas; });
  std::mt19937 rng(100 + c.P);
  // Two eager steps: the router's routing, then the caller's hot routing.
  for (int step = 0; step < 2; ++step) {
    const auto x = random_tokens(kBatch, int(f.model.hidden_size), rng);
    std::vector<int32_t> idx;
    std::vector<float> w;
    const bool caller = step == 1;
    if (caller) random_routing(kBatch, f.model.num_routed_experts, f.model.num_experts_per_token, rng, idx, w);
    const CpuResult cpu = run_cpu(c.P, c.decode ? EpProtocol::kLowLatency : EpProtocol::kNormal, placement, x,
                                  caller ? &idx : nullptr, caller ? &w : nullptr, seed);
    rig.load(x, caller ? &idx : nullptr, caller ? &w : nullptr);
    rig.issue(caller);
    rig.check();
    const std::string what = std::string(c.decode ? "decode" : "prefill") + " P=" + std::to_string(c.P) +
                             (c.redundant ? " +8 redundant" : "") + (caller ? " caller routing" : " router") + " " +
                             gpu::gpu_pipeline_name(c.pipeline) +
                             (shared_ctas > 0 ? " shared_ctas " + std::to_string(shared_ctas) : "");
    compare_step(rig, cpu, x, c.decode, what.c_str());
    for (int r = 0; r < c.P; ++r) check_stages(rig, r, placement, c.decode, what.c_str());
  }
  // Statistics: every valid (token, entry) counted once per logical expert over both steps.
  int64_t total = 0;
  for (int r = 0; r < c.P; ++r)
    for (int64_t v : rig.layers[r]->take_expert_counts(rig.stream)) total += v;
  EXPECT_EQ(total, int64_t(2) * kBatch * f.model.num_experts_per_token);
}

INSTANTIATE_TEST_SUITE_P(Decode, GpuLayer,
                         ::testing::Values(Case{1, false, true}, Case{2, false, true}, Case{4, false, true},
                                           Case{8, false, true}, Case{2, true, true}, Case{8, true, true}));
// The shared expert on SMs of its own and the routed GEMM1 on the rest (one SM left for it, too).
INSTANTIATE_TEST_SUITE_P(DecodeSharedCtas, GpuLayer,
                         ::testing::Values(Case{2, false, true, kStaged, 16}, Case{8, true, true, kStaged, -32},
                                           Case{4, false, true, kStaged, -1}));
INSTANTIATE_TEST_SUITE_P(DecodeFused, GpuLayer,
                         ::testing::Values(Case{1, false, true, kFused}, Case{2, false, true, kFused},
                                           Case{4, false, true, kFused}, Case{8, false, true, kFused},
                                           Case{2, true, true, kFused}, Case{8, true, true, kFused}));
INSTANTIATE_TEST_SUITE_P(Prefill, GpuLayer,
                         ::testing::Values(Case{1, false, false}, Case{2, false, false}, Case{4, false, false},
                                           Case{8, false, false}, Case{4, true, false}));

// One step of every rank of a rig captured in a CUDA Graph (ended even when issuing throws, so
// a failure does not leave the stream capturing for the tests that follow).
struct CapturedStep {
  GpuRig& rig;
  CapturedGraph graph;
  CapturedStep(GpuRig& r, bool caller_routing) : rig(r), graph(r.stream, [&] { r.issue(caller_routing); }) {}
  void replay() {
    graph.launch(rig.stream);
    rig.check();
  }
};

// One step of the rig on tokens x (its router's routing), eagerly or captured and replayed once;
// the outputs poisoned first.
void run_step(GpuRig& rig, const std::vector<uint16_t>& x, bool graph) {
  rig.load(x, nullptr, nullptr);
  if (graph) {
    CapturedStep step(rig, false);
    rig.load(x, nullptr, nullptr);  // poison again: the capture ran nothing
    step.replay();
  } else {
    rig.issue(false);
    rig.check();
  }
}

// Every rank of rig chose the experts and slots of ref's and received the same rows per expert.
void expect_same_routing_as(const GpuRig& rig, const GpuRig& ref, const std::string& what) {
  const int k = rig.fx.model.num_experts_per_token;
  for (int r = 0; r < rig.P; ++r) {
    const size_t tk = size_t(ref.tokens(r)) * k;
    EXPECT_EQ(download(rig.layers[r]->topk_idx(), tk), download(ref.layers[r]->topk_idx(), tk)) << what;
    EXPECT_EQ(download(rig.layers[r]->topk_slot(), tk), download(ref.layers[r]->topk_slot(), tk)) << what;
    const size_t e_loc = size_t(ref.layers[r]->num_local_experts());
    EXPECT_EQ(download(rig.group->rank(r).recv_count(), e_loc), download(ref.group->rank(r).recv_count(), e_loc))
        << what;
  }
}

// An FP8 model with gpt-oss's clamped SwiGLU and a shared expert: the GPU layer applies the
// activation to the routed and the shared experts as the CPU layer does, staged and fused (where
// GEMM1 must keep to the activation kernel: its fused epilogue computes SiLU·up only).
TEST(GpuLayer, Fp8ClampedSwigluEqualsCpuLayer) {
  ModelSpec m = load_model_spec("tiny-moe");
  m.name += "-clamped";
  m.activation = {"clamped_swiglu", 1.702, 7.0};
  const Fixture f(m);
  ASSERT_TRUE(f.weights.has_shared_experts());
  const int P = 2;
  const Placement placement = make_placement(P, false);
  std::mt19937 rng(77);
  const auto x = random_tokens(kBatch, int(m.hidden_size), rng);
  const uint64_t seed = 11;
  const CpuResult cpu = run_cpu(P, EpProtocol::kLowLatency, placement, x, nullptr, nullptr, seed, f);
  for (const gpu::GpuPipeline pipeline : {gpu::GpuPipeline::kStaged, kFused}) {
    GpuRig rig(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, pipeline, true, 0, size_t(4) << 20, f);
    run_step(rig, x, false);
    const std::string what = std::string("FP8 with clamped SwiGLU, ") + gpu::gpu_pipeline_name(pipeline);
    expect_same_routing(rig, cpu, what, nullptr);
    const double err = rel_error(rig.gather_out(), to_double(cpu.out));
    std::printf("[layer] %s: GPU vs CPU layer %.3e\n", what.c_str(), err);
    EXPECT_LE(err, kLayerTolerance) << what;
  }
}

// One step of P = 4 ranks captured once; replays with new tokens (router) and new caller routing.
TEST(GpuLayerGraph, ReplayWithNewDataAndRouting) {
  const Fixture& f = fixture();
  const int P = 4;
  const uint64_t seed = 5;
  const Placement placement = make_placement(P, true);
  for (gpu::GpuPipeline pipeline : {gpu::GpuPipeline::kStaged, kFused})
  for (bool caller : {false, true}) {
    GpuRig rig(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, pipeline);
    std::mt19937 rng(caller ? 77 : 55);
    auto x = random_tokens(kBatch, int(f.model.hidden_size), rng);
    std::vector<int32_t> idx;
    std::vector<float> w;
    random_routing(kBatch, f.model.num_routed_experts, f.model.num_experts_per_token, rng, idx, w);
    rig.load(x, &idx, &w);
    CapturedStep step(rig, caller);
    for (int replay = 0; replay < 3; ++replay) {
      x = random_tokens(kBatch, int(f.model.hidden_size), rng);
      random_routing(kBatch, f.model.num_routed_experts, f.model.num_experts_per_token, rng, idx, w);
      rig.load(x, &idx, &w);
      step.replay();
      const CpuResult cpu = run_cpu(P, EpProtocol::kLowLatency, placement, x, caller ? &idx : nullptr,
                                    caller ? &w : nullptr, seed);
      const std::string what = std::string("graph replay ") + std::to_string(replay) +
                               (caller ? " caller routing " : " router ") + gpu::gpu_pipeline_name(pipeline);
      compare_step(rig, cpu, x, true, what.c_str());
      for (int r = 0; r < P; ++r) check_stages(rig, r, placement, true, what.c_str());
    }
  }
}

// EPLB between steps: a graph captured under one placement replays under a new one (different
// hot experts, so different replicas) after set_placement, and equals the CPU layer built with it.
TEST(GpuLayerEplb, NewPlacementBetweenGraphReplays) {
  const Fixture& f = fixture();
  const int P = 4, E = f.model.num_routed_experts;
  const uint64_t seed = 21;
  std::vector<double> load_a(E, 1.0), load_b(E, 1.0);
  for (int e = 0; e < 8; ++e) load_a[e] = 8.0, load_b[E - 1 - e] = 8.0;
  const Placement a = balanced_placement(load_a, 8, P), b = balanced_placement(load_b, 8, P);
  for (gpu::GpuPipeline pipeline : {gpu::GpuPipeline::kStaged, kFused}) {
  GpuRig rig(P, gpu::EpMode::kLowLatency, a, seed, nullptr, pipeline);
  std::mt19937 rng(31);
  auto x = random_tokens(kBatch, int(f.model.hidden_size), rng);
  rig.load(x, nullptr, nullptr);
  CapturedStep step(rig, false);
  for (const Placement* placement : {&a, &b}) {
    if (placement == &b) {
      int moved = 0;
      for (int r = 0; r < P; ++r) moved += rig.layers[r]->set_placement(b, 0, f.weights, rig.stream);
      EXPECT_GT(moved, 0) << "the two placements hold the same experts";
    }
    x = random_tokens(kBatch, int(f.model.hidden_size), rng);
    rig.load(x, nullptr, nullptr);
    step.replay();
    const CpuResult cpu = run_cpu(P, EpProtocol::kLowLatency, *placement, x, nullptr, nullptr, seed);
    const std::string what = std::string(placement == &a ? "graph, placement A " : "graph, placement B after set_placement ") +
                             gpu::gpu_pipeline_name(pipeline);
    compare_step(rig, cpu, x, true, what.c_str());
    for (int r = 0; r < P; ++r) check_stages(rig, r, *placement, true, what.c_str());
  }
  }
}

// Two micro-batches of one layer: a second set of layers (own EP group, own buffers) using the
// first set's device weights computes the same step as the CPU layer; set_placement is refused.
TEST(GpuLayerShared, SecondLayerUsesTheFirstsWeights) {
  const Fixture& f = fixture();
  const int P = 2;
  const uint64_t seed = 4;
  const Placement placement = make_placement(P, true);
  GpuRig owner(P, gpu::EpMode::kLowLatency, placement, seed);
  GpuRig rig(P, gpu::EpMode::kLowLatency, placement, seed, &owner, kFused);  // a fused layer on staged weights
  std::mt19937 rng(8);
  const auto x = random_tokens(kBatch, int(f.model.hidden_size), rng);
  rig.load(x, nullptr, nullptr);
  rig.issue(false);
  rig.check();
  const CpuResult cpu = run_cpu(P, EpProtocol::kLowLatency, placement, x, nullptr, nullptr, seed);
  compare_step(rig, cpu, x, true, "shared weights, fused");
  for (int r = 0; r < P; ++r) check_stages(rig, r, placement, true, "shared weights, fused");
  try {
    owner.layers[0]->set_placement(placement, 0, f.weights, owner.stream);
    ADD_FAILURE() << "set_placement accepted on a layer whose weights are shared";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shares its weights"), std::string::npos) << e.what();
  }
}

// div_rn (silu_fp8.cuh), the activation's division, against CUDA's IEEE division: the same bits
// for random fp32 pairs over the whole exponent range, divisors as SiLU's (1 + e, up to infinity),
// general positive ones (subnormal to the largest, and infinity), and FP8 scales (amax / 448).
__global__ void div_pair_kernel(const float* a, const float* b, float* ours, float* ieee, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    ours[i] = div_rn(a[i], b[i]);
    ieee[i] = __fdiv_rn(a[i], b[i]);
  }
}

TEST(GpuActivation, DivisionIsIeee) {
  std::mt19937 rng(2026);
  std::uniform_int_distribution<uint32_t> bits;
  auto from_bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  const int per = 1 << 22;
  std::vector<float> a, b;
  for (int kind = 0; kind < 3; ++kind) {
    for (int i = 0; i < per; ++i) {
      a.push_back(from_bits(bits(rng)));
      const float pos = from_bits(bits(rng) & 0x7FFFFFFFu);  // any non-negative fp32, NaN and inf too
      const float d = kind == 0 ? 1.0f + pos : kind == 1 ? pos : std::fmax(pos, 1e-4f) / 448.0f;
      b.push_back(std::isnan(d) || d == 0.0f ? 1.0f : d);  // the contract: b > 0
    }
  }
  for (float x : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-45f, -3e38f})
    for (float y : {1.0f, INFINITY, 1e-45f, 3e38f, 448.0f, 2.2e-7f}) a.push_back(x), b.push_back(y);
  const int n = int(a.size());
  DeviceBuffer<float> d_a(n), d_b(n), d_ours(n), d_ieee(n);
  d_a.upload(a);
  d_b.upload(b);
  div_pair_kernel<<<(n + 255) / 256, 256>>>(d_a.ptr, d_b.ptr, d_ours.ptr, d_ieee.ptr, n);
  MOEKIT_CUDA_CHECK(cudaGetLastError());
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> ours = d_ours.download(), ieee = d_ieee.download();
  size_t differ = 0;
  for (int i = 0; i < n; ++i) {
    uint32_t x, y;
    std::memcpy(&x, &ours[i], 4);
    std::memcpy(&y, &ieee[i], 4);
    const bool same = x == y || (std::isnan(ours[i]) && std::isnan(ieee[i]));
    if (!same && differ++ < 5)
      std::printf("  %a / %a: %a, IEEE %a\n", double(a[i]), double(b[i]), double(ours[i]), double(ieee[i]));
  }
  std::printf("[layer] div_rn over %d pairs: %zu differ from IEEE division\n", n, differ);
  EXPECT_EQ(differ, 0u);
}

// GEMM1-like bf16 output for the activation kernels, `rows` rows of [gate; up] (2 inter each):
// normal(0, 2) values, and one entry in 5 of the gate halves drawn over 2^-30 .. 2^10 in magnitude,
// so that gates outside the table's shared-memory window (gate_table.h) are looked up in global
// memory.
std::vector<uint16_t> random_gate_up(size_t rows, int inter, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<float> log2_magnitude(-30.0f, 10.0f);
  std::vector<uint16_t> gate_up(rows * 2 * inter);
  for (auto& v : gate_up) v = float_to_bf16(normal(rng));
  for (size_t i = 0; i < gate_up.size(); i += 5)  // i % (2 inter) < inter: a gate; else an up, left as it is
    if (i % (2 * size_t(inter)) < size_t(inter))
      gate_up[i] = float_to_bf16((i % 2 ? -1.0f : 1.0f) * std::exp2(log2_magnitude(rng)));
  return gate_up;
}

// The contiguous activation kernel alone against reference.h: more rows than its grid's CTAs hold at
// once (8 rows each, up to 8 CTAs per SM: its loop over row blocks turns more than once), padding
// rows (row_expert = -1) left untouched, inputs as in the masked case (random_gate_up); with 1x128
// scales and per token (GpuActivation::token_scales, the kernel of one warp per row: each row's
// scale in all of its slots), per token also at gpt-oss-120b's 23 groups, all held in shared
// memory between the kernel's two passes, and at 26, two more than it holds.
TEST(GpuLayerKernels, SiluMulQuantContiguousMatchesReference) {
  const gpu::ActivationTable silu(ref::Activation{});
  int num_sms = 0;
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  struct Case {
    int inter, total_m;
    Fp8Scaling scaling;
  };
  const int many_rows = 8 * 8 * num_sms * 2 + 40;
  for (const Case c : {Case{384, many_rows, Fp8Scaling::kPerBlock}, Case{384, many_rows, Fp8Scaling::kPerToken},
                       Case{2944, 1500, Fp8Scaling::kPerToken}, Case{3328, 700, Fp8Scaling::kPerToken}}) {
    const int inter = c.inter, total_m = c.total_m;
    const Fp8Scaling scaling = c.scaling;
    const ContiguousLayout o{total_m, inter};
    std::mt19937 rng(31);
    const std::vector<uint16_t> gate_up = random_gate_up(size_t(total_m), inter, rng);
    std::vector<int32_t> row_expert(total_m);
    for (int m = 0; m < total_m; ++m) row_expert[m] = m % 11 == 3 ? -1 : m / 1000;
    std::vector<uint8_t> want(o.a_elems(), 0xAB);
    std::vector<float> want_s(o.scale_elems(), -1.0f);
    ref::activation_quant_contiguous(ref::Activation{}, o, gate_up.data(), row_expert.data(), want.data(),
                                     want_s.data(), scaling);
    DeviceArray<uint16_t> dg(gate_up.size());
    DeviceArray<int32_t> dr(row_expert.size());
    DeviceArray<uint8_t> dq(want.size());
    DeviceArray<float> ds(want_s.size());
    dg.upload(gate_up.data(), gate_up.size());
    dr.upload(row_expert.data(), row_expert.size());
    const std::vector<uint8_t> pq(want.size(), 0xAB);
    const std::vector<float> ps(want_s.size(), -1.0f);
    dq.upload(pq.data(), pq.size());
    ds.upload(ps.data(), ps.size());
    GpuActivation act = silu.act();
    act.token_scales = scaling == Fp8Scaling::kPerToken;
    gpu::launch_silu_mul_quant_contiguous(dg.ptr, total_m, inter, dr.ptr, dq.ptr, ds.ptr, nullptr, {}, act);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = dq.download(want.size());
    const auto got_s = ds.download(want_s.size());
    size_t diff = 0, diff_s = 0, padding_written = 0, one_scale_rows = 0;
    for (int m = 0; m < total_m; ++m) {
      for (int c = 0; c < inter; ++c) {
        const size_t i = o.a_offset(m) + c;
        diff += got[i] != want[i];
        padding_written += row_expert[m] < 0 && got[i] != 0xAB;
      }
      bool one = true;
      for (int g = 1; g < inter / 128; ++g) one = one && got_s[o.scale_offset(m, g)] == got_s[o.scale_offset(m, 0)];
      one_scale_rows += row_expert[m] >= 0 && one;
    }
    for (size_t i = 0; i < got_s.size(); ++i) diff_s += std::memcmp(&got_s[i], &want_s[i], 4) != 0;
    const size_t rows = size_t(std::count_if(row_expert.begin(), row_expert.end(), [](int32_t e) { return e >= 0; }));
    std::printf("[layer] contiguous activation (%s), inter %d, %d rows: %zu of %zu fp8 bytes and %zu of %zu scales "
                "differ from the reference; %zu of %zu rows have one scale\n", fp8_scaling_name(scaling), inter, total_m,
                diff, got.size(), diff_s, got_s.size(), one_scale_rows, rows);
    // As the masked case: glibc's expf and the correctly rounded one can differ in a rare halfway case.
    EXPECT_LE(diff, 4 + got.size() / 1000);
    EXPECT_LE(diff_s, 1 + got_s.size() / 1000);
    EXPECT_EQ(padding_written, 0u);
    if (scaling == Fp8Scaling::kPerToken) EXPECT_EQ(one_scale_rows, rows);
    else EXPECT_LT(one_scale_rows, rows / 2) << "1x128 rows with one scale: the data cannot tell the two apart";
  }
}

// The gate table (activation.cuh ActivationTable) against reference.h's own gate half, computed
// here on the host for every bf16 gate, for both activations: the entries may differ only where
// glibc's expf is not the correctly rounded exp (a handful of gates, printed); an entry in the wrong
// place or a wrong formula would differ for most gates. And bad launches (no table, inter not a
// multiple of 128, too many experts) are refused with the value.
TEST(GpuActivation, GateTableIsTheReferencesGateHalf) {
  const ref::Activation silu{}, swiglu{ref::Activation::Kind::kClampedSwiglu, 1.702f, 7.0f};
  for (const ref::Activation& act : {silu, swiglu}) {
    const gpu::ActivationTable table(act);
    std::vector<float> got(kBf16Values);
    MOEKIT_CUDA_CHECK(cudaMemcpy(got.data(), table.act().gate_table, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    int differ = 0;
    for (int b = 0; b < kBf16Values; ++b) {
      const float g = bf16_to_float(uint16_t(b));
      // reference.h's formulas with up = 1 (silu_mul(g, 1) is the gate half times 1, exactly).
      const float want = act.kind == ref::Activation::Kind::kSilu ? ref::silu_mul(g, 1.0f)
                                                                   : ref::clamped_swiglu(g, 0.0f, act.alpha, act.limit);
      const bool same = std::memcmp(&got[size_t(b)], &want, 4) == 0 || (std::isnan(got[size_t(b)]) && std::isnan(want));
      if (!same && differ++ < 8)
        std::printf("  gate %a (bits 0x%04x): table %a, reference %a\n", double(g), b, double(got[size_t(b)]),
                    double(want));
    }
    std::printf("[layer] gate table (%s): %d of %d entries differ from the reference\n",
                act.kind == ref::Activation::Kind::kSilu ? "silu" : "clamped swiglu", differ, kBf16Values);
    EXPECT_LE(differ, 8);
  }
  // Refused before anything is launched, naming the value.
  const gpu::ActivationTable table(silu);
  expect_error([] { gpu::launch_silu_mul_quant_masked(nullptr, 1, 4, 128, nullptr, nullptr, nullptr, nullptr, {}, {}); },
               {"GpuActivation::gate_table = "});
  expect_error([&] { gpu::launch_silu_mul_quant_masked(nullptr, 1, 4, 100, nullptr, nullptr, nullptr, nullptr, {}, table.act()); },
               {"inter = 100"});
  expect_error([&] { gpu::launch_silu_mul_quant_masked(nullptr, 5000, 4, 128, nullptr, nullptr, nullptr, nullptr, {}, table.act()); },
               {"5000 experts"});
  expect_error([&] { gpu::launch_silu_mul_quant_contiguous(nullptr, 8, 0, nullptr, nullptr, nullptr, nullptr, {}, table.act()); },
               {"inter = 0"});
  // Even with nothing to do: a missing table is the caller's bug whatever the rows.
  expect_error([] { gpu::launch_silu_mul_quant_masked(nullptr, 0, 4, 128, nullptr, nullptr, nullptr, nullptr, {}, {}); },
               {"GpuActivation::gate_table = "});
  expect_error([] { gpu::launch_silu_mul_quant_contiguous(nullptr, 0, 128, nullptr, nullptr, nullptr, nullptr, {}, {}); },
               {"GpuActivation::gate_table = "});
  expect_error([&] { gpu::launch_silu_mul_quant_contiguous(nullptr, -3, 128, nullptr, nullptr, nullptr, nullptr, {}, table.act()); },
               {"total_m = -3"});
}

// The activation kernel alone, bit for bit against reference.h (masked layout, rows past
// masked_m untouched) on GEMM-like bf16 inputs: a small case, and one whose rows outnumber the
// grid's warps times the items each loads at once (the kernel's loop turns more than once), with
// one expert holding most of them (inputs: random_gate_up, gates in and outside the table's window).
// Each with 1x128 scales and per token (GpuActivation::token_scales: a warp per row, every slot of
// a row its one scale), per token also at gpt-oss-120b's 23 groups (all held in shared memory
// between the kernel's two passes) and at 26, two more than it holds.
TEST(GpuLayerKernels, SiluMulQuantMatchesReference) {
  const gpu::ActivationTable silu(ref::Activation{});
  struct Case {
    int E, M, inter;
    std::vector<int32_t> masked_m;
  };
  // (The kernel deals runs of 4 consecutive (row, group) items: with 1, 2 or 3 groups per row a
  // run crosses rows, and experts, empty ones included.)
  for (const Case& k : {Case{3, 40, 256, {40, 0, 17}}, Case{3, 4096, 1024, {4096, 1, 2900}},
                        Case{5, 24, 128, {0, 5, 0, 0, 24}}, Case{3, 16, 384, {7, 0, 16}},
                        Case{4, 300, 2944, {300, 0, 41, 1}}, Case{2, 64, 3328, {9, 64}}})
  for (const Fp8Scaling scaling : {Fp8Scaling::kPerBlock, Fp8Scaling::kPerToken}) {
    const int E = k.E, M = k.M, inter = k.inter;
    if (scaling == Fp8Scaling::kPerBlock && inter > 1024) continue;  // (the groups' count matters per token only)
    const std::vector<int32_t>& masked_m = k.masked_m;
    const MaskedLayout o{E, M, inter};
    std::mt19937 rng(9 + M);
    const std::vector<uint16_t> gate_up = random_gate_up(size_t(E) * M, inter, rng);
    std::vector<uint8_t> want(o.a_elems(), 0xAB);
    std::vector<float> want_s(o.scale_elems(), -1.0f);
    ref::activation_quant_masked(ref::Activation{}, o, gate_up.data(), masked_m.data(), want.data(), want_s.data(),
                                 scaling);
    DeviceArray<uint16_t> dg(gate_up.size());
    DeviceArray<int32_t> dm(E);
    DeviceArray<uint8_t> dq(want.size());
    DeviceArray<float> ds(want_s.size());
    dg.upload(gate_up.data(), gate_up.size());
    dm.upload(masked_m.data(), E);
    std::vector<uint8_t> pq(want.size(), 0xAB);
    std::vector<float> ps(want_s.size(), -1.0f);
    dq.upload(pq.data(), pq.size());
    ds.upload(ps.data(), ps.size());
    GpuActivation act = silu.act();
    act.token_scales = scaling == Fp8Scaling::kPerToken;
    gpu::launch_silu_mul_quant_masked(dg.ptr, E, M, inter, dm.ptr, dq.ptr, ds.ptr, nullptr, {}, act);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = dq.download(want.size());
    const auto got_s = ds.download(want_s.size());
    size_t diff = 0, diff_s = 0;
    for (size_t i = 0; i < got.size(); ++i) diff += got[i] != want[i];
    for (size_t i = 0; i < got_s.size(); ++i) diff_s += std::memcmp(&got_s[i], &want_s[i], 4) != 0;
    std::printf("[layer] activation (%s) E = %d, M = %d, inter %d: %zu of %zu fp8 bytes and %zu of %zu scales differ "
                "from the reference\n", fp8_scaling_name(scaling), E, M, inter, diff, got.size(), diff_s, got_s.size());
    // glibc's expf vs the correctly rounded fp64 exp can differ in a rare halfway case; a wrong
    // formula or layout changes most bytes, so one in a thousand is a tight bound.
    size_t rows = 0;
    for (int m : masked_m) rows += size_t(m);
    EXPECT_LE(diff, 4 + rows * inter / 1000);
    EXPECT_LE(diff_s, 1 + rows * (inter / 128) / 1000);
    // Rows past masked_m untouched (the comparison above covers them too: want keeps 0xAB there).
    for (int e = 0; e < E; ++e)
      for (int m = masked_m[e]; m < M; ++m)
        for (int c = 0; c < inter; ++c) ASSERT_EQ(got[o.a_offset(e, m) + c], 0xAB) << "expert " << e << " row " << m;
    if (scaling != Fp8Scaling::kPerToken) continue;
    size_t one_scale_rows = 0;  // every valid row's slots one value
    for (int e = 0; e < E; ++e)
      for (int m = 0; m < masked_m[e]; ++m) {
        bool one = true;
        for (int g = 1; g < inter / 128; ++g) one = one && got_s[o.scale_offset(e, m, g)] == got_s[o.scale_offset(e, m, 0)];
        one_scale_rows += one;
      }
    EXPECT_EQ(one_scale_rows, rows);
  }
}

// The gate alone on a softmax router (Qwen-style, no groups) and a grouped sigmoid router with
// bias: indices equal, weights within 1e-6 relative (the same bits in practice).
TEST(GpuLayerKernels, GateMatchesReference) {
  for (bool sigmoid : {false, true}) {
    const int T = 50, d = 512, E = 128, k = 8;
    RouterSpec spec;
    spec.scoring = sigmoid ? "sigmoid" : "softmax";
    spec.num_groups = sigmoid ? 8 : 1;
    spec.topk_groups = sigmoid ? 4 : 1;
    spec.routed_scaling_factor = sigmoid ? 2.5 : 1.0;
    std::mt19937 rng(sigmoid ? 1 : 2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> x(size_t(T) * d);
    for (auto& v : x) v = float_to_bf16(normal(rng));
    std::vector<float> xf(x.size()), rw(size_t(E) * d), bias(E);
    for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);
    for (auto& v : rw) v = bf16_to_float(float_to_bf16(normal(rng) * 0.05f));
    for (auto& v : bias) v = normal(rng) * 0.05f;
    std::vector<float> logits(size_t(T) * E), want_w(size_t(T) * k);
    std::vector<int32_t> want_i(size_t(T) * k);
    ref::router_logits(xf.data(), T, d, rw.data(), E, logits.data());
    ref::select_experts(logits.data(), T, E, k, spec, sigmoid ? bias.data() : nullptr, want_i.data(), want_w.data());

    DeviceArray<uint16_t> dx(x.size());
    DeviceArray<float> dw(rw.size()), db(E), dl(logits.size()), dtw(want_w.size());
    DeviceArray<int32_t> dti(want_i.size());
    DeviceArray<gpu::LayerStatus> st(1);
    MOEKIT_CUDA_CHECK(cudaMemset(st.ptr, 0, sizeof(gpu::LayerStatus)));
    dx.upload(x.data(), x.size());
    dw.upload(rw.data(), rw.size());
    db.upload(bias.data(), E);
    gpu::RouterParams rp{sigmoid, spec.num_groups, spec.topk_groups, spec.normalize_topk, spec.routed_scaling_factor};
    gpu::launch_router_logits(dx.ptr, T, d, dw.ptr, E, dl.ptr, nullptr);
    gpu::launch_select_experts(dl.ptr, T, E, k, rp, sigmoid ? db.ptr : nullptr, dti.ptr, dtw.ptr, st.ptr, nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got_l = dl.download(logits.size());
    size_t same_l = 0;
    for (size_t i = 0; i < got_l.size(); ++i) {
      same_l += got_l[i] == logits[i];
      ASSERT_NEAR(got_l[i], logits[i], 1e-6 * (1 + std::fabs(logits[i])));
    }
    EXPECT_EQ(dti.download(want_i.size()), want_i) << spec.scoring;
    const auto got_w = dtw.download(want_w.size());
    for (size_t i = 0; i < got_w.size(); ++i) ASSERT_NEAR(got_w[i], want_w[i], 1e-6 * std::fabs(want_w[i]));
    std::printf("[layer] gate %s: %zu/%zu logits the same bits\n", spec.scoring.c_str(), same_l, got_l.size());
    EXPECT_EQ(st.download(1)[0].kind, 0);
  }
}

// Both router kernels on shapes that end inside a tile (tokens, experts and columns), a padded
// row (x_cols < d) and a logit bias: the tiled kernel in one split sums in gating.h's column
// order, 4 columns a DMMA, and its logits are held to the reference's bits (which they met on
// every case measured); the warp kernel's and the split tiles' (2, 4, 8 or 16 CTAs of a cluster)
// within fp64 rounding, and their count of equal bits printed. Poisoned outputs: every logit is
// written.
TEST(GpuLayerKernels, RouterKernelsMatchTheReference) {
  struct Shape {
    int T, E, d, x_cols;
    bool bias;
  };
  for (const Shape sh : {Shape{1, 128, 512, 512, false}, Shape{200, 60, 512, 480, true}, Shape{130, 256, 2944, 2880, true},
                         Shape{64, 64, 16, 4, false}, Shape{16, 256, 7168, 7168, true}}) {
    std::mt19937 rng(uint32_t(sh.T * 7 + sh.E));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> x(size_t(sh.T) * sh.x_cols);
    for (auto& v : x) v = float_to_bf16(normal(rng));
    std::vector<float> xf(size_t(sh.T) * sh.d, 0.0f), rw(size_t(sh.E) * sh.d, 0.0f), lb(sh.E);
    for (int t = 0; t < sh.T; ++t)
      for (int c = 0; c < sh.x_cols; ++c) xf[size_t(t) * sh.d + c] = bf16_to_float(x[size_t(t) * sh.x_cols + c]);
    for (int e = 0; e < sh.E; ++e)
      for (int c = 0; c < sh.x_cols; ++c) rw[size_t(e) * sh.d + c] = normal(rng) * 0.05f;  // fp32, padded columns 0
    for (auto& v : lb) v = normal(rng);
    std::vector<float> want(size_t(sh.T) * sh.E);
    ref::router_logits(xf.data(), sh.T, sh.d, rw.data(), sh.E, want.data(), sh.bias ? lb.data() : nullptr);

    DeviceArray<uint16_t> dx(x.size());
    DeviceArray<float> dw(rw.size()), dlb(lb.size()), dl(want.size());
    dx.upload(x.data(), x.size());
    dw.upload(rw.data(), rw.size());
    dlb.upload(lb.data(), lb.size());
    for (const gpu::RouterConfig cfg : {gpu::RouterConfig{gpu::RouterKernel::kWarps, 1},
                                        gpu::RouterConfig{gpu::RouterKernel::kTiles, 1},
                                        gpu::RouterConfig{gpu::RouterKernel::kTiles, 2},
                                        gpu::RouterConfig{gpu::RouterKernel::kTiles, 4},
                                        gpu::RouterConfig{gpu::RouterKernel::kTiles, 8},
                                        gpu::RouterConfig{gpu::RouterKernel::kTiles, 16}}) {
      if (cfg.splits > (sh.x_cols + 31) / 32) continue;  // a split needs a 32-column stage
      const bool exact = cfg.kernel == gpu::RouterKernel::kTiles && cfg.splits == 1;
      MOEKIT_CUDA_CHECK(cudaMemset(dl.ptr, 0xff, want.size() * sizeof(float)));  // NaN everywhere
      gpu::launch_router_logits(dx.ptr, sh.T, sh.d, dw.ptr, sh.E, dl.ptr, nullptr, {}, sh.bias ? dlb.ptr : nullptr,
                                sh.x_cols, cfg);
      MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = dl.download(want.size());
      size_t same = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        same += got[i] == want[i];
        ASSERT_NEAR(got[i], want[i], 1e-6 * (1 + std::fabs(want[i])))
            << cfg.to_string() << " T " << sh.T << " E " << sh.E << " at " << i;
      }
      std::printf("[layer] router %s T %d E %d d %d x_cols %d: %zu/%zu logits the same bits\n", cfg.to_string().c_str(),
                  sh.T, sh.E, sh.d, sh.x_cols, same, got.size());
      if (exact) ASSERT_EQ(same, got.size()) << cfg.to_string() << " T " << sh.T << " E " << sh.E << " d " << sh.d;
    }
  }
  // The rule's picks (choose_router_config): tests/host/test_heuristics.cu.
  expect_error([] { gpu::launch_router_logits(nullptr, 1, 512, nullptr, 8, nullptr, nullptr, {}, nullptr, 0,
                                              gpu::RouterConfig{gpu::RouterKernel::kTiles, 17}); },
               {"tiles:17", "expected 1..16 splits"});
  // Rows the kernels' 4-column loads cannot take, refused with the values (before any launch).
  expect_error([] { gpu::launch_router_logits(nullptr, 1, 512, nullptr, 8, nullptr, nullptr, {}, nullptr, 6); },
               {"x_cols = 6", "multiples of 4"});
  expect_error([] { gpu::launch_router_logits(nullptr, 1, 510, nullptr, 8, nullptr, nullptr); }, {"hidden = 510"});
  expect_error([] { gpu::launch_router_logits(nullptr, 1, 512, nullptr, 8, nullptr, nullptr, {}, nullptr, 516); },
               {"x_cols = 516", "x_cols <= hidden"});
}

TEST(GpuLayerErrors, BadInputIsReported) {
  for (gpu::GpuPipeline pipeline : {gpu::GpuPipeline::kStaged, kFused}) {
  const Fixture& f = fixture();
  const int P = 2;
  const Placement placement = make_placement(P, false);
  GpuRig rig(P, gpu::EpMode::kLowLatency, placement, 1, nullptr, pipeline);
  // More tokens than T_max: rejected on the host before anything runs.
  try {
    rig.layers[0]->dispatch(rig.x[0].ptr, 1000, 0, rig.stream);
    ADD_FAILURE() << "T > T_max accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("T_max"), std::string::npos) << e.what();
  }
  // A caller's expert id out of range: the step completes on every rank, check() names it.
  std::mt19937 rng(3);
  const auto x = random_tokens(kBatch, int(f.model.hidden_size), rng);
  std::vector<int32_t> idx;
  std::vector<float> w;
  random_routing(kBatch, f.model.num_routed_experts, f.model.num_experts_per_token, rng, idx, w);
  idx[5] = 999;  // rank 0, token 0, entry 5
  rig.load(x, &idx, &w);
  rig.issue(true);
  try {
    rig.layers[0]->check(rig.stream);
    ADD_FAILURE() << "bad expert id not reported";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("outside"), std::string::npos) << msg;
    EXPECT_NE(msg.find("999"), std::string::npos) << msg;
  }
  rig.layers[1]->check(rig.stream);  // the peer finished its step
  // Bad values in the config are named when the layer is made, whether or not the pipeline uses
  // them. refusal(edit): what making rank 0's layer with that change throws ("" if accepted).
  auto refusal = [&](auto&& edit) -> std::string {
    gpu::GpuLayerConfig c;
    c.max_tokens = rig.group->rank(0).config().max_tokens;
    c.pipeline = pipeline;
    edit(c);
    try {
      gpu::GpuMoeLayer layer(f.model, f.weights, placement, 0, rig.group->rank(0), c);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string ctas = refusal([](gpu::GpuLayerConfig& c) { c.combine_ctas = -3; });
  EXPECT_NE(ctas.find("combine_ctas = -3"), std::string::npos) << "combine_ctas = -3: '" << ctas << "'";
  const std::string toggle = refusal([](gpu::GpuLayerConfig& c) { c.shared_first = 2; });
  EXPECT_NE(toggle.find("shared_first = 2"), std::string::npos) << "shared_first = 2: '" << toggle << "'";
  const int sms = query_device().num_sms;  // the shared expert's own SMs: fewer than the device's
  for (int shared_ctas : {-1, sms}) {
    const std::string msg = refusal([&](gpu::GpuLayerConfig& c) { c.shared_ctas = shared_ctas; });
    EXPECT_NE(msg.find("shared_ctas = " + std::to_string(shared_ctas)), std::string::npos)
        << "shared_ctas = " << shared_ctas << ": '" << msg << "'";
  }
  // The shared expert unmerged over a buffer made with a self slab for it (fused only), named.
  const std::string unmerged = refusal([](gpu::GpuLayerConfig& c) { c.merge_shared = false; });
  if (pipeline == kFused)
    EXPECT_NE(unmerged.find("merge_shared is off"), std::string::npos) << "merge_shared off: '" << unmerged << "'";
  else
    EXPECT_EQ(unmerged, "") << "merge_shared off refused in the staged pipeline";
  // The staged pipeline over a buffer made with a self slab for the fused one, named.
  const std::string staged = refusal([](gpu::GpuLayerConfig& c) { c.pipeline = kStaged; });
  if (pipeline == kFused)
    EXPECT_NE(staged.find("pipeline is staged"), std::string::npos) << "staged over a self slab: '" << staged << "'";
  else
    EXPECT_EQ(staged, "") << "the staged rig's own pipeline refused";
  // The fused threshold: negative refused; below this rig's T_max while its EP buffer was made
  // with a self slab for the default threshold (fused only), named.
  for (int threshold : {-1, 0}) {
    const std::string msg = refusal([&](gpu::GpuLayerConfig& c) { c.fused_max_tokens = threshold; });
    if (threshold < 0 || rig.group->rank(0).config().self_slab)
      EXPECT_NE(msg.find("fused_max_tokens = " + std::to_string(threshold)), std::string::npos)
          << "fused_max_tokens = " << threshold << ": '" << msg << "'";
    else
      EXPECT_EQ(msg, "") << "fused_max_tokens = " << threshold << " refused";
  }
  EXPECT_EQ(rig.group->rank(0).config().self_slab, pipeline == kFused) << "the fixture's shared expert fits a slab";
  EXPECT_THROW(gpu::layer_ep_config(f.model, placement.num_slots, P, 4, gpu::EpMode::kLowLatency, pipeline, -1), Error);
  }
}

// The fused pipeline against the staged one on the same inputs: routing, slots and recv_count
// identical, outputs within the layer bound (and mostly the same bits); and the stage clock: the
// stages each pipeline runs stamped, the ones it fuses away not, every span well formed, also
// from a captured graph.
TEST(GpuLayerFused, EqualsStagedAndStampsItsStages) {
  const Fixture& f = fixture();
  const int P = 4;
  const uint64_t seed = 9;
  const Placement placement = make_placement(P, true);
  GpuRig staged(P, gpu::EpMode::kLowLatency, placement, seed);
  GpuRig fused(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, kFused);
  // The shared expert's own GEMMs in line instead of expert E_loc of the routed ones (over a
  // buffer without a self slab, so the hand-offs run).
  GpuRig inline_shared(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, kFused, false);
  // GEMM2 waiting for GEMM1's grid instead of for each expert's rows: the same bits.
  GpuRig grid_wait(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, kFused, true, 0, size_t(4) << 20, f, false);
  // GEMM1 waiting for the receive's grid instead of taking each expert's rows as they land.
  GpuRig recv_grid(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, kFused, true, 0, size_t(4) << 20, f, true,
                   false);
  // The combine send waiting for GEMM2's grid instead of starting beside it.
  GpuRig combine_grid(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, kFused, true, 0, size_t(4) << 20, f, true,
                      true, false);
  // GEMM1 walking the merged shared expert first, its W1 asked of the L2 while the receive runs.
  GpuRig shared_first(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, kFused, true, 0, size_t(4) << 20, f, true,
                      true, true, [](gpu::GpuLayerConfig& c) { c.shared_first = 1; });
  // The same in line, with every hand-off off (GEMM2 after GEMM1's grid, GEMM1 after the receive's,
  // the combine send after GEMM2's): the same bits as inline_shared's hand-offs.
  GpuRig inline_grid(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, kFused, false, 0, size_t(4) << 20, f, false,
                     false, false);
  EXPECT_FALSE(inline_shared.group->rank(0).config().self_slab) << "unmerged: no self slab, so the hand-offs run";
  for (GpuRig* rig : {&staged, &fused, &inline_shared})
    for (int r = 0; r < P; ++r) rig->layers[r]->set_timeline(true);
  std::mt19937 rng(12);
  for (bool graph : {false, true}) {
    const auto x = random_tokens(kBatch, int(f.model.hidden_size), rng);
    for (GpuRig* rig :
         {&staged, &fused, &inline_shared, &grid_wait, &recv_grid, &combine_grid, &shared_first, &inline_grid}) {
      run_step(*rig, x, graph);
    }
    for (GpuRig* rig : {&fused, &inline_shared}) {
      const std::string what = std::string(rig == &fused ? "fused" : "fused, shared expert in line") +
                               " vs staged" + (graph ? ", graph" : "");
      expect_same_routing_as(*rig, staged, what);
      const auto got = rig->gather_out(), want = staged.gather_out();
      size_t same = 0;
      for (size_t i = 0; i < got.size(); ++i) same += got[i] == want[i];
      const double err = rel_error(got, to_double(want));
      std::printf("[layer] %s: %.3e, %zu / %zu outputs the same bits\n", what.c_str(), err, same, got.size());
      EXPECT_LE(err, kLayerTolerance) << what;
    }
    EXPECT_EQ(fused.gather_out(), grid_wait.gather_out()) << "per-expert readiness against the grid wait"
                                                          << (graph ? ", graph" : "");
    EXPECT_EQ(fused.gather_out(), recv_grid.gather_out()) << "rows as they land against the receive's grid"
                                                          << (graph ? ", graph" : "");
    EXPECT_EQ(fused.gather_out(), combine_grid.gather_out()) << "the combine beside GEMM2 against after its grid"
                                                             << (graph ? ", graph" : "");
    EXPECT_EQ(fused.gather_out(), shared_first.gather_out()) << "the shared expert first in GEMM1's walk"
                                                             << (graph ? ", graph" : "");
    EXPECT_EQ(inline_shared.gather_out(), inline_grid.gather_out())
        << "the shared expert in line: hand-offs against grid waits" << (graph ? ", graph" : "");
    const std::string what = graph ? "stage clock, graph" : "stage clock";
    for (GpuRig* rig : {&staged, &fused, &inline_shared}) {
      const bool is_fused = rig != &staged, merged = rig == &fused;
      const auto clock = rig->layers[0]->last_timeline(rig->stream);
      for (int st = 0; st < int(gpu::GpuStage::kCount); ++st) {
        const auto stage = gpu::GpuStage(st);
        const bool activation = stage == gpu::GpuStage::kActivation || stage == gpu::GpuStage::kSharedActivation;
        const bool shared = stage <= gpu::GpuStage::kSharedGemm2;
        const std::string name = what + ", " + gpu::gpu_stage_name(stage) + (merged ? " (fused)" : is_fused ? " (fused, shared in line)" : " (staged)");
        EXPECT_EQ(clock[st].ran(), !(is_fused && activation) && !(merged && shared)) << name;
        if (clock[st].ran()) EXPECT_LE(clock[st].start_ns, clock[st].end_ns) << name;
      }
      // A stage that waits on the device for the one before (griddepcontrol.wait) starts after it.
      // (Every fused rig here has the hand-offs: GEMM1 waits for each expert's rows instead and may
      // start before the receive ends, and the combine send starts beside GEMM2 and signs off after
      // its grid.)
      auto at = [&](gpu::GpuStage st) { return clock[int(st)]; };
      if (!is_fused) EXPECT_GE(at(gpu::GpuStage::kGemm1).start_ns, at(gpu::GpuStage::kDispatchRecv).end_ns) << what;
      if (is_fused) EXPECT_GE(at(gpu::GpuStage::kCombineSend).end_ns, at(gpu::GpuStage::kGemm2).end_ns) << what;
      else EXPECT_GE(at(gpu::GpuStage::kCombineSend).start_ns, at(gpu::GpuStage::kGemm2).end_ns) << what;
      // The staged side stream joins before the combine receive, which adds the shared expert's rows.
      if (rig == &staged)
        EXPECT_GE(at(gpu::GpuStage::kCombineRecv).start_ns, at(gpu::GpuStage::kSharedGemm2).end_ns) << what;
    }
  }
}

// The fused step at kFusedMaxTokens tokens per rank (above 64, where the receive takes more CTAs
// and the merged shared expert more than one token block of the routed GEMMs) against the staged
// step: routing, slots and recv_count identical, outputs within the layer bound, eagerly and from
// a graph.
TEST(GpuLayerFused, EqualsStagedAtTheFusedLimit) {
  const Fixture& f = fixture();
  const int P = 2, batch = P * gpu::kFusedMaxTokens;
  const uint64_t seed = 21;
  const Placement placement = make_placement(P, true);
  GpuRig staged(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, gpu::GpuPipeline::kStaged, true, 0,
                size_t(4) << 20, f, true, true, true, {}, batch);
  GpuRig fused(P, gpu::EpMode::kLowLatency, placement, seed, nullptr, kFused, true, 0, size_t(4) << 20, f, true, true,
               true, {}, batch);
  ASSERT_EQ(staged.tokens(0), gpu::kFusedMaxTokens);
  EXPECT_TRUE(fused.group->rank(0).config().self_slab) << "the fixture's shared expert fits a slab";
  std::mt19937 rng(22);
  for (bool graph : {false, true}) {
    const auto x = random_tokens(batch, int(f.model.hidden_size), rng);
    for (GpuRig* rig : {&staged, &fused}) {
      run_step(*rig, x, graph);
    }
    const std::string what = std::string("fused at the fused limit vs staged") + (graph ? ", graph" : "");
    expect_same_routing_as(fused, staged, what);
    const double err = rel_error(fused.gather_out(), to_double(staged.gather_out()));
    std::printf("[layer] %s: %.3e\n", what.c_str(), err);
    EXPECT_LE(err, kLayerTolerance) << what;
  }
}

// A peer that never sends, with GEMM1 already running beside the receive (recv_ready): the
// receive times out and publishes zero rows, so the step ends (nothing waits for rows that will
// not come) and check() names the rank, the peer and the step.
TEST(GpuLayerFused, SilentPeerEndsInTheNamedTimeout) {
  const Fixture& f = fixture();
  const int P = 2, t_max = 8, d = int(f.model.hidden_size);
  const Placement placement = make_placement(P, false);
  gpu::EpConfig ec = gpu::layer_ep_config(f.model, placement.num_slots, P, t_max, gpu::EpMode::kLowLatency, kFused);
  ec.timeout_s = 0.05;
  gpu::EpLocalGroup group(ec);
  gpu::GpuLayerConfig cfg;
  cfg.max_tokens = t_max;
  cfg.pipeline = kFused;
  gpu::GpuMoeLayer layer(f.model, f.weights, placement, 0, group.rank(0), cfg);
  std::mt19937 rng(3);
  DeviceArray<uint16_t> x(size_t(t_max) * d), out(size_t(t_max) * d);
  const auto tokens = random_tokens(t_max, d, rng);
  x.upload(tokens.data(), tokens.size());
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto start = std::chrono::steady_clock::now();
  layer.forward_decode(x.ptr, t_max, 0, out.ptr, stream);  // rank 1 never steps
  try {
    layer.check(stream);
    ADD_FAILURE() << "a silent peer must make the step fail";
  } catch (const moekit::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("EP rank 0: dispatch_recv timed out"), std::string::npos) << msg;
    EXPECT_NE(msg.find("waiting for rank 1 at step 1"), std::string::npos) << msg;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
}

// ---- Staged weight moves while serving (layer.h begin_moves .. commit_moves) -----------------

// Runs the move protocol on `rig` (serving `a`) towards `b` with `budget` bytes per step, every
// step checked against the CPU layer under the placement it must use: `a` while the copies run
// and for the barrier step, `b` after the commit (with each stage, so the moved slots hold b's
// experts). peers: the ranks copy from each other's slots (the local transport's pointers);
// else from the host weights. graph: every step replays one graph captured before the moves.
// Returns the steps that ran while copies were in flight, and their mean time next to the steps'.
struct MoveTimes {
  int steps_during = 0;
  double during_us = 0, without_us = 0;
};
MoveTimes move_and_check(GpuRig& rig, const Placement& a, const Placement& b, size_t budget, bool peers, bool graph,
                         const std::string& name, uint64_t seed) {
  const Fixture& f = fixture();
  const int P = rig.P;
  std::mt19937 rng(seed + 1000);
  std::unique_ptr<CapturedStep> captured;
  cudaEvent_t t0, t1;
  MOEKIT_CUDA_CHECK(cudaEventCreate(&t0));
  MOEKIT_CUDA_CHECK(cudaEventCreate(&t1));
  double without_us = 0, during_us = 0;
  int without = 0;
  auto step = [&](const Placement& want, const std::string& what, bool stages, double* time_us) {
    const auto x = random_tokens(kBatch, int(f.model.hidden_size), rng);
    rig.load(x, nullptr, nullptr);
    MOEKIT_CUDA_CHECK(cudaEventRecord(t0, rig.stream));
    if (graph)
      captured->graph.launch(rig.stream);
    else
      rig.issue(false);
    MOEKIT_CUDA_CHECK(cudaEventRecord(t1, rig.stream));
    rig.check();
    float ms = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (time_us) *time_us += 1e3 * ms;
    const CpuResult cpu = run_cpu(P, EpProtocol::kLowLatency, want, x, nullptr, nullptr, seed);
    compare_step(rig, cpu, x, true, what.c_str());
    if (stages)
      for (int r = 0; r < P; ++r) check_stages(rig, r, want, true, what.c_str());
  };
  if (graph) {
    rig.load(random_tokens(kBatch, int(f.model.hidden_size), rng), nullptr, nullptr);
    captured = std::make_unique<CapturedStep>(rig, false);
  }
  for (int i = 0; i < 3; ++i, ++without) step(a, name + ": before the moves", i == 0, &without_us);

  const std::vector<ExpertMove> moves = plan_moves(a, b);
  std::vector<gpu::GpuExpertSlots> slots;
  for (int r = 0; r < P; ++r) slots.push_back(rig.layers[r]->expert_slots());
  int calls = 0;
  for (int r = 0; r < P; ++r) {
    if (peers) rig.layers[r]->set_peer_slots(slots);
    rig.layers[r]->begin_moves(b, 0, moves, peers ? nullptr : &f.weights, rig.stream);
    calls = std::max(calls, rig.layers[0]->advance_calls(r, moves, 0, budget));
  }
  MoveTimes out;
  for (int i = 0; i < calls; ++i) {
    for (int r = 0; r < P; ++r) rig.layers[r]->advance_moves(budget);
    step(a, name + ": copies in flight, step " + std::to_string(i), i == 0, &during_us);
    ++out.steps_during;
  }
  for (int r = 0; r < P; ++r) {
    EXPECT_TRUE(rig.layers[r]->moves_issued()) << name << ": rank " << r << " not done after " << calls << " calls";
    rig.layers[r]->wait_moves(rig.stream);
  }
  step(a, name + ": the barrier step", true, nullptr);
  int switched = 0;
  for (int r = 0; r < P; ++r) switched += rig.layers[r]->commit_moves(rig.stream);
  EXPECT_EQ(switched, int(moves.size())) << name;
  for (int r = 0; r < P; ++r) {
    EXPECT_FALSE(rig.layers[r]->moving()) << name;
    EXPECT_EQ(slots_not_holding(*rig.layers[r], b, r), 0) << name << ": rank " << r << " after the switch";
  }
  for (int i = 0; i < 2; ++i) step(b, name + ": after the switch", i == 0, nullptr);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  out.during_us = out.steps_during ? during_us / out.steps_during : 0;
  out.without_us = without_us / without;
  std::printf("[layer-moves] %s: %zu moves, %d steps with copies in flight (%zu bytes per step): step %.1f us during "
              "the copies, %.1f us before\n",
              name.c_str(), moves.size(), out.steps_during, budget, out.during_us, out.without_us);
  return out;
}

// Moves from peers' slots (the local transport: every rank's pointers are valid here), eager and
// from a graph captured before the moves, both pipelines: staged copies never show in a step, and
// the switch takes effect at the commit, graph included (no pointer changed).
TEST(GpuLayerMoves, StagedMovesSwitchAtTheCommitOnly) {
  const int P = 4;
  const auto placements = drifted_placements(P);
  const Placement &a = placements.first, &b = placements.second;
  const uint64_t seed = 41;
  for (gpu::GpuPipeline pipeline : {gpu::GpuPipeline::kStaged, kFused})
    for (bool graph : {false, true}) {
      const int e_loc = a.slots_per_gpu();
      GpuRig rig(P, gpu::EpMode::kLowLatency, a, seed, nullptr, pipeline, true, e_loc, size_t(64) << 10);
      const std::string name = std::string("peers, ") + gpu::gpu_pipeline_name(pipeline) + (graph ? ", graph" : ", eager");
      const MoveTimes t = move_and_check(rig, a, b, size_t(512) << 10, true, graph, name, seed);
      EXPECT_GE(t.steps_during, 2) << name << ": the copies did not span several steps";
    }
}

// The host fallback (a transport with no peer mapping): the same protocol from the host weights.
TEST(GpuLayerMoves, HostCopiesWhenNoPeerIsMapped) {
  const int P = 4;
  const auto placements = drifted_placements(P);
  const Placement &a = placements.first, &b = placements.second;
  GpuRig rig(P, gpu::EpMode::kLowLatency, a, 43, nullptr, gpu::GpuPipeline::kStaged, true, a.slots_per_gpu(),
             size_t(64) << 10);
  move_and_check(rig, a, b, size_t(1) << 20, false, false, "host copies", 43);
}

// An aborted move leaves the old placement serving; a later plan still goes through.
TEST(GpuLayerMoves, AbortKeepsTheOldPlacement) {
  const Fixture& f = fixture();
  const int P = 2;
  const auto placements = drifted_placements(P);
  const Placement &a = placements.first, &b = placements.second;
  const uint64_t seed = 45;
  GpuRig rig(P, gpu::EpMode::kLowLatency, a, seed, nullptr, gpu::GpuPipeline::kStaged, true, a.slots_per_gpu(),
             size_t(64) << 10);
  const std::vector<ExpertMove> moves = plan_moves(a, b);
  for (int r = 0; r < P; ++r) {
    rig.layers[r]->begin_moves(b, 0, moves, &f.weights, rig.stream);
    rig.layers[r]->advance_moves(size_t(256) << 10);
  }
  for (int r = 0; r < P; ++r) {
    rig.layers[r]->abort_moves();
    EXPECT_EQ(slots_not_holding(*rig.layers[r], a, r), 0) << "rank " << r << " after abort";
  }
  std::mt19937 rng(5);
  const auto x = random_tokens(kBatch, int(f.model.hidden_size), rng);
  rig.load(x, nullptr, nullptr);
  rig.issue(false);
  rig.check();
  compare_step(rig, run_cpu(P, EpProtocol::kLowLatency, a, x, nullptr, nullptr, seed), x, true, "after abort");
  for (int r = 0; r < P; ++r) check_stages(rig, r, a, true, "after abort");
  move_and_check(rig, a, b, size_t(1) << 20, false, false, "after an aborted plan", seed);
}

TEST(GpuLayerMoves, BadUseIsNamed) {
  const Fixture& f = fixture();
  const int P = 2;
  const auto placements = drifted_placements(P);
  const Placement &a = placements.first, &b = placements.second;
  const std::vector<ExpertMove> moves = plan_moves(a, b);
  auto expect = [](auto&& call, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "no error, expected '" << fragment << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  {
    GpuRig plain(P, gpu::EpMode::kLowLatency, a, 1);
    expect([&] { plain.layers[0]->begin_moves(b, 0, moves, &f.weights, plain.stream); }, "staging_slots = 0");
  }
  GpuRig small(P, gpu::EpMode::kLowLatency, a, 1, nullptr, gpu::GpuPipeline::kStaged, true, 1);
  expect([&] { small.layers[0]->begin_moves(b, 0, moves, &f.weights, small.stream); }, "more than its staging_slots = 1");
  GpuRig rig(P, gpu::EpMode::kLowLatency, a, 1, nullptr, gpu::GpuPipeline::kStaged, true, a.slots_per_gpu(),
             size_t(64) << 10);
  gpu::GpuMoeLayer& layer = *rig.layers[0];
  expect([&] { layer.begin_moves(b, 0, moves, nullptr, rig.stream); }, "no host weights were given");
  std::vector<ExpertMove> wrong = moves;
  wrong.pop_back();
  expect([&] { layer.begin_moves(b, 0, wrong, &f.weights, rig.stream); }, "no move fills it");
  expect([&] { layer.begin_moves(b, 1, moves, &f.weights, rig.stream); }, "for placement layer 1, but this layer serves layer 0");
  expect([&] { layer.commit_moves(rig.stream); }, "without moves in flight");
  expect([&] { layer.set_peer_slots({}); }, "set_peer_slots with 0 entries, expected one per rank (2)");
  layer.begin_moves(b, 0, moves, &f.weights, rig.stream);
  expect([&] { layer.begin_moves(b, 0, moves, &f.weights, rig.stream); }, "still in flight");
  expect([&] { layer.set_placement(b, 0, f.weights, rig.stream); }, "while moves are in flight");
  if (layer.move_bytes() > (size_t(64) << 10)) {
    layer.advance_moves(1);
    expect([&] { layer.wait_moves(rig.stream); }, "issue every chunk first");
  }
  while (!layer.moves_issued()) layer.advance_moves(size_t(1) << 30);
  expect([&] { layer.commit_moves(rig.stream); }, "call wait_moves and run one step first");
  layer.abort_moves();
  EXPECT_FALSE(layer.moving());
}

}  // namespace
