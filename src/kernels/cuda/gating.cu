// The router's top-k selection and the replica map on the GPU (see gating.cuh); the router GEMM
// is router_logits.cu's. Every formula is gating.h's (select_experts) or eplb.h's
// (choose_replicas_for_rank) with the same operation order, in fp64 where the reference uses fp64.
#include <algorithm>
#include <cmath>

#include "kernels/cuda/gating.cuh"
#include "kernels/cuda/launch.cuh"

namespace moekit::gpu {
namespace {

constexpr int kWarp = 32;

__device__ void record_fault(LayerStatus* status, LayerFault kind, int token, int entry, float value) {
  if (atomicCAS(&status->kind, 0, int(kind)) == 0) {
    status->token = token;
    status->entry = entry;
    status->value = value;
  }
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