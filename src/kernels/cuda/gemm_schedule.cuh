// gemm_schedule.cuh: what the FP8 grouped GEMM's threads agree on: the kernel arguments, the
// shared-memory layout of a pipeline stage and the tile order (gemm_fp8.cuh has the kernel).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/stamp.cuh"
#include "moekit/gemm.h"

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
  const float* bias = nullptr;     // MXFP4 plans: [E, n] fp32 added before the BF16 rounding
  const uint32_t* w_mx_scales = nullptr;  // MXFP4 plans: the scale words (mxfp4.h), for the row factor
  uint8_t* act = nullptr;          // gated: SiLU·up in FP8 [E, rows, n/2]
  float* act_scales = nullptr;     // gated: its scales [E, n/256, rows]
  unsigned long long* stamp = nullptr;  // stamp.cuh pair of a timed step, or null
  long long* stage_trace = nullptr;     // study: CTA 0's SM clock per stage (MaskedGemm::set_stage_trace)
  int* ready_out = nullptr;  // masked: per-expert readiness this GEMM signals (expert_ready_add)
  int* ready_in = nullptr;   // masked, kFlagExpertReady: the readiness it waits for, [E + 1]
                             // (+ kFlagRowsReady: [E + 2])
  // Affine epilogue (the FP8 kernel's kAffine instances: an MXFP4 plan's FP8 copy, mxfp4_fp8_copy.cuh):
  // output column n of expert e is acc · out_col_scale[e, n] + bias[e, n] (bias optional). Last,
  // so that the fields above keep their offsets in every other instance's parameter bank.
  const float* out_col_scale = nullptr;
  // The MXFP4 register kernel's row-scale instances (ContiguousGemmProblem::a_row_scales): [rows]
  // fp32, one activation scale per row for all of K.
  const float* a_row_scales = nullptr;
};

// Programmatic dependent launch: this kernel may start while the previous kernel on the stream
// is still running. Everything the previous kernel may write (activations, their scales,
// masked_m, row_expert, the output) is touched only after `griddepcontrol.wait`.
constexpr int kFlagPdl = 1;
// With kFlagPdl: masked_m and the weights are not written by the previous kernel, so the
// schedule is computed and the first ring of weight tiles is loaded before the wait: the
// weight stream starts during the previous kernel's tail (GEMM2 after the activation kernel).
constexpr int kFlagEarlyWeights = 2;
// With kFlagPdl | kFlagEarlyWeights: the previous kernel is a masked GEMM that signals per expert
// (ready_out = this kernel's ready_in), so the producer waits for each expert's rows, not for the
// previous kernel's grid: experts the previous GEMM has finished stream while it finishes the rest.
constexpr int kFlagExpertReady = 4;
// With kFlagPdl | kFlagEarlyWeights | kFlagExpertReady: the previous kernel is the EP dispatch
// receive (ep.h EpBuffer::dispatch_recv with rows_ready), which counts rows, not 64-column units:
// ready_in[E + 1] turns nonzero once masked_m is final, and ready_in[e] then reaches masked_m[e]
// when expert e's rows and scales have landed. The schedule waits for the first (it reads
// masked_m), each expert's loads for the second; the weights need neither.
constexpr int kFlagRowsReady = 8;
// Masked, with ready_out: the next kernel on the stream (the EP combine send beside this GEMM,
// ep.h) waits for each expert's rows through ready_out and for this grid before it completes,
// and reads nothing else an earlier kernel may still write; so every CTA triggers it at its
// start, and it takes the SMs this GEMM's CTAs leave as they finish (gemm.h set_early_trigger).
// It reads the rows with ordinary loads, so the signal needs no async-proxy fence.
constexpr int kFlagEarlyTrigger = 16;
// Masked: the last expert is walked first, and its weights load without demoting their L2 lines
// (ptx::policy_evict_unchanged; every other expert streams evict-first). The fused decode step's
// merged shared expert (slab E_loc) is the last expert: its rows are the rank's own tokens, so its
// weights are sure to be read whatever the routing. With kFlagRowsReady each CTA also asks the L2
// for its share of those weights while it waits for the receive to publish masked_m, when HBM
// carries little else, and the CTAs that take the expert's tiles first find them there
// (gemm.h set_last_expert_first).
constexpr int kFlagLastExpertFirst = 32;
// Contiguous, an MXFP4 plan's FP8 copy made beside the GEMM (mxfp4_fp8_copy.cuh, the previous
// kernel on the stream): the copy adds 1 to ready_in[rb] for every 128-deep block of weight row
// block rb (128 rows of the [E x N] copy) it has stored, and the producer waits for a tile's row
// blocks to reach K / 128 before it loads their first stage. Nothing else this kernel reads is
// written by the copy, and the copy waited for the kernel before it, so the GEMM does not wait
// for the copy's grid until its end (before its trigger and the counters' reset).
constexpr int kFlagWeightsReady = 64;

