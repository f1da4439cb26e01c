// FP8 token and block quantisation on the GPU: the MoE layer's shared-expert input
// (quantize.cuh) and the public kernels of quant_gpu.h. Tokens: one warp per 128-column group
// (quant_warp.cuh); weight blocks: one CTA per 128x128 block. Both give quant.h's bits.
#include <algorithm>
#include <cmath>

#include "ep/cuda/ep_format.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/quant_warp.cuh"
#include "kernels/cuda/quantize.cuh"
#include "kernels/cuda/silu_fp8.cuh"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/fp8.h"
#include "moekit/layout.h"
#include "moekit/quant.h"
#include "moekit/quant_gpu.h"

namespace moekit::gpu {
namespace {

using warp_quant::kRowsPerBlock;
using warp_quant::kWarp;
using warp_quant::load4;
using warp_quant::note_non_finite;
using warp_quant::quantize_group;

// The shared expert's input: x [T, d] bf16 -> FP8 1x128 as one masked expert. One warp per
// (row, group) item over as many CTAs as the items need: each warp's work is one load and one
// store, so the kernel takes one memory round trip whatever T is (dealing the items of 8 rows
// over one CTA's warps took T/8 dependent rounds: 50-90 us at 8 tokens, measured on the stage
// clock, 2026-11-30).
__global__ void quantize_tokens_kernel(const uint16_t* __restrict__ x, int num_tokens, int hidden, int max_m,
                                       uint8_t* __restrict__ out, float* __restrict__ out_scales, int32_t* masked_m,
                                       unsigned long long* stamp) {
  begin_kernel(stamp);
  if (blockIdx.x == 0 && threadIdx.x == 0) *masked_m = num_tokens;
  const int groups = hidden / kQuantBlock;
  const int lane = threadIdx.x % kWarp;
  const int64_t item = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (item < int64_t(num_tokens) * groups) {
    const int m = int(item / groups), g = int(item % groups);
    const int c = g * kQuantBlock + lane * 4;
    const uint2 xv = *reinterpret_cast<const uint2*>(x + size_t(m) * hidden + c);
    const float v[4] = {bf16_to_float(uint16_t(xv.x)), bf16_to_float(uint16_t(xv.x >> 16)),
                        bf16_to_float(uint16_t(xv.y)), bf16_to_float(uint16_t(xv.y >> 16))};
    float scale;
    const uint32_t q = quantize_group(v, scale);
    *reinterpret_cast<uint32_t*>(out + size_t(m) * hidden + c) = q;  // masked, one expert
    if (lane == 0) out_scales[size_t(g) * max_m + m] = scale;
  }
  end_kernel(stamp);
}

// quant_gpu.h tokens: row `row` of x [batches * rows, k]; its scales at [b, g, m] of
// [batches, k/128, rows].
template <class T>
__global__ void quantize_token_rows_kernel(const T* __restrict__ x, int64_t total_rows, int64_t rows, int k,
                                           uint8_t* __restrict__ q, float* __restrict__ scales,
                                           unsigned long long* first_bad) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= total_rows) return;
  const int lane = threadIdx.x % kWarp;
  const int groups = k / kQuantBlock;
  float* s = scales + (row / rows) * groups * rows + row % rows;
  for (int g = 0; g < groups; ++g) {
    const int64_t i = row * k + g * kQuantBlock + lane * 4;
    float v[4];
    load4(x + i, v);
    note_non_finite(v, uint64_t(i), first_bad);
    float scale;
    const uint32_t packed = quantize_group(v, scale);
    *reinterpret_cast<uint32_t*>(q + i) = packed;
    if (lane == 0) s[int64_t(g) * rows] = scale;
  }
}

// quant_gpu.h blocks: CTA (cb, rb, b) quantises the 128x128 block; thread t covers row t / 2,
// columns (t % 2) * 64 .. + 64, read twice (amax, then values: the second read hits L1/L2).
constexpr int kBlockThreads = 256;
template <class T>
__global__ void __launch_bounds__(kBlockThreads) quantize_blocks_kernel(const T* __restrict__ w, int n, int k,
                                                                        uint8_t* __restrict__ q,
                                                                        float* __restrict__ scales,
                                                                        unsigned long long* first_bad) {
  __shared__ float warp_amax[kBlockThreads / kWarp];
  const int cb = blockIdx.x, rb = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int64_t base = b * n * k + int64_t(rb * kQuantBlock + threadIdx.x / 2) * k + cb * kQuantBlock +
                       (threadIdx.x % 2) * (kQuantBlock / 2);
  float amax = 0.0f;
  for (int i = 0; i < kQuantBlock / 2; i += 4) {
    float v[4];
    load4(w + base + i, v);
    note_non_finite(v, uint64_t(base + i), first_bad);
    amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
  }
  for (int o = kWarp / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % kWarp == 0) warp_amax[threadIdx.x / kWarp] = amax;
  __syncthreads();
  amax = warp_amax[0];
  for (int i = 1; i < kBlockThreads / kWarp; ++i) amax = fmaxf(amax, warp_amax[i]);
  const float scale = fp8_group_scale(amax);
  const double inv = reciprocal_rn(scale);
  for (int i = 0; i < kQuantBlock / 2; i += 4) {
    float v[4];
    load4(w + base + i, v);
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) packed |= uint32_t(fp8_quantize_by(v[j], inv)) << (8 * j);
    *reinterpret_cast<uint32_t*>(q + base + i) = packed;
  }
  if (threadIdx.x == 0) scales[(b * (n / kQuantBlock) + rb) * (k / kQuantBlock) + cb] = scale;
}

