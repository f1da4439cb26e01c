// Setting up a GpuMoeLayer (include/moekit/layer.h): the constructor checks its arguments against
// each other, takes the rank's weights, allocates the step's buffers and plans its GEMMs, in that
// order, one Impl method per part (layer_impl.cuh; each names its Impl `s`, as the constructor
// and the step do). The step itself is in layer.cu.
#include <algorithm>

#include "ep/cuda/ep_format.h"
#include "kernels/cuda/gemm_host.cuh"
#include "layer/cuda/expert_mover.h"
#include "layer/cuda/layer_impl.cuh"
#include "layer/cuda/layer_pipeline.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/eplb.h"
#include "moekit/gemm.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/layout.h"
#include "moekit/weights.h"

namespace moekit::gpu {

namespace {

int round_up(int v, int unit) { return (v + unit - 1) / unit * unit; }

}  // namespace

bool shared_expert_in_slab(const ModelSpec& model) {
  const int64_t shared_inter = int64_t(model.num_shared_experts) * model.shared_intermediate_size;
  return shared_inter > 0 && shared_inter == model.moe_intermediate_size;
}

EpConfig layer_ep_config(const ModelSpec& model, int num_slots, int num_ranks, int max_tokens, EpMode mode,
                         GpuPipeline pipeline, int fused_max_tokens, bool merge_shared) {
  MOEKIT_CHECK(num_ranks >= 1 && max_tokens >= 1,
               fmtr("layer_ep_config: num_ranks {} and max_tokens {}, expected both >= 1", num_ranks, max_tokens));
  MOEKIT_CHECK(fused_max_tokens >= 0,
               fmtr("layer_ep_config: fused_max_tokens = {}, expected >= 0", fused_max_tokens));
  EpConfig c;
  c.num_ranks = num_ranks;
  c.max_tokens = max_tokens;
  // M_max = P T_max must be a multiple of 4 for the masked GEMM's TMA rows of scales.
  while (mode == EpMode::kLowLatency && (int64_t(num_ranks) * c.max_tokens) % 4 != 0) ++c.max_tokens;
  c.hidden = int(loaded_expert_sizes(model).hidden);  // MXFP4: padded to the weights' K
  c.topk = model.num_experts_per_token;
  c.num_slots = num_slots;
  c.mode = mode;
  c.block_m = kContiguousAlign;
  c.self_slab = mode == EpMode::kLowLatency && pipeline == GpuPipeline::kFused && merge_shared &&
                shared_expert_in_slab(model) && c.max_tokens <= fused_max_tokens;
  c.mxfp4_k_order = model.expert_format == "mxfp4";
  c.x_scaling = layer_fp8_scaling(model);
  c.validate();
  return c;
}

size_t gpu_layer_fp8_copy_bytes(const ModelSpec& model, const EpConfig& ec) {
  if (model.expert_format != "mxfp4") return 0;
  const ExpertWeightSizes sizes = loaded_expert_sizes(model);
  return size_t(ec.slots_per_rank()) * size_t(2 * sizes.intermediate) * size_t(sizes.hidden);
}

GpuMoeLayer::GpuMoeLayer(const ModelSpec& model, const MoeLayerWeights& weights, const Placement& placement,
                         int placement_layer, EpBuffer& ep, const GpuLayerConfig& config,
                         const GpuMoeLayer* share_weights_with)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.cfg = config;
  s.ep = &ep;
  s.ec = ep.config();
  s.rank = ep.rank();
  s.take_shapes(model, weights, placement, placement_layer);
  s.set_up_weights(model, weights, placement, placement_layer,
                   share_weights_with ? share_weights_with->impl_.get() : nullptr);
  s.allocate_token_state();
  s.choose_pipeline();
  s.allocate_expert_buffers(weights);
  s.plan_gemms();
  s.create_clocks_and_streams();
}

