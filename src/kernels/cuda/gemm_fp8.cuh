// gemm_fp8.cuh: the FP8 grouped GEMM kernel for sm_90a, one template for both layouts and
// both orientations.
//
// One CTA per multiprocessor (persistent); warpgroup 0 is the producer (one warp issues TMA
// loads into a ring of shared-memory stages, guarded by a full and an empty mbarrier each),
// warpgroups 1..kMathWGs are the consumers (wgmma, then scales on the CUDA cores).
//
// A tile is (expert, kBlockW weight rows, kBlockT token rows, one K range). Its operands:
//   swap-AB (small M_e): the weight rows are the MMA's M side (64 per math warpgroup) and the
//     tokens its N side (kBlockT = 16..128), so a handful of tokens does not pay for a 64-row
//     tile; the output tile is the transpose of the accumulator and is written as such.
//   normal (large M_e, contiguous prefill): the tokens are the M side (BM = 64 per math
//     warpgroup), the weight rows the N side (kBlockW = 128).
// Two-level accumulation: the four k32 wgmmas of one 128-deep K block go into a fresh partial
// sum, which the CUDA cores scale by a_scale(token) · w_scale(block) and add into fp32.
//
// Masked schedule: every CTA reads masked_m, computes the tiles of each expert (none for an
// expert without tokens: its weights are never read) and a prefix sum of them, and walks the
// tile indices blockIdx.x, blockIdx.x + gridDim.x, ...; producer and consumers walk the same
// sequence, so they agree without talking. Split-K: the splits of one tile write fp32
// partials to a workspace; the last split to finish (an atomic counter per tile, which it
// resets for the next launch) adds them in split order and writes BF16, so the result does not
// depend on which split finished last.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/ptx.cuh"
#include "moekit/bf16.h"

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
// clamped masked_m [E].
template <int kBlockT, int kBlockW>
struct SmemLayout {
  static constexpr int kWTile = kBlockW * kBlockK;
  static constexpr int kATile = kBlockT * kBlockK;
  static constexpr int kSaFloats = (kBlockT + 31) / 32 * 32;  // 128-byte aligned rows
  static constexpr int kStageBytes = kWTile + kATile + kSaFloats * 4 + 16;  // + two barriers
  static constexpr uint32_t kTxBytes = (kBlockW + kBlockT) * kBlockK + kBlockT * 4;
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

template <bool kMasked, int kBlockT, int kBlockW>
__device__ __forceinline__ TileInfo decode_tile(int tile, const KernelArgs& args, const int* prefix, const int* m_of,
                                                int lane) {
  const int num_w_blocks = args.n / kBlockW;
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

template <int kMathThreads>
__device__ __forceinline__ void math_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(kMathThreads) : "memory");
}

