// The GPU MoE layer (layer.h) on a gpt-oss-style model against the CPU layer (layer_cpu.h) and the
// float64 oracle: MXFP4 experts with biases, a router with a logit bias, top-4 then softmax, the
// clamped SwiGLU (limit 1, so that both clamps act often), hidden 160 and inter 96 (padded to 256
// and 128 by the loader and the layer: the padding paths run). Random weights written by the
// checkpoint generator and read back, fresh random tokens, outputs poisoned first. Decode (staged
// and fused) and prefill for P in {1, 2, 4} virtual ranks, with the router and with the caller's
// routing; GEMM1 of every rank against reference.h's MXFP4 GEMM on the same received rows; the
// gate and the activation kernels alone against their references; a step captured in a graph and
// replayed with new tokens and a new placement (set_placement); prefill through an FP8 copy of the
// weights on one workspace the caller gives every layer; what MXFP4 layers refuse.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "expect_error.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/gating.cuh"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/ep_cpu.h"
#include "moekit/eplb.h"
#include "moekit/gating.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"
#include "moekit/reference.h"
#include "moekit/spec.h"
#include "moekit/weights.h"
#include "oss_test_model.h"
#include "test_layer_reference.h"

using namespace moekit;
using namespace layer_test;

namespace {

const Fixture& oss() {
  static const Fixture f(parse_model_spec(testing_models::kOssModelJson, "oss_test_model.h"), 9);
  return f;
}

int d_model() { return int(oss().model.hidden_size); }

Placement oss_placement(int P, bool redundant) {
  const int E = oss().model.num_routed_experts;
  if (!redundant) return identity_placement(E, P);
  std::vector<double> load(E, 1.0);
  for (int e = 0; e < 4; ++e) load[e] = 6.0;
  return balanced_placement(load, P * 2, P);
}

CpuResult run_cpu_oss(int P, EpProtocol protocol, const Placement& placement, const std::vector<uint16_t>& x,
                      const std::vector<int32_t>* idx, const std::vector<float>* w, uint64_t seed) {
  return run_cpu(P, protocol, placement, x, idx, w, seed, oss());
}

GpuRig oss_rig(int P, gpu::EpMode mode, const Placement& placement, uint64_t seed, gpu::GpuPipeline pipeline) {
  return GpuRig(P, mode, placement, seed, nullptr, pipeline, true, 0, size_t(4) << 20, oss());
}

// Routing, recv_count and output against the CPU layer; output against the float64 oracle.
void compare_step(GpuRig& rig, const CpuResult& cpu, const std::vector<uint16_t>& x, const std::string& what) {
  const std::vector<uint16_t> got = rig.gather_out();
  size_t nan = 0;
  for (uint16_t v : got) nan += std::isnan(bf16_to_float(v));
  ASSERT_EQ(nan, 0u) << what << ": output values left poisoned or NaN";
  expect_same_routing(rig, cpu, what);
  if (::testing::Test::HasFatalFailure()) return;
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);
  std::vector<double> oracle(x.size());
  // The oracle quantises as the layer does: per token in normal mode (layer_fp8_scaling).
  LayerOracle(oss().model, oss().weights).run(xf.data(), kBatch, cpu.topk_idx.data(), cpu.topk_weights.data(),
                                              oracle.data(), rig.group->rank(0).config().x_scaling);
  const double vs_cpu = rel_error(got, to_double(cpu.out)), gpu_err = rel_error(got, oracle),
               cpu_err = rel_error(cpu.out, oracle);
  size_t same = 0;
  for (size_t i = 0; i < got.size(); ++i) same += got[i] == cpu.out[i];
  std::printf("[layer-mxfp4] %s: GPU vs CPU layer %.3e, GPU vs f64 oracle %.3e, CPU vs oracle %.3e; %zu/%zu outputs "
              "the same bits\n", what.c_str(), vs_cpu, gpu_err, cpu_err, same, got.size());
  EXPECT_LE(vs_cpu, kLayerTolerance) << what;
  EXPECT_LE(gpu_err, kLayerTolerance) << what;
}

