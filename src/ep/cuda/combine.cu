// The combine kernels (both modes), and one rank's combine in one kernel (combine_local).
//
// combine_send: for each message this rank received (the map dispatch_recv wrote), the weighted
// sum of its local experts' output rows in top-k order, in fp32 with explicit round-to-nearest
// multiply and add (no FMA contraction, so the bits match the CPU reference's `acc += w * y`),
// rounded once to bf16 and written into the source's combine inbox at the source token's row;
// the last CTA raises a flag at every peer (also those that sent nothing, which still wait).
// combine_recv: waits for all P flags and writes out[t] = bf16(add[t] + partial[r0][t] + ...) over
// the token's target ranks in ascending order, in fp32: a fixed order, so the result is
// deterministic and equal to the reference's.
//
// At decode sizes both are bound by round trips to memory, not by bytes: each thread loads
// every row (send) or every rank's partial (receive) of its chunks before the first add, in
// registers, and the adds then run in the fixed order.
//
// Beside the GEMM (y_ready, ep.h): the send starts while the GEMM that writes y still runs (the
// GEMM triggers its dependents at its start, gemm.h set_early_trigger), on the SMs the GEMM's
// CTAs leave as they finish. A warp waits for each message's experts' counters (acquire) and
// reads their rows from the L2 (the non-coherent path could hold lines from before the GEMM's
// stores); every CTA then waits for the GEMM's grid before it signs off, so the flags, and
// whatever comes after this kernel on the stream, find all of y stored. The last CTA zeroes the
// counters for the next step.
#include <cuda_runtime.h>

#include <algorithm>

#include "ep_device.cuh"
#include "kernels/cuda/launch.cuh"
#include "moekit/bf16.h"
#include "moekit/cuda_check.h"

namespace moekit::gpu {
namespace {

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t(float_to_bf16(lo)) | uint32_t(float_to_bf16(hi)) << 16;
}
__device__ __forceinline__ void unpack8(const uint4 v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = bf16_lo(w[i]);
    f[2 * i + 1] = bf16_hi(w[i]);
  }
}
__device__ __forceinline__ uint4 pack8(const float* f) {
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]), pack_bf16x2(f[6], f[7]));
}
// The combine's two operations on a chunk of 8 bf16, the only places they are spelled, so that
// every path (the send, the receive, one rank's single kernel) does them the same way:
// a partial's row term, acc + w * y (an IEEE-rounded multiply, then an add: no FMA contraction,
// the CPU reference's `acc += w * y`), and the receive's add of a bf16 partial.
__device__ __forceinline__ void add_weighted8(float (&acc)[8], float w, const uint4 y8) {
  float f[8];
  unpack8(y8, f);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, f[e]));
}
__device__ __forceinline__ void add8(float (&acc)[8], const uint4 part8) {
  float f[8];
  unpack8(part8, f);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], f[e]);
}

// combine_send's work item: one message's weighted sum over a slice of 32 * kSendChunks chunks
// (8 bf16 each). Items are dealt to warps in contiguous runs of equal length, so every warp has
// the same number of slices whatever the messages' row counts, and a warp reloads a message's map
// only when its run crosses into the next message. Up to kSendRows rows are loaded before any is
// added, so a typical message (1-2 local rows) costs one round trip per slice.
constexpr int kSendChunks = 4;
constexpr int kSendRows = 4;

