// gemm_schedule.cuh: what the FP8 grouped GEMM's threads agree on: the kernel arguments, the
// shared-memory layout of a pipeline stage and the tile order (gemm_fp8.cuh has the kernel).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moekit::gemm_detail {

constexpr int kBlockK = 128;        // one quantisation block of K per pipeline stage
constexpr int kRasterGroup = 8;     // contiguous: token blocks that share the weight stream in L2

struct KernelArgs {
  int num_experts = 0;
  int n = 0;
  int k = 0;
  int rows = 0;                   // masked: M_max; contiguous: M_total
  const int* masked_m = nullptr;  // masked only
  const int* row_expert = nullptr;  // contiguous only
  const float* w_scales = nullptr;
  uint16_t* out = nullptr;
  float* partials = nullptr;  // split-K workspace: slots x splits x tile floats
  int* counters = nullptr;    // one per slot, zero between launches
  int num_splits = 1;
  int num_stages = 0;
  int flags = 0;  // kFlag* below
  uint8_t* act = nullptr;          // gated: SiLU·up in FP8 [E, rows, n/2]
  float* act_scales = nullptr;     // gated: its scales [E, n/256, rows]
  unsigned long long* stamp = nullptr;  // stamp.cuh pair of a timed step, or null
};

// Programmatic dependent launch: this kernel may start while the previous kernel on the stream
// is still running. Everything the previous kernel may write (activations, their scales,
// masked_m, row_expert, the output) is touched only after `griddepcontrol.wait`.
constexpr int kFlagPdl = 1;
// With kFlagPdl: masked_m and the weights are not written by the previous kernel, so the
// schedule is computed and the first ring of weight tiles is loaded before the wait: the
// weight stream starts during the previous kernel's tail (GEMM2 after the activation kernel).
constexpr int kFlagEarlyWeights = 2;

// Shared memory, in order: W tiles, A tiles (each 1024-aligned for the 128-byte swizzle),
// A-scale rows, full and empty barriers, then (masked) the tile prefix sums [E+1] and the
// clamped masked_m [E]. kWRows: weight rows per stage (2 kBlockW for gated tiles).
template <int kBlockT, int kWRows>
struct SmemLayout {
  static constexpr int kWTile = kWRows * kBlockK;
  static constexpr int kATile = kBlockT * kBlockK;
  static constexpr int kSaFloats = (kBlockT + 31) / 32 * 32;  // 128-byte aligned rows
  static constexpr int kStageBytes = kWTile + kATile + kSaFloats * 4 + 16;  // + two barriers
  static constexpr uint32_t kTxBytes = (kWRows + kBlockT) * kBlockK + kBlockT * 4;
  static int bytes(int stages, int num_experts) { return 1024 + stages * kStageBytes + (2 * num_experts + 1) * 4; }
};

struct TileInfo {
  int e;          // local expert (-1: nothing to do, contiguous padding block)
  int w0;         // first weight row (output column) within the expert
  int t0;         // first token row: within the expert (masked) or global (contiguous)
  int m_valid;    // masked: rows of the expert that are real
  int kb_begin, kb_end;
  int split;
  int slot;       // split-K workspace slot of (expert, weight block, token block)
};

// num_w_blocks: weight blocks per expert (N / kBlockW; gated tiles: N / 2 / kBlockW).
template <bool kMasked, int kBlockT, int kBlockW>
__device__ __forceinline__ TileInfo decode_tile(int tile, const KernelArgs& args, int num_w_blocks, const int* prefix,
                                                const int* m_of, int lane) {
  const int k_blocks = args.k / kBlockK;
  const int splits = args.num_splits;
  TileInfo t{};
  int rest = tile / splits;
  t.split = tile - rest * splits;
  t.kb_begin = t.split * k_blocks / splits;
  t.kb_end = (t.split + 1) * k_blocks / splits;
  int tb, wb;
  if constexpr (kMasked) {
    // Largest e with prefix[e] <= tile (experts without tiles have prefix[e] == prefix[e+1]).
    int lo = 0, hi = args.num_experts - 1;
    while (lo < hi) {
      int mid = (lo + hi + 1) / 2;
      if (prefix[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    t.e = lo;
    t.m_valid = m_of[lo];
    rest = (tile - prefix[lo]) / splits;
    int t_blocks = (t.m_valid + kBlockT - 1) / kBlockT;
    tb = rest % t_blocks;
    wb = rest / t_blocks;
    int max_t_blocks = (args.rows + kBlockT - 1) / kBlockT;
    t.slot = (t.e * num_w_blocks + wb) * max_t_blocks + tb;
  } else {
    // Grouped raster: kRasterGroup token blocks walk the weight blocks together.
    int t_blocks = args.rows / kBlockT;
    int group = rest / (kRasterGroup * num_w_blocks);
    int first = group * kRasterGroup;
    int size = min(kRasterGroup, t_blocks - first);
    int in = rest - group * kRasterGroup * num_w_blocks;
    tb = first + in % size;
    wb = in / size;
    t.slot = tb * num_w_blocks + wb;
    t.m_valid = 0;
    // The block's expert: the largest row_expert of its rows (padding rows are -1).
    int e = -1;
    for (int r = lane; r < kBlockT; r += 32) e = max(e, __ldg(args.row_expert + tb * kBlockT + r));
    for (int o = 16; o > 0; o /= 2) e = max(e, __shfl_xor_sync(0xFFFFFFFFu, e, o));
    t.e = e;
  }
  t.t0 = tb * kBlockT;
  t.w0 = wb * kBlockW;
  return t;
}

// The consumer warpgroups' named barrier (the producer warps have left).
template <int kMathThreads>
__device__ __forceinline__ void math_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(kMathThreads) : "memory");
}

}  // namespace moekit::gemm_detail
