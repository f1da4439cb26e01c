// gemm_mxfp4_widen.cuh: the MXFP4 grouped GEMM with a widening warpgroup, for sm_90a; masked and
// contiguous, swap-AB only. The same contract, plans, schedule and numerics as gemm_mxfp4.cuh
// (GemmConfig::mxfp4_widen_wgs picks this kernel); what differs is who widens the weights.
//
// In gemm_mxfp4.cuh every math thread widens its own A fragments into registers, so each stage's
// widening sits on the math warps' own dependency chain (shared load -> scale field -> table ->
// prmt -> wgmma), and each row's four e4m3 tables are computed by the four threads of a quad that
// hold it. Here the roles are split, as the producer's already are (512 threads):
//   warpgroup 0  two TMA warps (codes and scale words; activations and their scales), as before;
//   widening     kWidenWGs warpgroups (1, or 2 taking alternate stages): thread r takes weight row
//                r of a stage, computes its four tables once, widens its 128 codes and writes them
//                as e4m3 into a 128-byte-swizzled tile of the widened ring, then fences the writes
//                to the async proxy and arrives on the slot's `wide_full` barrier;
//   math         3 - kWidenWGs warpgroups: the FP8 kernel's swap-AB stage (gemm_fp8.cuh), four
//                shared-memory wgmmas per 128-deep block and 64-row slab (two slabs per warpgroup
//                when there is one), the widened tile as A, the activations as B, and the promotion
//                acc += part · a_scale(token) (the row factor after the K loop).
// The widening warps run ahead of the math warps by as many stages as the ring holds, so the math
// warps' chain is the FP8 kernel's and the widening needs only to keep up with the HBM stream.
//
// Shared memory: a ring of stages as in gemm_mxfp4.cuh (the activation tile, the packed codes,
// 8 KB, the scale words, the activation scales; full and empty barriers), and beside it a ring of
// kWideSlots widened tiles (16 KB each; wide_full: the widening warps, wide_empty: the math warps).
// The widened ring is short on purpose: the stages are what keeps HBM busy (at the copy rate an SM
// takes ~8.5 KB of codes per ~520 cycles, and ~1.5 us of latency wants ~60 KB of them in flight),
// and a 16 KB widened tile in every stage would halve how many fit. The codes arrive by TMA with
// the 64-byte swizzle (16-byte unit q of row r lands at unit q ^ ((r >> 1) & 3)), so that eight
// threads reading unit q of eight consecutive rows hit eight different bank groups; the bytes in
// global memory are mxfp4_codes_for_gemm's, unchanged.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemm_mxfp4_parts.cuh"
#include "kernels/cuda/mxfp4_convert.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/stamp.cuh"

