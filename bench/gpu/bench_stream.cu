// bench_stream: how fast the grouped GEMM's weight loads can stream from HBM with nothing else in
// the kernel, against the device copy, in one run. It separates what the memory system gives the
// GEMM's access pattern from what the GEMM's own pipeline costs.
//
// One persistent CTA per SM: one thread issues the loads into a ring of shared-memory stages
// (full/empty mbarriers, as in gemm_fp8.cuh), one thread frees each stage as soon as it has
// landed (no math). The weights are E experts of [N, K] FP8 bytes, walked tile by tile as the
// masked GEMM walks them (a tile = 128 weight rows x all of K, one 128-deep block per stage):
//   box K           the GEMM's box (128 rows x 128 bytes, 128-byte swizzle), row stride K
//   2 boxes K       two boxes per stage, inter rows apart (the gated GEMM1's gate and up rows)
//   bulk            one contiguous 1D copy of the stage's bytes (weights stored tile-major)
//   MXFP4 box       the MXFP4 GEMM's code box (128 rows x 64 bytes, row stride K/2, no swizzle),
//                   alone or with its scale words (one 512-byte box per stage), the words laid out
//                   [E, K/128, N] (consecutive stages N·4 bytes apart) or tile-major (adjacent);
//                   or codes and words as one 8.5 KB record per stage, one bulk copy
// each with the tiles dealt round-robin (static, as the GEMM deals them) or taken from an atomic
// queue (dynamic), and with 6..13 stages. Figures: the median of 10 runs of each, TB/s of weight
// bytes; shapes are one EP8 rank of DeepSeek-V3 (33 experts with the shared one, GEMM1 N 4096
// K 7168, GEMM2 N 7168 K 2048). Then the masked GEMMs themselves on the same bytes (below).
//
// Usage: bench_stream [--json PATH] [--wide-only]   (--wide-only: the copy and the 256-row
// swap-AB section, wide_swap_gemm2, only)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/gemm_host.cuh"
#include "kernels/cuda/ptx.cuh"
#include "moekit/cuda_check.h"
#include "moekit/gemm.h"

using namespace moekit;

namespace {

constexpr int kBlockK = 128;

// The device buffers of one GEMM section: zeroed (or `byte`-filled) at allocation, freed with it.
struct DeviceBuffers {
  std::vector<void*> owned;
  DeviceBuffers() = default;
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    for (void* q : owned) cudaFree(q);
  }
  template <class T>
  T* alloc(size_t count, int byte = 0) {
    T* q = nullptr;
    MOEKIT_CUDA_CHECK(cudaMalloc(&q, count * sizeof(T)));
    owned.push_back(q);
    MOEKIT_CUDA_CHECK(cudaMemset(q, byte, count * sizeof(T)));
    return q;
  }
};

// One masked GEMM's inputs other than its weights, on E experts of m_max rows: FP8 activations
// (0x11 bytes), their 1x128 scales and the weights' 128x128 scales (zero).
struct MaskedInputs {
  uint8_t* a;
  float* a_scales;
  float* w_scales;
};
MaskedInputs masked_inputs(DeviceBuffers& d, int E, int m_max, int n, int k) {
  return {d.alloc<uint8_t>(size_t(E) * m_max * k, 0x11), d.alloc<float>(size_t(E) * (k / 128) * m_max),
          d.alloc<float>(size_t(E) * (n / 128) * (k / 128))};
}

struct StreamArgs {
  int tiles;         // weight tiles of 128 rows
  int k_blocks;      // 128-deep blocks per tile
  int stages;
  int boxes;         // boxes per stage (1, or 2: the second one `second_rows` rows further down)
  int second_rows;
  int box_w;         // bytes of a box row: 128 (FP8, one 128-deep block) or 64 (MXFP4 codes)
  int n_blocks;      // MXFP4 scales: 128-row blocks per expert (the words' x coordinate), or 0: none
  bool scales_tile_major;  // the words [tiles · K/128, 128]: a tile's stages read adjacent 512 bytes
  const uint8_t* flat;  // bulk: tile-major weights, one stage's bytes per (tile, block)
  int* queue;           // dynamic: [0] next tile, [1] CTAs done (both reset by the last CTA)
};

