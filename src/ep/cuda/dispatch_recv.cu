// The dispatch receive kernels (the hook): wait for every source's flag, then expand the
// messages into the masked layout (low-latency) or the contiguous layout (normal).
//
// Every CTA waits on all P flags (one thread per source, acquire loads, clock64 timeout) and
// builds the same small table in shared memory from the per-expert counts in the inbox
// headers: base[e][s] = rows of local expert e from sources < s (the canonical order of
// layout.h: by source rank, then source token) and, for the contiguous layout, the padded
// segment starts. A row's index is then base + the position the sender computed, so the
// copies need no atomics and no scan, and any CTA may copy any message.
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
  __shared__ int ok;
  __shared__ int rows[kEpMaxTopk];
  __shared__ int token;

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
      for (int e = 0; e < E; ++e)
        seg[e + 1] = seg[e] + (kContiguous ? (expert_rows[e] + a.block_m - 1) / a.block_m * a.block_m : 0);
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
      // Rows that no message fills: padding inside a segment (zero payload and scales, as the
      // reference writes) and the tail past M_total; both get expert -1 and source -1.
      const int kb_count = a.hidden / kQuantBlock;
      for (int r = blockIdx.x; r < a.max_rows; r += gridDim.x) {
        int lo = 0, hi = E;  // last segment with seg[e] <= r
        while (hi - lo > 1) {
          const int mid = (lo + hi) / 2;
          if (seg[mid] <= r) lo = mid; else hi = mid;
        }
        const bool real = fits && r < total_rows && r < seg[lo] + expert_rows[lo];
        if (real) continue;
        if (threadIdx.x == 0) {
          a.row_expert[r] = -1;
          a.recv_src[r] = -1;
        }
        if (fits && r < total_rows) {
          uint4* dst = reinterpret_cast<uint4*>(a.recv_x + size_t(r) * a.hidden);
          for (int c = threadIdx.x; c < a.hidden / 16; c += blockDim.x) dst[c] = make_uint4(0, 0, 0, 0);
          for (int kb = threadIdx.x; kb < kb_count; kb += blockDim.x) a.recv_scales[size_t(kb) * a.max_rows + r] = 0.0f;
        }
      }
    }

    const int num_msgs = fits ? src_start[P] : 0;
    for (int g = blockIdx.x; g < num_msgs; g += gridDim.x) {
      int s = 0;
      while (src_start[s + 1] <= g) ++s;
      const int j = g - src_start[s];
      const uint8_t* msg = a.dispatch_inbox(parity, s) + a.dispatch_header_bytes + size_t(j) * a.msg_bytes;
      const int* meta = reinterpret_cast<const int*>(msg + a.msg_meta_off);
      const size_t item = size_t(s) * a.max_tokens + j;
      if (threadIdx.x == 0) {
        token = __ldcg(meta);
        a.map_token[item] = token;
      }
      __syncthreads();
      if (threadIdx.x < k) {
        const int code = __ldcg(meta + 1 + threadIdx.x);
        const float w = __ldcg(reinterpret_cast<const float*>(meta + 1 + k) + threadIdx.x);
        int row = -1;
        if (code >= 0) {
          const int e = code >> 16;
          const int m = base[e * P + s] + (code & 0xFFFF);
          if (kContiguous) {
            row = seg[e] + m;
            a.row_expert[row] = e;
            a.recv_src[row] = s * a.max_tokens + token;
          } else {
            row = e * a.max_m + m;
            a.recv_src[row] = s * a.max_tokens + token;
          }
        }
        rows[threadIdx.x] = row;
        a.map_rows[item * k + threadIdx.x] = row;
        a.map_w[item * k + threadIdx.x] = w;
      }
      __syncthreads();
      const uint4* src = reinterpret_cast<const uint4*>(msg);
      for (int c = threadIdx.x; c < a.hidden / 16; c += blockDim.x) {
        const uint4 v = __ldcg(src + c);
        for (int i = 0; i < k; ++i)
          if (rows[i] >= 0) *reinterpret_cast<uint4*>(a.recv_x + size_t(rows[i]) * a.hidden + size_t(c) * 16) = v;
      }
      const float* scales = reinterpret_cast<const float*>(msg + a.msg_scale_off);
      const int kb_count = a.hidden / kQuantBlock;
      for (int kb = threadIdx.x; kb < kb_count; kb += blockDim.x) {
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
      __syncthreads();
    }
  }

  if (finish_cta(a, kPhaseDispatchRecv) && threadIdx.x == 0) advance_step(a, kPhaseDispatchRecv, step);
}

}  // namespace

void launch_dispatch_recv(const EpArgs& args, bool contiguous, int num_ctas, cudaStream_t stream) {
  const int E = args.local_experts, P = args.num_ranks;
  const size_t smem = sizeof(int) * (size_t(E) * P + P + 1 + E + 1 + E);
  if (contiguous)
    dispatch_recv_kernel<true><<<num_ctas, kEpThreads, smem, stream>>>(args);
  else
    dispatch_recv_kernel<false><<<num_ctas, kEpThreads, smem, stream>>>(args);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::gpu
