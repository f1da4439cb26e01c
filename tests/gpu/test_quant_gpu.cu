// GPU tests of quant_gpu.h: the token (1x128) and block (128x128) FP8 quantisation kernels give
// quant.h's bits on fresh random data of widely varying magnitude (bf16 and fp32 input, several
// batches, an all-zero group that takes the floor scale), write every output (poisoned first),
// report the first non-finite element, and replay from a CUDA Graph on new data.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "device_buffer.h"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/layout.h"
#include "moekit/quant.h"
#include "moekit/quant_gpu.h"

namespace moekit {
namespace {


// Values whose magnitude varies per row over four decades, as activations do.
std::vector<float> random_rows(int64_t rows, int k, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-2.0f, 2.0f);
  std::vector<float> x(size_t(rows) * k);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = std::pow(10.0f, mag(rng));
    for (int c = 0; c < k; ++c) x[size_t(r) * k + c] = n(rng) * m;
  }
  return x;
}

std::vector<uint16_t> to_bf16(std::vector<float>& x) {  // rounds x in place to what the bf16 holds
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    b[i] = float_to_bf16(x[i]);
    x[i] = bf16_to_float(b[i]);
  }
  return b;
}

// quant.h on [batches, rows, k]: q and MN-major scales [batches, k/128, rows].
void reference_tokens(const std::vector<float>& x, int64_t batches, int64_t rows, int k, std::vector<uint8_t>& q,
                      std::vector<float>& s) {
  q.assign(x.size(), 0);
  s.assign(size_t(batches) * rows * (k / kQuantBlock), 0.0f);
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t r = 0; r < rows; ++r) {
      const size_t row = size_t(b * rows + r);
      quantize_row_fp8(&x[row * k], k, &q[row * k], &s[size_t(b) * (k / kQuantBlock) * rows + r], rows);
    }
}

class QuantTokens : public ::testing::TestWithParam<bool> {};  // bf16 input?

TEST_P(QuantTokens, EqualsQuantHAndReplaysInAGraph) {
  const bool bf16 = GetParam();
  const int64_t batches = 3, rows = 77;
  const int k = 7168;
  std::mt19937 rng(bf16 ? 11 : 12);
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  DeviceBuffer<float> xf(size_t(batches * rows) * k);
  DeviceBuffer<uint16_t> xb(size_t(batches * rows) * k);
  DeviceBuffer<uint8_t> q(size_t(batches * rows) * k);
  DeviceBuffer<float> s(size_t(batches * rows) * (k / kQuantBlock));
  DeviceBuffer<unsigned long long> first_bad(1);
  auto launch = [&] {
    if (bf16)
      gpu::quantize_tokens_fp8(xb.ptr, batches, rows, k, q.ptr, s.ptr, first_bad.ptr, stream);
    else
      gpu::quantize_tokens_fp8(xf.ptr, batches, rows, k, q.ptr, s.ptr, first_bad.ptr, stream);
  };
  auto upload = [&](std::vector<float>& x) {
    if (bf16)
      xb.upload(to_bf16(x));
    else
      xf.upload(x);
  };
  auto check = [&](const std::vector<float>& x) {
    std::vector<uint8_t> want_q;
    std::vector<float> want_s;
    reference_tokens(x, batches, rows, k, want_q, want_s);
    EXPECT_EQ(q.download(), want_q);
    EXPECT_EQ(s.download(), want_s);
    EXPECT_EQ(first_bad.download()[0], ~0ull) << "a finite input was reported";
  };

  std::vector<float> x = random_rows(batches * rows, k, rng);
  for (int c = 0; c < kQuantBlock; ++c) x[size_t(5) * k + 256 + c] = 0.0f;  // takes the kMinAmax floor
  upload(x);
  q.poison(0x7F);  // fp8 NaN (scales: 3.4e38, never a real scale)
  s.poison(0x7F);
  MOEKIT_CUDA_CHECK(cudaMemset(first_bad.ptr, 0xFF, sizeof(unsigned long long)));
  launch();
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  check(x);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch();
  MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<float> x2 = random_rows(batches * rows, k, rng);
  upload(x2);
  q.poison(0x7F);
  s.poison(0x7F);
  MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  check(x2);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(Input, QuantTokens, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "bf16" : "fp32"; });

TEST(QuantBlocks, EqualsQuantH) {
  const int64_t batches = 2;
  const int n = 384, k = 512;
  std::mt19937 rng(13);
  std::vector<float> w = random_rows(batches * n, k, rng);
  DeviceBuffer<float> wf(w.size());
  DeviceBuffer<uint16_t> wb(w.size());
  DeviceBuffer<uint8_t> q(w.size());
  DeviceBuffer<float> s(size_t(batches) * (n / kQuantBlock) * (k / kQuantBlock));
  for (bool bf16 : {false, true}) {
    if (bf16)
      wb.upload(to_bf16(w));
    else
      wf.upload(w);
    q.poison(0x7F);
    s.poison(0x7F);
    if (bf16)
      gpu::quantize_blocks_fp8(wb.ptr, batches, n, k, q.ptr, s.ptr, nullptr, nullptr);
    else
      gpu::quantize_blocks_fp8(wf.ptr, batches, n, k, q.ptr, s.ptr, nullptr, nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> want_q(w.size());
    std::vector<float> want_s(s.count);
    const size_t per_q = size_t(n) * k, per_s = size_t(n / kQuantBlock) * (k / kQuantBlock);
    for (int64_t b = 0; b < batches; ++b)
      quantize_blocks_fp8(&w[b * per_q], n, k, &want_q[b * per_q], &want_s[b * per_s]);
    EXPECT_EQ(q.download(), want_q) << (bf16 ? "bf16" : "fp32");
    EXPECT_EQ(s.download(), want_s) << (bf16 ? "bf16" : "fp32");
  }
}

TEST(QuantReport, FirstNonFiniteElementAndBadShapes) {
  const int k = 256;
  std::vector<float> x(4 * k, 1.0f);
  x[size_t(2) * k + 200] = INFINITY;
  x[size_t(3) * k + 5] = NAN;
  DeviceBuffer<float> xf(x.size());
  DeviceBuffer<uint8_t> q(x.size());
  DeviceBuffer<float> s(4 * 2);
  DeviceBuffer<unsigned long long> first_bad(1);
  xf.upload(x);
  MOEKIT_CUDA_CHECK(cudaMemset(first_bad.ptr, 0xFF, sizeof(unsigned long long)));
  gpu::quantize_tokens_fp8(xf.ptr, 1, 4, k, q.ptr, s.ptr, first_bad.ptr, nullptr);
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(first_bad.download()[0], 2ull * k + 200);
  EXPECT_THROW(gpu::quantize_tokens_fp8(xf.ptr, 1, 4, 200, q.ptr, s.ptr, nullptr, nullptr), Error);
  EXPECT_THROW(gpu::quantize_blocks_fp8(xf.ptr, 1, 100, k, q.ptr, s.ptr, nullptr, nullptr), Error);
  EXPECT_THROW(gpu::quantize_tokens_fp8(xf.ptr + 1, 1, 3, k, q.ptr, s.ptr, nullptr, nullptr), Error);  // misaligned
}

}  // namespace
}  // namespace moekit