// Rank r's GEMM1 (decode) against reference.h's MXFP4 GEMM on the rows the GPU received, with the
// checkpoint's codes and scales of the rank's slots: the GEMM library's bound (3e-3 rms relative).
void check_gemm1(GpuRig& rig, int r, const Placement& placement, const std::string& what) {
  const MoeLayerWeights& lw = oss().weights;
  const int d = int(lw.padded_hidden), inter = int(lw.padded_intermediate), e_loc = rig.layers[r]->num_local_experts();
  const auto eb = rig.layers[r]->expert_buffers();
  ASSERT_NE(eb.gate_up, nullptr) << "MXFP4 layers write GEMM1's BF16 output";
  const int rows = eb.rows;
  const size_t total = size_t(e_loc) * rows;
  gpu::EpBuffer& ep = rig.group->rank(r);
  // The rows arrive in the MXFP4 GEMM's K order (EpConfig::mxfp4_k_order); reference.h's GEMM
  // reads the natural one.
  const auto recv_gemm_order = download(ep.recv_x(), total * d);
  std::vector<uint8_t> recv_x(recv_gemm_order.size());
  for (size_t row = 0; row < total; ++row)
    for (int p = 0; p < d; ++p) recv_x[row * d + size_t(mxfp4_k_source(p))] = recv_gemm_order[row * d + p];
  const auto recv_scales = download(ep.recv_scales(), total * (d / 128));
  const auto count = download(ep.recv_count(), size_t(e_loc));
  const auto gate_up = download(eb.gate_up, total * 2 * inter);
  const Mxfp4ExpertWeights& w1 = lw.w1_mxfp4;
  const Mxfp4WeightLayout l1{e_loc, w1.layout.n, w1.layout.k};
  std::vector<uint8_t> codes, scales;
  std::vector<float> bias;
  for (int i = 0; i < e_loc; ++i) {
    const size_t e = size_t(placement.phy2log_row(0)[r * e_loc + i]);
    const size_t c_per = size_t(l1.n) * l1.row_bytes(), s_per = size_t(l1.n) * l1.row_scales();
    codes.insert(codes.end(), w1.w.begin() + e * c_per, w1.w.begin() + (e + 1) * c_per);
    scales.insert(scales.end(), w1.scales.begin() + e * s_per, w1.scales.begin() + (e + 1) * s_per);
    bias.insert(bias.end(), w1.bias.begin() + e * l1.n, w1.bias.begin() + (e + 1) * l1.n);
  }
  std::vector<uint16_t> want(gate_up.size());
  ref::grouped_gemm_masked_mxfp4(MaskedLayout{e_loc, rows, d}, recv_x.data(), recv_scales.data(), count.data(), l1,
                                 codes.data(), scales.data(), bias.data(), want.data());
  double num = 0, den = 0;
  for (int e = 0; e < e_loc; ++e)
    for (int m = 0; m < count[e]; ++m)
      for (int c = 0; c < 2 * inter; ++c) {
        const size_t i = (size_t(e) * rows + m) * 2 * inter + c;
        const double g = bf16_to_float(gate_up[i]), v = bf16_to_float(want[i]);
        num += (g - v) * (g - v);
        den += v * v;
      }
  const double err = den > 0 ? std::sqrt(num / den) : 0.0;
  std::printf("[layer-mxfp4] %s rank %d: GEMM1 vs reference.h %.3e\n", what.c_str(), r, err);
  EXPECT_LE(err, 3e-3) << what << ": GEMM1 of rank " << r;
}

struct Case {
  int P;
  bool redundant;
  bool decode;
  gpu::GpuPipeline pipeline = gpu::GpuPipeline::kStaged;
};

class GpuLayerMxfp4 : public ::testing::TestWithParam<Case> {};

