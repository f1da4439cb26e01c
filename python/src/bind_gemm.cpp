// FP8 grouped GEMMs, masked (decode) and contiguous (prefill), on the caller's tensors:
// CPU tensors run the reference (reference.h), CUDA tensors the Hopper kernels (gemm.h).
//
// Arguments follow DeepGEMM's m_grouped_fp8_gemm_nt_masked / _contiguous: a = (a, a_scales) with
// MN-major activation scales, b = (w, w_scales) with 128x128 block scales, d the bf16 output.
//
// CUDA plans. gemm.h's MaskedGemm / ContiguousGemm bind the buffers at construction (TMA
// descriptors, workspace) and then only launch. The binding keeps one plan per distinct set of
// buffers and shapes, made at its first call, so repeated calls on the static buffers of a
// serving engine, and a CUDA Graph captured after one warm-up call, launch the kernel and
// nothing else. Plans live until clear_gemm_plans(): a captured graph uses their workspace.
#include <fmt/format.h>

#include <map>
#include <memory>
#include <tuple>

#include "bindings.h"
#include "moekit/layout.h"
#include "moekit/reference.h"
#include "tensor.h"

#if defined(MOEKIT_WITH_CUDA)
#include "moekit/cuda_check.h"
#include "moekit/gemm.h"
#endif

namespace nb = nanobind;

