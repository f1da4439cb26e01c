// bench_wgmma: the rate of the FP8 GEMM's inner 128-deep block on one SM with nothing else in
// the kernel, to tell apart what the tensor cores can do with the block's shape from what the
// GEMM's pipeline costs (docs/gemm.md run 17).
//
// One persistent CTA per SM, the GEMM's thread layout: warpgroup 0 a producer, warpgroups 1 and
// 2 math. Each math warpgroup owns 64 rows of a static A tile; both read one static B tile of N
// rows (128-byte swizzle, K-major, as the GEMM's stages). Per block a math warpgroup issues the
// block's four m64nNk32 wgmmas from these tiles, commits and waits for them, as the GEMM does.
// Variants, each timed with clock64 by every math warpgroup over `blocks` blocks:
//   promote   after the wait, the GEMM's promotion: acc = fmaf(part, scale, acc) with the scale
//             read from shared memory, two registers per accumulator (N <= 192: 2 x N/2 fit)
//   consume   N = 256, where partial and accumulator do not both fit: the partial is only summed
//             into 8 registers, so that the wgmmas' results are used
//   stages    the producer streams a stage's bytes (A rows + N weight rows of 128 bytes) per
//             block into a ring of shared-memory stages with bulk copies, paced by the math
//             warpgroups' full/empty barriers as the GEMM's TMA loads are; the wgmmas still read
//             the static tiles, so only the stage traffic into shared memory is added
//   ring      as stages, but the wgmmas read the stage that has just landed (descriptors built
//             per block from the ring position): the GEMM's k-block loop without its scales
//   copies    the stages alone, no wgmma: the rate at which an SM takes in stage bytes
// The source of the stage copies is a few MB that stay in L2. The ideal block is the tensor
// cores' time: 2 warpgroups x 4 wgmmas x N/2 cycles per sub-partition (FP8 dense: 2048 FLOP per
// cycle per sub-partition), 512 cycles at N = 128 and 1024 at N = 256.
//
// Usage: bench_wgmma [--blocks B] [--json PATH]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/ptx.cuh"
#include "moekit/check.h"
#include "moekit/cuda_check.h"

using namespace moekit;

namespace {

constexpr int kBlockK = 128;
constexpr int kATile = 128 * kBlockK;  // two warpgroups x 64 rows
constexpr int kSrcBytes = 8 << 20;     // stage source: stays in L2

template <int N>
__host__ __device__ constexpr int stage_bytes() {
  return kATile + N * kBlockK;
}
template <int N>
__host__ __device__ constexpr int ring_stages() {
  return N == 128 ? 6 : N == 192 ? 4 : 3;
}
template <int N, bool kStages>
__host__ __device__ constexpr int smem_bytes() {
  return 1024 + kATile + N * kBlockK + (kStages ? ring_stages<N>() * stage_bytes<N>() : 0) + 2 * 8 * 8 + 128 * 4;
}

enum Mode { kCopiesOnly, kPromote, kConsume };

template <int N, int kMode, bool kStages, bool kFromRing = false>
__global__ void __launch_bounds__(384, 1)
    wgmma_rate_kernel(const uint8_t* src, int blocks, long long* cycles, float* sink) {
  using Mma = ptx::Wgmma<N>;
  constexpr int kRegs = Mma::kRegs;
  constexpr int kStagesN = ring_stages<N>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = ptx::align_smem_1024(smem_raw);
  uint8_t* a_tile = smem;
  uint8_t* b_tile = a_tile + kATile;
  uint8_t* ring = b_tile + N * kBlockK;
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + (kStages ? kStagesN * stage_bytes<N>() : 0));
  uint64_t* empty = full + 8;
  float* scales = reinterpret_cast<float*>(empty + 8);

