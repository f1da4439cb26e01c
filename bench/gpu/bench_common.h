// bench_common.h: what the GPU benchmarks share: random FP8 or MXFP4 weights of a model's real
// shapes made in memory, random BF16 tokens, list parsing, the device copy bandwidth that their
// floors are measured against, and the timing of a graph's replays.
//
// Weights are random bytes, not a checkpoint: the values do not change the time of a step
// (the GEMMs read every byte of a hit expert whatever it holds; MXFP4 scales are kept in a
// checkpoint's range, which decides the kernel's widening path), and the checkpoint generator
// would first write tens of GB to disk. Included by one translation unit per benchmark.
#pragma once

#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/layout.h"
#include "moekit/mxfp4.h"
#include "moekit/spec.h"
#include "moekit/weights.h"

namespace moekit::bench {

// The FP8 GEMM rate measured on an H200 (2026-11-29, docs/results.md §Reference rates of the H200);
// the benchmarks do not
// measure it again, they divide FLOPs by it for the compute side of the floor.
constexpr double kFp8Flops = 1272e12;

inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Calls body(begin, end) on all cores over [0, n) cut into equal ranges of whole `unit`s.
template <class Body>
void parallel_for(size_t n, size_t unit, const Body& body) {
  const unsigned num_threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < num_threads; ++t)
    pool.emplace_back([&, t] {
      const size_t begin = n * t / num_threads / unit * unit,
                   end = t + 1 == num_threads ? n : n * (t + 1) / num_threads / unit * unit;
      body(begin, end);
    });
  for (auto& th : pool) th.join();
}

// Random finite e4m3 bytes of magnitude 2^-3 .. 2^2 (no NaN codes), filled on all cores: the
// weights of one layer of DeepSeek-V3 are 11 GB.
inline void fill_fp8(std::vector<uint8_t>& v, uint64_t seed) {
  parallel_for(v.size(), 8, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; i += 8) {
      const uint64_t h = mix(seed ^ i);
      for (size_t j = 0; j < 8 && i + j < end; ++j) {
        const uint8_t b = uint8_t(h >> (8 * j));
        v[i + j] = uint8_t((b & 0x80) | (0x30 + (b & 0x7F) % 0x28));
      }
    }
  });
}