namespace moekit::py {

namespace {

struct Operand {
  Tensor values, scales;
};

// a pair (tensor, scales), as DeepGEMM takes it.
std::pair<nb::handle, nb::handle> pair_arg(nb::handle obj, const char* name) {
  if (!nb::isinstance<nb::tuple>(obj) || nb::len(obj) != 2)
    throw nb::type_error(fmt::format("{} must be a pair ({}, {}_scales), got {}", name, name, name,
                                     nb::type_name(obj.type()).c_str())
                             .c_str());
  return {obj[0], obj[1]};
}

void expect_k(const Tensor& t, int64_t k) {
  if (k <= 0 || k % kQuantBlock != 0)
    throw nb::value_error(fmt::format("{}: K = {} must be a positive multiple of 128", t.name, k).c_str());
}

// w [E_loc, N, K] fp8 + w_scales [E_loc, N/128, K/128].
Operand weights_arg(nb::handle b, int64_t num_experts, int64_t k) {
  auto [w_obj, s_obj] = pair_arg(b, "b");
  Operand op{take(w_obj, "b[0] (weights)", {DType::kFp8}), take(s_obj, "b[1] (weight scales)", {DType::kFloat32})};
  expect_shape(op.values, {{num_experts, "E_loc"}, {-1, "N"}, {k, "K"}});
  expect_contiguous(op.values);
  int64_t n = op.values.dim(1);
  if (n % kQuantBlock != 0 || n == 0)
    throw nb::value_error(fmt::format("b[0] (weights): N = {} must be a positive multiple of 128", n).c_str());
  expect_shape(op.scales, {{num_experts, "E_loc"}, {n / kQuantBlock, "N/128"}, {k / kQuantBlock, "K/128"}});
  expect_contiguous(op.scales);
  return op;
}

#if defined(MOEKIT_WITH_CUDA)
using PlanKey = std::tuple<int, const void*, const void*, const void*, const void*, const void*, const void*, int64_t,
                           int64_t, int64_t, int64_t, int64_t>;
std::map<PlanKey, std::unique_ptr<MaskedGemm>> g_masked_plans;
std::map<PlanKey, std::unique_ptr<ContiguousGemm>> g_contiguous_plans;
#endif

void gemm_masked(nb::handle a, nb::handle b, nb::handle d_obj, nb::handle masked_m_obj, int expected_m, uintptr_t stream) {
  auto [a_obj, as_obj] = pair_arg(a, "a");
  Operand act{take(a_obj, "a[0] (activations)", {DType::kFp8}), take(as_obj, "a[1] (activation scales)", {DType::kFloat32})};
  expect_shape(act.values, {{-1, "E_loc"}, {-1, "M_max"}, {-1, "K"}});
  expect_contiguous(act.values);
  int64_t num_experts = act.values.dim(0), max_m = act.values.dim(1), k = act.values.dim(2);
  expect_k(act.values, k);
  expect_shape(act.scales, {{num_experts, "E_loc"}, {max_m, "M_max"}, {k / kQuantBlock, "K/128"}});
  expect_mn_major(act.scales);
  Operand w = weights_arg(b, num_experts, k);
  int64_t n = w.values.dim(1);
  Tensor d = take(d_obj, "d", {DType::kBf16}, Access::kWrite);
  expect_shape(d, {{num_experts, "E_loc"}, {max_m, "M_max"}, {n, "N"}});
  expect_contiguous(d);
  Tensor masked_m = take(masked_m_obj, "masked_m", {DType::kInt32});
  expect_shape(masked_m, {{num_experts, "E_loc"}});
  expect_contiguous(masked_m);
  if (expected_m < 0) throw nb::value_error(fmt::format("expected_m = {} must be >= 0", expected_m).c_str());
  Device device = expect_same_device({&act.values, &act.scales, &w.values, &w.scales, &d, &masked_m});

  MaskedLayout a_layout{int(num_experts), int(max_m), int(k)};
  WeightLayout w_layout{int(num_experts), int(n), int(k)};
  if (device == Device::kCpu) {
    // The reference reads masked_m on the host: check it here so the message names the argument.
    for (int64_t e = 0; e < num_experts; ++e) {
      int32_t v = masked_m.ptr<int32_t>()[e];
      if (v < 0 || v > max_m)
        throw nb::value_error(fmt::format("masked_m[{}] = {} must be in [0, M_max = {}]", e, v, max_m).c_str());
    }
    nb::gil_scoped_release release;
    ref::grouped_gemm_masked(a_layout, act.values.ptr<uint8_t>(), act.scales.ptr<float>(), masked_m.ptr<int32_t>(), w_layout,
                             w.values.ptr<uint8_t>(), w.scales.ptr<float>(), d.ptr<uint16_t>());
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  DeviceGuard guard(d.device_id);
  PlanKey key{d.device_id,      act.values.data, act.scales.data, w.values.data, w.scales.data, masked_m.data, d.data,
              num_experts,      max_m,           n,               k,             expected_m};
  auto it = g_masked_plans.find(key);
  if (it == g_masked_plans.end()) {
    MaskedGemmProblem problem{int(num_experts), int(n), int(k), int(max_m), expected_m};
    MaskedGemmBuffers buffers{act.values.ptr<uint8_t>(), act.scales.ptr<float>(), w.values.ptr<uint8_t>(),
                              w.scales.ptr<float>(),     masked_m.ptr<int32_t>(), d.ptr<uint16_t>()};
    it = g_masked_plans.emplace(key, std::make_unique<MaskedGemm>(problem, buffers)).first;
  }
  it->second->run(reinterpret_cast<cudaStream_t>(stream));
#else
  (void)stream;
#endif
}

void gemm_contiguous(nb::handle a, nb::handle b, nb::handle d_obj, nb::handle m_indices_obj, uintptr_t stream) {
  auto [a_obj, as_obj] = pair_arg(a, "a");
  Operand act{take(a_obj, "a[0] (activations)", {DType::kFp8}), take(as_obj, "a[1] (activation scales)", {DType::kFloat32})};
  expect_shape(act.values, {{-1, "M_total"}, {-1, "K"}});
  expect_contiguous(act.values);
  int64_t total_m = act.values.dim(0), k = act.values.dim(1);
  expect_k(act.values, k);
  expect_shape(act.scales, {{total_m, "M_total"}, {k / kQuantBlock, "K/128"}});
  expect_mn_major(act.scales);
  auto [w_obj, ws_obj] = pair_arg(b, "b");
  Tensor w_probe = take(w_obj, "b[0] (weights)", {DType::kFp8});
  expect_shape(w_probe, {{-1, "E_loc"}, {-1, "N"}, {k, "K"}});
  int64_t num_experts = w_probe.dim(0);
  Operand w = weights_arg(b, num_experts, k);
  int64_t n = w.values.dim(1);
  Tensor d = take(d_obj, "d", {DType::kBf16}, Access::kWrite);
  expect_shape(d, {{total_m, "M_total"}, {n, "N"}});
  expect_contiguous(d);
  Tensor m_indices = take(m_indices_obj, "m_indices", {DType::kInt32});
  expect_shape(m_indices, {{total_m, "M_total"}});
  expect_contiguous(m_indices);
  Device device = expect_same_device({&act.values, &act.scales, &w.values, &w.scales, &d, &m_indices});

  ContiguousLayout a_layout{int(total_m), int(k)};
  WeightLayout w_layout{int(num_experts), int(n), int(k)};
  if (device == Device::kCpu) {
    for (int64_t m = 0; m < total_m; ++m) {
      int32_t v = m_indices.ptr<int32_t>()[m];
      if (v < -1 || v >= num_experts)
        throw nb::value_error(
            fmt::format("m_indices[{}] = {} must be a local expert in [0, E_loc = {}) or -1 (padding)", m, v, num_experts).c_str());
    }
    nb::gil_scoped_release release;
    ref::grouped_gemm_contiguous(a_layout, act.values.ptr<uint8_t>(), act.scales.ptr<float>(), m_indices.ptr<int32_t>(),
                                 w_layout, w.values.ptr<uint8_t>(), w.scales.ptr<float>(), d.ptr<uint16_t>());
    return;
  }
#if defined(MOEKIT_WITH_CUDA)
  DeviceGuard guard(d.device_id);
  PlanKey key{d.device_id,  act.values.data, act.scales.data, w.values.data, w.scales.data, m_indices.data, d.data,
              num_experts,  total_m,         n,               k,             0};
  auto it = g_contiguous_plans.find(key);
  if (it == g_contiguous_plans.end()) {
    ContiguousGemmProblem problem{int(num_experts), int(n), int(k), int(total_m)};
    ContiguousGemmBuffers buffers{act.values.ptr<uint8_t>(), act.scales.ptr<float>(), m_indices.ptr<int32_t>(),
                                  w.values.ptr<uint8_t>(),   w.scales.ptr<float>(),   d.ptr<uint16_t>()};
    it = g_contiguous_plans.emplace(key, std::make_unique<ContiguousGemm>(problem, buffers)).first;
  }
  it->second->run(reinterpret_cast<cudaStream_t>(stream));
#else
  (void)stream;
#endif
}

size_t clear_gemm_plans() {
#if defined(MOEKIT_WITH_CUDA)
  size_t n = g_masked_plans.size() + g_contiguous_plans.size();
  g_masked_plans.clear();
  g_contiguous_plans.clear();
  return n;
#else
  return 0;
#endif
}

}  // namespace

void bind_gemm(nb::module_& m) {
  m.def("gemm_masked", &gemm_masked, nb::arg("a"), nb::arg("b"), nb::arg("d"), nb::arg("masked_m"), nb::arg("expected_m"),
        nb::arg("stream") = 0,
        "d[e, :masked_m[e]] = bf16(a[e] . b[e]^T) for a = (a [E_loc, M_max, K] fp8, a_scales [E_loc, M_max, K/128] "
        "MN-major), b = (w [E_loc, N, K] fp8, w_scales [E_loc, N/128, K/128]); rows past masked_m untouched.");
  m.def("gemm_contiguous", &gemm_contiguous, nb::arg("a"), nb::arg("b"), nb::arg("d"), nb::arg("m_indices"),
        nb::arg("stream") = 0,
        "d[m] = bf16(a[m] . b[m_indices[m]]^T) for a = (a [M_total, K] fp8, a_scales [M_total, K/128] MN-major); rows "
        "with m_indices = -1 untouched.");
  m.def("clear_gemm_plans", &clear_gemm_plans, "Drops the cached CUDA GEMM plans; returns how many there were.");
}

}  // namespace moekit::py
