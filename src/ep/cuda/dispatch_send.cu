// The dispatch send kernel (both modes): quantise each token once, write one message per
// distinct target rank into that peer's inbox, raise one flag per peer.
//
// Message positions are deterministic without atomics on global memory: CTA c owns the tokens
// [c*T/G, (c+1)*T/G) and first counts, over the tokens before its range, how many messages go to
// each rank and how many rows go to each slot (shared-memory counters). Its warp 0 then walks
// its own tokens in order (one lane per top-k entry), so token t's message lands at inbox position "messages to that rank
// from tokens < t", and each entry's row position is "rows of that slot from tokens < t": the
// canonical order of layout.h, computed where the routing is known. The last CTA to finish
// recounts the whole batch; the thread that raises a peer's flag first writes that peer's
// per-expert counts into its inbox header, so its release store covers them (every CTA's payload
// is covered by the system fence before its sign-off).
//
// Latency, not bytes, sets this kernel's time at decode sizes (one token per CTA): the first x
// block of a CTA's token is loaded before the counting, the counting loads four rounds of
// topk_idx at once, and the conversion to e4m3 is the hardware's (cvt.rn.satfinite, the same
// rounding as fp8.h's) wherever the chunk is finite.
#include <cuda_runtime.h>

#include "ep_device.cuh"
#include "kernels/cuda/launch.cuh"
#include "moekit/cuda_check.h"
#include "moekit/fp8.h"
#include "moekit/quant.h"

