// Internal to src/layer/cuda: which pipeline a GpuMoeLayer runs and with which hand-offs, decided
// from its shapes and GpuLayerConfig alone (no GPU), so that the choices can be printed and tested
// (tests/host). layer_setup.cu allocates what the plan says.
// - fused: decode with GpuPipeline::kFused and T_max <= fused_max_tokens (else staged);
// - merged: fused with a shared expert and merge_shared (the shared expert is local expert E_loc,
//   its rows the EP buffer's self slab);
// - gated: fused FP8 SiLU·up layers whose GEMM1 plan takes tiles of at most 32 tokens get the
//   SiLU·up + FP8 epilogue (at 64 it was slower than GEMM1 and the activation kernel apart);
// - hand-offs (fused FP8 layers whose routed experts are exactly the EP buffer's slabs): the
//   receive beside GEMM1 on recv_ctas CTAs (more than one rank), the combine send beside GEMM2 on
//   combine_ctas.
// Throws moekit::Error naming the value for a bad GpuLayerConfig field or an EP buffer made for
// another pipeline (its self slab).
#pragma once

#include <string>

#include "moekit/layer.h"
#include "moekit/spec.h"

namespace moekit::gpu {

struct LayerPipelineInputs {
  int rank = 0;
  bool decode = true;
  GpuLayerConfig cfg;
  int t_max = 0;             // the rank's tokens per step
  bool shared_slot = false;  // the model has a shared expert (local slot E_loc)
  bool self_slab = false;    // the EP buffer's EpConfig::self_slab
  int num_ranks = 1, ep_ctas = 0;  // the EP buffer's; ep_ctas 0: the device's SMs
  bool mxfp4 = false, clamped_swiglu = false;
  int e_loc = 0, d = 0, inter = 0, m_max = 0, planned_m = 0;  // planned_m: GEMM rows per expert planned
  int num_sms = 0;
};

struct LayerPipeline {
  bool fused = false, merged = false, gated = false;
  int recv_ctas = 0;     // > 0: the receive hands rows to GEMM1 (recv_ready)
  int combine_ctas = 0;  // > 0: the combine send runs beside GEMM2 (combine_ready)
  int routed_slabs(int e_loc) const { return e_loc + (merged ? 1 : 0); }
  std::string to_string() const;  // e.g. "fused merged gated recv_ctas=16 combine_ctas=132"
};

LayerPipeline choose_layer_pipeline(const LayerPipelineInputs& in);

// The rows per active local expert the layer's GEMM plans take (LayerPipelineInputs::planned_m):
// GpuLayerConfig::expected_m, or where it is 0 every rank's T_max tokens routed uniformly over the
// slots (upper_typical_rows; the mean alone gave about half of the experts a second token block:
// docs/layer-gpu.md item 12); at most M_max.
int layer_planned_m(int expected_m, int num_ranks, int t_max, int topk, int num_slots, int m_max);

// Whether the model's shared experts have the routed experts' shape, so that a layer keeps them in
// local slot E_loc and the fused pipeline can merge them (layer_ep_config's self slab).
bool shared_expert_in_slab(const ModelSpec& model);

}  // namespace moekit::gpu
