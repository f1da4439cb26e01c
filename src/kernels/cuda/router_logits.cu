// The router GEMM on the GPU: logits = x . w^T (+ bias) in fp64, rounded once to fp32 (see
// gating.cuh). The top-k selection and the replica map are gating.cu's.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "kernels/cuda/gating.cuh"
#include "kernels/cuda/gemm_host.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ptx.cuh"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"

namespace moekit::gpu {
namespace {

constexpr int kWarp = 32;
constexpr int kLogitTokens = 8;   // tokens per block of the router GEMM: each weight row is read once per 8 tokens
constexpr int kLogitWarps = 8;    // experts per block (one warp each)

__device__ double warp_sum(double v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void router_logits_kernel(const uint16_t* __restrict__ x, int num_tokens, int hidden, int x_cols,
                                     const float* __restrict__ w, int num_experts, float* __restrict__ logits,
                                     const float* __restrict__ logit_bias, unsigned long long* stamp) {
  begin_kernel(stamp);
  const int lane = threadIdx.x % kWarp;
  const int e = blockIdx.x * kLogitWarps + threadIdx.x / kWarp;
  const int t0 = blockIdx.y * kLogitTokens;
  if (e >= num_experts) return;
  const int nt = min(kLogitTokens, num_tokens - t0);
  double acc[kLogitTokens] = {};
  const float* we = w + size_t(e) * hidden;
  // Columns past x_cols are zero in x: their products add nothing to the fp64 sums.
  for (int i = lane * 4; i < x_cols; i += kWarp * 4) {
    const float4 wv = *reinterpret_cast<const float4*>(we + i);
#pragma unroll
    for (int tt = 0; tt < kLogitTokens; ++tt) {
      if (tt >= nt) break;
      const uint2 xv = *reinterpret_cast<const uint2*>(x + size_t(t0 + tt) * x_cols + i);
      // bf16 x fp32 is exact in fp64 (8 + 24 significant bits), so fma == the reference's mul + add.
      acc[tt] += double(bf16_to_float(uint16_t(xv.x & 0xffff))) * double(wv.x);
      acc[tt] += double(bf16_to_float(uint16_t(xv.x >> 16))) * double(wv.y);
      acc[tt] += double(bf16_to_float(uint16_t(xv.y & 0xffff))) * double(wv.z);
      acc[tt] += double(bf16_to_float(uint16_t(xv.y >> 16))) * double(wv.w);
    }
  }
#pragma unroll
  for (int tt = 0; tt < kLogitTokens; ++tt) {
    if (tt >= nt) break;
    const double s = warp_sum(acc[tt]) + (logit_bias ? double(logit_bias[e]) : 0.0);
    if (lane == 0) logits[size_t(t0 + tt) * num_experts + e] = float(s);
  }
  end_kernel(stamp);
}

// The router GEMM in tiles on the fp64 tensor cores, for many tokens. The warp kernel above converts
// an operand to fp64 for every product (36 conversions per 32 products and lane, at 16 per SM and
// clock); here a CTA widens a 64-token x 16-column slice of x and a 64-expert slice of w once into
// shared memory, and each value serves 64 products, made by DMMAs (mma.m16n8k4.f64, Hopper's own
// shape: the Ampere-era m8n8k4 compiles to a DMMA.8x8x4 and measured 1.3x slower at 1024 tokens).
// Hopper's fp64 tensor rate is twice its FMA pipe's, and a fragment load feeds a DMMA of 512
// products where an fp64 FMA kernel's feeds 2: that kernel (64 x 64 tiles, 256 threads of 4 x 4
// fmas) spent half its loop on shared loads and ran at 19% of the fp64 peak, 1.7-2.5x this one's
// time (docs/layer-gpu.md).
// 4 warps, each 32 tokens x 32 experts of the tile: 2 x 4 DMMAs per 4 columns, from 2 A fragments
// (16 tokens each) and 4 B fragments (8 experts each). The slices are stored [column][row] with
// rows padded to kSliceStride = 68 values: lane l loads column l % 4, row l / 4, at
// (4 (l % 4) + l / 4) mod 16 of the 16 8-byte bank pairs, each pair at most twice: two wavefronts,
// the least 256 bytes take (unpadded, a fragment would take four).
// Each logit starts at its bias and takes its columns 4 at a time in order. The products are
// exact in fp64; how a DMMA rounds the sum of its 4 products and the accumulator is not documented
// as four fmas in order, so the logits are gating.h's bits when the two fp64 sums round to the
// same fp32, which they did on every logit the test compares (one split, 4 shapes).
// Split K (splits > 1, decode's few tiles): the `splits` CTAs of a cluster take one tile's column
// ranges in turn, CTA s from column tile s k_tiles / splits on, only the first starting at the
// bias; each leaves its 64 x 64 partial sums in its shared memory, and CTA s adds rows s · 64 /
// splits .. of all the partials in cluster order (p0 + p1 + ...), reading its peers' shared
// memory. Deterministic, but no longer gating.h's order either
// (docs/layer-gpu.md §Numerics: what is the same bits).
constexpr int kTileT = 64, kTileE = 64, kTileK = 16, kTileThreads = 128, kMaxRouterSplits = 8;
constexpr int kSliceStride = kTileT + 4;
static_assert(kTileT == kTileE, "one padded stride for both operands' slices");

// Split K's end: every CTA of the cluster has left its [kTileT][kTileE] partial sums in `part`
// (its shared memory); CTA `split` adds rows split · kTileT / splits .. of all of them in cluster
// order (p0 + p1 + ..., p0 holding the bias) and writes those logits.
__device__ void add_split_partials(const double* part, int splits, int split, int t0, int e0, int num_tokens,
                                   int num_experts, float* __restrict__ logits) {
  ptx::cluster_sync();  // every split's partials written
  const int r0 = split * kTileT / splits, r1 = (split + 1) * kTileT / splits;
  for (int idx = threadIdx.x; idx < (r1 - r0) * kTileE; idx += blockDim.x) {
    const int r = r0 + idx / kTileE, c = idx % kTileE, t = t0 + r, e = e0 + c;
    double sum = ptx::ld_shared_cluster_f64(part + r * kTileE + c, 0);
    for (int q = 1; q < splits; ++q) sum += ptx::ld_shared_cluster_f64(part + r * kTileE + c, uint32_t(q));
    if (t < num_tokens && e < num_experts) logits[size_t(t) * num_experts + e] = float(sum);
  }
  ptx::cluster_sync();  // no CTA leaves while a peer still reads its partials
}

// d[16 x 8] += a[16 x 4] b[4 x 8]; lane l (g = l / 4, q = l % 4) holds a (row g, column q) and (row
// g + 8, column q), b (column q, row g), and d (row g, columns 2q, 2q + 1) and (row g + 8, the same).
__device__ __forceinline__ void dmma_16x8x4(double (&d)[4], const double (&a)[2], double b) {
  asm("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(b));
}

__global__ void __launch_bounds__(kTileThreads)
    router_logits_tiled_kernel(const uint16_t* __restrict__ x, int num_tokens, int hidden, int x_cols,
                               const float* __restrict__ w, int num_experts, float* __restrict__ logits,
                               const float* __restrict__ logit_bias, int splits, unsigned long long* stamp) {
  begin_kernel(stamp);
  constexpr int kSlice = kTileK * kSliceStride;  // one operand's slice: [column][row (padded)]
  static_assert(4 * kSlice >= kTileT * kTileE, "the partial tile fits the slices' memory");
  __shared__ double tile_smem[4 * kSlice];  // [buffer][x, w] slices; after the K loop, the partials
  auto slice = [&](int buf, int op) { return tile_smem + (2 * buf + op) * kSlice; };
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp, g = lane / 4, q = lane % 4;
  const int split = splits > 1 ? int(ptx::cluster_ctarank()) : 0;  // the cluster runs along x
  const int t0 = blockIdx.y * kTileT, e0 = blockIdx.x / splits * kTileE;
  const int wt = warp % 2 * 32, we = warp / 2 * 32;  // the warp's tokens and experts in the tile
  // The loader: thread tid brings row tid % 64 (a token of x, an expert of w), columns c .. c + 7 of
  // the slice, c = tid / 64 · 8: a warp's stores of one column are 32 consecutive rows.
  const int lrow = tid % kTileT, lcol = tid / kTileT * 8;
  const bool t_ok = t0 + lrow < num_tokens, e_ok = e0 + lrow < num_experts;
  const uint16_t* xrow = x + size_t(t_ok ? t0 + lrow : 0) * x_cols;
  const float* wrow = w + size_t(e_ok ? e0 + lrow : 0) * hidden;
  uint2 xv[2] = {};
  float4 wv[2] = {};
  auto load = [&](int k0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // x_cols is a multiple of 4: a group of 4 is in or out whole
      const int c = k0 + lcol + 4 * h;
      xv[h] = t_ok && c < x_cols ? *reinterpret_cast<const uint2*>(xrow + c) : uint2{};
      wv[h] = e_ok && c < x_cols ? *reinterpret_cast<const float4*>(wrow + c) : float4{};
    }
  };
  auto store = [&](int buf) {
    double* xs = slice(buf, 0) + lcol * kSliceStride + lrow;
    double* ws = slice(buf, 1) + lcol * kSliceStride + lrow;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      xs[(4 * h + 0) * kSliceStride] = double(bf16_to_float(uint16_t(xv[h].x & 0xffff)));
      xs[(4 * h + 1) * kSliceStride] = double(bf16_to_float(uint16_t(xv[h].x >> 16)));
      xs[(4 * h + 2) * kSliceStride] = double(bf16_to_float(uint16_t(xv[h].y & 0xffff)));
      xs[(4 * h + 3) * kSliceStride] = double(bf16_to_float(uint16_t(xv[h].y >> 16)));
      ws[(4 * h + 0) * kSliceStride] = double(wv[h].x);
      ws[(4 * h + 1) * kSliceStride] = double(wv[h].y);
      ws[(4 * h + 2) * kSliceStride] = double(wv[h].z);
      ws[(4 * h + 3) * kSliceStride] = double(wv[h].w);
    }
  };
  // acc[i][j][r]: token tile_t(i, r), expert tile_e(j, r) of the tile (the DMMA's d layout).
  auto tile_t = [&](int i, int r) { return wt + 16 * i + g + 8 * (r / 2); };
  auto tile_e = [&](int j, int r) { return we + 8 * j + 2 * q + r % 2; };
  double acc[2][4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int e = e0 + tile_e(j, r);
      const double b = split == 0 && logit_bias && e < num_experts ? double(logit_bias[e]) : 0.0;
#pragma unroll
      for (int i = 0; i < 2; ++i) acc[i][j][r] = b;
    }
  const int k_tiles = (x_cols + kTileK - 1) / kTileK;
  const int kt_begin = split * k_tiles / splits, kt_end = (split + 1) * k_tiles / splits;
  load(kt_begin * kTileK);
  store(0);
  __syncthreads();
  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const int buf = (kt - kt_begin) & 1;
    if (kt + 1 < kt_end) load((kt + 1) * kTileK);  // in flight while this slice is multiplied
    const double* xs = slice(buf, 0) + q * kSliceStride + wt + g;
    const double* ws = slice(buf, 1) + q * kSliceStride + we + g;
#pragma unroll
    for (int k4 = 0; k4 < kTileK; k4 += 4) {
      double a[2][2], b[4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) a[i][h] = xs[k4 * kSliceStride + 16 * i + 8 * h];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[k4 * kSliceStride + 8 * j];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) dmma_16x8x4(acc[i][j], a[i], b[j]);
    }
    if (kt + 1 < kt_end) store(buf ^ 1);  // the other buffer was last read in iteration kt - 1
    __syncthreads();
  }
  if (splits > 1) {
    double* part = tile_smem;  // the slices are read (the loop's last barrier)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) part[tile_t(i, r) * kTileE + tile_e(j, r)] = acc[i][j][r];
    add_split_partials(part, splits, split, t0, e0, num_tokens, num_experts, logits);
    end_kernel(stamp);
    return;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int t = t0 + tile_t(i, r), e = e0 + tile_e(j, r);
        if (t < num_tokens && e < num_experts) logits[size_t(t) * num_experts + e] = float(acc[i][j][r]);
      }
  end_kernel(stamp);
}

}  // namespace

