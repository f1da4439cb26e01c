// silu_fp8.cuh: the activation's arithmetic on one value and the 1x128 scale of one group, shared
// by the activation kernels (activation.cu) and the GEMM's fused SiLU·up epilogue
// (gemm_epilogue.cuh), so both give the reference's bits (reference.h: silu_mul_quant_*).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "moekit/fp8.h"
#include "moekit/quant.h"

namespace moekit {

// a / b rounded to fp32 as IEEE division rounds it, for b > 0 (up to +infinity), without the
// subroutine CUDA's correctly rounded division calls: that call, one per value, kept the 8
// activations of a GEMM1 thread from overlapping and made the gated epilogue's SiLU phase ~4 900
// SM cycles per tile instead of ~1 600 (docs/gemm.md run 19). The quotient is formed in fp64 from a
// reciprocal refined to about an ulp and rounded once. That is exact: unless b is a power of two
// (then the reciprocal and the product are exact), a quotient of two fp32 values is never within
// 2^-50 (relative) of a point halfway between two fp32 values, and the fp64 product is within
// 1.5 * 2^-52 of the quotient, so both round the same way (subnormal results included; a / inf =
// ±0 and inf / inf = NaN as IEEE; a NaN stays NaN).
// The two halves: reciprocal_rn(b) depends on b alone, so values divided by one scale share it
// (div_by(a, reciprocal_rn(b)) is div_rn(a, b), bit for bit).
__device__ __forceinline__ double reciprocal_rn(float b) {
  const double bd = b;
  double y;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(y) : "d"(bd));
  y = fma(fma(-bd, y, 1.0), y, y);
  y = fma(fma(-bd, y, 1.0), y, y);
  return isinf(b) ? 0.0 : y;
}
__device__ __forceinline__ float div_by(float a, double reciprocal) { return __double2float_rn(double(a) * reciprocal); }
__device__ __forceinline__ float div_rn(float a, float b) { return div_by(a, reciprocal_rn(b)); }

// Each activation is its gate half times its up half in fp32, as the reference multiplies them.
// SiLU(g)·u in the reference's order: g / (1 + exp(-g)) * u, in fp32. The reference calls glibc's
// expf; fp64 exp rounded to fp32 is the correctly rounded expf, which glibc's (0.502 ulp) equals
// except in rare halfway cases (docs/layer-gpu.md).
__device__ __forceinline__ float silu_gate(float g) {
  const float e = float(exp(double(-g)));
  return div_rn(g, __fadd_rn(1.0f, e));
}
__device__ __forceinline__ float silu_mul(float g, float u) { return __fmul_rn(silu_gate(g), u); }

// reference.h's clamped_swiglu in its order: g = min(gate, limit), u = clamp(up, -limit, limit),
// g / (1 + exp(-(alpha g))) * (u + 1), in fp32 (exp as silu_gate's; a NaN stays NaN).
__device__ __forceinline__ float clamped_swiglu_gate(float gate, float alpha, float limit) {
  const float g = gate > limit ? limit : gate;
  const float e = float(exp(double(-__fmul_rn(alpha, g))));
  return div_rn(g, __fadd_rn(1.0f, e));
}
__device__ __forceinline__ float clamped_swiglu_up(float up, float limit) {
  return __fadd_rn(up > limit ? limit : (up < -limit ? -limit : up), 1.0f);
}

// An expert activation on the device (reference.h's ref::Activation): SiLU·up, or gpt-oss's
// clamped SwiGLU with its constants as fp32. The activation kernels take the gate half from
// gate_table: activation_gate of every bf16 gate, made on the device (activation.cuh
// ActivationTable), so a look-up gives the bits the functions above compute.
struct GpuActivation {
  bool clamped_swiglu = false;
  float alpha = 0.0f, limit = 0.0f;
  const float* gate_table = nullptr;  // [65536], indexed by the gate's bf16 bits
  // The FP8 output in the MXFP4 GEMM's K order (mxfp4.h): an MXFP4 layer's GEMM2 reads it so.
  bool mxfp4_k_order = false;
  // One scale per row for all of inter (quant.h Fp8Scaling::kPerToken), in each of the row's
  // inter/128 slots: an MXFP4 layer's prefill. The contiguous kernel only.
  bool token_scales = false;
};

__device__ __forceinline__ float activation_gate(const GpuActivation& a, float gate) {
  return a.clamped_swiglu ? clamped_swiglu_gate(gate, a.alpha, a.limit) : silu_gate(gate);
}
__device__ __forceinline__ float activation_up(const GpuActivation& a, float up) {
  return a.clamped_swiglu ? clamped_swiglu_up(up, a.limit) : up;
}

// quant.h's scale of a group whose largest magnitude is amax: div_rn by 448 with the reciprocal a
// constant, the double nearest 1/448 (div_by's argument above holds for any reciprocal within an
// ulp or so, and this one is within half of one), instead of refining it at run time per group.
constexpr double kFp8MaxReciprocal = 1.0 / double(kFp8Max);
__device__ __forceinline__ float fp8_group_scale(float amax) { return div_by(fmaxf(amax, kMinAmax), kFp8MaxReciprocal); }

// Four e4m3 codes of finite quotients, byte i = q_i: the hardware conversion (round to nearest
// even, saturating at 448, subnormals kept), which is fp8.h's float_to_fp8_e4m3 on finite input,
// two values per instruction.
__device__ __forceinline__ uint32_t fp8x4_e4m3_finite(float q0, float q1, float q2, float q3) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(q1), "f"(q0));  // first operand: upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(q3), "f"(q2));
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// One value's e4m3 code under that scale (fp8.h's rounding, IEEE division: div_rn). A finite quotient
// takes the hardware conversion (round to nearest even, saturating at 448, subnormals kept: fp8.h's
// float_to_fp8_e4m3 on finite input, one instruction instead of its ~25); NaN and infinity take
// fp8.h's, whose NaN code is the reference's.
// fp8_quantize_by takes reciprocal_rn(scale), computed once for the values of one group.
__device__ __forceinline__ uint8_t fp8_quantize_by(float v, double scale_reciprocal) {
  const float q = div_by(v, scale_reciprocal);
  return isfinite(q) ? uint8_t(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3)) : float_to_fp8_e4m3(q);
}

}  // namespace moekit
