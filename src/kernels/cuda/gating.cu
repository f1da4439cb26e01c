// The router on the GPU: router GEMM, top-k selection and the replica map (see gating.cuh).
// Every formula is gating.h's (select_experts) or eplb.h's (choose_replicas_for_rank) with the
// same operation order, in fp64 where the reference uses fp64.
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

__device__ void record_fault(LayerStatus* status, LayerFault kind, int token, int entry, float value) {
  if (atomicCAS(&status->kind, 0, int(kind)) == 0) {
    status->token = token;
    status->entry = entry;
    status->value = value;
  }
}

__device__ double warp_sum(double v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The best (value, index) of the warp: larger value first, lower index on ties; every lane gets it.
__device__ void warp_argmax(double& v, int& i) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const double ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
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

// The router GEMM in tiles, for many tokens. The warp kernel above converts an operand to fp64 for
// every product (36 conversions per 32 products and lane, at 16 per SM and clock: a quarter of the
// fp64 FMA rate); here a CTA widens a 64-token x 16-column slice of x and a 64-expert slice of w
// once into shared memory, and each value serves 64 products.
// Thread (ty, tx) owns tokens ty + 16 i and experts tx + 16 j (i, j < 4): a warp reads 2 tokens'
// values (broadcast) and 16 consecutive experts' (one 128-byte wavefront) per column. Each of the
// 16 sums starts at the bias and adds its products in column order, as gating.h's loop does; the
// products are exact, so fma rounds as its add does and the logits are gating.h's bits. Columns
// past x_cols are read as zero and add exact zeros.
// Split K (splits > 1, decode's few tiles): the `splits` CTAs of a cluster take one tile's column
// ranges in turn, CTA s from column tile s k_tiles / splits on, only the first starting at the
// bias; each leaves its 64 x 64 partial sums in its shared memory, and CTA s adds rows s · 64 /
// splits .. of all the partials in cluster order (p0 + p1 + ...), reading its peers' shared
// memory. Deterministic, but no longer gating.h's order: a logit can differ from the reference's
// in the last bit where the fp64 sums round to fp32 differently
// (docs/layer-gpu.md §Numerics: what is the same bits).
constexpr int kTileT = 64, kTileE = 64, kTileK = 16, kTileThreads = 256, kMaxRouterSplits = 8;

__global__ void __launch_bounds__(kTileThreads)
    router_logits_tiled_kernel(const uint16_t* __restrict__ x, int num_tokens, int hidden, int x_cols,
                               const float* __restrict__ w, int num_experts, float* __restrict__ logits,
                               const float* __restrict__ logit_bias, int splits, unsigned long long* stamp) {
  begin_kernel(stamp);
  // The two buffers of x's and w's slices; after the K loop, a split's partial tile [token][expert].
  static_assert(2 * kTileK * (kTileT + kTileE) == kTileT * kTileE, "the partial tile fits the slices' memory");
  __shared__ double tile_smem[2 * kTileK * (kTileT + kTileE)];
  auto xs = reinterpret_cast<double(*)[kTileK][kTileT]>(tile_smem);                    // [buffer][column][token]
  auto ws = reinterpret_cast<double(*)[kTileK][kTileE]>(tile_smem + 2 * kTileK * kTileT);  // [buffer][column][expert]
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int split = splits > 1 ? int(ptx::cluster_ctarank()) : 0;  // the cluster runs along x
  const int t0 = blockIdx.y * kTileT, e0 = blockIdx.x / splits * kTileE;
  // The loader: thread tid brings row tid / 4 (a token of x, an expert of w), columns c .. c + 3.
  const int lrow = tid / 4, lcol = (tid % 4) * 4;
  const bool t_ok = t0 + lrow < num_tokens, e_ok = e0 + lrow < num_experts;
  const uint16_t* xrow = x + size_t(t_ok ? t0 + lrow : 0) * x_cols;
  const float* wrow = w + size_t(e_ok ? e0 + lrow : 0) * hidden;
  uint2 xv = {};
  float4 wv = {};
  auto load = [&](int k0) {
    const bool c_ok = k0 + lcol < x_cols;  // x_cols is a multiple of 4: a group is in or out whole
    xv = t_ok && c_ok ? *reinterpret_cast<const uint2*>(xrow + k0 + lcol) : uint2{};
    wv = e_ok && c_ok ? *reinterpret_cast<const float4*>(wrow + k0 + lcol) : float4{};
  };
  auto store = [&](int buf) {
    xs[buf][lcol + 0][lrow] = double(bf16_to_float(uint16_t(xv.x & 0xffff)));
    xs[buf][lcol + 1][lrow] = double(bf16_to_float(uint16_t(xv.x >> 16)));
    xs[buf][lcol + 2][lrow] = double(bf16_to_float(uint16_t(xv.y & 0xffff)));
    xs[buf][lcol + 3][lrow] = double(bf16_to_float(uint16_t(xv.y >> 16)));
    ws[buf][lcol + 0][lrow] = double(wv.x);
    ws[buf][lcol + 1][lrow] = double(wv.y);
    ws[buf][lcol + 2][lrow] = double(wv.z);
    ws[buf][lcol + 3][lrow] = double(wv.w);
  };
  double acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int e = e0 + tx + 16 * j;
    const double b = split == 0 && logit_bias && e < num_experts ? double(logit_bias[e]) : 0.0;
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i][j] = b;
  }
  const int k_tiles = (x_cols + kTileK - 1) / kTileK;
  const int kt_begin = split * k_tiles / splits, kt_end = (split + 1) * k_tiles / splits;
  load(kt_begin * kTileK);
  store(0);
  __syncthreads();
  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const int buf = (kt - kt_begin) & 1;
    if (kt + 1 < kt_end) load((kt + 1) * kTileK);  // in flight while this slice is multiplied
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      double a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[buf][kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[buf][kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
    // The other buffer was last read in iteration kt - 1, which every thread has left.
    if (kt + 1 < kt_end) store(buf ^ 1);
    __syncthreads();
  }
  if (splits > 1) {
    double* part = tile_smem;  // the slices are read (the loop's last barrier)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) part[(ty + 16 * i) * kTileE + tx + 16 * j] = acc[i][j];
    ptx::cluster_sync();  // every split's partials written
    const int r0 = split * kTileT / splits, r1 = (split + 1) * kTileT / splits;
    for (int idx = tid; idx < (r1 - r0) * kTileE; idx += kTileThreads) {
      const int r = r0 + idx / kTileE, c = idx % kTileE, t = t0 + r, e = e0 + c;
      double sum = ptx::ld_shared_cluster_f64(part + r * kTileE + c, 0);  // split 0's: it holds the bias
      for (int q = 1; q < splits; ++q) sum += ptx::ld_shared_cluster_f64(part + r * kTileE + c, uint32_t(q));
      if (t < num_tokens && e < num_experts) logits[size_t(t) * num_experts + e] = float(sum);
    }
    ptx::cluster_sync();  // no CTA leaves while a peer still reads its partials
    end_kernel(stamp);
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = t0 + ty + 16 * i;
    if (t >= num_tokens) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = e0 + tx + 16 * j;
      if (e < num_experts) logits[size_t(t) * num_experts + e] = float(acc[i][j]);
    }
  }
  end_kernel(stamp);
}