void GpuMoeLayer::Impl::take_shapes(const ModelSpec& model, const MoeLayerWeights& weights, const Placement& placement,
                                    int placement_layer) {
  Impl& s = *this;
  s.num_sms = query_device().num_sms;  // once: the device's properties are a slow query
  s.decode = s.ec.mode == EpMode::kLowLatency;
  MOEKIT_CHECK(model.is_moe(), fmtr("model '{}' is dense: it has no MoE layer", model.name));
  s.mxfp4 = model.expert_format == "mxfp4";
  MOEKIT_CHECK(model.expert_format == "fp8" || s.mxfp4,
               fmtr("model '{}': expert_format '{}', expected fp8 or mxfp4", model.name, model.expert_format));
  MOEKIT_CHECK(weights.is_mxfp4() == s.mxfp4, fmtr("layer weights are {}, model '{}' has expert_format {}",
                                                   weights.is_mxfp4() ? "MXFP4" : "FP8", model.name, model.expert_format));
  MOEKIT_CHECK(s.ec.mxfp4_k_order == s.mxfp4,
               fmtr("EP buffer's mxfp4_k_order = {} for model '{}' with expert_format {}: an MXFP4 layer's experts read "
                    "their rows in the MXFP4 GEMM's K order, an FP8 layer's in the natural one (layer_ep_config sets it)",
                    s.ec.mxfp4_k_order, model.name, model.expert_format));
  const Fp8Scaling scaling = layer_fp8_scaling(model);
  MOEKIT_CHECK(s.ec.x_scaling == scaling,
               fmtr("EP buffer's x_scaling = {} for model '{}' ({}) in {} mode: the layer's FP8 activations are {} "
                    "(layer_fp8_scaling; layer_ep_config sets it)",
                    fp8_scaling_name(s.ec.x_scaling), model.name, model.expert_format, ep_mode_name(s.ec.mode),
                    fp8_scaling_name(scaling)));
  s.token_scales = scaling == Fp8Scaling::kPerToken;
  MOEKIT_CHECK(weights.hidden_size == model.hidden_size && weights.intermediate_size == model.moe_intermediate_size,
               fmtr("layer weights have hidden {} and inter {}, the model {} and {}", weights.hidden_size,
                    weights.intermediate_size, model.hidden_size, model.moe_intermediate_size));
  // MXFP4 weights come padded to multiples of 128 (weights.h); the layer pads x and out to match.
  s.model_d = int(model.hidden_size);
  s.d = s.mxfp4 ? int(weights.padded_hidden) : s.model_d;
  s.inter = s.mxfp4 ? int(weights.padded_intermediate) : int(model.moe_intermediate_size);
  MOEKIT_CHECK(s.d % kQuantBlock == 0 && s.inter % kQuantBlock == 0 && s.d >= s.model_d &&
                   s.d == loaded_expert_sizes(model).hidden && s.inter >= model.moe_intermediate_size,
               fmtr("model '{}': hidden {} and intermediate {} ({} and {} with the weights' padding), expected "
                    "multiples of {} (MXFP4: the loader's padding of the model's sizes)", model.name,
                    model.hidden_size, model.moe_intermediate_size, s.d, s.inter, kQuantBlock));
  s.num_experts = model.num_routed_experts;
  s.k = model.num_experts_per_token;
  MOEKIT_CHECK(weights.first_expert == 0 && weights.num_local_experts() == s.num_experts,
               fmtr("layer weights hold experts [{}, {}), expected all {} experts of '{}'", weights.first_expert,
                    weights.first_expert + weights.num_local_experts(), s.num_experts, model.name));
  MOEKIT_CHECK(!s.mxfp4 || (s.cfg.staging_slots == 0 && !weights.has_shared_experts()),
               fmtr("model '{}': staging_slots = {} and {} shared expert: MXFP4 layers move no weights while serving "
                    "and have no shared expert",
                    model.name, s.cfg.staging_slots, weights.has_shared_experts() ? "a" : "no"));
  MOEKIT_CHECK(placement.num_experts == s.num_experts && placement.num_gpus == s.ec.num_ranks &&
                   placement.num_slots == s.ec.num_slots,
               fmtr("placement of {} experts in {} slots on {} GPUs, expected {} experts in the EP buffer's {} slots "
                    "on P = {} ranks",
                    placement.num_experts, placement.num_slots, placement.num_gpus, s.num_experts, s.ec.num_slots,
                    s.ec.num_ranks));
  MOEKIT_CHECK(placement_layer >= 0 && placement_layer < placement.num_layers,
               fmtr("placement layer {}, expected 0..{}", placement_layer, placement.num_layers - 1));
  MOEKIT_CHECK(s.ec.hidden == s.d && s.ec.topk == s.k,
               fmtr("EP buffer of hidden {} and top-{}, the model has hidden {} and top-{}", s.ec.hidden, s.ec.topk,
                    s.d, s.k));
  MOEKIT_CHECK(s.cfg.max_tokens >= 1 && s.cfg.max_tokens <= s.ec.max_tokens,
               fmtr("GpuLayerConfig::max_tokens = {}, expected 1..{} (the EP buffer's T_max)", s.cfg.max_tokens,
                    s.ec.max_tokens));
  MOEKIT_CHECK(s.num_experts <= kMaxGateExperts && model.router.num_groups <= 32 && s.k <= 32,
               fmtr("the GPU gate handles up to {} experts, 32 groups and top-32; the model has {}, {} and top-{}",
                    kMaxGateExperts, s.num_experts, model.router.num_groups, s.k));
  MOEKIT_CHECK(s.decode || s.ec.block_m % kContiguousAlign == 0,
               fmtr("normal-mode EP buffer with block_m {}, expected a multiple of the contiguous GEMM's {}",
                    s.ec.block_m, kContiguousAlign));
  s.t_max = s.cfg.max_tokens;
  s.e_loc = s.ec.slots_per_rank();
  s.m_max = s.ec.max_m();
  MOEKIT_CHECK(!s.decode || s.m_max % 4 == 0,
               fmtr("M_max = P T_max = {}, expected a multiple of 4 (use layer_ep_config)", s.m_max));
  s.rows = s.decode ? s.m_max : s.ec.contiguous_rows();
  s.t_pad = round_up(s.t_max, 4);
  s.router = {model.router.scoring == "sigmoid", model.router.num_groups, model.router.topk_groups,
              model.router.normalize_topk, model.router.routed_scaling_factor, model.router.scoring == "topk_softmax"};
  MOEKIT_CHECK(model.router.scoring == "sigmoid" || model.router.scoring == "softmax" ||
                   model.router.scoring == "topk_softmax",
               fmtr("router scoring '{}', expected softmax, sigmoid or topk_softmax", model.router.scoring));
}

