// gemm_host.cuh: host-side pieces shared by the masked and contiguous GEMM plans: TMA
// descriptor encoding (through the runtime's driver entry point: libcuda is not linked),
// argument checks, the config heuristic's helpers, and the launcher of one kernel instance.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/gemm_fp8.cuh"
#include "kernels/cuda/gemm_mxfp4.cuh"
#include "kernels/cuda/gemm_mxfp4_widen.cuh"
#include "moekit/cuda_check.h"
#include "moekit/gemm.h"

namespace moekit::gemm_detail {

// A row-major 2D tensor of `rows` x `cols` elements (cols innermost, row stride in elements)
// as a TMA map with a box of box_rows x box_cols; swizzle_bytes 128 for the FP8 operand tiles, 64
// for the MXFP4 codes the widening warpgroup reads (gemm_mxfp4_widen.cuh), 0 for none.
CUtensorMap make_tma_2d(const void* ptr, bool is_fp32, uint64_t rows, uint64_t cols, uint64_t row_stride,
                        uint32_t box_rows, uint32_t box_cols, int swizzle_bytes);
// A dense 3D tensor of d2 x d1 x d0 elements (d0 innermost, no padding), unswizzled, with a box of
// b2 x b1 x b0: two MXFP4 weight slabs of a stage as one copy (gemm_mxfp4.cu).
CUtensorMap make_tma_3d(const void* ptr, bool is_fp32, uint64_t d0, uint64_t d1, uint64_t d2, uint32_t b0, uint32_t b1,
                        uint32_t b2);

void check_shape(int n, int k);            // N, K positive multiples of 128
void check_pointer(const void* p, const char* name);  // non-null, 16-byte aligned
// w, and w_scales (FP8) or w_mx_scales (MXFP4), each with the other format's pointers null; bias only
// with MXFP4, 4-byte aligned.
void check_weight_buffers(bool mxfp4, const void* w, const float* w_scales, const uint32_t* w_mx_scales, const float* bias);
// A config with cluster = 2 (any other was refused by the instance dispatch): FP8, BF16 output,
// no split-K, and `cols` output columns in an even number of weight blocks.
void check_cluster(const GemmConfig& cfg, int cols);
// MOEKIT_PRINT_CONFIGS=1: "moekit " + what on stderr, once per plan made (a GEMM's config, a
// layer's pipeline).
void maybe_print_plan(const std::string& what);
void maybe_print_config(const char* kind, const std::string& problem, const GemmConfig& cfg);
// MOEKIT_MXFP4_WIDEN (registers | smem | smem2, or unset) over a heuristic's MXFP4 config: a study
// knob, so that one build can run the layer every way (GemmConfig::mxfp4_widen_wgs 0 | 1 | 2; smem2
// takes one widening warpgroup where two are not compiled: contiguous plans, tiles above 64 tokens).
void apply_mxfp4_widen_knob(GemmConfig& cfg, bool masked);
// MOEKIT_MXFP4_PREFILL (copy | registers, or unset) over a heuristic's contiguous MXFP4 config: copy
// takes choose_mxfp4_fp8_copy_config, registers the heuristic's (GemmConfig::mxfp4_fp8_copy).
void apply_mxfp4_prefill_knob(GemmConfig& cfg, const ContiguousGemmProblem& p);
int max_smem_per_block();
int num_sms();
// The current device's peak HBM bandwidth (memory clock x 2 x bus width) over its SMs x SM clock;
// 0 where the device does not report them.
double hbm_bytes_per_sm_cycle();
// A masked MXFP4 config of 16-, 32- or 48-token tiles with `rows` (128 or 256) weight rows per tile:
// block_n, the ring depth that fits, and the split count for the new number of tiles.
void set_mxfp4_rows(GemmConfig& cfg, const MaskedGemmProblem& p, int rows);
// MOEKIT_MXFP4_ROWS (128 | 256, or unset) over a heuristic's masked MXFP4 config of 16-, 32- or 48-token tiles:
// the weight rows per tile (set_mxfp4_rows), a study knob for the layer's A/B.
void apply_mxfp4_rows_knob(GemmConfig& cfg, const MaskedGemmProblem& p);

// Stages that fit next to the fixed part, capped where deeper buys nothing. Layout: the
// kernel's SmemLayout (or Mxfp4SmemLayout); extra_static: static shared memory beyond the
// kernel's own few words (the gated epilogue's amax exchange).
template <class Layout>
int stages_that_fit(int num_experts, int extra_static) {
  int per = Layout::kStageBytes;
  int fixed = Layout::bytes(0, num_experts) + 2048 + extra_static;  // + static shared and slack
  int s = (max_smem_per_block() - fixed) / per;
  return s > 16 ? 16 : s;
}

// Fills num_stages, smem_bytes and num_ctas of cfg for a kernel with shared-memory Layout.
template <class Layout>
void finish_config(GemmConfig& cfg, int num_experts, int extra_static) {
  const int budget = max_smem_per_block();
  if (cfg.num_stages <= 0) cfg.num_stages = stages_that_fit<Layout>(num_experts, extra_static);
  MOEKIT_CHECK(cfg.num_stages >= 2, "GEMM config: " + std::to_string(cfg.num_stages) +
                                        " pipeline stages do not fit in shared memory; expected at least 2");
  cfg.smem_bytes = Layout::bytes(cfg.num_stages, num_experts);
  MOEKIT_CHECK(cfg.smem_bytes <= budget, "GEMM config " + cfg.to_string() + " needs " + std::to_string(cfg.smem_bytes) +
                                             " bytes of shared memory per CTA; the device has " +
                                             std::to_string(budget));
  if (cfg.num_ctas <= 0 && cfg.cluster == 1) cfg.num_ctas = num_sms();  // clusters: cluster_ctas
}

// Raises a kernel's dynamic shared-memory limit to the device's opt-in maximum (less its static
// shared memory) after checking that smem_bytes fits. The limit belongs to the kernel function,
// not to a plan: a later plan of the same kernel with a smaller ring never lowers it below what
// an earlier plan launches with. After the first call for a kernel on a device, a call is a
// lookup and the check, so launchers may make it on every launch.
void allow_smem(const void* kernel, int smem_bytes);

// A plan's kernel: FP8 weights (three TMA maps) or MXFP4 weights (a fourth, for the scales).
struct Launch {
  void (*kernel)(CUtensorMap, CUtensorMap, CUtensorMap, KernelArgs) = nullptr;
  void (*kernel_mxfp4)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, KernelArgs) = nullptr;
  int threads = 0;
  int cluster = 1;
};