template <bool kBulk, bool kDynamic>
__global__ void __launch_bounds__(64, 1) stream_kernel(const __grid_constant__ CUtensorMap map,
                                                       const __grid_constant__ CUtensorMap map_scales, StreamArgs a) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring = ptx::align_smem_1024(smem_raw);
  const int box_bytes = 128 * a.box_w, scale_bytes = a.n_blocks ? 512 : 0;
  const int stage_bytes = a.boxes * box_bytes + scale_bytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + a.stages * stage_bytes);
  uint64_t* empty = full + a.stages;
  int* last = reinterpret_cast<int*>(empty + a.stages);  // [stages]: 1 when the stage ends the walk
  if (threadIdx.x == 0) {
    for (int s = 0; s < a.stages; ++s) ptx::mbar_init(&full[s], 1), ptx::mbar_init(&empty[s], 1);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // producer
    const uint64_t policy = ptx::policy_evict_first();
    int s = 0;
    uint32_t phase = 0;
    int tile = kDynamic ? atomicAdd(a.queue, 1) : int(blockIdx.x);
    for (;; tile = kDynamic ? atomicAdd(a.queue, 1) : tile + int(gridDim.x)) {
      const bool done = tile >= a.tiles;
      for (int kb = 0; kb < (done ? 1 : a.k_blocks); ++kb) {
        ptx::mbar_wait(&empty[s], phase ^ 1);
        last[s] = done;
        if (done) {
          ptx::mbar_arrive(&full[s]);
        } else {
          ptx::mbar_arrive_expect_tx(&full[s], stage_bytes);
          uint8_t* dst = ring + s * stage_bytes;
          if constexpr (kBulk) {
            ptx::bulk_load(dst, a.flat + (size_t(tile) * a.k_blocks + kb) * stage_bytes, stage_bytes, &full[s], policy);
          } else {
            // Gated: tile -> (expert, 128-row block of its gate half); the up box is inter rows down.
            const int blocks = a.boxes == 2 ? a.second_rows / 128 : 1;
            const int row = a.boxes == 2 ? (tile / blocks) * 2 * a.second_rows + (tile % blocks) * 128 : tile * 128;
            for (int b = 0; b < a.boxes; ++b)
              ptx::tma_load_2d(dst + b * box_bytes, &map, &full[s], kb * a.box_w, row + b * a.second_rows, policy);
            if (a.n_blocks && a.scales_tile_major)
              ptx::tma_load_2d(dst + a.boxes * box_bytes, &map_scales, &full[s], 0, tile * a.k_blocks + kb, policy);
            else if (a.n_blocks)  // [E * K/128, N] words: x = the tile's first row, y = (expert, block)
              ptx::tma_load_2d(dst + a.boxes * box_bytes, &map_scales, &full[s], (tile % a.n_blocks) * 128,
                               (tile / a.n_blocks) * a.k_blocks + kb, policy);
          }
        }
        if (++s == a.stages) s = 0, phase ^= 1;
      }
      if (done) break;
    }
  } else if (threadIdx.x == 32) {  // consumer: frees every stage once it has landed
    int s = 0;
    uint32_t phase = 0;
    for (;;) {
      ptx::mbar_wait(&full[s], phase);
      const bool done = last[s];
      ptx::mbar_arrive(&empty[s]);
      if (done) break;
      if (++s == a.stages) s = 0, phase ^= 1;
    }
    if (kDynamic && atomicAdd(a.queue + 1, 1) == int(gridDim.x) - 1) {  // every CTA has taken its last tile
      a.queue[0] = 0;
      a.queue[1] = 0;
    }
  }
}