void GpuMoeLayer::Impl::set_up_weights(const ModelSpec& model, const MoeLayerWeights& weights,
                                       const Placement& placement, int placement_layer, const Impl* other) {
  Impl& s = *this;
  // Weights of the rank's slots, the router, the placement row, the shared expert.
  const int32_t* phy2log = placement.phy2log_row(placement_layer);
  s.shared_slot = weights.has_shared_experts() && weights.shared_w1.layout.n / 2 == s.inter &&
                  weights.shared_w2.layout.k == s.inter;
  if (other)
    s.share_weights(*other, phy2log);
  else
    s.upload_weights(weights, phy2log);
  // The activation's table (the constants as the CPU layer takes them, layer_cpu.h activation_of).
  const ref::Activation act = activation_of(model.activation);
  const bool same_act = other &&
                        other->activation.clamped_swiglu == (act.kind == ref::Activation::Kind::kClampedSwiglu) &&
                        other->activation.alpha == act.alpha && other->activation.limit == act.limit;
  s.activation_table = same_act ? other->activation_table : std::make_shared<const ActivationTable>(act);
  s.activation = s.activation_table->act();
  s.activation.mxfp4_k_order = s.mxfp4;  // GEMM2's FP8 input in the MXFP4 GEMM's K order (mxfp4.h)
  s.activation.token_scales = s.token_scales;  // and scaled per token where the dispatch is
  // The replica table at a fixed stride (the most replicas any placement of these slots can
  // give an expert), so that set_placement() never changes what a captured graph points at.
  s.replicas.max_replicas = s.ec.num_slots - s.num_experts + 1;
  s.replicas.slots_per_gpu = placement.slots_per_gpu();
  s.replicas.num_experts = s.num_experts;
  s.log2phy = s.alloc<int32_t>(size_t(s.num_experts) * s.replicas.max_replicas);
  s.replica_count = s.alloc<int32_t>(s.num_experts);
  s.replicas.log2phy = s.log2phy;
  s.replicas.replica_count = s.replica_count;
  s.upload_table(placement, placement_layer, nullptr);
  s.local_experts.assign(phy2log + s.rank * s.e_loc, phy2log + (s.rank + 1) * s.e_loc);
  s.current = std::make_unique<Placement>(placement);
  s.placement_layer = placement_layer;
  s.slot_bytes = {size_t(2) * s.inter * s.d, size_t(2 * s.inter / kQuantBlock) * (s.d / kQuantBlock) * sizeof(float),
                  size_t(s.d) * s.inter, size_t(s.d / kQuantBlock) * (s.inter / kQuantBlock) * sizeof(float)};
  MOEKIT_CHECK(s.cfg.staging_slots >= 0 && (s.cfg.staging_slots == 0 || !other),
               fmtr("rank {}: staging_slots = {}, expected >= 0, and 0 on a layer that shares another's weights (it "
                    "cannot move them)", s.rank, s.cfg.staging_slots));
  if (s.cfg.staging_slots > 0)
    s.mover = std::make_unique<ExpertMover>(s.slot_bytes, s.cfg.staging_slots, s.cfg.move_chunk_bytes);
}

