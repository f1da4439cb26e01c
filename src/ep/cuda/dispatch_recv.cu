// The dispatch receive kernels (the hook): wait for every source's flag, then expand the
// messages into the masked layout (low-latency) or the contiguous layout (normal).
//
// Every CTA waits on all P flags (one thread per source, acquire loads, clock64 timeout) and
// builds the same small table in shared memory from the per-expert counts in the inbox
// headers: base[e][s] = rows of local expert e from sources < s (the canonical order of
// layout.h: by source rank, then source token) and, for the contiguous layout, the padded
// segment starts. A row's index is then base + the position the sender computed, so the
// copies need no atomics and no scan, and any warp may copy any message.
//
// With rows_ready (ep.h) the receive also hands its rows to a GEMM that runs beside it: CTA 0
// publishes recv_count as soon as the table is built, and every message's rows are released to
// their experts' counters once stored; a CTA that times out raises the abort bit instead.
//
// One warp per message, messages dealt round-robin over the CTAs first (so every SM copies).
// At decode sizes this is latency-bound, so a warp keeps a whole message in flight: it loads its
// first message (payload, scales, metadata) before the table is built, and at most one further
// round trip per 8 KiB of payload follows. (Loading the next message while writing the current
// one out was measured: no faster at 4096 tokens per rank, at 184 registers instead of 116.)
#include <cuda_runtime.h>

#include "contiguous.cuh"
#include "ep_device.cuh"
#include "kernels/cuda/launch.cuh"
#include "moekit/cuda_check.h"
#include "moekit/gemm.h"

namespace moekit::gpu {
namespace {

constexpr int kRecvChunks = 16;  // 16-byte payload chunks per lane in flight: 8 KiB per warp
constexpr int kRecvScales = 2;   // scales per lane in flight: 64 per warp (d <= 8192)

// What a warp holds of one message: the first 32 * kRecvChunks chunks of the payload, the first
// 32 * kRecvScales scales, the source token and (lane j < k) top-k entry j's code and weight.
struct MsgLoad {
  uint4 v[kRecvChunks];
  float sc[kRecvScales];
  int token, code;
  float w;
};

__device__ __forceinline__ const uint8_t* message_at(const EpArgs& a, int parity, int s, int j) {
  return a.dispatch_inbox(parity, s) + a.dispatch_header_bytes + size_t(j) * a.msg_bytes;
}

__device__ __forceinline__ void load_chunks(const uint8_t* msg, int c0, int num_chunks, uint4* v) {
  const int lane = threadIdx.x & 31;
  const uint4* src = reinterpret_cast<const uint4*>(msg);
#pragma unroll
  for (int u = 0; u < kRecvChunks; ++u) {
    const int c = c0 + lane + 32 * u;
    if (c < num_chunks) v[u] = __ldcg(src + c);
  }
}
__device__ __forceinline__ void load_scales(const EpArgs& a, const uint8_t* msg, int kb0, int kb_count, float* sc) {
  const int lane = threadIdx.x & 31;
  const float* scales = reinterpret_cast<const float*>(msg + a.msg_scale_off);
#pragma unroll
  for (int u = 0; u < kRecvScales; ++u) {
    const int kb = kb0 + lane + 32 * u;
    if (kb < kb_count) sc[u] = __ldcg(scales + kb);
  }
}

__device__ __forceinline__ void load_message(const EpArgs& a, const uint8_t* msg, MsgLoad& m) {
  const int lane = threadIdx.x & 31, k = a.topk;
  load_chunks(msg, 0, a.hidden / 16, m.v);
  load_scales(a, msg, 0, a.hidden / kQuantBlock, m.sc);
  const int* meta = reinterpret_cast<const int*>(msg + a.msg_meta_off);
  m.token = __ldcg(meta);
  m.code = lane < k ? __ldcg(meta + 1 + lane) : -1;
  m.w = lane < k ? __ldcg(reinterpret_cast<const float*>(meta + 1 + k) + lane) : 0.0f;
}

// The hand-off to a GEMM running beside the receive (a.rows_ready, ep.h): by every thread of
// CTA 0 once recv_count is written; self_rows is thread 0's recv_count[E_loc] (the send's T).
// The barrier passes on the CTA's writes (and the acquire of this rank's own flag, behind which
// the send wrote the self slab); thread 0's one fence makes both adds releases: the self slab's
// rows count as landed at once, and the word the GEMM's schedule waits for is raised.
__device__ __forceinline__ void publish_recv_counts(const EpArgs& a, int self_rows) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int E = a.local_experts;
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  if (a.self_slab) atomicAdd(a.rows_ready + E, self_rows);
  atomicAdd(a.rows_ready + E + a.self_slab + 1, 1);
}

template <bool kContiguous>
__global__ void __launch_bounds__(kEpThreads) dispatch_recv_kernel(EpArgs a) {
  extern __shared__ int smem[];
  const int P = a.num_ranks, E = a.local_experts, k = a.topk;
  int* base = smem;                 // [E][P]
  int* src_start = base + E * P;    // [P + 1]: prefix of message counts
  int* seg = src_start + P + 1;     // [E + 1]: contiguous segment starts, seg[E] = M_total
  int* expert_rows = seg + E + 1;   // [E]: real rows per local expert
  int* pad_start = expert_rows + E; // [E + 1]: contiguous: prefix of padding rows per segment
  __shared__ int ok;

  begin_ep_kernel(a, kPhaseDispatchRecv);
  const unsigned step = current_step(a, kPhaseDispatchRecv);
  const int parity = int(step) & a.parity_mask;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int s = threadIdx.x; s < P; s += blockDim.x) {
    const uint64_t flag = wait_flag(a, reinterpret_cast<const uint64_t*>(a.dispatch_inbox(parity, s)), step,
                                    kPhaseDispatchRecv, s);
    if (flag == 0) ok = 0;
    src_start[s + 1] = int(uint32_t(flag));
  }
  __syncthreads();
  // A CTA that timed out will not count its messages' rows: it tells the GEMM to stop waiting
  // (gemm.h kRowsReadyAbort), whether or not CTA 0 saw every flag and published real counts.
  if (!kContiguous && a.rows_ready && !ok && threadIdx.x == 0)
    atomicOr(a.rows_ready + E + a.self_slab + 1, kRowsReadyAbort);
  // The self slab's count for the hand-off, loaded now so that its round trip overlaps the table's.
  const bool hand_off = !kContiguous && a.rows_ready && blockIdx.x == 0;
  const int self_rows = hand_off && a.self_slab && threadIdx.x == 0 ? __ldcg(a.recv_count + E) : 0;
  if (hand_off && !ok) {  // (ok is the same in all threads)
    for (int e = threadIdx.x; e < E; e += blockDim.x) a.recv_count[e] = 0;
    publish_recv_counts(a, self_rows);
  }

