// gemm_ready.cuh: per-expert readiness, the counters through which a grouped GEMM waits for the
// kernel before it (a GEMM, the EP dispatch receive, the MXFP4 weights' FP8 copy) expert by expert
// or row block by row block instead of for its whole grid, and signals the kernel after it. The
// flags that turn each on are in gemm_args.cuh; the producer (gemm_schedule.cuh) waits, the math
// threads signal after a tile's stores and reset the counters at the CTA's end.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/gemm_args.cuh"
#include "kernels/cuda/ptx.cuh"

namespace moekit::gemm_detail {

// Per-expert readiness between two masked GEMMs of one step (GEMM1 -> GEMM2 of a decode step).
// The counter of expert e counts units of 64 output columns x 1 row: every stored tile of the
// signalling GEMM adds (its weight rows / 64) x (its real token rows), so the expert is complete
// when the counter reaches (K / 64) x masked_m[e] of the waiting GEMM, whose K is the signalling
// GEMM's output width. Neither side needs the other's tile shape. The signal is a release after a
// barrier of the tile's math threads (whose stores precede it); the wait is an acquire and then
// a proxy fence, since the waiting GEMM reads the rows with TMA. The waiting GEMM's last CTA zeroes
// the counters (and its own CTA count, element E) for the next step.

// One thread spins until done() (acquire loads inside it), then orders what it saw before the
// TMA loads that follow. What it waits for is written by a kernel that is resident whenever this
// runs (PDL: this kernel is launched only once every CTA of it has started), so the wait ends; a
// condition that never comes true (a caller pairing kernels wrongly) traps after ~10 s instead
// of hanging the stream.
// idle() runs once per poll (count_tiles' prefetch while it waits for the publication).
template <class Done, class Idle>
__device__ __forceinline__ void spin_until(Done&& done, Idle&& idle) {
  const long long start = clock64();
  while (!done()) {
    if (clock64() - start > (1ll << 34)) __trap();
    idle();
    __nanosleep(32);
  }
  ptx::fence_proxy_async_global();
}
template <class Done>
__device__ __forceinline__ void spin_until(Done&& done) {
  spin_until(done, [] {});
}
// Until a counter reaches target.
__device__ __forceinline__ void ready_wait(const int* counter, int target) {
  spin_until([&] { return ptx::ld_acquire_gpu(counter) >= target; });
}
// kFlagWeightsReady: the row blocks a tile of kBlockW weight rows starting at row t.w0 of expert
// t.e reads (the last may reach past N: its rows are never stored), each widened over all of K.
template <int kBlockW>
__device__ __forceinline__ void weights_ready_wait(const KernelArgs& args, int e, int w0) {
  const int first = (e * args.n + w0) / 128, k_blocks = args.k / 128;
  for (int j = 0; j < kBlockW / 128 && w0 + j * 128 < args.n; ++j) ready_wait(args.ready_in + first + j, k_blocks);
}
// kFlagRowsReady: expert e's rows from the EP receive, or the receive's abort (gemm.h
// kRowsReadyAbort in the published word: a receive CTA timed out, so some rows never come).
__device__ __forceinline__ void rows_ready_wait(const KernelArgs& args, int e, int m_valid) {
  const int* word = args.ready_in + args.num_experts + 1;
  spin_until([&] {
    return ptx::ld_acquire_gpu(args.ready_in + e) >= m_valid || (ptx::ld_acquire_gpu(word) & kRowsReadyAbort);
  });
}
__device__ __forceinline__ void expert_ready_wait(const KernelArgs& args, int e, int m_valid) {
  if (args.flags & kFlagRowsReady) return rows_ready_wait(args, e, m_valid);
  ready_wait(args.ready_in + e, (args.k / 64) * m_valid);
}

// The consumer warpgroups' named barrier (the producer warps have left).
template <int kMathThreads>
__device__ __forceinline__ void math_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(kMathThreads) : "memory");
}

// The signalling side, by every math thread after a tile's output is stored: the tile's stores,
// then one release of its units of expert t.e. It costs GEMM2 of DeepSeek-V3 at B = 256 ~6 us
// alone (bench_stream, run 56). Sent a few K blocks into the next tile instead, once the stores
// have long reached the L2, it cost ~2 us alone but the step nothing less (run 57).
template <int kMathThreads, int kBlockW, int kBlockT>
__device__ __forceinline__ void expert_ready_add(const KernelArgs& args, const TileInfo& t, int mtid) {
  // The next GEMM reads these rows with TMA; the combine beside this one (kFlagEarlyTrigger) with
  // ordinary loads, which need no proxy fence.
  if (!(args.flags & kFlagEarlyTrigger)) ptx::fence_proxy_async_global();
  math_barrier<kMathThreads>();
  if (mtid == 0) ptx::red_release_gpu_add(args.ready_out + t.e, (kBlockW / 64) * min(kBlockT, t.m_valid - t.t0));
}

// The waiting side, by every math thread at the CTA's end: the last CTA zeroes the counters for
// the next step. Every CTA's producer has read its counters before its consumers got their last
// stage, so no read is still to come. `count` counters, then the CTA count; `extra` more words
// past it are zeroed too.
template <int kMathThreads>
__device__ __forceinline__ void ready_reset(int* counters, int count, int extra, int mtid, int* last_flag) {
  math_barrier<kMathThreads>();
  if (mtid == 0) *last_flag = atomicAdd(counters + count, 1) == int(gridDim.x) - 1;
  math_barrier<kMathThreads>();
  if (!*last_flag) return;
  for (int i = mtid; i <= count + extra; i += kMathThreads) counters[i] = 0;
}
template <int kMathThreads>
__device__ __forceinline__ void expert_ready_reset(const KernelArgs& args, int mtid, int* last_flag) {
  // (with kFlagRowsReady the published word too)
  ready_reset<kMathThreads>(args.ready_in, args.num_experts, (args.flags & kFlagRowsReady) ? 1 : 0, mtid, last_flag);
}
// kFlagWeightsReady: the copy's E x N / 128 row-block counters (element E x N / 128 counts the
// CTAs), once the copy's grid is complete: it also counts the row blocks of experts without rows,
// which no tile waits for.
template <int kMathThreads>
__device__ __forceinline__ void weights_ready_reset(const KernelArgs& args, int mtid, int* last_flag) {
  ptx::grid_dependency_wait();
  ready_reset<kMathThreads>(args.ready_in, args.num_experts * (args.n / 128), 0, mtid, last_flag);
}

}  // namespace moekit::gemm_detail
