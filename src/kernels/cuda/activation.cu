// The MoE layer's activation kernels: act(gate, up) fused with FP8 quantisation, masked and
// contiguous, 1x128 groups or one scale per token (activation.cuh). One warp per row or per
// (row, group) item; the quantisation is quant_warp.cuh's. The operations are the reference's, in
// its order: v = g / (1 + exp(-g)) * u in fp32 (the gate half g / (1 + exp(-g)) looked up:
// gate_table.h), scale = max(amax, kMinAmax) / 448, q = e4m3(v / scale) (fp8.h's rounding, IEEE
// division).
#include <algorithm>
#include <cmath>

#include "ep/cuda/ep_format.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/gate_table.h"
#include "kernels/cuda/gemm_host.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/quant_warp.cuh"
#include "kernels/cuda/silu_fp8.cuh"
#include "kernels/cuda/warp_prefix.cuh"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/fp8.h"
#include "moekit/layout.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"

namespace moekit::gpu {
namespace {

using warp_quant::fp8x4_by;
using warp_quant::kRowsPerBlock;
using warp_quant::kWarp;
using warp_quant::quantize_group;

// The CTA's window of the gate table (gate_table.h): two runs of the global table, 16 bytes per
// copy. Called before the grid dependency wait: the table is written once, at set-up.
__device__ void load_gate_window(const float* __restrict__ table, float* window) {
  static_assert(kGateWindowHalf % 4 == 0 && kGateWindowFirstBits % 4 == 0, "4-entry copies stay in one run");
  for (int i = threadIdx.x * 4; i < kGateWindow; i += blockDim.x * 4)
    *reinterpret_cast<float4*>(window + i) = __ldg(reinterpret_cast<const float4*>(table + gate_window_bits(i)));
}

// The gate halves of a lane's 4 gates (bf16 bits as loaded): from the window when every gate of
// the warp is in it (the common case: one vote, where a test and a predicated global load per
// value cost issue slots whether taken or not), else each from the window or the global table.
// Called by whole warps.
__device__ __forceinline__ void gate_halves4(const float* __restrict__ table, const float* window, uint2 gv,
                                             float (&h)[4]) {
  const uint16_t g[4] = {uint16_t(gv.x), uint16_t(gv.x >> 16), uint16_t(gv.y), uint16_t(gv.y >> 16)};
  const unsigned any_off = gate_window_offset(g[0]) | gate_window_offset(g[1]) | gate_window_offset(g[2]) |
                           gate_window_offset(g[3]);
  if (__all_sync(0xffffffffu, any_off < unsigned(kGateWindowHalf))) {
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = window[gate_window_entry(g[j])];
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = gate_window_index(g[j]);
      h[j] = i >= 0 ? window[i] : __ldg(table + g[j]);
    }
  }
}

// act(gate, up) of a lane's 4 values of a group (bf16 pairs as loaded), in the reference's
// operations: the gate half (looked up) times the up half (activation_up's, with the kind a
// template parameter, so that a SiLU kernel carries no clamp code), in fp32.
template <bool kClamped>
__device__ __forceinline__ void activate4(const GpuActivation& act, const float* window, uint2 gv, uint2 uv,
                                          float (&v)[4]) {
  float h[4];
  gate_halves4(act.gate_table, window, gv, h);
  const uint16_t u[4] = {uint16_t(uv.x), uint16_t(uv.x >> 16), uint16_t(uv.y), uint16_t(uv.y >> 16)};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float up = bf16_to_float(u[j]);
    v[j] = __fmul_rn(h[j], kClamped ? clamped_swiglu_up(up, act.limit) : up);
  }
}

// Where lane's 4 values of a 128-column group go: bytes 4 lane.., or in the MXFP4 GEMM's K order
// (GpuActivation::mxfp4_k_order) that unit's place in the block. Either way one warp writes one
// 128-byte block.
__device__ __forceinline__ int group_unit_offset(const GpuActivation& act, int lane) {
  return (act.mxfp4_k_order ? mxfp4_unit_position(lane) : lane) * 4;
}