__device__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The physical slot of entry (token t, logical expert e in [0, E)), eplb_detail::pick_replica's
// rule: a replica on the token's own rank first, else splitmix64 of (seed, global token, expert)
// mod the replica count. Counts the entry for EPLB.
__device__ int32_t replica_slot(const ReplicaMap& m, int t, int32_t e) {
  atomicAdd(m.counts + e, 1ull);
  const ReplicaTable& table = m.table;
  const int32_t* replicas = table.log2phy + size_t(e) * table.max_replicas;
  const int n = table.replica_count[e];
  if (n == 1) return replicas[0];
  const uint64_t h =
      splitmix64(splitmix64(m.seed ^ splitmix64(uint64_t(m.first_token + t))) ^ uint64_t(uint32_t(e)));
  int own = 0;
  for (int r = 0; r < n; ++r) own += replicas[r] / table.slots_per_gpu == m.rank;
  if (own == 0) return replicas[h % uint64_t(n)];
  int pick = int(h % uint64_t(own));
  for (int r = 0; r < n; ++r)
    if (replicas[r] / table.slots_per_gpu == m.rank && pick-- == 0) return replicas[r];
  return -1;  // not reached: `own` replicas are on this rank
}

// One token of select_experts (one warp): gating.h's rule; see the kernel below.
__device__ void select_token(const float* __restrict__ logits, int num_tokens, int num_experts, int k,
                             const RouterParams& router, const float* __restrict__ bias, int32_t* __restrict__ topk_idx,
                             float* __restrict__ topk_weights, LayerStatus* status, const ReplicaMap& map) {
  extern __shared__ double smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int t = blockIdx.x * (blockDim.x / kWarp) + warp;
  if (t >= num_tokens) return;
  double* score = smem + size_t(warp) * 2 * num_experts;
  double* sel = score + num_experts;
  const float* lt = logits + size_t(t) * num_experts;

  int bad = -1;
  for (int e = lane; e < num_experts; e += kWarp)
    if (!isfinite(lt[e]) && bad < 0) bad = e;
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const int other = __shfl_xor_sync(0xffffffffu, bad, o);
    if (other >= 0 && (bad < 0 || other < bad)) bad = other;
  }
  if (bad >= 0) {
    if (lane == 0) record_fault(status, LayerFault::kNonFiniteLogit, t, bad, lt[bad]);
    for (int j = lane; j < k; j += kWarp) {
      topk_idx[size_t(t) * k + j] = -1;
      topk_weights[size_t(t) * k + j] = 0.0f;
      if (map.topk_slot) map.topk_slot[size_t(t) * k + j] = -1;
    }
    return;
  }

  if (router.sigmoid) {
    for (int e = lane; e < num_experts; e += kWarp) score[e] = 1.0 / (1.0 + exp(-double(lt[e])));
  } else if (router.topk_softmax) {
    for (int e = lane; e < num_experts; e += kWarp) score[e] = double(lt[e]);  // softmax after the top-k
  } else {
    float m = -INFINITY;
    for (int e = lane; e < num_experts; e += kWarp) m = fmaxf(m, lt[e]);
    for (int o = kWarp / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    for (int e = lane; e < num_experts; e += kWarp) score[e] = exp(double(lt[e]) - double(m));
    __syncwarp();
    // The reference sums in expert order; so does lane 0 (E additions, negligible next to the GEMM).
    double sum = 0.0;
    if (lane == 0)
      for (int e = 0; e < num_experts; ++e) sum += score[e];
    sum = __shfl_sync(0xffffffffu, sum, 0);
    __syncwarp();
    for (int e = lane; e < num_experts; e += kWarp) score[e] /= sum;
  }
  for (int e = lane; e < num_experts; e += kWarp) sel[e] = score[e] + (bias ? double(bias[e]) : 0.0);
  __syncwarp();

  if (router.num_groups > 1) {
    const int group_size = num_experts / router.num_groups;
    // Lane g scores group g: the sum of its two largest sel (its largest when it has one expert).
    double group_score = -INFINITY;
    if (lane < router.num_groups) {
      double b1 = -INFINITY, b2 = -INFINITY;
      for (int i = 0; i < group_size; ++i) {
        const double v = sel[lane * group_size + i];
        if (v > b1) {
          b2 = b1;
          b1 = v;
        } else if (v > b2) {
          b2 = v;
        }
      }
      group_score = group_size >= 2 ? 0.0 + b1 + b2 : 0.0 + b1;
    }
    unsigned kept = 0;
    double v = lane < router.num_groups ? group_score : -INFINITY;
    for (int g = 0; g < router.topk_groups; ++g) {
      double bv = v;
      int bi = lane < router.num_groups ? lane : kWarp;
      warp_argmax(bv, bi);
      kept |= 1u << bi;
      if (lane == bi) v = -INFINITY;  // out of the next rounds
    }
    __syncwarp();
    for (int e = lane; e < num_experts; e += kWarp)
      if (!(kept >> (e / group_size) & 1u)) sel[e] = -INFINITY;
    __syncwarp();
  }

  // k rounds of a warp argmax; the winner's sel becomes -inf (k <= the kept experts, so a masked
  // -inf expert is never chosen).
  double sum = 0.0;
  int chosen = -1;  // lane j keeps entry j (k <= 32)
  for (int j = 0; j < k; ++j) {
    double bv = -INFINITY;
    int bi = num_experts;
    for (int e = lane; e < num_experts; e += kWarp)
      if (sel[e] > bv || (sel[e] == bv && e < bi)) bv = sel[e], bi = e;
    warp_argmax(bv, bi);
    __syncwarp();
    if (lane == 0) sel[bi] = -INFINITY;
    __syncwarp();
    if (lane == j) chosen = bi;
    sum += score[bi];  // the reference's order: entries 0..k-1
  }
  // topk_softmax: score[chosen] becomes exp(logit - the first chosen logit), summed in entry order.
  double chosen_score = lane < k ? score[chosen] : 0.0;
  if (router.topk_softmax) {
    const double shift = __shfl_sync(0xffffffffu, chosen_score, 0);
    chosen_score = exp(chosen_score - shift);
    sum = 0.0;
    for (int j = 0; j < k; ++j) sum += __shfl_sync(0xffffffffu, chosen_score, j);
  }
  if (lane < k) {
    const double norm = router.normalize ? 1.0 / (sum + 1e-20) : 1.0;
    topk_idx[size_t(t) * k + lane] = chosen;
    topk_weights[size_t(t) * k + lane] = float(chosen_score * norm * router.scaling);
    if (map.topk_slot) map.topk_slot[size_t(t) * k + lane] = replica_slot(map, t, chosen);
  }
}

