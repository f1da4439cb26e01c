// Internal to src/ep/cuda: how dispatch_send.cu's CTAs learn, before they plan their own tokens,
// the rows per slot and the messages per rank of all the tokens before their range. The plan puts
// token t's rows and messages after those of tokens < t (layout.h's canonical order), so these
// counts are each CTA's starting positions, and the last CTA's final counts are the batch's totals.
// Two ways, the same counts (count_tokens' validity rule): counting the earlier tokens directly
// (decode sizes), or a look-back over the counts the CTAs publish of their own tokens
// (EpArgs::cta_counts and cta_flags; prefill sizes). Every thread of the CTA calls them.
#pragma once

#include <cstdint>

#include "ep_device.cuh"
#include "kernels/cuda/ptx.cuh"

namespace moekit::gpu {

// Counts, over tokens [t0, t1), rows per slot and messages per rank. Each warp takes 32 / k tokens
// at a time (one entry per lane), kCountRounds rounds loaded before any is classified; entries
// that fail the validity rule are skipped, and every CTA applies the same rule, so all agree on
// positions.
constexpr int kCountRounds = 8;
__device__ inline void count_tokens(const EpArgs& a, const int32_t* topk_idx, int t0, int t1, int* cnt_slot,
                                    int* cnt_rank) {
  for (int i = threadIdx.x; i < a.num_slots; i += blockDim.x) cnt_slot[i] = 0;
  for (int i = threadIdx.x; i < a.num_ranks; i += blockDim.x) cnt_rank[i] = 0;
  __syncthreads();
  const int k = a.topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int per_warp = 32 / k, group = lane / k, j = lane % k, stride = num_warps * per_warp;
  for (int first = t0 + warp * per_warp; first < t1; first += kCountRounds * stride) {
    int slot[kCountRounds];
#pragma unroll
    for (int u = 0; u < kCountRounds; ++u) {
      const int t = first + u * stride + group;
      slot[u] = group < per_warp && t < t1 ? topk_idx[size_t(t) * k + j] : -1;
    }
#pragma unroll
    for (int u = 0; u < kCountRounds; ++u) {
      // Rounds past t1 classify nothing (warp-uniform, so the shuffles keep every lane): at decode
      // sizes a CTA counts a few tokens in one round, and the other seven were a chain of matches.
      if (first + u * stride >= t1) break;
      const int t = first + u * stride + group;
      const bool active = group < per_warp && t < t1;
      const EntryInfo e = classify_entry(slot[u], active, group, a.num_slots, a.local_experts);
      if (e.valid) atomicAdd(&cnt_slot[slot[u]], 1);
      if (e.first_on_rank) atomicAdd(&cnt_rank[e.rank], 1);
    }
  }
  __syncthreads();
}

// Whether count_before takes the look-back: the direct count's last CTA classifies T * k entries,
// 256 a round; the look-back's reads G * n counters, 2048 a round trip (8 loads a thread): the
// look-back from 4x fewer rounds, where the grid fits the published counts' buffer.
__device__ __forceinline__ bool use_look_back(const EpArgs& a, int num_tokens) {
  const int n = a.num_slots + a.num_ranks;
  return int(gridDim.x) <= a.count_ctas && int64_t(num_tokens) * a.topk >= int64_t(gridDim.x) * n / 4;
}

// The counts over tokens [0, t_begin), before the CTA plans its own. Counted directly while that
// is cheap; past that (prefill sizes: the last of 132 CTAs would count 8,130 of 8,192 tokens,
// one warp round of ~60 instructions and two match_any per 32 entries), each CTA counts its own
// tokens, publishes them (cta_counts, then its flag = step, a release), waits for the flags of
// the CTAs before it and sums their counts: O(T / G + G * (num_slots + P)) instead of O(T) a CTA.
// The waits assume what a decoupled look-back does: a CTA is resident once any CTA after it is
// (the grid fits the GPU at once; grids are dispatched in order). The choice depends only on the
// step's token count and the grid, so every CTA makes the same one, and either way the counts are
// the same (count_tokens' validity rule).
__device__ inline void count_before(const EpArgs& a, const int32_t* topk_idx, int num_tokens, int t_begin, int t_end,
                             unsigned step, int* cnt_slot, int* cnt_rank) {
  const int S = a.num_slots, n = S + a.num_ranks;
  if (!use_look_back(a, num_tokens)) {
    count_tokens(a, topk_idx, 0, t_begin, cnt_slot, cnt_rank);
    return;
  }
  count_tokens(a, topk_idx, t_begin, t_end, cnt_slot, cnt_rank);
  int32_t* mine = a.cta_counts + size_t(blockIdx.x) * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) mine[i] = i < S ? cnt_slot[i] : cnt_rank[i - S];
  __syncthreads();  // the CTA's stores, then thread 0's release (the barrier passes them on)
  if (threadIdx.x == 0) ptx::st_release_gpu(a.cta_flags + blockIdx.x, int(step));
  for (int i = threadIdx.x; i < n; i += blockDim.x) *(i < S ? cnt_slot + i : cnt_rank + (i - S)) = 0;
  for (int c = threadIdx.x; c < int(blockIdx.x); c += blockDim.x)
    timed_wait(a, kPhaseDispatchSend, a.rank, step, c, 0, 32, 256,
               [&] { return ptx::ld_acquire_gpu(a.cta_flags + c) == int(step); });
  __syncthreads();  // every earlier CTA's counts acquired (a timeout leaves them short, and is reported)
  // The earlier CTAs' counters, (CTA, counter) pairs dealt over the threads, consecutive threads on
  // consecutive counters; kLoads loads in flight before their adds.
  constexpr int kLoads = 8;
  const int pairs = int(blockIdx.x) * n;  // < count_ctas * n, which the buffer allocated
  for (int p0 = 0; p0 < pairs; p0 += kLoads * int(blockDim.x)) {
    int v[kLoads], at[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int p = p0 + u * int(blockDim.x) + int(threadIdx.x);
      at[u] = p < pairs ? p % n : 0;
      v[u] = p < pairs ? __ldcg(a.cta_counts + p) : 0;
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      if (v[u]) atomicAdd(at[u] < S ? cnt_slot + at[u] : cnt_rank + (at[u] - S), v[u]);
  }
  __syncthreads();
}

// One rank's send in normal mode (EpArgs::direct and contiguous) places its rows in the contiguous
// layout itself, so before any row it needs every slot's total over the step, not only the counts
// before its range (cnt_slot, from count_before): tot[s] for s < num_slots (tot_rank: P ints of
// scratch). With the direct count, each CTA counts the tokens from t_begin on as well (no more than
// the last CTA's count before). With the look-back, the last CTA adds its own published counts to
// its count before and publishes the totals (cta_counts' row count_ctas, then cta_flags[count_ctas]
// = step, a release); every other CTA waits for them. That wait needs every CTA of the grid resident
// at once, as the look-back's needs the earlier ones: the grid is at most what the GPU holds at
// once (send_resident_ctas; else the direct count), and the last CTA waits for nothing but earlier
// CTAs' counts, which they publish first. Every thread of the CTA calls it, after count_before.
__device__ inline void count_totals(const EpArgs& a, const int32_t* topk_idx, int num_tokens, int t_begin,
                                    unsigned step, const int* cnt_slot, int* tot, int* tot_rank) {
  const int S = a.num_slots, n = S + a.num_ranks;
  if (!use_look_back(a, num_tokens) || int(gridDim.x) > a.send_resident_ctas) {
    count_tokens(a, topk_idx, t_begin, num_tokens, tot, tot_rank);  // ends with a barrier
    for (int i = threadIdx.x; i < S; i += blockDim.x) tot[i] += cnt_slot[i];
    __syncthreads();
    return;
  }
  int32_t* totals = a.cta_counts + size_t(a.count_ctas) * n;
  int32_t* flag = a.cta_flags + a.count_ctas;
  if (blockIdx.x == gridDim.x - 1) {
    const int32_t* mine = a.cta_counts + size_t(blockIdx.x) * n;  // this CTA's own, published by count_before
    for (int i = threadIdx.x; i < S; i += blockDim.x) totals[i] = tot[i] = cnt_slot[i] + mine[i];
    __syncthreads();  // the CTA's stores, then thread 0's release
    if (threadIdx.x == 0) ptx::st_release_gpu(flag, int(step));
    return;
  }
  if (threadIdx.x == 0)
    timed_wait(a, kPhaseDispatchSend, a.rank, step, int(gridDim.x) - 1, 0, 32, 256,
               [&] { return ptx::ld_acquire_gpu(flag) == int(step); });
  __syncthreads();  // the totals acquired (a timeout leaves them stale, and is reported)
  for (int i = threadIdx.x; i < S; i += blockDim.x) tot[i] = __ldcg(totals + i);
  __syncthreads();
}

}  // namespace moekit::gpu