// Host checks shared by the public launches: the vector loads need aligned rows.
void check_quant_args(const char* what, const void* x, size_t x_align, const uint8_t* q, const float* scales,
                      int64_t batches, int64_t rows, int k) {
  MOEKIT_CHECK(k > 0 && k % kQuantBlock == 0, fmtr("{}: k = {} must be a positive multiple of 128", what, k));
  MOEKIT_CHECK(batches >= 0 && rows >= 0, fmtr("{}: batches = {}, rows = {} must be >= 0", what, batches, rows));
  MOEKIT_CHECK(reinterpret_cast<uintptr_t>(x) % x_align == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(scales) % 4 == 0,
               fmtr("{}: x must be {}-byte aligned and q 4-byte aligned (x = {}, q = {})", what, x_align, x,
                    static_cast<const void*>(q)));
}

template <class T>
void launch_quantize_tokens_fp8(const T* x, int64_t batches, int64_t rows, int k, uint8_t* q, float* scales,
                                unsigned long long* first_bad, cudaStream_t stream) {
  check_quant_args("quantize_tokens_fp8", x, 4 * sizeof(T), q, scales, batches, rows, k);
  const int64_t total = batches * rows;
  if (total == 0) return;
  const int64_t blocks = (total + kRowsPerBlock - 1) / kRowsPerBlock;
  MOEKIT_CHECK(blocks < (int64_t(1) << 31), fmtr("quantize_tokens_fp8: {} rows are too many for one launch", total));
  quantize_token_rows_kernel<<<unsigned(blocks), kRowsPerBlock * kWarp, 0, stream>>>(x, total, rows, k, q, scales,
                                                                                      first_bad);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_quantize_blocks_fp8(const T* w, int64_t batches, int n, int k, uint8_t* q, float* scales,
                                unsigned long long* first_bad, cudaStream_t stream) {
  check_quant_args("quantize_blocks_fp8", w, 4 * sizeof(T), q, scales, batches, n, k);
  MOEKIT_CHECK(n % kQuantBlock == 0, fmtr("quantize_blocks_fp8: n = {} must be a multiple of 128", n));
  MOEKIT_CHECK(batches < 65536 && n / kQuantBlock < 65536,
               fmtr("quantize_blocks_fp8: batches = {} and n/128 = {} must be < 65536", batches, n / kQuantBlock));
  if (batches == 0 || n == 0) return;
  const dim3 grid(k / kQuantBlock, n / kQuantBlock, unsigned(batches));
  quantize_blocks_kernel<<<grid, kBlockThreads, 0, stream>>>(w, n, k, q, scales, first_bad);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_tokens_fp8(const uint16_t* x, int64_t batches, int64_t rows, int k, uint8_t* q, float* scales,
                         unsigned long long* first_bad, cudaStream_t stream) {
  launch_quantize_tokens_fp8(x, batches, rows, k, q, scales, first_bad, stream);
}
void quantize_tokens_fp8(const float* x, int64_t batches, int64_t rows, int k, uint8_t* q, float* scales,
                         unsigned long long* first_bad, cudaStream_t stream) {
  launch_quantize_tokens_fp8(x, batches, rows, k, q, scales, first_bad, stream);
}
void quantize_blocks_fp8(const uint16_t* w, int64_t batches, int n, int k, uint8_t* q, float* scales,
                         unsigned long long* first_bad, cudaStream_t stream) {
  launch_quantize_blocks_fp8(w, batches, n, k, q, scales, first_bad, stream);
}
void quantize_blocks_fp8(const float* w, int64_t batches, int n, int k, uint8_t* q, float* scales,
                         unsigned long long* first_bad, cudaStream_t stream) {
  launch_quantize_blocks_fp8(w, batches, n, k, q, scales, first_bad, stream);
}

void launch_quantize_tokens(const uint16_t* x, int num_tokens, int hidden, int max_m, uint8_t* out, float* out_scales,
                            int32_t* masked_m, cudaStream_t stream, const LaunchOptions& opt) {
  const int64_t items = int64_t(num_tokens) * (hidden / kQuantBlock);
  const int blocks = int(std::max<int64_t>(1, (items + kRowsPerBlock - 1) / kRowsPerBlock));
  launch_kernel_ex(quantize_tokens_kernel, dim3(blocks), dim3(kRowsPerBlock * kWarp), 0, stream, opt.pdl, x,
                   num_tokens, hidden, max_m, out, out_scales, masked_m, opt.stamp);
}

}  // namespace moekit::gpu
