// moekit/gemm.h: FP8 grouped expert GEMM on Hopper (sm_90a): masked (decode) and contiguous
// (prefill) layouts of layout.h, out = A · Wᵀ per local expert, BF16 output.
//
// Numerics (docs/design.md §Numerics and their bounds): A is FP8 e4m3 with one fp32 scale per (row,
// 128 columns of K), W is FP8 e4m3 with one fp32 scale per 128x128 block. Every 128-deep K block is
// accumulated in the tensor core, then both scales are applied and the block is added into an fp32
// accumulator on the CUDA cores (two-level accumulation); the result is rounded once to BF16.
//
// Plan once, run many. A plan binds the problem shape and the device buffers, builds the TMA
// descriptors (which hold the addresses) and owns any workspace (split-K partials and their
// counters, an FP8 copy of MXFP4 weights). `run` is graph-safe: it launches one kernel on the stream (two for a contiguous plan
// through an FP8 copy of MXFP4 weights, GemmConfig::mxfp4_fp8_copy), allocates nothing,
// never synchronises, and never reads shapes on the host: masked_m stays on the device, so a
// CUDA Graph captured once and replayed with new masked_m contents and new data in the same
// buffers computes the new result. A plan's workspace is used by one run at a time (runs of one
// plan on one stream are ordered; two streams need two plans).
//
// Masked (decode):
//   a         [E_loc, M_max, K] fp8 e4m3         a_scales [E_loc, K/128, M_max] fp32
//   w         [E_loc, N, K] fp8 e4m3             w_scales [E_loc, N/128, K/128] fp32
//   masked_m  [E_loc] int32 on the device: rows of expert e that are real; values are clamped
//             to [0, M_max]. Experts with masked_m = 0 read no weights.
//   out       [E_loc, M_max, N] bf16 bits (moekit/bf16.h); rows at or past masked_m[e] are not
//             written.
// Masked with the SiLU·up + FP8 epilogue (problem.epilogue = kSiluMulFp8, the MoE layer's GEMM1):
//   w holds each expert's [gate; up] rows (N = 2·inter), and instead of `out` the GEMM writes
//   act [E_loc, M_max, inter] fp8 e4m3 = SiLU(gate)·up with its 1x128 scales act_scales
//   [E_loc, inter/128, M_max] fp32: the same bits as running the activation kernel on the BF16
//   output of the same accumulation (gate and up are rounded to BF16 first), without the BF16
//   round trip through HBM and the activation's own launch. Needs inter a multiple of 128;
//   tiles are swap-AB with at most 64 tokens (an expert with more rows takes more token blocks).
// Contiguous (prefill):
//   a [M_total, K] fp8, a_scales [K/128, M_total] fp32 (or [M_total]: a_row_scales, below),
//   row_expert [M_total] int32 (-1: padding, its output row is not written), out [M_total, N] bf16
//   bits. Each expert's rows are together and every segment is padded to a multiple of
//   kContiguousAlign rows, padding at its end, so that every block of the GEMM's BM rows belongs
//   to a single expert.
//
// MXFP4 weights (problem.weights = WeightFormat::kMxfp4; gpt-oss's experts), either layout:
//   w       E_loc x N x K/2 bytes of e2m1 codes (values in mxfp4.h), rewritten from the checkpoint's
//           [E_loc, N, K/2] by mxfp4_codes_for_gemm (mxfp4.h): tile-major, one contiguous 8 KB per
//           128 rows x 128-deep block, each 64-byte row in the order of the tensor core's fragments
//   w_mx_scales E_loc x N x K/128 32-bit words, tile-major as w: each row's base scale with the
//           widening's shifts of its 128-deep block, made from the checkpoint's codes and
//           [E_loc, N, K/32] scales by mxfp4_scales_for_gemm (mxfp4.h)
//   bias    [E_loc, N] fp32 or null: added to the fp32 accumulator before the BF16 rounding
//   w_scales must be null. The weights stream from HBM at 4.25 bits each and are widened to e4m3
//   on the chip (in the math threads' registers, or with GemmConfig::mxfp4_widen_wgs by
//   warpgroups of their own into shared memory); the result is reference.h's MXFP4 contract
//   (exact widening for groups within 2^14 of their row's largest scale). Tiles are always
//   swap-AB with block_n = 128; the SiLU·up epilogue is not available with MXFP4 weights.
//   The FP8 activations `a` are in the MXFP4 GEMM's K order (mxfp4.h mxfp4_k_position: permuted
//   inside each 128-deep block, so that every value a tensor-core lane widens is of one scale
//   group; their 1x128 scales as usual): mxfp4_permute_k makes them from natural rows, and an
//   MXFP4 layer's EP buffer and activation kernel write them so.
//   Contiguous plans may take the activations with one scale per row for all of K
//   (ContiguousGemmProblem::a_row_scales: a_scales [M_total] fp32, each row quantised as one
//   group, scale = amax / 448 over the row): the register kernel then keeps the whole K in the
//   tensor core's accumulator and applies the row's scale once at the end, with no partial sum
//   per 128-deep block to promote. Not with the FP8 copy or the widening warpgroups below.
//   Contiguous plans may instead widen the weights once per run into an FP8 copy and run the FP8
//   kernel on it (GemmConfig::mxfp4_fp8_copy; choose_mxfp4_fp8_copy_config): the plan then uses
//   E_loc x N x K bytes of e4m3 (its own, or the caller's fp8_copy_workspace, which plans that never
//   run at once may share) and E_loc x N column factors besides, and `run` launches two
//   kernels (the copy, then the FP8 GEMM with the row factor and the bias in its epilogue). The
//   e4m3 values are those the other kernels widen, so the contract above holds unchanged. For
//   prefill of many rows per expert, where the FP8 kernel's rate is the limit and the other
//   kernels widen the same weights again in every token tile. With GemmConfig::mxfp4_fp8_copy_ctas
//   the copy runs beside the GEMM on that many SMs and the GEMM (on num_ctas others, the two
//   together at most the device's SMs) starts on each 128-row block of the copy once it is made;
//   the plan then also owns E_loc x N / 128 + 1 counters, which each run leaves at zero.
//
// Requirements (checked when a plan is made, with the bad value in the message): N and K
// multiples of 128, M_max and M_total multiples of 4 (16-byte rows of scales for TMA),
// M_total a multiple of kContiguousAlign, all pointers non-null, device buffers 16-byte aligned.
// The kernels need a compute capability 9.0 device (sm_90a); that is not checked here.
//
// Overlap with the previous kernel (programmatic dependent launch, off by default): with
// set_overlap(kPreviousKernel) the kernel may be scheduled while the previous kernel on the
// stream is still running and waits for it (griddepcontrol.wait) before touching anything that
// kernel may write. kPreviousKernelStaticWeights (masked only) promises that the previous kernel
// writes neither masked_m nor the weights: the schedule and the first ring of weight tiles are
// then loaded before the wait, so the weight stream starts under the previous kernel's tail
// (GEMM2 after the activation kernel, or back-to-back GEMMs of one step).
// kPreviousGemmPerExpert (masked, FP8) is kPreviousKernelStaticWeights where the previous kernel
// is a masked GEMM that signals its experts one by one: this GEMM's ready_in is that GEMM's
// ready_out (E_loc + 1 device ints, zero when first used), and its producer waits for each
// expert's rows to be complete instead of for the previous grid, so GEMM2 of a decode step
// streams the experts GEMM1 has finished while GEMM1 is still busy with the rest. The counter of
// expert e reaches (K / 64) · masked_m[e] of the waiting GEMM when the signalling GEMM has stored
// all of its output rows of e (its N = the waiting GEMM's K); the waiting GEMM's last CTA zeroes
// the counters for the next run, so the pair must run together in every step (a GEMM with
// ready_in also resets when it runs without the overlap).
// kDispatchPerExpert (masked, FP8) is the same hand-off from the EP dispatch receive (ep.h
// EpBuffer::dispatch_recv with rows_ready = this GEMM's ready_in, E_loc + 2 device ints, zero when
// first used): the GEMM may start as soon as the receive has started, reads masked_m once the
// receive has published it (ready_in[E_loc + 1] nonzero), loads its first ring of weights, and
// loads each expert's rows once ready_in[e] has counted masked_m[e] of them; its last CTA zeroes
// all E_loc + 2 counters. The receive must leave SMs free (its num_ctas) for the GEMM's CTAs to
// be resident while it copies. A receive CTA that times out sets kRowsReadyAbort in
// ready_in[E_loc + 1]: the GEMM then stops waiting for rows (its output is not meaningful, and
// the receive's fault record names the peer), so a timeout never leaves the GEMM spinning.
//
// set_early_trigger(true) (masked, FP8, with ready_out) lets the kernel launched after this one
// on the stream start as soon as every CTA of this one has started, on the SMs this GEMM's CTAs
// leave as they finish, instead of after this GEMM's own wait: only for a successor that takes
// this GEMM's rows expert by expert through ready_out (at (N / 64) · masked_m[e], as above) with
// ordinary loads, not TMA (the signal then skips the async-proxy fence), waits
// for this grid before it completes, and reads nothing else a kernel before this one may still
// write (ep.h EpBuffer::combine_send with y_ready, the fused decode pipeline's combine).
//
// set_last_expert_first(true) (masked, FP8) walks expert E_loc - 1 first and loads its weights
// without demoting their L2 lines (the other experts' stream through the L2 as evict-first); with
// kDispatchPerExpert each CTA also asks the L2 for a share of that expert's weights while it
// waits for the receive to publish masked_m, when HBM carries little else. For an expert sure to
// be read whatever the routing: the fused decode step's merged shared expert (the rank's own
// tokens). Results are the same bits in either order (each tile is computed alike).
//
// Configs: a problem descriptor (E_loc, N, K, M_max, expected_m, last_expert_m) goes through a
// small heuristic that returns a GemmConfig; MOEKIT_PRINT_CONFIGS=1 prints it when a plan is made.
// expected_m and last_expert_m only steer the choice; correctness never depends on them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