// One 128-column group g of one row: gate_up [2 inter] -> out [inter] fp8, its scale to *scale.
template <bool kClamped>
__device__ void silu_mul_quant_group(const GpuActivation& act, const float* window,
                                     const uint16_t* __restrict__ gate_up, int inter, int g,
                                     uint8_t* __restrict__ out, float* __restrict__ scale_out) {
  const int lane = threadIdx.x % kWarp;
  const int c = g * kQuantBlock + lane * 4;
  float v[4];
  activate4<kClamped>(act, window, *reinterpret_cast<const uint2*>(gate_up + c),
                      *reinterpret_cast<const uint2*>(gate_up + inter + c), v);
  float scale;
  const uint32_t q = quantize_group(v, scale);
  *reinterpret_cast<uint32_t*>(out + g * kQuantBlock + group_unit_offset(act, lane)) = q;
  if (lane == 0) *scale_out = scale;
}

// The masked kernel deals the (row, group) items of every expert's valid rows over all the grid's
// warps (row_start: the valid rows of experts < e, one warp's prefix in shared memory). Each warp
// takes one contiguous slice of the items and walks it in runs of kActItems (a row's next groups,
// 1 KB of gate and 1 KB of up per warp), each run loaded before any of it is computed; a slice's
// row, group and expert come from one division and one search, and its items step through them.
// The grid is sized from M_max, which a step's rows rarely approach, so it is what fits the GPU at
// once (kActCtasPerSm per SM) and the slices are cut from the rows there are. Each CTA first
// copies the gate table's window into shared memory (16 KB); a second round of CTAs would copy it
// again. History (docs/layer-gpu.md items 36, 39, 43): one CTA per 8 rows of each expert with 16
// dependent items per warp took 56-70 us for 21 MB at 2048 tokens (DeepSeek-V3, EP8); runs of
// items dealt over the grid took it to 38 us, the gate table to ~24 us on the eager events, and
// what bound it then was the instructions per item (~250, of which the clamp's run-time
// branches, a reciprocal of 448 per group, and a test, a predicated global load and a branch per
// value): the kind is a template parameter now, and the window and finiteness tests one vote
// per group.
constexpr int kActItems = 4;
constexpr int kActCtasPerSm = 4;  // 256 threads of <= 64 registers and 16 KB of shared memory each
constexpr int kActMaxExperts = 4096;  // row_start's 16 KB beside the window