// One warp per token; shared memory holds the token's score and sel [E] in fp64. With `map`
// (map.topk_slot non-null) each chosen entry also gets its physical slot here, so the gate and
// the replica choice are one kernel.
__global__ void select_experts_kernel(const float* __restrict__ logits, int num_tokens, int num_experts, int k,
                                      RouterParams router, const float* __restrict__ bias, int32_t* __restrict__ topk_idx,
                                      float* __restrict__ topk_weights, LayerStatus* status, ReplicaMap map,
                                      unsigned long long* stamp) {
  begin_kernel(stamp);
  select_token(logits, num_tokens, num_experts, k, router, bias, topk_idx, topk_weights, status, map);
  end_kernel(stamp);
}

__global__ void map_replicas_kernel(ReplicaMap map, int num_tokens, int k, const int32_t* __restrict__ routing_idx,
                                    const float* __restrict__ routing_weights, int32_t* __restrict__ topk_idx,
                                    float* __restrict__ topk_weights, LayerStatus* status, unsigned long long* stamp) {
  begin_kernel(stamp);
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < num_tokens * k) {
    const int t = i / k, j = i % k;
    int32_t e = routing_idx ? routing_idx[i] : topk_idx[i];
    if (routing_idx) topk_weights[i] = routing_weights[i];
    if (e < -1 || e >= map.table.num_experts) {
      record_fault(status, LayerFault::kBadExpert, t, j, float(e));
      e = -1;
    }
    topk_idx[i] = e;
    map.topk_slot[i] = e == -1 ? -1 : replica_slot(map, t, e);
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
  // SM cycles of each, from the rate that bounds it: the warp kernel widens 36 values to fp64 per
  // 32 products (Hopper: 16 per SM and clock), spread over every SM; the tiles make 64 fp64 FMAs
  // per SM and clock, one CTA of 64 x 64 products per column at a time per SM, in rounds of SMs.
  // Ties go to fewer splits (one split is gating.h's bits).
  const double products = double(num_tokens) * num_experts * hidden;
  const double warps = products * 36.0 / 32.0 / (16.0 * num_sms);
  const long tiles = long((num_tokens + kTileT - 1) / kTileT) * ((num_experts + kTileE - 1) / kTileE);
  const int k_tiles = (hidden + kTileK - 1) / kTileK;
  RouterConfig best{RouterKernel::kWarps, 1};
  double best_cycles = warps;
  for (int s = 1; s <= kMaxRouterSplits && s <= k_tiles; s *= 2) {
    const double rounds = double((tiles * s + num_sms - 1) / num_sms);
    const double cycles = rounds * double(kTileT) * kTileE * (double(hidden) / s) / 64.0;
    if (cycles < best_cycles) best = {RouterKernel::kTiles, s}, best_cycles = cycles;
  }
  return best;
}

