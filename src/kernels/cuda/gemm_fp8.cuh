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
//     tile; the output tile is the transpose of the accumulator and is written as such. Up to
//     64 tokens a tile may hold 256 weight rows as two 128-row slabs per tile (each warpgroup
//     multiplies 64 rows of both, as in the gated tile): half the tiles for the same bytes, so
//     the fixed work of a tile (its scales, its epilogue, the ring's turnover) weighs half as
//     much where K is short (a 128-row tile of K = 1024 is only eight 128-deep blocks).
//   normal (large M_e, contiguous prefill): the tokens are the M side (BM = 64 per math
//     warpgroup), the weight rows the N side (kBlockW = 128, or 256 as two 128-column halves:
//     with every SM loading, each takes in ~40 B of stages per cycle from the L2, so the wider
//     tile's fewer bytes per FLOP are what lifts the prefill rate, docs/gemm.md runs 17 and 21).
// Two-level accumulation: the four k32 wgmmas of one 128-deep K block go into a fresh partial
// sum, which the CUDA cores scale by a_scale(token) · w_scale(block) and add into fp32.
//
// Gated (SiLU·up + FP8) tiles, masked swap-AB only: W1 = [gate; up] (N = 2·inter rows). A tile
//   loads the matching 128-row blocks of gate and up (rows w0.. and inter + w0..), each math
//   warpgroup multiplies 64 rows of each, and the epilogue (gemm_epilogue.cuh) writes
//   SiLU(gate)·up as FP8 with its 1x128 scale straight from the registers: the activation
//   never goes through HBM in BF16 and needs no kernel of its own.
//
// Masked schedule: every CTA reads masked_m, computes the tiles of each expert (none for an
// expert without tokens: its weights are never read) and a prefix sum of them, and walks the
// tile indices blockIdx.x, blockIdx.x + gridDim.x, ...; producer and consumers walk the same
// sequence, so they agree without talking.
//
// Clusters (kCluster = 2): the two CTAs of a cluster take neighbouring weight blocks of the same
// (expert, token block), so they need the same activation tile; each loads half of its rows and
// multicasts them to both, which cuts the bytes crossing L2 -> SM per 128-deep block of a 128x128
// tile from 32 KB to 24 KB. A stage is then written by both CTAs' producers, so a consumer frees
// it in both (empty[s] counts the math warps of the cluster), and neither CTA leaves while the
// other may still address its shared memory. The cluster walks cluster tiles of 2 kBlockW weight
// rows. Measured slower than single CTAs on the H200 (the L2 -> SM bytes were not the limit,
// docs/gemm.md run 9): a forced config only.
//
// Per-expert readiness (masked, gemm_ready.cuh): a GEMM may signal each stored tile into
// per-expert counters (ready_out) and the next masked GEMM may wait on them (ready_in) instead of
// on this kernel's grid, so GEMM2 streams the experts GEMM1 has finished while GEMM1 finishes the
// rest.
//
// kAffine (normal orientation): each output column n is acc · out_col_scale[e, n] + bias[e, n] before
// the BF16 rounding: an MXFP4 plan's prefill through a widened FP8 copy of its weights
// (mxfp4_fp8_copy.cuh), whose per-row factor and bias this applies as the MXFP4 kernels do.
//
// Split-K: the splits of one tile write fp32 partials to a workspace; the last split to finish
// (an atomic counter per tile, which it resets for the next launch) adds them in split order and
// writes BF16, so the result does not depend on which split finished last.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemm_epilogue.cuh"
#include "kernels/cuda/gemm_schedule.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/stamp.cuh"
#include "moekit/bf16.h"

