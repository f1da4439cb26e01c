// warp_prefix.cuh: an exclusive prefix over n counts by one warp, and the segment an item falls
// in, shared by the EP kernels (messages per source, rows per expert) and the masked activation
// (rows per expert).
#pragma once

#include <cuda_runtime.h>

namespace moekit {

// Warp-wide prefix over n counts (all lanes of one warp call it): out[0] = 0, out[i + 1] =
// count(0) + ... + count(i). One shuffle scan per 32 counts instead of one thread walking n.
// count(i) may read out[i + 1] (the lane that reads it is the lane that overwrites it).
template <class Count>
__device__ __forceinline__ void warp_prefix(int* out, int n, Count count) {
  const int lane = threadIdx.x & 31;
  int carry = 0;
  for (int b = 0; b < n; b += 32) {
    const int i = b + lane;
    int v = i < n ? count(i) : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xFFFFFFFFu, v, o);
      if (lane >= o) v += u;
    }
    if (i < n) out[i + 1] = carry + v;
    carry += __shfl_sync(0xFFFFFFFFu, v, 31);
  }
  if (lane == 0) out[0] = 0;
}

// The segment s of item i under such a prefix (start[s] = items of segments < s, start[n] = all):
// the s with start[s] <= i < start[s + 1], skipping empty segments. Binary search.
__device__ __forceinline__ int segment_of(const int* start, int n, int i) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (start[mid + 1] > i) hi = mid; else lo = mid + 1;
  }
  return lo;
}

}  // namespace moekit