// A warp's part of one weighted sum: acc[u] + w * y[row] for its chunks c0 + 32u (< num_chunks)
// over the rows in `rows` (a ballot: lane j < k holds entry j's row and weight), in top-k order,
// the reference's operations and order. Up to kSendRows rows' chunks are loaded before any is
// added. kL2: y is read through the L2 (it is being written beside this kernel; the non-coherent
// path could hold lines from before those stores). Every lane must call it (the shuffles).
template <bool kL2>
__device__ __forceinline__ void add_rows(const EpArgs& a, const uint16_t* y, unsigned rows, int my_row, float my_w,
                                         int c0, int num_chunks, float (&acc)[kSendChunks][8]) {
  for (unsigned left = rows; left;) {
    int row[kSendRows];
    float w[kSendRows];
    int n = 0;
#pragma unroll
    for (int q = 0; q < kSendRows; ++q) {
      row[q] = 0;
      w[q] = 0.0f;
      if (left) {  // warp-uniform
        const int from = __ffs(left) - 1;
        left &= left - 1;
        row[q] = __shfl_sync(0xFFFFFFFFu, my_row, from);
        w[q] = __shfl_sync(0xFFFFFFFFu, my_w, from);
        n = q + 1;
      }
    }
    uint4 v[kSendRows][kSendChunks];
#pragma unroll
    for (int q = 0; q < kSendRows; ++q) {
      const uint4* yr = reinterpret_cast<const uint4*>(y + size_t(row[q]) * a.hidden);
#pragma unroll
      for (int u = 0; u < kSendChunks; ++u)
        if (q < n && c0 + 32 * u < num_chunks) v[q][u] = kL2 ? __ldcg(yr + c0 + 32 * u) : __ldg(yr + c0 + 32 * u);
    }
#pragma unroll
    for (int q = 0; q < kSendRows; ++q) {
      if (q >= n) continue;
#pragma unroll
      for (int u = 0; u < kSendChunks; ++u)
        if (c0 + 32 * u < num_chunks) add_weighted8(acc[u], w[q], v[q][u]);
    }
  }
}

// Beside the GEMM: lane i < k with a row waits until its expert's counter shows all of the
// expert's rows stored (the GEMM's ready_out units, gemm.h: hidden / 64 per row, for the
// recv_count the GEMM itself clamps to [0, M_max]); the warp barrier then passes the acquire on
// to the lanes that load the rows. A counter that never gets there (a GEMM not paired with this
// kernel) is recorded as this rank's timeout, naming the expert, and the wait ends. The sleep
// between polls doubles up to 512 ns: a thousand waiting warps polling the same L2 line every
// few tens of nanoseconds would load the slice the GEMM streams through.
__device__ __forceinline__ void wait_rows(const EpArgs& a, const int32_t* y_ready, int row, unsigned step) {
  if (row >= 0) {
    const int e = row / a.max_m;
    const int target = (a.hidden / 64) * min(max(__ldcg(a.recv_count + e), 0), a.max_m);
    timed_wait(a, kPhaseCombineSend, a.rank, step, e, target, 32, 512,
               [&] { return ptx::ld_acquire_gpu(y_ready + e) >= target; });
  }
  __syncwarp();
}

