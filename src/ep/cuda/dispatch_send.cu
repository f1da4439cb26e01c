// The dispatch send kernel (both modes): quantise each token once, write one message per
// distinct target rank into that peer's inbox, raise one flag per peer.
//
// Message positions are deterministic without atomics on global memory: CTA c owns the tokens
// [c*T/G, (c+1)*T/G) and first learns, over the tokens before its range, how many messages go to
// each rank and how many rows go to each slot (shared-memory counters; send_count.cuh: counted
// directly, or at prefill sizes by a look-back over the CTAs' own counts). It then plans its tokens
// in batches of up to 32, in token order (plan_batch), so token t's message lands at inbox
// position "messages to that rank from tokens < t", and each entry's row position is "rows of
// that slot from tokens < t": the canonical order of layout.h, computed where the routing is
// known. The CTA with the last tokens ends holding the whole batch's counts and writes every
// peer's per-expert counts into its inbox header; the last CTA to finish raises the flags, whose
// release stores cover every CTA's payload and headers (each CTA fences before its sign-off).
// One rank (EpArgs::direct, ep.h) has nobody to send to: the planned row positions are already
// the masked layout's rows, so each token is written there once per entry, with the combine's map
// and recv_src; the CTA with the last tokens writes recv_count, and no flag is raised. In normal
// mode the contiguous layout's rows also need the segment starts, so there the CTAs first share the
// step's per-expert totals (count_totals) and each builds the segment table (contiguous.cuh), then
// writes row_expert too and its share of the rows no token fills.
//
// A batch's tokens are copied by teams of warps working side by side: at decode sizes (one token
// per CTA) the whole CTA is one team and latency sets the time, so the token's first x block is
// loaded before the counting and the counting keeps eight rounds of topk_idx in flight; at
// prefill sizes each warp copies its own tokens and loads its next x block before it sends the
// current one. The conversion to e4m3 is the hardware's (cvt.rn.satfinite, the same rounding as
// fp8.h's) wherever the chunk is finite.
#include <cuda_runtime.h>

#include "contiguous.cuh"
#include "ep_device.cuh"
#include "send_count.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/silu_fp8.cuh"
#include "moekit/cuda_check.h"
#include "moekit/fp8.h"
#include "moekit/mxfp4.h"
#include "moekit/quant.h"

