// Internal to moekit_cuda: one warp quantises one 128-column group to FP8 e4m3, each lane 4
// consecutive values, so the group's amax is one warp reduction. The activation kernels
// (activation.cu) and the token and block quantisation kernels (quantize.cu) share it; both give
// quant.h's bits: scale = max(amax, kMinAmax) / 448, q = e4m3(v / scale) with fp8.h's rounding and
// an IEEE division (silu_fp8.cuh div_by).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/silu_fp8.cuh"
#include "moekit/bf16.h"
#include "moekit/fp8.h"

namespace moekit::gpu::warp_quant {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // CTAs of 8 warps: one row (or one item) per warp

// The e4m3 codes of a lane's 4 values divided by one scale (fp8_quantize_by's bits), packed: two
// paired hardware conversions when every quotient of the warp is finite (always, for finite
// inputs), else fp8.h's conversion per value, whose NaN code is the reference's. One vote per
// group instead of a test and a branch per value. Called by whole warps.
__device__ __forceinline__ uint32_t fp8x4_by(const float (&v)[4], double inv) {
  float q[4];
  bool finite = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    q[i] = div_by(v[i], inv);
    finite = finite && isfinite(q[i]);
  }
  if (__all_sync(0xffffffffu, finite)) return fp8x4_e4m3_finite(q[0], q[1], q[2], q[3]);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) packed |= uint32_t(fp8_quantize_by(v[i], inv)) << (8 * i);
  return packed;
}

// Quantises the warp's 4 values per lane of one 128-column group: returns the packed fp8 bytes
// and, through `scale`, the group's scale. Called by whole warps.
__device__ inline uint32_t quantize_group(const float (&v)[4], float& scale) {
  const float lane_amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  // The warp's largest: one integer max over the bits (ordered as the non-negative floats are),
  // where a chain of five shuffles and fmaxf was. fmaxf drops a NaN unless every operand is one;
  // a lane whose four are all NaN enters as 0 instead, which fp8_group_scale's floor makes the
  // same scale as the NaN the shuffles would give when every lane is NaN.
  const unsigned bits = __reduce_max_sync(0xffffffffu, isnan(lane_amax) ? 0u : __float_as_uint(lane_amax));
  scale = fp8_group_scale(__uint_as_float(bits));
  return fp8x4_by(v, reciprocal_rn(scale));  // one reciprocal for the lane's 4 divisions
}

// Four consecutive inputs as fp32: bf16 widened exactly, fp32 as it is.
__device__ inline void load4(const uint16_t* p, float (&v)[4]) {
  const uint2 b = *reinterpret_cast<const uint2*>(p);
  v[0] = bf16_to_float(uint16_t(b.x));
  v[1] = bf16_to_float(uint16_t(b.x >> 16));
  v[2] = bf16_to_float(uint16_t(b.y));
  v[3] = bf16_to_float(uint16_t(b.y >> 16));
}
__device__ inline void load4(const float* p, float (&v)[4]) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  v[0] = f.x;
  v[1] = f.y;
  v[2] = f.z;
  v[3] = f.w;
}

// quant_gpu.h's report of a non-finite input: the smallest flattened index wins.
__device__ inline void note_non_finite(const float (&v)[4], unsigned long long index, unsigned long long* first_bad) {
  if (first_bad == nullptr) return;
  for (int i = 0; i < 4; ++i)
    if (!isfinite(v[i])) {
      atomicMin(first_bad, index + i);
      return;
    }
}

}  // namespace moekit::gpu::warp_quant