namespace moekit::gemm_detail {

// Shared memory of the widening kernel, in order: the kWideSlots widened tiles, the stages'
// activation tiles (both 1024-aligned for the 128-byte swizzle: every tile is a multiple of 1024
// bytes), packed code tiles, scale-word tiles, activation-scale rows, the stages' full and empty
// barriers, the widened tiles' full and empty barriers, then (masked) prefix [E+1] and m_of [E].
template <int kBlockT>
struct Mxfp4WidenSmemLayout : Mxfp4SmemLayout<kBlockT> {  // its stage ring and what a stage holds
  using Stage = Mxfp4SmemLayout<kBlockT>;
  static constexpr int kWideSlots = 4;
  static constexpr int kWideTile = Stage::kWRows * kBlockK;
  static constexpr int kWideBytes = kWideSlots * (kWideTile + 16);
  static_assert(Stage::kATile % 1024 == 0, "activation tiles keep the next tile 1024-aligned");
  static int bytes(int stages, int num_experts) {
    return 1024 + kWideBytes + stages * Stage::kStageBytes + (2 * num_experts + 1) * 4;
  }
};

// Registers of the four warpgroups (setmaxnreg draws on the CTA's own pool): 128 per thread at
// launch (__launch_bounds__(512, 1)); the producer gives back down to 40, each widening warpgroup
// to 72 (its row's codes, tables and one 32-byte pair of chunks at a time), and the math
// warpgroups take the rest: 200 each for two (a 128-token tile's partial and accumulators,
// 64 + 64, and its activation scales fit), setmaxnreg's 256 for one (two slabs of up to 64 tokens).
template <int kWidenWGs>
struct Mxfp4WidenRegisters {
  static constexpr int kThreads = 512;
  static constexpr int kLaunch = 65536 / kThreads / 8 * 8;
  static constexpr int kProducer = 40;
  static constexpr int kWiden = 72;
  static constexpr int kMathWGs = 3 - kWidenWGs;
  static constexpr int kRest = (kThreads * kLaunch - 128 * kProducer - 128 * kWidenWGs * kWiden) / (128 * kMathWGs);
  static constexpr int kMath = (kRest > 256 ? 256 : kRest) / 8 * 8;
};

// Row `row` of one stage: its 64 bytes of codes (64-byte swizzled, see the header) and scale word,
// widened into its 128 e4m3 bytes of the 128-byte-swizzled tile `wide` (chunk c of row r at
// c ^ (r & 7): eight consecutive rows write eight different bank groups). The codes hold, per
// 16-byte unit q, one word per k32 slice s with the values at the GEMM's positions 32s + 4q .. +3
// and 32s + 16 + 4q .. +3 (mxfp4_codes_for_gemm, the order of a register A fragment), all of
// scale group q in the GEMM's K order (mxfp4.h), so chunk 2s is the first halves of slice s's four
// words and chunk 2s + 1 their second halves, and unit q's words take group q's table.
__device__ __forceinline__ void widen_row(const uint8_t* codes, uint32_t scale_word, uint8_t* wide, int row) {
  uint32_t c[4][4];  // [q][s]
  const int code_xor = (row >> 1) & 3;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint4 u = *reinterpret_cast<const uint4*>(codes + row * (kBlockK / 2) + ((q ^ code_xor) * 16));
    c[q][0] = u.x, c[q][1] = u.y, c[q][2] = u.z, c[q][3] = u.w;
  }
  uint2 table[4];
  if (mxfp4_detail::block_shifts_fast(scale_word)) {
#pragma unroll
    for (int g = 0; g < 4; ++g)
      table[g] = mxfp4_detail::e4m3_table_fast(mxfp4_detail::group_shift_field(scale_word, g));
  } else {  // out of line, as in gemm_mxfp4.cuh: rare, and inlined it would double the loop
#pragma unroll
    for (int g = 0; g < 4; ++g)
      table[g] = mxfp4_detail::e4m3_table_outlined(mxfp4_detail::group_shift_field(scale_word, g));
  }
  uint8_t* out = wide + row * kBlockK;
  const int wide_xor = row & 7;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint2 v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = mxfp4_detail::e2m1x8_to_e4m3(c[q][s], table[q]);
    *reinterpret_cast<uint4*>(out + (((2 * s) ^ wide_xor) * 16)) = make_uint4(v[0].x, v[1].x, v[2].x, v[3].x);
    *reinterpret_cast<uint4*>(out + (((2 * s + 1) ^ wide_xor) * 16)) = make_uint4(v[0].y, v[1].y, v[2].y, v[3].y);
  }
}

