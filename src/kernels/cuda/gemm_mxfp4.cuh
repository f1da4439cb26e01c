// gemm_mxfp4.cuh: the grouped GEMM with MXFP4 weights (gpt-oss) and FP8 activations, for sm_90a;
// masked (decode) and contiguous (prefill) layouts, swap-AB only.
//
// It is the FP8 kernel (gemm_fp8.cuh: persistent CTAs, one TMA producer warp, a ring of stages
// with full/empty mbarriers, the same tile schedule, two-level accumulation, split-K and BF16
// epilogue) with the weights taken from registers: a weight stage holds 128 rows x 128 K of
// packed e2m1 codes (64 B a row) and one 32-bit word per row with its 4 e8m0 scales re-encoded
// (mxfp4_scales_for_gemm; 4.25 bits per weight read from HBM),
// and every math thread widens the codes of its own A fragment (mxfp4_convert.cuh) straight into
// the registers of a register-sourced wgmma: no widened tile goes through shared memory, and no
// barrier or proxy fence stands between the widening and the tensor core. The codes are stored
// in the order of those fragments (mxfp4_codes_for_gemm, mxfp4.h): a thread's 64 codes of one row
// and stage are 16 consecutive bytes, one conflict-free 16-byte load. K runs in the MXFP4 GEMM's
// order (mxfp4.h), both operands: every value a quad lane holds is of one 32-value scale group,
// so a thread makes two e4m3 tables per stage (its two rows) instead of eight. Tiles of up to 64 tokens
// keep two partials in flight: stage kb's wgmmas run while kb - 1 is promoted and kb + 1 widened;
// 128-token tiles have room for one, and widen kb + 1 while kb's wgmmas run. (Two CTAs per SM,
// for twice the math warps per scheduler in half the registers, measured 7-20% slower: the
// widening needs fewer instructions per stage, not more warps; docs/gemm-mxfp4.md run 22.)
//
// Weights are the MMA's M side (64 rows per math warpgroup, 128 per tile) because only the A
// operand may come from registers; tokens (16..128 per tile) are the N side, which suits decode
// and prefill alike. Promotion of a block partial: acc += part · a_scale(token); the row factor
// 2^(base - 127) (mxfp4_convert.cuh), one per row for the whole K, multiplies the sum once after
// the K loop, before split-K's reduction and the bias.
// With one activation scale per row (kRowScales: ContiguousGemmProblem::a_row_scales,
// MaskedGemmProblem::a_row_scales) there is no block partial at all: the K loop accumulates in
// acc, and the token's scale multiplies once, before the row factor.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemm_epilogue.cuh"
#include "kernels/cuda/gemm_mxfp4_parts.cuh"
#include "kernels/cuda/gemm_schedule.cuh"
#include "kernels/cuda/mxfp4_convert.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/stamp.cuh"

namespace moekit::gemm_detail {

// The A fragments of one stage for this thread: a[s] for the four k32 slices, rows r and r + 8 of
// its warp (codes_*: the row's 16 bytes, mxfp4_codes_for_gemm's words; scales_*: the row's scale
// word of the block). In the GEMM's K order (mxfp4.h) all of a quad lane's values are in scale group
// q = lane % 4, so the thread makes the two tables of that group alone (the natural order needed
// all four groups' tables in every lane, eight per stage, each made by the quad's four lanes).
__device__ __forceinline__ void widen_stage(const uint4& codes_r, const uint4& codes_r8, uint32_t scales_r,
                                            uint32_t scales_r8, uint32_t (&a)[4][4]) {
  const uint32_t words_r[4] = {codes_r.x, codes_r.y, codes_r.z, codes_r.w};
  const uint32_t words_r8[4] = {codes_r8.x, codes_r8.y, codes_r8.z, codes_r8.w};
  const int q = threadIdx.x % 4;
  uint2 t_r, t_r8;
  if (mxfp4_detail::block_shifts_fast(scales_r & scales_r8)) {  // one branch per stage, nearly always taken
    t_r = mxfp4_detail::e4m3_table_fast(mxfp4_detail::group_shift_field(scales_r, q));
    t_r8 = mxfp4_detail::e4m3_table_fast(mxfp4_detail::group_shift_field(scales_r8, q));
  } else {  // out of line: inlined, its rounded tables made every loop copy twice as long
    t_r = mxfp4_detail::e4m3_table_outlined(mxfp4_detail::group_shift_field(scales_r, q));
    t_r8 = mxfp4_detail::e4m3_table_outlined(mxfp4_detail::group_shift_field(scales_r8, q));
  }
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint2 lo = mxfp4_detail::e2m1x8_to_e4m3(words_r[s], t_r);
    const uint2 hi = mxfp4_detail::e2m1x8_to_e4m3(words_r8[s], t_r8);
    a[s][0] = lo.x;  // row r,     positions 32s + 4q .. +3
    a[s][1] = hi.x;  // row r + 8, positions 32s + 4q .. +3
    a[s][2] = lo.y;  // row r,     positions 32s + 16 + 4q ..
    a[s][3] = hi.y;  // row r + 8, positions 32s + 16 + 4q ..
  }
}