template <bool kClamped>
__global__ void __launch_bounds__(kRowsPerBlock * kWarp, kActCtasPerSm)
    silu_mul_quant_masked_kernel(const uint16_t* __restrict__ gate_up, int num_experts, int max_m, int inter,
                                 const int32_t* __restrict__ masked_m, uint8_t* __restrict__ out,
                                 float* __restrict__ out_scales, GpuActivation act, unsigned long long* stamp) {
  extern __shared__ int row_start[];  // [E + 1]
  __shared__ __align__(16) float window[kGateWindow];
  load_gate_window(act.gate_table, window);
  begin_kernel(stamp);
  if (threadIdx.x < kWarp) warp_prefix(row_start, num_experts, [&](int e) { return min(max(masked_m[e], 0), max_m); });
  __syncthreads();
  const int groups = inter / kQuantBlock;
  const int lane = threadIdx.x % kWarp;
  const int64_t items = int64_t(row_start[num_experts]) * groups;
  const int64_t warps = int64_t(gridDim.x) * kRowsPerBlock;
  const int64_t per_warp = (items + warps - 1) / warps;
  const int64_t begin = (int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp) * per_warp;
  const int64_t end = begin + per_warp < items ? begin + per_warp : items;
  // layout.h's masked offsets (its methods are host-only): row (e, m) at (e M_max + m) K, scale
  // (e, m, kb) at (e K/128 + kb) M_max + m. The walk's position: group g of row r (all experts'
  // rows counted), row m of expert e, and the lane's pointer into that row's gate_up (set when the
  // row changes, every `groups` items, so that an item's loads are one add away).
  int r = 0, g = 0, e = 0, m = 0;
  const uint16_t* src_row = nullptr;
  auto set_row = [&] { src_row = gate_up + (size_t(e) * max_m + m) * 2 * inter + lane * 4; };
  if (begin < end) {
    r = int(begin / groups);
    g = int(begin - int64_t(r) * groups);
    e = segment_of(row_start, num_experts, r);
    m = r - row_start[e];
    set_row();
  }
  for (int64_t first = begin; first < end; first += kActItems) {
    const int n = end - first < kActItems ? int(end - first) : kActItems;
    const bool more = first + kActItems < end;  // another run follows this one
    int e_of[kActItems], m_of[kActItems], group[kActItems];
    uint2 gv[kActItems], uv[kActItems];
#pragma unroll
    for (int u = 0; u < kActItems; ++u) {
      if (u >= n) break;
      e_of[u] = e;
      m_of[u] = m;
      group[u] = g;
      const uint16_t* src = src_row + g * kQuantBlock;
      gv[u] = *reinterpret_cast<const uint2*>(src);
      uv[u] = *reinterpret_cast<const uint2*>(src + inter);
      if ((u + 1 < n || more) && ++g == groups) {  // the next row, the next expert with rows where this one ends
        g = 0;
        ++m;
        if (++r == row_start[e + 1]) {
          while (row_start[e + 1] <= r) ++e;
          m = 0;
        }
        set_row();
      }
    }
#pragma unroll
    for (int u = 0; u < kActItems; ++u) {
      if (u >= n) break;
      float v[4], scale;
      activate4<kClamped>(act, window, gv[u], uv[u], v);
      const uint32_t q = quantize_group(v, scale);
      *reinterpret_cast<uint32_t*>(out + (size_t(e_of[u]) * max_m + m_of[u]) * inter + group[u] * kQuantBlock +
                                   group_unit_offset(act, lane)) = q;
      if (lane == 0) out_scales[(size_t(e_of[u]) * groups + group[u]) * max_m + m_of[u]] = scale;
    }
  }
  end_kernel(stamp);
}

// The contiguous kernel: blocks of 8 rows, dealt over a grid that fits the GPU at once (each CTA
// copies the gate window once, as the masked kernel's).
constexpr int kContiguousCtasPerSm = 8;  // 256 threads of <= 32 registers and 16 KB of shared memory each

template <bool kClamped>
__global__ void __launch_bounds__(kRowsPerBlock * kWarp, kContiguousCtasPerSm)
    silu_mul_quant_contiguous_kernel(const uint16_t* __restrict__ gate_up, int total_m, int inter,
                                     const int32_t* __restrict__ row_expert, uint8_t* __restrict__ out,
                                     float* __restrict__ out_scales, GpuActivation act, unsigned long long* stamp) {
  __shared__ __align__(16) float window[kGateWindow];
  load_gate_window(act.gate_table, window);
  begin_kernel(stamp);
  __syncthreads();  // the window
  const int groups = inter / kQuantBlock;
  for (int m0 = blockIdx.x * kRowsPerBlock; m0 < total_m; m0 += gridDim.x * kRowsPerBlock) {
    const int n = min(kRowsPerBlock, total_m - m0);
    for (int item = threadIdx.x / kWarp; item < n * groups; item += kRowsPerBlock) {
      const int m = m0 + item / groups, g = item % groups;
      if (row_expert[m] < 0) continue;
      // layout.h's contiguous offsets: row m at m K, scale (m, kb) at kb M_total + m.
      silu_mul_quant_group<kClamped>(act, window, gate_up + size_t(m) * 2 * inter, inter, g,
                                     out + size_t(m) * inter, out_scales + size_t(g) * total_m + m);
    }
  }
  end_kernel(stamp);
}

