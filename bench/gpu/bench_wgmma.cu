// bench_wgmma: the rate of the FP8 GEMM's inner 128-deep block per SM, with every SM (or --sms S
// of them) running it at once and nothing else in the kernel, to tell apart what the tensor cores
// can do with the block's shape from what the GEMM's pipeline costs (docs/gemm.md runs 17, 21).
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
//   ... mc    in clusters of 2: each CTA's producer copies half of every stage and multicasts it
//             to both CTAs, so each SM still receives whole stages while the L2 serves half of
//             the bytes; a stage is free again once the math warps of both CTAs have read it
// and, printed after them, the decode kernels' small-N blocks (small_n_kernel below).
// The source of the stage copies is a few MB that stay in L2. The ideal block is the tensor
// cores' time: 2 warpgroups x 4 wgmmas x N/2 cycles per sub-partition (FP8 dense: 2048 FLOP per
// cycle per sub-partition), 512 cycles at N = 128 and 1024 at N = 256.
//
// --sms S runs S CTAs instead of one per SM: the stage copies come from L2, so whether an SM's
// intake falls as more SMs copy tells a limit of the L2 (which TMA multicast relieves) from one of
// the SM itself (which it does not).
//
// Usage: bench_wgmma [--blocks B] [--sms S] [--cluster-attr 0|1] [--json PATH]
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
bool g_cluster_attr = false;           // --cluster-attr 1: launch with an explicit cluster of 1

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

template <int N, int kMode, bool kStages, bool kFromRing = false, bool kMc = false>
__global__ void __launch_bounds__(384, 1)
    wgmma_rate_kernel(const uint8_t* src, int blocks, long long* cycles, float* sink) {
  static_assert(!kMc || kStages, "multicast is of the stages");
  constexpr int kCtas = kMc ? 2 : 1;
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
      ptx::mbar_init(&empty[s], 8 * kCtas);  // one arrive per math warp (of both CTAs: multicast)
    }
    ptx::fence_barrier_init();
  }
  ptx::fence_proxy_async_smem();
  __syncthreads();
  const uint32_t rank = kMc ? ptx::cluster_ctarank() : 0;
  if constexpr (kMc) ptx::cluster_sync();  // the peer's barriers exist before we copy into them

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (kStages && warp == 0 && lane == 0) {
      const uint64_t policy = ptx::policy_evict_last();
      // 256 KB each: 4 stages of 48 KB fit. A cluster's CTAs copy the halves of the same stages.
      const uint8_t* my_src = src + (blockIdx.x / kCtas % 32) * (kSrcBytes / 32);
      constexpr uint32_t kPart = stage_bytes<N>() / kCtas;
      int s = 0;
      uint32_t phase = 0;
      for (int b = 0; b < blocks; ++b) {
        ptx::mbar_wait(&empty[s], phase ^ 1);
        ptx::mbar_arrive_expect_tx(&full[s], stage_bytes<N>());
        uint8_t* dst = ring + s * stage_bytes<N>() + rank * kPart;
        const uint8_t* from = my_src + (b % 4) * stage_bytes<N>() + rank * kPart;
        if constexpr (kMc) ptx::bulk_load_multicast(dst, from, kPart, &full[s], 0x3, policy);
        else ptx::bulk_load(dst, from, kPart, &full[s], policy);
        if (++s == kStagesN) s = 0, phase ^= 1;
      }
    }
    __syncwarp();
    if constexpr (kMc) ptx::cluster_sync();  // no CTA leaves while its peer may copy into it
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
      if constexpr (kMc) {
        if (lane < 2) ptx::mbar_arrive_cluster(&empty[s], lane);  // lane r frees the stage in CTA r
      } else if (lane == 0) {
        ptx::mbar_arrive(&empty[s]);
      }
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
  if constexpr (kMc) ptx::cluster_sync();
}