TEST_P(GpuLayerMxfp4, EqualsCpuLayer) {
  const Case c = GetParam();
  const Placement placement = oss_placement(c.P, c.redundant);
  const uint64_t seed = 21;
  GpuRig rig = oss_rig(c.P, c.decode ? gpu::EpMode::kLowLatency : gpu::EpMode::kNormal, placement, seed, c.pipeline);
  ASSERT_EQ(rig.group->rank(0).config().hidden, 256) << "the EP buffer runs the padded hidden size";
  ASSERT_EQ(rig.group->rank(0).config().x_scaling, Fp8Scaling::kPerToken)
      << "an MXFP4 layer scales its FP8 activations per token";
  std::mt19937 rng(300 + c.P);
  for (int step = 0; step < 2; ++step) {
    const auto x = random_tokens(kBatch, d_model(), rng);
    std::vector<int32_t> idx;
    std::vector<float> w;
    const bool caller = step == 1;
    if (caller) random_routing(kBatch, oss().model.num_routed_experts, oss().model.num_experts_per_token, rng, idx, w);
    const CpuResult cpu = run_cpu_oss(c.P, c.decode ? EpProtocol::kLowLatency : EpProtocol::kNormal, placement, x,
                                    caller ? &idx : nullptr, caller ? &w : nullptr, seed);
    rig.load(x, caller ? &idx : nullptr, caller ? &w : nullptr);
    rig.issue(caller);
    rig.check();
    const std::string what = std::string(c.decode ? "decode" : "prefill") + " P=" + std::to_string(c.P) +
                             (c.redundant ? " +redundant" : "") + (caller ? " caller routing" : " router") + " " +
                             gpu::gpu_pipeline_name(c.pipeline);
    compare_step(rig, cpu, x, what);
    if (c.decode)
      for (int r = 0; r < c.P; ++r) check_gemm1(rig, r, placement, what);
  }
}

constexpr gpu::GpuPipeline kFused = gpu::GpuPipeline::kFused;
INSTANTIATE_TEST_SUITE_P(Decode, GpuLayerMxfp4,
                         ::testing::Values(Case{1, false, true}, Case{2, false, true}, Case{4, false, true},
                                           Case{4, true, true}, Case{2, false, true, kFused},
                                           Case{4, true, true, kFused}));
INSTANTIATE_TEST_SUITE_P(Prefill, GpuLayerMxfp4,
                         ::testing::Values(Case{1, false, false}, Case{2, false, false}, Case{4, true, false}));

// One step of 2 ranks captured once: replays with new tokens, then after set_placement (the MXFP4
// slots rewritten in the GEMM's encodings) with the new placement's routing slots and output.
TEST(GpuLayerMxfp4Graph, ReplayWithNewDataAndPlacement) {
  const int P = 2;
  const uint64_t seed = 4;
  const Placement first = oss_placement(P, true);
  std::vector<double> load(oss().model.num_routed_experts, 1.0);
  for (int e = 12; e < 16; ++e) load[e] = 6.0;
  const Placement second = balanced_placement(load, first.num_slots - first.num_experts, P);
  GpuRig rig = oss_rig(P, gpu::EpMode::kLowLatency, first, seed, gpu::GpuPipeline::kStaged);
  std::mt19937 rng(77);
  auto x = random_tokens(kBatch, d_model(), rng);
  rig.load(x, nullptr, nullptr);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(rig.stream, cudaStreamCaptureModeThreadLocal));
  rig.issue(false);
  MOEKIT_CUDA_CHECK(cudaStreamEndCapture(rig.stream, &graph));
  MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    const Placement& placement = replay < 2 ? first : second;
    if (replay == 2) {
      int moved = 0;
      for (int r = 0; r < P; ++r) moved += rig.layers[r]->set_placement(second, 0, oss().weights, rig.stream);
      EXPECT_GT(moved, 0) << "the second placement moves slots";
    }
    x = random_tokens(kBatch, d_model(), rng);
    rig.load(x, nullptr, nullptr);
    MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, rig.stream));
    rig.check();
    const CpuResult cpu = run_cpu_oss(P, EpProtocol::kLowLatency, placement, x, nullptr, nullptr, seed);
    compare_step(rig, cpu, x, "graph replay " + std::to_string(replay));
    for (int r = 0; r < P; ++r) check_gemm1(rig, r, placement, "graph replay " + std::to_string(replay));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Sets an environment variable for a scope and puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

