// mxfp4_fp8_copy.cuh: an MXFP4 plan's weights widened into an FP8 copy, for prefill
// (GemmConfig::mxfp4_fp8_copy; the plan side is in gemm_mxfp4.cu).
//
// Why: a contiguous (prefill) GEMM of many rows per expert is bound by the tensor cores, and the
// MXFP4 kernel pays for its widening inside every tile: each 128-token tile widens the same
// weights again, in the math threads, between their wgmmas (docs/gemm-mxfp4.md: 0.63-0.75x of the
// FP8 kernel's rate). Widening each weight once per run into an FP8 copy, then running the FP8
// kernel on it, costs one pass over the weights (4.25 bits read, 8 written) and then FP8's own
// rate; for enough rows per expert the pass is the smaller share.
//
// What the copy holds, per expert e: w8 [N, K] e4m3 in the MXFP4 GEMM's K order (mxfp4.h: the
// activations of an MXFP4 plan are in that order, so both operands agree) and out_col_scale [N]
// fp32, the row factor 2^(base - 127) (mxfp4_convert.cuh). The e4m3 bytes are exactly those the
// register kernel widens (the same table and lookup), so the products are the same; the FP8 kernel
// runs with unit block scales and applies factor and bias in its affine epilogue (gemm_fp8.cuh
// kAffine), before the single BF16 rounding.
//
// Two ways to run it. Before the GEMM (mxfp4_fp8_copy_kernel): one CTA per run of the tile-major codes (128 rows x one 128-deep block, 8 KB; mxfp4.h
// mxfp4_gemm_run): each thread widens eight code words (8 values each; their loads all in flight
// at once) and writes each row's 128 bytes of the block as two 4-byte pieces per word. With PDL
// the copy waits for the previous kernel before it writes: that kernel may be this plan's FP8
// GEMM of the run before, still reading the copy. It lets the FP8 GEMM be scheduled once every
// CTA of the copy has started; the GEMM then waits for the whole copy (launch.cuh).
//
// Beside the GEMM (mxfp4_fp8_copy_beside_kernel, GemmConfig::mxfp4_fp8_copy_ctas): the FP8 GEMM of
// many rows per expert is bound by the tensor cores and leaves HBM mostly idle, so a few SMs can
// make the copy while the others multiply what is already made. A grid of `ctas` persistent CTAs,
// one per SM (the ring below takes the shared memory a GEMM CTA would need), walks the runs in
// order (run r, r + ctas, ...; runs are row-block major, so row blocks complete roughly in order,
// as the GEMM's tile walk asks for them). Each run's 8 KB of codes and 512 B of scale words come
// by bulk copy into a ring of kBesideStages stages: one SM keeps ~140 KB of loads in flight, where
// the one-run CTAs above keep 8 KB each. Sixteen warps widen; one more warp refills the ring and,
// every kBesideSignalEvery runs, adds 1 to each of those runs' row-block counters with one
// GPU-scope release; the GEMM's producer waits for K / 128 in each row block its tile reads
// (gemm_args.cuh kFlagWeightsReady). The GEMM runs on the other SMs: the copy never
// waits for it, so the two cannot deadlock whatever the CTAs' placement.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/mxfp4_convert.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/stamp.cuh"
#include "moekit/mxfp4.h"

