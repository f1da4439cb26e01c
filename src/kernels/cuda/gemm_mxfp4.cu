// The MXFP4 parts of the grouped GEMM plans (gemm.h, kernel in gemm_mxfp4.cuh): the compiled
// instances, the weight and scale TMA maps, the bias.
#include <string>

#include "kernels/cuda/gemm_host.cuh"

namespace moekit::gemm_detail {

namespace {

Launch mxfp4_launch(GemmConfig& cfg, bool masked, int num_experts) {
  const std::string bad = std::string(masked ? "masked" : "contiguous") + " MXFP4 GEMM config " + cfg.to_string() +
                          " is not compiled; expected ";
  MOEKIT_CHECK(cfg.swap_ab && cfg.block_n == 128, bad + "swap-AB with block_n = 128");
  MOEKIT_CHECK(cfg.cluster == 1, bad + "cluster = 1 (MXFP4 kernels run one CTA per cluster)");
  if (!masked) {
    switch (cfg.block_m) {
      case 64: return Mxfp4Instance<false, 64>::launch(cfg, num_experts);
      case 128: return Mxfp4Instance<false, 128>::launch(cfg, num_experts);
    }
    MOEKIT_CHECK(false, bad + "block_m in {64, 128}");
  }
  switch (cfg.block_m) {
    case 16: return Mxfp4Instance<true, 16>::launch(cfg, num_experts);
    case 32: return Mxfp4Instance<true, 32>::launch(cfg, num_experts);
    case 48: return Mxfp4Instance<true, 48>::launch(cfg, num_experts);
    case 64: return Mxfp4Instance<true, 64>::launch(cfg, num_experts);
    case 128: return Mxfp4Instance<true, 128>::launch(cfg, num_experts);
  }
  MOEKIT_CHECK(false, bad + "block_m in {16, 32, 48, 64, 128}");
  return {};
}

}  // namespace

void bind_mxfp4_weights(PlanCore& plan, bool masked, int num_experts, int n, int k, const uint8_t* w,
                        const uint32_t* w_mx_scales, const float* bias) {
  plan.launch = mxfp4_launch(plan.cfg, masked, masked ? num_experts : 0);
  const int k_blocks = k / kBlockK;
  // Codes: tile-major (mxfp4_codes_for_gemm), seen as rows of 64 bytes, a box of 128 of them (one
  // stage: 128 weight rows x one 128-deep block, 8 KB in one piece), no swizzle (the consumers read
  // them with ordinary loads). Scales: tile-major too, rows of 128 4-byte words, a box of one row
  // per stage (TMA moves them as fp32 words; the bits are not touched).
  plan.tma_w = make_tma_2d(w, false, uint64_t(num_experts) * n * k_blocks, kBlockK / 2, kBlockK / 2, 128, kBlockK / 2,
                           false);
  plan.tma_ws = make_tma_2d(w_mx_scales, true, uint64_t(num_experts) * (n / 128) * k_blocks, 128, 128, 1, 128, false);
  plan.args.bias = bias;
  plan.args.w_mx_scales = w_mx_scales;
}

}  // namespace moekit::gemm_detail
