// moekit/reference.h: the CPU reference kernels of one MoE layer: FP8 grouped GEMMs (masked
// and contiguous) with FP8 or MXFP4 weights, SiLU(gate)·up (or gpt-oss's clamped SwiGLU) fused
// with FP8 quantisation, the shared expert, and the dense float64 oracle of a whole MoE layer. Every CUDA kernel is checked against these.
// Layouts are layout.h's (nothing here indexes memory any other way); quantisation is
// quant.h's; bf16 is bf16.h's (uint16_t bits). Gating is in gating.h.
//
// ---- Grouped GEMM: out = A · W^T per expert, two-level accumulation --------------------
// For one output element (row m of expert e, column n), with kb = 0, 1, ..., K/128 - 1 in
// that order and a[i], w[i] the fp8 e4m3 values (exact as floats) of row m and weight row n:
//   partial_kb = fp32( sum_{i in block kb} a[i] * w[i] )   the tensor core's 128-deep partial.
//       Here the sum is EXACT before its one rounding to fp32: every product of two e4m3 values
//       is a multiple of 2^-18 below 2^17.7, so 128 of them fit in 43 bits and a float64 sum is
//       exact in any order. The reference is therefore independent of summation order; the
//       tensor core's partial differs from it only by its own limited-precision accumulation.
//   s_kb       = fp32( a_scale[m, kb] * w_scale[n / 128, kb] )
//   acc        = fmaf(s_kb, partial_kb, acc)              acc starts at 0.0f, one fp32 FMA per block.
//   out        = float_to_bf16(acc)                         round to nearest even.
// This is DeepGEMM's order: scale product first, then a fused multiply-add into the fp32
// accumulator. A CUDA kernel following it differs from this reference only by the tensor
// core's own rounding inside each block partial (it keeps fewer bits than fp32), far below a
// bf16 step: most bf16 outputs are equal and the rest one bf16 ulp apart. Compare within a
// tolerance, not bit for bit.
// Checks (moekit::Error, nothing written): K and N multiples of 128, E_loc and K equal in A's
// and W's layouts, masked_m[e] in [0, M_max], row_expert[m] in [-1, E_loc).
//
// ---- Activation: SiLU(gate)·up fused with FP8 quantisation -----------------------------
// The GEMM1 output row is [2·inter] bf16: columns [0, inter) are the gate, [inter, 2·inter)
// the up projection (the fused W1 is [2·inter, d] = gate_proj rows then up_proj rows; DeepSeek
// checkpoints store the two separately and the loader stacks them in this order).
//   v[j] = silu_mul(g, u) with g = bf16_to_float(row[j]), u = bf16_to_float(row[inter + j]):
//          silu(g) * u = g / (1.0f + expf(-g)) * u, all in fp32, NOT rounded to bf16 (fused);
//   then the row v [inter] is quantised per 1x128 by quantize_row_fp8 (quant.h) into the
//   output layout. inter must be a multiple of 128.
//
// Other activations (spec.h's ActivationSpec, here ref::Activation): the same kernels with
// v[j] = activate(act, g, u) in fp32. gpt-oss's clamped SwiGLU, with the constants as fp32:
//   g' = min(g, limit) (the gate is clamped from above only), u' = clamp(u, -limit, limit),
//   v  = g' / (1.0f + expf(-(alpha * g'))) * (u' + 1.0f);   a NaN stays NaN (and is then refused
//   by the quantisation).
//
// ---- MXFP4 weights (gpt-oss) -------------------------------------------------------------
// The same grouped GEMMs with W in layout.h's Mxfp4WeightLayout (values: mxfp4.h) and an optional
// bias [E_loc, N] fp32. The two-level accumulation is the FP8 one with the weight scales inside
// the block partial (they change every 32 values of K, the activation's every 128):
//   partial_kb = fp32( sum_{i in block kb} a[i] * w[i] ),   w[i] = e2m1(code_i) * 2^(s_i - 127), exact
//       (mxfp4.h). The float64 sum is exact whenever the four scale exponents of the block span at
//       most 24: a product of an e4m3 and an e2m1 value is a multiple of 2^-10 below 2^12, so 32 of
//       them under one scale fill 27 bits, and four such sums fit float64's 53 bits within a spread
//       of 24 (beyond it the float64 sum is still far more precise than the fp32 rounding after it).
//   acc        = fmaf(a_scale[m, kb], partial_kb, acc)     acc starts at 0.0f.
//   out        = float_to_bf16(acc + bias[e, n])           fp32 add, then round to nearest even
//                                                          (without a bias: float_to_bf16(acc)).
// A GPU kernel that converts the e2m1 values to e4m3 and shifts each 32-value group by its scale's
// offset from a base (the GEMM: its row's largest) computes the same block partial exactly, times
// a power of two, for groups within e4m3's range of that base.
// Checks as for FP8, plus: a scale byte above kMxfp4MaxScale is an Error.
//
// ---- Shared expert ----------------------------------------------------------------------
// The same numerics on T tokens as one expert with masked_m = T: quantise x per token
// (1x128), GEMM1 (W1 [2·inter, d]), SiLU·up + quantisation, GEMM2 (W2 [d, inter]) -> bf16.
//
// ---- Dense float64 oracle ---------------------------------------------------------------
// out[t] = sum_j topk_weights[t, j] · expert_{topk_idx[t, j]}(x[t]) (+ shared_expert(x[t])),
// in float64 on the DEQUANTISED weights (fp8 value x block scale, exact in float64), with
// expert(x) = W2 · q2( silu(g)·u ),  [g; u] = bf16( W1 · q1(x) ),  where the oracle reproduces
// exactly the pipeline's three roundings of activations, so that they are not counted as error:
//   q1:   x -> FP8 1x128 (quantize_row_fp8 on the fp32 x), dequantised exactly;
//   bf16: the GEMM1 output rounded to bf16 (the GEMM's output type; the float64 sum is rounded
//         to fp32 then to bf16, where the pipeline rounds its fp32 accumulator);
//   q2:   SiLU·up computed in fp32 from those bf16 values by the activation kernel's formula,
//         then FP8 1x128 (quantize_row_fp8), dequantised exactly.
// With expert biases (gpt-oss, moe_layer_mxfp4_f64): [g; u] = bf16( W1 · q1(x) + b1 ), the float64
// sum plus the bias rounded to fp32 then to bf16, and expert(x) = W2 · q2(act(g, u)) + b2 in float64;
// act is the layer's activation (SiLU·up or the clamped SwiGLU above), in fp32 as the kernel does it;
// q1 and q2 per token instead where the caller says so (quant.h Fp8Scaling: an MXFP4 layer's
// normal mode).
// Everything else is float64 and unrounded: the GEMM sums, the GEMM2 output (the pipeline's
// bf16 rounding of it counts as error, about 1.6e-3 rms relative), the weighted sum over experts and
// the shared expert. A pipeline whose GEMM1 fp32 result crosses a bf16 rounding boundary away
// from the float64 one can differ in q2; that is rare (fp32 vs bf16 precision) and is error.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "moekit/layout.h"
#include "moekit/quant.h"