namespace moekit::gemm_detail {

template <bool kSwapAB, bool kMasked, int kMathWGs, int kBlockT, int kBlockW, bool kGated = false, int kCluster = 1,
          bool kAffine = false>
__global__ void __launch_bounds__((kMathWGs + 1) * 128, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_w,
                        const __grid_constant__ CUtensorMap tma_sa, const KernelArgs args) {
  // A 256-row swap-AB tile is two 128-row slabs, each warpgroup multiplying 64 rows of both (the
  // gated tile's shape, with the second slab the next 128 rows instead of the up rows).
  constexpr bool kWideSwap = kSwapAB && kBlockW == 256;
  constexpr int kSlabW = kWideSwap ? 128 : kBlockW;  // weight rows of one slab
  static_assert(kSwapAB ? kSlabW == 64 * kMathWGs : kBlockT == 64 * kMathWGs, "one 64-row MMA slab per warpgroup");
  static_assert((kBlockW % 64 == 0 && kBlockW <= 128) ||
                    (kBlockW == 256 && !kGated && kCluster == 1 && (!kSwapAB || kBlockT <= 64)),
                "weight rows per tile: 64 or 128 (one 128-row scale block), or 256 (the normal orientation, or "
                "swap-AB up to 64 tokens)");
  static_assert(!kGated || (kSwapAB && kMasked && kBlockW == 128 && kBlockT <= 64),
                "gated tiles: masked swap-AB, 128 gate + 128 up rows, at most 64 tokens");
  static_assert(kCluster == 1 || (kCluster == 2 && !kGated && kBlockT >= 16),
                "clusters of 2 multicast halves of the token tile (8-row swizzle atoms); not for gated tiles");
  static_assert(!kAffine || (!kSwapAB && !kGated), "the affine epilogue (an MXFP4 plan's FP8 copy): normal orientation");
  // Weight slabs per warpgroup: gate (and up), or the two 128-row halves of a 256-row tile.
  constexpr int kSlabs = kGated || kWideSwap ? 2 : 1;
  // A 256-column tile (normal orientation) is two 128-column halves, each multiplied into one
  // partial and promoted before the other: 128 accumulator registers and 64 of partial fit a
  // consumer thread, a 256-column partial beside its accumulator would not. Each half is one
  // 128-row weight-scale block.
  constexpr int kColSlabs = !kSwapAB && kBlockW == 256 ? 2 : 1;
  constexpr int kWs = kSlabs * kColSlabs;  // weight-scale rows a tile reads per K block
  constexpr int kMathThreads = kMathWGs * 128;
  constexpr int kMmaN = kSwapAB ? kBlockT : kBlockW / kColSlabs;
  using Mma = ptx::Wgmma<kMmaN>;
  constexpr int kRegs = Mma::kRegs;
  // Slab sl's (or column half c's) accumulators at [sl * kRegs, (sl + 1) * kRegs).
  constexpr int kAccRegs = kSlabs * kColSlabs * kRegs;
  constexpr int kPartRegs = kColSlabs == 2 ? kRegs : kAccRegs;
  // The normal orientation's epilogue stages each math warp's rows in shared memory.
  constexpr int kEpiBytes = epilogue_smem_bytes(kSwapAB, kGated, kMathWGs, kBlockT);
  constexpr int kEpiWarp = kEpiBytes / (kMathWGs * 4);  // one math warp's staging rows
  using Layout = SmemLayout<kBlockT, kSlabs * kSlabW, kEpiBytes>;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = ptx::align_smem_1024(smem_raw);
  const int stages = args.num_stages;
  uint8_t* w_tiles = smem;
  uint8_t* a_tiles = w_tiles + stages * Layout::kWTile;
  float* sa_tiles = reinterpret_cast<float*>(a_tiles + stages * Layout::kATile);
  uint8_t* epi_rows = reinterpret_cast<uint8_t*>(sa_tiles + stages * Layout::kSaFloats);  // 128-byte aligned
  uint64_t* full = reinterpret_cast<uint64_t*>(epi_rows + kEpiBytes);
  uint64_t* empty = full + stages;
  int* prefix = reinterpret_cast<int*>(empty + stages);  // [E+1]
  int* m_of = prefix + args.num_experts + 1;              // [E]

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // (256-column tiles: where N is an odd multiple of 128 the last one of an expert reaches past N;
  // its second half is computed on whatever rows the TMA box holds and never stored.)
  const int num_w_blocks = ((kGated ? args.n / 2 : args.n) + kBlockW - 1) / kBlockW;
  const int k_blocks = args.k / kBlockK;

  // PDL: wait for the previous kernel, then let the next kernel's CTAs take SMs as ours leave
  // (it waits for our results itself). The trigger (once per CTA, by any thread) always follows
  // this kernel's own wait, so a kernel launched on it finds every kernel before this one
  // complete: what a dependent reads before its wait (the early weights' masked_m) can only be
  // written by this kernel. With early weights only the producer warp waits, after its first
  // loads; the consumers touch nothing the previous kernel writes except through the producer's
  // loads, and write nothing it reads.
  // kFlagWeightsReady (contiguous): the copy before this kernel waited for the kernel before it, and
  // the producer waits for the copy's row blocks tile by tile (weights_ready_wait).
  const bool early_weights = kMasked && (args.flags & kFlagPdl) && (args.flags & kFlagEarlyWeights);
  const bool weights_ready = !kMasked && (args.flags & kFlagWeightsReady);
  if (threadIdx.x == 0) trace_cta(args, kStageTraceCtaEntry);
  begin_gemm(args, early_weights || weights_ready, full, empty, kMathWGs * 4 * kCluster);
  const int rank = kCluster > 1 ? int(ptx::cluster_ctarank()) : 0;
  if constexpr (kCluster > 1) ptx::cluster_sync();  // the peer's barriers exist before we load into them
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&tma_a);
    ptx::prefetch_tensormap(&tma_w);
    ptx::prefetch_tensormap(&tma_sa);
  }
  // Tiles of the walk: a cluster's tile is kCluster weight blocks, rank r computes block r of it.
  // kFlagLastExpertFirst (masked): while thread 0 waits for the receive's publication it asks the
  // L2 for one box of the last expert's weights every second poll, this CTA's share of them (every
  // gridDim.x-th box, K block by K block, so the boxes the tiles read first come first). Every
  // poll (~4-5 TB/s over the CTAs) queued the dispatch send's round trips behind the prefetch and
  // delayed it by 2-3 us at 32 tokens per rank; every second poll still covers the expert within
  // the wait (docs/layer-gpu.md item 32).
  int next_box = blockIdx.x, polls = 0;
  auto prefetch_last_expert = [&] {
    if (!kMasked || !(args.flags & kFlagLastExpertFirst)) return;
    if (++polls % 2 != 0) return;
    const int row_blocks = args.n / kBlockW;
    if (next_box >= row_blocks * k_blocks) return;
    const int kb = next_box / row_blocks, rb = next_box - kb * row_blocks;
    ptx::prefetch_tma_2d(&tma_w, kb * kBlockK, (args.num_experts - 1) * args.n + rb * kBlockW);
    next_box += gridDim.x;
  };
  const int num_tiles = count_tiles<kMasked, kBlockT>(args, num_w_blocks / kCluster, prefix, m_of, prefetch_last_expert);
  const TileWalk walk = tile_walk<kCluster>();
  auto fetch_rows = [&](int tile) {
    BlockRows<kBlockT> rows{};
    if constexpr (!kMasked) rows = fetch_block_rows<kBlockT>(tile, args, num_w_blocks / kCluster, lane);
    return rows;
  };
  auto decode_with = [&](int tile, const BlockRows<kBlockT>& rows) {
    TileInfo t = decode_tile<kMasked, kBlockT, kBlockW * kCluster>(tile, args, num_w_blocks / kCluster, prefix, m_of,
                                                                   lane, rows);
    t.w0 += rank * kBlockW;
    return t;
  };
  auto decode = [&](int tile) { return decode_with(tile, fetch_rows(tile)); };

  if (warp < 4) {
    // ---------------- producer ----------------
    if constexpr (kMathWGs == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (warp != 0) return end_cluster<kCluster>();
    const uint64_t policy_w = ptx::policy_evict_first();
    const uint64_t policy_kept = ptx::policy_evict_unchanged();  // kFlagLastExpertFirst's expert
    const uint64_t policy_a = ptx::policy_evict_last();
    // A stage's weight rows: one box of kBlockW rows (a 256-row swap-AB tile's two slabs are one
    // box: the rows lie in smem as two stacked 128-row slabs), or (gated) the gate box and the
    // up box inter rows further down.
    auto load_w = [&](int stage, int kb, const TileInfo& t) {
      const bool kept = (args.flags & kFlagLastExpertFirst) && t.e == args.num_experts - 1;
      if (weights_ready && kb == t.kb_begin) weights_ready_wait<kBlockW>(args, t.e, t.w0);
#pragma unroll
      for (int sl = 0; sl < (kGated ? 2 : 1); ++sl)
        ptx::tma_load_2d(w_tiles + stage * Layout::kWTile + sl * kBlockW * kBlockK, &tma_w, &full[stage],
                         kb * kBlockK, t.e * args.n + t.w0 + sl * (args.n / 2), kept ? policy_kept : policy_w);
    };
    auto load_a = [&](int stage, int kb, const TileInfo& t) {
      const int a_row = kMasked ? t.e * args.rows + t.t0 : t.t0;
      const int sa_row = kMasked ? t.e * k_blocks : 0;
      if constexpr (kCluster == 1) {
        ptx::tma_load_2d(a_tiles + stage * Layout::kATile, &tma_a, &full[stage], kb * kBlockK, a_row, policy_a);
      } else {  // this CTA's half of the rows, to both CTAs (tma_a's box is kBlockT / 2 rows)
        constexpr int kHalf = kBlockT / 2;
        ptx::tma_load_2d_multicast(a_tiles + stage * Layout::kATile + rank * kHalf * kBlockK, &tma_a, &full[stage],
                                   kb * kBlockK, a_row + rank * kHalf, 0x3, policy_a);
      }
      ptx::tma_load_2d(sa_tiles + stage * Layout::kSaFloats, &tma_sa, &full[stage], t.t0, sa_row + kb, policy_a);
    };
    produce(args, num_tiles, walk, full, empty, Layout::kTxBytes, early_weights, decode, load_w, load_a);
    return end_cluster<kCluster>();
  }

  // ---------------- consumers ----------------
  if constexpr (kMathWGs == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  // Through a shuffle from lane 0, so that the compiler knows it is the same in every lane and
  // keeps the descriptor arithmetic below on the uniform datapath (run 22).
  const int wg = __shfl_sync(0xFFFFFFFFu, warp / 4, 0) - 1;
  const int warp_in_wg = warp % 4;
  const int mtid = threadIdx.x - 128;  // 0 .. kMathThreads-1
  // Lower descriptor words of ring stage 0; stage s is s tiles further (ptx::smem_desc_sw128).
  const uint32_t w_desc0 = ptx::smem_desc_sw128_lo(w_tiles);
  const uint32_t a_desc0 = ptx::smem_desc_sw128_lo(a_tiles);
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
  // Row j of a gated tile is the up block, inter rows further down; of a 256-row tile, the
  // second half's scale block (clamped to the expert's last block for a tile that reaches past N).
  struct WScales {
    float lo[kWs], hi[kWs];
  };
  auto load_ws = [&](const TileInfo& t, int base, WScales& ws) {
#pragma unroll
    for (int j = 0; j < kWs; ++j) {
      const int first = (t.w0 + (kGated ? j * (args.n / 2) : 0)) / kBlockK;
      const int w_block = kGated ? first : min(first + j, args.n / kBlockK - 1);
      const float* row = args.w_scales + (size_t(t.e) * (args.n / kBlockK) + w_block) * k_blocks;
      ws.lo[j] = base + lane < t.kb_end ? __ldg(row + base + lane) : 0.0f;
      ws.hi[j] = base + 32 + lane < t.kb_end ? __ldg(row + base + 32 + lane) : 0.0f;
    }
  };
  // The first tile at or after `tile` with work; rows: `tile`'s, fetched earlier.
  auto next_tile_from = [&](int tile, TileInfo& t, BlockRows<kBlockT> rows) {
    for (; tile < num_tiles; tile += walk.stride) {
      t = decode_with(tile, rows);
      if (t.e >= 0) break;
      if (tile + walk.stride < num_tiles) rows = fetch_rows(tile + walk.stride);
    }
    return tile;
  };
  auto next_tile = [&](int tile, TileInfo& t) { return tile < num_tiles ? next_tile_from(tile, t, fetch_rows(tile)) : tile; };
  TileInfo t{};
  int tile = next_tile(walk.first, t);
  if (mtid == 0) trace_cta(args, kStageTraceCtaBegin);
  int consumed = 0;  // stages waited for (MaskedGemm::set_stage_trace)
  long long* const tracer = stage_tracer(args);
  WScales ws{};
  if (tile < num_tiles) load_ws(t, t.kb_begin, ws);
  while (tile < num_tiles) {
    // The next tile: masked, decoded from shared memory now; contiguous, its rows' experts are
    // fetched now and decoded after this tile's k blocks (a decode here waited for them, a tenth
    // of the consumers' time at K = 2048, run 10). Its weight scales are used from its first
    // block on, after this tile's epilogue.
    TileInfo t_next{};
    int tile_next = tile + walk.stride;
    WScales ws_next{};
    BlockRows<kBlockT> ahead{};
    if constexpr (kMasked) {
      tile_next = next_tile(tile_next, t_next);
      if (tile_next < num_tiles) load_ws(t_next, t_next.kb_begin, ws_next);
    } else if (tile_next < num_tiles) {
      ahead = fetch_rows(tile_next);
    }
    float acc[kAccRegs];
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.0f;
    float part[kPartRegs];
    int ws_base = t.kb_begin;
    for (int kb = t.kb_begin; kb < t.kb_end; ++kb) {
      if (kb - ws_base == 64) {
        ws_base = kb;
        load_ws(t, ws_base, ws);
      }
      const int j = kb - ws_base;
      float wsc[kWs];
#pragma unroll
      for (int w = 0; w < kWs; ++w) wsc[w] = __shfl_sync(0xFFFFFFFFu, j < 32 ? ws.lo[w] : ws.hi[w], j & 31);
      trace_at(tracer, consumed, kStageTraceWaitBegin);
      ptx::mbar_wait(&full[s], phase);
      trace_at(tracer, consumed, kStageTraceWaitEnd);
      ++consumed;
      const float* sa = sa_tiles + s * Layout::kSaFloats;
      // Per-register combined scale: a_scale of the register's token times the block's w_scale.
      // Normal orientation: [slab][row][scale block: the column half of a 256-column tile].
      float scale_a[kSlabs][kSwapAB ? kBlockT / 8 : 2][2];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl) {
        if constexpr (kSwapAB) {
#pragma unroll
          for (int j = 0; j < kBlockT / 8; ++j) {
            float2 v = *reinterpret_cast<const float2*>(sa + j * 8 + frag_col);
            scale_a[sl][j][0] = v.x * wsc[sl];
            scale_a[sl][j][1] = v.y * wsc[sl];
          }
        } else {
          const float sa0 = sa[frag_row], sa1 = sa[frag_row + 8];
          scale_a[sl][0][0] = sa0 * wsc[sl * kColSlabs];
          scale_a[sl][1][0] = sa1 * wsc[sl * kColSlabs];
          if constexpr (kColSlabs == 2) {
            scale_a[sl][0][1] = sa0 * wsc[sl * kColSlabs + 1];
            scale_a[sl][1][1] = sa1 * wsc[sl * kColSlabs + 1];
          }
        }
      }
      const uint32_t w_desc = w_desc0 + s * (Layout::kWTile >> 4);
      const uint32_t a_desc = a_desc0 + s * (Layout::kATile >> 4);
      if constexpr (kColSlabs == 2) {
        // Column half c: its four wgmmas into the partial, wait, promote with scale block c; the
        // other warpgroup's wgmmas keep the tensor cores busy meanwhile (bench_wgmma: two
        // warpgroups that each wait and promote run at the full tensor rate).
        const uint32_t desc_m = a_desc + wg * 64 * kBlockK / 16;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint32_t desc_n = w_desc + c * 128 * kBlockK / 16;
#pragma unroll
          for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[i]);
          ptx::wgmma_fence();
#pragma unroll
          for (int k = 0; k < kBlockK / 32; ++k)
            Mma::mma(part, ptx::smem_desc_sw128(desc_m + 2 * k), ptx::smem_desc_sw128(desc_n + 2 * k), k > 0);
          ptx::wgmma_commit();
          ptx::wgmma_wait<0>();
#pragma unroll
          for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[i]);
          if (c == 1 && lane == 0) ptx::mbar_arrive(&empty[s]);
#pragma unroll
          for (int i = 0; i < kRegs; ++i)
            acc[c * kRegs + i] = fmaf(part[i], scale_a[0][(i / 2) % 2][c], acc[c * kRegs + i]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kAccRegs; ++i) ptx::fence_operand(part[i]);
        ptx::wgmma_fence();
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          const uint32_t desc_m =
              kSwapAB ? w_desc + (sl * kSlabW + wg * 64) * kBlockK / 16 : a_desc + wg * 64 * kBlockK / 16;
          const uint32_t desc_n = kSwapAB ? a_desc : w_desc;
#pragma unroll
          for (int k = 0; k < kBlockK / 32; ++k)
            Mma::mma(part + sl * kRegs, ptx::smem_desc_sw128(desc_m + 2 * k), ptx::smem_desc_sw128(desc_n + 2 * k), k > 0);
        }
        ptx::wgmma_commit();
        trace_at(tracer, consumed - 1, kStageTraceMmaIssued);
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kAccRegs; ++i) ptx::fence_operand(part[i]);
        trace_at(tracer, consumed - 1, kStageTraceReleased);
        if constexpr (kCluster == 1) {
          if (lane == 0) ptx::mbar_arrive(&empty[s]);
        } else if (lane < kCluster) {
          ptx::mbar_arrive_cluster(&empty[s], lane);  // lane r frees the stage in CTA r
        }
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
#pragma unroll
          for (int i = 0; i < kRegs; ++i) {
            const float sc = kSwapAB ? scale_a[sl][i / 4][i % 2] : scale_a[sl][(i / 2) % 2][0];
            acc[sl * kRegs + i] = fmaf(part[sl * kRegs + i], sc, acc[sl * kRegs + i]);
          }
        }
      }
      if (++s == stages) s = 0, phase ^= 1;
    }

    if constexpr (!kMasked) {
      if (tile_next < num_tiles) tile_next = next_tile_from(tile_next, t_next, ahead);
      if (tile_next < num_tiles) load_ws(t_next, t_next.kb_begin, ws_next);
    }

    // ---------------- split-K reduction ----------------
    // (256-column tiles have no split-K: its reduction of 128 accumulators per thread made ptxas
    // spill around every tile, and the plan refuses the config.)
    bool store = true;
    if constexpr (kColSlabs == 1) {
      store = args.num_splits == 1 || reduce_splits<kAccRegs, kMathThreads>(args, t, acc, mtid, &last_flag);
    }

    // ---------------- epilogue, straight from the registers ----------------
    const Fragment f{frag_row, frag_col, mtid, warp - 4};
    if (!store) {
    } else if constexpr (kGated) {
      store_silu_mul_fp8<kBlockT, kRegs, kMathThreads>(args, t, acc, acc + kRegs, f);
    } else if constexpr (kSwapAB) {
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl) {  // a 256-row tile: slab 1 is the next 128 output columns
        TileInfo ts = t;
        ts.w0 += sl * kSlabW;
        if constexpr (stages_transposed(kSwapAB, kGated, kBlockT)) {
          store_bf16_transposed_staged<kMasked, kBlockT, kRegs>(args, ts, acc + sl * kRegs, f,
                                                                epi_rows + (warp - 4) * kEpiWarp);
        } else {
          store_bf16_transposed<kMasked, kBlockT, kRegs>(args, ts, acc + sl * kRegs, f);
        }
      }
    } else {
      store_bf16<kMasked, kAccRegs, kAffine>(args, t, acc, f, epi_rows + (warp - 4) * kEpiWarp);
    }
    if constexpr (kMasked) {
      if (store && args.ready_out) expert_ready_add<kMathThreads, kBlockW, kBlockT>(args, t, mtid);
    }
    t = t_next;
    tile = tile_next;
    ws = ws_next;
  }
  if constexpr (kMasked) {
    if (args.ready_in) expert_ready_reset<kMathThreads>(args, mtid, &last_flag);
  } else {
    if (weights_ready) weights_ready_reset<kMathThreads>(args, mtid, &last_flag);
  }
  if (mtid == 0) {
    stamp_end(args.stamp);
    trace_cta(args, kStageTraceCtaEnd);
  }
  end_cluster<kCluster>();
}

}  // namespace moekit::gemm_detail