struct Pattern {
  std::string name;
  bool bulk, dynamic;
  int boxes, stages, k;
  int tiles = 0;  // 0: every tile of the 33 experts; else the first `tiles` (one round or less)
  int box_w = 128;  // 64: MXFP4 codes (K/2 bytes a row)
  int mx_scales = 0;  // with the MXFP4 scale words: 1 laid out [E, K/128, N], 2 tile-major
};

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Decode at small batches: a few experts hit with one row each (and the shared expert, the last
// slab, with one), so the GEMMs' tiles fill about one round of SMs. Both GEMMs with 16-token
// tiles, whole or split-K 2, on the two EP8 shapes: what splitting buys when the hit
// experts, not E_loc, set the tile count (B = 8 on EP8 hits ~7 of DeepSeek-V3's 32 local experts
// and ~9 of Qwen3.5's 64).
template <class Time, class Report>
void decode_splits(uint8_t* const* w, Time&& time, Report&& report) {
  struct Shape {
    const char* name;
    int e, n1, k1, n2, k2;
  };
  const int m_max = 16;
  for (const Shape& s : {Shape{"DeepSeek-V3", 33, 4096, 7168, 7168, 2048}, Shape{"Qwen3.5", 65, 2048, 4096, 4096, 1024}}) {
    const int E = s.e;
    DeviceBuffers d;
    const MaskedInputs in1 = masked_inputs(d, E, m_max, s.n1, s.k1), in2 = masked_inputs(d, E, m_max, s.n2, s.k2);
    uint16_t* out = d.alloc<uint16_t>(size_t(E) * m_max * s.n2);
    int32_t* m = d.alloc<int32_t>(E);
    const MaskedGemmProblem p1{E, s.n1, s.k1, m_max, 1, GemmEpilogue::kSiluMulFp8};
    const MaskedGemmProblem p2{E, s.n2, s.k2, m_max, 1};
    std::printf("decode, %s shapes (E = %d), experts hit with one row each, the shared one included:\n", s.name, E);
    for (int hit : {6, 8, 9, 10, 12}) {
      std::vector<int32_t> mm(E, 0);
      for (int i = 0; i + 1 < hit; ++i) mm[i * (E - 1) / (hit - 1)] = 1;  // spread over the routed slabs
      mm[E - 1] = 1;
      MOEKIT_CUDA_CHECK(cudaMemcpy(m, mm.data(), sizeof(int32_t) * E, cudaMemcpyHostToDevice));
      const double mb1 = double(hit) * s.n1 * s.k1 / 1e6, mb2 = double(hit) * s.n2 * s.k2 / 1e6;
      for (int gemm = 1; gemm <= 2; ++gemm) {
        // Whole tiles and split-K 2 (3..8 lost more, docs/layer-gpu.md item 13; a split tail, gemm.md
        // run 19).
        for (int splits : {1, 2}) {
          GemmConfig c{};
          c.swap_ab = true, c.block_m = 16, c.block_n = 128, c.num_splits = splits;
          const std::string name = std::string(s.name) + (gemm == 1 ? " GEMM1 gated" : " GEMM2") + ", " +
                                   std::to_string(hit) + " hit, split " + std::to_string(splits);
          if (gemm == 1) {
            MaskedGemm g0(p1, {in1.a, in1.a_scales, w[0], in1.w_scales, m, nullptr, in2.a, in2.a_scales}, &c),
                g1(p1, {in1.a, in1.a_scales, w[1], in1.w_scales, m, nullptr, in2.a, in2.a_scales}, &c);
            report(name, time([&](int i) { (i ? g1 : g0).run(nullptr); }), mb1, g0.config().to_string());
          } else {
            MaskedGemm g0(p2, {in2.a, in2.a_scales, w[0], in2.w_scales, m, out}, &c),
                g1(p2, {in2.a, in2.a_scales, w[1], in2.w_scales, m, out}, &c);
            report(name, time([&](int i) { (i ? g1 : g0).run(nullptr); }), mb2, g0.config().to_string());
          }
        }
      }
    }
  }
}

// GEMM2 (BF16 output, K = 2048 and 1024) with swap-AB tiles of 128 and of 256 weight rows, on
// the routing patterns of one EP8 rank at B = 8, 64 and 256 (uniform routing, the shared expert
// last with the rank's own tokens) and on the MISSION problem (8 DeepSeek-V3 experts, 5 and 16
// rows each), and the heuristic's pick: what the 256-row tile buys where a tile of short K
// spends much of its time on per-tile work.
template <class Time, class Report>
void wide_swap_gemm2(uint8_t* const* w, Time&& time, Report&& report) {
  struct Shape {
    const char* name;
    int e, n, k;
  };
  const int m_max = 64;
  for (const Shape& s : {Shape{"DeepSeek-V3", 33, 7168, 2048}, Shape{"Qwen3.5", 65, 4096, 1024},
                         Shape{"MISSION problem", 8, 7168, 2048}}) {
    const int E = s.e, R = E - 1;  // EP8 ranks: R routed slabs, the shared one last
    DeviceBuffers d;
    const MaskedInputs in = masked_inputs(d, E, m_max, s.n, s.k);
    uint16_t* out = d.alloc<uint16_t>(size_t(E) * m_max * s.n);
    int32_t* m = d.alloc<int32_t>(E);
    std::printf("GEMM2, %s shapes (E = %d, N %d, K %d), swap-AB tiles of 128 and 256 weight rows:\n", s.name, E, s.n,
                s.k);
    // (pattern name, masked_m, expected_m as the layer would pass it)
    std::vector<std::tuple<std::string, std::vector<int32_t>, int>> patterns;
    if (E == 8) {
      patterns.push_back({"all 16 rows", std::vector<int32_t>(E, 16), 16});
      patterns.push_back({"all 5 rows", std::vector<int32_t>(E, 5), 5});
    } else {
      for (int batch : {8, 64, 256}) {
        // This rank's routed rows (batch · top-k / 8) spread evenly over its slabs, the shared slab
        // with the rank's own batch / 8 tokens.
        const int routed_rows = batch * (R == 32 ? 8 : 10) / 8;
        std::vector<int32_t> mm(E, 0);
        for (int i = 0; i < routed_rows; ++i) mm[(i * 7) % R] += 1;  // a stride that visits every slab
        mm[E - 1] = std::max(1, batch / 8);
        patterns.push_back({"B = " + std::to_string(batch) + " pattern", mm, upper_typical_rows(routed_rows, R)});
      }
    }
    for (const auto& [pattern, mm, expected] : patterns) {
      int hit = 0, most = 0;
      for (int v : mm) hit += v > 0, most = std::max(most, v);
      MOEKIT_CUDA_CHECK(cudaMemcpy(m, mm.data(), sizeof(int32_t) * E, cudaMemcpyHostToDevice));
      const double mb = double(hit) * s.n * s.k / 1e6;
      const MaskedGemmProblem p{E, s.n, s.k, m_max, expected};
      const int block_m = most <= 16 ? 16 : most <= 32 ? 32 : 64;
      for (int block_n : {128, 256, 0}) {
        GemmConfig c{};
        c.swap_ab = true, c.block_m = block_m, c.block_n = block_n;
        const std::string name = std::string(s.name) + " GEMM2, " + pattern + " (" + std::to_string(hit) + " hit), " +
                                 (block_n ? std::to_string(block_n) + "-row tiles" : std::string("heuristic"));
        MaskedGemm g0(p, {in.a, in.a_scales, w[0], in.w_scales, m, out}, block_n ? &c : nullptr);
        MaskedGemm g1(p, {in.a, in.a_scales, w[1], in.w_scales, m, out}, block_n ? &c : nullptr);
        report(name, time([&](int i) { (i ? g1 : g0).run(nullptr); }), mb, g0.config().to_string());
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) try {
  std::string json_path;
  bool wide_only = false;    // --wide-only: the copy and wide_swap_gemm2's section only
  bool gemms_only = false;   // --gemms-only: the copy and the GEMMs on the same bytes only (for ncu)
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (s == "--wide-only") wide_only = true;
    else if (s == "--gemms-only") gemms_only = true;
    else {
      std::fprintf(stderr, "usage: bench_stream [--json PATH] [--wide-only | --gemms-only]\n");
      return s == "--help" ? 0 : 2;
    }
  }
  int num_sms = 0;
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  const int E = 33, n1 = 4096, k1 = 7168, n2 = 7168, k2 = 2048;
  const size_t bytes = size_t(E) * n1 * k1;  // the largest tensor; GEMM2's is half of it
  // Two copies, used in turn, so that no run finds the previous one's bytes in L2.
  uint8_t* w[2];
  for (auto& p : w) {
    MOEKIT_CUDA_CHECK(cudaMalloc(&p, bytes));
    MOEKIT_CUDA_CHECK(cudaMemset(p, 0x11, bytes));
  }
  int* queue;
  MOEKIT_CUDA_CHECK(cudaMalloc(&queue, 2 * sizeof(int)));
  MOEKIT_CUDA_CHECK(cudaMemset(queue, 0, 2 * sizeof(int)));
  cudaEvent_t e0, e1;
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e0));
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e1));
  auto time = [&](auto&& launch) {
    std::vector<float> ms;
    for (int it = 0; it < 11; ++it) {
      MOEKIT_CUDA_CHECK(cudaEventRecord(e0));
      launch(it % 2);
      MOEKIT_CUDA_CHECK(cudaEventRecord(e1));
      MOEKIT_CUDA_CHECK(cudaEventSynchronize(e1));
      float t = 0;
      MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (it > 0) ms.push_back(t);  // the first run warms up
    }
    return median(ms);
  };

  // The ceiling: the device copy (bytes read + written) of half the tensor.
  const float copy_ms = time([&](int i) { MOEKIT_CUDA_CHECK(cudaMemcpyAsync(w[1 - i], w[i], bytes / 2, cudaMemcpyDeviceToDevice)); });
  const double copy_tbs = double(bytes) / (copy_ms * 1e-3) / 1e12;
  std::printf("device: %d SMs; copy %.3f TB/s (read + write of %.0f MB)\n", num_sms, copy_tbs, bytes / 2 / 1e6);

  std::vector<Pattern> patterns;
  if (!wide_only && !gemms_only) patterns = {
      {"box K 7168, static, 12 stages", false, false, 1, 12, k1},
      {"box K 7168, static, 6 stages", false, false, 1, 6, k1},
      {"box K 7168, dynamic, 12 stages", false, true, 1, 12, k1},
      {"2 boxes K 7168 (gated), static, 6 stages", false, false, 2, 6, k1},
      {"2 boxes K 7168 (gated), dynamic, 6 stages", false, true, 2, 6, k1},
      {"box K 2048, static, 13 stages", false, false, 1, 13, k2},
      {"box K 2048, dynamic, 13 stages", false, true, 1, 13, k2},
      {"bulk 16 KB, static, 12 stages", true, false, 1, 12, k1},
      {"bulk 16 KB, dynamic, 12 stages", true, true, 1, 12, k1},
      {"bulk 32 KB, static, 6 stages", true, false, 2, 6, k1},
      // MXFP4 (gpt-oss's format on DeepSeek-V3's shapes): the GEMM's 64-byte code rows, with and
      // without the scale words, against the same stage bytes as one tile-major bulk copy.
      {"MXFP4 box K 7168, static, 16 stages", false, false, 1, 16, k1, 0, 64},
      {"MXFP4 box + scales K 7168, static, 16 stages", false, false, 1, 16, k1, 0, 64, 1},
      {"MXFP4 box + scales K 2048, static, 16 stages", false, false, 1, 16, k2, 0, 64, 1},
      {"MXFP4 box + tile-major scales K 7168, 16 st.", false, false, 1, 16, k1, 0, 64, 2},
      {"MXFP4 box + tile-major scales K 2048, 16 st.", false, false, 1, 16, k2, 0, 64, 2},
      {"MXFP4 bulk 8 KB, static, 16 stages", true, false, 1, 16, k1, 0, 64},
      {"MXFP4 bulk record 8.5 KB, static, 16 stages", true, false, 1, 16, k1, 0, 64, 1},
      {"MXFP4 2 boxes (16 KB), static, 8 stages", false, false, 2, 8, k1, 0, 64},
  };
  // Decode sizes: at most one gated tile (1.8 MB) per SM, as GEMM1 of 3-8 hit experts (48-128
  // tiles), with 3 or 6 stages in the ring: whether an SM's share of the stream is bound by the
  // bytes it keeps in flight, and what a round that leaves SMs idle streams.
  for (int tiles : {48, 96, 132})
    for (int stages : {3, 6})
      if (!wide_only && !gemms_only)
      patterns.push_back({"gated " + std::to_string(tiles) + " tiles, " + std::to_string(stages) + " stages", false,
                          false, 2, stages, k1, tiles});
  // One line per measurement, and one JSON object in "runs" (config: the GEMM's, or empty).
  std::string js = "{\"copy_tbs\": " + std::to_string(copy_tbs) + ", \"runs\": [";
  bool first_run = true;
  auto report = [&](const std::string& name, float ms, double mb, const std::string& config) {
    const double tbs = mb * 1e6 / (ms * 1e-3) / 1e12;
    std::printf("  %-44s %8.1f us  %.0f MB  %.3f TB/s  %.1f%% of copy%s\n", name.c_str(), ms * 1e3, mb, tbs,
                100 * tbs / copy_tbs, config.empty() ? "" : ("  [" + config + "]").c_str());
    js += std::string(first_run ? "" : ", ") + "{\"name\": \"" + name + "\", \"us\": " + std::to_string(ms * 1e3) +
          ", \"mb\": " + std::to_string(mb) + ", \"tbs\": " + std::to_string(tbs) + ", \"config\": \"" + config +
          "\"}";
    first_run = false;
  };
  for (const Pattern& p : patterns) {
    const int n = p.k == k1 ? n1 : n2;
    const int row_bytes = p.k * p.box_w / kBlockK;  // K bytes (FP8) or K/2 (MXFP4)
    const size_t pat_bytes = size_t(E) * n * row_bytes;
    const int box_bytes = 128 * p.box_w;
    StreamArgs a{};
    a.k_blocks = p.k / kBlockK;
    a.stages = p.stages;
    a.boxes = p.boxes;
    a.box_w = p.box_w;
    a.n_blocks = p.mx_scales ? n / 128 : 0;
    a.scales_tile_major = p.mx_scales == 2;
    a.queue = queue;
    // Gated: a tile is 128 gate rows and the matching 128 up rows, n / 2 rows further down.
    a.second_rows = p.boxes == 2 ? n / 2 : 0;
    a.tiles = int(pat_bytes / (size_t(a.k_blocks) * p.boxes * box_bytes));  // 128 (gated: 2 x 128) rows each
    if (p.tiles) a.tiles = std::min(a.tiles, p.tiles);
    const int stage_bytes = p.boxes * box_bytes + (p.mx_scales ? 512 : 0);
    const size_t smem = 1024 + size_t(p.stages) * stage_bytes + p.stages * 20;
    auto kernel = p.bulk ? (p.dynamic ? stream_kernel<true, true> : stream_kernel<true, false>)
                         : (p.dynamic ? stream_kernel<false, true> : stream_kernel<false, false>);
    MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    CUtensorMap maps[2], scale_maps[2];
    for (int i = 0; i < 2; ++i) {
      maps[i] = gemm_detail::make_tma_2d(w[i], false, uint64_t(E) * n, row_bytes, row_bytes, 128, p.box_w, p.box_w == 128);
      // The scale words [E * K/128, N] (fp32-sized), placed after the codes of the same buffer.
      scale_maps[i] = p.mx_scales == 2
                          ? gemm_detail::make_tma_2d(w[i] + pat_bytes, true, uint64_t(E) * (n / 128) * a.k_blocks, 128,
                                                     128, 1, 128, false)
                          : gemm_detail::make_tma_2d(w[i] + pat_bytes, true, uint64_t(E) * a.k_blocks, n, n, 1, 128, false);
    }
    const float ms = time([&](int i) {
      a.flat = w[i];
      kernel<<<num_sms, 64, smem>>>(maps[i], scale_maps[i], a);
      MOEKIT_CUDA_CHECK(cudaGetLastError());
    });
    report(p.name, ms, double(a.tiles) * a.k_blocks * stage_bytes / 1e6, "");
  }

  // The GEMMs themselves on the same bytes: GEMM1 with the SiLU·up epilogue (N 4096 = gate + up,
  // K 7168) and GEMM2 (N 7168, K 2048) of one EP8 rank of DeepSeek-V3 at B = 256: 32 routed experts
  // with 8 rows and the shared expert with 32 (two 16-token blocks: 544 GEMM1 tiles), or every
  // expert with 8 rows (528 tiles, 4 per SM exactly); GEMM1 also with forced split-K.
  if (!wide_only) {
    const int m_max = 256;
    DeviceBuffers d;
    const MaskedInputs in1 = masked_inputs(d, E, m_max, n1, k1), in2 = masked_inputs(d, E, m_max, n2, k2);
    uint16_t* out = d.alloc<uint16_t>(size_t(E) * m_max * n2);
    int32_t* m = d.alloc<int32_t>(E);
    const MaskedGemmProblem p1{E, n1, k1, m_max, 8, GemmEpilogue::kSiluMulFp8};
    const MaskedGemmProblem p2{E, n2, k2, m_max, 8};
    std::vector<int32_t> shared_32(E, 8), all_8(E, 8);
    shared_32[E - 1] = 32;
    auto run = [&](const std::string& name, const MaskedGemmProblem& p, const MaskedGemmBuffers& b0,
                   const MaskedGemmBuffers& b1, const std::vector<int32_t>& mm, const GemmConfig* cfg, double mb) {
      MOEKIT_CUDA_CHECK(cudaMemcpy(m, mm.data(), sizeof(int32_t) * E, cudaMemcpyHostToDevice));
      MaskedGemm g0(p, b0, cfg), g1(p, b1, cfg);
      report(name, time([&](int i) { (i ? g1 : g0).run(nullptr); }), mb, g0.config().to_string());
    };
    std::printf("the GEMMs on the same bytes (E = %d, M_max = %d):\n", E, m_max);
    const double mb1 = double(E) * n1 * k1 / 1e6, mb2 = double(E) * n2 * k2 / 1e6;
    MaskedGemmBuffers g1b[2], g2b[2];
    for (int i = 0; i < 2; ++i) {
      g1b[i] = {in1.a, in1.a_scales, w[i], in1.w_scales, m, nullptr, in2.a, in2.a_scales};
      g2b[i] = {in2.a, in2.a_scales, w[i], in2.w_scales, m, out};
    }
    run("GEMM1 gated, shared expert 32 rows (544 tiles)", p1, g1b[0], g1b[1], shared_32, nullptr, mb1);
    run("GEMM1 gated, all 8 rows (528 tiles)", p1, g1b[0], g1b[1], all_8, nullptr, mb1);
    {  // the same 528 tiles with 32 tokens each: what a wider token block costs per tile
      GemmConfig c{};
      c.swap_ab = true, c.block_m = 32, c.block_n = 128;
      run("GEMM1 gated, all 8 rows, block_m 32 (528)", p1, g1b[0], g1b[1], all_8, &c, mb1);
      run("GEMM1 gated, shared 32 rows, block_m 32", p1, g1b[0], g1b[1], shared_32, &c, mb1);
      // B = 512: 16 rows per routed expert, the shared one's 64 in two 32-token blocks (544
      // tiles) or in one of 64 (528).
      std::vector<int32_t> b512(E, 16);
      b512[E - 1] = 64;
      run("GEMM1 gated, B = 512 pattern, block_m 32 (544)", p1, g1b[0], g1b[1], b512, &c, mb1);
      c.block_m = 64;
      run("GEMM1 gated, B = 512 pattern, block_m 64 (528)", p1, g1b[0], g1b[1], b512, &c, mb1);
    }
    for (int splits : {2, 4}) {
      GemmConfig c{};
      c.swap_ab = true, c.block_m = 16, c.block_n = 128, c.num_splits = splits;
      run("GEMM1 gated, shared 32 rows, split " + std::to_string(splits), p1, g1b[0], g1b[1], shared_32, &c, mb1);
    }
    GemmConfig c32{};
    c32.swap_ab = true, c32.block_m = 32, c32.block_n = 128;
    // (The same config here, after the split-K runs, measured 255 us against 233 before them
    // (runs 46-49): the position costs it, not the tile; the comparisons sit above the splits.)
    run("GEMM1 gated, shared 32 rows, block_m 32, after splits", p1, g1b[0], g1b[1], shared_32, &c32, mb1);
    run("GEMM2, shared expert 32 rows", p2, g2b[0], g2b[1], shared_32, nullptr, mb2);
    {  // What the per-expert signal of each stored tile costs (ready_out, as the layer's GEMM2 does
       // for the combine beside it): nobody waits, the counters only grow.
      int32_t* ready = d.alloc<int32_t>(E);  // (zero)
      MaskedGemmBuffers s0 = g2b[0], s1 = g2b[1];
      s0.ready_out = s1.ready_out = ready;
      run("GEMM2, shared 32 rows, signalling", p2, s0, s1, shared_32, nullptr, mb2);
      MaskedGemm e0(p2, s0), e1(p2, s1);
      e0.set_early_trigger(true);
      e1.set_early_trigger(true);
      report("GEMM2, shared 32 rows, signalling, early trigger", time([&](int i) { (i ? e1 : e0).run(nullptr); }), mb2,
             e0.config().to_string());
    }
    run("GEMM2, all 8 rows", p2, g2b[0], g2b[1], all_8, nullptr, mb2);
    run("GEMM2, shared 32 rows, block_m 32", p2, g2b[0], g2b[1], shared_32, &c32, mb2);
    // B = 64: 28 routed experts with 2 rows, 4 without, the shared one with 8: 464 GEMM1 tiles
    // (3.5 per SM), the weights of 29 experts.
    std::vector<int32_t> b64(E, 2);
    for (int e = 0; e < 4; ++e) b64[e * 8] = 0;
    b64[E - 1] = 8;
    run("GEMM1 gated, B = 64 pattern (464 tiles)", p1, g1b[0], g1b[1], b64, nullptr, mb1 * 29 / 33);
    run("GEMM2, B = 64 pattern", p2, g2b[0], g2b[1], b64, nullptr, mb2 * 29 / 33);
  }
  if (!wide_only && !gemms_only) decode_splits(w, time, report);
  if (!gemms_only) wide_swap_gemm2(w, time, report);
  js += "]}\n";
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    MOEKIT_CHECK(f != nullptr, "bench_stream: cannot write " + json_path);
    std::fputs(js.c_str(), f);
    std::fclose(f);
  }
  for (auto& p : w) cudaFree(p);
  cudaFree(queue);
  return 0;
} catch (const std::exception& e) {  // a CUDA error or bad input: a message, not std::terminate
  std::fprintf(stderr, "bench_stream: error: %s\n", e.what());
  return 2;
}