void GpuMoeLayer::Impl::allocate_token_state() {
  Impl& s = *this;
  // Per-token state.
  s.logits = s.alloc<float>(size_t(s.t_max) * s.num_experts);
  s.topk_idx = s.alloc<int32_t>(size_t(s.t_max) * s.k);
  s.topk_slot = s.alloc<int32_t>(size_t(s.t_max) * s.k);
  s.topk_w = s.alloc<float>(size_t(s.t_max) * s.k);
  s.counts = s.alloc<unsigned long long>(s.num_experts);
  s.status = s.alloc<LayerStatus>(1);
  MOEKIT_CUDA_CHECK(cudaMemset(s.counts, 0, sizeof(unsigned long long) * s.num_experts));
  MOEKIT_CUDA_CHECK(cudaMemset(s.status, 0, sizeof(LayerStatus)));
}

int GpuMoeLayer::Impl::planned_m() const {
  return layer_planned_m(cfg.expected_m, ec.num_ranks, t_max, k, ec.num_slots, m_max);
}

void GpuMoeLayer::Impl::choose_pipeline() {
  Impl& s = *this;
  const LayerPipeline p = choose_layer_pipeline({.rank = s.rank,
                                                  .decode = s.decode,
                                                  .cfg = s.cfg,
                                                  .t_max = s.t_max,
                                                  .shared_slot = s.shared_slot,
                                                  .self_slab = s.ec.self_slab,
                                                  .num_ranks = s.ec.num_ranks,
                                                  .ep_ctas = s.ec.num_ctas,
                                                  .mxfp4 = s.mxfp4,
                                                  .clamped_swiglu = s.activation.clamped_swiglu,
                                                  .e_loc = s.e_loc,
                                                  .d = s.d,
                                                  .inter = s.inter,
                                                  .m_max = s.m_max,
                                                  .planned_m = s.planned_m(),
                                                  .num_sms = s.num_sms});
  gemm_detail::maybe_print_plan(fmtr("layer rank {} [T_max {}, E_loc {}, {}]: {}", s.rank, s.t_max, s.e_loc,
                                     s.decode ? "decode" : "prefill", p.to_string()));
  s.fused = p.fused;
  s.merged = p.merged;
  s.gated = p.gated;
  const int slabs = s.routed_slabs();
  if (!s.gated) s.gate_up = s.alloc<uint16_t>(s.routed_rows() * 2 * s.inter);  // gated: GEMM1 writes act itself
  if (s.gated && s.cfg.expert_ready) {  // GEMM2 takes each expert as soon as GEMM1 has stored its rows
    s.expert_ready = s.alloc<int32_t>(slabs + 1);
    MOEKIT_CUDA_CHECK(cudaMemset(s.expert_ready, 0, sizeof(int32_t) * (slabs + 1)));
  }
  if (p.recv_ctas > 0) {  // the receive beside GEMM1
    s.recv_ctas = p.recv_ctas;
    s.recv_ready = s.alloc<int32_t>(slabs + 2);
    MOEKIT_CUDA_CHECK(cudaMemset(s.recv_ready, 0, sizeof(int32_t) * (slabs + 2)));
  }
  if (p.combine_ctas > 0) {  // the combine send beside GEMM2 (it zeroes the counters after each step)
    s.combine_ctas = p.combine_ctas;
    s.combine_ready = s.alloc<int32_t>(slabs);
    MOEKIT_CUDA_CHECK(cudaMemset(s.combine_ready, 0, sizeof(int32_t) * slabs));
  }
}