namespace moekit {

constexpr int kContiguousAlign = 128;  // rows per padded expert segment in the contiguous layout

// MaskedGemm::set_stage_trace's buffer: [stage][event] int64 clocks, events in this order.
constexpr int kStageTraceStages = 1024, kStageTraceEvents = 6;
// After the stage records (from word kStageTraceCtaBase), kStageTraceCtaEvents global-timer stamps
// for each of the first kStageTraceCtas CTAs (MaskedGemm::set_stage_trace).
constexpr int kStageTraceCtas = 1024, kStageTraceCtaEvents = 3;
constexpr int kStageTraceCtaEntry = 0, kStageTraceCtaBegin = 1, kStageTraceCtaEnd = 2;
constexpr int kStageTraceCtaBase = kStageTraceStages * kStageTraceEvents;
constexpr int kStageTraceWords = kStageTraceCtaBase + kStageTraceCtas * kStageTraceCtaEvents;
constexpr int kStageTraceWeightsIssued = 0, kStageTraceActivationsIssued = 1, kStageTraceWaitBegin = 2,
              kStageTraceWaitEnd = 3, kStageTraceMmaIssued = 4, kStageTraceReleased = 5;

// The tile shape and schedule of one launch.
struct GemmConfig {
  bool swap_ab = false;  // weights on the MMA's M side, tokens on its N side (small M_e)
  int block_m = 0;       // tokens per tile (MMA N when swap_ab, else 64 · math warpgroups)
  int block_n = 0;       // weight rows (output columns) per tile: 128; 64 (masked swap-AB, 16 tokens);
                         // 256 (normal orientation, block_m 128, contiguous or masked, one CTA, no split-K:
                         // fewer stage bytes per FLOP;
                         // masked swap-AB up to 64 tokens, BF16 output, N a multiple of 256: two 128-row slabs;
                         // MXFP4 weights: 16, 32 or 48 tokens, widened in registers, any N (a last slab past
                         // N is not stored); mxfp4_wide_tiles says where the heuristic takes it)
  int num_stages = 0;    // shared-memory pipeline depth
  int num_splits = 1;    // split-K factor (partials reduced by the last split of a tile)
  int num_ctas = 0;      // persistent grid size (a multiple of cluster)
  int smem_bytes = 0;
  // CTAs per cluster: 2 pairs neighbouring weight blocks of one token block, which then share
  // its activation tile by TMA multicast (FP8, BF16 output, no split-K, an even number of
  // weight blocks); 1 otherwise.
  int cluster = 1;
  // MXFP4 weights: 0 widens the codes to e4m3 in every math thread's registers; 1 gives the
  // widening a warpgroup of its own that writes each stage's e4m3 tile to shared memory for two
  // math warpgroups, 2 gives it two warpgroups (alternate stages) for one math warpgroup (tiles
  // of up to 64 tokens). The heuristic takes 0 (measured: docs/gemm-mxfp4.md runs 24, 27 and 29);
  // MOEKIT_MXFP4_WIDEN=registers, smem or smem2 sets it over the heuristic's pick. The same
  // products in the same order, so the same results.
  int mxfp4_widen_wgs = 0;
  // MXFP4 weights, contiguous plans: widen the weights into an FP8 copy of the plan's (one kernel,
  // mxfp4_fp8_copy.cuh), then run the FP8 kernel on it in the normal orientation, block_m 128,
  // block_n 256, no split-K, no cluster (choose_mxfp4_fp8_copy_config). Not the heuristic's pick
  // until measured on a GPU (docs/gemm-mxfp4.md); MOEKIT_MXFP4_PREFILL=copy or registers sets it
  // over the heuristic for contiguous MXFP4 plans made without a config.
  bool mxfp4_fp8_copy = false;
  // With mxfp4_fp8_copy: > 0 makes the copy beside the GEMM, on this many SMs of their own, and
  // hands each 128-row block of it to the GEMM (on num_ctas other SMs) once it is widened over all
  // of K (mxfp4_fp8_copy.cuh); 0 makes the whole copy first. choose_mxfp4_fp8_copy_beside_config;
  // MOEKIT_MXFP4_PREFILL=beside (or beside:N for N SMs) sets it over the heuristic.
  int mxfp4_fp8_copy_ctas = 0;
  std::string to_string() const;
};

enum class Overlap { kNone, kPreviousKernel, kPreviousKernelStaticWeights, kPreviousGemmPerExpert, kDispatchPerExpert };

// kDispatchPerExpert: the bit of the published word (ready_in[E_loc + 1]) a timed-out producer
// sets; the publication itself is the word's low bits.
constexpr int32_t kRowsReadyAbort = 1 << 30;

enum class GemmEpilogue { kBf16, kSiluMulFp8 };

enum class WeightFormat { kFp8, kMxfp4 };

struct MaskedGemmProblem {
  int num_experts = 0;  // E_loc
  int n = 0;
  int k = 0;
  int max_m = 0;        // M_max
  int expected_m = 0;   // typical rows per expert with tokens; 0: unknown (assume M_max)
  GemmEpilogue epilogue = GemmEpilogue::kBf16;
  WeightFormat weights = WeightFormat::kFp8;
  // Rows the last expert is known to hold when it is not a routed one (the layer's merged shared
  // expert: every token of the rank); 0: like the others (expected_m).
  int last_expert_m = 0;
  // MXFP4 weights: each row's K/128 scale slots hold one scale, its token's (quant.h
  // Fp8Scaling::kPerToken; a_scales keeps its layout). The register kernel then keeps the whole K
  // in the tensor core's accumulator and multiplies the scale once, where it otherwise promotes
  // a partial sum after every 128-deep block (docs/gemm-mxfp4.md run 44); a config that widens
  // in warpgroups of their own reads the slots as 1x128 scales, the same values.
  bool a_row_scales = false;
};

struct ContiguousGemmProblem {
  int num_experts = 0;
  int n = 0;
  int k = 0;
  int total_m = 0;  // M_total
  WeightFormat weights = WeightFormat::kFp8;
  // MXFP4 weights, the register kernel: a_scales holds one scale per row for all of K ([M_total]
  // fp32) instead of one per row and 128-deep block (see above). Its 128-token tile then has no
  // block partial to promote between its wgmmas, the work that holds the kernel's prefill rate
  // below the FP8 kernel's (docs/gemm-mxfp4.md run 41).
  bool a_row_scales = false;
};

// Heuristics (pure functions of the problem and the multiprocessor count).
GemmConfig choose_masked_config(const MaskedGemmProblem& p, int num_sms);
GemmConfig choose_contiguous_config(const ContiguousGemmProblem& p, int num_sms);
// MXFP4 weights, masked, a heuristic's config (choose_masked_config): whether tiles of 256 weight
// rows (block_n = 256, two 128-row slabs a stage) should replace its 48-token tiles on a GPU whose
// HBM gives `hbm_bytes_per_sm_cycle` (its peak bandwidth over SMs x SM clock; 0: unknown). Where
// HBM outruns the 128-row kernel's chain per stage (an H200: ~19 B per SM cycle; an H100: ~13,
// where both tilings wait on HBM alike), the wider tile's shorter chain per weight byte pays, if
// its tiles do not cost more rounds of SMs. 16- and 32-token tiles take them only through
// MOEKIT_MXFP4_ROWS: on an H200 they did not pay there (docs/gemm-mxfp4.md runs 34, 36-39 and 42).
bool mxfp4_wide_tiles(const MaskedGemmProblem& p, const GemmConfig& cfg, int num_sms, double hbm_bytes_per_sm_cycle);
// The config of a contiguous MXFP4 problem through an FP8 copy of its weights
// (GemmConfig::mxfp4_fp8_copy); throws moekit::Error naming the format for FP8 weights.
GemmConfig choose_mxfp4_fp8_copy_config(const ContiguousGemmProblem& p, int num_sms);
// The same with the copy beside the GEMM (GemmConfig::mxfp4_fp8_copy_ctas): `copy_ctas` SMs for the
// copy, or 0 for the fewest that keep it ahead of the GEMM on the rest (counted from the problem's
// bytes and FLOPs, gemm_heuristic.cu); throws moekit::Error naming copy_ctas outside 0..num_sms-1.
GemmConfig choose_mxfp4_fp8_copy_beside_config(const ContiguousGemmProblem& p, int num_sms, int copy_ctas = 0);
// The config a ContiguousGemm made without one takes: choose_contiguous_config on the current
// device's SMs, then, for MXFP4 weights, the MOEKIT_MXFP4_PREFILL and MOEKIT_MXFP4_WIDEN knobs.
// For callers that size memory by the config before they make the plan (a layer that gives its
// GEMMs one FP8 copy workspace).
GemmConfig contiguous_plan_config(const ContiguousGemmProblem& p);

// The expected_m to plan for when `rows` routed rows fall uniformly on `experts` experts: the mean
// plus two standard deviations (Poisson), at least 1, so that few experts need a second token
// block. Planning for the mean itself gives about half of them one (their weights read twice).
// Throws moekit::Error naming the value when rows < 0 or experts < 1.
int upper_typical_rows(int64_t rows, int experts);

struct MaskedGemmBuffers {
  const uint8_t* a = nullptr;
  const float* a_scales = nullptr;
  const uint8_t* w = nullptr;
  const float* w_scales = nullptr;
  const int32_t* masked_m = nullptr;
  uint16_t* out = nullptr;          // kBf16
  uint8_t* act = nullptr;           // kSiluMulFp8
  float* act_scales = nullptr;      // kSiluMulFp8
  const uint32_t* w_mx_scales = nullptr;  // kMxfp4
  const float* bias = nullptr;      // kMxfp4, optional
  int32_t* ready_out = nullptr;     // optional: per-expert readiness this GEMM signals (FP8)
  int32_t* ready_in = nullptr;      // kPreviousGemmPerExpert / kDispatchPerExpert: the readiness it waits for (FP8)
};

struct ContiguousGemmBuffers {
  const uint8_t* a = nullptr;
  const float* a_scales = nullptr;
  const int32_t* row_expert = nullptr;
  const uint8_t* w = nullptr;
  const float* w_scales = nullptr;
  uint16_t* out = nullptr;
  const uint32_t* w_mx_scales = nullptr;  // kMxfp4
  const float* bias = nullptr;      // kMxfp4, optional
  // GemmConfig::mxfp4_fp8_copy, optional: mxfp4_fp8_copy_bytes(problem) bytes of device memory for
  // the copy, 16-byte aligned. Plans that never run at the same time may share one (a layer's
  // GEMMs on one stream, every layer of a model); null: the plan allocates its own.
  uint8_t* fp8_copy_workspace = nullptr;
};
// The bytes of an FP8 copy of a contiguous problem's MXFP4 weights: E_loc x N x K.
size_t mxfp4_fp8_copy_bytes(const ContiguousGemmProblem& p);

class MaskedGemm {
 public:
  // Validates, chooses a config (or takes `config` when given; its num_ctas/num_stages may be 0
  // to be filled in), builds the TMA descriptors and allocates the workspace.
  MaskedGemm(const MaskedGemmProblem& problem, const MaskedGemmBuffers& buffers, const GemmConfig* config = nullptr);
  ~MaskedGemm();
  MaskedGemm(const MaskedGemm&) = delete;
  MaskedGemm& operator=(const MaskedGemm&) = delete;