// Per token (GpuActivation::token_scales): one warp per row, the row's largest magnitude (by
// quantize_group's rule: a lane's NaNs left out) first, then its codes under the one scale, which
// goes into each of the row's inter/128 slots. Between the two a warp keeps its row's activated
// values of the first kHeldGroups groups in shared memory (gpt-oss-120b's 23 groups: 11.5 KB), so
// the row is read and activated once; a wider row's further groups are activated again. (Computing
// every group twice made the kernel 25% slower than the 1x128 one in gpt-oss-120b's prefill,
// docs/gemm-mxfp4.md run 43; holding the values in registers instead unrolls 24 groups' code,
// ~250 KB of instructions a row.)
constexpr int kHeldGroups = 24;
constexpr int kTokenCtasPerSm = 2;  // 96 KB of held values and the 16 KB gate window each
constexpr int kPrefetchGroups = 4;
constexpr size_t kTokenHeldBytes = size_t(kRowsPerBlock) * kHeldGroups * kQuantBlock * sizeof(float);
// The masked (decode) form gives every row a team of at least kMaskedMinTeam warps, each holding
// kMaskedHeldGroups groups (gpt-oss-120b's 23 groups over 4 warps: 6 each), so that its CTAs hold
// 24 KB of values and 4 fit an SM, 32 warps: with one warp a row and 96 KB a CTA, at B = 1024
// (4096 rows) the kernel ran at 25% occupancy and 41% of its issue slots, 38.5 us under ncu against
// the 1 x 128 kernel's 34.0 at 41% occupancy (one H100, 2026-12-07). In the step: 39.5 us against
// 42.4 at B = 1024, level at 64 and 256 (the 1 x 128 kernel: 35.1).
constexpr int kMaskedMinTeam = 4;
constexpr int kMaskedHeldGroups = 6;
constexpr int kMaskedTokenCtasPerSm = 4;
constexpr size_t kMaskedHeldBytes = size_t(kRowsPerBlock) * kMaskedHeldGroups * kQuantBlock * sizeof(float);