void GpuMoeLayer::Impl::allocate_expert_buffers(const MoeLayerWeights& weights) {
  Impl& s = *this;
  // The routed experts' act [rows, inter] + scales and y [rows, d] (gate_up [rows, 2 inter]:
  // choose_pipeline).
  const size_t total_rows = s.routed_rows();
  s.act = s.alloc<uint8_t>(total_rows * s.inter);
  s.act_scales = s.alloc<float>(total_rows * (s.inter / kQuantBlock));
  s.y = s.alloc<uint16_t>(total_rows * s.d);
  // A padded hidden size (MXFP4): the router, the send and the combine take the model's rows as
  // they are (x_cols, out_cols); a padded copy of x only for the shared expert's quantisation or a
  // row length those kernels do not take (two graph nodes per layer, and a break in the PDL chain).
  if (s.d != s.model_d && (weights.has_shared_experts() || s.model_d % 16 != 0)) {
    s.x_pad = s.alloc<uint16_t>(size_t(s.t_max) * s.d);
    MOEKIT_CUDA_CHECK(cudaMemset(s.x_pad, 0, size_t(s.t_max) * s.d * sizeof(uint16_t)));  // the padding stays zero
  }
  if (s.d != s.model_d && s.model_d % 8 != 0) s.out_pad = s.alloc<uint16_t>(size_t(s.t_max) * s.d);
  if (weights.has_shared_experts()) {
    s.shared_inter = weights.shared_w1.layout.n / 2;
    if (s.owner) {
      s.sw1 = s.owner->sw1, s.sw1s = s.owner->sw1s, s.sw2 = s.owner->sw2, s.sw2s = s.owner->sw2s;
    } else if (s.shared_slot) {  // slot E_loc of W1 and W2
      s.sw1 = s.w1 + size_t(s.e_loc) * 2 * s.inter * s.d;
      s.sw1s = s.w1s + size_t(s.e_loc) * (2 * s.inter / kQuantBlock) * (s.d / kQuantBlock);
      s.sw2 = s.w2 + size_t(s.e_loc) * s.d * s.inter;
      s.sw2s = s.w2s + size_t(s.e_loc) * (s.d / kQuantBlock) * (s.inter / kQuantBlock);
    } else {
      s.sw1 = s.upload(weights.shared_w1.w);
      s.sw1s = s.upload(weights.shared_w1.scales);
      s.sw2 = s.upload(weights.shared_w2.w);
      s.sw2s = s.upload(weights.shared_w2.scales);
    }
    s.side_shared = !s.fused && s.cfg.overlap_shared;
    if (!s.merged) {  // its own GEMMs' buffers (merged: the routed GEMMs' slab E_loc)
      s.sx = s.alloc<uint8_t>(size_t(s.t_pad) * s.d);
      s.sx_scales = s.alloc<float>(size_t(s.t_pad) * (s.d / kQuantBlock));
      s.s_m = s.alloc<int32_t>(1);
      if (!s.gated) s.s_gate_up = s.alloc<uint16_t>(size_t(s.t_pad) * 2 * s.shared_inter);
      s.s_act = s.alloc<uint8_t>(size_t(s.t_pad) * s.shared_inter);
      s.s_act_scales = s.alloc<float>(size_t(s.t_pad) * (s.shared_inter / kQuantBlock));
      s.s_out = s.alloc<uint16_t>(size_t(s.t_pad) * s.d);
      MOEKIT_CUDA_CHECK(cudaMemset(s.s_m, 0, sizeof(int32_t)));
    } else {
      s.s_out = s.y + size_t(s.e_loc) * s.m_max * s.d;  // rows 0..T-1 of slab E_loc, token order
    }
  }
}

