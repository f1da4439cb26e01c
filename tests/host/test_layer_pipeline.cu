// Which pipeline a GpuMoeLayer runs and with which hand-offs (layer_pipeline.h), decided without a
// GPU from the layer's shapes and GpuLayerConfig: the decode step of DeepSeek-V3 and Qwen3.5 as
// rank 0 of EP8 and of gpt-oss-120b on one rank at the issue's batches, and every refusal named.
#include <gtest/gtest.h>

#include <initializer_list>
#include <set>
#include <string>

#include "expect_error.h"
#include "layer/cuda/layer_pipeline.h"
#include "moekit/ep.h"
#include "moekit/layer.h"
#include "moekit/spec.h"
#include "moekit/weights.h"

using namespace moekit;
using namespace moekit::gpu;

namespace {

// Rank 0 of EP8 at global batch B (B / 8 tokens a rank), fused, with the EP buffer
// layer_ep_config makes for it (a self slab where the shared expert is merged), on 132 SMs.
LayerPipelineInputs ep8(int e_loc, int d, int inter, int topk, int batch) {
  LayerPipelineInputs in;
  in.cfg.pipeline = GpuPipeline::kFused;
  in.t_max = batch / 8;
  in.shared_slot = true;
  in.self_slab = in.t_max <= in.cfg.fused_max_tokens;
  in.num_ranks = 8;
  in.e_loc = e_loc, in.d = d, in.inter = inter;
  in.m_max = 8 * in.t_max;
  in.planned_m = layer_planned_m(0, 8, in.t_max, topk, 8 * e_loc, in.m_max);
  in.num_sms = 132;
  return in;
}
LayerPipelineInputs deepseek(int batch) { return ep8(32, 7168, 2048, 8, batch); }
LayerPipelineInputs qwen(int batch) { return ep8(64, 4096, 1024, 10, batch); }

std::string plan(const LayerPipelineInputs& in) { return choose_layer_pipeline(in).to_string(); }

}  // namespace

// The issue's batches: gated GEMM1 where its tiles hold at most 32 tokens (B = 8..256), the
// receive's CTAs by tokens per rank (8 at one token, then T / 4 within 16..64), the combine send
// on the EP buffer's grid; fused up to 512 tokens per rank (kFusedMaxTokens).
TEST(LayerPipeline, DeepSeekV3AndQwenDecodeAsRank0OfEp8) {
  EXPECT_EQ(plan(deepseek(8)), "fused merged gated recv_ctas=8 combine_ctas=132");
  EXPECT_EQ(plan(deepseek(64)), "fused merged gated recv_ctas=16 combine_ctas=132");
  EXPECT_EQ(plan(deepseek(256)), "fused merged gated recv_ctas=16 combine_ctas=132");
  EXPECT_EQ(plan(deepseek(1024)), "fused merged recv_ctas=32 combine_ctas=132");  // 48-token tiles
  EXPECT_EQ(plan(deepseek(2048)), "fused merged recv_ctas=64 combine_ctas=132");
  EXPECT_EQ(plan(deepseek(4096)), "fused merged recv_ctas=64 combine_ctas=132");  // 512 a rank
  EXPECT_EQ(plan(deepseek(8192)), "staged");
  EXPECT_EQ(plan(qwen(8)), "fused merged gated recv_ctas=8 combine_ctas=132");
  EXPECT_EQ(plan(qwen(256)), "fused merged gated recv_ctas=16 combine_ctas=132");
  EXPECT_EQ(plan(qwen(2048)), "fused merged recv_ctas=64 combine_ctas=132");
  LayerPipelineInputs prefill = deepseek(8192);
  prefill.decode = false;
  EXPECT_EQ(plan(prefill), "staged");
  LayerPipelineInputs staged = deepseek(256);
  staged.cfg.pipeline = GpuPipeline::kStaged;
  staged.self_slab = false;
  EXPECT_EQ(plan(staged), "staged");
}

// The config's own knobs: the receive's and the combine send's CTAs (at most the EP buffer's), the
// hand-offs off, no receive on one rank, an unmerged shared expert (no self slab: the routed
// experts are the buffer's slabs, the hand-offs stay).
TEST(LayerPipeline, KnobsAndOneRank) {
  LayerPipelineInputs in = deepseek(256);
  in.cfg.recv_ctas = 200;
  in.ep_ctas = 64;
  EXPECT_EQ(plan(in), "fused merged gated recv_ctas=64 combine_ctas=64");
  in.cfg.recv_ctas = 24;
  in.cfg.combine_ctas = 40;
  EXPECT_EQ(plan(in), "fused merged gated recv_ctas=24 combine_ctas=40");
  in.cfg.recv_ready = false;
  in.cfg.combine_ready = false;
  EXPECT_EQ(plan(in), "fused merged gated");
  LayerPipelineInputs unmerged = deepseek(256);
  unmerged.cfg.merge_shared = false;
  unmerged.self_slab = false;
  EXPECT_EQ(plan(unmerged), "fused gated recv_ctas=16 combine_ctas=132");
  LayerPipelineInputs one = deepseek(256);
  one.num_ranks = 1;
  EXPECT_EQ(plan(one), "fused merged gated combine_ctas=132");
}