template <bool kSwapAB, bool kMasked, int kMathWGs, int kBlockT, int kBlockW, bool kGated, int kCluster, bool kAffine>
Launch get_launch(int smem_bytes) {
  Launch l;
  l.kernel = &grouped_gemm_kernel<kSwapAB, kMasked, kMathWGs, kBlockT, kBlockW, kGated, kCluster, kAffine>;
  allow_smem(reinterpret_cast<const void*>(l.kernel), smem_bytes);
  l.threads = (kMathWGs + 1) * 128;
  l.cluster = kCluster;
  return l;
}

// The grid of a plan: cfg.num_ctas when set (checked to be a multiple of cfg.cluster), else (with
// clusters) as many CTAs as can be resident at once: a persistent grid with a cluster that waits
// for a free pair of multiprocessors would double its tiles' time.
int cluster_ctas(const Launch& launch, const GemmConfig& cfg);

// One launch of a plan's kernel (with the programmatic-serialisation attribute when
// args.flags has kFlagPdl).
void launch_kernel(const Launch& launch, const GemmConfig& cfg, const CUtensorMap& tma_a, const CUtensorMap& tma_w,
                   const CUtensorMap& tma_sa, const CUtensorMap& tma_ws, const KernelArgs& args, cudaStream_t stream);

// Split-K workspace owned by a plan.
struct SplitWorkspace {
  float* partials = nullptr;
  int* counters = nullptr;
  void allocate(size_t slots, int splits, int tile_elems);
  ~SplitWorkspace();
};

