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
// the one-run CTAs above keep 8 KB each. Every kBesideSignalEvery runs every thread fences its
// stores for the async proxy (the GEMM reads the copy with TMA) and one thread adds 1 to each of
// those runs' row-block counters with release semantics; the GEMM's producer waits for K / 128 in
// each row block its tile reads (gemm_schedule.cuh kFlagWeightsReady). The GEMM runs on the other SMs: the copy never
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

// Code word i of a run (row i / 16, word i % 16) with its row's scale word, widened and stored into
// the run's 128-deep block of the copy (block0: its row 0; rows k bytes apart).
__device__ __forceinline__ void widen_code_word(uint32_t code, uint32_t word, int i, uint8_t* block0, int k) {
  const int r = i / 16, q = (i % 16) / 4, s = i % 4;  // word q·4 + s of row r: lane q, slice s
  const int field = mxfp4_detail::group_shift_field(word, q);
  const uint2 table = mxfp4_detail::block_shifts_fast(word) ? mxfp4_detail::e4m3_table_fast(field)
                                                            : mxfp4_detail::e4m3_table_outlined(field);
  const uint2 v = mxfp4_detail::e2m1x8_to_e4m3(code, table);
  uint8_t* row = block0 + size_t(r) * k;
  *reinterpret_cast<uint32_t*>(row + mxfp4_fragment_position(q, s, 0)) = v.x;  // values 0..3
  *reinterpret_cast<uint32_t*>(row + mxfp4_fragment_position(q, s, 4)) = v.y;  // values 4..7
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

constexpr int kBesideThreads = 512, kBesideStages = 16, kBesideSignalEvery = 8;
constexpr int kRunCodeWords = 128 * 16, kRunScaleWords = 128;
constexpr int kBesideStageBytes = (kRunCodeWords + kRunScaleWords) * 4;
constexpr int kBesideSmemBytes = kBesideStages * (kBesideStageBytes + 8);  // + the full barriers

// Grid: `ctas` CTAs of kBesideThreads, kBesideSmemBytes of dynamic shared memory. ready: [E x N / 128]
// row-block counters, zero at the start (the GEMM's last CTA zeroes them for the next run).
__global__ void __launch_bounds__(kBesideThreads, 1)
    mxfp4_fp8_copy_beside_kernel(const uint32_t* __restrict__ codes, const uint32_t* __restrict__ words, int k,
                                 long runs, uint8_t* __restrict__ w8, float* __restrict__ out_col_scale, int* ready,
                                 unsigned long long* stamp) {
  extern __shared__ __align__(128) uint8_t ring[];
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + kBesideStages * kBesideStageBytes);
  ptx::grid_dependency_wait();  // the previous kernel may be the last run's GEMM, still reading w8
  ptx::launch_dependents();     // the GEMM's CTAs take the other SMs
  const int k_blocks = k / 128;
  auto run_of = [&](int it) { return long(blockIdx.x) + long(it) * gridDim.x; };
  auto issue = [&](int it) {  // by thread 0: run_of(it)'s codes and words into stage it % stages
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
    for (int s = 0; s < kBesideStages; ++s) ptx::mbar_init(&full[s], 1);
    ptx::fence_barrier_init();
    for (int it = 0; it < kBesideStages; ++it) issue(it);
  }
  __syncthreads();
  for (int it = 0; run_of(it) < runs; ++it) {
    const long run = run_of(it);
    const int kb = int(run % k_blocks);
    const long row_block = run / k_blocks;
    ptx::mbar_wait(&full[it % kBesideStages], (it / kBesideStages) & 1);
    const uint32_t* code = reinterpret_cast<const uint32_t*>(ring + (it % kBesideStages) * kBesideStageBytes);
    const uint32_t* word = code + kRunCodeWords;
    uint8_t* block0 = w8 + row_block * 128 * size_t(k) + kb * 128;
#pragma unroll
    for (int j = 0; j < kRunCodeWords / kBesideThreads; ++j) {
      const int i = threadIdx.x + j * kBesideThreads;
      widen_code_word(code[i], word[i / 16], i, block0, k);
    }
    if (kb == 0 && threadIdx.x < 128) out_col_scale[row_block * 128 + threadIdx.x] = mxfp4_detail::row_factor(word[threadIdx.x]);
    // Every kBesideSignalEvery runs (and after the last): the fence and the release wait for stores
    // to complete, a memory round trip; done every run they made ~28 GB/s of copy bytes per SM
    // (measured; docs/gemm-mxfp4.md run 32). Then the runs since the last signal are released.
    const bool signal = (it + 1) % kBesideSignalEvery == 0 || run_of(it + 1) >= runs;
    if (signal) ptx::fence_proxy_async_global();
    __syncthreads();  // the stage read by every thread (and, when signalling, every store made)
    if (threadIdx.x == 0) {
      if (signal)
        for (int j = it - (it % kBesideSignalEvery); j <= it; ++j) ptx::red_release_gpu_add(ready + run_of(j) / k_blocks, 1);
      issue(it + kBesideStages);
    }
  }
  if (threadIdx.x == 0) stamp_end(stamp);
}

}  // namespace moekit::gemm_detail