  if (ok) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (warp == 0) warp_prefix(src_start, P, [&](int s) { return src_start[s + 1]; });
    for (int i = threadIdx.x; i < E * P; i += blockDim.x) {
      const int s = i / E, e = i % E;
      base[e * P + s] = __ldcg(reinterpret_cast<const int*>(a.dispatch_inbox(parity, s) + kEpFlagBytes) + e);
    }
    __syncthreads();

    // This warp's first message is loaded while the table is built.
    const int msg_stride = gridDim.x * warps, first_msg = warp * gridDim.x + blockIdx.x;
    const int sent_msgs = src_start[P];
    MsgLoad ld;
    int g_src = 0;
    if (first_msg < sent_msgs) {
      g_src = segment_of(src_start, P, first_msg);
      load_message(a, message_at(a, parity, g_src, first_msg - src_start[g_src]), ld);
    }

    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      int acc = 0;
      for (int s = 0; s < P; ++s) {
        const int c = base[e * P + s];
        base[e * P + s] = acc;
        acc += c;
      }
      expert_rows[e] = acc;
    }
    __syncthreads();
    if (kContiguous) contiguous_segments(a, expert_rows, seg, pad_start);
    const int total_rows = kContiguous ? seg[E] : 0;
    const bool fits = !kContiguous || total_rows <= a.max_rows;
    if (!fits && threadIdx.x == 0 && blockIdx.x == 0)
      record_fault(a, EpErrorKind::kCapacity, kPhaseDispatchRecv, -1, step, -1, a.max_rows, total_rows);
    if (blockIdx.x == 0) {
      for (int e = threadIdx.x; e < E; e += blockDim.x) a.recv_count[e] = expert_rows[e];
      for (int s = threadIdx.x; s < P; s += blockDim.x) a.recv_msgs[s] = fits ? src_start[s + 1] - src_start[s] : 0;
      if (kContiguous && threadIdx.x == 0) *a.total_rows = fits ? total_rows : 0;
      if (hand_off) publish_recv_counts(a, self_rows);
    }

    // Rows that no message fills: padding inside a segment and the tail past M_total.
    if (kContiguous) fill_unplaced_rows(a, seg, expert_rows, pad_start, fits);

    const int num_msgs = fits ? sent_msgs : 0;
    const int kb_count = a.hidden / kQuantBlock, num_chunks = a.hidden / 16;
    for (int g = first_msg, s = g_src; g < num_msgs;) {
      const int j = g - src_start[s];
      const uint8_t* msg = message_at(a, parity, s, j);
      if (g != first_msg) load_message(a, msg, ld);
      const int g_next = g + msg_stride;
      const int s_next = g_next < num_msgs ? segment_of(src_start, P, g_next) : 0;
      const size_t item = size_t(s) * a.max_tokens + j;
      // Lane i < k: entry i's output row (-1: not on this rank), its expert and its position.
      int row = -1, e = 0, m = 0;
      if (ld.code >= 0) {
        e = entry_expert(ld.code);
        m = base[e * P + s] + entry_pos(ld.code);
        row = kContiguous ? seg[e] + m : e * a.max_m + m;
        if (kContiguous) a.row_expert[row] = e;
        a.recv_src[row] = s * a.max_tokens + ld.token;
      }
      if (lane == 0) a.map_token[item] = ld.token;
      if (lane < k) {
        a.map_rows[item * k + lane] = row;
        a.map_w[item * k + lane] = ld.w;
      }
      const unsigned rows = __ballot_sync(0xFFFFFFFFu, row >= 0);
      for (int c0 = 0; c0 < num_chunks; c0 += 32 * kRecvChunks) {
        if (c0 > 0) load_chunks(msg, c0, num_chunks, ld.v);
        for (unsigned left = rows; left; left &= left - 1) {
          const int r = __shfl_sync(0xFFFFFFFFu, row, __ffs(left) - 1);
          uint4* dst = reinterpret_cast<uint4*>(a.recv_x + size_t(r) * a.hidden);
#pragma unroll
          for (int u = 0; u < kRecvChunks; ++u) {
            const int c = c0 + lane + 32 * u;
            if (c < num_chunks) dst[c] = ld.v[u];
          }
        }
      }
      for (int kb0 = 0; kb0 < kb_count; kb0 += 32 * kRecvScales) {
        if (kb0 > 0) load_scales(a, msg, kb0, kb_count, ld.sc);
        for (unsigned left = rows; left; left &= left - 1) {
          const int from = __ffs(left) - 1;
          const int r = __shfl_sync(0xFFFFFFFFu, row, from);
          const int re = __shfl_sync(0xFFFFFFFFu, e, from), rm = __shfl_sync(0xFFFFFFFFu, m, from);
#pragma unroll
          for (int u = 0; u < kRecvScales; ++u) {
            const int kb = kb0 + lane + 32 * u;
            if (kb >= kb_count) continue;
            if (kContiguous)
              a.recv_scales[size_t(kb) * a.max_rows + r] = ld.sc[u];
            else
              a.recv_scales[(size_t(re) * kb_count + kb) * a.max_m + rm] = ld.sc[u];
          }
        }
      }
      // This message's rows are in place: each lane with a row releases it to the GEMM (the
      // warp barrier passes on the other lanes' stores of the row).
      if (!kContiguous && a.rows_ready && rows) {
        __syncwarp();
        if (row >= 0) ptx::red_release_gpu_add(a.rows_ready + e, 1);
      }
      g = g_next;
      s = s_next;
    }
  }

  if (finish_cta(a, kPhaseDispatchRecv, false) && threadIdx.x == 0) advance_step(a, kPhaseDispatchRecv, step);
}

