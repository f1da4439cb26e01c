// The dispatch send kernel (both modes): quantise each token once, write one message per
// distinct target rank into that peer's inbox, raise one flag per peer.
//
// Message positions are deterministic without atomics on global memory: CTA c owns the tokens
// [c*T/G, (c+1)*T/G) and first counts, over the tokens before its range, how many messages go to
// each rank and how many rows go to each slot (shared-memory counters). Its warp 0 then walks
// its own tokens in order (one lane per top-k entry), so token t's message lands at inbox position "messages to that rank
// from tokens < t", and each entry's row position is "rows of that slot from tokens < t": the
// canonical order of layout.h, computed where the routing is known. The last CTA to finish
// recounts the whole batch, writes each peer's per-expert counts into its inbox header and
// raises the flags with a release store (fence first, so every CTA's payload is visible).
#include <cuda_runtime.h>

#include "ep_device.cuh"
#include "moekit/cuda_check.h"
#include "moekit/fp8.h"
#include "moekit/quant.h"

namespace moekit::gpu {
namespace {

// Counts, over tokens [t0, t1), rows per slot and messages per rank. Each warp takes 32 / k tokens
// at a time (one entry per lane); entries that fail the validity rule are skipped, and every CTA
// applies the same rule, so all agree on positions.
__device__ void count_tokens(const EpArgs& a, const int32_t* topk_idx, int t0, int t1, int* cnt_slot, int* cnt_rank) {
  for (int i = threadIdx.x; i < a.num_slots; i += blockDim.x) cnt_slot[i] = 0;
  for (int i = threadIdx.x; i < a.num_ranks; i += blockDim.x) cnt_rank[i] = 0;
  __syncthreads();
  const int k = a.topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int per_warp = 32 / k, group = lane / k, j = lane % k;
  for (int first = t0 + warp * per_warp; first < t1; first += num_warps * per_warp) {
    const int t = first + group;
    const bool active = group < per_warp && t < t1;
    const int slot = active ? topk_idx[size_t(t) * k + j] : -1;
    const EntryInfo e = classify_entry(slot, active, group, a.num_slots, a.local_experts);
    if (e.valid) atomicAdd(&cnt_slot[slot], 1);
    if (e.first_on_rank) atomicAdd(&cnt_rank[e.rank], 1);
  }
  __syncthreads();
}

struct TokenPlan {
  int num_targets;
  int target_rank[kEpMaxTopk];
  uint8_t* target_msg[kEpMaxTopk];  // the message slot in that peer's inbox
  int entry_rank[kEpMaxTopk];       // -1: entry skipped
  int entry_code[kEpMaxTopk];       // local_expert << 16 | row position
  float entry_w[kEpMaxTopk];
};

// Warp 0, lane j = entry j: positions of token t's messages and rows, in token order (the counters
// hold the counts of all earlier tokens). Valid entries of a token have distinct slots and the
// first entry per rank is unique, so no two lanes touch the same counter. Records bad entries.
__device__ void plan_token(const EpArgs& a, const int32_t* topk_idx, const float* topk_weights, int t, int parity,
                           unsigned step, int* cnt_slot, int* cnt_rank, TokenPlan& p) {
  const int k = a.topk, lane = threadIdx.x & 31;
  const bool active = lane < k;
  const int slot = active ? topk_idx[size_t(t) * k + lane] : -1;
  const EntryInfo e = classify_entry(slot, active, 0, a.num_slots, a.local_experts);
  if (e.fault) record_fault(a, EpErrorKind(e.fault), kPhaseDispatchSend, -1, step, t, lane, slot);
  int code = -1;
  float w = 0.0f;
  if (e.valid) {
    w = topk_weights[size_t(t) * k + lane];
    if (!isfinite(w)) record_fault(a, EpErrorKind::kNotFinite, kPhaseDispatchSend, -1, step, t, lane, 0);
    code = ((slot % a.local_experts) << 16) | cnt_slot[slot]++;
  }
  if (active) {
    p.entry_rank[lane] = e.rank;
    p.entry_code[lane] = code;
    p.entry_w[lane] = w;
  }
  const unsigned leaders = __ballot_sync(0xFFFFFFFFu, e.first_on_rank);
  if (e.first_on_rank) {
    const int i = __popc(leaders & ((1u << lane) - 1));
    p.target_rank[i] = e.rank;
    p.target_msg[i] = a.dispatch_outbox(parity, e.rank) + a.dispatch_header_bytes + size_t(cnt_rank[e.rank]++) * a.msg_bytes;
  }
  // The combine sums the partial results in ascending rank order: a leader's place in that
  // order is the number of leaders with a smaller rank.
  int place = 0;
  for (int i = 0; i < 32; ++i) {
    const int other = __shfl_sync(0xFFFFFFFFu, e.rank, i);
    place += ((leaders >> i) & 1) && other < e.rank;
  }
  const int num_targets = __popc(leaders);
  if (e.first_on_rank) a.route_ranks[size_t(t) * k + place] = e.rank;
  if (active && lane >= num_targets) a.route_ranks[size_t(t) * k + lane] = -1;
  if (lane == 0) p.num_targets = num_targets;
}

// All threads: 1x128 quantisation of token t (quant.h's rule: scale = max(amax, 1e-4) / 448,
// q = fp8(x / scale) in fp32) and one 16-byte store per target per 16 elements. Eight lanes
// hold one 128-wide group, so the amax is a three-step shuffle.
__device__ void quantize_and_send(const EpArgs& a, const uint16_t* x, int t, unsigned step, const TokenPlan& p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_chunks = a.hidden / 16;
  const uint4* xr = reinterpret_cast<const uint4*>(x + size_t(t) * a.hidden);
  for (int c0 = warp * 32; c0 < num_chunks; c0 += blockDim.x) {
    const int c = c0 + lane;
    const bool active = c < num_chunks;
    uint4 u0 = make_uint4(0, 0, 0, 0), u1 = u0;
    if (active) {
      u0 = xr[2 * c];
      u1 = xr[2 * c + 1];
    }
    const uint32_t w[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
    float v[16];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[2 * i] = bf16_lo(w[i]);
      v[2 * i + 1] = bf16_hi(w[i]);
    }
    float amax = 0.0f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      amax = fmaxf(amax, fabsf(v[i]));
      finite = finite && isfinite(v[i]);
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    if (!active) continue;
    if (!finite) record_fault(a, EpErrorKind::kNotFinite, kPhaseDispatchSend, -1, step, t, c * 16, 1);
    const float scale = fmaxf(amax, kMinAmax) / kFp8Max;
    uint32_t q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      q[i] = uint32_t(float_to_fp8_e4m3(v[4 * i] / scale)) | uint32_t(float_to_fp8_e4m3(v[4 * i + 1] / scale)) << 8 |
             uint32_t(float_to_fp8_e4m3(v[4 * i + 2] / scale)) << 16 |
             uint32_t(float_to_fp8_e4m3(v[4 * i + 3] / scale)) << 24;
    const uint4 packed = make_uint4(q[0], q[1], q[2], q[3]);
    for (int i = 0; i < p.num_targets; ++i) {
      uint8_t* msg = p.target_msg[i];
      *reinterpret_cast<uint4*>(msg + size_t(c) * 16) = packed;
      if ((c & 7) == 0) *reinterpret_cast<float*>(msg + a.msg_scale_off + (c >> 3) * 4) = scale;
    }
  }
}

__global__ void __launch_bounds__(kEpThreads) dispatch_send_kernel(EpArgs a, const uint16_t* x, const int32_t* topk_idx,
                                                                   const float* topk_weights, int num_tokens) {
  extern __shared__ int smem[];
  int* cnt_slot = smem;               // [num_slots]
  int* cnt_rank = smem + a.num_slots;  // [P]
  __shared__ TokenPlan plan;
  const unsigned step = current_step(a, kPhaseDispatchSend);
  const int parity = int(step) & a.parity_mask;
  const int t_begin = int(int64_t(num_tokens) * blockIdx.x / gridDim.x);
  const int t_end = int(int64_t(num_tokens) * (blockIdx.x + 1) / gridDim.x);

  count_tokens(a, topk_idx, 0, t_begin, cnt_slot, cnt_rank);
  for (int t = t_begin; t < t_end; ++t) {
    if (threadIdx.x < 32) plan_token(a, topk_idx, topk_weights, t, parity, step, cnt_slot, cnt_rank, plan);
    __syncthreads();
    if (threadIdx.x < plan.num_targets) {
      const int r = plan.target_rank[threadIdx.x];
      int* meta = reinterpret_cast<int*>(plan.target_msg[threadIdx.x] + a.msg_meta_off);
      float* wts = reinterpret_cast<float*>(meta + 1 + a.topk);
      meta[0] = t;
      for (int j = 0; j < a.topk; ++j) {
        const bool here = plan.entry_rank[j] == r;
        meta[1 + j] = here ? plan.entry_code[j] : -1;
        wts[j] = here ? plan.entry_w[j] : 0.0f;
      }
    }
    quantize_and_send(a, x, t, step, plan);
    __syncthreads();
  }

  if (finish_cta(a, kPhaseDispatchSend)) {
    count_tokens(a, topk_idx, 0, num_tokens, cnt_slot, cnt_rank);
    for (int i = threadIdx.x; i < a.num_slots; i += blockDim.x) {
      const int r = i / a.local_experts;
      reinterpret_cast<int*>(a.dispatch_outbox(parity, r) + kEpFlagBytes)[i % a.local_experts] = cnt_slot[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
    __syncthreads();
    for (int r = threadIdx.x; r < a.num_ranks; r += blockDim.x)
      st_release_sys(reinterpret_cast<uint64_t*>(a.dispatch_outbox(parity, r)),
                     uint64_t(step) << 32 | uint32_t(cnt_rank[r]));
    if (threadIdx.x == 0) {
      a.ctr->num_tokens = num_tokens;
      advance_step(a, kPhaseDispatchSend, step);
    }
  }
}

}  // namespace

void launch_dispatch_send(const EpArgs& args, const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
                          int num_tokens, int num_ctas, cudaStream_t stream) {
  const int grid = num_tokens < 1 ? 1 : (num_tokens < num_ctas ? num_tokens : num_ctas);
  const size_t smem = sizeof(int) * size_t(args.num_slots + args.num_ranks);
  dispatch_send_kernel<<<grid, kEpThreads, smem, stream>>>(args, x, topk_idx, topk_weights, num_tokens);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::gpu