std::string RouterConfig::to_string() const {
  return kernel == RouterKernel::kWarps   ? std::string("warps")
         : kernel == RouterKernel::kTiles ? "tiles:" + std::to_string(splits)
                                          : std::string("auto");
}

RouterConfig choose_router_config(int num_tokens, int num_experts, int hidden, int num_sms) {
  // SM cycles of each, from their times on one H100 under ncu (docs/layer-gpu.md, 2026-12-07).
  // Both are latency-bound at decode sizes. The warp kernel's blocks (8 experts x 8 tokens) take
  // ~530 + 760 n cycles per 128-column pass for n tokens (14.7 us at 1 token, 69-73 us at 8-96 for
  // gpt-oss-120b), and past a wave of blocks ~2.7x what its fp64 widenings give (36 per 32
  // products and lane, 16 per SM and clock). A tile's CTA spends ~2300 cycles per 16-column slice
  // (the DMMA pipe is 28-50% busy), and a split's CTAs run at once while two fit every SM. Ties go
  // to fewer splits (one split is gating.h's order).
  constexpr double kWarpPassCycles = 530.0, kWarpTokenPassCycles = 760.0, kWarpRateFactor = 2.7;
  constexpr double kTileSliceCycles = 2300.0;
  const double products = double(num_tokens) * num_experts * hidden;
  const double passes = std::ceil(hidden / double(kWarp * 4));
  const double warps = std::max(passes * (kWarpPassCycles + kWarpTokenPassCycles * std::min(num_tokens, kLogitTokens)),
                                kWarpRateFactor * products * 36.0 / 32.0 / (16.0 * num_sms));
  const long tiles = long((num_tokens + kTileT - 1) / kTileT) * ((num_experts + kTileE - 1) / kTileE);
  const int k_tiles = (hidden + kTileK - 1) / kTileK;
  RouterConfig best{RouterKernel::kWarps, 1};
  double best_cycles = warps;
  for (int s = 1; s <= kMaxRouterSplits && s <= k_tiles; s *= 2) {
    const double rounds = double((tiles * s + 2 * num_sms - 1) / (2 * num_sms));
    const double cycles = rounds * std::ceil(double(k_tiles) / s) * kTileSliceCycles;
    if (cycles < best_cycles) best = {RouterKernel::kTiles, s}, best_cycles = cycles;
  }
  return best;
}