namespace moekit::ref {

// An expert activation with its constants as fp32 (the layer converts spec.h's ActivationSpec).
struct Activation {
  enum class Kind { kSilu, kClampedSwiglu };
  Kind kind = Kind::kSilu;
  float alpha = 0.0f;  // kClampedSwiglu only
  float limit = 0.0f;  // kClampedSwiglu only
};

// Masked grouped GEMM. a [E_loc, M_max, K] fp8 and a_scales in a_layout's order; w, w_scales
// in w_layout's ([E_loc, N, K], [E_loc, N/128, K/128]); masked_m [E_loc] (host memory);
// out [E_loc, M_max, N] bf16 bits at a_layout.out_offset(e, m, N). Rows m >= masked_m[e] are
// neither read nor written.
void grouped_gemm_masked(const MaskedLayout& a_layout, const uint8_t* a, const float* a_scales,
                         const int32_t* masked_m, const WeightLayout& w_layout, const uint8_t* w,
                         const float* w_scales, uint16_t* out);

// Contiguous grouped GEMM. a [M_total, K] fp8 and a_scales in a_layout's order; row_expert
// [M_total] the local expert of each row or -1 (padding: not read, its output row not written);
// out [M_total, N] bf16 bits, row m at m * N. Rows are computed independently, so the reference
// accepts any order of experts; the block-M padding of segments is the producer's contract
// (check_contiguous_segments verifies it).
void grouped_gemm_contiguous(const ContiguousLayout& a_layout, const uint8_t* a, const float* a_scales,
                             const int32_t* row_expert, const WeightLayout& w_layout, const uint8_t* w,
                             const float* w_scales, uint16_t* out);

// Throws unless row_expert [total_m] is a valid contiguous layout for a GEMM of block `block_m`:
// total_m a multiple of block_m, every value in [-1, num_experts), and every block of block_m
// rows holds rows of at most one expert (padding rows -1 anywhere in it).
void check_contiguous_segments(const int32_t* row_expert, int total_m, int block_m, int num_experts);

// The activation's fp32 formula (the oracle uses the same one).
inline float silu_mul(float gate, float up) { return gate / (1.0f + std::exp(-gate)) * up; }

// gpt-oss's clamped SwiGLU in fp32 (contract above).
inline float clamped_swiglu(float gate, float up, float alpha, float limit) {
  const float g = gate > limit ? limit : gate;                          // a NaN gate stays NaN
  const float u = up > limit ? limit : (up < -limit ? -limit : up);     // a NaN up stays NaN
  return g / (1.0f + std::exp(-(alpha * g))) * (u + 1.0f);
}

inline float activate(const Activation& act, float gate, float up) {
  return act.kind == Activation::Kind::kSilu ? silu_mul(gate, up) : clamped_swiglu(gate, up, act.alpha, act.limit);
}

// Any activation + FP8 quantisation: the two functions below with activate(act, g, u), also per
// token (quant.h Fp8Scaling: a row's one scale in each of its inter/128 slots), as an MXFP4 layer
// quantises.
void activation_quant_masked(const Activation& act, const MaskedLayout& out_layout, const uint16_t* gate_up,
                             const int32_t* masked_m, uint8_t* out, float* out_scales,
                             Fp8Scaling scaling = Fp8Scaling::kPerBlock);
void activation_quant_contiguous(const Activation& act, const ContiguousLayout& out_layout, const uint16_t* gate_up,
                                 const int32_t* row_expert, uint8_t* out, float* out_scales,
                                 Fp8Scaling scaling = Fp8Scaling::kPerBlock);

// SiLU(gate)·up + FP8 quantisation, masked layout. gate_up [E_loc, M_max, 2·inter] bf16 (GEMM1's
// output); out fp8 and out_scales in out_layout's order, out_layout.k = inter. Rows at or past
// masked_m[e] are neither read nor written.
void silu_mul_quant_masked(const MaskedLayout& out_layout, const uint16_t* gate_up, const int32_t* masked_m,
                           uint8_t* out, float* out_scales);

// SiLU(gate)·up + FP8 quantisation, contiguous layout. gate_up [M_total, 2·inter] bf16; out and
// out_scales in out_layout's order (out_layout.k = inter); rows with row_expert == -1 untouched.
void silu_mul_quant_contiguous(const ContiguousLayout& out_layout, const uint16_t* gate_up,
                               const int32_t* row_expert, uint8_t* out, float* out_scales);

// MXFP4 masked grouped GEMM (contract above): a, a_scales, masked_m, out as grouped_gemm_masked's;
// w [E_loc, N, K/2] and w_scales [E_loc, N, K/32] in w_layout's order; bias [E_loc, N] or nullptr.
void grouped_gemm_masked_mxfp4(const MaskedLayout& a_layout, const uint8_t* a, const float* a_scales,
                               const int32_t* masked_m, const Mxfp4WeightLayout& w_layout, const uint8_t* w,
                               const uint8_t* w_scales, const float* bias, uint16_t* out);

// MXFP4 contiguous grouped GEMM: a, a_scales, row_expert, out as grouped_gemm_contiguous's.
void grouped_gemm_contiguous_mxfp4(const ContiguousLayout& a_layout, const uint8_t* a, const float* a_scales,
                                   const int32_t* row_expert, const Mxfp4WeightLayout& w_layout, const uint8_t* w,
                                   const uint8_t* w_scales, const float* bias, uint16_t* out);

// One expert's FP8 weights in the checkpoint format (one expert: WeightLayout with E_loc = 1).
struct ExpertFp8 {
  int hidden = 0;               // d, a multiple of 128
  int inter = 0;                // a multiple of 128
  const uint8_t* w1 = nullptr;  // [2·inter, hidden]: gate_proj rows then up_proj rows
  const float* w1_scales = nullptr;  // [2·inter/128, hidden/128]
  const uint8_t* w2 = nullptr;  // [hidden, inter]: down_proj
  const float* w2_scales = nullptr;  // [hidden/128, inter/128]
};

// Shared expert on x [num_tokens, hidden] fp32 -> out [num_tokens, hidden] bf16 bits, with the
// model's activation (that of its routed experts, as MoeWeightsF64's).
void shared_expert(const float* x, int num_tokens, const ExpertFp8& weights, uint16_t* out,
                   const Activation& act = {});

// w fp8 [rows, cols] with 128x128 block scales [rows/128, cols/128] -> float64 [rows, cols]
// (exact: an fp8 value times an fp32 scale fits in float64).
void dequantize_weights_f64(const uint8_t* w, const float* scales, int rows, int cols, double* out);

// The routed experts and the optional shared expert of one MoE layer, dequantised to float64.
struct MoeWeightsF64 {
  int hidden = 0;
  int inter = 0;                     // routed expert intermediate size
  int num_experts = 0;               // E (logical experts: topk_idx indexes them)
  const double* w1 = nullptr;        // [E, 2·inter, hidden]
  const double* w2 = nullptr;        // [E, hidden, inter]
  int shared_inter = 0;              // 0: no shared expert
  const double* shared_w1 = nullptr; // [2·shared_inter, hidden]
  const double* shared_w2 = nullptr; // [hidden, shared_inter]
  Activation activation{};           // of the routed and the shared experts
};

// The float64 oracle (contract above): x [num_tokens, hidden] fp32, topk_idx / topk_weights
// [num_tokens, k] -> out [num_tokens, hidden] float64. Throws on an expert id outside [0, E).
void moe_layer_f64(const float* x, int num_tokens, const int32_t* topk_idx, const float* topk_weights, int k,
                   const MoeWeightsF64& weights, double* out);

// The routed experts of one MoE layer in MXFP4 (gpt-oss), as the loader holds them (padded sizes).
struct MoeWeightsMxfp4 {
  int hidden = 0;                     // a multiple of 128
  int inter = 0;                      // a multiple of 128
  int num_experts = 0;                // E (logical experts)
  const uint8_t* w1 = nullptr;        // Mxfp4WeightLayout{E, 2·inter, hidden}: gate rows then up rows
  const uint8_t* w1_scales = nullptr;
  const uint8_t* w2 = nullptr;        // Mxfp4WeightLayout{E, hidden, inter}
  const uint8_t* w2_scales = nullptr;
  const float* b1 = nullptr;          // [E, 2·inter] or nullptr (no expert biases)
  const float* b2 = nullptr;          // [E, hidden] or nullptr
  Activation activation{};
};

// The float64 oracle on MXFP4 weights (contract above), decoded exactly expert by expert: x
// [num_tokens, hidden] fp32 -> out [num_tokens, hidden] float64. Throws on an expert id outside [0, E).
void moe_layer_mxfp4_f64(const float* x, int num_tokens, const int32_t* topk_idx, const float* topk_weights, int k,
                         const MoeWeightsMxfp4& weights, double* out, Fp8Scaling scaling = Fp8Scaling::kPerBlock);

// ||got - want||_F / ||want||_F over n values (want the reference). Throws if want is all zero.
double relative_frobenius_error(const double* got, const double* want, size_t n);

}  // namespace moekit::ref
