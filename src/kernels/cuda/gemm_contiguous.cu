// The contiguous (prefill) grouped GEMM plan: validation, config, TMA maps, launch.
#include <string>

#include "kernels/cuda/gemm_host.cuh"

namespace moekit {

using namespace gemm_detail;

struct ContiguousGemm::Impl : PlanCore {
  ContiguousGemmProblem problem;
  Mxfp4Fp8Copy copy;  // GemmConfig::mxfp4_fp8_copy: the widened weights (w8 null otherwise)
};

namespace {

template <class F>
void with_contiguous_instance(const GemmConfig& cfg, F&& f) {
  const std::string bad = "contiguous GEMM config " + cfg.to_string() + " is not compiled; expected ";
  MOEKIT_CHECK(!cfg.swap_ab && (cfg.block_n == 128 || cfg.block_n == 256),
               bad + "the normal orientation with block_n in {128, 256}");
  if (cfg.block_n == 256) {
    MOEKIT_CHECK(cfg.block_m == 128 && cfg.cluster == 1 && cfg.num_splits == 1,
                 bad + "block_m = 128, cluster = 1, num_splits = 1 with block_n = 256");
    return f(Instance<false, false, 2, 128, 256>{});
  }
  if (cfg.cluster == 2) {
    MOEKIT_CHECK(cfg.block_m == 128, bad + "block_m = 128 with cluster = 2");
    return f(Instance<false, false, 2, 128, 128, false, 2>{});
  }
  MOEKIT_CHECK(cfg.cluster == 1, bad + "cluster in {1, 2}");
  switch (cfg.block_m) {
    case 64: return f(Instance<false, false, 1, 64, 128>{});
    case 128: return f(Instance<false, false, 2, 128, 128>{});
  }
  MOEKIT_CHECK(false, bad + "block_m in {64, 128}");
}

std::string describe(const ContiguousGemmProblem& p) {
  return "E=" + std::to_string(p.num_experts) + " N=" + std::to_string(p.n) + " K=" + std::to_string(p.k) +
         " M_total=" + std::to_string(p.total_m) + (p.weights == WeightFormat::kMxfp4 ? " weights=mxfp4" : "") +
         (p.a_row_scales ? " a_row_scales" : "");
}

}  // namespace

ContiguousGemm::ContiguousGemm(const ContiguousGemmProblem& p, const ContiguousGemmBuffers& b,
                               const GemmConfig* config)
    : impl_(std::make_unique<Impl>()) {
  MOEKIT_CHECK(p.num_experts > 0, "contiguous GEMM: E_loc = " + std::to_string(p.num_experts) + "; expected >= 1");
  check_shape(p.n, p.k);
  MOEKIT_CHECK(p.total_m > 0 && p.total_m % kContiguousAlign == 0,
               "contiguous GEMM: M_total = " + std::to_string(p.total_m) + " must be a positive multiple of " +
                   std::to_string(kContiguousAlign) + " (padded expert segments)");
  check_pointer(b.a, "a");
  check_pointer(b.a_scales, "a_scales");
  check_pointer(b.row_expert, "row_expert");
  check_pointer(b.out, "out");
  const bool mxfp4 = p.weights == WeightFormat::kMxfp4;
  check_weight_buffers(mxfp4, b.w, b.w_scales, b.w_mx_scales, b.bias);
  MOEKIT_CHECK(mxfp4 || !p.a_row_scales, "contiguous GEMM " + describe(p) +
                                             ": a_row_scales (one activation scale per row) needs MXFP4 weights");
  const int k_blocks = p.k / kBlockK;

  Impl& im = *impl_;
  im.problem = p;
  im.cfg = config ? *config : contiguous_plan_config(p);
  MOEKIT_CHECK(mxfp4 || im.cfg.mxfp4_widen_wgs == 0,
               "contiguous GEMM config " + im.cfg.to_string() +
                   ": mxfp4_widen_wgs (the widening warpgroups) needs MXFP4 weights");
  MOEKIT_CHECK(mxfp4 || !im.cfg.mxfp4_fp8_copy,
               "contiguous GEMM config " + im.cfg.to_string() + ": fp8_copy (an FP8 copy of MXFP4 weights) needs "
                   "MXFP4 weights");
  MOEKIT_CHECK(!p.a_row_scales || !im.cfg.mxfp4_fp8_copy,
               "contiguous GEMM config " + im.cfg.to_string() +
                   ": fp8_copy runs the FP8 kernel, which takes block scales; a_row_scales is compiled for the "
                   "MXFP4 register kernel only");
  MOEKIT_CHECK(im.cfg.num_splits >= 1 && im.cfg.num_splits <= k_blocks,
               "contiguous GEMM: num_splits = " + std::to_string(im.cfg.num_splits) + "; expected 1..K/128 = " +
                   std::to_string(k_blocks));
  const float* w_scales = b.w_scales;
  MOEKIT_CHECK(b.fp8_copy_workspace == nullptr || im.cfg.mxfp4_fp8_copy,
               "contiguous GEMM config " + im.cfg.to_string() +
                   ": fp8_copy_workspace is set, but the plan makes no FP8 copy (GemmConfig::mxfp4_fp8_copy)");
  if (b.fp8_copy_workspace) check_pointer(b.fp8_copy_workspace, "fp8_copy_workspace");
  if (mxfp4 && im.cfg.mxfp4_fp8_copy) {
    bind_mxfp4_fp8_copy(im, im.copy, p.num_experts, p.n, p.k, b.w, b.w_mx_scales, b.bias, b.fp8_copy_workspace);
    w_scales = im.copy.unit_scales;
  } else if (mxfp4) {
    bind_mxfp4_weights(im, false, p.num_experts, p.n, p.k, b.w, b.w_mx_scales, b.bias, p.a_row_scales);
  } else {
    with_contiguous_instance(im.cfg, [&](auto inst) { im.launch = decltype(inst)::launch(im.cfg, 0); });
    im.tma_w = make_tma_2d(b.w, false, uint64_t(p.num_experts) * p.n, p.k, p.k, im.cfg.block_n, kBlockK, 128);
  }

  check_cluster(im.cfg, p.n);
  const int bm = im.cfg.block_m, bn = im.cfg.block_n;
  im.tma_a = make_tma_2d(b.a, false, p.total_m, p.k, p.k, bm / im.cfg.cluster, kBlockK, 128);
  // (Row scales: one row of M_total; the kernel reads them itself, args.a_row_scales.)
  im.tma_sa = make_tma_2d(b.a_scales, true, p.a_row_scales ? 1 : k_blocks, p.total_m, p.total_m, 1, bm, 0);

  im.bind(p.num_experts, p.n, p.k, p.total_m, w_scales, b.out, size_t(p.total_m / bm) * ((p.n + bn - 1) / bn));
  im.args.row_expert = b.row_expert;
  if (p.a_row_scales) im.args.a_row_scales = b.a_scales;
  maybe_print_config("contiguous", describe(p), im.cfg);
}

GemmConfig contiguous_plan_config(const ContiguousGemmProblem& p) {
  GemmConfig cfg = choose_contiguous_config(p, num_sms());
  // (The prefill and widening knobs pick kernels that take block scales.)
  if (p.weights != WeightFormat::kMxfp4 || p.a_row_scales) return cfg;
  apply_mxfp4_prefill_knob(cfg, p);
  if (!cfg.mxfp4_fp8_copy) apply_mxfp4_widen_knob(cfg, false);
  return cfg;
}

size_t mxfp4_fp8_copy_bytes(const ContiguousGemmProblem& p) {
  MOEKIT_CHECK(p.num_experts > 0 && p.n > 0 && p.k > 0,
               "mxfp4_fp8_copy_bytes: E_loc = " + std::to_string(p.num_experts) + ", N = " + std::to_string(p.n) +
                   ", K = " + std::to_string(p.k) + "; expected all positive");
  return size_t(p.num_experts) * size_t(p.n) * size_t(p.k);
}

ContiguousGemm::~ContiguousGemm() = default;

const GemmConfig& ContiguousGemm::config() const { return impl_->cfg; }

void ContiguousGemm::run(cudaStream_t stream) const {
  if (impl_->copy.w8) impl_->copy.run(stream, impl_->args.stamp);
  impl_->run(stream);
}

void ContiguousGemm::set_timeline(unsigned long long* stamp) { impl_->args.stamp = stamp; }

void ContiguousGemm::set_overlap(Overlap overlap) {
  const char* name = overlap == Overlap::kPreviousKernelStaticWeights ? "kPreviousKernelStaticWeights"
                     : overlap == Overlap::kPreviousGemmPerExpert       ? "kPreviousGemmPerExpert"
                     : overlap == Overlap::kDispatchPerExpert           ? "kDispatchPerExpert"
                                                                        : nullptr;
  MOEKIT_CHECK(name == nullptr, std::string("contiguous GEMM: ") + (name ? name : "") +
                                    " needs the masked layout (the schedule of the contiguous layout depends on "
                                    "row_expert, which the previous kernel may write)");
  impl_->set_overlap(overlap);
  if (impl_->copy.w8) {  // the copy is the plan's first kernel; the GEMM always overlaps the copy
    impl_->copy.pdl = overlap == Overlap::kPreviousKernel;
    impl_->args.flags |= kFlagPdl;
  }
}

}  // namespace moekit