template <bool kBeside>
__global__ void __launch_bounds__(kEpThreads) combine_send_kernel(EpArgs a, const uint16_t* __restrict__ y,
                                                                  int32_t* y_ready) {
  extern __shared__ int smem[];
  int* src_start = smem;  // [P + 1]
  const int P = a.num_ranks, k = a.topk;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if constexpr (kBeside) {  // no wait here: the receive that wrote the map has completed (ep.h)
    if (threadIdx.x == 0 && a.stamps) stamp_start(a.stamps + 2 * kPhaseCombineSend);
  } else {
    begin_ep_kernel(a, kPhaseCombineSend);
  }
  const unsigned step = current_step(a, kPhaseCombineSend);
  const int parity = int(step) & a.parity_mask;
  if (warp == 0) warp_prefix(src_start, P, [&](int s) { return __ldcg(a.recv_msgs + s); });
  __syncthreads();
  const int num_msgs = src_start[P], num_chunks = a.hidden / 8;
  const int slices = (num_chunks + 32 * kSendChunks - 1) / (32 * kSendChunks);
  const int64_t items = int64_t(num_msgs) * slices, num_warps = int64_t(gridDim.x) * warps;
  const int64_t gw = int64_t(blockIdx.x) * warps + warp;
  // Beside the GEMM the items are claimed one by one from a counter instead: the CTAs that find an
  // SM while the GEMM still runs take them all, those that start after it find none left. (The
  // claim of the next item is issued before this one's loads, so its round trip hides under them.)
  auto claim = [&]() { return lane == 0 ? atomicAdd(&a.ctr->send_claims, 1u) : 0u; };
  unsigned claimed = kBeside ? claim() : 0u;
  int64_t it = kBeside ? int64_t(__shfl_sync(0xFFFFFFFFu, claimed, 0)) : gw * items / num_warps;
  const int64_t item_end = kBeside ? items : (gw + 1) * items / num_warps;
  int cur = -1;         // the message whose map the lanes hold
  int my_row = -1;      // lane i < k: entry i's row in y (-1: none)
  float my_w = 0.0f;    // and its top-k weight
  unsigned rows = 0;    // lanes with a row, in top-k order
  uint4* dst = nullptr;
  for (; it < item_end; it = kBeside ? int64_t(__shfl_sync(0xFFFFFFFFu, claimed, 0)) : it + 1) {
    if constexpr (kBeside) claimed = claim();
    const int g = int(it / slices), slice = int(it % slices);
    if (g != cur) {
      cur = g;
      const int s = segment_of(src_start, P, g);
      const size_t item = size_t(s) * a.max_tokens + (g - src_start[s]);
      my_row = lane < k ? __ldcg(a.map_rows + item * k + lane) : -1;
      my_w = lane < k ? __ldcg(a.map_w + item * k + lane) : 0.0f;
      const int token = __ldcg(a.map_token + item);
      rows = __ballot_sync(0xFFFFFFFFu, my_row >= 0);
      if constexpr (kBeside) wait_rows(a, y_ready, my_row, step);
      dst = reinterpret_cast<uint4*>(a.combine_outbox(parity, s) + kEpFlagBytes + size_t(token) * a.hidden * 2);
    }
    const int c0 = slice * 32 * kSendChunks + lane;
    // acc = 0, then acc + w * y row by row in top-k order: the reference's operations and order.
    float acc[kSendChunks][8] = {};
    add_rows<kBeside>(a, y, rows, my_row, my_w, c0, num_chunks, acc);
#pragma unroll
    for (int u = 0; u < kSendChunks; ++u)
      if (c0 + 32 * u < num_chunks) dst[c0 + 32 * u] = pack8(acc[u]);
  }
  if constexpr (kBeside) ptx::grid_dependency_wait();  // the GEMM's grid: all of y is stored
  if (finish_cta(a, kPhaseCombineSend, true)) {
    if constexpr (kBeside) {
      for (int e = threadIdx.x; e < a.local_experts + a.self_slab; e += blockDim.x) y_ready[e] = 0;
      if (threadIdx.x == 0) a.ctr->send_claims = 0;
    }
    for (int s = threadIdx.x; s < P; s += blockDim.x)
      st_release_sys(reinterpret_cast<uint64_t*>(a.combine_outbox(parity, s)), uint64_t(step) << 32);
    if (threadIdx.x == 0) advance_step(a, kPhaseCombineSend, step);
  }
  if constexpr (kBeside) ptx::launch_dependents();  // (after this kernel's own wait: the chain's rule)
}

// combine_recv: one CTA per (token, slice of its columns); each thread holds up to kRecvChunks
// chunks of its slice (a whole 8192-wide token in one pass at 256 threads) and loads kRecvRanks
// ranks' partials of them before adding any, so a slice with up to 8 target ranks costs one round
// trip. With fewer tokens than CTAs a token is cut into `slices` (up to one chunk per thread
// each), so that its 8 partials do not all funnel into one SM (a 7168-wide token's ~130 KB took
// ~2 us of one SM's intake at decode sizes). The adds stay in ascending rank order, whatever the
// slicing: the same bits.
constexpr int kRecvChunks = 4;
constexpr int kRecvRanks = 8;

