// FP8 e4m3 quantisation on caller-provided tensors: per token (1x128 groups, scales MN-major as
// the masked and contiguous GEMMs read them) and per 128x128 weight block. Leading dimensions are
// batch dimensions: x [..., M, K] quantises every [M, K] matrix. CPU tensors run quant.h, CUDA
// tensors quant_gpu.h's kernels (the same bits) on the caller's stream. A non-finite input is a
// moekit.Error naming its index: on the CPU before anything is written; on CUDA after the kernel,
// which needs one synchronisation, so `check_finite=False` (and any call inside a CUDA-Graph
// capture) skips it.
#include <fmt/format.h>

#include <vector>

#include "bindings.h"
#include "moekit/bf16.h"
#include "moekit/layout.h"
#include "moekit/quant.h"
#include "tensor.h"

#if defined(MOEKIT_WITH_CUDA)
#include <map>

#include "moekit/cuda_check.h"
#include "moekit/quant_gpu.h"
#endif

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

#if defined(MOEKIT_WITH_CUDA)
// Runs launch(first_bad, stream) on the tensors' device; then, unless the stream is capturing or
// check_finite is off, reads quant_gpu.h's non-finite report back and raises on it.
template <class Launch>
void run_on_cuda(const Tensor& in, uintptr_t stream_handle, bool check_finite, Launch&& launch) {
  static std::map<int, unsigned long long*> first_bad_of_device;  // one report word per device, kept
  DeviceGuard guard(in.device_id);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOEKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  unsigned long long* first_bad = nullptr;
  if (check_finite && capture == cudaStreamCaptureStatusNone) {
    unsigned long long*& word = first_bad_of_device[in.device_id];
    if (word == nullptr) MOEKIT_CUDA_CHECK(cudaMalloc(&word, sizeof(*word)));
    first_bad = word;
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(first_bad, 0xff, sizeof(*first_bad), stream));
  }
  launch(first_bad, stream);
  if (first_bad == nullptr) return;
  unsigned long long bad = 0;
  {
    nb::gil_scoped_release release;
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(&bad, first_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream));
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  // moekit.Error, as the CPU path's check raises it.
  if (bad != ~0ull) throw Error(fmt::format("{}: element {} (flattened) is not finite", in.name, bad));
}
#endif

void quantize_per_token(nb::handle x_obj, nb::handle q_obj, nb::handle scales_obj, uintptr_t stream, bool check_finite) {
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
  int64_t batches = x.numel() / (m * k);
  if (expect_same_device({&x, &q, &scales}) == Device::kCuda) {
#if defined(MOEKIT_WITH_CUDA)
    run_on_cuda(x, stream, check_finite, [&](unsigned long long* first_bad, cudaStream_t s) {
      if (x.dtype == DType::kBf16)
        gpu::quantize_tokens_fp8(x.ptr<uint16_t>(), batches, m, int(k), q.ptr<uint8_t>(), scales.ptr<float>(), first_bad, s);
      else
        gpu::quantize_tokens_fp8(x.ptr<float>(), batches, m, int(k), q.ptr<uint8_t>(), scales.ptr<float>(), first_bad, s);
    });
    return;
#else
    no_cuda_path("per_token_cast_to_fp8");
#endif
  }
  nb::gil_scoped_release release;
  std::vector<float> buf;
  for_each_row(batches, m, kb, [&](int64_t row, int64_t s) {
    quantize_row_fp8(row_as_float(x, row, buf), int(k), q.ptr<uint8_t>() + row * k, scales.ptr<float>() + s, m);
  });
}

void quantize_per_block(nb::handle w_obj, nb::handle q_obj, nb::handle scales_obj, uintptr_t stream, bool check_finite) {
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
  int64_t batches = w.numel() / (n * k), scale_elems = (n / kQuantBlock) * (k / kQuantBlock);
  if (expect_same_device({&w, &q, &scales}) == Device::kCuda) {
#if defined(MOEKIT_WITH_CUDA)
    run_on_cuda(w, stream, check_finite, [&](unsigned long long* first_bad, cudaStream_t s) {
      if (w.dtype == DType::kBf16)
        gpu::quantize_blocks_fp8(w.ptr<uint16_t>(), batches, int(n), int(k), q.ptr<uint8_t>(), scales.ptr<float>(), first_bad, s);
      else
        gpu::quantize_blocks_fp8(w.ptr<float>(), batches, int(n), int(k), q.ptr<uint8_t>(), scales.ptr<float>(), first_bad, s);
    });
    return;
#else
    no_cuda_path("per_block_cast_to_fp8");
#endif
  }
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
        nb::arg("stream") = 0, nb::arg("check_finite") = true,
        "x [..., M, K] fp32/bf16 -> x_fp8 [..., M, K], x_scales [..., M, K/128] (MN-major), written in place.");
  m.def("quantize_per_block", &quantize_per_block, nb::arg("w"), nb::arg("w_fp8"), nb::arg("w_scales"),
        nb::arg("stream") = 0, nb::arg("check_finite") = true,
        "w [..., N, K] fp32/bf16 -> w_fp8 [..., N, K], w_scales [..., N/128, K/128], written in place.");
  m.def("dequantize_per_token", &dequantize_per_token, nb::arg("x_fp8"), nb::arg("x_scales"), nb::arg("out"),
        "The inverse of quantize_per_token into out [..., M, K] fp32.");
}

}  // namespace moekit::py