// Groups g_first, g_first + g_step, ... of one row by one warp: gate_up_row [2 inter] -> out_row
// [inter] fp8 under the row's one scale, which goes into slots scale_slot + g scale_stride.
// row_amax(warp's amax bits) gives the row's amax bits: the warp's own when it takes the whole row,
// else its team's (called by every warp of the CTA, also one with no groups: g_first >= groups).
// held: the warp's [kHeld][kWarp] float4s of shared memory, offset by the lane; its slot j holds
// the warp's j-th group (its groups past kHeld are activated again for the codes).
template <bool kClamped, int kHeld, class RowAmax>
__device__ __forceinline__ void quant_token_groups(const GpuActivation& act, const float* window, float4* held,
                                                   const uint16_t* __restrict__ gate_up_row, int inter, int g_first,
                                                   int g_step, uint8_t* __restrict__ out_row,
                                                   float* __restrict__ scale_slot, size_t scale_stride,
                                                   RowAmax&& row_amax) {
  const int groups = inter / kQuantBlock, lane = threadIdx.x % kWarp;
  const uint16_t* src = gate_up_row + lane * 4;
  auto activated = [&](int g, float(&v)[4]) {
    activate4<kClamped>(act, window, *reinterpret_cast<const uint2*>(src + g * kQuantBlock),
                        *reinterpret_cast<const uint2*>(src + inter + g * kQuantBlock), v);
  };
  float lane_amax = 0.0f;
  // Four groups' loads in flight per lane before any is used: at 2 CTAs per SM the warps alone do
  // not cover HBM's latency (the compiler keeps a group's loads behind the previous group's work).
  for (int j0 = 0; g_first + j0 * g_step < groups; j0 += kPrefetchGroups) {
    uint2 gate[kPrefetchGroups], up[kPrefetchGroups];
#pragma unroll
    for (int i = 0; i < kPrefetchGroups; ++i) {
      const int g = g_first + (j0 + i) * g_step;
      if (g < groups) {
        gate[i] = *reinterpret_cast<const uint2*>(src + g * kQuantBlock);
        up[i] = *reinterpret_cast<const uint2*>(src + inter + g * kQuantBlock);
      }
    }
#pragma unroll
    for (int i = 0; i < kPrefetchGroups; ++i)
      if (g_first + (j0 + i) * g_step < groups) {
        float v[4];
        activate4<kClamped>(act, window, gate[i], up[i], v);
        lane_amax = fmaxf(lane_amax, fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
        if (j0 + i < kHeld) held[(j0 + i) * kWarp] = make_float4(v[0], v[1], v[2], v[3]);
      }
  }
  const unsigned bits = row_amax(__reduce_max_sync(0xffffffffu, isnan(lane_amax) ? 0u : __float_as_uint(lane_amax)));
  const float scale = fp8_group_scale(__uint_as_float(bits));
  const double inv = reciprocal_rn(scale);
  for (int j = 0, g = g_first; g < groups; ++j, g += g_step) {
    float v[4];
    if (j < kHeld) {
      const float4 h = held[j * kWarp];
      v[0] = h.x, v[1] = h.y, v[2] = h.z, v[3] = h.w;
    } else {
      activated(g, v);
    }
    *reinterpret_cast<uint32_t*>(out_row + g * kQuantBlock + group_unit_offset(act, lane)) = fp8x4_by(v, inv);
    if (lane == 0) scale_slot[g * scale_stride] = scale;
  }
}

template <bool kClamped>
__global__ void __launch_bounds__(kRowsPerBlock * kWarp, kTokenCtasPerSm)
    silu_mul_quant_contiguous_token_kernel(const uint16_t* __restrict__ gate_up, int total_m, int inter,
                                           const int32_t* __restrict__ row_expert, uint8_t* __restrict__ out,
                                           float* __restrict__ out_scales, GpuActivation act,
                                           unsigned long long* stamp) {
  __shared__ __align__(16) float window[kGateWindow];
  extern __shared__ float4 held_values[];  // [warp][group][lane]: a lane's 4 values of a group
  load_gate_window(act.gate_table, window);
  begin_kernel(stamp);
  __syncthreads();  // the window
  float4* held = held_values + size_t(threadIdx.x / kWarp) * kHeldGroups * kWarp + threadIdx.x % kWarp;
  for (int m = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp; m < total_m; m += gridDim.x * kRowsPerBlock) {
    if (row_expert[m] < 0) continue;  // warp-uniform: one warp per row
    // layout.h: scale (m, g) at g M_total + m.
    quant_token_groups<kClamped, kHeldGroups>(act, window, held, gate_up + size_t(m) * 2 * inter, inter, 0, 1,
                                 out + size_t(m) * inter, out_scales + m, size_t(total_m), [](unsigned b) { return b; });
  }
  end_kernel(stamp);
}

// The masked layout per token: each expert's valid rows (row_start after the held values: the
// valid rows of experts < e, one warp's prefix) dealt over the grid, each to a team of 4 or 8
// warps of one CTA: 8 where that still gives every warp a row's share (a decode step has few rows,
// 256 at gpt-oss-120b's B = 64 on one rank; one warp walking a row's 23 groups twice took 17 us
// where the 1 x 128 kernel, which deals single groups, took 10; one H100, 2026-12-07), and never
// fewer than 4, whose shares fit kMaskedHeldGroups (above).
// Warp w of a team takes groups w, w + team, ...; the team's amax meets in shared memory.
template <bool kClamped>
__global__ void __launch_bounds__(kRowsPerBlock * kWarp, kMaskedTokenCtasPerSm)
    silu_mul_quant_masked_token_kernel(const uint16_t* __restrict__ gate_up, int num_experts, int max_m, int inter,
                                       const int32_t* __restrict__ masked_m, uint8_t* __restrict__ out,
                                       float* __restrict__ out_scales, GpuActivation act, unsigned long long* stamp) {
  __shared__ __align__(16) float window[kGateWindow];
  __shared__ unsigned warp_amax[kRowsPerBlock];
  extern __shared__ float4 held_values[];  // as the contiguous kernel's, then row_start [E + 1]
  int* row_start = reinterpret_cast<int*>(held_values + kRowsPerBlock * kMaskedHeldGroups * kWarp);
  load_gate_window(act.gate_table, window);
  begin_kernel(stamp);
  if (threadIdx.x < kWarp) warp_prefix(row_start, num_experts, [&](int e) { return min(max(masked_m[e], 0), max_m); });
  __syncthreads();  // the window and the prefix
  const int groups = inter / kQuantBlock, rows = row_start[num_experts], warp = threadIdx.x / kWarp;
  int team = kMaskedMinTeam;  // CTA-uniform: every warp of a CTA meets the same barriers
  while (team < kRowsPerBlock && int64_t(rows) * team * 2 <= int64_t(gridDim.x) * kRowsPerBlock) team *= 2;
  const int teams = kRowsPerBlock / team, first = warp - warp % team;
  float4* held = held_values + size_t(warp) * kMaskedHeldGroups * kWarp + threadIdx.x % kWarp;
  auto team_amax = [&](unsigned bits) {  // a team has at least kMaskedMinTeam warps
    if (threadIdx.x % kWarp == 0) warp_amax[warp] = bits;
    __syncthreads();
    for (int w = first; w < first + team; ++w) bits = max(bits, warp_amax[w]);
    __syncthreads();  // read before the next row's writes
    return bits;
  };
  for (int base = blockIdx.x * teams; base < rows; base += gridDim.x * teams) {  // CTA-uniform bounds
    const int r = base + warp / team;
    int e = 0, m = 0, g_first = groups;  // past the last row: no groups, the team's barriers only
    if (r < rows) e = segment_of(row_start, num_experts, r), m = r - row_start[e], g_first = warp % team;
    const size_t row = size_t(e) * max_m + m;
    // layout.h: scale (e, m, g) at (e inter/128 + g) M_max + m.
    quant_token_groups<kClamped, kMaskedHeldGroups>(act, window, held, gate_up + row * 2 * inter, inter, g_first, team,
                                 out + row * inter, out_scales + size_t(e) * groups * max_m + m, size_t(max_m),
                                 team_amax);
  }
  end_kernel(stamp);
}

// The activation launches' shared checks: a table, and rows of whole 1x128 groups.
void check_activation_args(const char* what, const GpuActivation& act, int inter) {
  MOEKIT_CHECK(inter > 0 && inter % kQuantBlock == 0,
               fmtr("{}: inter = {}, expected a positive multiple of {}", what, inter, kQuantBlock));
  MOEKIT_CHECK(act.gate_table != nullptr && reinterpret_cast<uintptr_t>(act.gate_table) % 16 == 0,
               fmtr("{}: GpuActivation::gate_table = {}, expected a 16-byte aligned device table (ActivationTable)",
                    what, static_cast<const void*>(act.gate_table)));
}

// ActivationTable's entries: the gate half of every bf16 gate, by the functions the gated GEMM
// epilogue calls (silu_fp8.cuh), so that the two paths give the same bits.
__global__ void fill_gate_table_kernel(GpuActivation act, float* table) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < kBf16Values) table[b] = activation_gate(act, bf16_to_float(uint16_t(b)));
}

}  // namespace