template <bool kMasked, int kBlockT, int kWidenWGs>
__global__ void __launch_bounds__(512, 1)
    grouped_gemm_mxfp4_widen_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_w,
                                    const __grid_constant__ CUtensorMap tma_sa,
                                    const __grid_constant__ CUtensorMap tma_ws, const KernelArgs args) {
  static_assert(kWidenWGs == 1 || (kWidenWGs == 2 && kBlockT <= 64),
                "one widening warpgroup, or two beside one math warpgroup holding two slabs of up to 64 tokens");
  constexpr int kBlockW = 128, kMathWGs = 3 - kWidenWGs, kMathThreads = 128 * kMathWGs;
  constexpr int kSlabs = 2 / kMathWGs;  // 64-row slabs of the tile per math warpgroup
  using Mma = ptx::Wgmma<kBlockT>;
  constexpr int kRegs = Mma::kRegs;
  using Layout = Mxfp4WidenSmemLayout<kBlockT>;
  using Regs = Mxfp4WidenRegisters<kWidenWGs>;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = ptx::align_smem_1024(smem_raw);
  const int stages = args.num_stages;
  constexpr int kWideSlots = Layout::kWideSlots;
  uint8_t* wide_tiles = smem;
  uint8_t* a_tiles = wide_tiles + kWideSlots * Layout::kWideTile;
  uint8_t* code_tiles = a_tiles + stages * Layout::kATile;
  uint8_t* ws_tiles = code_tiles + stages * Layout::kWTile;
  float* sa_tiles = reinterpret_cast<float*>(ws_tiles + stages * Layout::kWsTile);
  uint64_t* full = reinterpret_cast<uint64_t*>(sa_tiles + stages * Layout::kSaFloats);
  uint64_t* empty = full + stages;
  uint64_t* wide_full = empty + stages;
  uint64_t* wide_empty = wide_full + kWideSlots;
  int* prefix = reinterpret_cast<int*>(wide_empty + kWideSlots);  // [E+1]
  int* m_of = prefix + args.num_experts + 1;              // [E]

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_w_blocks = args.n / kBlockW;
  const int k_blocks = args.k / kBlockK;

  const bool early_weights = kMasked && (args.flags & kFlagPdl) && (args.flags & kFlagEarlyWeights);
  if (threadIdx.x == 0) {  // (begin_gemm's fence makes these visible too)
    for (int w = 0; w < kWideSlots; ++w) {
      ptx::mbar_init(&wide_full[w], 4);               // the warps of the widening warpgroup
      ptx::mbar_init(&wide_empty[w], 4 * kMathWGs);   // the math warps
    }
  }
  begin_gemm(args, early_weights, full, empty, 4 * kMathWGs, 2);  // two producer warps
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&tma_a);
    ptx::prefetch_tensormap(&tma_w);
    ptx::prefetch_tensormap(&tma_sa);
    ptx::prefetch_tensormap(&tma_ws);
  }
  const int num_tiles = count_tiles<kMasked, kBlockT>(args, num_w_blocks, prefix, m_of);
  auto decode = [&](int tile) {
    return decode_tile<kMasked, kBlockT, kBlockW>(tile, args, num_w_blocks, prefix, m_of, lane);
  };

  if (warp < 4) {
    // ---------------- producer (gemm_mxfp4_parts.cuh) ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Regs::kProducer));
    produce_mxfp4<kMasked, kBlockT, Layout>(args, num_tiles, early_weights, decode, full, empty, code_tiles, ws_tiles,
                                            a_tiles, sa_tiles, &tma_a, &tma_w, &tma_sa, &tma_ws);
    return;
  }

  // The position in both rings: stage s of the stage ring, slot w of the widened ring.
  int s = 0, w = 0;
  uint32_t phase = 0, wide_phase = 0;
  auto advance = [&] {
    if (++s == stages) s = 0, phase ^= 1;
    if (++w == kWideSlots) w = 0, wide_phase ^= 1;
  };

  if (warp < 4 + 4 * kWidenWGs) {
    // ---------------- widening ----------------
    // Every stage of this CTA's walk, in the producer's order (warpgroup g of two: the stages
    // g, g + 2, ...); thread r widens row r into the widened ring's next slot once the math warps
    // have freed it (their wgmmas that read it have completed).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Regs::kWiden));
    const int row = threadIdx.x % 128;
    const int widen_wg = warp / 4 - 1;
    int iter = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileInfo t = decode(tile);
      if (t.e < 0) continue;
      for (int kb = t.kb_begin; kb < t.kb_end; ++kb, ++iter) {
        if (kWidenWGs == 2 && iter % 2 != widen_wg) {
          advance();
          continue;
        }
        ptx::mbar_wait(&full[s], phase);
        ptx::mbar_wait(&wide_empty[w], wide_phase ^ 1);  // (the first lap passes at once)
        const uint32_t word = reinterpret_cast<const uint32_t*>(ws_tiles + s * Layout::kWsTile)[row];
        widen_row(code_tiles + s * Layout::kWTile, word, wide_tiles + w * Layout::kWideTile, row);
        ptx::fence_proxy_async_smem();  // our generic stores, before the wgmmas (async proxy) read them
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&wide_full[w]);
        advance();
      }
    }
    return;
  }

  // ---------------- math ----------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Regs::kMath));
  // Through a shuffle from lane 0, so that the descriptor arithmetic stays on the uniform datapath
  // (gemm_fp8.cuh).
  const int wg = __shfl_sync(0xFFFFFFFFu, warp / 4, 0) - 1 - kWidenWGs;
  const int warp_in_wg = warp % 4;
  const int mtid = threadIdx.x - 128 * (1 + kWidenWGs);
  // This warpgroup's first slab (64 rows); slab sl is sl · 64 rows further.
  const uint32_t wide_desc0 = ptx::smem_desc_sw128_lo(wide_tiles) + wg * kSlabs * 64 * kBlockK / 16;
  const uint32_t a_desc0 = ptx::smem_desc_sw128_lo(a_tiles);
  const int frag_row = wg * kSlabs * 64 + warp_in_wg * 16 + lane / 4;  // + 8, and + 64 · sl for slab sl
  const int frag_col = (lane % 4) * 2;
  __shared__ int last_flag;

  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileInfo t = decode(tile);
    if (t.e < 0) continue;
    uint2 row_words[kSlabs];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
      row_words[sl] = mxfp4_row_words(args, t, frag_row + 64 * sl, num_w_blocks, k_blocks);
    float acc[kSlabs * kRegs], part[kSlabs * kRegs];