// Prefill through an FP8 copy of the weights (MOEKIT_MXFP4_PREFILL=copy), every GEMM of both ranks
// on one caller workspace (GpuLayerConfig::fp8_copy_workspace): poisoned first, written by the
// step, and the outputs within the layer's bound of the CPU layer and the oracle, two steps in a
// row (each rank's GEMM2 copy overwrites its GEMM1 copy, and the next rank's overwrites both). A
// workspace one byte short is refused by name.
TEST(GpuLayerMxfp4Copy, PrefillOnOneSharedFp8Copy) {
  const ScopedEnv knob("MOEKIT_MXFP4_PREFILL", "copy");
  const int P = 2;
  const uint64_t seed = 31;
  const Placement placement = oss_placement(P, true);
  const gpu::EpConfig ec =
      gpu::layer_ep_config(oss().model, placement.num_slots, P, (kBatch + P - 1) / P, gpu::EpMode::kNormal);
  const size_t bytes = gpu::gpu_layer_fp8_copy_bytes(oss().model, ec);
  const MoeLayerWeights& lw = oss().weights;
  EXPECT_EQ(bytes, size_t(placement.num_slots / P) * 2 * lw.padded_intermediate * lw.padded_hidden)
      << "E_loc x 2 inter x d of the padded sizes";
  DeviceArray<uint8_t> workspace(bytes);
  const std::vector<uint8_t> poison(bytes, 0x7f);  // e4m3 NaN: a byte the copy never writes
  workspace.upload(poison.data(), poison.size());
  const auto share = [&](gpu::GpuLayerConfig& cfg) {
    cfg.fp8_copy_workspace = workspace.ptr;
    cfg.fp8_copy_workspace_bytes = bytes;
  };
  GpuRig rig(P, gpu::EpMode::kNormal, placement, seed, nullptr, gpu::GpuPipeline::kStaged, true, 0, size_t(4) << 20,
             oss(), true, true, true, share);
  std::mt19937 rng(41);
  for (int step = 0; step < 2; ++step) {
    const auto x = random_tokens(kBatch, d_model(), rng);
    rig.load(x, nullptr, nullptr);
    rig.issue(false);
    rig.check();
    const CpuResult cpu = run_cpu_oss(P, EpProtocol::kNormal, placement, x, nullptr, nullptr, seed);
    compare_step(rig, cpu, x, "prefill on one FP8 copy, step " + std::to_string(step));
  }
  const auto after = workspace.download(bytes);
  size_t written = 0;
  for (uint8_t v : after) written += v != 0x7f;
  EXPECT_EQ(written, bytes) << "GEMM1's copy fills the caller's workspace (E_loc x 2 inter x d)";

  const auto short_by_one = [&](gpu::GpuLayerConfig& cfg) {
    cfg.fp8_copy_workspace = workspace.ptr;
    cfg.fp8_copy_workspace_bytes = bytes - 1;
  };
  try {
    GpuRig small(P, gpu::EpMode::kNormal, placement, seed, nullptr, gpu::GpuPipeline::kStaged, true, 0,
                 size_t(4) << 20, oss(), true, true, true, short_by_one);
    FAIL() << "a workspace one byte short was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_copy_workspace_bytes = " + std::to_string(bytes - 1)),
              std::string::npos) << e.what();
  }
}