  // Static tiles: e4m3 codes that are never NaN (bit patterns 0x7F / 0xFF avoided), written by the
  // threads and made visible to the async proxy that wgmma reads through.
  for (int i = threadIdx.x; i < (kATile + N * kBlockK) / 4; i += blockDim.x) {
    uint32_t h = (i * 2654435761u) ^ (blockIdx.x * 40503u);
    reinterpret_cast<uint32_t*>(a_tile)[i] = h & 0x3E3E3E3Eu;
  }
  if (threadIdx.x < 128) scales[threadIdx.x] = 1.0f + threadIdx.x * 1e-3f;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStagesN; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], 8);  // one arrive per math warp
    }
    ptx::fence_barrier_init();
  }
  ptx::fence_proxy_async_smem();
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (!kStages || warp != 0 || lane != 0) return;
    const uint64_t policy = ptx::policy_evict_last();
    const uint8_t* my_src = src + (blockIdx.x % 32) * (kSrcBytes / 32);  // 256 KB each: 4 stages of 48 KB fit
    int s = 0;
    uint32_t phase = 0;
    for (int b = 0; b < blocks; ++b) {
      ptx::mbar_wait(&empty[s], phase ^ 1);
      ptx::mbar_arrive_expect_tx(&full[s], stage_bytes<N>());
      ptx::bulk_load(ring + s * stage_bytes<N>(), my_src + (b % 4) * stage_bytes<N>(), stage_bytes<N>(), &full[s], policy);
      if (++s == kStagesN) s = 0, phase ^= 1;
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int wg = warp / 4 - 1;
  const int frag_row = wg * 64 + (warp % 4) * 16 + lane / 4;
  const uint64_t desc_a = ptx::make_smem_desc_sw128(a_tile + wg * 64 * kBlockK);
  const uint64_t desc_b = ptx::make_smem_desc_sw128(b_tile);
  float part[kRegs];
  constexpr int kAcc = kMode == kPromote ? kRegs : 8;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
  int s = 0;
  uint32_t phase = 0;
  long long start = 0;
  for (int b = 0; b < blocks; ++b) {
    if (b == 1) start = clock64();  // the first block fills the pipes
    if constexpr (kStages) ptx::mbar_wait(&full[s], phase);
    uint64_t da = desc_a, db = desc_b;
    if constexpr (kFromRing) {
      const uint8_t* stage = ring + s * stage_bytes<N>();
      da = ptx::make_smem_desc_sw128(stage + wg * 64 * kBlockK);
      db = ptx::make_smem_desc_sw128(stage + kATile);
    }
    float sc[2] = {1.0f, 1.0f};
    if constexpr (kMode == kPromote) {
      sc[0] = scales[frag_row];
      sc[1] = scales[frag_row + 8];
    }
    if constexpr (kMode != kCopiesOnly) {
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBlockK / 32; ++k) Mma::mma(part, da + 2 * k, db + 2 * k, k > 0);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[i]);
    }
    if constexpr (kStages) {
      if (lane == 0) ptx::mbar_arrive(&empty[s]);
      if (++s == kStagesN) s = 0, phase ^= 1;
    }
    if constexpr (kMode == kPromote) {
#pragma unroll
      for (int i = 0; i < kRegs; ++i) acc[i] = fmaf(part[i], sc[(i / 2) % 2], acc[i]);
    } else if constexpr (kMode == kConsume) {
#pragma unroll
      for (int i = 0; i < kRegs; ++i) acc[i % 8] += part[i];
    }
  }
  const long long end = clock64();
  if ((threadIdx.x - 128) % 128 == 0) cycles[blockIdx.x * 2 + wg] = (end - start) / (blocks - 1);
  float v = acc[0];
  if (v == 12345.678f) sink[blockIdx.x] = v;  // keeps the results alive
}

struct Result {
  std::string name;
  int n;
  double cycles, ideal, tflops, us, bytes_per_cycle;
};