namespace {

// MOEKIT_ROUTER: warps, tiles (the heuristic's splits where it takes tiles, else 1) or tiles:S.
RouterConfig router_config_override() {
  static const RouterConfig c = [] {
    const char* env = std::getenv("MOEKIT_ROUTER");
    if (!env || !*env) return RouterConfig{};
    const std::string v(env);
    if (v == "warps") return RouterConfig{RouterKernel::kWarps, 1};
    if (v == "tiles") return RouterConfig{RouterKernel::kTiles, 0};
    int s = 0;
    if (v.rfind("tiles:", 0) == 0) s = std::atoi(v.c_str() + 6);
    MOEKIT_CHECK(s == 1 || s == 2 || s == 4 || s == 8,
                 "MOEKIT_ROUTER = '" + v + "', expected 'warps', 'tiles' or 'tiles:S' with S in {1, 2, 4, 8}");
    return RouterConfig{RouterKernel::kTiles, s};
  }();
  return c;
}

}  // namespace

void launch_router_logits(const uint16_t* x, int num_tokens, int hidden, const float* router_weight, int num_experts,
                          float* logits, cudaStream_t stream, const LaunchOptions& opt, const float* logit_bias,
                          int x_cols, RouterConfig config) {
  if (num_tokens == 0) return;
  if (x_cols <= 0) x_cols = hidden;
  // Both kernels load 4 columns at once (x as uint2, w as float4) from rows that start aligned.
  MOEKIT_CHECK(hidden % 4 == 0 && x_cols % 4 == 0 && x_cols <= hidden,
               "launch_router_logits: hidden = " + std::to_string(hidden) + ", x_cols = " + std::to_string(x_cols) +
                   "; expected multiples of 4 with x_cols <= hidden");
  if (config.kernel == RouterKernel::kAuto) config = router_config_override();
  const RouterConfig chosen = choose_router_config(num_tokens, num_experts, x_cols, gemm_detail::num_sms());
  if (config.kernel == RouterKernel::kAuto) config = chosen;
  if (config.kernel == RouterKernel::kTiles && config.splits == 0)  // "tiles": the heuristic's splits where it takes tiles
    config.splits = chosen.kernel == RouterKernel::kTiles ? chosen.splits : 1;
  if (config.kernel == RouterKernel::kTiles) {
    const int k_tiles = (x_cols + kTileK - 1) / kTileK;
    MOEKIT_CHECK(config.splits >= 1 && config.splits <= kMaxRouterSplits && config.splits <= k_tiles,
                 "launch_router_logits: " + config.to_string() + ", expected 1.." +
                     std::to_string(std::min(kMaxRouterSplits, k_tiles)) + " splits for " + std::to_string(x_cols) +
                     " columns");
    const dim3 grid(unsigned((num_experts + kTileE - 1) / kTileE * config.splits),
                    unsigned((num_tokens + kTileT - 1) / kTileT));
    launch_kernel_ex(router_logits_tiled_kernel, grid, dim3(kTileThreads), 0, stream, LaunchShape(opt.pdl, config.splits),
                     x, num_tokens, hidden, x_cols, router_weight, num_experts, logits, logit_bias, config.splits,
                     opt.stamp);
    return;
  }
  const dim3 grid((num_experts + kLogitWarps - 1) / kLogitWarps, (num_tokens + kLogitTokens - 1) / kLogitTokens);
  launch_kernel_ex(router_logits_kernel, grid, dim3(kLogitWarps * kWarp), 0, stream, opt.pdl, x, num_tokens, hidden,
                   x_cols, router_weight, num_experts, logits, logit_bias, opt.stamp);
}

}  // namespace moekit::gpu
