// gemm_mxfp4_parts.cuh: what both MXFP4 grouped GEMM kernels share (the register kernel,
// gemm_mxfp4.cuh, and the widening-warpgroup kernel, gemm_mxfp4_widen.cuh): the stage ring's
// shared-memory layout, the activation scales of a math thread's accumulator columns, the producer
// warpgroup (a weights warp and an activations warp), and a tile's end (the row factor, split-K's
// reduction, the BF16 store with the bias).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemm_epilogue.cuh"
#include "kernels/cuda/gemm_schedule.cuh"
#include "kernels/cuda/mxfp4_convert.cuh"
#include "kernels/cuda/ptx.cuh"
#include "moekit/mxfp4.h"

namespace moekit::gemm_detail {

// Shared memory of the MXFP4 kernel, in order: A tiles (1024-aligned for the swizzle), packed
// weight tiles, weight-scale tiles, A-scale rows, full and empty barriers (the stage ring), then
// (masked) prefix [E+1] and m_of [E]. The widening kernel's layout (gemm_mxfp4_widen.cuh) is this
// one with its widened tiles before the ring and their barriers after it.
// kSlabs: 128-row weight slabs per stage (2: a 256-row tile of the register kernel, both slabs
// multiplied with the stage's one activation tile).
template <int kBlockT, int kSlabs = 1>
struct Mxfp4SmemLayout {
  static constexpr int kWRows = 128 * kSlabs;
  static constexpr int kATile = kBlockT * kBlockK;
  static constexpr int kWTile = kWRows * kBlockK / 2;
  static constexpr int kWsTile = kWRows * 4;
  static constexpr int kSaFloats = (kBlockT + 31) / 32 * 32;
  static constexpr int kStageBytes = kATile + kWTile + kWsTile + kSaFloats * 4 + 16;
  static constexpr uint32_t kTxWeights = kWTile + kWsTile;           // the weights' producer warp
  static constexpr uint32_t kTxActivations = kATile + kBlockT * 4;  // the activations' producer warp
  static int bytes(int stages, int num_experts) { return 1024 + stages * kStageBytes + (2 * num_experts + 1) * 4; }
};

// The activation scales of a math thread's accumulator columns in a tile of kBlockT tokens (the
// wgmma's layout: accumulator register c is column (c / 4)·8 + frag_col + c % 2), loaded from a
// row of per-token scales (a stage's row in shared memory, or a tile's row scales in global memory).
template <int kBlockT>
struct TokenScales {
  float2 pairs[kBlockT / 8];
  __device__ __forceinline__ void load(const float* row, int frag_col) {
#pragma unroll
    for (int j = 0; j < kBlockT / 8; ++j) pairs[j] = *reinterpret_cast<const float2*>(row + j * 8 + frag_col);
  }
  // The scale of accumulator register c (of one 64-row slab).
  __device__ __forceinline__ float of(int c) const { return (c % 2) ? pairs[c / 4].y : pairs[c / 4].x; }
};

// The producer warpgroup of both MXFP4 kernels (this one and gemm_mxfp4_widen.cuh), after its
// setmaxnreg: warp 0 issues each stage's codes and scale words, warp 1 its activations and their
// scales, warps 2-3 leave. Two warps: one thread issuing all four copies of a stage could not issue
// a stage faster than ~700 SM cycles, which bounded the decode kernel (docs/gemm-mxfp4.md, run 18).
// Stage s's tiles: codes + s·kWTile, scale words + s·kWsTile, activations + s·kATile, their
// scales + s·kSaFloats (Layout: either kernel's shared-memory layout). kBlockScales false (the
// contiguous register kernel with ContiguousGemmProblem::a_row_scales): the stages carry no
// activation scales.
// A stage's weights are Layout::kWRows / 128 slabs: 128-row blocks t.w0 / 128 and + 1 (for two),
// their runs of codes and of words k_blocks runs apart, each kind taken by one 3D copy (the maps of
// bind_mxfp4_weights for block_n 256): the producer's issue, not the bytes, is what a copy costs
// (docs/gemm-mxfp4.md runs 18 and 34).
template <bool kMasked, int kBlockT, class Layout, bool kBlockScales = true, class Decode>
__device__ __forceinline__ void produce_mxfp4(const KernelArgs& args, int num_tiles, bool early_weights, Decode&& decode,
                                              uint64_t* full, uint64_t* empty, uint8_t* code_tiles, uint8_t* ws_tiles,
                                              uint8_t* a_tiles, float* sa_tiles, const CUtensorMap* tma_a,
                                              const CUtensorMap* tma_w, const CUtensorMap* tma_sa,
                                              const CUtensorMap* tma_ws) {
  constexpr int kBlockW = 128, kSlabs = Layout::kWRows / kBlockW;
  const int warp = threadIdx.x / 32;
  if (warp > 1) return;
  const int num_w_blocks = args.n / kBlockW, k_blocks = args.k / kBlockK;
  const uint64_t policy_w = ptx::policy_evict_first();
  const uint64_t policy_a = ptx::policy_evict_last();
  auto load_w = [&](int stage, int kb, const TileInfo& t) {  // codes and scales of 128 rows x 128 K a slab
    if constexpr (kSlabs == 1) {  // tile-major codes and words: the stage is run `run` of both
      const int run = int(mxfp4_gemm_run(t.e, t.w0 / kBlockW, kb, num_w_blocks, k_blocks));
      ptx::tma_load_2d(code_tiles + stage * Layout::kWTile, tma_w, &full[stage], 0, run * kBlockW, policy_w);
      ptx::tma_load_2d(ws_tiles + stage * Layout::kWsTile, tma_ws, &full[stage], 0, run, policy_w);
    } else {  // [row block][k block][128 rows] views: both slabs of k block kb in one copy each
      const int row_block = t.e * num_w_blocks + t.w0 / kBlockW;
      ptx::tma_load_3d(code_tiles + stage * Layout::kWTile, tma_w, &full[stage], 0, kb * kBlockW, row_block, policy_w);
      ptx::tma_load_3d(ws_tiles + stage * Layout::kWsTile, tma_ws, &full[stage], 0, kb, row_block, policy_w);
    }
  };
  auto load_a = [&](int stage, int kb, const TileInfo& t) {
    const int a_row = kMasked ? t.e * args.rows + t.t0 : t.t0;
    const int sa_row = kMasked ? t.e * k_blocks : 0;
    ptx::tma_load_2d(a_tiles + stage * Layout::kATile, tma_a, &full[stage], kb * kBlockK, a_row, policy_a);
    if constexpr (kBlockScales)
      ptx::tma_load_2d(sa_tiles + stage * Layout::kSaFloats, tma_sa, &full[stage], t.t0, sa_row + kb, policy_a);
  };
  constexpr uint32_t kTxActivations = kBlockScales ? Layout::kTxActivations : Layout::kATile;
  if (warp == 0)
    produce(args, num_tiles, tile_walk<1>(), full, empty, Layout::kTxWeights, early_weights, decode, load_w, load_a,
            kProduceWeights);
  else
    produce(args, num_tiles, tile_walk<1>(), full, empty, kTxActivations, early_weights, decode, load_w, load_a,
            kProduceActivations);
}

// The scale words of a math thread's two accumulator rows in tile t, rows frag_row and + 8 from
// t.w0 (both in one 128-row block: frag_row % 16 < 8; every k block of a row holds the same s_row,
// block 0's is read), for the row factor after the K loop; loaded when a tile starts, so that
// their latency hides under its K loop. row_blocks: N / 128.
__device__ __forceinline__ uint2 mxfp4_row_words(const KernelArgs& args, const TileInfo& t, int frag_row,
                                                 int row_blocks, int k_blocks) {
  constexpr int kBlockW = 128;
  const int row = t.w0 + frag_row;
  const uint32_t* words =
      args.w_mx_scales + mxfp4_gemm_run(t.e, row / kBlockW, 0, row_blocks, k_blocks) * kBlockW + row % kBlockW;
  return make_uint2(__ldg(words), __ldg(words + 8));
}

// A tile's end in both MXFP4 kernels: the row factor 2^(base - 127) (exact: a power of two), then
// split-K's reduction and the BF16 store with the bias. A math thread holds kSlabs slabs of
// accumulators (slab sl: acc + sl·kRegs, rows f.row + kSlabRows·sl and + 8, scale words
// row_words[sl]): 64-row slabs of one warpgroup (gemm_mxfp4_widen.cuh), or the 128-row slabs of a
// 256-row tile.
template <bool kMasked, int kBlockT, int kRegs, int kMathThreads, int kSlabs = 1, int kSlabRows = 64>
__device__ __forceinline__ void store_mxfp4_tile(const KernelArgs& args, const TileInfo& t, float* acc,
                                                 const uint2 (&row_words)[kSlabs], const Fragment& f, int* last_flag) {
#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl) {
    const float rf[2] = {mxfp4_detail::row_factor(row_words[sl].x), mxfp4_detail::row_factor(row_words[sl].y)};
#pragma unroll
    for (int i = 0; i < kRegs; ++i) acc[sl * kRegs + i] *= rf[(i / 2) % 2];
  }
  const bool store =
      args.num_splits == 1 || reduce_splits<kSlabs * kRegs, kMathThreads>(args, t, acc, f.mtid, last_flag);
  if (!store) return;
#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl) {
    if (t.w0 + kSlabRows * sl >= args.n) continue;  // a 256-row tile's second slab past N
    Fragment fs = f;
    fs.row += kSlabRows * sl;
    store_bf16_transposed<kMasked, kBlockT, kRegs>(args, t, acc + sl * kRegs, fs);
  }
}

}  // namespace moekit::gemm_detail