// What a plan holds and does, whatever its layout.
struct PlanCore {
  GemmConfig cfg;
  CUtensorMap tma_a{}, tma_w{}, tma_sa{};
  CUtensorMap tma_ws{};  // MXFP4: the weights' e8m0 scales
  KernelArgs args;
  Launch launch;
  SplitWorkspace workspace;
  // The arguments common to both layouts; allocates the split-K workspace of `split_slots`
  // tiles (of `slabs` accumulators each: 2 for gated tiles) when cfg splits K.
  void bind(int num_experts, int n, int k, int rows, const float* w_scales, uint16_t* out, size_t split_slots,
            int slabs = 1);
  void run(cudaStream_t stream) const;
  void set_overlap(Overlap overlap);
};

}  // namespace moekit::gemm_detail

namespace moekit::gemm_detail {

// One compiled kernel instance, as a type the plans dispatch on. kGated: the SiLU·up + FP8
// epilogue (a tile holds kBlockW gate rows and kBlockW up rows). kCluster: CTAs per cluster.
// kAffine: the per-column factor and bias of an MXFP4 plan's FP8 copy (KernelArgs::out_col_scale).
template <bool kSwapAB_, bool kMasked_, int kMathWGs_, int kBlockT_, int kBlockW_, bool kGated_ = false,
          int kCluster = 1, bool kAffine = false>
struct Instance {
  static constexpr bool kSwapAB = kSwapAB_;
  static constexpr bool kMasked = kMasked_;
  static constexpr int kMathWGs = kMathWGs_;
  static constexpr int kBlockT = kBlockT_;
  static constexpr int kBlockW = kBlockW_;
  static constexpr bool kGated = kGated_;
  static Launch launch(GemmConfig& cfg, int num_experts) {
    constexpr int kWRows = kGated ? 2 * kBlockW : kBlockW;
    constexpr int kExtraStatic = kGated ? kMathWGs * 4 * kBlockT * 4 : 0;  // gemm_epilogue.cuh's warp_amax
    MOEKIT_CHECK(cfg.cluster == kCluster, "GEMM config " + cfg.to_string() + " dispatched to a kernel of cluster " +
                                              std::to_string(kCluster));
    constexpr int kEpiBytes = epilogue_smem_bytes(kSwapAB, kGated, kMathWGs, kBlockT);
    finish_config<SmemLayout<kBlockT, kWRows, kEpiBytes>>(cfg, num_experts, kExtraStatic);
    Launch l = get_launch<kSwapAB, kMasked, kMathWGs, kBlockT, kBlockW, kGated, kCluster, kAffine>(cfg.smem_bytes);
    cfg.num_ctas = cluster_ctas(l, cfg);
    return l;
  }
};

// Refuses a kernel whose registers at launch are fewer than its warpgroups' setmaxnreg split draws
// on (its consumers would wait for them forever): that is ptxas's to decide, so the device is asked.
void check_register_split(const void* kernel, const GemmConfig& cfg, int launch_regs);

// One compiled MXFP4 kernel instance (swap-AB, 128 · kSlabs weight rows per tile): widening in the
// math threads' registers (kWidenWGs 0, gemm_mxfp4.cuh; kSlabs 2 there only) or by kWidenWGs
// warpgroups of its own into shared memory (gemm_mxfp4_widen.cuh; GemmConfig::mxfp4_widen_wgs);
// kRowScales: the register kernel with one activation scale per row (ContiguousGemmProblem::a_row_scales,
// MaskedGemmProblem::a_row_scales).
template <bool kMasked, int kBlockT, int kWidenWGs, int kSlabs = 1, bool kRowScales = false>
struct Mxfp4Instance {
  static_assert(!kRowScales || (kWidenWGs == 0 && (kMasked || kSlabs == 1)),
                "row scales: the register kernel, one slab in contiguous plans");
  static constexpr bool kWiden = kWidenWGs > 0;
  static_assert(kSlabs == 1 || !kWiden, "256-row MXFP4 tiles widen in registers");
  using Layout = std::conditional_t<kWiden, Mxfp4WidenSmemLayout<kBlockT>, Mxfp4SmemLayout<kBlockT, kSlabs>>;
  using Regs = std::conditional_t<kWiden, Mxfp4WidenRegisters<kWidenWGs>, Mxfp4Registers>;
  static Launch launch(GemmConfig& cfg, int num_experts) {
    finish_config<Layout>(cfg, num_experts, 0);
    Launch l;
    if constexpr (kWiden) l.kernel_mxfp4 = &grouped_gemm_mxfp4_widen_kernel<kMasked, kBlockT, kWidenWGs>;
    else l.kernel_mxfp4 = &grouped_gemm_mxfp4_kernel<kMasked, kBlockT, kSlabs, kRowScales>;
    l.threads = Regs::kThreads;
    allow_smem(reinterpret_cast<const void*>(l.kernel_mxfp4), cfg.smem_bytes);
    check_register_split(reinterpret_cast<const void*>(l.kernel_mxfp4), cfg, Regs::kLaunch);
    return l;
  }
};

// The MXFP4 parts of a plan (gemm_mxfp4.cu), on buffers check_weight_buffers passed: picks the
// instance, builds the weight and scale TMA maps (tma_a and tma_sa are the FP8 plan's).
// row_scales: the problem's a_row_scales (a contiguous plan sets args.a_row_scales; a masked one's
// stages carry the scales as before). A masked plan whose config widens in warpgroups of their own
// reads the same values as 1x128 scales.
void bind_mxfp4_weights(PlanCore& plan, bool masked, int num_experts, int n, int k, const uint8_t* w,
                        const uint32_t* w_mx_scales, const float* bias, bool row_scales = false);

// A contiguous MXFP4 plan's FP8 copy of its weights (GemmConfig::mxfp4_fp8_copy, mxfp4_fp8_copy.cuh):
// the workspace it owns and the widening kernel that fills it before each run of the FP8 GEMM.
struct Mxfp4Fp8Copy {
  uint8_t* w8 = nullptr;             // [E, N, K] e4m3, in the MXFP4 GEMM's K order
  bool owns_w8 = false;              // allocated here (the caller gave no fp8_copy_workspace)
  float* col_scale = nullptr;        // [E, N] the rows' factors 2^(base - 127)
  float* unit_scales = nullptr;      // [E, N/128, K/128] 1.0: the FP8 kernel's block scales
  const uint8_t* codes = nullptr;    // the plan's MXFP4 buffers
  const uint32_t* words = nullptr;
  int runs = 0, k = 0;
  bool pdl = false;                  // the plan's overlap with the kernel before it
  int ctas = 0;                      // > 0: the copy beside the GEMM on this many SMs
  int* ready = nullptr;              // beside: [E x N / 128 + 1] row-block counters (gemm_ready.cuh)
  Mxfp4Fp8Copy() = default;
  Mxfp4Fp8Copy(const Mxfp4Fp8Copy&) = delete;
  Mxfp4Fp8Copy& operator=(const Mxfp4Fp8Copy&) = delete;
  ~Mxfp4Fp8Copy();
  void run(cudaStream_t stream, unsigned long long* stamp) const;
};

// The FP8-copy parts of a contiguous MXFP4 plan (gemm_mxfp4.cu): checks the config, allocates
// the copy (in `workspace` where given: checked non-null and aligned by the caller), picks the FP8
// kernel with the affine epilogue and builds its weight TMA map; the GEMM always waits for the copy
// (kFlagPdl), for all of it or (GemmConfig::mxfp4_fp8_copy_ctas) row block by row block
// (kFlagWeightsReady). The caller binds with copy.unit_scales as w_scales.
void bind_mxfp4_fp8_copy(PlanCore& plan, Mxfp4Fp8Copy& copy, int num_experts, int n, int k, const uint8_t* w,
                         const uint32_t* w_mx_scales, const float* bias, uint8_t* workspace);

// Split-K factor: 1 unless the tiles leave SMs idle in the only wave (gemm_heuristic.cu).
int choose_splits(long tiles, int num_sms, int k_blocks);
// The rows per expert a masked plan is made for: expected_m where given (at most M_max), else M_max.
int planned_rows(const MaskedGemmProblem& p);

}  // namespace moekit::gemm_detail
