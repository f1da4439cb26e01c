// The combine kernels (both modes).
//
// combine_send: for each message this rank received (the map dispatch_recv wrote, one warp per
// message), the weighted
// sum of its local experts' output rows in top-k order, in fp32 with explicit round-to-nearest
// multiply and add (no FMA contraction, so the bits match the CPU reference's `acc += w * y`),
// rounded once to bf16 and written into the source's combine inbox at the source token's row;
// the last CTA raises a flag at every peer (also those that sent nothing, which still wait).
// combine_recv: waits for all P flags and writes out[t] = bf16(add[t] + partial[r0][t] + ...) over
// the token's target ranks in ascending order, in fp32: a fixed order, so the result is
// deterministic and equal to the reference's.
#include <cuda_runtime.h>

#include "ep_device.cuh"
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

// One warp per received message; each lane sums kUnroll 8-wide chunks at a time, so that many
// independent loads of y are in flight.
__global__ void __launch_bounds__(kEpThreads) combine_send_kernel(EpArgs a, const uint16_t* __restrict__ y) {
  constexpr int kUnroll = 4;
  extern __shared__ int smem[];
  int* src_start = smem;  // [P + 1]
  __shared__ int warp_rows[kEpThreads / 32][kEpMaxTopk];
  __shared__ float warp_w[kEpThreads / 32][kEpMaxTopk];
  const int P = a.num_ranks, k = a.topk;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const unsigned step = current_step(a, kPhaseCombineSend);
  const int parity = int(step) & a.parity_mask;
  if (threadIdx.x == 0) {
    src_start[0] = 0;
    for (int s = 0; s < P; ++s) src_start[s + 1] = src_start[s] + a.recv_msgs[s];
  }
  __syncthreads();
  const int num_msgs = src_start[P], num_chunks = a.hidden / 8;
  int* rows = warp_rows[warp];
  float* weights = warp_w[warp];
  for (int g = blockIdx.x * warps + warp; g < num_msgs; g += gridDim.x * warps) {
    int s = 0;
    while (src_start[s + 1] <= g) ++s;
    const size_t item = size_t(s) * a.max_tokens + (g - src_start[s]);
    if (lane < k) {
      rows[lane] = a.map_rows[item * k + lane];
      weights[lane] = a.map_w[item * k + lane];
    }
    const int token = a.map_token[item];
    __syncwarp();
    uint4* dst = reinterpret_cast<uint4*>(a.combine_outbox(parity, s) + kEpFlagBytes + size_t(token) * a.hidden * 2);
    for (int c0 = lane; c0 < num_chunks; c0 += 32 * kUnroll) {
      float acc[kUnroll][8] = {};
      for (int i = 0; i < k; ++i) {
        const int row = rows[i];
        if (row < 0) continue;
        const uint4* yr = reinterpret_cast<const uint4*>(y + size_t(row) * a.hidden);
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (c0 + 32 * u < num_chunks) v[u] = __ldg(yr + c0 + 32 * u);
        const float w = weights[i];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (c0 + 32 * u >= num_chunks) continue;
          float f[8];
          unpack8(v[u], f);
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[u][q] = __fadd_rn(acc[u][q], __fmul_rn(w, f[q]));
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + 32 * u < num_chunks) dst[c0 + 32 * u] = pack8(acc[u]);
    }
    __syncwarp();
  }
  if (finish_cta(a, kPhaseCombineSend)) {
    for (int s = threadIdx.x; s < P; s += blockDim.x)
      st_release_sys(reinterpret_cast<uint64_t*>(a.combine_outbox(parity, s)), uint64_t(step) << 32);
    if (threadIdx.x == 0) advance_step(a, kPhaseCombineSend, step);
  }
}

__global__ void __launch_bounds__(kEpThreads) combine_recv_kernel(EpArgs a, const uint16_t* add, uint16_t* out) {
  __shared__ int ok;
  __shared__ int ranks[kEpMaxTopk];
  const int P = a.num_ranks, k = a.topk;
  const unsigned step = current_step(a, kPhaseCombineRecv);
  const int parity = int(step) & a.parity_mask;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int r = threadIdx.x; r < P; r += blockDim.x)
    if (wait_flag(a, reinterpret_cast<const uint64_t*>(a.combine_inbox(parity, r)), step, kPhaseCombineRecv, r) == 0)
      ok = 0;
  __syncthreads();
  const int num_tokens = ok ? a.ctr->num_tokens : 0;
  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    if (threadIdx.x < k) ranks[threadIdx.x] = a.route_ranks[size_t(t) * k + threadIdx.x];
    __syncthreads();
    for (int c = threadIdx.x; c < a.hidden / 8; c += blockDim.x) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (add) unpack8(reinterpret_cast<const uint4*>(add + size_t(t) * a.hidden)[c], acc);
      // Four ranks' partials loaded before any is added (the adds stay in ascending rank order).
      for (int i = 0; i < k && ranks[i] >= 0; i += 4) {
        uint4 part[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (i + u < k && ranks[i + u] >= 0)
            part[u] = __ldcg(reinterpret_cast<const uint4*>(a.combine_inbox(parity, ranks[i + u]) + kEpFlagBytes +
                                                            size_t(t) * a.hidden * 2) + c);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (i + u >= k || ranks[i + u] < 0) continue;
          float v[8];
          unpack8(part[u], v);
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], v[q]);
        }
      }
      reinterpret_cast<uint4*>(out + size_t(t) * a.hidden)[c] = pack8(acc);
    }
    __syncthreads();
  }
  if (finish_cta(a, kPhaseCombineRecv) && threadIdx.x == 0) advance_step(a, kPhaseCombineRecv, step);
}

}  // namespace

void launch_combine_send(const EpArgs& args, const uint16_t* y, int num_ctas, cudaStream_t stream) {
  combine_send_kernel<<<num_ctas, kEpThreads, sizeof(int) * (args.num_ranks + 1), stream>>>(args, y);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

void launch_combine_recv(const EpArgs& args, const uint16_t* add, uint16_t* out, int num_ctas, cudaStream_t stream) {
  combine_recv_kernel<<<num_ctas, kEpThreads, 0, stream>>>(args, add, out);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

}  // namespace moekit::gpu