namespace {

// MOEKIT_ROUTER: warps, tiles (the heuristic's splits for tiles, else 1) or tiles:S.
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

void launch_select_experts(const float* logits, int num_tokens, int num_experts, int k, const RouterParams& router,
                           const float* bias, int32_t* topk_idx, float* topk_weights, LayerStatus* status,
                           cudaStream_t stream, const ReplicaMap* map, const LaunchOptions& opt) {
  if (num_tokens == 0) return;
  const int warps = std::max(1, std::min(8, 48 * 1024 / (16 * num_experts)));
  const size_t smem = size_t(warps) * 16 * num_experts;
  launch_kernel_ex(select_experts_kernel, dim3((num_tokens + warps - 1) / warps), dim3(warps * kWarp), smem, stream,
                   opt.pdl, logits, num_tokens, num_experts, k, router, bias, topk_idx, topk_weights, status,
                   map ? *map : ReplicaMap{}, opt.stamp);
}

void launch_map_replicas(const ReplicaMap& map, int num_tokens, int k, const int32_t* routing_idx,
                         const float* routing_weights, int32_t* topk_idx, float* topk_weights, LayerStatus* status,
                         cudaStream_t stream, const LaunchOptions& opt) {
  const int n = num_tokens * k;
  if (n == 0) return;
  launch_kernel_ex(map_replicas_kernel, dim3((n + 255) / 256), dim3(256), 0, stream, opt.pdl, map, num_tokens, k,
                   routing_idx, routing_weights, topk_idx, topk_weights, status, opt.stamp);
}

}  // namespace moekit::gpu