void launch_silu_mul_quant_masked(const uint16_t* gate_up, int num_experts, int max_m, int inter,
                                  const int32_t* masked_m, uint8_t* out, float* out_scales, cudaStream_t stream,
                                  const LaunchOptions& opt, const GpuActivation& act) {
  check_activation_args("silu_mul_quant_masked", act, inter);
  if (num_experts == 0 || max_m == 0) return;
  // The kernel counts rows (every expert's, added up) in 32-bit integers.
  MOEKIT_CHECK(num_experts > 0 && max_m > 0 && int64_t(num_experts) * max_m < (int64_t(1) << 31),
               fmtr("silu_mul_quant_masked: {} experts x M_max = {} rows, expected 1 .. 2^31 - 1 rows", num_experts,
                    max_m));
  // The row prefix's shared memory beside the 16 KB window, within the 48 KB a launch gets unasked.
  MOEKIT_CHECK(num_experts <= kActMaxExperts,
               fmtr("silu_mul_quant_masked: {} experts, expected at most {}", num_experts, kActMaxExperts));
  if (act.token_scales) {  // a team of warps per row; a grid that fits the GPU at once
    auto kernel = act.clamped_swiglu ? silu_mul_quant_masked_token_kernel<true> : silu_mul_quant_masked_token_kernel<false>;
    const size_t smem = kMaskedHeldBytes + sizeof(int) * (num_experts + 1);
    gemm_detail::allow_smem(reinterpret_cast<const void*>(kernel), int(smem));  // checked against the device
    const int ctas = int(std::min<int64_t>(int64_t(kMaskedTokenCtasPerSm) * gemm_detail::num_sms(),
                                           (int64_t(num_experts) * max_m + kRowsPerBlock - 1) / kRowsPerBlock));
    launch_kernel_ex(kernel, dim3(ctas), dim3(kRowsPerBlock * kWarp), smem, stream, opt.pdl, gate_up, num_experts,
                     max_m, inter, masked_m, out, out_scales, act, opt.stamp);
    return;
  }
  const int64_t items = int64_t(num_experts) * max_m * (inter / kQuantBlock);
  const int64_t per_cta = int64_t(kRowsPerBlock) * kActItems;
  const int ctas = int(std::min<int64_t>(int64_t(kActCtasPerSm) * gemm_detail::num_sms(), (items + per_cta - 1) / per_cta));
  launch_kernel_ex(act.clamped_swiglu ? silu_mul_quant_masked_kernel<true> : silu_mul_quant_masked_kernel<false>,
                   dim3(ctas), dim3(kRowsPerBlock * kWarp),
                   sizeof(int) * (num_experts + 1), stream, opt.pdl, gate_up, num_experts, max_m, inter, masked_m, out,
                   out_scales, act, opt.stamp);
}