// The expert at position p of the walk, and the position of expert e (kFlagLastExpertFirst:
// E-1, 0, 1, ..., E-2; otherwise 0, 1, ..., E-1).
__device__ __forceinline__ int walk_expert(const KernelArgs& args, int p) {
  if (!(args.flags & kFlagLastExpertFirst)) return p;
  return p == 0 ? args.num_experts - 1 : p - 1;
}
__device__ __forceinline__ int walk_position(const KernelArgs& args, int e) {
  if (!(args.flags & kFlagLastExpertFirst)) return e;
  return e == args.num_experts - 1 ? 0 : e + 1;
}

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

// Shared memory, in order: W tiles, A tiles (each 1024-aligned for the 128-byte swizzle),
// A-scale rows, the epilogue's staging rows (kEpiBytes, gemm_epilogue.cuh), full and empty
// barriers, then (masked) the tile prefix sums [E+1] and the clamped masked_m [E]. kWRows:
// weight rows per stage (2 kBlockW for gated tiles).
template <int kBlockT, int kWRows, int kEpiBytes = 0>
struct SmemLayout {
  static constexpr int kWTile = kWRows * kBlockK;
  static constexpr int kATile = kBlockT * kBlockK;
  static constexpr int kSaFloats = (kBlockT + 31) / 32 * 32;  // 128-byte aligned rows
  static constexpr int kStageBytes = kWTile + kATile + kSaFloats * 4 + 16;  // + two barriers
  static constexpr uint32_t kTxBytes = (kWRows + kBlockT) * kBlockK + kBlockT * 4;
  static constexpr int kEpi = kEpiBytes;
  static int bytes(int stages, int num_experts) {
    return 1024 + stages * kStageBytes + kEpiBytes + (2 * num_experts + 1) * 4;
  }
};

struct TileInfo {
  int e;          // local expert (-1: nothing to do, contiguous padding block)
  int w0;         // first weight row (output column) within the expert
  int t0;         // first token row: within the expert (masked) or global (contiguous)
  int m_valid;    // masked: rows of the expert that are real
  int kb_begin, kb_end;
  int split;
  int slot;       // split-K workspace slot of (expert, weight block, token block)
  uint32_t real[4];  // contiguous: bit r % 32 of word r / 32 is set when token row t0 + r is real
};

// Contiguous: whether token row t0 + r of the tile is a real row (not segment padding).
// (Selected, not indexed: a runtime index would put TileInfo in local memory.)
__device__ __forceinline__ bool is_real_row(const TileInfo& t, int r) {
  const uint32_t word = r < 32 ? t.real[0] : r < 64 ? t.real[1] : r < 96 ? t.real[2] : t.real[3];
  return (word >> (r % 32)) & 1u;
}