namespace moekit::gpu {
namespace {

// Counts, over tokens [t0, t1), rows per slot and messages per rank. Each warp takes 32 / k tokens
// at a time (one entry per lane), kCountRounds rounds loaded before any is classified; entries
// that fail the validity rule are skipped, and every CTA applies the same rule, so all agree on
// positions.
constexpr int kCountRounds = 4;
__device__ void count_tokens(const EpArgs& a, const int32_t* topk_idx, int t0, int t1, int* cnt_slot, int* cnt_rank) {
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
      const int t = first + u * stride + group;
      const bool active = group < per_warp && t < t1;
      const EntryInfo e = classify_entry(slot[u], active, group, a.num_slots, a.local_experts);
      if (e.valid) atomicAdd(&cnt_slot[slot[u]], 1);
      if (e.first_on_rank) atomicAdd(&cnt_rank[e.rank], 1);
    }
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
  const float weight = active ? topk_weights[size_t(t) * k + lane] : 0.0f;  // loaded with the slot: one round trip
  const EntryInfo e = classify_entry(slot, active, 0, a.num_slots, a.local_experts);
  if (e.fault) record_fault(a, EpErrorKind(e.fault), kPhaseDispatchSend, -1, step, t, lane, slot);
  int code = -1;
  float w = 0.0f;
  if (e.valid) {
    w = weight;
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
  // order is the number of leaders with a smaller rank (one shuffle per leader, not per lane).
  int place = 0;
  for (unsigned m = leaders; m; m &= m - 1) place += __shfl_sync(0xFFFFFFFFu, e.rank, __ffs(m) - 1) < e.rank;
  const int num_targets = __popc(leaders);
  if (e.first_on_rank) a.route_ranks[size_t(t) * k + place] = e.rank;
  if (active && lane >= num_targets) a.route_ranks[size_t(t) * k + lane] = -1;
  if (lane == 0) p.num_targets = num_targets;
}

// x chunks (16 elements) of one token that each thread holds at once: a 8192-wide token in one
// pass at 256 threads, so the whole token is in flight before the first conversion.
constexpr int kQuantRounds = 2;
struct XBlock {
  uint4 u[kQuantRounds][2];
};

// Loads this thread's chunks of token t from chunk c_base on: chunk c_base + i * blockDim.x + threadIdx.x.
__device__ __forceinline__ void load_x(const EpArgs& a, const uint16_t* x, int t, int c_base, XBlock& b) {
  const int num_chunks = a.hidden / 16;
  const uint4* xr = reinterpret_cast<const uint4*>(x + size_t(t) * a.hidden);
#pragma unroll
  for (int i = 0; i < kQuantRounds; ++i) {
    const int c = c_base + i * int(blockDim.x) + int(threadIdx.x);
    b.u[i][0] = b.u[i][1] = make_uint4(0, 0, 0, 0);
    if (c < num_chunks) {
      b.u[i][0] = __ldg(xr + 2 * c);
      b.u[i][1] = __ldg(xr + 2 * c + 1);
    }
  }
}

// Four e4m3 codes of finite quotients, byte i = q[i]: the hardware conversion (round to nearest
// even, saturating at 448, subnormals kept), which is fp8.h's float_to_fp8_e4m3 on finite input.
__device__ __forceinline__ uint32_t cvt_e4m3x4(float q0, float q1, float q2, float q3) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(q1), "f"(q0));  // first operand: upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(q3), "f"(q2));
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// All threads: 1x128 quantisation (quant.h's rule: scale = max(amax, 1e-4) / 448, q = fp8(x /
// scale) in fp32) of the chunks in b and one 16-byte store per target per 16 elements. Eight
// lanes hold one 128-wide group, so the amax is a three-step shuffle. A chunk with a NaN or an
// infinity (a recorded fault) takes fp8.h's conversion, whose NaN code is the reference's.
__device__ void quantize_and_send(const EpArgs& a, const XBlock& b, int t, int c_base, unsigned step,
                                  const TokenPlan& p) {
  const int warp = threadIdx.x >> 5;
  const int num_chunks = a.hidden / 16;
#pragma unroll
  for (int i = 0; i < kQuantRounds; ++i) {
    if (c_base + i * int(blockDim.x) + warp * 32 >= num_chunks) break;  // warp-uniform: the shuffles need all lanes
    const int c = c_base + i * int(blockDim.x) + int(threadIdx.x);
    const bool active = c < num_chunks;
    const uint32_t w[8] = {b.u[i][0].x, b.u[i][0].y, b.u[i][0].z, b.u[i][0].w,
                           b.u[i][1].x, b.u[i][1].y, b.u[i][1].z, b.u[i][1].w};
    float v[16];
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      v[2 * h] = bf16_lo(w[h]);
      v[2 * h + 1] = bf16_hi(w[h]);
    }
    float amax = 0.0f;
    bool finite = true;
#pragma unroll
    for (int h = 0; h < 16; ++h) {
      amax = fmaxf(amax, fabsf(v[h]));
      finite = finite && isfinite(v[h]);
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    if (!active) continue;
    if (!finite) record_fault(a, EpErrorKind::kNotFinite, kPhaseDispatchSend, -1, step, t, c * 16, 1);
    const float scale = fmaxf(amax, kMinAmax) / kFp8Max;
    float q[16];
#pragma unroll
    for (int h = 0; h < 16; ++h) q[h] = v[h] / scale;
    uint32_t packed[4];
    if (finite && isfinite(scale)) {
#pragma unroll
      for (int h = 0; h < 4; ++h) packed[h] = cvt_e4m3x4(q[4 * h], q[4 * h + 1], q[4 * h + 2], q[4 * h + 3]);
    } else {
#pragma unroll
      for (int h = 0; h < 4; ++h)
        packed[h] = uint32_t(float_to_fp8_e4m3(q[4 * h])) | uint32_t(float_to_fp8_e4m3(q[4 * h + 1])) << 8 |
                    uint32_t(float_to_fp8_e4m3(q[4 * h + 2])) << 16 | uint32_t(float_to_fp8_e4m3(q[4 * h + 3])) << 24;
    }
    const uint4 out = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    for (int r = 0; r < p.num_targets; ++r) {
      uint8_t* msg = p.target_msg[r];
      *reinterpret_cast<uint4*>(msg + size_t(c) * 16) = out;
      if ((c & 7) == 0) *reinterpret_cast<float*>(msg + a.msg_scale_off + (c >> 3) * 4) = scale;
    }
    if (a.self_slab) {  // the rank's own copy: masked slab E_loc, row t (EpConfig::self_slab)
      const size_t slab = size_t(a.local_experts);
      *reinterpret_cast<uint4*>(a.recv_x + (slab * a.max_m + t) * a.hidden + size_t(c) * 16) = out;
      if ((c & 7) == 0) a.recv_scales[(slab * (a.hidden / kQuantBlock) + (c >> 3)) * a.max_m + t] = scale;
    }
  }
}

__global__ void __launch_bounds__(kEpThreads) dispatch_send_kernel(EpArgs a, const uint16_t* x, const int32_t* topk_idx,
                                                                   const float* topk_weights, int num_tokens) {
  extern __shared__ int smem[];
  int* cnt_slot = smem;               // [num_slots]
  int* cnt_rank = smem + a.num_slots;  // [P]
  __shared__ TokenPlan plan;
  begin_ep_kernel(a, kPhaseDispatchSend);
  if (a.self_slab && blockIdx.x == 0 && threadIdx.x == 0) a.recv_count[a.local_experts] = num_tokens;
  const unsigned step = current_step(a, kPhaseDispatchSend);
  const int parity = int(step) & a.parity_mask;
  const int t_begin = int(int64_t(num_tokens) * blockIdx.x / gridDim.x);
  const int t_end = int(int64_t(num_tokens) * (blockIdx.x + 1) / gridDim.x);

  // The first x block of the CTA's first token is in flight while the counts are made.
  XBlock xb;
  if (t_begin < t_end) load_x(a, x, t_begin, 0, xb);
  count_tokens(a, topk_idx, 0, t_begin, cnt_slot, cnt_rank);
  const int num_chunks = a.hidden / 16, block_chunks = kQuantRounds * int(blockDim.x);
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
    for (int c_base = 0; c_base < num_chunks; c_base += block_chunks) {
      if (c_base > 0) load_x(a, x, t, c_base, xb);
      quantize_and_send(a, xb, t, c_base, step, plan);
    }
    if (t + 1 < t_end) load_x(a, x, t + 1, 0, xb);  // the next token's first block, before the barrier
    __syncthreads();
  }

  if (finish_cta(a, kPhaseDispatchSend, true)) {
    count_tokens(a, topk_idx, 0, num_tokens, cnt_slot, cnt_rank);
    // The thread that raises peer r's flag writes r's counts first: its release store covers them.
    const int E = a.local_experts;
    for (int r = threadIdx.x; r < a.num_ranks; r += blockDim.x) {
      uint8_t* inbox = a.dispatch_outbox(parity, r);
      int* counts = reinterpret_cast<int*>(inbox + kEpFlagBytes);
      for (int e = 0; e < E; ++e) counts[e] = cnt_slot[r * E + e];
      st_release_sys(reinterpret_cast<uint64_t*>(inbox), uint64_t(step) << 32 | uint32_t(cnt_rank[r]));
    }
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
  launch_kernel_ex(dispatch_send_kernel, dim3(grid), dim3(kEpThreads), smem, stream, args.pdl != 0, args, x, topk_idx,
                   topk_weights, num_tokens);
}

}  // namespace moekit::gpu