// combine_recv with more tokens than CTAs (prefill sizes): a CTA per token would walk its tokens
// one after another, each a chain of two round trips and two barriers (gpt-oss-120b's 8192 tokens
// on 132 CTAs: 62 in a row). Instead every warp takes (token, pass) items on its own, as
// combine_local_kernel does: `team` warps share a token's passes of 32 x kRecvChunks chunks when
// there are warps to spare, the token's target ranks come from its lanes < k by shuffles, and up
// to kWarpRanks ranks' chunks are loaded before any is added. The adds are the CTA path's, in the
// same order (add, then the partials in ascending rank order): the same bits.
constexpr int kWarpRanks = 4;
// The warps per token when a step's tokens are dealt to warps as (token, pass) items, the item
// index walking over the CTAs first: a token's `passes` go to that many warps while the grid has
// warps to spare, else one warp walks them all (combine_recv_warps and combine_local_kernel).
__device__ __forceinline__ int token_team(int passes, int num_tokens) {
  return max(1, min(passes, int(gridDim.x * (blockDim.x >> 5)) / max(num_tokens, 1)));
}
__device__ __forceinline__ void combine_recv_warps(const EpArgs& a, const uint16_t* add, uint16_t* out, int parity,
                                                   int num_tokens, int num_chunks) {
  const int k = a.topk, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  constexpr int kPass = 32 * kRecvChunks;
  const int team = token_team((num_chunks + kPass - 1) / kPass, num_tokens), all_warps = gridDim.x * warps;
  for (int item = blockIdx.x + (threadIdx.x >> 5) * gridDim.x; item < num_tokens * team; item += all_warps) {
    const int t = item / team, first_pass = item - t * team;
    const int r = lane < k ? __ldcg(a.route_ranks + size_t(t) * k + lane) : -1;
    const unsigned have = __ballot_sync(0xFFFFFFFFu, r >= 0);
    const int n = ~have == 0 ? 32 : __ffs(~have) - 1;  // the ranks before the first -1
    for (int pass0 = first_pass * kPass; pass0 < num_chunks; pass0 += team * kPass) {
      const int c0 = pass0 + lane;
      float acc[kRecvChunks][8] = {};
      if (add) {
#pragma unroll
        for (int u = 0; u < kRecvChunks; ++u) {
          const int c = c0 + 32 * u;
          if (c < num_chunks) unpack8(reinterpret_cast<const uint4*>(add + size_t(t) * a.hidden)[c], acc[u]);
        }
      }
      for (int i = 0; i < n; i += kWarpRanks) {  // warp-uniform (the shuffles need every lane)
        uint4 part[kWarpRanks][kRecvChunks];
#pragma unroll
        for (int q = 0; q < kWarpRanks; ++q) {
          const int rank = __shfl_sync(0xFFFFFFFFu, r, (i + q) & 31);
          if (i + q >= n) continue;
          const uint4* src = reinterpret_cast<const uint4*>(a.combine_inbox(parity, rank) + kEpFlagBytes +
                                                            size_t(t) * a.hidden * 2);
#pragma unroll
          for (int u = 0; u < kRecvChunks; ++u)
            if (c0 + 32 * u < num_chunks) part[q][u] = __ldcg(src + c0 + 32 * u);
        }
#pragma unroll
        for (int q = 0; q < kWarpRanks; ++q) {
          if (i + q >= n) continue;
#pragma unroll
          for (int u = 0; u < kRecvChunks; ++u)
            if (c0 + 32 * u < num_chunks) add8(acc[u], part[q][u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kRecvChunks; ++u) {
        const int c = c0 + 32 * u;
        if (c < num_chunks) reinterpret_cast<uint4*>(out + size_t(t) * a.out_cols)[c] = pack8(acc[u]);
      }
    }
  }
}

__global__ void __launch_bounds__(kEpThreads) combine_recv_kernel(EpArgs a, const uint16_t* add, uint16_t* out,
                                                                  int slices) {
  __shared__ int ok;
  __shared__ int ranks[kEpMaxTopk];
  __shared__ int token_ranks;
  const int P = a.num_ranks, k = a.topk;
  begin_ep_kernel(a, kPhaseCombineRecv);
  const unsigned step = current_step(a, kPhaseCombineRecv);
  const int parity = int(step) & a.parity_mask;
  // The token count and the first token's target ranks come from this rank's own dispatch send,
  // complete before this kernel's wait: loaded here, their round trips overlap the flags' instead
  // of following them (at decode sizes the receive is a chain of round trips).
  const int sent_tokens = __ldcg(&a.ctr->num_tokens);
  const int first_route = threadIdx.x < k ? __ldcg(a.route_ranks + size_t(blockIdx.x / slices) * k + threadIdx.x) : -1;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int r = threadIdx.x; r < P; r += blockDim.x)
    if (wait_flag(a, reinterpret_cast<const uint64_t*>(a.combine_inbox(parity, r)), step, kPhaseCombineRecv, r) == 0)
      ok = 0;
  __syncthreads();
  // Columns past out_cols (<= hidden, EpBuffer::combine_recv; a padded hidden size) are never
  // stored, so neither path reads them.
  const int num_tokens = ok ? sent_tokens : 0, num_chunks = a.out_cols / 8;
  // More tokens than CTAs: the warps' path; else (decode sizes) a CTA per (token, slice). Every CTA
  // read the same count, so they all choose alike (a CTA whose flag wait timed out has no tokens).
  const bool by_warps = num_tokens > int(gridDim.x);
  if (by_warps) combine_recv_warps(a, add, out, parity, num_tokens, num_chunks);
  const int slice_chunks = (num_chunks + slices - 1) / slices;
  for (int item = blockIdx.x; item < (by_warps ? 0 : num_tokens) * slices; item += gridDim.x) {
    const int t = item / slices, first = item % slices * slice_chunks;
    const int last = min(first + slice_chunks, num_chunks);
    if (threadIdx.x < 32) {
      // The token's target ranks, ascending, -1 padded: the partials to add are those before
      // the first -1.
      const int lane = threadIdx.x;
      const int r = item == int(blockIdx.x) ? first_route : lane < k ? a.route_ranks[size_t(t) * k + lane] : -1;
      const unsigned have = __ballot_sync(0xFFFFFFFFu, r >= 0);
      if (lane < k) ranks[lane] = r;
      if (lane == 0) token_ranks = ~have == 0 ? 32 : __ffs(~have) - 1;
    }
    __syncthreads();
    const int n = token_ranks;
    for (int c_base = first; c_base < last; c_base += kRecvChunks * blockDim.x) {
      float acc[kRecvChunks][8] = {};
      if (add) {
#pragma unroll
        for (int u = 0; u < kRecvChunks; ++u) {
          const int c = c_base + u * blockDim.x + threadIdx.x;
          if (c < last) unpack8(reinterpret_cast<const uint4*>(add + size_t(t) * a.hidden)[c], acc[u]);  // add may be out
        }
      }
      for (int i = 0; i < n; i += kRecvRanks) {
        uint4 part[kRecvRanks][kRecvChunks];
#pragma unroll
        for (int q = 0; q < kRecvRanks; ++q) {
          if (i + q >= n) continue;
          const uint4* src = reinterpret_cast<const uint4*>(a.combine_inbox(parity, ranks[i + q]) + kEpFlagBytes +
                                                            size_t(t) * a.hidden * 2);
#pragma unroll
          for (int u = 0; u < kRecvChunks; ++u) {
            const int c = c_base + u * blockDim.x + threadIdx.x;
            if (c < last) part[q][u] = __ldcg(src + c);
          }
        }
#pragma unroll
        for (int q = 0; q < kRecvRanks; ++q) {
          if (i + q >= n) continue;
#pragma unroll
          for (int u = 0; u < kRecvChunks; ++u) {
            const int c = c_base + u * blockDim.x + threadIdx.x;
            if (c < last) add8(acc[u], part[q][u]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kRecvChunks; ++u) {
        const int c = c_base + u * blockDim.x + threadIdx.x;
        if (c < last) reinterpret_cast<uint4*>(out + size_t(t) * a.out_cols)[c] = pack8(acc[u]);
      }
    }
    __syncthreads();
  }
  if (finish_cta(a, kPhaseCombineRecv, false) && threadIdx.x == 0) advance_step(a, kPhaseCombineRecv, step);
}

// One rank (EpArgs::direct, after a combine_send that launched nothing): no inbox and no flag;
// out[t] = bf16(add[t] + bf16(sum)) with sum made here from y with combine_send's operations in its
// order (0, then + w * y row by row in top-k order, one bf16 rounding), the two kernels' bits. The
// work items are (token, part): a token's first out_cols columns in passes of 32 x kSendChunks
// chunks (8 bf16 each), a warp per item, items dealt over the CTAs first. With few tokens a token's
// passes go to `team` warps side by side; with many, one warp walks them all, and every token of
// the step is in flight at once (a CTA per token walked 1024 tokens as eight rounds of two dependent
// round trips each). Every row's chunks of a pass are loaded (up to kSendRows rows at a time) before
// any is added. The rows and weights come from the map the send wrote in either mode (item t =
// token t; a token with no expert has no rows and is written as add alone, or 0).
__global__ void __launch_bounds__(kEpThreads) combine_local_kernel(EpArgs a, const uint16_t* add, uint16_t* out,
                                                                   const uint16_t* __restrict__ y) {
  begin_ep_kernel(a, kPhaseCombineRecv);
  const unsigned step = current_step(a, kPhaseCombineRecv);
  const int k = a.topk, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int num_tokens = __ldcg(a.recv_msgs), out_chunks = a.out_cols / 8;  // every token is an item
  constexpr int kPass = 32 * kSendChunks;
  const int team = token_team((out_chunks + kPass - 1) / kPass, num_tokens), all_warps = gridDim.x * warps;
  for (int item = blockIdx.x + (threadIdx.x >> 5) * gridDim.x; item < num_tokens * team; item += all_warps) {
    const int t = item / team, first_pass = item - t * team;
    const int my_row = lane < k ? __ldcg(a.map_rows + size_t(t) * k + lane) : -1;
    const float my_w = lane < k ? __ldcg(a.map_w + size_t(t) * k + lane) : 0.0f;
    const unsigned rows = __ballot_sync(0xFFFFFFFFu, my_row >= 0);
    // The pass loop is warp-uniform (the shuffles below need every lane); a lane's chunks past
    // the row are skipped one by one.
    for (int pass0 = first_pass * kPass; pass0 < out_chunks; pass0 += team * kPass) {
      const int c0 = pass0 + lane;
      float acc[kSendChunks][8] = {}, part[kSendChunks][8] = {};
      if (add) {
#pragma unroll
        for (int u = 0; u < kSendChunks; ++u) {
          const int c = c0 + 32 * u;
          if (c < out_chunks) unpack8(reinterpret_cast<const uint4*>(add + size_t(t) * a.hidden)[c], acc[u]);
        }
      }
      add_rows<false>(a, y, rows, my_row, my_w, c0, out_chunks, part);
#pragma unroll
      for (int u = 0; u < kSendChunks; ++u) {
        const int c = c0 + 32 * u;
        if (c >= out_chunks) continue;
        if (rows) add8(acc[u], pack8(part[u]));  // the sum rounded once to bf16; no expert: add alone
        reinterpret_cast<uint4*>(out + size_t(t) * a.out_cols)[c] = pack8(acc[u]);
      }
    }
  }
  if (finish_cta(a, kPhaseCombineRecv, false) && threadIdx.x == 0) {
    advance_step(a, kPhaseCombineRecv, step);
    // This kernel stands for both phases: the send's step moves on with the receive's, so that a
    // later step's two-kernel combine (combine_send with y_ready) raises and waits for one flag.
    a.ctr->step[kPhaseCombineSend] += 1;
  }
}

}  // namespace

void launch_combine_send(const EpArgs& args, const uint16_t* y, int32_t* y_ready, int num_ctas, cudaStream_t stream) {
  launch_kernel_ex(y_ready ? combine_send_kernel<true> : combine_send_kernel<false>, dim3(num_ctas), dim3(kEpThreads),
                   sizeof(int) * (args.num_ranks + 1), stream, args.pdl != 0, args, y, y_ready);
}

void launch_combine_recv(const EpArgs& args, const uint16_t* add, uint16_t* out, int num_ctas, int max_tokens,
                         const uint16_t* y, cudaStream_t stream) {
  if (y) {  // one rank: a warp per token, tokens over the CTAs first
    const int grid = std::max(1, std::min(num_ctas, max_tokens));
    launch_kernel_ex(combine_local_kernel, dim3(grid), dim3(kEpThreads), 0, stream, args.pdl != 0, args, add, out, y);
    return;
  }
  // Slices per token: as many as the grid has CTAs per token, at most one chunk per thread each.
  const int num_chunks = args.hidden / 8;
  const int max_slices = (num_chunks + kEpThreads - 1) / kEpThreads;
  const int slices = std::max(1, std::min(max_slices, num_ctas / std::max(max_tokens, 1)));
  const int grid = std::min(num_ctas, max_tokens * slices);
  launch_kernel_ex(combine_recv_kernel, dim3(grid), dim3(kEpThreads), 0, stream, args.pdl != 0, args, add, out,
                   slices);
}

}  // namespace moekit::gpu