// One rank (EpArgs::direct): the send kernel wrote the masked layout, so the hand-off to a GEMM
// beside the receive is all that is left: once the send's grid is complete (the wait below),
// every expert's rows count as landed and the published word is raised, as dispatch_recv_kernel
// does after its copies. One CTA.
__global__ void __launch_bounds__(kEpThreads) publish_direct_kernel(EpArgs a) {
  begin_kernel(a.stamps ? a.stamps + 2 * kPhaseDispatchRecv : nullptr);
  const int E = a.local_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) ptx::red_release_gpu_add(a.rows_ready + e, __ldcg(a.recv_count + e));
  publish_recv_counts(a, a.self_slab && threadIdx.x == 0 ? __ldcg(a.recv_count + E) : 0);
  end_kernel(a.stamps ? a.stamps + 2 * kPhaseDispatchRecv : nullptr);
}

}  // namespace

void launch_publish_direct(const EpArgs& args, cudaStream_t stream) {
  launch_kernel_ex(publish_direct_kernel, dim3(1), dim3(kEpThreads), 0, stream, args.pdl != 0, args);
}

void launch_dispatch_recv(const EpArgs& args, bool contiguous, int num_ctas, cudaStream_t stream) {
  const int E = args.local_experts, P = args.num_ranks;
  const size_t smem = sizeof(int) * (size_t(E) * P + P + 1 + E + 1 + E + E + 1);
  launch_kernel_ex(contiguous ? dispatch_recv_kernel<true> : dispatch_recv_kernel<false>, dim3(num_ctas),
                   dim3(kEpThreads), smem, stream, args.pdl != 0, args);
}

}  // namespace moekit::gpu