void GpuMoeLayer::Impl::plan_gemms() {
  Impl& s = *this;
  const int slabs = s.routed_slabs();
  // GEMM1 writes gate_up (staged) or, with the SiLU·up epilogue, the FP8 activations (fused).
  const GemmEpilogue epilogue1 = s.gated ? GemmEpilogue::kSiluMulFp8 : GemmEpilogue::kBf16;
  const WeightFormat format = s.mxfp4 ? WeightFormat::kMxfp4 : WeightFormat::kFp8;
  // Merged: slab E_loc holds every token of the rank, which the heuristic weighs on its own.
  const int shared_rows = s.merged ? s.t_max : 0;
  const int m_plan = s.planned_m();
  // Per-token activations (an MXFP4 layer): the register kernel keeps the whole K in one
  // accumulator (a_row_scales, docs/gemm-mxfp4.md run 44).
  const MaskedGemmProblem p1{slabs, 2 * s.inter, s.d, s.m_max, m_plan, epilogue1, format, shared_rows, s.token_scales};
  const MaskedGemmProblem p2{slabs, s.d, s.inter, s.m_max, m_plan, GemmEpilogue::kBf16, format, shared_rows,
                             s.token_scales};
  const EpBuffer& ep = *s.ep;
  const MaskedGemmBuffers b1{ep.recv_x(), ep.recv_scales(), s.w1, s.w1s, ep.recv_count(), s.gate_up, s.act,
                             s.act_scales, s.w1_mx, s.b1, s.expert_ready, s.recv_ready};
  const MaskedGemmBuffers b2{s.act,   s.act_scales, s.w2,    s.w2s, ep.recv_count(), s.y,
                             nullptr, nullptr,      s.w2_mx, s.b2,  s.combine_ready, s.expert_ready};
  // The shared expert on the side stream on its own SMs (GpuLayerConfig::shared_ctas): its GEMMs
  // and the routed GEMM1, which it overlaps, each planned for their share of the SMs.
  const int shared_ctas = s.decode && s.side_shared ? s.cfg.shared_ctas : 0;
  if (s.decode) {
    const GemmConfig routed1 = choose_masked_config(p1, s.num_sms - shared_ctas);
    s.gemm1 = std::make_unique<MaskedGemm>(p1, b1, shared_ctas > 0 ? &routed1 : nullptr);
    s.gemm2 = std::make_unique<MaskedGemm>(p2, b2);
    // GEMM1 starts under the receive kernel's tail (with recv_ready: beside the receive, taking
    // each expert as its rows land); GEMM2's weights (static) start streaming
    // under the activation kernel, or under GEMM1 itself in the fused pipeline (docs/gemm.md: the
    // decode-step overlap).
    s.gemm1->set_overlap(s.recv_ready ? Overlap::kDispatchPerExpert : Overlap::kPreviousKernel);
    s.gemm2->set_overlap(s.expert_ready ? Overlap::kPreviousGemmPerExpert : Overlap::kPreviousKernelStaticWeights);
    s.gemm2->set_early_trigger(s.combine_ready != nullptr);  // the combine send starts beside it
    // The merged shared expert first in GEMM1's walk, its W1 asked of the L2 while the receive runs.
    const bool shared_first = s.cfg.shared_first == -1 ? s.t_max > 1 : s.cfg.shared_first == 1;
    s.gemm1->set_last_expert_first(s.merged && s.recv_ready && shared_first);
  } else {
    ContiguousGemmProblem c1{s.e_loc, 2 * s.inter, s.d, s.rows, format};
    ContiguousGemmProblem c2{s.e_loc, s.d, s.inter, s.rows, format};
    GemmConfig cfg1 = contiguous_plan_config(c1), cfg2 = contiguous_plan_config(c2);
    // Per-token activations: the register kernel then keeps the whole K in one accumulator
    // (a_row_scales, docs/gemm-mxfp4.md run 41). A plan the knobs sent to the FP8 copy or to the
    // widening warpgroups reads the same values as 1x128 scales (a row's slots all hold its scale).
    auto take_row_scales = [&](ContiguousGemmProblem& c, GemmConfig& cfg) {
      if (!s.token_scales || cfg.mxfp4_fp8_copy || cfg.mxfp4_widen_wgs != 0) return;
      c.a_row_scales = true;
      cfg = contiguous_plan_config(c);
    };
    take_row_scales(c1, cfg1);
    take_row_scales(c2, cfg2);
    // MXFP4 GEMMs that widen into an FP8 copy share one: prefill launches no kernel early (no PDL
    // outside a plan), so GEMM2's copy starts only once GEMM1's grid is done; GEMM1's is the larger.
    uint8_t* copy = cfg1.mxfp4_fp8_copy || cfg2.mxfp4_fp8_copy ? s.fp8_copy_workspace(c1, c2) : nullptr;
    s.cgemm1 = std::make_unique<ContiguousGemm>(
        c1,
        ContiguousGemmBuffers{ep.recv_x(), ep.recv_scales(), ep.row_expert(), s.w1, s.w1s, s.gate_up, s.w1_mx, s.b1,
                              cfg1.mxfp4_fp8_copy ? copy : nullptr},
        &cfg1);
    s.cgemm2 = std::make_unique<ContiguousGemm>(
        c2,
        ContiguousGemmBuffers{s.act, s.act_scales, ep.row_expert(), s.w2, s.w2s, s.y, s.w2_mx, s.b2,
                              cfg2.mxfp4_fp8_copy ? copy : nullptr},
        &cfg2);
  }
  if (s.shared_inter > 0 && !s.merged) {
    // The shared expert is a masked GEMM with one "expert" of every token.
    const MaskedGemmProblem q1{1, 2 * s.shared_inter, s.d, s.t_pad, s.t_max, epilogue1};
    const MaskedGemmProblem q2{1, s.d, s.shared_inter, s.t_pad, s.t_max};
    GemmConfig c1, c2;
    if (shared_ctas > 0) c1 = choose_masked_config(q1, shared_ctas), c2 = choose_masked_config(q2, shared_ctas);
    s.shared1 = std::make_unique<MaskedGemm>(
        q1, MaskedGemmBuffers{s.sx, s.sx_scales, s.sw1, s.sw1s, s.s_m, s.s_gate_up, s.s_act, s.s_act_scales},
        shared_ctas > 0 ? &c1 : nullptr);
    s.shared2 = std::make_unique<MaskedGemm>(q2, MaskedGemmBuffers{s.s_act, s.s_act_scales, s.sw2, s.sw2s, s.s_m, s.s_out},
                                             shared_ctas > 0 ? &c2 : nullptr);
    if (s.fused) {
      s.shared1->set_overlap(Overlap::kPreviousKernel);
      s.shared2->set_overlap(Overlap::kPreviousKernelStaticWeights);
    }
  }
}