template <bool kSwapAB, bool kMasked, int kMathWGs, int kBlockT, int kBlockW>
__global__ void __launch_bounds__((kMathWGs + 1) * 128, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_w,
                        const __grid_constant__ CUtensorMap tma_sa, const KernelArgs args) {
  static_assert(kSwapAB ? kBlockW == 64 * kMathWGs : kBlockT == 64 * kMathWGs, "one 64-row MMA slab per warpgroup");
  static_assert(kBlockW % 64 == 0 && kBlockW <= 128, "a tile's weight rows share one 128-row scale block");
  constexpr int kMathThreads = kMathWGs * 128;
  constexpr int kMmaN = kSwapAB ? kBlockT : kBlockW;
  using Mma = ptx::Wgmma<kMmaN>;
  constexpr int kRegs = Mma::kRegs;
  using Layout = SmemLayout<kBlockT, kBlockW>;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int stages = args.num_stages;
  uint8_t* w_tiles = smem;
  uint8_t* a_tiles = w_tiles + stages * Layout::kWTile;
  float* sa_tiles = reinterpret_cast<float*>(a_tiles + stages * Layout::kATile);
  uint64_t* full = reinterpret_cast<uint64_t*>(sa_tiles + stages * Layout::kSaFloats);
  uint64_t* empty = full + stages;
  int* prefix = reinterpret_cast<int*>(empty + stages);  // [E+1]
  int* m_of = prefix + args.num_experts + 1;              // [E]

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_w_blocks = args.n / kBlockW;
  const int k_blocks = args.k / kBlockK;

  // Let the next kernel's CTAs take SMs as ours leave (it waits for our results itself).
  ptx::launch_dependents();
  const bool early_weights = kMasked && (args.flags & kFlagPdl) && (args.flags & kFlagEarlyWeights);
  if ((args.flags & kFlagPdl) && !early_weights) ptx::grid_dependency_wait();
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&tma_a);
    ptx::prefetch_tensormap(&tma_w);
    ptx::prefetch_tensormap(&tma_sa);
    for (int s = 0; s < stages; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], kMathWGs * 4);  // one arrive per math warp
    }
    ptx::fence_barrier_init();
  }
  int num_tiles;
  if constexpr (kMasked) {
    for (int e = threadIdx.x; e < args.num_experts; e += blockDim.x) {
      int m = min(max(__ldg(args.masked_m + e), 0), args.rows);
      m_of[e] = m;
      prefix[e + 1] = num_w_blocks * ((m + kBlockT - 1) / kBlockT) * args.num_splits;
    }
    __syncthreads();
    if (warp == 0) {  // inclusive scan of prefix[1..E]: one contiguous chunk per lane
      int chunk = (args.num_experts + 31) / 32;
      int begin = min(lane * chunk, args.num_experts), end = min(begin + chunk, args.num_experts);
      int sum = 0;
      for (int e = begin; e < end; ++e) sum += prefix[e + 1];
      int incl = sum;
      for (int o = 1; o < 32; o *= 2) {
        int v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
        if (lane >= o) incl += v;
      }
      int run = incl - sum;
      for (int e = begin; e < end; ++e) {
        run += prefix[e + 1];
        prefix[e + 1] = run;
      }
      if (lane == 0) prefix[0] = 0;
    }
    __syncthreads();
    num_tiles = prefix[args.num_experts];
  } else {
    __syncthreads();
    num_tiles = (args.rows / kBlockT) * num_w_blocks * args.num_splits;
  }

  if (warp < 4) {
    // ---------------- producer ----------------
    if constexpr (kMathWGs == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (warp != 0) return;
    const uint64_t policy_w = ptx::policy_evict_first();
    const uint64_t policy_a = ptx::policy_evict_last();
    // Early weights: the first ring of stages gets its weight tile (and the expect-tx of the
    // whole stage) before the wait; the activation loads of those stages follow it.
    int prefetched = 0;
    if (early_weights) {
      for (int tile = blockIdx.x; tile < num_tiles && prefetched < stages; tile += gridDim.x) {
        TileInfo t = decode_tile<kMasked, kBlockT, kBlockW>(tile, args, prefix, m_of, lane);
        for (int kb = t.kb_begin; kb < t.kb_end && prefetched < stages; ++kb, ++prefetched) {
          if (lane == 0) {
            ptx::mbar_arrive_expect_tx(&full[prefetched], Layout::kTxBytes);
            ptx::tma_load_2d(w_tiles + prefetched * Layout::kWTile, &tma_w, &full[prefetched], kb * kBlockK,
                             t.e * args.n + t.w0, policy_w);
          }
        }
      }
      ptx::grid_dependency_wait();
    }
    int iter = 0, s = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      TileInfo t = decode_tile<kMasked, kBlockT, kBlockW>(tile, args, prefix, m_of, lane);
      if (t.e < 0) continue;
      const int w_row = t.e * args.n + t.w0;
      const int a_row = kMasked ? t.e * args.rows + t.t0 : t.t0;
      const int sa_row = kMasked ? t.e * k_blocks : 0;
      for (int kb = t.kb_begin; kb < t.kb_end; ++kb, ++iter) {
        if (lane == 0) {
          if (iter >= prefetched) {
            ptx::mbar_wait(&empty[s], phase ^ 1);
            ptx::mbar_arrive_expect_tx(&full[s], Layout::kTxBytes);
            ptx::tma_load_2d(w_tiles + s * Layout::kWTile, &tma_w, &full[s], kb * kBlockK, w_row, policy_w);
          }
          ptx::tma_load_2d(a_tiles + s * Layout::kATile, &tma_a, &full[s], kb * kBlockK, a_row, policy_a);
          ptx::tma_load_2d(sa_tiles + s * Layout::kSaFloats, &tma_sa, &full[s], t.t0, sa_row + kb, policy_a);
        }
        if (++s == stages) s = 0, phase ^= 1;
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  if constexpr (kMathWGs == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int wg = warp / 4 - 1;
  const int warp_in_wg = warp % 4;
  const int mtid = threadIdx.x - 128;  // 0 .. kMathThreads-1
  // Accumulator fragment of m64nN: register i holds row (i/2 % 2)·8 + lane/4 of this warp's
  // 16 rows, column (i/4)·8 + (lane%4)·2 + i%2.
  const int frag_row = wg * 64 + warp_in_wg * 16 + lane / 4;  // + 8 for (i/2) odd
  const int frag_col = (lane % 4) * 2;                        // + 8·(i/4) + i%2
  __shared__ int last_flag;

  int s = 0;
  uint32_t phase = 0;
  // The weight scales of a tile, one K block per lane in two registers (64 blocks, K = 8192, per
  // load), read by shuffle. A per-stage load was the consumers' main stall (ncu, run 3); the
  // next tile's scales are loaded while the current tile runs, so no tile waits for them.
  auto load_ws = [&](const TileInfo& t, int base, float& lo, float& hi) {
    const float* row = args.w_scales + (size_t(t.e) * (args.n / kBlockK) + t.w0 / kBlockK) * k_blocks;
    lo = base + lane < t.kb_end ? __ldg(row + base + lane) : 0.0f;
    hi = base + 32 + lane < t.kb_end ? __ldg(row + base + 32 + lane) : 0.0f;
  };
  auto next_tile = [&](int tile, TileInfo& t) {  // the first tile at or after `tile` with work
    for (; tile < num_tiles; tile += gridDim.x) {
      t = decode_tile<kMasked, kBlockT, kBlockW>(tile, args, prefix, m_of, lane);
      if (t.e >= 0) break;
    }
    return tile;
  };
  TileInfo t{};
  int tile = next_tile(blockIdx.x, t);
  float ws_lo = 0.0f, ws_hi = 0.0f;
  if (tile < num_tiles) load_ws(t, t.kb_begin, ws_lo, ws_hi);
  while (tile < num_tiles) {
    TileInfo t_next{};
    const int tile_next = next_tile(tile + gridDim.x, t_next);
    float next_lo = 0.0f, next_hi = 0.0f;
    if (tile_next < num_tiles) load_ws(t_next, t_next.kb_begin, next_lo, next_hi);
    float acc[kRegs];
#pragma unroll
    for (int i = 0; i < kRegs; ++i) acc[i] = 0.0f;
    float part[kRegs];
    int ws_base = t.kb_begin;
    for (int kb = t.kb_begin; kb < t.kb_end; ++kb) {
      if (kb - ws_base == 64) {
        ws_base = kb;
        load_ws(t, ws_base, ws_lo, ws_hi);
      }
      const int j = kb - ws_base;
      const float ws = __shfl_sync(0xFFFFFFFFu, j < 32 ? ws_lo : ws_hi, j & 31);
      ptx::mbar_wait(&full[s], phase);
      const float* sa = sa_tiles + s * Layout::kSaFloats;
      // Per-register combined scale: a_scale of the register's token times the block's w_scale.
      float scale_a[kSwapAB ? kBlockT / 8 : 2][2];
      if constexpr (kSwapAB) {
#pragma unroll
        for (int j = 0; j < kBlockT / 8; ++j) {
          float2 v = *reinterpret_cast<const float2*>(sa + j * 8 + frag_col);
          scale_a[j][0] = v.x * ws;
          scale_a[j][1] = v.y * ws;
        }
      } else {
        scale_a[0][0] = sa[frag_row] * ws;
        scale_a[1][0] = sa[frag_row + 8] * ws;
      }
      const uint8_t* m_side = kSwapAB ? w_tiles + s * Layout::kWTile : a_tiles + s * Layout::kATile;
      const uint8_t* n_side = kSwapAB ? a_tiles + s * Layout::kATile : w_tiles + s * Layout::kWTile;
      const uint64_t desc_m = ptx::make_smem_desc_sw128(m_side + wg * 64 * kBlockK);
      const uint64_t desc_n = ptx::make_smem_desc_sw128(n_side);
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockK / 32; ++k) Mma::mma(part, desc_m + 2 * k, desc_n + 2 * k, k > 0);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[i]);
      if (lane == 0) ptx::mbar_arrive(&empty[s]);
#pragma unroll
      for (int i = 0; i < kRegs; ++i) {
        const float sc = kSwapAB ? scale_a[i / 4][i % 2] : scale_a[(i / 2) % 2][0];
        acc[i] = fmaf(part[i], sc, acc[i]);
      }
      if (++s == stages) s = 0, phase ^= 1;
    }

    // ---------------- split-K reduction ----------------
    bool store = true;  // false: another split of this tile writes it
    if (args.num_splits > 1) {
      const int splits = args.num_splits;
      float* my = args.partials + (size_t(t.slot) * splits + t.split) * kRegs * kMathThreads;
#pragma unroll
      for (int i = 0; i < kRegs; ++i) __stcg(my + i * kMathThreads + mtid, acc[i]);
      __threadfence();
      math_barrier<kMathThreads>();
      if (mtid == 0) last_flag = atomicAdd(args.counters + t.slot, 1) == splits - 1;
      math_barrier<kMathThreads>();
      store = last_flag;
      if (store) {
        __threadfence();
        if (mtid == 0) args.counters[t.slot] = 0;  // every split has arrived: ready for the next launch
        // Sum in split order (deterministic). The loads of one split are independent, so all
        // kRegs of them are in flight together: one L2 round trip per split, not per register
        // (the per-register chain cost ~5 us per tile, run 1).
        const float* base = args.partials + size_t(t.slot) * splits * kRegs * kMathThreads;
        float sum[kRegs];
#pragma unroll
        for (int i = 0; i < kRegs; ++i) sum[i] = 0.0f;
        for (int sp = 0; sp < splits; ++sp) {
          const float* part_sp = base + size_t(sp) * kRegs * kMathThreads + mtid;
          float v[kRegs];
#pragma unroll
          for (int i = 0; i < kRegs; ++i) v[i] = sp == t.split ? acc[i] : __ldcg(part_sp + i * kMathThreads);
#pragma unroll
          for (int i = 0; i < kRegs; ++i) sum[i] += v[i];
        }
#pragma unroll
        for (int i = 0; i < kRegs; ++i) acc[i] = sum[i];
      }
    }

    // ---------------- epilogue: BF16 straight from the registers ----------------
    if (!store) {
    } else if constexpr (kSwapAB) {
      // Accumulator rows are weight rows n, columns are tokens: out[e, t0 + col, w0 + row].
      uint16_t* out = args.out + (size_t(t.e) * args.rows + t.t0) * args.n + t.w0;
#pragma unroll
      for (int i = 0; i < kRegs; ++i) {
        const int col = (i / 4) * 8 + frag_col + i % 2;
        const int row = frag_row + ((i / 2) % 2) * 8;
        if (t.t0 + col < t.m_valid) out[size_t(col) * args.n + row] = float_to_bf16(acc[i]);
      }
    } else {
      bool row_ok[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = t.t0 + frag_row + h * 8;
        row_ok[h] = kMasked ? m < t.m_valid : __ldg(args.row_expert + m) >= 0;
      }
      const size_t row_base = kMasked ? size_t(t.e) * args.rows + t.t0 : size_t(t.t0);
      uint16_t* out = args.out + row_base * args.n + t.w0;
#pragma unroll
      for (int i = 0; i < kRegs; i += 2) {
        const int h = (i / 2) % 2;
        if (!row_ok[h]) continue;
        const int col = (i / 4) * 8 + frag_col;
        const int row = frag_row + h * 8;
        const uint32_t packed = uint32_t(float_to_bf16(acc[i])) | (uint32_t(float_to_bf16(acc[i + 1])) << 16);
        *reinterpret_cast<uint32_t*>(out + size_t(row) * args.n + col) = packed;
      }
    }
    t = t_next;
    tile = tile_next;
    ws_lo = next_lo;
    ws_hi = next_hi;
  }
}

}  // namespace moekit::gemm_detail