void launch_silu_mul_quant_contiguous(const uint16_t* gate_up, int total_m, int inter, const int32_t* row_expert,
                                      uint8_t* out, float* out_scales, cudaStream_t stream, const LaunchOptions& opt,
                                      const GpuActivation& act) {
  check_activation_args("silu_mul_quant_contiguous", act, inter);
  MOEKIT_CHECK(total_m >= 0, fmtr("silu_mul_quant_contiguous: total_m = {}, expected >= 0", total_m));
  if (total_m == 0) return;
  const int ctas_per_sm = act.token_scales ? kTokenCtasPerSm : kContiguousCtasPerSm;
  const int blocks = int(std::min<int64_t>(int64_t(ctas_per_sm) * gemm_detail::num_sms(),
                                           (int64_t(total_m) + kRowsPerBlock - 1) / kRowsPerBlock));
  auto kernel = act.token_scales ? (act.clamped_swiglu ? silu_mul_quant_contiguous_token_kernel<true>
                                                        : silu_mul_quant_contiguous_token_kernel<false>)
                                 : (act.clamped_swiglu ? silu_mul_quant_contiguous_kernel<true>
                                                       : silu_mul_quant_contiguous_kernel<false>);
  const size_t smem = act.token_scales ? kTokenHeldBytes : 0;
  if (smem > 0) gemm_detail::allow_smem(reinterpret_cast<const void*>(kernel), int(smem));  // past the 48 KB default
  launch_kernel_ex(kernel, dim3(blocks), dim3(kRowsPerBlock * kWarp), smem, stream, opt.pdl, gate_up, total_m, inter,
                   row_expert, out, out_scales, act, opt.stamp);
}

ActivationTable::ActivationTable(const ref::Activation& act)
    : act_{act.kind == ref::Activation::Kind::kClampedSwiglu, act.alpha, act.limit, nullptr} {
  MOEKIT_CUDA_CHECK(cudaMalloc(&table_, kBf16Values * sizeof(float)));
  try {  // the launch's own status (not an earlier error still pending), then the kernel's
    launch_kernel_ex(fill_gate_table_kernel, dim3(kBf16Values / 256), dim3(256), 0, nullptr, false, act_, table_);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  } catch (...) {
    cudaFree(table_);
    throw;
  }
  act_.gate_table = table_;
}

ActivationTable::~ActivationTable() { cudaFree(table_); }

}  // namespace moekit::gpu