// Contiguous: the grouped raster of a tile index (without its split): kRasterGroup token blocks
// walk the weight blocks together. Returns the token block, sets wb.
// (Every group but the last has kRasterGroup blocks, a power of two: a shift and a mask instead of
// a run-time division, which costs ~25 instructions and sat on every tile's path, run 27.)
__device__ __forceinline__ int contiguous_token_block(int rest, int t_blocks, int num_w_blocks, int& wb) {
  const int group = rest / (kRasterGroup * num_w_blocks);
  const int first = group * kRasterGroup;
  const int size = min(kRasterGroup, t_blocks - first);
  const int in = rest - group * kRasterGroup * num_w_blocks;
  static_assert((kRasterGroup & (kRasterGroup - 1)) == 0, "a power of two");
  if (size == kRasterGroup) {
    wb = in / kRasterGroup;
    return first + in % kRasterGroup;
  }
  wb = in / size;
  return first + in % size;
}

// tile / splits and the split's k blocks, without a division when there is one split (every
// contiguous 256-column plan and most others).
__device__ __forceinline__ int split_tile(int tile, int splits) { return splits == 1 ? tile : tile / splits; }

// Contiguous: row_expert of a tile's token block, one value per lane for each 32 rows. Fetched a
// whole tile ahead (fetch_block_rows) and read by decode_tile, so that no thread waits for them.
template <int kBlockT>
struct BlockRows {
  int v[(kBlockT + 31) / 32];
};
template <int kBlockT>
__device__ __forceinline__ BlockRows<kBlockT> fetch_block_rows(int tile, const KernelArgs& args, int num_w_blocks,
                                                               int lane) {
  int wb;
  const int tb = contiguous_token_block(split_tile(tile, args.num_splits), args.rows / kBlockT, num_w_blocks, wb);
  BlockRows<kBlockT> rows;
#pragma unroll
  for (int j = 0; j < (kBlockT + 31) / 32; ++j) rows.v[j] = __ldg(args.row_expert + tb * kBlockT + j * 32 + lane);
  return rows;
}