// Reserves n bytes on transparent huge pages where the kernel allows it (THP in "madvise" mode):
// filling 11 GB then takes 512 times fewer page faults. Advice only: if refused, nothing changes.
inline void reserve_huge(std::vector<uint8_t>& v, size_t n) {
  v.reserve(n);
  const uintptr_t huge = uintptr_t(2) << 20, at = reinterpret_cast<uintptr_t>(v.data());
  const uintptr_t begin = (at + huge - 1) & ~(huge - 1), end = (at + n) & ~(huge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

inline ExpertWeights random_operand(int num_experts, int n, int k, uint64_t seed) {
  ExpertWeights w;
  w.layout = WeightLayout{num_experts, n, k};
  reserve_huge(w.w, w.layout.w_elems());
  w.w.resize(w.layout.w_elems());
  fill_fp8(w.w, seed);
  w.scales.assign(w.layout.scale_elems(), float(0.5 / std::sqrt(double(k))));
  return w;
}

// A uniform double in [0, 1) from a mixed 64-bit word.
inline double unit_interval(uint64_t h) { return double(h >> 11) / 9007199254740992.0; }

// The router of `m` for hidden size d, random: weights of the scale of a trained router's,
// zero sigmoid biases, small logit biases where the router adds them (gpt-oss).
inline void random_router(const ModelSpec& m, int d, MoeLayerWeights& w) {
  const int E = m.num_routed_experts;
  w.router_weight.resize(size_t(E) * d);
  for (size_t i = 0; i < w.router_weight.size(); ++i)
    w.router_weight[i] = float((unit_interval(mix(i + 3)) - 0.5) * 3.4 / std::sqrt(double(d)));
  if (m.router.scoring == "sigmoid") w.router_bias.assign(E, 0.0f);
  if (m.router.logit_bias) {
    w.router_logit_bias.resize(E);
    for (int e = 0; e < E; ++e) w.router_logit_bias[e] = float((unit_interval(mix(e + 0xb1a5)) - 0.5) * 0.1);
  }
}

// The scale bytes of random MXFP4 weights: 118 .. 122, weights of at most 6 * 2^-5 ~ 0.19. The
// spread is that of a trained checkpoint's smooth scales, and it keeps the GEMM on its fast
// widening path (mxfp4.h, kGemmScaleFastBit: every group within 11 of its row's largest scale):
// real groups are at most 4 apart, and the padding's all-zero groups (scale 127) do not count.
constexpr uint8_t kRandomScaleMin = 118, kRandomScaleSpan = 5;

// One MXFP4 operand [E, n_p, k_p] as the loader leaves it: rows with real_row(r) hold random codes
// in their first k columns (every byte is two valid e2m1 codes), scales as above and, with_bias,
// a bias in [-0.1, 0.1); the rest is the loader's padding (zero codes, scale 127, zero bias).
template <class RealRow>
Mxfp4ExpertWeights random_mxfp4_operand(int num_experts, int n_p, int k_p, int k, const RealRow& real_row,
                                        bool with_bias, uint64_t seed) {
  Mxfp4ExpertWeights w;
  w.layout = Mxfp4WeightLayout{num_experts, n_p, k_p};
  const Mxfp4WeightLayout& l = w.layout;
  reserve_huge(w.w, l.w_bytes());
  w.w.resize(l.w_bytes(), 0);
  w.scales.assign(l.scale_elems(), kMxfp4UnitScale);
  if (with_bias) w.bias.assign(size_t(num_experts) * n_p, 0.0f);
  const size_t codes = size_t(k) / 2, groups = size_t(k) / kMxfp4Group;
  parallel_for(size_t(num_experts) * n_p, 1, [&](size_t begin, size_t end) {
    for (size_t row = begin; row < end; ++row) {
      if (!real_row(int(row % size_t(n_p)))) continue;
      uint8_t* c = &w.w[row * l.row_bytes()];
      for (size_t j = 0; j < codes; j += 8) {
        const uint64_t h = mix(seed ^ (row * l.row_bytes() + j));
        for (size_t b = 0; b < 8 && j + b < codes; ++b) c[j + b] = uint8_t(h >> (8 * b));
      }
      for (size_t g = 0; g < groups; ++g)
        w.scales[row * l.row_scales() + g] =
            uint8_t(kRandomScaleMin + mix(~seed ^ (row * l.row_scales() + g)) % kRandomScaleSpan);
      if (with_bias) w.bias[row] = float((unit_interval(mix((seed << 56) ^ ~row)) - 0.5) * 0.2);
    }
  });
  return w;
}

// One MoE layer of an MXFP4 model (expert_format "mxfp4", gpt-oss) as load_moe_layer makes it for
// all E experts: hidden and inter padded to multiples of 128, gate rows [0, inter) and up rows
// [inter_p, inter_p + inter) of W1 real, the router on the unpadded hidden.
inline MoeLayerWeights random_layer_mxfp4(const ModelSpec& m) {
  const int d = int(m.hidden_size), inter = int(m.moe_intermediate_size), E = m.num_routed_experts;
  MOEKIT_CHECK(d % kMxfp4Group == 0 && inter % kMxfp4Group == 0,
               "model '" + m.name + "': hidden " + std::to_string(d) + " and inter " + std::to_string(inter) +
                   " must be multiples of " + std::to_string(kMxfp4Group) + " for MXFP4 weights");
  MOEKIT_CHECK(m.num_shared_experts == 0,
               "model '" + m.name + "': MXFP4 layers hold no shared expert, the model has " +
                   std::to_string(m.num_shared_experts));
  const ExpertWeightSizes padded = loaded_expert_sizes(m);
  const int d_p = int(padded.hidden), inter_p = int(padded.intermediate);
  MoeLayerWeights w;
  w.num_experts = E;
  w.hidden_size = d;
  w.intermediate_size = inter;
  w.padded_hidden = d_p;
  w.padded_intermediate = inter_p;
  w.w1_mxfp4 = random_mxfp4_operand(E, 2 * inter_p, d_p, d, [&](int r) { return r % inter_p < inter; },
                                    m.expert_bias, 1);
  w.w2_mxfp4 = random_mxfp4_operand(E, d_p, inter_p, inter, [&](int r) { return r < d; }, m.expert_bias, 2);
  random_router(m, d, w);
  return w;
}

// One MoE layer of `m` with all E routed experts (what GpuMoeLayer takes), the router and the
// shared experts, random; in the model's expert format.
inline MoeLayerWeights random_layer(const ModelSpec& m) {
  if (m.expert_format == "mxfp4") return random_layer_mxfp4(m);
  MoeLayerWeights w;
  const int d = int(m.hidden_size), inter = int(m.moe_intermediate_size), E = m.num_routed_experts;
  w.num_experts = E;
  w.hidden_size = d;
  w.intermediate_size = inter;
  w.w1 = random_operand(E, 2 * inter, d, 1);
  w.w2 = random_operand(E, d, inter, 2);
  random_router(m, d, w);
  const int shared_inter = int(m.num_shared_experts * m.shared_intermediate_size);
  if (shared_inter > 0) {
    w.shared_w1 = random_operand(1, 2 * shared_inter, d, 4);
    w.shared_w2 = random_operand(1, d, shared_inter, 5);
  }
  return w;
}

// n BF16 values (bits) uniform in about [-1.7, 1.7]: finite tokens for the router and the EP send.
inline std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i) {
    const float v = float((unit_interval(mix(i * 131 + seed)) - 0.5) * 3.4);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    h[i] = uint16_t(bits >> 16);
  }
  return h;
}