namespace moekit::gemm_detail {

constexpr int kFp8CopyThreads = 256;

// Lane q's e4m3 table for a row's 128-deep block: all of lane q's values are scale group q.
__device__ __forceinline__ uint2 group_table(uint32_t word, int q) {
  const int field = mxfp4_detail::group_shift_field(word, q);
  return mxfp4_detail::block_shifts_fast(word) ? mxfp4_detail::e4m3_table_fast(field)
                                               : mxfp4_detail::e4m3_table_outlined(field);
}

// Lane q's code word of slice s, widened through its table and stored at its places in the row.
__device__ __forceinline__ void widen_word(uint32_t code, uint2 table, int q, int s, uint8_t* row) {
  const uint2 v = mxfp4_detail::e2m1x8_to_e4m3(code, table);
  *reinterpret_cast<uint32_t*>(row + mxfp4_fragment_position(q, s, 0)) = v.x;  // values 0..3
  *reinterpret_cast<uint32_t*>(row + mxfp4_fragment_position(q, s, 4)) = v.y;  // values 4..7
}

// Code word i of a run (row i / 16, word i % 16) with its row's scale word, widened and stored into
// the run's 128-deep block of the copy (block0: its row 0; rows k bytes apart). widen_word's body
// is written out here: called, ptxas gives this kernel 53 registers instead of 48.
__device__ __forceinline__ void widen_code_word(uint32_t code, uint32_t word, int i, uint8_t* block0, int k) {
  const int r = i / 16, q = (i % 16) / 4, s = i % 4;  // word q·4 + s of row r: lane q, slice s
  const uint2 table = group_table(word, q);
  const uint2 v = mxfp4_detail::e2m1x8_to_e4m3(code, table);
  uint8_t* row = block0 + size_t(r) * k;
  *reinterpret_cast<uint32_t*>(row + mxfp4_fragment_position(q, s, 0)) = v.x;  // values 0..3
  *reinterpret_cast<uint32_t*>(row + mxfp4_fragment_position(q, s, 4)) = v.y;  // values 4..7
}

// Lane q's four code words of one row of a run (slices 0..3) with the row's scale word, widened and
// stored into the row's 128 bytes of the block: one table for the four words, where
// widen_code_word makes one per word.
__device__ __forceinline__ void widen_row_group(uint4 code, uint32_t word, int q, uint8_t* row) {
  const uint2 table = group_table(word, q);
  widen_word(code.x, table, q, 0, row);
  widen_word(code.y, table, q, 1, row);
  widen_word(code.z, table, q, 2, row);
  widen_word(code.w, table, q, 3, row);
}

// Grid: E · N/128 · K/128 CTAs of kFp8CopyThreads, CTA = run. codes: the run's 128 rows x 16 words
// (mxfp4_codes_for_gemm); words: its 128 scale words (mxfp4_scales_for_gemm).
__global__ void __launch_bounds__(kFp8CopyThreads)
    mxfp4_fp8_copy_kernel(const uint32_t* __restrict__ codes, const uint32_t* __restrict__ words, int k,
                          uint8_t* __restrict__ w8, float* __restrict__ out_col_scale, unsigned long long* stamp) {
  ptx::grid_dependency_wait();  // (a no-op without PDL)
  ptx::launch_dependents();     // the GEMM's CTAs may take the SMs ours leave; it waits for this grid
  if (threadIdx.x == 0) stamp_start(stamp);
  const int k_blocks = k / 128;
  const size_t run = blockIdx.x;
  const int kb = int(run % k_blocks);
  const size_t row_block = run / k_blocks;  // e · N/128 + n / 128
  const uint32_t* run_codes = codes + run * 128 * 16;
  const uint32_t* run_words = words + run * 128;
  uint8_t* block0 = w8 + row_block * 128 * size_t(k) + kb * 128;
  constexpr int kWordsPerThread = 128 * 16 / kFp8CopyThreads;
  uint32_t code[kWordsPerThread], word[kWordsPerThread];
#pragma unroll
  for (int j = 0; j < kWordsPerThread; ++j) {  // every load in flight before the first use
    const int i = threadIdx.x + j * kFp8CopyThreads;
    code[j] = __ldg(run_codes + i);
    word[j] = __ldg(run_words + i / 16);
  }
#pragma unroll
  for (int j = 0; j < kWordsPerThread; ++j) widen_code_word(code[j], word[j], threadIdx.x + j * kFp8CopyThreads, block0, k);
  if (kb == 0 && threadIdx.x < 128)
    out_col_scale[row_block * 128 + threadIdx.x] = mxfp4_detail::row_factor(__ldg(run_words + threadIdx.x));
  if (threadIdx.x == 0) stamp_end(stamp);
}

// 16 widening warps, a thread per (row, scale group) of a run, and one more warp that refills the
// ring and signals (kBesideThreads in all).
constexpr int kBesideWideners = 512, kBesideThreads = kBesideWideners + 32, kBesideStages = 16,
              kBesideSignalEvery = 8;
constexpr int kRunCodeWords = 128 * 16, kRunScaleWords = 128;
constexpr int kBesideStageBytes = (kRunCodeWords + kRunScaleWords) * 4;
// Each widening warp assembles its 8 rows of a run in shared memory, 144 bytes apart (rows 128 bytes
// apart would put a warp's 4-byte pieces of 8 rows on the same banks), then stores them in 16-byte
// pieces: 4-byte stores straight from the widening touched 8 rows per instruction, 4x as many.
constexpr int kBesideRowPitch = 144, kBesideWarpRows = 8;
constexpr int kBesideScratchOffset = kBesideStages * (kBesideStageBytes + 16);  // after the ring and barriers
constexpr int kBesideSmemBytes = kBesideScratchOffset + kBesideWideners / 32 * kBesideWarpRows * kBesideRowPitch;

// Grid: `ctas` CTAs of kBesideThreads, kBesideSmemBytes of dynamic shared memory. ready: [E x N / 128]
// row-block counters, zero at the start (the GEMM's last CTA zeroes them for the next run).
//
// Each widening warp arrives on the stage's free barrier once its lanes have stored the run (after
// a proxy fence every kBesideSignalEvery runs: the GEMM reads the copy with TMA); the signalling
// warp waits for that, refills the stage and, every kBesideSignalEvery runs, makes one GPU-scope
// fence and adds 1 to each of those runs' row-block counters, so no widening thread waits for a
// release. What set the rate per copy SM (one H100, docs/gemm-mxfp4.md run 33): 22 GB/s with the
// releases in a widening thread, 26 with this signalling warp and one table per (row, group), 49-53
// once the stores were 16 bytes wide.
__global__ void __launch_bounds__(kBesideThreads, 1)
    mxfp4_fp8_copy_beside_kernel(const uint32_t* __restrict__ codes, const uint32_t* __restrict__ words, int k,
                                 int runs, uint8_t* __restrict__ w8, float* __restrict__ out_col_scale, int* ready,
                                 unsigned long long* stamp) {
  extern __shared__ __align__(128) uint8_t ring[];
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + kBesideStages * kBesideStageBytes);
  uint64_t* stage_free = full + kBesideStages;
  ptx::grid_dependency_wait();  // the previous kernel may be the last run's GEMM, still reading w8
  ptx::launch_dependents();     // the GEMM's CTAs take the other SMs
  const int k_blocks = k / 128;
  auto run_of = [&](int it) { return int(blockIdx.x) + it * int(gridDim.x); };  // < runs <= INT_MAX
  auto signals_after = [&](int it) { return (it + 1) % kBesideSignalEvery == 0 || run_of(it + 1) >= runs; };
  auto issue = [&](int it) {  // run_of(it)'s codes and words into stage it % stages
    const long run = run_of(it);
    if (run >= runs) return;
    uint8_t* stage = ring + (it % kBesideStages) * kBesideStageBytes;
    uint64_t* bar = &full[it % kBesideStages];
    const uint64_t policy = ptx::policy_evict_first();
    ptx::mbar_arrive_expect_tx(bar, kBesideStageBytes);
    ptx::bulk_load(stage, codes + run * kRunCodeWords, kRunCodeWords * 4, bar, policy);
    ptx::bulk_load(stage + kRunCodeWords * 4, words + run * kRunScaleWords, kRunScaleWords * 4, bar, policy);
  };
  if (threadIdx.x == 0) {
    stamp_start(stamp);
    for (int s = 0; s < kBesideStages; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&stage_free[s], kBesideWideners / 32);
    }
    ptx::fence_barrier_init();
    for (int it = 0; it < kBesideStages; ++it) issue(it);
  }
  __syncthreads();
  if (threadIdx.x >= kBesideWideners) {  // the signalling warp, one lane
    if (threadIdx.x == kBesideWideners) {
      for (int it = 0; run_of(it) < runs; ++it) {
        ptx::mbar_wait(&stage_free[it % kBesideStages], (it / kBesideStages) & 1);
        if (signals_after(it)) {
          // The free barrier made every store of these runs visible to this thread (CTA scope);
          // the fence makes them so at GPU scope before the relaxed adds (a release pattern).
          ptx::fence_acq_rel_gpu();
          for (int j = it - (it % kBesideSignalEvery); j <= it; ++j) ptx::red_relaxed_gpu_add(ready + run_of(j) / k_blocks, 1);
        }
        issue(it + kBesideStages);
      }
      stamp_end(stamp);
    }
    return;
  }
  // A run's row block and k block step on by the grid's size each time: no division per run (with
  // 64-bit divisions here the loop's bookkeeping cost more instructions than the widening).
  const int step_kb = int(gridDim.x) % k_blocks, step_rb = int(gridDim.x) / k_blocks;
  uint8_t* scratch = ring + kBesideScratchOffset + threadIdx.x / 32 * kBesideWarpRows * kBesideRowPitch;
  int kb = int(blockIdx.x) % k_blocks, row_block = int(blockIdx.x) / k_blocks;
  for (int it = 0; run_of(it) < runs; ++it, kb += step_kb, row_block += step_rb) {
    if (kb >= k_blocks) kb -= k_blocks, ++row_block;
    ptx::mbar_wait(&full[it % kBesideStages], (it / kBesideStages) & 1);
    const uint32_t* code = reinterpret_cast<const uint32_t*>(ring + (it % kBesideStages) * kBesideStageBytes);
    const uint32_t* word = code + kRunCodeWords;
    uint8_t* block0 = w8 + size_t(row_block) * 128 * k + kb * 128;
    // Thread t widens row t / 4's words of lane t % 4 (words 4t .. 4t + 3 of the run, one 16-byte
    // load) into its warp's scratch; then lane l stores 16-byte pieces l % 4 and 4 + l % 4 of row l / 4.
    const int r = threadIdx.x / 4, lane = threadIdx.x % 32;
    widen_row_group(reinterpret_cast<const uint4*>(code)[threadIdx.x], word[r], threadIdx.x % 4,
                    scratch + (lane / 4) * kBesideRowPitch);
    __syncwarp();
    const uint8_t* from = scratch + (lane / 4) * kBesideRowPitch + (lane % 4) * 16;
    uint8_t* to = block0 + size_t(r) * k + (lane % 4) * 16;
    const uint4 lo = *reinterpret_cast<const uint4*>(from), hi = *reinterpret_cast<const uint4*>(from + 64);
    *reinterpret_cast<uint4*>(to) = lo;
    *reinterpret_cast<uint4*>(to + 64) = hi;
    if (kb == 0 && threadIdx.x < 128) out_col_scale[size_t(row_block) * 128 + threadIdx.x] = mxfp4_detail::row_factor(word[threadIdx.x]);
    if (signals_after(it)) ptx::fence_proxy_async_global();
    __syncwarp();  // the warp's reads of the stage, of its scratch, and its stores before its one arrive
    if (threadIdx.x % 32 == 0) ptx::mbar_arrive(&stage_free[it % kBesideStages]);
  }
}

}  // namespace moekit::gemm_detail