// The gate alone: the logit bias and top-k-then-softmax against gating.h, the same experts and
// weights within fp64 exp's last bits.
TEST(GpuLayerMxfp4Kernels, GateMatchesReference) {
  const int T = 200, E = 128, k = 4, hidden = 256;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(size_t(T) * hidden);
  for (auto& v : x) v = float_to_bf16(normal(rng));
  std::vector<float> router(size_t(E) * hidden), bias(E);
  for (auto& v : router) v = normal(rng) / 16.0f;
  for (auto& v : bias) v = normal(rng);
  RouterSpec spec;
  spec.scoring = "topk_softmax";
  spec.normalize_topk = true;
  std::vector<float> xf(x.size()), want_logits(size_t(T) * E), want_w(size_t(T) * k);
  std::vector<int32_t> want_idx(size_t(T) * k);
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);
  ref::router_logits(xf.data(), T, hidden, router.data(), E, want_logits.data(), bias.data());
  ref::select_experts(want_logits.data(), T, E, k, spec, nullptr, want_idx.data(), want_w.data());

  DeviceArray<uint16_t> dx(x.size());
  DeviceArray<float> drouter(router.size()), dbias(E), dlogits(size_t(T) * E), dw(size_t(T) * k);
  DeviceArray<int32_t> didx(size_t(T) * k);
  DeviceArray<gpu::LayerStatus> status(1);
  dx.upload(x.data(), x.size());
  drouter.upload(router.data(), router.size());
  dbias.upload(bias.data(), bias.size());
  MOEKIT_CUDA_CHECK(cudaMemset(status.ptr, 0, sizeof(gpu::LayerStatus)));
  gpu::RouterParams params;
  params.topk_softmax = true;
  gpu::launch_router_logits(dx.ptr, T, hidden, drouter.ptr, E, dlogits.ptr, nullptr, {}, dbias.ptr);
  gpu::launch_select_experts(dlogits.ptr, T, E, k, params, nullptr, didx.ptr, dw.ptr, status.ptr, nullptr);
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  const auto logits = dlogits.download(want_logits.size());
  size_t logit_diff = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    logit_diff += std::memcmp(&logits[i], &want_logits[i], 4) != 0;
    ASSERT_NEAR(logits[i], want_logits[i], 1e-6 * (1 + std::fabs(want_logits[i]))) << "logit " << i;
  }
  EXPECT_LE(logit_diff, logits.size() / 100) << "fp64 sums rounded once differ only where the order matters";
  {  // x as rows of 160 columns (a padded hidden size, x_cols): the same bits as x zero-padded to 256
    const int cols = 160;
    std::vector<uint16_t> x_short(size_t(T) * cols), x_zero(x.size(), 0);
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < cols; ++i) x_short[size_t(t) * cols + i] = x_zero[size_t(t) * hidden + i] = x[size_t(t) * hidden + i];
    DeviceArray<uint16_t> dshort(x_short.size());
    DeviceArray<float> dlogits2(size_t(T) * E);
    dshort.upload(x_short.data(), x_short.size());
    dx.upload(x_zero.data(), x_zero.size());
    gpu::launch_router_logits(dx.ptr, T, hidden, drouter.ptr, E, dlogits.ptr, nullptr, {}, dbias.ptr);
    gpu::launch_router_logits(dshort.ptr, T, hidden, drouter.ptr, E, dlogits2.ptr, nullptr, {}, dbias.ptr, cols);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(dlogits2.download(size_t(T) * E), dlogits.download(size_t(T) * E)) << "x_cols = " << cols;
  }
  // Routing on the reference's own logits, so that a last-bit logit difference cannot flip a choice.
  dlogits.upload(want_logits.data(), want_logits.size());
  gpu::launch_select_experts(dlogits.ptr, T, E, k, params, nullptr, didx.ptr, dw.ptr, status.ptr, nullptr);
  EXPECT_EQ(didx.download(want_idx.size()), want_idx);
  const auto w = dw.download(want_w.size());
  for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], want_w[i], 1e-6f * want_w[i]) << "weight " << i;
  for (int t = 0; t < T; ++t) {
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += w[size_t(t) * k + j];
    EXPECT_NEAR(sum, 1.0f, 1e-6f) << "token " << t << ": a softmax over the k sums to 1";
  }
}