// The decode kernels' block (docs/gemm-mxfp4.md run 13): four m64nNk32 wgmmas per warpgroup for
// N = 8..32 tokens (and 128, the prefill tile), with A from shared memory (the FP8 kernel) or
// from registers (the MXFP4 kernel), then commit, wait for them and promote the partial. Nothing
// is loaded per block: what is left is the tensor core's latency and each block's fence, arrive,
// commit and wait. The decode kernels keep two blocks in flight; a timing loop written that way
// here makes ptxas serialise every wgmma (even without its C7511 warning), so only the waited
// block is timed: an upper bound of what a block costs the decode kernels.
template <int N>
struct RsMma;
template <>
struct RsMma<8> {
  __device__ __forceinline__ static void mma(float* d, const uint32_t* a, uint64_t desc_b, bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)));
  }
};
template <>
struct RsMma<16> : ptx::WgmmaRS<16> {};
template <>
struct RsMma<32> : ptx::WgmmaRS<32> {};
template <>
struct RsMma<128> : ptx::WgmmaRS<128> {};

template <int N, bool kRegsA>
__global__ void __launch_bounds__(384, 1) small_n_kernel(int blocks, long long* cycles, float* sink) {
  constexpr int kRegs = N / 2;  // accumulator registers of m64nN per thread
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = ptx::align_smem_1024(smem_raw);
  uint8_t* a_tile = smem;
  uint8_t* b_tile = a_tile + kATile;
  for (int i = threadIdx.x; i < (kATile + N * kBlockK) / 4; i += blockDim.x) {
    uint32_t h = (i * 2654435761u) ^ (blockIdx.x * 40503u);
    reinterpret_cast<uint32_t*>(a_tile)[i] = h & 0x3E3E3E3Eu;
  }
  ptx::fence_proxy_async_smem();
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int wg = warp / 4 - 1;
  const uint64_t desc_a = ptx::make_smem_desc_sw128(a_tile + wg * 64 * kBlockK);
  const uint64_t desc_b = ptx::make_smem_desc_sw128(b_tile);
  uint32_t a[4][4];
#pragma unroll
  for (int g = 0; g < 4; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = (threadIdx.x * 0x01010101u + g * 4 + j) & 0x3E3E3E3Eu;
  constexpr int kParts = N >= 128 ? 1 : 2;  // two partials as in the decode kernels; one at 128 (registers)
  float part[kParts][kRegs], acc[kRegs];
#pragma unroll
  for (int i = 0; i < kRegs; ++i) acc[i] = 0.0f;
  auto issue = [&](float* d) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) ptx::fence_operand(d[i]);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBlockK / 32; ++k) {
      if constexpr (kRegsA) {
        RsMma<N>::mma(d, a[k], desc_b + 2 * k, k > 0);
      } else {
        ptx::Wgmma<N>::mma(d, desc_a + 2 * k, desc_b + 2 * k, k > 0);
      }
    }
    ptx::wgmma_commit();
#pragma unroll
    for (int i = 0; i < kRegs; ++i) ptx::fence_operand(d[i]);
  };
  auto promote = [&](float* d) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) acc[i] = fmaf(d[i], 1.001f, acc[i]);
  };
  // The clock is read with nothing in flight: a read between wgmmas makes ptxas serialise them.
  const long long start = clock64();
  for (int b = 0; b < blocks; b += 2) {
    issue(part[0]);
    ptx::wgmma_wait<0>();
    promote(part[0]);
    issue(part[kParts - 1]);
    ptx::wgmma_wait<0>();
    promote(part[kParts - 1]);
  }
  const long long end = clock64();
  if ((threadIdx.x - 128) % 128 == 0) cycles[blockIdx.x * 2 + wg] = (end - start) / blocks;
  if (acc[0] == 12345.678f) sink[blockIdx.x] = acc[0];
}

