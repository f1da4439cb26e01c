// Internal to moekit_cuda: the layer's activation kernels, act(gate, up) + FP8 (activation.cu), bit for bit
// reference.h's activation_quant_* and quant.h's quantize_row_fp8 (docs/layer-gpu.md gives the one
// place where a bit can differ: expf). The activation's gate half is looked up (gate_table.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/silu_fp8.cuh"
#include "moekit/reference.h"

namespace moekit::gpu {

// The gate half of an activation (silu_fp8.cuh activation_gate) for every bf16 gate: 65536 floats
// (256 KB) computed on the device at set-up (one kernel, then a synchronisation), and the
// GpuActivation that points at them: what the activation kernels below take. One per layer;
// layers that share weights share it.
class ActivationTable {
 public:
  explicit ActivationTable(const ref::Activation& act);
  ~ActivationTable();
  ActivationTable(const ActivationTable&) = delete;
  ActivationTable& operator=(const ActivationTable&) = delete;
  const GpuActivation& act() const { return act_; }

 private:
  float* table_ = nullptr;
  GpuActivation act_;
};

// act(gate, up) + FP8 1x128, masked layout (act: an ActivationTable's, SiLU·up or gpt-oss's clamped
// SwiGLU; a GpuActivation without a table is refused).
// gate_up [E_loc, M_max, 2 inter] bf16; out [E_loc, M_max, inter] fp8, out_scales
// [E_loc, inter/128, M_max]; rows >= masked_m[e] (clamped to [0, M_max]) neither read nor written.
// With act.token_scales one scale per row, in each of its slots (each row to a team of 4 or 8 warps
// of one CTA, as few rows as a decode step has spread over the grid).
void launch_silu_mul_quant_masked(const uint16_t* gate_up, int num_experts, int max_m, int inter,
                                  const int32_t* masked_m, uint8_t* out, float* out_scales, cudaStream_t stream,
                                  const LaunchOptions& opt, const GpuActivation& act);

// The same, contiguous layout: gate_up [M_total, 2 inter]; out [M_total, inter], out_scales
// [inter/128, M_total]; rows with row_expert == -1 untouched. With act.token_scales one scale per
// row (reference.h activation_quant_contiguous per token), in each of its slots.
void launch_silu_mul_quant_contiguous(const uint16_t* gate_up, int total_m, int inter, const int32_t* row_expert,
                                      uint8_t* out, float* out_scales, cudaStream_t stream,
                                      const LaunchOptions& opt, const GpuActivation& act);

}  // namespace moekit::gpu
