// The MXFP4 parts of the grouped GEMM plans (gemm.h, kernel in gemm_mxfp4.cuh): the compiled
// instances, the weight and scale TMA maps, the bias; and the FP8 copy of contiguous plans
// (GemmConfig::mxfp4_fp8_copy, mxfp4_fp8_copy.cuh).
#include <string>
#include <vector>

#include "kernels/cuda/gemm_host.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mxfp4_fp8_copy.cuh"

namespace moekit::gemm_detail {

namespace {

// The kernel of a config: widening in registers (gemm_mxfp4.cuh) or by one or two warpgroups of
// its own (gemm_mxfp4_widen.cuh; two only beside one math warpgroup, up to 64 tokens), with the
// same tile sizes.
// With row scales: the register kernel's row-scale instance; a masked plan widening in warpgroups
// of their own reads the row's scale in every 1x128 slot instead (the same values).
template <bool kMasked, int kBlockT>
Launch mxfp4_instance(GemmConfig& cfg, int num_experts, bool row_scales) {
  if (row_scales && cfg.mxfp4_widen_wgs == 0) return Mxfp4Instance<kMasked, kBlockT, 0, 1, true>::launch(cfg, num_experts);
  MOEKIT_CHECK(kMasked || !row_scales, "contiguous MXFP4 GEMM config " + cfg.to_string() +
                                           ": a_row_scales (one activation scale per row) is compiled for the "
                                           "register kernel only; expected mxfp4_widen_wgs 0");
  switch (cfg.mxfp4_widen_wgs) {
    case 0: return Mxfp4Instance<kMasked, kBlockT, 0>::launch(cfg, num_experts);
    case 1: return Mxfp4Instance<kMasked, kBlockT, 1>::launch(cfg, num_experts);
    case 2:
      if constexpr (kMasked && kBlockT <= 64) return Mxfp4Instance<kMasked, kBlockT, 2>::launch(cfg, num_experts);
  }
  MOEKIT_CHECK(false, std::string(kMasked ? "masked" : "contiguous") + " MXFP4 GEMM config " + cfg.to_string() +
                          " is not compiled; expected mxfp4_widen_wgs 0 or 1, or 2 with masked tiles of at most 64 "
                          "tokens");
  return {};
}

Launch mxfp4_launch(GemmConfig& cfg, bool masked, int num_experts, bool row_scales) {
  const std::string bad = std::string(masked ? "masked" : "contiguous") + " MXFP4 GEMM config " + cfg.to_string() +
                          " is not compiled; expected ";
  MOEKIT_CHECK(cfg.cluster == 1, bad + "cluster = 1 (MXFP4 kernels run one CTA per cluster)");
  if (masked && cfg.swap_ab && cfg.block_n == 256) {  // two 128-row slabs a stage (gemm_mxfp4.cuh)
    MOEKIT_CHECK((cfg.block_m == 16 || cfg.block_m == 32 || cfg.block_m == 48) && cfg.mxfp4_widen_wgs == 0,
                 bad + "block_m = 16, 32 or 48 and mxfp4_widen_wgs = 0 with block_n = 256");
    if (row_scales) {
      if (cfg.block_m == 48) return Mxfp4Instance<true, 48, 0, 2, true>::launch(cfg, num_experts);
      if (cfg.block_m == 32) return Mxfp4Instance<true, 32, 0, 2, true>::launch(cfg, num_experts);
      return Mxfp4Instance<true, 16, 0, 2, true>::launch(cfg, num_experts);
    }
    if (cfg.block_m == 48) return Mxfp4Instance<true, 48, 0, 2>::launch(cfg, num_experts);
    if (cfg.block_m == 32) return Mxfp4Instance<true, 32, 0, 2>::launch(cfg, num_experts);
    return Mxfp4Instance<true, 16, 0, 2>::launch(cfg, num_experts);
  }
  MOEKIT_CHECK(cfg.swap_ab && cfg.block_n == 128,
               bad + "swap-AB with block_n = 128 (or 256 for masked tiles of 16, 32 or 48 tokens)");
  if (!masked) {
    switch (cfg.block_m) {
      case 64: return mxfp4_instance<false, 64>(cfg, num_experts, row_scales);
      case 128: return mxfp4_instance<false, 128>(cfg, num_experts, row_scales);
    }
    MOEKIT_CHECK(false, bad + "block_m in {64, 128}");
  }
  switch (cfg.block_m) {
    case 16: return mxfp4_instance<true, 16>(cfg, num_experts, row_scales);
    case 32: return mxfp4_instance<true, 32>(cfg, num_experts, row_scales);
    case 48: return mxfp4_instance<true, 48>(cfg, num_experts, row_scales);
    case 64: return mxfp4_instance<true, 64>(cfg, num_experts, row_scales);
    case 128: return mxfp4_instance<true, 128>(cfg, num_experts, row_scales);
  }
  MOEKIT_CHECK(false, bad + "block_m in {16, 32, 48, 64, 128}");
  return {};
}

}  // namespace

void bind_mxfp4_weights(PlanCore& plan, bool masked, int num_experts, int n, int k, const uint8_t* w,
                        const uint32_t* w_mx_scales, const float* bias, bool row_scales) {
  plan.launch = mxfp4_launch(plan.cfg, masked, masked ? num_experts : 0, row_scales);
  const int k_blocks = k / kBlockK;
  // Codes: tile-major (mxfp4_codes_for_gemm), seen as rows of 64 bytes, a box of 128 of them (one
  // stage: 128 weight rows x one 128-deep block, 8 KB in one piece). No swizzle for the math threads'
  // fragment loads (a quad reads a row's 64 bytes); the 64-byte swizzle for the widening warpgroup,
  // whose threads read one row each (gemm_mxfp4_widen.cuh). Scales: tile-major too, rows of 128
  // 4-byte words, a box of one row per stage (TMA moves them as fp32 words; the bits are not touched).
  if (plan.cfg.block_n == 256) {
    // Two 128-row slabs a stage (gemm_mxfp4.cuh): the same bytes seen as [E·N/128 row blocks][K/128
    // k blocks][128 rows of 64 bytes, or 128 words], a box of two row blocks, one copy per stage each.
    const uint64_t row_blocks = uint64_t(num_experts) * (n / 128);
    plan.tma_w = make_tma_3d(w, false, kBlockK / 2, uint64_t(k_blocks) * 128, row_blocks, kBlockK / 2, 128, 2);
    plan.tma_ws = make_tma_3d(w_mx_scales, true, 128, k_blocks, row_blocks, 128, 1, 2);
  } else {
    plan.tma_w = make_tma_2d(w, false, uint64_t(num_experts) * n * k_blocks, kBlockK / 2, kBlockK / 2, 128,
                             kBlockK / 2, plan.cfg.mxfp4_widen_wgs > 0 ? 64 : 0);
    plan.tma_ws = make_tma_2d(w_mx_scales, true, uint64_t(num_experts) * (n / 128) * k_blocks, 128, 128, 1, 128, 0);
  }
  plan.args.bias = bias;
  plan.args.w_mx_scales = w_mx_scales;
}

void bind_mxfp4_fp8_copy(PlanCore& plan, Mxfp4Fp8Copy& copy, int num_experts, int n, int k, const uint8_t* w,
                         const uint32_t* w_mx_scales, const float* bias, uint8_t* workspace) {
  const GemmConfig& c = plan.cfg;
  MOEKIT_CHECK(!c.swap_ab && c.block_m == 128 && c.block_n == 256 && c.cluster == 1 && c.num_splits == 1 &&
                   c.mxfp4_widen_wgs == 0,
               "contiguous MXFP4 GEMM config " + c.to_string() +
                   " is not compiled; the FP8 copy (fp8_copy) runs the normal orientation with block_m = 128, "
                   "block_n = 256, splits = 1, cluster = 1 and no widening warpgroups "
                   "(choose_mxfp4_fp8_copy_config)");
  const int sms = num_sms();
  MOEKIT_CHECK(c.mxfp4_fp8_copy_ctas >= 0 && c.mxfp4_fp8_copy_ctas < sms &&
                   (c.mxfp4_fp8_copy_ctas == 0 || (c.num_ctas > 0 && c.num_ctas + c.mxfp4_fp8_copy_ctas <= sms)),
               "contiguous MXFP4 GEMM config " + c.to_string() + ": beside_ctas (the SMs of the copy beside the GEMM) = " +
                   std::to_string(c.mxfp4_fp8_copy_ctas) + "; expected 0, or 1.." + std::to_string(sms - 1) +
                   " with ctas set and ctas + beside_ctas <= the device's " + std::to_string(sms) + " SMs");
  plan.launch = Instance<false, false, 2, 128, 256, false, 1, true>::launch(plan.cfg, 0);
  const int k_blocks = k / kBlockK;
  const size_t rows = size_t(num_experts) * n;
  const std::vector<float> ones(size_t(num_experts) * (n / kBlockK) * k_blocks, 1.0f);
  auto allocate = [&](auto** ptr, size_t bytes, const char* what) {  // the size in the message: it may be GBs
    const cudaError_t err = cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
    MOEKIT_CHECK(err == cudaSuccess, std::string("contiguous MXFP4 GEMM (fp8_copy): allocating ") + what + " of " +
                                         std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(err));
  };
  copy.owns_w8 = workspace == nullptr;
  if (copy.owns_w8) allocate(&copy.w8, rows * k, "the FP8 copy (E x N x K)");
  else copy.w8 = workspace;
  allocate(&copy.col_scale, rows * sizeof(float), "the column factors");
  allocate(&copy.unit_scales, ones.size() * sizeof(float), "the unit block scales");
  MOEKIT_CUDA_CHECK(cudaMemcpy(copy.unit_scales, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  copy.codes = w;
  copy.words = w_mx_scales;
  copy.runs = int(size_t(num_experts) * (n / kBlockK) * k_blocks);
  copy.k = k;
  plan.tma_w = make_tma_2d(copy.w8, false, rows, k, k, plan.cfg.block_n, kBlockK, 128);
  plan.args.bias = bias;
  plan.args.out_col_scale = copy.col_scale;
  plan.args.flags |= kFlagPdl;  // the GEMM's prologue under the copy's tail; it waits for the copy
  copy.ctas = c.mxfp4_fp8_copy_ctas;
  if (copy.ctas > 0) {  // the GEMM on the other SMs, row block by row block
    const size_t counters = rows / kBlockK + 1;
    allocate(&copy.ready, counters * sizeof(int), "the row-block counters");
    MOEKIT_CUDA_CHECK(cudaMemset(copy.ready, 0, counters * sizeof(int)));
    allow_smem(reinterpret_cast<const void*>(&mxfp4_fp8_copy_beside_kernel), kBesideSmemBytes);
    plan.args.ready_in = copy.ready;
    plan.args.flags |= kFlagWeightsReady;
  }
}

Mxfp4Fp8Copy::~Mxfp4Fp8Copy() {
  if (owns_w8) cudaFree(w8);  // no throw from a destructor; freeing null is a no-op
  cudaFree(col_scale);
  cudaFree(unit_scales);
  cudaFree(ready);
}

void Mxfp4Fp8Copy::run(cudaStream_t stream, unsigned long long* stamp) const {
  if (ctas > 0) {
    launch_kernel_ex(mxfp4_fp8_copy_beside_kernel, dim3(ctas), dim3(kBesideThreads), kBesideSmemBytes, stream, pdl,
                     reinterpret_cast<const uint32_t*>(codes), words, k, runs, w8, col_scale, ready, stamp);
    return;
  }
  launch_kernel_ex(mxfp4_fp8_copy_kernel, dim3(runs), dim3(kFp8CopyThreads), 0, stream, pdl,
                   reinterpret_cast<const uint32_t*>(codes), words, k, w8, col_scale, stamp);
}

}  // namespace moekit::gemm_detail