template <int N, bool kRegsA>
void run_small_n(int sms, int blocks, long long* d_cycles, float* sink) {
  auto kernel = small_n_kernel<N, kRegsA>;
  const int smem = 1024 + kATile + N * kBlockK;
  MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  for (int r = 0; r < 2; ++r) kernel<<<sms, 384, smem>>>(blocks, d_cycles, sink);
  MOEKIT_CUDA_CHECK(cudaGetLastError());
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<long long> c(2 * sms);
  MOEKIT_CUDA_CHECK(cudaMemcpy(c.data(), d_cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  std::sort(c.begin(), c.end());
  std::printf("small N: A from %-9s N=%3d  %6lld cycles per waited block (tensor ideal %3d)\n",
              kRegsA ? "registers" : "shared", N, c[c.size() / 2], 2 * 4 * N / 2);
}

struct Result {
  std::string name;
  int n;
  double cycles, ideal, tflops, us, bytes_per_cycle;
};

template <int N, int kMode, bool kStages, bool kFromRing = false, bool kMc = false>
Result run(const char* name, int sms, int blocks, const uint8_t* src, long long* d_cycles, float* sink) {
  auto kernel = wgmma_rate_kernel<N, kMode, kStages, kFromRing, kMc>;
  const int smem = smem_bytes<N, kStages>();
  MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (kMc) sms = std::max(2, sms - sms % 2);  // whole clusters of 2
  cudaLaunchConfig_t lc{};
  lc.gridDim = dim3(sms);
  lc.blockDim = dim3(384);
  lc.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = kMc ? 2 : 1;
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  lc.attrs = &attr;
  lc.numAttrs = kMc || g_cluster_attr ? 1 : 0;  // a cluster of 1 said explicitly, or no attribute
  auto launch = [&] { MOEKIT_CUDA_CHECK(cudaLaunchKernelEx(&lc, kernel, src, blocks, d_cycles, sink)); };
  cudaEvent_t e0, e1;
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e0));
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e1));
  launch();  // warm-up
  MOEKIT_CUDA_CHECK(cudaGetLastError());
  std::vector<double> times;
  for (int r = 0; r < 5; ++r) {
    MOEKIT_CUDA_CHECK(cudaEventRecord(e0));
    launch();
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
  int blocks = 4000, ctas = 0;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--blocks") && i + 1 < argc) {
      blocks = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--sms") && i + 1 < argc) {
      ctas = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--cluster-attr") && i + 1 < argc) {
      g_cluster_attr = std::atoi(argv[++i]) != 0;
    } else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_wgmma [--blocks B] [--sms S] [--cluster-attr 0|1] [--json PATH]\n");
      return 2;
    }
  }
  try {
    MOEKIT_CHECK(blocks >= 2, "--blocks " + std::to_string(blocks) + ": expected at least 2");
    int sms = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    MOEKIT_CHECK(ctas >= 0 && ctas <= sms,
                 "--sms " + std::to_string(ctas) + ": expected 1.." + std::to_string(sms) + " (0: every SM)");
    const int device_sms = sms;
    if (ctas > 0) sms = ctas;
    uint8_t* src = nullptr;
    long long* d_cycles = nullptr;
    float* sink = nullptr;
    MOEKIT_CUDA_CHECK(cudaMalloc(&src, kSrcBytes));
    MOEKIT_CUDA_CHECK(cudaMemset(src, 0x38, kSrcBytes));
    MOEKIT_CUDA_CHECK(cudaMalloc(&d_cycles, 2 * device_sms * sizeof(long long)));
    MOEKIT_CUDA_CHECK(cudaMalloc(&sink, device_sms * sizeof(float)));
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
    rs.push_back(run<128, kCopiesOnly, true, false, true>("copies mc", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<128, kPromote, true, true, true>("wgmma + promote + ring mc", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<256, kCopiesOnly, true, false, true>("copies mc", sms, blocks, src, d_cycles, sink));
    rs.push_back(run<256, kConsume, true, true, true>("wgmma + consume + ring mc", sms, blocks, src, d_cycles, sink));
    // The decode kernels' blocks (printed only): FP8 (A from shared memory) and MXFP4 (registers).
    run_small_n<16, false>(sms, blocks, d_cycles, sink);
    run_small_n<8, true>(sms, blocks, d_cycles, sink);
    run_small_n<16, true>(sms, blocks, d_cycles, sink);
    run_small_n<32, true>(sms, blocks, d_cycles, sink);
    run_small_n<128, false>(sms, blocks, d_cycles, sink);  // the prefill tile, for comparison
    run_small_n<128, true>(sms, blocks, d_cycles, sink);
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
