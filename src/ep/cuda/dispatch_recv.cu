// The dispatch receive kernels (the hook): wait for every source's flag, then expand the
// messages into the masked layout (low-latency) or the contiguous layout (normal).
//
// Every CTA waits on all P flags (one thread per source, acquire loads, clock64 timeout) and
// builds the same small table in shared memory from the per-expert counts in the inbox
// headers: base[e][s] = rows of local expert e from sources < s (the canonical order of
// layout.h: by source rank, then source token) and, for the contiguous layout, the padded
// segment starts. A row's index is then base + the position the sender computed, so the
// copies need no atomics and no scan, and any warp may copy any message.
#include <cuda_runtime.h>

#include "ep_device.cuh"
#include "moekit/cuda_check.h"

namespace moekit::gpu {
namespace {

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
  __shared__ int warp_rows[kEpThreads / 32][kEpMaxTopk];

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

  if (ok) {
    for (int i = threadIdx.x; i < E * P; i += blockDim.x) {
      const int s = i / E, e = i % E;
      base[e * P + s] = __ldcg(reinterpret_cast<const int*>(a.dispatch_inbox(parity, s) + kEpFlagBytes) + e);
    }
    __syncthreads();
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
    if (threadIdx.x == 0) {
      src_start[0] = 0;
      for (int s = 0; s < P; ++s) src_start[s + 1] += src_start[s];
      seg[0] = 0;
      pad_start[0] = 0;
      for (int e = 0; e < E; ++e) {
        seg[e + 1] = seg[e] + (kContiguous ? (expert_rows[e] + a.block_m - 1) / a.block_m * a.block_m : 0);
        pad_start[e + 1] = pad_start[e] + (kContiguous ? seg[e + 1] - seg[e] - expert_rows[e] : 0);
      }
    }
    __syncthreads();
    const int total_rows = seg[E];
    const bool fits = !kContiguous || total_rows <= a.max_rows;
    if (!fits && threadIdx.x == 0 && blockIdx.x == 0)
      record_fault(a, EpErrorKind::kCapacity, kPhaseDispatchRecv, -1, step, -1, a.max_rows, total_rows);
    if (blockIdx.x == 0) {
      for (int e = threadIdx.x; e < E; e += blockDim.x) a.recv_count[e] = expert_rows[e];
      for (int s = threadIdx.x; s < P; s += blockDim.x) a.recv_msgs[s] = fits ? src_start[s + 1] - src_start[s] : 0;
      if (kContiguous && threadIdx.x == 0) *a.total_rows = fits ? total_rows : 0;
    }

    if (kContiguous) {
      // Rows that no message fills get expert -1 and source -1: padding inside a segment and the
      // tail past M_total (one thread per row). Padding rows also get a zero payload and zero
      // scales, as the reference writes (one warp per padding row).
      const int stride = gridDim.x * blockDim.x;
      for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < a.max_rows; r += stride) {
        bool real = false;
        if (fits && r < total_rows) {
          int lo = 0, hi = E;  // the last segment with seg[e] <= r
          while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (seg[mid] <= r) lo = mid; else hi = mid;
          }
          real = r < seg[lo] + expert_rows[lo];
        }
        if (!real) {
          a.row_expert[r] = -1;
          a.recv_src[r] = -1;
        }
      }
      const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
      const int kb_count = a.hidden / kQuantBlock;
      for (int p = blockIdx.x * warps + (threadIdx.x >> 5); fits && p < pad_start[E]; p += gridDim.x * warps) {
        int e = 0;
        while (pad_start[e + 1] <= p) ++e;
        const int r = seg[e] + expert_rows[e] + (p - pad_start[e]);
        uint4* dst = reinterpret_cast<uint4*>(a.recv_x + size_t(r) * a.hidden);
        for (int c = lane; c < a.hidden / 16; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
        for (int kb = lane; kb < kb_count; kb += 32) a.recv_scales[size_t(kb) * a.max_rows + r] = 0.0f;
      }
    }

    // One warp per message: a message is a few KB, so many in flight at once beat one CTA
    // walking them in turn.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int* rows = warp_rows[warp];
    const int num_msgs = fits ? src_start[P] : 0;
    const int kb_count = a.hidden / kQuantBlock, num_chunks = a.hidden / 16;
    for (int g = blockIdx.x * warps + warp; g < num_msgs; g += gridDim.x * warps) {
      int s = 0;
      while (src_start[s + 1] <= g) ++s;
      const int j = g - src_start[s];
      const uint8_t* msg = a.dispatch_inbox(parity, s) + a.dispatch_header_bytes + size_t(j) * a.msg_bytes;
      const int* meta = reinterpret_cast<const int*>(msg + a.msg_meta_off);
      const size_t item = size_t(s) * a.max_tokens + j;
      const int token = __ldcg(meta);
      if (lane == 0) a.map_token[item] = token;
      if (lane < k) {
        const int code = __ldcg(meta + 1 + lane);
        const float w = __ldcg(reinterpret_cast<const float*>(meta + 1 + k) + lane);
        int row = -1;
        if (code >= 0) {
          const int e = code >> 16;
          const int m = base[e * P + s] + (code & 0xFFFF);
          row = kContiguous ? seg[e] + m : e * a.max_m + m;
          if (kContiguous) a.row_expert[row] = e;
          a.recv_src[row] = s * a.max_tokens + token;
        }
        rows[lane] = row;
        a.map_rows[item * k + lane] = row;
        a.map_w[item * k + lane] = w;
      }
      __syncwarp();
      // Two 16-byte chunks per lane per round, both loaded before any store.
      const uint4* src = reinterpret_cast<const uint4*>(msg);
      for (int c = lane; c < num_chunks; c += 64) {
        const bool second = c + 32 < num_chunks;
        const uint4 v0 = __ldcg(src + c);
        const uint4 v1 = second ? __ldcg(src + c + 32) : v0;
        for (int i = 0; i < k; ++i) {
          const int row = rows[i];
          if (row < 0) continue;
          uint4* dst = reinterpret_cast<uint4*>(a.recv_x + size_t(row) * a.hidden);
          dst[c] = v0;
          if (second) dst[c + 32] = v1;
        }
      }
      const float* scales = reinterpret_cast<const float*>(msg + a.msg_scale_off);
      for (int kb = lane; kb < kb_count; kb += 32) {
        const float sc = __ldcg(scales + kb);
        for (int i = 0; i < k; ++i) {
          const int row = rows[i];
          if (row < 0) continue;
          if (kContiguous) {
            a.recv_scales[size_t(kb) * a.max_rows + row] = sc;
          } else {
            const int e = row / a.max_m, m = row % a.max_m;
            a.recv_scales[(size_t(e) * kb_count + kb) * a.max_m + m] = sc;
          }
        }
      }
      __syncwarp();
    }
  }

  if (finish_cta(a, kPhaseDispatchRecv) && threadIdx.x == 0) advance_step(a, kPhaseDispatchRecv, step);
}

}  // namespace

void launch_dispatch_recv(const EpArgs& args, bool contiguous, int num_ctas, cudaStream_t stream) {
  const int E = args.local_experts, P = args.num_ranks;
  const size_t smem = sizeof(int) * (size_t(E) * P + P + 1 + E + 1 + E + E + 1);
  if (contiguous)
    dispatch_recv_kernel<true><<<num_ctas, kEpThreads, smem, stream>>>(args);
  else
    dispatch_recv_kernel<false><<<num_ctas, kEpThreads, smem, stream>>>(args);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::gpu