#pragma unroll
    for (int i = 0; i < kSlabs * kRegs; ++i) acc[i] = 0.0f;
    for (int kb = t.kb_begin; kb < t.kb_end; ++kb) {
      // The widening warps waited for `full` before they filled the slot; waiting on it here too
      // (it has completed by then) makes the TMA-written activations visible to these threads
      // without relying on that chain.
      ptx::mbar_wait(&full[s], phase);
      ptx::mbar_wait(&wide_full[w], wide_phase);
      TokenScales<kBlockT> sa;
      sa.load(sa_tiles + s * Layout::kSaFloats, frag_col);
      const uint32_t wide_desc = wide_desc0 + w * (Layout::kWideTile >> 4);
      const uint32_t a_desc = a_desc0 + s * (Layout::kATile >> 4);
#pragma unroll
      for (int i = 0; i < kSlabs * kRegs; ++i) ptx::fence_operand(part[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl) {
#pragma unroll
        for (int k = 0; k < kBlockK / 32; ++k)
          Mma::mma(part + sl * kRegs, ptx::smem_desc_sw128(wide_desc + sl * 64 * kBlockK / 16 + 2 * k),
                   ptx::smem_desc_sw128(a_desc + 2 * k), k > 0);
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kSlabs * kRegs; ++i) ptx::fence_operand(part[i]);
      __syncwarp();  // every lane's scale loads before lane 0 hands the stage back to the producer
      if (lane == 0) {
        ptx::mbar_arrive(&empty[s]);
        ptx::mbar_arrive(&wide_empty[w]);
      }
#pragma unroll
      for (int i = 0; i < kSlabs * kRegs; ++i) acc[i] = fmaf(part[i], sa.of(i % kRegs), acc[i]);  // every slab: the same tokens
      advance();
    }
    store_mxfp4_tile<kMasked, kBlockT, kRegs, kMathThreads, kSlabs>(
        args, t, acc, row_words, Fragment{frag_row, frag_col, mtid, mtid / 32}, &last_flag);
  }
  if (mtid == 0) stamp_end(args.stamp);
}

}  // namespace moekit::gemm_detail