// "8,64,256" -> {8, 64, 256}; an item that is not a positive integer is an Error naming it.
inline std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MOEKIT_CHECK(used == item.size() && !item.empty() && v > 0,
                 "list '" + s + "': item '" + item + "' is not a positive integer");
    out.push_back(v);
  }
  MOEKIT_CHECK(!out.empty(), "list '" + s + "' is empty");
  return out;
}

// Device copy bandwidth, read + write bytes over the time: the best of 5 copies of `bytes`
// (2 GB by default, far past the L2) on the current device.
inline double measure_copy_bandwidth(size_t bytes = size_t(1) << 31) {
  void *a = nullptr, *b = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&a, bytes));
  MOEKIT_CUDA_CHECK(cudaMalloc(&b, bytes));
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e0));
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e1));
  MOEKIT_CUDA_CHECK(cudaMemset(a, 0, bytes));
  MOEKIT_CUDA_CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  float best = 1e30f;
  for (int i = 0; i < 5; ++i) {
    MOEKIT_CUDA_CHECK(cudaEventRecord(e0));
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    MOEKIT_CUDA_CHECK(cudaEventRecord(e1));
    MOEKIT_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  MOEKIT_CUDA_CHECK(cudaEventDestroy(e0));
  MOEKIT_CUDA_CHECK(cudaEventDestroy(e1));
  MOEKIT_CUDA_CHECK(cudaFree(a));
  MOEKIT_CUDA_CHECK(cudaFree(b));
  return 2.0 * double(bytes) / (double(best) * 1e-3);
}

double median(std::vector<double> v);

// A graph's replay time in microseconds: median, min and max over the replays.
struct Timing {
  double median_us = 0, min_us = 0, max_us = 0;
};

// Replays `graph` n times back to back on `stream`, an event between replays; each replay's time
// divided by `per` (the steps one replay holds).
inline Timing time_replays(cudaGraphExec_t graph, cudaStream_t stream, int n, int per = 1) {
  std::vector<cudaEvent_t> ev(n + 1);
  for (auto& e : ev) MOEKIT_CUDA_CHECK(cudaEventCreate(&e));
  MOEKIT_CUDA_CHECK(cudaEventRecord(ev[0], stream));
  for (int i = 0; i < n; ++i) {
    MOEKIT_CUDA_CHECK(cudaGraphLaunch(graph, stream));
    MOEKIT_CUDA_CHECK(cudaEventRecord(ev[i + 1], stream));
  }
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> t(n);
  for (int i = 0; i < n; ++i) {
    float ms = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    t[i] = ms * 1e3 / per;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  Timing r;
  r.median_us = median(t);
  r.min_us = *std::min_element(t.begin(), t.end());
  r.max_us = *std::max_element(t.begin(), t.end());
  return r;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace moekit::bench
