// choose_layer_pipeline (layer_pipeline.h): the layer's pipeline and hand-offs from its shapes.
#include <algorithm>
#include <cstdint>
#include <string>

#include "ep/cuda/ep_format.h"  // fmtr: "{}" messages in .cu files
#include "layer/cuda/layer_pipeline.h"
#include "moekit/check.h"
#include "moekit/gemm.h"

namespace moekit::gpu {

std::string LayerPipeline::to_string() const {
  std::string s = fused ? "fused" : "staged";
  if (merged) s += " merged";
  if (gated) s += " gated";
  if (recv_ctas > 0) s += " recv_ctas=" + std::to_string(recv_ctas);
  if (combine_ctas > 0) s += " combine_ctas=" + std::to_string(combine_ctas);
  return s;
}

LayerPipeline choose_layer_pipeline(const LayerPipelineInputs& in) {
  const GpuLayerConfig& cfg = in.cfg;
  const int rank = in.rank;
  MOEKIT_CHECK(cfg.fused_max_tokens >= 0,
               fmtr("rank {}: GpuLayerConfig::fused_max_tokens = {}, expected >= 0", rank, cfg.fused_max_tokens));
  LayerPipeline p;
  p.fused = in.decode && cfg.pipeline == GpuPipeline::kFused && in.t_max <= cfg.fused_max_tokens;
  p.merged = p.fused && in.shared_slot && cfg.merge_shared;
  MOEKIT_CHECK(!p.merged || in.self_slab,
               fmtr("rank {}: the fused pipeline runs the shared expert as local expert E_loc and needs an EpBuffer "
                    "with self_slab (layer_ep_config(..., GpuPipeline::kFused, fused_max_tokens = {}) makes one for "
                    "T_max = {})", rank, cfg.fused_max_tokens, in.t_max));
  // A self slab the send would fill for nobody (and whose extra slab would keep the hand-offs
  // off): the buffer was made for the fused pipeline, for a larger fused_max_tokens, or for layers
  // that merge the shared expert.
  if (in.decode && in.self_slab) {
    MOEKIT_CHECK(cfg.pipeline == GpuPipeline::kFused,
                 fmtr("rank {}: GpuLayerConfig::pipeline is staged, but the EpBuffer has a self slab (made for the "
                      "fused pipeline); make it with layer_ep_config(..., GpuPipeline::kStaged)",
                      rank));
    MOEKIT_CHECK(p.fused, fmtr("rank {}: T_max = {} runs staged (GpuLayerConfig::fused_max_tokens = {}), but the "
                               "EpBuffer has a self slab; make it with layer_ep_config(..., GpuPipeline::kFused, {})",
                               rank, in.t_max, cfg.fused_max_tokens, cfg.fused_max_tokens));
    MOEKIT_CHECK(!in.shared_slot || cfg.merge_shared,
                 fmtr("rank {}: GpuLayerConfig::merge_shared is off, but the EpBuffer has a self slab; make it with "
                      "layer_ep_config(..., merge_shared = false)", rank));
  }
  const int slabs = p.routed_slabs(in.e_loc);
  // The gated epilogue only where its tiles hold at most 32 tokens: at 64 (DeepSeek-V3 at 2048
  // tokens, EP8) its GEMM1 took 456 us against 365 + 63 for GEMM1 and the activation kernel
  // (stage clock, 2026-11-30), at 32 it saved 30-40 us per layer.
  // (MXFP4 GEMMs have no SiLU·up epilogue, and gpt-oss's activation is not SiLU·up: the epilogue
  // computes SiLU·up only, so another activation keeps the activation kernel with FP8 weights too.)
  if (p.fused && !in.mxfp4 && !in.clamped_swiglu) {
    const MaskedGemmProblem g{slabs, 2 * in.inter, in.d, in.m_max, in.planned_m, GemmEpilogue::kSiluMulFp8};
    p.gated = choose_masked_config(g, in.num_sms).block_m <= 32;
  }
  // The hand-offs beside the EP kernels count the EP buffer's slabs (its E_loc, + 1 with the self
  // slab), so the routed GEMMs' experts must be exactly those (a self slab only when merged).
  const bool hand_offs = p.fused && !in.mxfp4 && slabs == in.e_loc + (in.self_slab ? 1 : 0);
  const int ep_ctas = in.ep_ctas > 0 ? in.ep_ctas : in.num_sms;
  MOEKIT_CHECK(cfg.shared_first >= -1 && cfg.shared_first <= 1,
               fmtr("rank {}: GpuLayerConfig::shared_first = {}, expected 1 (on), 0 (off) or -1 (automatic)", rank,
                    cfg.shared_first));
  MOEKIT_CHECK(cfg.recv_ctas >= 0 && cfg.combine_ctas >= 0,
               fmtr("rank {}: GpuLayerConfig::recv_ctas = {} and combine_ctas = {}, expected >= 0 (0: automatic)",
                    rank, cfg.recv_ctas, cfg.combine_ctas));
  MOEKIT_CHECK(cfg.shared_ctas >= 0 && cfg.shared_ctas < in.num_sms,
               fmtr("rank {}: GpuLayerConfig::shared_ctas = {}, expected 0 (every SM) .. {} (the device's SMs less one)",
                    rank, cfg.shared_ctas, in.num_sms - 1));
  // GEMM1 takes each expert's rows from the receive as they land. (One rank has no receive: its
  // send writes the layout, and GEMM1 follows the send's grid.)
  if (hand_offs && cfg.recv_ready && in.num_ranks > 1) {
    // Automatic: at one token per rank 8 CTAs were 0.7% (DeepSeek-V3) and 3.5% (Qwen3.5) faster
    // than 16 and 4 CTAs slower; at 8 tokens per rank 16 were 0.2-1.1% faster than 8 (run 53); at
    // 128 and 256 tokens per rank 32 and 64 (runs 72, 76: 16 left GEMM1 waiting for the rows).
    const int want = cfg.recv_ctas > 0 ? cfg.recv_ctas : in.t_max <= 1 ? 8 : std::clamp(in.t_max / 4, 16, 64);
    p.recv_ctas = std::min(want, ep_ctas);
  }
  // The combine send takes each message once GEMM2 has stored its experts' rows.
  if (hand_offs && cfg.combine_ready) p.combine_ctas = std::min(cfg.combine_ctas > 0 ? cfg.combine_ctas : ep_ctas, ep_ctas);
  return p;
}

int layer_planned_m(int expected_m, int num_ranks, int t_max, int topk, int num_slots, int m_max) {
  const int rows = expected_m > 0 ? expected_m : upper_typical_rows(int64_t(num_ranks) * t_max * topk, num_slots);
  return std::min(rows, m_max);
}

}  // namespace moekit::gpu