// How a CTA's registers are split between its producer warpgroup and its two math warpgroups
// (setmaxnreg draws on the CTA's own pool: the registers its 384 threads were launched with).
// kLaunch is what __launch_bounds__(384, 1) leaves a thread (the SM's 64K registers, rounded down
// to ptxas's granularity of 8): 168; the producer gives back down to 40 and the consumers take the
// rest, 232.
struct Mxfp4Registers {
  static constexpr int kThreads = 384;
  static constexpr int kLaunch = 65536 / kThreads / 8 * 8;
  static constexpr int kProducer = 40;
  static constexpr int kConsumer = (kThreads * kLaunch - 128 * kProducer) / 256 / 8 * 8;
};

// kSlabs = 2: tiles of 256 weight rows, two 128-row slabs per stage sharing its activation tile;
// each math warpgroup multiplies its 64 rows of both (half the activation loads, full-barrier
// waits and hand-backs per weight byte, and two independent widenings per stage). N a multiple
// of 128 (an odd one computes the last tile's second slab on the next rows, and does not store
// it); tiles of up to 32 tokens in the two-partial loop, 48 in the one-partial loop (two partials
// of two 48-token slabs spill 516 bytes at ptxas's 168 registers; one does not).
// kRowScales (ContiguousGemmProblem::a_row_scales with one slab, MaskedGemmProblem::a_row_scales
// with either): one activation scale per row for all of K, so the whole K accumulates in the
// tensor core and the scale multiplies once at the end.
template <bool kMasked, int kBlockT, int kSlabs = 1, bool kRowScales = false>
__global__ void __launch_bounds__(384, 1)
    grouped_gemm_mxfp4_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_w,
                              const __grid_constant__ CUtensorMap tma_sa, const __grid_constant__ CUtensorMap tma_ws,
                              const KernelArgs args) {
  // Two math warpgroups hold a tile's 128 rows. (Four, two pairs taking a tile's k blocks in
  // turn, measured no faster: docs/gemm-mxfp4.md, runs 6 and 8.)
  constexpr int kMathWGs = 2, kBlockW = 128 * kSlabs, kMathThreads = 256;
  static_assert(kSlabs == 1 || (kSlabs == 2 && kBlockT <= 48), "256-row tiles: up to 48 tokens");
  static_assert(!kRowScales || kMasked || kSlabs == 1, "row scales: contiguous plans of one slab");
  // Stage pipelining needs a second partial in registers: up to 64 tokens per tile, 32 with two slabs.
  constexpr bool kPipelined = kBlockT <= (kSlabs == 1 ? 64 : 32);
  // Stages issued in pairs (two pairs in flight: four partials in registers): up to 32 tokens, one
  // slab (a 256-row stage is already two slabs' widening and eight wgmmas; four partials of two
  // slabs do not fit ptxas's 168 registers, which then serialises every wgmma).
  constexpr bool kPaired = kBlockT <= 32 && kSlabs == 1;
  using Mma = ptx::WgmmaRS<kBlockT>;
  constexpr int kRegs = Mma::kRegs;
  constexpr int kAccRegs = kSlabs * kRegs;  // slab sl: registers sl·kRegs ..
  using Layout = Mxfp4SmemLayout<kBlockT, kSlabs>;
  using Regs = Mxfp4Registers;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = ptx::align_smem_1024(smem_raw);
  const int stages = args.num_stages;
  uint8_t* a_tiles = smem;
  uint8_t* w_tiles = a_tiles + stages * Layout::kATile;
  uint8_t* ws_tiles = w_tiles + stages * Layout::kWTile;
  float* sa_tiles = reinterpret_cast<float*>(ws_tiles + stages * Layout::kWsTile);
  uint64_t* full = reinterpret_cast<uint64_t*>(sa_tiles + stages * Layout::kSaFloats);
  uint64_t* empty = full + stages;
  int* prefix = reinterpret_cast<int*>(empty + stages);  // [E+1]
  int* m_of = prefix + args.num_experts + 1;              // [E]

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // Tiles per expert and token block. With two slabs and N an odd multiple of 128 the last tile's
  // second slab lies past N: its stage holds the next expert's first row block (or, after the last
  // expert, TMA's zero fill), its products are computed and not stored (store_mxfp4_tile).
  const int num_w_blocks = (args.n + kBlockW - 1) / kBlockW;
  const int row_blocks = args.n / 128;        // the layout's 128-row blocks
  const int k_blocks = args.k / kBlockK;

  // PDL as in gemm_fp8.cuh: the trigger always follows this kernel's own wait.
  const bool early_weights = kMasked && (args.flags & kFlagPdl) && (args.flags & kFlagEarlyWeights);
  if (threadIdx.x == 0) trace_cta(args, kStageTraceCtaEntry);
  begin_gemm(args, early_weights, full, empty, kMathWGs * 4, 2);  // two producer warps (below)
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&tma_a);
    ptx::prefetch_tensormap(&tma_w);
    ptx::prefetch_tensormap(&tma_sa);
    ptx::prefetch_tensormap(&tma_ws);
  }
  const int num_tiles = count_tiles<kMasked, kBlockT>(args, num_w_blocks, prefix, m_of);

  if (warp < 4) {
    // ---------------- producer ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Regs::kProducer));
    auto decode = [&](int tile) {
      return decode_tile<kMasked, kBlockT, kBlockW>(tile, args, num_w_blocks, prefix, m_of, lane);
    };
    produce_mxfp4<kMasked, kBlockT, Layout, !kRowScales || kMasked>(
        args, num_tiles, early_weights, decode, full, empty, w_tiles, ws_tiles, a_tiles, sa_tiles, &tma_a, &tma_w,
        &tma_sa, &tma_ws);
    return;
  }

  // ---------------- consumers ----------------
  // The consumers take what the producer gave back (Mxfp4Registers).
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Regs::kConsumer));
  const int wg = warp / 4 - 1;
  const int warp_in_wg = warp % 4;
  const int mtid = threadIdx.x - 128;
  const int frag_row = wg * 64 + warp_in_wg * 16 + lane / 4;  // A and accumulator rows frag_row, + 8 (+ 128 · sl)
  const int frag_col = (lane % 4) * 2;
  __shared__ int last_flag;
  if (mtid == 0) trace_cta(args, kStageTraceCtaBegin);

  // The ring position walks on from constants only, so the compiler knows it is the same in every
  // lane and keeps the barrier and descriptor arithmetic on the uniform datapath, off the vector
  // integer pipe the widening keeps busy (recomputed per tile from loaded values: 8% slower, run 6).
  int s = 0;
  uint32_t phase = 0;
  int consumed = 0, committed = 0, released = 0;  // stages waited for, committed, handed back (set_stage_trace)
  long long* const tracer = stage_tracer(args);
  // The A fragments of the stage at the ring position s, once it is full (widen_stage), slab by
  // slab (a slab's 128 rows are 128 consecutive rows of the stage's codes and words).
  using Frags = uint32_t[kSlabs][4][4];
  auto widen = [&](Frags& a) {
    trace_at(tracer, consumed, kStageTraceWaitBegin);
    ptx::mbar_wait(&full[s], phase);
    trace_at(tracer, consumed, kStageTraceWaitEnd);
    ++consumed;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl) {
      const int row = sl * 128 + frag_row;
      const uint8_t* w_stage = w_tiles + s * Layout::kWTile;
      const uint32_t* ws_stage = reinterpret_cast<const uint32_t*>(ws_tiles + s * Layout::kWsTile);
      const uint4 codes_r = *reinterpret_cast<const uint4*>(w_stage + row * (kBlockK / 2) + (lane % 4) * 16);
      const uint4 codes_r8 = *reinterpret_cast<const uint4*>(w_stage + (row + 8) * (kBlockK / 2) + (lane % 4) * 16);
      widen_stage(codes_r, codes_r8, ws_stage[row], ws_stage[row + 8], a[sl]);
    }
  };
  // accumulate: the stage's first wgmma adds to `part` (the row-scale loop's one accumulator)
  // instead of starting it.
  auto mma_stage = [&](float* part, const Frags& a, int stage, bool accumulate = false) {
    const uint64_t desc_n = ptx::make_smem_desc_sw128(a_tiles + stage * Layout::kATile);
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int g = 0; g < kBlockK / 32; ++g)
        Mma::mma(part + sl * kRegs, a[sl][g], desc_n + 2 * g, accumulate || g > 0);
  };
  auto fence_part = [&](float* part) {
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) ptx::fence_operand(part[i]);
  };
  auto advance = [&] {
    if (++s == stages) s = 0, phase ^= 1;
  };
  // Stage `stage`'s four wgmmas per slab from fragments a into `part`, committed (not waited for).
  auto mma_commit = [&](float* part, const Frags& a, int stage, bool accumulate = false) {
    fence_part(part);
    ptx::wgmma_fence();  // orders the fragments' writes before the wgmmas that read them
    mma_stage(part, a, stage, accumulate);
    ptx::wgmma_commit();
    trace_at(tracer, committed, kStageTraceMmaIssued);
    ++committed;
    fence_part(part);
  };
  // One stage: wait for it, widen its weights into A fragments, issue its wgmmas into `part` (or
  // onto it: accumulate); the ring moves on.
  auto issue = [&](float* part, bool accumulate = false) {
    Frags a;
    widen(a);
    mma_commit(part, a, s, accumulate);
    advance();
  };
  // Two stages as one round (stage ids to sa, sb): both widened, then their eight wgmmas behind
  // one fence and one commit, so the warpgroup meets once per two stages, and the widening of
  // the two has twice the independent work to interleave. The row-scale loop passes one
  // accumulator as both: `more` then says whether it already holds earlier stages.
  auto issue_pair = [&](float* pa, float* pb, int& sa, int& sb, bool more = false) {
    Frags a0, a1;
    sa = s;
    widen(a0);
    advance();
    sb = s;
    widen(a1);
    advance();
    fence_part(pa);
    fence_part(pb);
    ptx::wgmma_fence();
    mma_stage(pa, a0, sa, more);
    mma_stage(pb, a1, sb, more || pa == pb);
    ptx::wgmma_commit();
    trace_at(tracer, committed, kStageTraceMmaIssued);
    trace_at(tracer, committed + 1, kStageTraceMmaIssued);
    committed += 2;
    fence_part(pa);
    fence_part(pb);
  };
  // Stage st back to the producer, once every lane of the warp is done with it.
  auto release = [&](int st) {
    __syncwarp();
    trace_at(tracer, released, kStageTraceReleased);
    ++released;
    if (lane == 0) ptx::mbar_arrive(&empty[st]);
  };
  // Promotion of stage st's partial (its wgmmas complete): the activation scales are read before
  // the stage is handed back to the producer. (No weight factor here: it is the row's, applied
  // once per tile, which saves a multiply per accumulator and stage.)
  auto promote = [&](int st, float* part, float* acc) {
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) ptx::fence_operand(part[i]);
    TokenScales<kBlockT> sa;
    sa.load(sa_tiles + st * Layout::kSaFloats, frag_col);
    release(st);
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[i] = fmaf(part[i], sa.of(i % kRegs), acc[i]);  // every slab: the same tokens
  };

  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const TileInfo t = decode_tile<kMasked, kBlockT, kBlockW>(tile, args, num_w_blocks, prefix, m_of, lane);
    if (t.e < 0) continue;
    uint2 row_words[kSlabs];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)  // a slab past N (not stored) reads slab 0's words, not past the array
      row_words[sl] = mxfp4_row_words(args, t, frag_row + (t.w0 + 128 * sl < args.n ? 128 * sl : 0), row_blocks, k_blocks);
    float acc[kAccRegs];
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) acc[i] = 0.0f;
    const int num_kb = t.kb_end - t.kb_begin;
    if constexpr (kRowScales) {
      // The whole K in `acc` (the tensor core orders wgmmas on one accumulator): stage kb + 1 is
      // widened while kb's wgmmas run, and a stage goes back to the producer once its wgmmas are
      // done; nothing else stands between them. The tokens' scales are loaded first, so that their
      // latency hides under the K loop, and multiply once at the end.
      // Masked: the scales keep their [E, K/128, M_max] layout, each slot of a row holding its one
      // scale (quant.h), and the stages carry them as for block scales; the tile's last stage's
      // serve, read before it goes back (not held through the loop: the two-slab 48-token tile
      // spilled). Not from global memory: with PDL's early weights only the activations'
      // producer warp waits for the kernel that writes them.
      TokenScales<kBlockT> row_scale;
      if constexpr (!kMasked) row_scale.load(args.a_row_scales + t.t0, frag_col);
      auto take_scales = [&](int st) {
        if constexpr (kMasked) row_scale.load(sa_tiles + st * Layout::kSaFloats, frag_col);
      };
      if (kPaired && stages >= 4 && num_kb >= 2) {
        // Pairs of stages into the one accumulator: pair j + 1 is widened and issued behind pair
        // j's wgmmas, then pair j's stages go back (four stages held, as in the paired loop below).
        int pa, pb;
        issue_pair(acc, acc, pa, pb);
        int left = num_kb - 2;
        for (; left >= 2; left -= 2) {
          int ca, cb;
          issue_pair(acc, acc, ca, cb, true);
          ptx::wgmma_wait<1>();
          release(pa);
          release(pb);
          pa = ca, pb = cb;
        }
        if (left == 1) {
          const int last = s;
          issue(acc, true);
          ptx::wgmma_wait<1>();
          release(pa);
          release(pb);
          ptx::wgmma_wait<0>();
          take_scales(last);
          release(last);
        } else {
          ptx::wgmma_wait<0>();
          take_scales(pb);
          release(pa);
          release(pb);
        }
      } else {
        Frags a0, a1;
        int prev = s;
        widen(a0);
        advance();
        mma_commit(acc, a0, prev);
        auto step = [&](Frags& fb) {  // the other fragments' stage (prev) in flight
          const int cur = s;
          widen(fb);
          advance();
          mma_commit(acc, fb, cur, true);
          ptx::wgmma_wait<1>();
          release(prev);
          prev = cur;
        };
        int kb = t.kb_begin + 1;
        for (; kb + 1 < t.kb_end; kb += 2) {
          step(a1);
          step(a0);
        }
        if (kb < t.kb_end) step(a1);
        ptx::wgmma_wait<0>();
        take_scales(prev);
        release(prev);
      }
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) acc[i] *= row_scale.of(i % kRegs);
    } else if (kPaired && stages >= 4 && num_kb >= 2) {
      // Pairs of stages, two pairs in flight: pair j's wgmmas run while pair j - 1 is promoted
      // and pair j + 1 widened (four stages held, so the ring needs at least four).
      float p0[kAccRegs], p1[kAccRegs], p2[kAccRegs], p3[kAccRegs];
      int s0, s1, s2, s3;
      issue_pair(p0, p1, s0, s1);
      int left = num_kb - 2;
      for (; left >= 4; left -= 4) {
        issue_pair(p2, p3, s2, s3);
        ptx::wgmma_wait<1>();
        promote(s0, p0, acc);
        promote(s1, p1, acc);
        issue_pair(p0, p1, s0, s1);
        ptx::wgmma_wait<1>();
        promote(s2, p2, acc);
        promote(s3, p3, acc);
      }
      // p0, p1 in flight; 0..3 stages left.
      if (left >= 2) {
        issue_pair(p2, p3, s2, s3);
        ptx::wgmma_wait<1>();
        promote(s0, p0, acc);
        promote(s1, p1, acc);
        if (left == 3) {
          s0 = s;
          issue(p0);
          ptx::wgmma_wait<1>();
          promote(s2, p2, acc);
          promote(s3, p3, acc);
          ptx::wgmma_wait<0>();
          promote(s0, p0, acc);
        } else {
          ptx::wgmma_wait<0>();
          promote(s2, p2, acc);
          promote(s3, p3, acc);
        }
      } else if (left == 1) {
        s2 = s;
        issue(p2);
        ptx::wgmma_wait<1>();
        promote(s0, p0, acc);
        promote(s1, p1, acc);
        ptx::wgmma_wait<0>();
        promote(s2, p2, acc);
      } else {
        ptx::wgmma_wait<0>();
        promote(s0, p0, acc);
        promote(s1, p1, acc);
      }
    } else if constexpr (kPipelined) {
      // Two partials in flight: stage kb's wgmmas run while stage kb - 1 is promoted and stage
      // kb + 1 is widened.
      float part[2][kAccRegs];
      int prev = s;
      issue(part[0]);
      int kb = t.kb_begin + 1;
      for (; kb + 1 < t.kb_end; kb += 2) {
        int cur = s;
        issue(part[1]);
        ptx::wgmma_wait<1>();
        promote(prev, part[0], acc);
        prev = cur;
        cur = s;
        issue(part[0]);
        ptx::wgmma_wait<1>();
        promote(prev, part[1], acc);
        prev = cur;
      }
      if (kb < t.kb_end) {  // an even number of stages: one more into part[1]
        const int cur = s;
        issue(part[1]);
        ptx::wgmma_wait<1>();
        promote(prev, part[0], acc);
        ptx::wgmma_wait<0>();
        promote(cur, part[1], acc);
      } else {
        ptx::wgmma_wait<0>();
        promote(prev, part[0], acc);
      }
    } else {
      // One partial (a second does not fit beside 128 tokens' accumulators, nor beside two slabs of
      // 48), but the next stage is widened while this one's wgmmas run: its fragments are the only
      // extra registers.
      float part[kAccRegs];
      Frags a0, a1;
      int cur = s;
      widen(a0);
      advance();
      // Stage `cur` from fragments fa; the next one (if any) widened into fb meanwhile.
      auto step = [&](const Frags& fa, Frags& fb, bool more) {
        mma_commit(part, fa, cur);
        const int next = s;
        if (more) {
          widen(fb);
          advance();
#pragma unroll
          for (int g = 0; g < 4; ++g)  // pinned before the wait, so the widening runs under the wgmmas
            for (int j = 0; j < 4; ++j)
#pragma unroll
              for (int sl = 0; sl < kSlabs; ++sl) ptx::fence_operand(fb[sl][g][j]);
        }
        ptx::wgmma_wait<0>();
        promote(cur, part, acc);
        cur = next;
      };
      int kb = t.kb_begin;
      for (; kb + 2 < t.kb_end; kb += 2) {
        step(a0, a1, true);
        step(a1, a0, true);
      }
      if (kb + 1 < t.kb_end) {
        step(a0, a1, true);
        step(a1, a0, false);
      } else {
        step(a0, a1, false);
      }
    }

    store_mxfp4_tile<kMasked, kBlockT, kRegs, kMathThreads, kSlabs, 128>(
        args, t, acc, row_words, Fragment{frag_row, frag_col, mtid, warp - 4}, &last_flag);
  }
  if (mtid == 0) {
    stamp_end(args.stamp);
    trace_cta(args, kStageTraceCtaEnd);
  }
}

}  // namespace moekit::gemm_detail