  void run(cudaStream_t stream) const;  // graph-safe
  const GemmConfig& config() const;
  void set_overlap(Overlap overlap);
  void set_early_trigger(bool on);  // see the top of this file
  void set_last_expert_first(bool on);  // see the top of this file
  // Stage clock (a timeline of a step): every later run writes the %globaltimer nanoseconds of
  // its first CTA's start to stamp[0] (atomicMin) and its last CTA's end to stamp[1]
  // (atomicMax); the caller resets the pair. Null (the default) records nothing.
  void set_timeline(unsigned long long* stamp);
  // A study tool, not for serving, in a library built with -DMOEKIT_STAGE_TRACE=ON (elsewhere a
  // non-null `trace` throws, naming the option; the kernels of other builds carry no trace code).
  // With `trace` a device buffer of kStageTraceWords int64 (zeroed by the caller), CTA 0 writes its
  // SM clock (clock64) for each of its first kStageTraceStages stages: when its copies of the
  // weights and of the activations were issued, and when its first math warp began and ended its
  // wait for the stage, committed the stage's wgmmas and handed the stage back (the masked FP8
  // kernel, whose 256-column tiles record only the copies and the wait, and the MXFP4 register
  // kernel). Then every CTA c < kStageTraceCtas writes the global timer (ns, comparable across
  // SMs) at [kStageTraceCtaBase + c x kStageTraceCtaEvents + kStageTraceCta*]:
  // when it entered the kernel, when its math warps were ready for their first tile (after the
  // set-up and the schedule), and when they finished their last. Null (the default) records nothing.
  void set_stage_trace(long long* trace);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class ContiguousGemm {
 public:
  ContiguousGemm(const ContiguousGemmProblem& problem, const ContiguousGemmBuffers& buffers,
                 const GemmConfig* config = nullptr);
  ~ContiguousGemm();
  ContiguousGemm(const ContiguousGemm&) = delete;
  ContiguousGemm& operator=(const ContiguousGemm&) = delete;

  void run(cudaStream_t stream) const;  // graph-safe
  const GemmConfig& config() const;
  void set_overlap(Overlap overlap);  // kNone or kPreviousKernel
  void set_timeline(unsigned long long* stamp);  // as MaskedGemm's

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit
