// gemm_args.cuh: what the grouped GEMM kernels (gemm_fp8.cuh, gemm_mxfp4.cuh, gemm_mxfp4_widen.cuh)
// receive from the host and agree on: the kernel arguments, the flags that pair a GEMM with the
// kernels beside it on the stream, the order experts are walked in, and a tile's descriptor.
// Host and device; no device code beyond the walk order. The readiness the flags name is in
// gemm_ready.cuh, the tile schedule in gemm_schedule.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

// One tile of a schedule (gemm_schedule.cuh decode_tile).
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

}  // namespace moekit::gemm_detail