// num_w_blocks: weight blocks per expert (N / kBlockW; gated tiles: N / 2 / kBlockW). rows
// (contiguous only): the tile's fetch_block_rows (the overload below fetches them itself).
template <bool kMasked, int kBlockT, int kBlockW>
__device__ __forceinline__ TileInfo decode_tile(int tile, const KernelArgs& args, int num_w_blocks, const int* prefix,
                                                const int* m_of, int lane, const BlockRows<kBlockT>& rows) {
  const int k_blocks = args.k / kBlockK;
  const int splits = args.num_splits;
  TileInfo t{};
  int rest = split_tile(tile, splits);
  t.split = tile - rest * splits;
  t.kb_begin = splits == 1 ? 0 : t.split * k_blocks / splits;
  t.kb_end = splits == 1 ? k_blocks : (t.split + 1) * k_blocks / splits;
  int tb, wb;
  if constexpr (kMasked) {
    // Largest walk position p with prefix[p] <= tile (experts without tiles have prefix[p] ==
    // prefix[p+1]).
    int lo = 0, hi = args.num_experts - 1;
    while (lo < hi) {
      int mid = (lo + hi + 1) / 2;
      if (prefix[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    // Through lane 0 (the search gives every lane the same lo), so that the compiler knows the
    // tile is the same in every lane and keeps what follows from it on the uniform datapath.
    t.e = __shfl_sync(0xFFFFFFFFu, walk_expert(args, lo), 0);
    t.m_valid = __shfl_sync(0xFFFFFFFFu, m_of[t.e], 0);
    rest = split_tile(tile - __shfl_sync(0xFFFFFFFFu, prefix[lo], 0), splits);
    int t_blocks = (t.m_valid + kBlockT - 1) / kBlockT;
    tb = t_blocks == 1 ? 0 : rest % t_blocks;  // decode: one token block per expert, no division
    wb = t_blocks == 1 ? rest : rest / t_blocks;
    int max_t_blocks = (args.rows + kBlockT - 1) / kBlockT;
    t.slot = (t.e * num_w_blocks + wb) * max_t_blocks + tb;
  } else {
    tb = contiguous_token_block(rest, args.rows / kBlockT, num_w_blocks, wb);
    t.slot = tb * num_w_blocks + wb;
    t.m_valid = 0;
    // The block's expert: the largest row_expert of its rows (padding rows are -1); and which rows
    // are real, so that the epilogue needs no load of its own.
    static_assert(kBlockT % 32 == 0 && kBlockT <= 128, "contiguous token blocks of 32..128 rows");
    int e = -1;
#pragma unroll
    for (int j = 0; j < kBlockT / 32; ++j) {
      const int re = rows.v[j];
      e = max(e, re);
      t.real[j] = __ballot_sync(0xFFFFFFFFu, re >= 0);
    }
    for (int o = 16; o > 0; o /= 2) e = max(e, __shfl_xor_sync(0xFFFFFFFFu, e, o));
    t.e = __shfl_sync(0xFFFFFFFFu, e, 0);  // the same in every lane; from lane 0, the compiler knows it
  }
  t.t0 = tb * kBlockT;
  t.w0 = wb * kBlockW;
  return t;
}

template <bool kMasked, int kBlockT, int kBlockW>
__device__ __forceinline__ TileInfo decode_tile(int tile, const KernelArgs& args, int num_w_blocks, const int* prefix,
                                                const int* m_of, int lane) {
  BlockRows<kBlockT> rows{};
  if constexpr (!kMasked) rows = fetch_block_rows<kBlockT>(tile, args, num_w_blocks, lane);
  return decode_tile<kMasked, kBlockT, kBlockW>(tile, args, num_w_blocks, prefix, m_of, lane, rows);
}

// The number of tiles of a launch, which every thread of the CTA returns. Masked: also fills
// m_of[e] (masked_m clamped to [0, rows]) and prefix[0..E] (tiles before walk position p, see
// walk_expert; an expert without tokens has none, so its weights are never read) in shared
// memory. Called by the whole CTA (it synchronises). idle(): run by thread 0 once per poll while
// it waits for the receive's publication (kFlagRowsReady).
template <bool kMasked, int kBlockT, class Idle>
__device__ __forceinline__ int count_tiles(const KernelArgs& args, int num_w_blocks, int* prefix, int* m_of,
                                           Idle&& idle) {
  if constexpr (!kMasked) {
    __syncthreads();
    return (args.rows / kBlockT) * num_w_blocks * args.num_splits;
  } else {
    // kFlagRowsReady: masked_m is being written by the receive that runs beside this kernel;
    // thread 0 waits until it is final and the barrier passes that on (and the loads below go to
    // the L2, where the receive's stores are, not through the non-coherent path).
    // Its stage clock starts here: until then the CTA only holds its SM.
    if (args.flags & kFlagRowsReady) {
      if (threadIdx.x == 0) {
        // The publication (low bits), not an abort alone: masked_m is final only once published.
        const int* word = args.ready_in + args.num_experts + 1;
        spin_until([&] { return (ptx::ld_acquire_gpu(word) & (kRowsReadyAbort - 1)) != 0; }, idle);
        stamp_start(args.stamp);
      }
      __syncthreads();
    }
    for (int e = threadIdx.x; e < args.num_experts; e += blockDim.x) {
      const int m = min(max(__ldcg(args.masked_m + e), 0), args.rows);
      m_of[e] = m;
      prefix[walk_position(args, e) + 1] = num_w_blocks * ((m + kBlockT - 1) / kBlockT) * args.num_splits;
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // inclusive scan of prefix[1..E]: one contiguous chunk per lane
      const int lane = threadIdx.x;
      const int chunk = (args.num_experts + 31) / 32;
      const int begin = min(lane * chunk, args.num_experts), end = min(begin + chunk, args.num_experts);
      int sum = 0;
      for (int e = begin; e < end; ++e) sum += prefix[e + 1];
      int incl = sum;
      for (int o = 1; o < 32; o *= 2) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
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
    return prefix[args.num_experts];
  }
}
template <bool kMasked, int kBlockT>
__device__ __forceinline__ int count_tiles(const KernelArgs& args, int num_w_blocks, int* prefix, int* m_of) {
  return count_tiles<kMasked, kBlockT>(args, num_w_blocks, prefix, m_of, [] {});
}

// The tiles a CTA works on: first, first + stride, ... A CTA alone walks from blockIdx.x in steps
// of gridDim.x; the CTAs of a cluster walk the cluster's sequence together (each takes its own
// weight block of a cluster tile, see decode_tile's callers).
struct TileWalk {
  int first, stride;
};
template <int kCluster>
__device__ __forceinline__ TileWalk tile_walk() {
  return {int(blockIdx.x) / kCluster, int(gridDim.x) / kCluster};
}

// The start of a grouped GEMM kernel, before the tile count: the PDL wait and trigger (unless the
// producer takes them after its early weight loads), and in thread 0 the stage clock and the
// ring's barriers (full[s]: the producer warps' arrives, one per warp (full_arrivals), plus the
// stage's TMA bytes; empty[s]: empty_arrivals, one per math warp of every CTA that loads into the
// stage), made visible to TMA.
__device__ __forceinline__ void begin_gemm(const KernelArgs& args, bool early_weights, uint64_t* full, uint64_t* empty,
                                           int empty_arrivals, int full_arrivals = 1) {
  if (args.flags & kFlagEarlyTrigger) ptx::launch_dependents();
  if (!early_weights) {  // (without the PDL launch attribute the wait returns at once)
    ptx::grid_dependency_wait();
    ptx::launch_dependents();
  }
  if (threadIdx.x == 0) {
    if (!(args.flags & kFlagRowsReady)) stamp_start(args.stamp);  // (else once its schedule is known)
    for (int s = 0; s < args.num_stages; ++s) {
      ptx::mbar_init(&full[s], full_arrivals);
      ptx::mbar_init(&empty[s], empty_arrivals);
    }
    ptx::fence_barrier_init();
  }
}

// The producer warp's loop (lane 0 issues): for every k block of every tile of this CTA's walk
// (decode(tile) gives its TileInfo), wait for the stage to be free, announce tx_bytes,
// load_w(stage, kb, tile) (the weights) and load_a(stage, kb, tile) (activations and their
// scales). Early weights: the first ring of stages gets its weights (and the whole stage's
// expect-tx) before the PDL wait; their activation loads follow it.
//
// Split producers (role kProduceWeights in one warp, kProduceActivations in another, full
// barriers initialised with 2 arrivals): each warp waits for the free stage itself, announces
// only its own bytes (tx_bytes) and issues only its own copies, so the two warps issue in
// parallel. A stage completes once both have arrived and all bytes have landed, in either order.
// The activations' warp waits for the previous kernel (PDL) and for each expert's readiness; the
// weights' warp takes the early weights and the PDL trigger.
constexpr int kProduceBoth = 0, kProduceWeights = 1, kProduceActivations = 2;
// MaskedGemm::set_stage_trace (a study build, -DMOEKIT_STAGE_TRACE=ON; in every other build these
// are empty and the kernels' code is unchanged): CTA 0 writes the SM clock of event `what` (gemm.h
// kStageTrace*) of its stage number `stage` (counted from its first, over all its tiles); stages past
// the buffer's last overwrite it. A consumer tests once whether it traces (stage_tracer).
__device__ __forceinline__ void trace_at([[maybe_unused]] long long* trace, [[maybe_unused]] int stage,
                                         [[maybe_unused]] int what) {
#ifdef MOEKIT_STAGE_TRACE
  if (trace != nullptr) trace[min(stage, kStageTraceStages - 1) * kStageTraceEvents + what] = clock64();
#endif
}
__device__ __forceinline__ void trace_stage(const KernelArgs& args, int stage, int what) {
  trace_at(blockIdx.x == 0 ? args.stage_trace : nullptr, stage, what);
}
// The per-CTA stamps of the same study build (gemm.h kStageTraceCta*), by one thread of the CTA.
__device__ __forceinline__ void trace_cta([[maybe_unused]] const KernelArgs& args, [[maybe_unused]] int what) {
#ifdef MOEKIT_STAGE_TRACE
  if (args.stage_trace != nullptr && blockIdx.x < kStageTraceCtas)
    args.stage_trace[kStageTraceCtaBase + blockIdx.x * kStageTraceCtaEvents + what] =
        static_cast<long long>(global_timer_ns());
#endif
}
__device__ __forceinline__ long long* stage_tracer([[maybe_unused]] const KernelArgs& args) {
#ifdef MOEKIT_STAGE_TRACE
  return threadIdx.x == 128 && blockIdx.x == 0 ? args.stage_trace : nullptr;
#else
  return nullptr;
#endif
}
template <class Decode, class LoadW, class LoadA>
__device__ __forceinline__ void produce(const KernelArgs& args, int num_tiles, TileWalk walk, uint64_t* full,
                                        uint64_t* empty, uint32_t tx_bytes, bool early_weights, Decode&& decode,
                                        LoadW&& load_w, LoadA&& load_a, int role = kProduceBoth) {
  const int lane = threadIdx.x % 32, stages = args.num_stages;
  int prefetched = 0;
  const bool per_expert = early_weights && (args.flags & kFlagExpertReady);
  if (early_weights && role == kProduceActivations) {
    ptx::grid_dependency_wait();  // (begin_gemm waited otherwise)
  } else if (early_weights) {
    for (int tile = walk.first; tile < num_tiles && prefetched < stages; tile += walk.stride) {
      const TileInfo t = decode(tile);
      for (int kb = t.kb_begin; kb < t.kb_end && prefetched < stages; ++kb, ++prefetched) {
        if (lane == 0) {
          ptx::mbar_arrive_expect_tx(&full[prefetched], tx_bytes);
          load_w(prefetched, kb, t);
          trace_stage(args, prefetched, kStageTraceWeightsIssued);
        }
      }
    }
    if (!per_expert) {
      ptx::grid_dependency_wait();
      ptx::launch_dependents();
    }
  }
  int iter = 0, s = 0, ready_e = -1;
  uint32_t phase = 0;
  for (int tile = walk.first; tile < num_tiles; tile += walk.stride) {
    const TileInfo t = decode(tile);
    if (t.e < 0) continue;
    // (Tiles of one expert are consecutive in every walk. Split producers: only the activations
    // wait for their rows; the weights are static.)
    if (per_expert && role != kProduceWeights && t.e != ready_e) {
      if (lane == 0) expert_ready_wait(args, t.e, t.m_valid);
      ready_e = t.e;
    }
    for (int kb = t.kb_begin; kb < t.kb_end; ++kb, ++iter) {
      if (lane == 0) {
        if (iter >= prefetched) {
          ptx::mbar_wait(&empty[s], phase ^ 1);
          ptx::mbar_arrive_expect_tx(&full[s], tx_bytes);
          if (role == kProduceActivations) load_a(s, kb, t);
          else load_w(s, kb, t);
        }
        if (role == kProduceBoth) load_a(s, kb, t);
        if (role != kProduceActivations && iter >= prefetched) trace_stage(args, iter, kStageTraceWeightsIssued);
        if (role != kProduceWeights) trace_stage(args, iter, kStageTraceActivationsIssued);
      }
      if (++s == stages) s = 0, phase ^= 1;
    }
  }
  // The PDL chain's rule: trigger only after this kernel's own wait (the weights' warp, if split).
  if ((per_expert && role != kProduceActivations) || (args.flags & kFlagWeightsReady)) {
    ptx::grid_dependency_wait();
    ptx::launch_dependents();
  }
}

// Every thread's last step in a clustered kernel: no CTA leaves while a peer may still multicast
// into its shared memory or arrive on its barriers.
template <int kCluster>
__device__ __forceinline__ void end_cluster() {
  if constexpr (kCluster > 1) ptx::cluster_sync();
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