// gpt-oss-120b on one rank (MXFP4 experts, the clamped SwiGLU, no shared expert): fused to 512
// tokens, never gated and without the FP8 hand-offs; B = 1024 runs staged.
TEST(LayerPipeline, GptOssOnOneRank) {
  LayerPipelineInputs in;
  in.cfg.pipeline = GpuPipeline::kFused;
  in.mxfp4 = true;
  in.clamped_swiglu = true;
  in.e_loc = 128, in.d = 2944, in.inter = 2944, in.num_sms = 132;
  for (int batch : {1, 64, 256, 512}) {
    in.t_max = in.m_max = batch;
    in.planned_m = layer_planned_m(0, 1, batch, 4, 128, in.m_max);
    EXPECT_EQ(plan(in), "fused") << "B = " << batch;
  }
  in.t_max = in.m_max = 1024;
  EXPECT_EQ(plan(in), "staged");
}

// Bad knobs and an EP buffer made for another pipeline, refused with the value and the fix.
TEST(LayerPipeline, RefusalsNameTheValue) {
  auto refused = [](void (*change)(LayerPipelineInputs&), std::initializer_list<std::string> fragments) {
    LayerPipelineInputs in = deepseek(256);
    change(in);
    expect_error([&] { choose_layer_pipeline(in); }, fragments);
  };
  refused([](LayerPipelineInputs& in) { in.cfg.fused_max_tokens = -1; }, {"fused_max_tokens = -1"});
  refused([](LayerPipelineInputs& in) { in.self_slab = false; },
          {"needs an EpBuffer with self_slab", "fused_max_tokens = 512", "T_max = 32"});
  refused([](LayerPipelineInputs& in) { in.cfg.pipeline = GpuPipeline::kStaged; },
          {"pipeline is staged, but the EpBuffer has a self slab", "GpuPipeline::kStaged"});
  refused([](LayerPipelineInputs& in) { in.cfg.fused_max_tokens = 16; },
          {"T_max = 32 runs staged (GpuLayerConfig::fused_max_tokens = 16)", "GpuPipeline::kFused, 16"});
  refused([](LayerPipelineInputs& in) { in.cfg.merge_shared = false; },
          {"merge_shared is off, but the EpBuffer has a self slab"});
  refused([](LayerPipelineInputs& in) { in.cfg.shared_first = 2; }, {"shared_first = 2"});
  refused([](LayerPipelineInputs& in) { in.cfg.recv_ctas = -1; }, {"recv_ctas = -1"});
  refused([](LayerPipelineInputs& in) { in.cfg.combine_ctas = -3; }, {"combine_ctas = -3"});
  refused([](LayerPipelineInputs& in) { in.cfg.shared_ctas = 132; }, {"shared_ctas = 132", "0 (every SM) .. 131"});
}

// The EP buffer layer_ep_config makes for a layer is one that layer accepts, for every embedded
// model, one rank and eight, decode batches from 1 to 1024 tokens a rank, either pipeline, the
// shared expert merged or not; and the layer is fused exactly where it was asked for and the
// tokens a rank are at most fused_max_tokens, merged exactly where it also has a shared expert of
// the routed experts' shape and merge_shared is on.
TEST(LayerPipeline, TheBufferLayerEpConfigMakesIsAccepted) {
  std::set<std::string> covered;
  for (const std::string& name : embedded_model_names()) {
    const ModelSpec model = load_model_spec(name);
    if (!model.is_moe()) continue;
    const ExpertWeightSizes sizes = loaded_expert_sizes(model);
    const bool shared_slot = shared_expert_in_slab(model);
    for (int ranks : {1, 8}) {
      if (model.num_routed_experts % ranks != 0) continue;
      for (int t : {1, 3, 32, 128, 512, 513, 1024})
        for (GpuPipeline pipeline : {GpuPipeline::kStaged, GpuPipeline::kFused})
          for (bool merge : {true, false}) {
            const gpu::EpConfig ec = layer_ep_config(model, model.num_routed_experts, ranks, t, EpMode::kLowLatency,
                                                pipeline, kFusedMaxTokens, merge);
            LayerPipelineInputs in;
            in.cfg.pipeline = pipeline;
            in.cfg.merge_shared = merge;
            in.t_max = t;
            in.shared_slot = shared_slot;
            in.self_slab = ec.self_slab;
            in.num_ranks = ranks;
            in.mxfp4 = model.expert_format == "mxfp4";
            in.clamped_swiglu = model.activation.kind == "clamped_swiglu";
            in.e_loc = ec.slots_per_rank();
            in.d = int(sizes.hidden), in.inter = int(sizes.intermediate);
            in.m_max = ec.max_m();
            in.planned_m = layer_planned_m(0, ranks, t, ec.topk, ec.num_slots, in.m_max);
            in.num_sms = 132;
            const std::string what = name + " P " + std::to_string(ranks) + " T " + std::to_string(t) + " " +
                                     gpu_pipeline_name(pipeline) + (merge ? " merged" : " unmerged");
            LayerPipeline p;
            EXPECT_NO_THROW(p = choose_layer_pipeline(in)) << what;
            const bool fused = pipeline == GpuPipeline::kFused && t <= kFusedMaxTokens;
            EXPECT_EQ(p.fused, fused) << what;
            EXPECT_EQ(p.merged, fused && shared_slot && merge) << what;
            covered.insert(name);
          }
    }
  }
  for (const char* name : {"deepseek-v3", "qwen3.5-397b-a17b", "gpt-oss-120b", "kimi-k2"})
    EXPECT_EQ(covered.count(name), 1u) << name << " is not among the embedded models";
}
