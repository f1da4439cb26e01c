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
// clock); here a CTA multiplies a 64-token x 64-expert tile on DMMAs (mma.m16n8k4.f64, Hopper's own
// shape: the Ampere-era m8n8k4 compiles to a DMMA.8x8x4 and measured 1.3x slower at 1024 tokens),
// and each value a warp widens feeds 32 products (an A value 8 in each of its 4 DMMAs, a B value 16
// in each of its 2). Hopper's fp64 tensor rate is twice its FMA pipe's: an fp64 FMA tile kernel
// spent half its loop on shared loads and ran at 19% of the fp64 peak (docs/layer-gpu.md).
// The columns come in stages of 32 through a ring of kStages buffers filled by cp.async, x as
// bf16 and w as fp32 the way they lie in memory, so that kStages - 1 stages are in flight while one
// is multiplied: a ring of one slice converted to fp64 by the loader before its barrier measured
// ~2300 SM cycles a 16-column slice, latency-bound (the DMMA pipe 28-50% busy). The values become
// fp64 as a warp loads its fragments. The router's weights are not the previous kernel's output,
// so their first stages are asked for before the grid-dependency wait.
// 4 warps, each 32 tokens x 32 experts of the tile: 2 x 4 DMMAs per 4 columns, from 2 A fragments
// (16 tokens each) and 4 B fragments (8 experts each). Rows are padded (w to 36 floats, x to 40
// bf16), so lane l = 4 g + q reads bank 4 g + q of w's row g, and words 20 g + q / 2 of x's: every
// fragment load is one wavefront. A warp skips the DMMAs of its 16-token halves that hold no token
// (decode fills one or two of a tile's four).
// Each logit starts at its bias and takes its columns 4 at a time in order. The products are
// exact in fp64; how a DMMA rounds the sum of its 4 products and the accumulator is not documented
// as four fmas in order, so the logits are gating.h's bits when the two fp64 sums round to the
// same fp32, which they did on every logit the test compares (one split, 5 shapes).
// Split K (splits > 1, decode's few tiles): the `splits` CTAs of a cluster take one tile's stages
// in turn, CTA s from stage s k_stages / splits on, only the first starting at the bias; each
// leaves its 64 x 64 partial sums in its shared memory, and CTA s adds rows s · 64 / splits .. of
// all the partials in cluster order (p0 + p1 + ...), reading its peers' shared memory. Deterministic,
// but no longer gating.h's order either
// (docs/layer-gpu.md §Numerics: what is the same bits).
constexpr int kTileT = 64, kTileE = 64, kTileThreads = 128;
constexpr int kMaxRouterSplits = 16, kPortableClusterSize = 8;  // Hopper takes 16 as a non-portable size
constexpr int kStageK = 32, kStages = 4;
constexpr int kWStride = kStageK + 4, kXStride = kStageK + 8;  // a stage row's floats of w, bf16 of x
constexpr int kStageWBytes = kTileE * kWStride * 4, kStageXBytes = kTileT * kXStride * 2;
constexpr int kStageBytes = kStageWBytes + kStageXBytes;
constexpr int kTileSmemBytes = kStages * kStageBytes;
static_assert(kTileSmemBytes >= kTileT * kTileE * 8, "the partial tile fits the ring's memory");
static_assert(kStageWBytes % 16 == 0 && kWStride * 4 % 16 == 0 && kXStride * 2 % 8 == 0, "cp.async alignment");

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
  extern __shared__ __align__(16) uint8_t tile_smem[];  // the ring; after the K loop, the partials
  auto stage_w = [&](int buf) { return reinterpret_cast<float*>(tile_smem + buf * kStageBytes); };
  auto stage_x = [&](int buf) { return reinterpret_cast<uint16_t*>(tile_smem + buf * kStageBytes + kStageWBytes); };
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp, g = lane / 4, q = lane % 4;
  const int split = splits > 1 ? int(ptx::cluster_ctarank()) : 0;  // the cluster runs along x
  const int t0 = blockIdx.y * kTileT, e0 = blockIdx.x / splits * kTileE;
  const int wt = warp % 2 * 32, we = warp / 2 * 32;  // the warp's tokens and experts in the tile
  const int k_stages = (x_cols + kStageK - 1) / kStageK;
  const int ks_begin = split * k_stages / splits, n = (split + 1) * k_stages / splits - ks_begin;
  // A stage's loads: 64 rows x 8 chunks (16 B of w, 8 B of x), chunk i = tid + 128 h of row i / 8:
  // a warp's 32 chunks are 4 whole rows. Columns past x_cols (a group of 4 is in or out whole) and
  // rows past the tile's tokens or experts are filled with zeros without a read.
  auto load_w = [&](int ks, int buf) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const int i = tid + kTileThreads * h, r = i / 8, c = ks * kStageK + i % 8 * 4;
      const bool ok = e0 + r < num_experts && c < x_cols;
      ptx::cp_async_16(stage_w(buf) + r * kWStride + i % 8 * 4, ok ? w + size_t(e0 + r) * hidden + c : w, ok ? 16 : 0);
    }
  };
  auto load_x = [&](int ks, int buf) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const int i = tid + kTileThreads * h, r = i / 8, c = ks * kStageK + i % 8 * 4;
      const bool ok = t0 + r < num_tokens && c < x_cols;
      ptx::cp_async_8(stage_x(buf) + r * kXStride + i % 8 * 4, ok ? x + size_t(t0 + r) * x_cols + c : x, ok ? 8 : 0);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < n) load_w(ks_begin + s, s);
  begin_kernel(stamp);  // x is the previous kernel's output
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) load_x(ks_begin + s, s);
    ptx::cp_async_commit();  // group s: stage s's x (group 0 also holds every early w)
  }
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
  const bool live[2] = {t0 + wt < num_tokens, t0 + wt + 16 < num_tokens};  // warp-uniform
  for (int i = 0; i < n; ++i) {
    ptx::cp_async_wait<kStages - 2>();  // this thread's copies of stage i have landed
    __syncthreads();                    // everyone's; and stage i - 1's buffer is read by all
    if (i + kStages - 1 < n) {
      load_w(ks_begin + i + kStages - 1, (i + kStages - 1) % kStages);
      load_x(ks_begin + i + kStages - 1, (i + kStages - 1) % kStages);
    }
    ptx::cp_async_commit();  // one group per iteration, empty at the end, so the wait's count holds
    if (!live[0]) continue;
    const uint16_t* xs = stage_x(i % kStages) + (wt + g) * kXStride + q;
    const float* ws = stage_w(i % kStages) + (we + g) * kWStride + q;
#pragma unroll
    for (int k4 = 0; k4 < kStageK; k4 += 4) {
      double a[2][2], b[4];
#pragma unroll
      for (int ii = 0; ii < 2; ++ii)
#pragma unroll
        for (int h = 0; h < 2; ++h) a[ii][h] = double(bf16_to_float(xs[(16 * ii + 8 * h) * kXStride + k4]));
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = double(ws[8 * j * kWStride + k4]);
#pragma unroll
      for (int j = 0; j < 4; ++j) dmma_16x8x4(acc[0][j], a[0], b[j]);
      if (live[1])
#pragma unroll
        for (int j = 0; j < 4; ++j) dmma_16x8x4(acc[1][j], a[1], b[j]);
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // the ring is read and no copy is in flight: its memory takes the partials
  if (splits > 1) {
    double* part = reinterpret_cast<double*>(tile_smem);
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
  // SM cycles of each (µs at 1.755 GHz), from their times on one H100 (docs/layer-gpu.md,
  // 2026-12-07). The warp kernel's blocks (8 experts x 8 tokens) take ~530 + 760 n cycles per
  // 128-column pass for n tokens (14.7 us at 1 token, 69-73 us at 8-96 for gpt-oss-120b, under
  // ncu), and past a wave of blocks ~2.7x what its fp64 widenings give (36 per 32 products and
  // lane, 16 per SM and clock). The tiles, fitted to bench_router's 105 times (3 router shapes,
  // 1-8192 tokens, 1-16 splits): ~8 us fixed, then per round of CTAs (two an SM) ~3 us and, per
  // 32-column stage, the larger of the ring's latency (~0.9 us a stage, whatever the CTA count)
  // and the DMMAs (~0.7 us a stage of 64 live tokens for each CTA on the SM). Ties go to fewer
  // splits (one split is gating.h's order).
  constexpr double kWarpPassCycles = 530.0, kWarpTokenPassCycles = 760.0, kWarpRateFactor = 2.7;
  constexpr double kTileFixedCycles = 14000.0, kTileRoundCycles = 5270.0;
  constexpr double kStageLatencyCycles = 1580.0, kStageDmmaCycles = 1230.0;
  constexpr int kTileCtasPerSm = 2;
  const double products = double(num_tokens) * num_experts * hidden;
  const double passes = std::ceil(hidden / double(kWarp * 4));
  const double warps = std::max(passes * (kWarpPassCycles + kWarpTokenPassCycles * std::min(num_tokens, kLogitTokens)),
                                kWarpRateFactor * products * 36.0 / 32.0 / (16.0 * num_sms));
  const int token_tiles = (num_tokens + kTileT - 1) / kTileT;
  const long tiles = long(token_tiles) * ((num_experts + kTileE - 1) / kTileE);
  // The share of the tiles' 16-token quarters that hold a token (a warp skips the empty ones):
  // only the last token tile has empty ones.
  const int last_quarters = ((num_tokens - (token_tiles - 1) * kTileT) + 15) / 16;
  const double live = (4.0 * (token_tiles - 1) + last_quarters) / (4.0 * token_tiles);
  const int k_stages = (hidden + kStageK - 1) / kStageK;
  RouterConfig best{RouterKernel::kWarps, 1};
  double best_cycles = warps;
  for (int s = 1; s <= kMaxRouterSplits && s <= k_stages; s *= 2) {
    const long ctas = tiles * s;
    const long per_round = long(kTileCtasPerSm) * num_sms;
    const double rounds = double((ctas + per_round - 1) / per_round);
    const double on_sm = double(std::min<long>(kTileCtasPerSm, (ctas + num_sms - 1) / num_sms));
    const double stage = std::max(kStageLatencyCycles, on_sm * kStageDmmaCycles * live);
    const double cycles = kTileFixedCycles + rounds * (kTileRoundCycles + std::ceil(double(k_stages) / s) * stage);
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
    MOEKIT_CHECK(s == 1 || s == 2 || s == 4 || s == 8 || s == 16,
                 "MOEKIT_ROUTER = '" + v + "', expected 'warps', 'tiles' or 'tiles:S' with S in {1, 2, 4, 8, 16}");
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
  // Both kernels load 4 columns at once (x 8 bytes, w 16) from rows that start aligned.
  MOEKIT_CHECK(hidden % 4 == 0 && x_cols % 4 == 0 && x_cols <= hidden,
               "launch_router_logits: hidden = " + std::to_string(hidden) + ", x_cols = " + std::to_string(x_cols) +
                   "; expected multiples of 4 with x_cols <= hidden");
  if (config.kernel == RouterKernel::kAuto) config = router_config_override();
  const RouterConfig chosen = choose_router_config(num_tokens, num_experts, x_cols, gemm_detail::num_sms());
  if (config.kernel == RouterKernel::kAuto) config = chosen;
  if (config.kernel == RouterKernel::kTiles && config.splits == 0)  // "tiles": the heuristic's splits where it takes tiles
    config.splits = chosen.kernel == RouterKernel::kTiles ? chosen.splits : 1;
  if (config.kernel == RouterKernel::kTiles) {
    const int k_stages = (x_cols + kStageK - 1) / kStageK;  // a split takes whole stages
    MOEKIT_CHECK(config.splits >= 1 && config.splits <= kMaxRouterSplits && config.splits <= k_stages,
                 "launch_router_logits: " + config.to_string() + ", expected 1.." +
                     std::to_string(std::min(kMaxRouterSplits, k_stages)) + " splits for " + std::to_string(x_cols) +
                     " columns");
    gemm_detail::allow_smem(reinterpret_cast<const void*>(router_logits_tiled_kernel), kTileSmemBytes);
    if (config.splits > kPortableClusterSize)
      MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(router_logits_tiled_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    const dim3 grid(unsigned((num_experts + kTileE - 1) / kTileE * config.splits),
                    unsigned((num_tokens + kTileT - 1) / kTileT));
    launch_kernel_ex(router_logits_tiled_kernel, grid, dim3(kTileThreads), kTileSmemBytes, stream,
                     LaunchShape(opt.pdl, config.splits),
                     x, num_tokens, hidden, x_cols, router_weight, num_experts, logits, logit_bias, config.splits,
                     opt.stamp);
    return;
  }
  const dim3 grid((num_experts + kLogitWarps - 1) / kLogitWarps, (num_tokens + kLogitTokens - 1) / kLogitTokens);
  launch_kernel_ex(router_logits_kernel, grid, dim3(kLogitWarps * kWarp), 0, stream, opt.pdl, x, num_tokens, hidden,
                   x_cols, router_weight, num_experts, logits, logit_bias, opt.stamp);
}

}  // namespace moekit::gpu