uint8_t* GpuMoeLayer::Impl::fp8_copy_workspace(const ContiguousGemmProblem& p1, const ContiguousGemmProblem& p2) {
  const size_t need = std::max(mxfp4_fp8_copy_bytes(p1), mxfp4_fp8_copy_bytes(p2));
  if (cfg.fp8_copy_workspace != nullptr) {
    MOEKIT_CHECK(cfg.fp8_copy_workspace_bytes >= need,
                 fmtr("rank {}: GpuLayerConfig::fp8_copy_workspace_bytes = {}, the layer's FP8 copy of its MXFP4 weights "
                      "needs {} (gpu_layer_fp8_copy_bytes)",
                      rank, cfg.fp8_copy_workspace_bytes, need));
    return cfg.fp8_copy_workspace;  // its alignment is checked by the GEMM plans
  }
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, need);
  if (e != cudaSuccess) {
    cudaGetLastError();  // an allocation failure is not sticky; keep it from the next check
    throw Error(fmtr("rank {}: allocating the FP8 copy of the layer's MXFP4 weights, {} bytes: {} (give the layers one "
                     "GpuLayerConfig::fp8_copy_workspace)",
                     rank, need, cudaGetErrorString(e)));
  }
  allocations.push_back(p);
  return static_cast<uint8_t*>(p);
}

void GpuMoeLayer::Impl::create_clocks_and_streams() {
  Impl& s = *this;
  s.clocks = s.alloc<unsigned long long>(2 * kNumClocks);
  s.clocks_reset = s.alloc<unsigned long long>(2 * kNumClocks);
  {
    std::vector<unsigned long long> reset(2 * kNumClocks);
    for (int i = 0; i < kNumClocks; ++i) reset[2 * i] = ~0ull, reset[2 * i + 1] = 0;
    MOEKIT_CUDA_CHECK(cudaMemcpy(s.clocks_reset, reset.data(), reset.size() * sizeof(reset[0]), cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaMemcpy(s.clocks, reset.data(), reset.size() * sizeof(reset[0]), cudaMemcpyHostToDevice));
  }
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s.side, cudaStreamNonBlocking));
  MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
  MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming));
  for (auto& e : s.events) MOEKIT_CUDA_CHECK(cudaEventCreate(&e));
  // The copies and clears above ran on the legacy default stream, which a caller's non-blocking
  // stream does not wait for: finish them before the first step can be issued.
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace moekit::gpu
