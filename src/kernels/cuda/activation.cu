// FP8 quantisation kernels of the MoE layer (see activation.cuh). One warp per row; each lane
// holds 4 consecutive values of a 128-column group, so a group's amax is one warp reduction.
// The operations are the reference's, in its order: v = g / (1 + exp(-g)) * u in fp32,
// scale = max(amax, kMinAmax) / 448, q = e4m3(v / scale) (fp8.h's rounding, IEEE division).
#include <algorithm>
#include <cmath>

#include "kernels/cuda/activation.cuh"
#include "moekit/bf16.h"
#include "moekit/cuda_check.h"
#include "moekit/fp8.h"
#include "moekit/layout.h"
#include "moekit/quant.h"

namespace moekit::gpu {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // one warp per row

__device__ float silu_mul(float g, float u) {
  // The reference calls glibc's expf; fp64 exp rounded to fp32 is the correctly rounded expf,
  // which glibc's (0.502 ulp) equals except in rare halfway cases (docs/layer-gpu.md).
  const float e = float(exp(double(-g)));
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, e)), u);
}

// Quantises the warp's 4 values per lane of one 128-column group: returns the packed fp8 bytes
// and, through `scale`, the group's scale.
__device__ uint32_t quantize_group(const float (&v)[4], float& scale) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int o = kWarp / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  scale = __fdiv_rn(fmaxf(amax, kMinAmax), kFp8Max);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) packed |= uint32_t(float_to_fp8_e4m3(__fdiv_rn(v[i], scale))) << (8 * i);
  return packed;
}

// One row: gate_up [2 inter] -> out [inter] fp8, scales at out_scales[g * scale_stride].
__device__ void silu_mul_quant_row(const uint16_t* __restrict__ gate_up, int inter, uint8_t* __restrict__ out,
                                   float* __restrict__ out_scales, size_t scale_stride) {
  const int lane = threadIdx.x % kWarp;
  for (int g = 0; g < inter / kQuantBlock; ++g) {
    const int c = g * kQuantBlock + lane * 4;
    const uint2 gv = *reinterpret_cast<const uint2*>(gate_up + c);
    const uint2 uv = *reinterpret_cast<const uint2*>(gate_up + inter + c);
    const float v[4] = {silu_mul(bf16_to_float(uint16_t(gv.x)), bf16_to_float(uint16_t(uv.x))),
                        silu_mul(bf16_to_float(uint16_t(gv.x >> 16)), bf16_to_float(uint16_t(uv.x >> 16))),
                        silu_mul(bf16_to_float(uint16_t(gv.y)), bf16_to_float(uint16_t(uv.y))),
                        silu_mul(bf16_to_float(uint16_t(gv.y >> 16)), bf16_to_float(uint16_t(uv.y >> 16)))};
    float scale;
    const uint32_t q = quantize_group(v, scale);
    *reinterpret_cast<uint32_t*>(out + c) = q;
    if (lane == 0) out_scales[g * scale_stride] = scale;
  }
}

__global__ void silu_mul_quant_masked_kernel(const uint16_t* __restrict__ gate_up, int max_m, int inter,
                                             const int32_t* __restrict__ masked_m, uint8_t* __restrict__ out,
                                             float* __restrict__ out_scales) {
  const int e = blockIdx.y;
  const int m = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  const int rows = min(max(masked_m[e], 0), max_m);
  if (m >= rows) return;
  // layout.h's masked offsets (its methods are host-only): row (e, m) at (e M_max + m) K, scale
  // (e, m, kb) at (e K/128 + kb) M_max + m.
  const size_t row = size_t(e) * max_m + m;
  silu_mul_quant_row(gate_up + row * 2 * inter, inter, out + row * inter,
                     out_scales + size_t(e) * (inter / kQuantBlock) * max_m + m, size_t(max_m));
}

__global__ void silu_mul_quant_contiguous_kernel(const uint16_t* __restrict__ gate_up, int total_m, int inter,
                                                 const int32_t* __restrict__ row_expert, uint8_t* __restrict__ out,
                                                 float* __restrict__ out_scales) {
  const int m = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  if (m >= total_m || row_expert[m] < 0) return;
  // layout.h's contiguous offsets: row m at m K, scale (m, kb) at kb M_total + m.
  silu_mul_quant_row(gate_up + size_t(m) * 2 * inter, inter, out + size_t(m) * inter, out_scales + m,
                     size_t(total_m));
}

__global__ void quantize_tokens_kernel(const uint16_t* __restrict__ x, int num_tokens, int hidden, int max_m,
                                       uint8_t* __restrict__ out, float* __restrict__ out_scales, int32_t* masked_m) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *masked_m = num_tokens;
  const int m = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  if (m >= num_tokens) return;
  const int lane = threadIdx.x % kWarp;
  for (int g = 0; g < hidden / kQuantBlock; ++g) {
    const int c = g * kQuantBlock + lane * 4;
    const uint2 xv = *reinterpret_cast<const uint2*>(x + size_t(m) * hidden + c);
    const float v[4] = {bf16_to_float(uint16_t(xv.x)), bf16_to_float(uint16_t(xv.x >> 16)),
                        bf16_to_float(uint16_t(xv.y)), bf16_to_float(uint16_t(xv.y >> 16))};
    float scale;
    const uint32_t q = quantize_group(v, scale);
    *reinterpret_cast<uint32_t*>(out + size_t(m) * hidden + c) = q;  // masked, one expert
    if (lane == 0) out_scales[size_t(g) * max_m + m] = scale;
  }
}

}  // namespace

void launch_silu_mul_quant_masked(const uint16_t* gate_up, int num_experts, int max_m, int inter,
                                  const int32_t* masked_m, uint8_t* out, float* out_scales, cudaStream_t stream) {
  if (num_experts == 0 || max_m == 0) return;
  const dim3 grid((max_m + kRowsPerBlock - 1) / kRowsPerBlock, num_experts);
  silu_mul_quant_masked_kernel<<<grid, kRowsPerBlock * kWarp, 0, stream>>>(gate_up, max_m, inter, masked_m, out,
                                                                           out_scales);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void launch_silu_mul_quant_contiguous(const uint16_t* gate_up, int total_m, int inter, const int32_t* row_expert,
                                      uint8_t* out, float* out_scales, cudaStream_t stream) {
  if (total_m == 0) return;
  silu_mul_quant_contiguous_kernel<<<(total_m + kRowsPerBlock - 1) / kRowsPerBlock, kRowsPerBlock * kWarp, 0,
                                     stream>>>(gate_up, total_m, inter, row_expert, out, out_scales);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void launch_quantize_tokens(const uint16_t* x, int num_tokens, int hidden, int max_m, uint8_t* out, float* out_scales,
                            int32_t* masked_m, cudaStream_t stream) {
  const int blocks = std::max(1, (num_tokens + kRowsPerBlock - 1) / kRowsPerBlock);
  quantize_tokens_kernel<<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(x, num_tokens, hidden, max_m, out, out_scales,
                                                                       masked_m);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::gpu
