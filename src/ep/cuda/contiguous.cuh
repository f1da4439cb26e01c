// Internal to src/ep/cuda: the contiguous layout's (normal mode, layout.h) segment table and the
// rows no token fills, shared by the two kernels that place rows in it: the dispatch receive
// (dispatch_recv.cu) and one rank's send, which places its rows itself (dispatch_send.cu).
//
// Expert e's rows start at seg[e], its real rows first (expert_rows[e] of them), then padding to
// a multiple of block_m; seg[E] is M_total. Padding and the tail past M_total belong to no
// expert: row_expert and recv_src -1, and padding rows a zero payload and zero scales, as the
// CPU reference writes them.
#pragma once

#include <cuda_runtime.h>

#include "ep_device.cuh"
#include "moekit/layout.h"

namespace moekit::gpu {

// seg[E + 1] (segment starts) and pad_start[E + 1] (padding rows before segment e) from
// expert_rows[E], in shared memory: one warp scan each. Every thread of the CTA (at least two
// warps) calls it; it ends with a barrier.
__device__ __forceinline__ void contiguous_segments(const EpArgs& a, const int* expert_rows, int* seg, int* pad_start) {
  const int E = a.local_experts, warp = threadIdx.x >> 5;
  auto padded = [&](int e) { return (expert_rows[e] + a.block_m - 1) / a.block_m * a.block_m; };
  if (warp == 0) warp_prefix(seg, E, padded);
  if (warp == 1) warp_prefix(pad_start, E, [&](int e) { return padded(e) - expert_rows[e]; });
  __syncthreads();
}

// This CTA's share of the rows no token fills (all rows of max_rows when !fits): row_expert and
// recv_src -1 (one thread per row), and each padding row's payload and scales zero (one warp per
// padding row). Every thread calls it; the grid covers every row between its CTAs.
__device__ __forceinline__ void fill_unplaced_rows(const EpArgs& a, const int* seg, const int* expert_rows,
                                                   const int* pad_start, bool fits) {
  const int E = a.local_experts, total_rows = seg[E];
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
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, kb_count = a.hidden / kQuantBlock;
  for (int p = blockIdx.x * warps + (threadIdx.x >> 5); fits && p < pad_start[E]; p += gridDim.x * warps) {
    int e = 0, hi = E;  // the last segment with pad_start[e] <= p
    while (hi - e > 1) {
      const int mid = (e + hi) / 2;
      if (pad_start[mid] <= p) e = mid; else hi = mid;
    }
    const int r = seg[e] + expert_rows[e] + (p - pad_start[e]);
    uint4* dst = reinterpret_cast<uint4*>(a.recv_x + size_t(r) * a.hidden);
    for (int c = lane; c < a.hidden / 16; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
    for (int kb = lane; kb < kb_count; kb += 32) a.recv_scales[size_t(kb) * a.max_rows + r] = 0.0f;
  }
}

}  // namespace moekit::gpu
