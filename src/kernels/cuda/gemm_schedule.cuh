// gemm_schedule.cuh: the tile schedule of the grouped GEMM kernels: the shared-memory layout of a
// pipeline stage, the tile order and its decoding, the tile count of a masked launch, and the
// producer warp's loop (gemm_fp8.cuh has the FP8 kernel; its arguments are in gemm_args.cuh, the
// per-expert readiness the producer waits on in gemm_ready.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemm_args.cuh"
#include "kernels/cuda/gemm_ready.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/stamp.cuh"
#include "moekit/gemm.h"

namespace moekit::gemm_detail {

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

}  // namespace moekit::gemm_detail