// The clamped SwiGLU + FP8 kernel alone against reference.h's, on values that cross both clamps.
TEST(GpuLayerMxfp4Kernels, ClampedSwigluMatchesReference) {
  const int E = 3, M = 12, inter = 256;
  const ref::Activation ref_act{ref::Activation::Kind::kClampedSwiglu, 1.702f, 7.0f};
  const gpu::ActivationTable table(ref_act);
  const GpuActivation& act = table.act();
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 6.0f);
  std::vector<uint16_t> gate_up(size_t(E) * M * 2 * inter);
  for (auto& v : gate_up) v = float_to_bf16(normal(rng));
  const std::vector<int32_t> masked_m = {M, 5, 0};
  DeviceArray<uint16_t> dg(gate_up.size());
  DeviceArray<int32_t> dm(E);
  DeviceArray<uint8_t> dq(size_t(E) * M * inter);
  DeviceArray<float> ds(size_t(E) * M * (inter / 128));
  dg.upload(gate_up.data(), gate_up.size());
  dm.upload(masked_m.data(), E);
  gpu::launch_silu_mul_quant_masked(dg.ptr, E, M, inter, dm.ptr, dq.ptr, ds.ptr, nullptr, {}, act);
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> want_q(dq.count);
  std::vector<float> want_s(ds.count);
  ref::activation_quant_masked(ref_act, MaskedLayout{E, M, inter}, gate_up.data(), masked_m.data(), want_q.data(),
                               want_s.data());
  const auto q = dq.download(dq.count);
  const auto s = ds.download(ds.count);
  size_t diff = 0, n = 0, scale_diff = 0;
  for (int e = 0; e < E; ++e)
    for (int m = 0; m < masked_m[e]; ++m) {
      for (int c = 0; c < inter; ++c) {
        const size_t i = (size_t(e) * M + m) * inter + c;
        diff += q[i] != want_q[i];
        ++n;
      }
      for (int b = 0; b < inter / 128; ++b) {
        const size_t i = (size_t(e) * (inter / 128) + b) * M + m;
        scale_diff += std::memcmp(&s[i], &want_s[i], 4) != 0;
      }
    }
  std::printf("[layer-mxfp4] clamped SwiGLU: %zu of %zu codes and %zu scales differ from reference.h\n", diff, n,
              scale_diff);
  EXPECT_LE(diff, 2 + n / 1000) << "a rare expf halfway case aside, the same bits";
  EXPECT_EQ(scale_diff, 0u);

  // In the MXFP4 GEMM's K order (an MXFP4 layer's GEMM2 input): the same bytes, permuted inside
  // each 128-column block, and the same scales.
  GpuActivation permuted = act;
  permuted.mxfp4_k_order = true;
  dq.upload(std::vector<uint8_t>(dq.count, 0x7F).data(), dq.count);
  gpu::launch_silu_mul_quant_masked(dg.ptr, E, M, inter, dm.ptr, dq.ptr, ds.ptr, nullptr, {}, permuted);
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  const auto qp = dq.download(dq.count);
  const auto sp = ds.download(ds.count);
  size_t moved = 0;
  for (int e = 0; e < E; ++e)
    for (int m = 0; m < masked_m[e]; ++m)
      for (int c = 0; c < inter; ++c) {
        const size_t row = (size_t(e) * M + m) * inter;
        moved += qp[row + c] != q[row + mxfp4_k_source(c)];
      }
  EXPECT_EQ(moved, 0u) << "the K-ordered output is the natural one permuted";
  EXPECT_EQ(std::memcmp(sp.data(), s.data(), s.size() * sizeof(float)), 0);
}

// What an MXFP4 layer refuses, by name.
TEST(GpuLayerMxfp4Errors, RefusalsAreNamed) {
  const Placement placement = oss_placement(2, false);
  const gpu::EpConfig ec = gpu::layer_ep_config(oss().model, placement.num_slots, 2, 8, gpu::EpMode::kLowLatency);
  gpu::EpLocalGroup group(ec);
  gpu::GpuLayerConfig cfg;
  cfg.max_tokens = 8;
  cfg.staging_slots = 1;
  try {
    gpu::GpuMoeLayer layer(oss().model, oss().weights, placement, 0, group.rank(0), cfg);
    FAIL() << "staging_slots on an MXFP4 layer was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("staging_slots = 1"), std::string::npos) << e.what();
  }
  cfg.staging_slots = 0;
  gpu::GpuMoeLayer layer(oss().model, oss().weights, placement, 0, group.rank(0), cfg);
  EXPECT_FALSE(layer.expert_slots().valid());
  try {
    layer.map_peer_slots();
    FAIL() << "map_peer_slots on an MXFP4 layer was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MXFP4"), std::string::npos) << e.what();
  }
  // A buffer made by hand with 1x128 scales, in either mode: the layer names both scalings.
  for (const gpu::EpMode mode : {gpu::EpMode::kNormal, gpu::EpMode::kLowLatency}) {
    gpu::EpConfig by_hand = gpu::layer_ep_config(oss().model, placement.num_slots, 2, 8, mode);
    ASSERT_EQ(by_hand.x_scaling, Fp8Scaling::kPerToken);
    by_hand.x_scaling = Fp8Scaling::kPerBlock;
    gpu::EpLocalGroup blocks(by_hand);
    expect_error([&] { gpu::GpuMoeLayer l(oss().model, oss().weights, placement, 0, blocks.rank(0), cfg); },
                 {"x_scaling = 1x128", "per-token"});
  }
}

}  // namespace
