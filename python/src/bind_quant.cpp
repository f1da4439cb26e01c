// FP8 e4m3 quantisation (quant.h) on caller-provided tensors: per token (1x128 groups, scales
// MN-major as the masked and contiguous GEMMs read them) and per 128x128 weight block.
// Leading dimensions are batch dimensions: x [..., M, K] quantises every [M, K] matrix.
#include <fmt/format.h>

#include <vector>

#include "bindings.h"
#include "moekit/bf16.h"
#include "moekit/layout.h"
#include "moekit/quant.h"
#include "tensor.h"

namespace nb = nanobind;

namespace moekit::py {

namespace {

// Shape checks shared by every function: at least 2-D, the last two dimensions multiples of 128
// where the quantisation groups need it.
void expect_matrix(const Tensor& t, bool rows_in_blocks) {
  if (t.ndim() < 2) throw nb::value_error(fmt::format("{} must be at least 2-D [..., rows, K], got {}-D", t.name, t.ndim()).c_str());
  if (t.dim(-1) % kQuantBlock != 0 || t.dim(-1) == 0)
    throw nb::value_error(fmt::format("{}: K = {} (its last dimension) must be a positive multiple of 128", t.name, t.dim(-1)).c_str());
  if (rows_in_blocks && (t.dim(-2) % kQuantBlock != 0 || t.dim(-2) == 0))
    throw nb::value_error(
        fmt::format("{}: N = {} (its second-to-last dimension) must be a positive multiple of 128", t.name, t.dim(-2)).c_str());
}

std::vector<Dim> same_shape_dims(const Tensor& t, int64_t last, const char* last_label, int64_t second, const char* second_label) {
  std::vector<Dim> dims;
  for (int i = 0; i < t.ndim() - 2; ++i) dims.push_back({t.shape[i], "batch"});
  dims.push_back({second, second_label});
  dims.push_back({last, last_label});
  return dims;
}

// One row of x as fp32 (bf16 widened exactly).
const float* row_as_float(const Tensor& x, int64_t row, std::vector<float>& buf) {
  int64_t k = x.dim(-1);
  if (x.dtype == DType::kFloat32) return x.ptr<float>() + row * k;
  buf.resize(size_t(k));
  const uint16_t* src = x.ptr<uint16_t>() + row * k;
  for (int64_t i = 0; i < k; ++i) buf[size_t(i)] = bf16_to_float(src[i]);
  return buf.data();
}

// fn(row, scale_offset) for every row of a [..., M, K] tensor: its index among all rows, and where
// its MN-major scales ([..., K/128, M], stride M) start.
template <class F>
void for_each_row(int64_t batches, int64_t m, int64_t kb, F&& fn) {
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t r = 0; r < m; ++r) fn(b * m + r, b * kb * m + r);
}

void quantize_per_token(nb::handle x_obj, nb::handle q_obj, nb::handle scales_obj) {
  Tensor x = take(x_obj, "x", {DType::kFloat32, DType::kBf16});
  Tensor q = take(q_obj, "x_fp8", {DType::kFp8}, Access::kWrite);
  Tensor scales = take(scales_obj, "x_scales", {DType::kFloat32}, Access::kWrite);
  expect_matrix(x, false);
  expect_contiguous(x);
  int64_t m = x.dim(-2), k = x.dim(-1), kb = k / kQuantBlock;
  expect_shape(q, same_shape_dims(x, k, "K", m, "M"));
  expect_contiguous(q);
  expect_shape(scales, same_shape_dims(x, kb, "K/128", m, "M"));
  expect_mn_major(scales);
  if (expect_same_device({&x, &q, &scales}) == Device::kCuda) no_cuda_path("per_token_cast_to_fp8");
  int64_t batches = x.numel() / (m * k);
  nb::gil_scoped_release release;
  std::vector<float> buf;
  for_each_row(batches, m, kb, [&](int64_t row, int64_t s) {
    quantize_row_fp8(row_as_float(x, row, buf), int(k), q.ptr<uint8_t>() + row * k, scales.ptr<float>() + s, m);
  });
}

void quantize_per_block(nb::handle w_obj, nb::handle q_obj, nb::handle scales_obj) {
  Tensor w = take(w_obj, "w", {DType::kFloat32, DType::kBf16});
  Tensor q = take(q_obj, "w_fp8", {DType::kFp8}, Access::kWrite);
  Tensor scales = take(scales_obj, "w_scales", {DType::kFloat32}, Access::kWrite);
  expect_matrix(w, true);
  expect_contiguous(w);
  int64_t n = w.dim(-2), k = w.dim(-1);
  expect_shape(q, same_shape_dims(w, k, "K", n, "N"));
  expect_contiguous(q);
  expect_shape(scales, same_shape_dims(w, k / kQuantBlock, "K/128", n / kQuantBlock, "N/128"));
  expect_contiguous(scales);
  if (expect_same_device({&w, &q, &scales}) == Device::kCuda) no_cuda_path("per_block_cast_to_fp8");
  int64_t batches = w.numel() / (n * k), scale_elems = (n / kQuantBlock) * (k / kQuantBlock);
  nb::gil_scoped_release release;
  std::vector<float> matrix;
  for (int64_t b = 0; b < batches; ++b) {
    const float* src = w.ptr<float>() + b * n * k;
    if (w.dtype == DType::kBf16) {
      matrix.resize(size_t(n * k));
      const uint16_t* bits = w.ptr<uint16_t>() + b * n * k;
      for (int64_t i = 0; i < n * k; ++i) matrix[size_t(i)] = bf16_to_float(bits[i]);
      src = matrix.data();
    }
    quantize_blocks_fp8(src, int(n), int(k), q.ptr<uint8_t>() + b * n * k, scales.ptr<float>() + b * scale_elems);
  }
}

void dequantize_per_token(nb::handle q_obj, nb::handle scales_obj, nb::handle out_obj) {
  Tensor q = take(q_obj, "x_fp8", {DType::kFp8});
  Tensor scales = take(scales_obj, "x_scales", {DType::kFloat32});
  Tensor out = take(out_obj, "out", {DType::kFloat32}, Access::kWrite);
  expect_matrix(q, false);
  expect_contiguous(q);
  int64_t m = q.dim(-2), k = q.dim(-1), kb = k / kQuantBlock;
  expect_shape(scales, same_shape_dims(q, kb, "K/128", m, "M"));
  expect_mn_major(scales);
  expect_shape(out, same_shape_dims(q, k, "K", m, "M"));
  expect_contiguous(out);
  if (expect_same_device({&q, &scales, &out}) == Device::kCuda) no_cuda_path("per_token_cast_back");
  int64_t batches = q.numel() / (m * k);
  nb::gil_scoped_release release;
  for_each_row(batches, m, kb, [&](int64_t row, int64_t s) {
    dequantize_row_fp8(q.ptr<uint8_t>() + row * k, scales.ptr<float>() + s, m, int(k), out.ptr<float>() + row * k);
  });
}

}  // namespace

void bind_quant(nb::module_& m) {
  m.def("quantize_per_token", &quantize_per_token, nb::arg("x"), nb::arg("x_fp8"), nb::arg("x_scales"),
        "x [..., M, K] fp32/bf16 -> x_fp8 [..., M, K], x_scales [..., M, K/128] (MN-major), written in place.");
  m.def("quantize_per_block", &quantize_per_block, nb::arg("w"), nb::arg("w_fp8"), nb::arg("w_scales"),
        "w [..., N, K] fp32/bf16 -> w_fp8 [..., N, K], w_scales [..., N/128, K/128], written in place.");
  m.def("dequantize_per_token", &dequantize_per_token, nb::arg("x_fp8"), nb::arg("x_scales"), nb::arg("out"),
        "The inverse of quantize_per_token into out [..., M, K] fp32.");
}

}  // namespace moekit::py
