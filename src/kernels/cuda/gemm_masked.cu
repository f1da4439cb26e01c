// The masked (decode) grouped GEMM plan: validation, config, TMA maps, workspace, launch.
#include <string>

#include "kernels/cuda/gemm_host.cuh"

namespace moekit {

using namespace gemm_detail;

struct MaskedGemm::Impl : PlanCore {
  MaskedGemmProblem problem;
};

namespace {

// The instances compiled for the masked layout.
template <class F>
void with_masked_instance(const GemmConfig& cfg, GemmEpilogue epilogue, F&& f) {
  const std::string bad = "masked GEMM config " + cfg.to_string() + " is not compiled; expected ";
  if (epilogue == GemmEpilogue::kSiluMulFp8) {
    MOEKIT_CHECK(cfg.swap_ab && cfg.block_n == 128, bad + "swap-AB with block_n = 128 for the SiLU·up epilogue");
    MOEKIT_CHECK(cfg.cluster == 1, bad + "cluster = 1 for the SiLU·up epilogue");
    switch (cfg.block_m) {
      case 16: return f(Instance<true, true, 2, 16, 128, true>{});
      case 32: return f(Instance<true, true, 2, 32, 128, true>{});
      case 64: return f(Instance<true, true, 2, 64, 128, true>{});
    }
    MOEKIT_CHECK(false, bad + "block_m in {16, 32, 64} for the SiLU·up epilogue");
  }
  if (cfg.swap_ab && cfg.block_n == 64) {
    // One math warpgroup, 64 weight rows per tile: twice the tiles, for a fuller last wave.
    MOEKIT_CHECK(cfg.block_m == 16, bad + "block_m = 16 with block_n = 64");
    return f(Instance<true, true, 1, 16, 64>{});
  }
  if (cfg.block_n == 256 && cfg.swap_ab) {
    // Two 128-row slabs per tile (gemm_fp8.cuh): half the tiles, so half the per-tile fixed work
    // per weight byte, where K is short.
    MOEKIT_CHECK(cfg.cluster == 1, bad + "cluster = 1 for swap-AB with block_n = 256");
    switch (cfg.block_m) {
      case 16: return f(Instance<true, true, 2, 16, 256>{});
      case 32: return f(Instance<true, true, 2, 32, 256>{});
      case 64: return f(Instance<true, true, 2, 64, 256>{});
    }
    MOEKIT_CHECK(false, bad + "block_m in {16, 32, 64} for swap-AB with block_n = 256");
  }
  if (cfg.block_n == 256) {
    // Two 128-column halves per tile (gemm_fp8.cuh): fewer stage bytes per FLOP where the tokens
    // fill the M side (above 64 rows per expert).
    MOEKIT_CHECK(cfg.block_m == 128 && cfg.cluster == 1 && cfg.num_splits == 1,
                 bad + "the normal orientation with block_m = 128, cluster = 1, num_splits = 1 with block_n = 256");
    return f(Instance<false, true, 2, 128, 256>{});
  }
  MOEKIT_CHECK(cfg.block_n == 128, bad + "block_n = 128 (or 64 with swap-AB block_m = 16, 256 with swap-AB up to "
                                         "block_m = 64 or in the normal orientation)");
  if (cfg.cluster == 2) {
    if (cfg.swap_ab) {
      switch (cfg.block_m) {
        case 64: return f(Instance<true, true, 2, 64, 128, false, 2>{});
        case 128: return f(Instance<true, true, 2, 128, 128, false, 2>{});
      }
      MOEKIT_CHECK(false, bad + "block_m in {64, 128} for swap-AB with cluster = 2");
    }
    MOEKIT_CHECK(cfg.block_m == 128, bad + "block_m = 128 with cluster = 2");
    return f(Instance<false, true, 2, 128, 128, false, 2>{});
  }
  MOEKIT_CHECK(cfg.cluster == 1, bad + "cluster in {1, 2}");
  if (cfg.swap_ab) {
    switch (cfg.block_m) {
      case 16: return f(Instance<true, true, 2, 16, 128>{});
      case 32: return f(Instance<true, true, 2, 32, 128>{});
      case 48: return f(Instance<true, true, 2, 48, 128>{});
      case 64: return f(Instance<true, true, 2, 64, 128>{});
      case 128: return f(Instance<true, true, 2, 128, 128>{});
    }
    MOEKIT_CHECK(false, bad + "block_m in {16, 32, 48, 64, 128} for swap-AB");
  }
  switch (cfg.block_m) {
    case 64: return f(Instance<false, true, 1, 64, 128>{});
    case 128: return f(Instance<false, true, 2, 128, 128>{});
  }
  MOEKIT_CHECK(false, bad + "block_m in {64, 128}");
}

std::string describe(const MaskedGemmProblem& p) {
  return "E=" + std::to_string(p.num_experts) + " N=" + std::to_string(p.n) + " K=" + std::to_string(p.k) +
         " M_max=" + std::to_string(p.max_m) + " expected_m=" + std::to_string(p.expected_m) +
         (p.last_expert_m > 0 ? " last_expert_m=" + std::to_string(p.last_expert_m) : "") +
         (p.epilogue == GemmEpilogue::kSiluMulFp8 ? " epilogue=silu-mul-fp8" : "") +
         (p.weights == WeightFormat::kMxfp4 ? " weights=mxfp4" : "") + (p.a_row_scales ? " a_row_scales" : "");
}

}  // namespace

MaskedGemm::MaskedGemm(const MaskedGemmProblem& p, const MaskedGemmBuffers& b, const GemmConfig* config)
    : impl_(std::make_unique<Impl>()) {
  MOEKIT_CHECK(p.num_experts > 0 && p.num_experts <= 4096,
               "masked GEMM: E_loc = " + std::to_string(p.num_experts) + "; expected 1..4096");
  check_shape(p.n, p.k);
  MOEKIT_CHECK(p.max_m > 0 && p.max_m % 4 == 0,
               "masked GEMM: M_max = " + std::to_string(p.max_m) + " must be a positive multiple of 4");
  MOEKIT_CHECK(p.expected_m >= 0, "masked GEMM: expected_m = " + std::to_string(p.expected_m) + " must be >= 0");
  MOEKIT_CHECK(p.last_expert_m >= 0,
               "masked GEMM: last_expert_m = " + std::to_string(p.last_expert_m) + " must be >= 0");
  check_pointer(b.a, "a");
  check_pointer(b.a_scales, "a_scales");
  check_pointer(b.masked_m, "masked_m");
  const bool gated = p.epilogue == GemmEpilogue::kSiluMulFp8;
  const bool mxfp4 = p.weights == WeightFormat::kMxfp4;
  check_weight_buffers(mxfp4, b.w, b.w_scales, b.w_mx_scales, b.bias);
  MOEKIT_CHECK(mxfp4 || !p.a_row_scales,
               "masked GEMM " + describe(p) + ": a_row_scales (one activation scale per row) needs MXFP4 weights");
  MOEKIT_CHECK(!(mxfp4 && gated), "masked GEMM: the SiLU·up epilogue needs FP8 weights; with MXFP4 weights use "
                                  "the BF16 output (gemm.h)");
  if (gated) {
    MOEKIT_CHECK(p.n % (2 * kBlockK) == 0, "masked GEMM with the SiLU·up epilogue: N = " + std::to_string(p.n) +
                                               " must be 2·inter with inter a multiple of 128");
    check_pointer(b.act, "act");
    check_pointer(b.act_scales, "act_scales");
  } else {
    check_pointer(b.out, "out");
  }
  const int k_blocks = p.k / kBlockK;

  Impl& im = *impl_;
  im.problem = p;
  im.cfg = config ? *config : choose_masked_config(p, num_sms());
  if (config == nullptr && mxfp4) {
    apply_mxfp4_widen_knob(im.cfg, true);
    if (mxfp4_wide_tiles(p, im.cfg, num_sms(), hbm_bytes_per_sm_cycle())) set_mxfp4_rows(im.cfg, p, 256);
    apply_mxfp4_rows_knob(im.cfg, p);
  }
  MOEKIT_CHECK(mxfp4 || im.cfg.mxfp4_widen_wgs == 0,
               "masked GEMM config " + im.cfg.to_string() +
                   ": mxfp4_widen_wgs (the widening warpgroups) needs MXFP4 weights");
  MOEKIT_CHECK(!im.cfg.mxfp4_fp8_copy, "masked GEMM config " + im.cfg.to_string() +
                                           ": fp8_copy (an FP8 copy of MXFP4 weights) is for contiguous plans");
  MOEKIT_CHECK(im.cfg.num_splits >= 1 && im.cfg.num_splits <= k_blocks,
               "masked GEMM: num_splits = " + std::to_string(im.cfg.num_splits) + "; expected 1..K/128 = " +
                   std::to_string(k_blocks));
  if (mxfp4) {
    bind_mxfp4_weights(im, true, p.num_experts, p.n, p.k, b.w, b.w_mx_scales, b.bias, p.a_row_scales);
  } else {
    with_masked_instance(im.cfg, p.epilogue,
                         [&](auto inst) { im.launch = decltype(inst)::launch(im.cfg, p.num_experts); });
    im.tma_w = make_tma_2d(b.w, false, uint64_t(p.num_experts) * p.n, p.k, p.k, im.cfg.block_n, kBlockK, 128);
  }

  check_cluster(im.cfg, gated ? p.n / 2 : p.n);
  // A 256-row FP8 swap-AB tile stores both of its slabs: N must hold whole tiles. (The MXFP4 kernel
  // leaves a second slab past N unstored.)
  MOEKIT_CHECK(!(im.cfg.swap_ab && im.cfg.block_n == 256) || mxfp4 || p.n % 256 == 0,
               "masked GEMM: swap-AB with block_n = 256 needs N a multiple of 256; N = " + std::to_string(p.n));
  const int bm = im.cfg.block_m, bn = im.cfg.block_n;
  im.tma_a = make_tma_2d(b.a, false, uint64_t(p.num_experts) * p.max_m, p.k, p.k, bm / im.cfg.cluster, kBlockK, 128);
  im.tma_sa = make_tma_2d(b.a_scales, true, uint64_t(p.num_experts) * k_blocks, p.max_m, p.max_m, 1, bm, 0);

  const int cols = gated ? p.n / 2 : p.n;  // output columns
  const size_t split_slots = size_t(p.num_experts) * ((cols + bn - 1) / bn) * ((p.max_m + bm - 1) / bm);
  im.bind(p.num_experts, p.n, p.k, p.max_m, b.w_scales, b.out, split_slots, gated ? 2 : 1);
  im.args.masked_m = b.masked_m;
  im.args.act = b.act;
  im.args.act_scales = b.act_scales;
  MOEKIT_CHECK(!(mxfp4 && (b.ready_out || b.ready_in)),
               "masked GEMM: per-expert readiness (ready_out / ready_in) needs FP8 weights; the MXFP4 kernel "
               "neither signals nor waits");
  MOEKIT_CHECK(b.ready_in == nullptr || b.ready_in != b.ready_out,
               "masked GEMM: ready_in and ready_out are the same counters; a GEMM waits for the previous one's");
  im.args.ready_out = b.ready_out;
  im.args.ready_in = b.ready_in;
  maybe_print_config("masked", describe(p), im.cfg);
}

MaskedGemm::~MaskedGemm() = default;

const GemmConfig& MaskedGemm::config() const { return impl_->cfg; }

void MaskedGemm::run(cudaStream_t stream) const { impl_->run(stream); }

void MaskedGemm::set_overlap(Overlap overlap) {
  MOEKIT_CHECK(overlap != Overlap::kPreviousGemmPerExpert || impl_->args.ready_in != nullptr,
               "masked GEMM: kPreviousGemmPerExpert needs ready_in (the previous GEMM's ready_out counters); "
               "this plan has none");
  MOEKIT_CHECK(overlap != Overlap::kDispatchPerExpert || impl_->args.ready_in != nullptr,
               "masked GEMM: kDispatchPerExpert needs ready_in (the counters the dispatch receive fills, "
               "EpBuffer::dispatch_recv's rows_ready); this plan has none");
  impl_->set_overlap(overlap);
}

void MaskedGemm::set_early_trigger(bool on) {
  MOEKIT_CHECK(!on || impl_->args.ready_out != nullptr,
               "masked GEMM: set_early_trigger needs ready_out (the counters its successor waits on per expert); "
               "this plan has none");
  impl_->args.flags = on ? impl_->args.flags | kFlagEarlyTrigger : impl_->args.flags & ~kFlagEarlyTrigger;
}

void MaskedGemm::set_last_expert_first(bool on) {
  MOEKIT_CHECK(!on || impl_->problem.weights == WeightFormat::kFp8,
               "masked GEMM: set_last_expert_first needs FP8 weights; the MXFP4 kernel walks the experts in order");
  impl_->args.flags = on ? impl_->args.flags | kFlagLastExpertFirst : impl_->args.flags & ~kFlagLastExpertFirst;
}

void MaskedGemm::set_timeline(unsigned long long* stamp) { impl_->args.stamp = stamp; }
void MaskedGemm::set_stage_trace(long long* trace) {
#ifndef MOEKIT_STAGE_TRACE
  MOEKIT_CHECK(trace == nullptr,
               "MaskedGemm::set_stage_trace: this library was built without the stage trace; configure with "
               "-DMOEKIT_STAGE_TRACE=ON for a study build");
#endif
  impl_->args.stage_trace = trace;
}

}  // namespace moekit