namespace moekit::gpu {
namespace {

// What the copy of one token needs: its messages' places and each top-k entry's code and weight.
struct TokenPlan {
  int num_targets;
  int target_rank[kEpMaxTopk];
  uint8_t* target_msg[kEpMaxTopk];  // the message slot in that peer's inbox
  int entry_rank[kEpMaxTopk];       // -1: entry skipped
  int entry_code[kEpMaxTopk];       // pack_entry(local expert, row position), or -1
  float entry_w[kEpMaxTopk];
};

// Tokens planned at once: every warp plans up to kBatchTokens / warps of them (one lane per top-k
// entry), so a batch costs one round trip for its routing and one turn per warp at the counters.
constexpr int kBatchTokens = 32;
__device__ __forceinline__ int plan_tokens_per_warp(int k) {
  const int by_lanes = 32 / k, by_batch = kBatchTokens / (kEpThreads / 32);
  return by_lanes < by_batch ? by_lanes : by_batch;
}

// One lane's top-k entry of a batch: warp w holds tokens [w * per_warp, (w + 1) * per_warp) of it
// (lane = group * k + j: entry j of the group's token). Loaded at the top of the batch, so that
// its round trip overlaps the x load and the counting (at decode sizes the send is a chain of
// round trips: stage clock, 1.2 us of 8 for this one when it followed the counting).
struct BatchEntry {
  int slot;
  float weight;
};
__device__ __forceinline__ BatchEntry load_batch_entry(const EpArgs& a, const int32_t* topk_idx,
                                                       const float* topk_weights, int b0, int n) {
  const int k = a.topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per_warp = plan_tokens_per_warp(k), group = lane / k, j = lane % k, i = warp * per_warp + group;
  const bool active = group < per_warp && i < n;
  const size_t at = size_t(b0 + i) * k + j;
  return {active ? topk_idx[at] : -1, active ? topk_weights[at] : 0.0f};
}

// All threads: the plans of tokens [b0, b0 + n) of the batch into plans[0, n), positions in token
// order, from this lane's entry `in` (load_batch_entry). Inside a warp, an entry's place among the
// warp's entries of its slot (or, for a message, of its rank) is a match_any rank; across warps,
// the warps take turns at the shared counters in warp order. Valid entries of a token have
// distinct slots and the first entry per rank is unique, so each counter grows by the warp's count
// of that key. Records bad entries.
__device__ void plan_batch(const EpArgs& a, BatchEntry in, int b0, int n, int parity, unsigned step, int* cnt_slot,
                           int* cnt_rank, TokenPlan* plans) {
  const int k = a.topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per_warp = plan_tokens_per_warp(k), group = lane / k, j = lane % k, i = warp * per_warp + group;
  const bool active = group < per_warp && i < n;
  const int t = b0 + i;
  const int slot = in.slot;
  const float weight = in.weight;
  const EntryInfo e = classify_entry(slot, active, group, a.num_slots, a.local_experts);
  if (e.fault) record_fault(a, EpErrorKind(e.fault), kPhaseDispatchSend, -1, step, t, j, slot);
  const unsigned earlier = (1u << lane) - 1;
  const unsigned same_slot = __match_any_sync(0xFFFFFFFFu, e.valid ? slot : kNoMatchKey);
  const unsigned same_rank = __match_any_sync(0xFFFFFFFFu, e.first_on_rank ? e.rank : kNoMatchKey);
  int row_pos = 0, msg_pos = 0;
  const int warps_used = (n + per_warp - 1) / per_warp;
  for (int w = 0; w < warps_used; ++w) {
    if (warp == w) {
      if (e.valid) row_pos = cnt_slot[slot] + __popc(same_slot & earlier);
      if (e.first_on_rank) msg_pos = cnt_rank[e.rank] + __popc(same_rank & earlier);
      __syncwarp();
      if (e.valid && (same_slot & earlier) == 0) cnt_slot[slot] += __popc(same_slot);
      if (e.first_on_rank && (same_rank & earlier) == 0) cnt_rank[e.rank] += __popc(same_rank);
    }
    __syncthreads();
  }

  TokenPlan& p = plans[active ? i : 0];
  int code = -1;
  float w = 0.0f;
  if (e.valid) {
    w = weight;
    if (!isfinite(w)) record_fault(a, EpErrorKind::kNotFinite, kPhaseDispatchSend, -1, step, t, j, 0);
    code = pack_entry(slot % a.local_experts, row_pos);
  }
  if (active) {
    p.entry_rank[j] = e.rank;
    p.entry_code[j] = code;
    p.entry_w[j] = w;
  }
  const unsigned token_lanes = (k == 32 ? 0xFFFFFFFFu : (1u << k) - 1) << (group * k);
  const unsigned all_leaders = __ballot_sync(0xFFFFFFFFu, e.first_on_rank);
  const unsigned leaders = all_leaders & token_lanes;
  if (e.first_on_rank) {
    const int target = __popc(leaders & earlier);
    p.target_rank[target] = e.rank;
    p.target_msg[target] = a.dispatch_outbox(parity, e.rank) + a.dispatch_header_bytes + size_t(msg_pos) * a.msg_bytes;
  }
  // The combine sums the partial results in ascending rank order: a leader's place in that
  // order is the number of its token's leaders with a smaller rank (one shuffle per leader).
  int place = 0;
  for (unsigned m = all_leaders; m; m &= m - 1) {
    const int from = __ffs(m) - 1;
    const int r = __shfl_sync(0xFFFFFFFFu, e.rank, from);
    place += (token_lanes >> from & 1u) && r < e.rank;
  }
  const int num_targets = __popc(leaders);
  if (e.first_on_rank) a.route_ranks[size_t(t) * k + place] = e.rank;
  if (active && j >= num_targets) a.route_ranks[size_t(t) * k + j] = -1;
  if (active && j == 0) p.num_targets = num_targets;
}

// A token is copied by a team of warps: the whole CTA when the CTA has one token (decode), one
// warp per token from 8 tokens on. Team thread tt of team_threads holds x chunks (16 elements)
// c_base + i * team_threads + tt, i < kQuantRounds: a whole 8192-wide token in one pass for a
// CTA-wide team, so the token is in flight before the first conversion.
constexpr int kQuantRounds = 2;
struct XBlock {
  uint4 u[kQuantRounds][2];
};
struct Team {
  int tt, threads;  // this thread's index in its team, the team's size
};

// Loads this thread's chunks of token t from chunk c_base on (chunks past x's columns: zeros).
__device__ __forceinline__ void load_x(const EpArgs& a, const uint16_t* x, int t, int c_base, Team team, XBlock& b) {
  const int num_chunks = a.x_cols / 16;
  const uint4* xr = reinterpret_cast<const uint4*>(x + size_t(t) * a.x_cols);
#pragma unroll
  for (int i = 0; i < kQuantRounds; ++i) {
    const int c = c_base + i * team.threads + team.tt;
    b.u[i][0] = b.u[i][1] = make_uint4(0, 0, 0, 0);
    if (c < num_chunks) {
      b.u[i][0] = __ldg(xr + 2 * c);
      b.u[i][1] = __ldg(xr + 2 * c + 1);
    }
  }
}

// Chunk c (16 values) of a quantised row into `row`: one 16-byte store, or, in the MXFP4 GEMM's K
// order (EpConfig::mxfp4_k_order), its four 4-byte units each at its place in the 128-deep block.
__device__ __forceinline__ void store_chunk(uint8_t* row, int c, uint4 v, bool mxfp4_k_order) {
  if (!mxfp4_k_order) {
    *reinterpret_cast<uint4*>(row + size_t(c) * 16) = v;
    return;
  }
  uint8_t* block = row + size_t(c / 8) * kQuantBlock;
  const int unit0 = (c % 8) * 4;
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(block + mxfp4_unit_position(unit0 + j) * 4) = w[j];
}

// EpConfig::x_scaling per token: token t's largest finite magnitude over all of its x columns.
// Each team thread reads its chunks again (the row is in the L1 or the L2 from the block loads),
// a warp reduces by shuffles, and a wider team (fewer than 8 tokens in the CTA's batch) through
// shared memory between two of its own named barriers (ids 1.., one per team; the second keeps
// the next token's writes behind this token's reads). Non-finite values are left out, so a
// recorded fault spoils only its own values, as it does under 1x128 scales.
__device__ float token_amax(const EpArgs& a, const uint16_t* x, int t, Team team, int team_id, float* warp_amax) {
  const uint4* xr = reinterpret_cast<const uint4*>(x + size_t(t) * a.x_cols);
  // The bf16 pairs' magnitudes folded as pairs (NaNs pass over, one instruction per two values),
  // kAmaxBatch chunks a thread loaded before any is folded (zeros past the row), so that a 32-lane
  // team reads a gpt-oss-120b token (184 chunks) in two round trips instead of six. An infinity
  // among them (a recorded fault, rare) sends this thread through the value loop that leaves it out.
  constexpr int kAmaxBatch = 4;
  const int num_chunks = a.x_cols / 16;
  uint32_t m = 0;
  for (int c0 = team.tt; c0 < num_chunks; c0 += kAmaxBatch * team.threads) {
    uint4 u[kAmaxBatch][2];
#pragma unroll
    for (int b = 0; b < kAmaxBatch; ++b) {
      const int c = c0 + b * team.threads;
      u[b][0] = u[b][1] = make_uint4(0, 0, 0, 0);
      if (c < num_chunks) u[b][0] = __ldg(xr + 2 * c), u[b][1] = __ldg(xr + 2 * c + 1);
    }
#pragma unroll
    for (int b = 0; b < kAmaxBatch; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h) m = bf16x2_absmax<false>(m, bf16x8_absmax<false>(u[b][h]));
  }
  float amax = bf16x2_fold_max(m);
  if (isinf(amax)) {
    amax = 0.0f;
    for (int c = team.tt; c < a.x_cols / 16; c += team.threads) {
      const uint4 u[2] = {__ldg(xr + 2 * c), __ldg(xr + 2 * c + 1)};
      const uint32_t w[8] = {u[0].x, u[0].y, u[0].z, u[0].w, u[1].x, u[1].y, u[1].z, u[1].w};
#pragma unroll
      for (int h = 0; h < 8; ++h) {
        const float lo = bf16_lo(w[h]), hi = bf16_hi(w[h]);
        if (isfinite(lo)) amax = fmaxf(amax, fabsf(lo));
        if (isfinite(hi)) amax = fmaxf(amax, fabsf(hi));
      }
    }
  }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  if (team.threads == 32) return amax;
  const int warp = threadIdx.x >> 5, first_warp = warp - (team.tt >> 5);
  if ((threadIdx.x & 31) == 0) warp_amax[warp] = amax;
  ptx::named_barrier(1 + team_id, team.threads);
  for (int w = 0; w < team.threads / 32; ++w) amax = fmaxf(amax, warp_amax[first_warp + w]);
  ptx::named_barrier(1 + team_id, team.threads);
  return amax;
}

// All threads: 1x128 quantisation (quant.h's rule: scale = max(amax, 1e-4) / 448, q = fp8(x /
// scale) in fp32, both divisions IEEE-rounded through silu_fp8.cuh's div_rn, which costs no
// subroutine call per value as `/` does) of the chunks in b, then one pass per target with a
// 16-byte store per 16 elements (the target's message address read from the plan once per block,
// not once per chunk).
// Eight lanes hold one 128-wide group, so the amax is a three-step shuffle; per token
// (EpArgs::token_scales) every group takes token_scale, the same rule over token_amax's. A chunk
// with a NaN or an infinity (a recorded fault) takes fp8.h's conversion, whose NaN code is the
// reference's.
// One rank (EpArgs::direct): the rows are this rank's own layout's; seg is the contiguous layout's
// segment table (null for the masked layout), and nothing is stored where the step's rows do not
// fit it (place false; the fault is recorded once).
__device__ void quantize_and_send(const EpArgs& a, const XBlock& b, int t, int c_base, Team team, unsigned step,
                                  const TokenPlan& p, float token_scale, const int* seg, bool place) {
  const int lane = threadIdx.x & 31;
  const int num_chunks = a.hidden / 16;
  uint4 out[kQuantRounds];
  float scale[kQuantRounds];
  int chunk[kQuantRounds];  // -1: this thread has no chunk i
#pragma unroll
  for (int i = 0; i < kQuantRounds; ++i) chunk[i] = -1;
#pragma unroll
  for (int i = 0; i < kQuantRounds; ++i) {
    const int warp_first = c_base + i * team.threads + team.tt - lane;
    if (warp_first >= num_chunks) break;  // warp-uniform: the shuffles need all lanes
    const int c = warp_first + lane;
    const uint32_t w[8] = {b.u[i][0].x, b.u[i][0].y, b.u[i][0].z, b.u[i][0].w,
                           b.u[i][1].x, b.u[i][1].y, b.u[i][1].z, b.u[i][1].w};
    float v[16];
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      v[2 * h] = bf16_lo(w[h]);
      v[2 * h + 1] = bf16_hi(w[h]);
    }
    // The chunk's pairs folded with NaNs kept: an all-ones exponent iff a value is not finite.
    // Finite, its magnitude is the chunk's amax; else (a recorded fault) the value loop gives
    // fmaxf's amax, which passes over NaNs and keeps infinities.
    const uint32_t m = bf16x2_absmax<true>(bf16x8_absmax<true>(b.u[i][0]), bf16x8_absmax<true>(b.u[i][1]));
    const bool finite = bf16x2_finite(m);
    float amax = bf16x2_fold_max(m);
    if (!finite) {
      amax = 0.0f;
#pragma unroll
      for (int h = 0; h < 16; ++h) amax = fmaxf(amax, fabsf(v[h]));
    }
    if (!a.token_scales) {
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    }
    if (c >= num_chunks) continue;
    if (!finite) record_fault(a, EpErrorKind::kNotFinite, kPhaseDispatchSend, -1, step, t, c * 16, 1);
    scale[i] = a.token_scales ? token_scale : fp8_group_scale(amax);
    const double inv = reciprocal_rn(scale[i]);  // once for the 16 divisions
    float q[16];
#pragma unroll
    for (int h = 0; h < 16; ++h) q[h] = div_by(v[h], inv);
    uint32_t packed[4];
    if (finite && isfinite(scale[i])) {
#pragma unroll
      for (int h = 0; h < 4; ++h) packed[h] = fp8x4_e4m3_finite(q[4 * h], q[4 * h + 1], q[4 * h + 2], q[4 * h + 3]);
    } else {
#pragma unroll
      for (int h = 0; h < 4; ++h)
        packed[h] = uint32_t(float_to_fp8_e4m3(q[4 * h])) | uint32_t(float_to_fp8_e4m3(q[4 * h + 1])) << 8 |
                    uint32_t(float_to_fp8_e4m3(q[4 * h + 2])) << 16 | uint32_t(float_to_fp8_e4m3(q[4 * h + 3])) << 24;
    }
    out[i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    chunk[i] = c;
  }
  // This thread's chunks into row m of masked slab e (layout.h's offsets), with their scales.
  auto store_masked_row = [&](size_t e, size_t m) {
#pragma unroll
    for (int i = 0; i < kQuantRounds; ++i) {
      const int c = chunk[i];
      if (c < 0) continue;
      store_chunk(a.recv_x + (e * a.max_m + m) * a.hidden, c, out[i], a.mxfp4_k_order);
      if ((c & 7) == 0) a.recv_scales[(e * (a.hidden / kQuantBlock) + (c >> 3)) * a.max_m + m] = scale[i];
    }
  };
  // This thread's chunks into row r of the contiguous layout (scales K-major over max_rows).
  auto store_contiguous_row = [&](size_t r) {
#pragma unroll
    for (int i = 0; i < kQuantRounds; ++i) {
      const int c = chunk[i];
      if (c < 0) continue;
      store_chunk(a.recv_x + r * a.hidden, c, out[i], a.mxfp4_k_order);
      if ((c & 7) == 0) a.recv_scales[size_t(c >> 3) * a.max_rows + r] = scale[i];
    }
  };
  if (a.direct && place) {  // one rank: each valid entry's row of the layout
    for (int j = 0; j < a.topk; ++j) {
      const int code = p.entry_code[j];
      if (code < 0) continue;
      if (seg) store_contiguous_row(size_t(seg[entry_expert(code)] + entry_pos(code)));
      else store_masked_row(size_t(entry_expert(code)), size_t(entry_pos(code)));
    }
  }
  for (int r = 0; r < (a.direct ? 0 : p.num_targets); ++r) {
    uint8_t* msg = p.target_msg[r];
#pragma unroll
    for (int i = 0; i < kQuantRounds; ++i) {
      const int c = chunk[i];
      if (c < 0) continue;
      store_chunk(msg, c, out[i], a.mxfp4_k_order);
      if ((c & 7) == 0) *reinterpret_cast<float*>(msg + a.msg_scale_off + (c >> 3) * 4) = scale[i];
    }
  }
  if (a.self_slab) store_masked_row(size_t(a.local_experts), size_t(t));  // the rank's own copy (EpConfig::self_slab)
}

// One rank in normal mode: the shared memory past the counters (the totals, their rank scratch and
// the segment table), in ints.
int direct_smem_ints(const EpArgs& a) {
  return a.direct && a.contiguous ? a.num_slots + a.num_ranks + 2 * (a.local_experts + 1) : 0;
}

// One rank in normal mode, after count_before: the step's rows per expert into tot (count_totals;
// E = num_slots for one rank), the segment table, and whether the rows fit max_rows (if not, the
// first CTA records the capacity fault as the receive would, and no row is placed). Every thread.
__device__ bool contiguous_table(const EpArgs& a, const int32_t* topk_idx, int num_tokens, int t_begin, unsigned step,
                                 const int* cnt_slot, int* tot, int* tot_rank, int* seg, int* pad_start) {
  count_totals(a, topk_idx, num_tokens, t_begin, step, cnt_slot, tot, tot_rank);
  contiguous_segments(a, tot, seg, pad_start);
  const int total_rows = seg[a.local_experts];
  const bool fits = total_rows <= a.max_rows;
  if (!fits && blockIdx.x == 0 && threadIdx.x == 0)
    record_fault(a, EpErrorKind::kCapacity, kPhaseDispatchRecv, -1, step, -1, a.max_rows, total_rows);
  return fits;
}

__global__ void __launch_bounds__(kEpThreads) dispatch_send_kernel(EpArgs a, const uint16_t* x, const int32_t* topk_idx,
                                                                   const float* topk_weights, int num_tokens) {
  extern __shared__ int smem[];
  int* cnt_slot = smem;               // [num_slots]
  int* cnt_rank = smem + a.num_slots;  // [P]
  // One rank in normal mode (direct_smem_ints): the step's totals and the contiguous layout's table.
  const bool direct_contiguous = a.direct && a.contiguous;
  int* tot = cnt_rank + a.num_ranks;  // [num_slots] = [E] (one rank)
  int* tot_rank = tot + a.num_slots;  // [P]
  int* seg = tot_rank + a.num_ranks;  // [E + 1]
  int* pad_start = seg + a.local_experts + 1;  // [E + 1]
  bool place = true;  // one rank in normal mode: the step's rows fit max_rows
  __shared__ TokenPlan plans[kBatchTokens];
  __shared__ float warp_amax[kEpThreads / 32];  // token_amax's, per token
  begin_ep_kernel(a, kPhaseDispatchSend);
  if (a.self_slab && blockIdx.x == 0 && threadIdx.x == 0) a.recv_count[a.local_experts] = num_tokens;
  const unsigned step = current_step(a, kPhaseDispatchSend);
  const int parity = int(step) & a.parity_mask;
  const int t_begin = int(int64_t(num_tokens) * blockIdx.x / gridDim.x);
  const int t_end = int(int64_t(num_tokens) * (blockIdx.x + 1) / gridDim.x);

  // Tokens are planned and copied a batch at a time; the first x block of each team's first token
  // and the batch's routing are in flight while the counts before the CTA's range are made.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = kEpThreads / 32;
  const int num_chunks = a.hidden / 16, per_batch = plan_tokens_per_warp(a.topk) * num_warps;
  for (int b0 = t_begin; b0 < t_end; b0 += per_batch) {
    const int n = t_end - b0 < per_batch ? t_end - b0 : per_batch;
    const int team_warps = num_warps / (n < num_warps ? n : num_warps), teams = num_warps / team_warps;
    const Team team{(warp % team_warps) * 32 + lane, team_warps * 32};
    const int block_chunks = kQuantRounds * team.threads;
    int i = warp / team_warps, c_base = 0;
    XBlock cur;
    float token_scale = 0.0f;  // per token: the scale of token b0 + i, made when its first block is sent
    if (i < n) load_x(a, x, b0 + i, 0, team, cur);
    const BatchEntry entry = load_batch_entry(a, topk_idx, topk_weights, b0, n);
    if (b0 == t_begin) {
      count_before(a, topk_idx, num_tokens, t_begin, t_end, step, cnt_slot, cnt_rank);
      if (direct_contiguous) place = contiguous_table(a, topk_idx, num_tokens, t_begin, step, cnt_slot, tot, tot_rank,
                                                      seg, pad_start);
    }
    plan_batch(a, entry, b0, n, parity, step, cnt_slot, cnt_rank, plans);
    __syncthreads();
    while (i < n) {
      const TokenPlan& p = plans[i];
      if (a.direct && c_base == 0 && team.tt < a.topk) {
        // One rank: the combine's map of token t (item t: every token is an item, those without
        // an expert have no rows) and each row's source, as dispatch_recv writes them.
        const int t = b0 + i, j = team.tt, code = place ? p.entry_code[j] : -1;
        const int e = entry_expert(code), pos = entry_pos(code);
        const int row = code < 0 ? -1 : direct_contiguous ? seg[e] + pos : e * a.max_m + pos;
        a.map_rows[size_t(t) * a.topk + j] = row;
        a.map_w[size_t(t) * a.topk + j] = p.entry_w[j];
        if (j == 0) a.map_token[t] = t;
        if (row >= 0) a.recv_src[row] = t;
        if (row >= 0 && direct_contiguous) a.row_expert[row] = e;
      }
      if (!a.direct && c_base == 0 && team.tt < p.num_targets) {
        const int r = p.target_rank[team.tt];
        int* meta = reinterpret_cast<int*>(p.target_msg[team.tt] + a.msg_meta_off);
        float* wts = reinterpret_cast<float*>(meta + 1 + a.topk);
        meta[0] = b0 + i;
        for (int j = 0; j < a.topk; ++j) {
          const bool here = p.entry_rank[j] == r;
          meta[1 + j] = here ? p.entry_code[j] : -1;
          wts[j] = here ? p.entry_w[j] : 0.0f;
        }
      }
      int next_i = i, next_c = c_base + block_chunks;  // the block after this one, loaded before this one is sent
      if (next_c >= num_chunks) {
        next_c = 0;
        next_i += teams;
      }
      XBlock next;
      if (next_i < n) load_x(a, x, b0 + next_i, next_c, team, next);
      if (a.token_scales && c_base == 0)
        token_scale = fp8_group_scale(token_amax(a, x, b0 + i, team, warp / team_warps, warp_amax));
      quantize_and_send(a, cur, b0 + i, c_base, team, step, p, token_scale, direct_contiguous ? seg : nullptr, place);
      cur = next;
      i = next_i;
      c_base = next_c;
    }
    __syncthreads();  // the next batch rewrites the plans
  }
  if (t_begin == t_end) {
    count_before(a, topk_idx, num_tokens, t_begin, t_end, step, cnt_slot, cnt_rank);
    if (direct_contiguous)
      place = contiguous_table(a, topk_idx, num_tokens, t_begin, step, cnt_slot, tot, tot_rank, seg, pad_start);
  }

  // The CTA with the last tokens now holds the whole batch's counts: it writes each peer's
  // per-expert counts into that peer's inbox header (covered by its system fence in finish_cta,
  // like its payload) and the message counts for the last CTA, which raises the flags.
  const int E = a.local_experts;
  if (a.direct) {  // one rank: its counts are recv_count, and every token is a combine item
    if (direct_contiguous) fill_unplaced_rows(a, seg, tot, pad_start, place);
    if (blockIdx.x == gridDim.x - 1) {
      for (int e = threadIdx.x; e < E; e += blockDim.x) a.recv_count[e] = cnt_slot[e];
      if (threadIdx.x == 0) a.recv_msgs[0] = place ? num_tokens : 0;
      if (direct_contiguous && threadIdx.x == 0) *a.total_rows = place ? seg[E] : 0;
    }
    if (finish_cta(a, kPhaseDispatchSend, false) && threadIdx.x == 0) {
      a.ctr->num_tokens = num_tokens;
      advance_step(a, kPhaseDispatchSend, step);
    }
    return;
  }
  if (blockIdx.x == gridDim.x - 1) {
    for (int i = threadIdx.x; i < a.num_ranks * E; i += blockDim.x) {
      const int r = i / E, e = i % E;
      reinterpret_cast<int*>(a.dispatch_outbox(parity, r) + kEpFlagBytes)[e] = cnt_slot[i];
    }
    for (int r = threadIdx.x; r < a.num_ranks; r += blockDim.x) a.send_msgs[r] = cnt_rank[r];
  }
  if (finish_cta(a, kPhaseDispatchSend, true)) {
    for (int r = threadIdx.x; r < a.num_ranks; r += blockDim.x)
      st_release_sys(reinterpret_cast<uint64_t*>(a.dispatch_outbox(parity, r)),
                     uint64_t(step) << 32 | uint32_t(__ldcg(a.send_msgs + r)));
    if (threadIdx.x == 0) {
      a.ctr->num_tokens = num_tokens;
      advance_step(a, kPhaseDispatchSend, step);
    }
  }
}

}  // namespace

int dispatch_send_resident_ctas(const EpArgs& args, int num_sms) {
  int per_sm = 0;
  const size_t smem = sizeof(int) * size_t(args.num_slots + args.num_ranks + direct_smem_ints(args));
  MOEKIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dispatch_send_kernel, kEpThreads, smem));
  return per_sm * num_sms;
}

void launch_dispatch_send(const EpArgs& args, const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
                          int num_tokens, int num_ctas, cudaStream_t stream) {
  const int grid = num_tokens < 1 ? 1 : (num_tokens < num_ctas ? num_tokens : num_ctas);
  const size_t smem = sizeof(int) * size_t(args.num_slots + args.num_ranks + direct_smem_ints(args));
  launch_kernel_ex(dispatch_send_kernel, dim3(grid), dim3(kEpThreads), smem, stream, args.pdl != 0, args, x, topk_idx,
                   topk_weights, num_tokens);
}

}  // namespace moekit::gpu