template <int N, int kMode, bool kStages, bool kFromRing = false>
Result run(const char* name, int sms, int blocks, const uint8_t* src, long long* d_cycles, float* sink) {
  auto kernel = wgmma_rate_kernel<N, kMode, kStages, kFromRing>;
  const int smem = smem_bytes<N, kStages>();
  MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t e0, e1;
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e0));
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e1));
  kernel<<<sms, 384, smem>>>(src, blocks, d_cycles, sink);  // warm-up
  MOEKIT_CUDA_CHECK(cudaGetLastError());
  std::vector<double> times;
  for (int r = 0; r < 5; ++r) {
    MOEKIT_CUDA_CHECK(cudaEventRecord(e0));
    kernel<<<sms, 384, smem>>>(src, blocks, d_cycles, sink);
    MOEKIT_CUDA_CHECK(cudaEventRecord(e1));
    MOEKIT_CUDA_CHECK(cudaEventSynchronize(e1));
    MOEKIT_CUDA_CHECK(cudaGetLastError());
    float ms = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    times.push_back(ms * 1e3);
  }
  std::sort(times.begin(), times.end());
  std::vector<long long> c(2 * sms);
  MOEKIT_CUDA_CHECK(cudaMemcpy(c.data(), d_cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  std::sort(c.begin(), c.end());
  Result r;
  r.name = name;
  r.n = N;
  r.cycles = double(c[c.size() / 2]);
  r.ideal = kMode == kCopiesOnly ? 0.0 : 2.0 * 4 * N / 2;  // 2 warpgroups x 4 wgmmas x N/2 cycles per sub-partition
  r.us = times[times.size() / 2];
  r.tflops = kMode == kCopiesOnly ? 0.0 : double(sms) * blocks * 2.0 * 128 * N * kBlockK / (r.us * 1e-6) / 1e12;
  r.bytes_per_cycle = kStages ? stage_bytes<N>() / r.cycles : 0.0;
  std::printf("%-26s N=%3d  %6.0f cycles per block (ideal %4.0f: %5.1f%%)  %7.1f TFLOP/s  stage bytes %5.1f B/cycle per SM\n",
              name, N, r.cycles, r.ideal, r.ideal > 0 ? 100 * r.ideal / r.cycles : 0.0, r.tflops, r.bytes_per_cycle);
  MOEKIT_CUDA_CHECK(cudaEventDestroy(e0));
  MOEKIT_CUDA_CHECK(cudaEventDestroy(e1));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int blocks = 4000;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--blocks") && i + 1 < argc) {
      blocks = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_wgmma [--blocks B] [--json PATH]\n");
      return 2;
    }
  }
  try {
    MOEKIT_CHECK(blocks >= 2, "--blocks " + std::to_string(blocks) + ": expected at least 2");
    int sms = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint8_t* src = nullptr;
    long long* d_cycles = nullptr;
    float* sink = nullptr;
    MOEKIT_CUDA_CHECK(cudaMalloc(&src, kSrcBytes));
    MOEKIT_CUDA_CHECK(cudaMemset(src, 0x38, kSrcBytes));
    MOEKIT_CUDA_CHECK(cudaMalloc(&d_cycles, 2 * sms * sizeof(long long)));
    MOEKIT_CUDA_CHECK(cudaMalloc(&sink, sms * sizeof(float)));
    std::printf("bench_wgmma: %d SMs, %d blocks of 128-deep K per math warpgroup\n", sms, blocks);
    std::vector<Result> rs;
    rs.push_back(run<128, kCopiesOnly, true>("copies", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<128, kPromote, false>("wgmma + promote", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<128, kPromote, true>("wgmma + promote + stages", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<128, kPromote, true, true>("wgmma + promote + ring", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<192, kCopiesOnly, true>("copies", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<192, kPromote, false>("wgmma + promote", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<192, kPromote, true>("wgmma + promote + stages", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<192, kPromote, true, true>("wgmma + promote + ring", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<256, kCopiesOnly, true>("copies", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<256, kConsume, false>("wgmma + consume", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<256, kConsume, true>("wgmma + consume + stages", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<256, kConsume, true, true>("wgmma + consume + ring", sms, blocks, src, d_cycles, sink));
    if (!json_path.empty()) {
      std::string js = "{\"blocks\": " + std::to_string(blocks) + ", \"runs\": [";
      for (size_t i = 0; i < rs.size(); ++i) {
        char buf[256];
        std::snprintf(buf, sizeof buf, "%s{\"variant\": \"%s\", \"n\": %d, \"cycles_per_block\": %.1f, \"ideal\": %.0f, \"us\": %.2f, \"TFLOPs\": %.1f, \"stage_bytes_per_cycle\": %.2f}",
                      i ? ", " : "", rs[i].name.c_str(), rs[i].n, rs[i].cycles, rs[i].ideal, rs[i].us, rs[i].tflops,
                      rs[i].bytes_per_cycle);
        js += buf;
      }
      js += "]}\n";
      FILE* f = std::fopen(json_path.c_str(), "w");
      MOEKIT_CHECK(f != nullptr, "bench_wgmma: cannot write " + json_path);
      std::fputs(js.c_str(), f);
      std::fclose(f);
    }
    cudaFree(src);
    cudaFree(d_cycles);
    cudaFree(sink);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_wgmma: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
