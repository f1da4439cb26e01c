// bench_router: the router GEMM's two kernels (router_logits.cu) on the models' router shapes,
// each configuration timed alone, with the L2 flushed before every launch as a decode step's
// weight stream leaves it (a 7 MB router would otherwise stay in the 50 MB L2 between launches).
// Prints, per shape and token count, the median of --iters launches of each configuration in µs
// (CUDA events around the one launch) and the rule's pick (choose_router_config), so the rule's
// costs can be read against the measured times.
//
// Usage: bench_router [--tokens 1,8,...] [--models gpt-oss-120b,deepseek-v3,qwen3.5]
//                     [--configs auto,warps,tiles:1,tiles:2,tiles:4,tiles:8,tiles:16] [--iters N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "kernels/cuda/gating.cuh"
#include "kernels/cuda/gemm_host.cuh"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"

using namespace moekit;

namespace {

struct RouterShape {
  std::string model;
  int num_experts, hidden, x_cols;  // x_cols < hidden: the loader's padded rows (gpt-oss)
};

const std::vector<RouterShape> kShapes = {
    {"gpt-oss-120b", 128, 2944, 2880}, {"deepseek-v3", 256, 7168, 7168}, {"qwen3.5", 512, 4096, 4096}};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

int parse_int(const std::string& flag, const std::string& v, int lo) {
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  MOEKIT_CHECK(!v.empty() && *end == '\0' && n >= lo && n <= (1 << 20),
               "bench_router: " + flag + " '" + v + "', expected an integer in " + std::to_string(lo) + " .. 1048576");
  return int(n);
}

gpu::RouterConfig parse_config(const std::string& v) {
  if (v == "auto") return {};
  if (v == "warps") return {gpu::RouterKernel::kWarps, 1};
  MOEKIT_CHECK(v.rfind("tiles:", 0) == 0, "bench_router: --configs entry '" + v +
                                              "', expected auto, warps or tiles:S");
  return {gpu::RouterKernel::kTiles, parse_int("--configs", v.substr(6), 1)};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> tokens = {1, 8, 16, 64, 128, 256, 1024, 4096, 8192};
  std::vector<std::string> models = {"gpt-oss-120b", "deepseek-v3", "qwen3.5"};
  std::vector<std::string> configs = {"auto", "warps", "tiles:1", "tiles:2", "tiles:4", "tiles:8", "tiles:16"};
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    MOEKIT_CHECK(i + 1 < argc, "bench_router: " + a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--tokens") {
      tokens = bench::parse_list(v);
      for (const int t : tokens)
        MOEKIT_CHECK(t <= (1 << 20), "bench_router: --tokens item " + std::to_string(t) + ", expected at most 1048576");
    } else if (a == "--models") {
      models = split_list(v);
    } else if (a == "--configs") {
      configs = split_list(v);
    } else if (a == "--iters") {
      iters = parse_int(a, v, 1);
    } else {
      MOEKIT_CHECK(false, "bench_router: unknown flag '" + a + "'");
    }
  }
  for (const auto& c : configs) parse_config(c);  // refuse a bad entry before anything runs

  const int max_t = *std::max_element(tokens.begin(), tokens.end());
  size_t max_x = 0, max_w = 0, max_l = 0;
  for (const auto& s : kShapes) {
    max_x = std::max(max_x, size_t(max_t) * s.x_cols);
    max_w = std::max(max_w, size_t(s.num_experts) * s.hidden);
    max_l = std::max(max_l, size_t(max_t) * s.num_experts);
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> hx(max_x);
  std::vector<float> hw(max_w), hb(512);
  for (auto& v : hx) v = float_to_bf16(normal(rng));
  for (auto& v : hw) v = normal(rng) * 0.02f;
  for (auto& v : hb) v = normal(rng);
  uint16_t* x = nullptr;
  float *w = nullptr, *bias = nullptr, *logits = nullptr;
  void* flush = nullptr;
  const size_t flush_bytes = size_t(256) << 20;  // past any Hopper L2
  MOEKIT_CUDA_CHECK(cudaMalloc(&x, max_x * sizeof(uint16_t)));
  MOEKIT_CUDA_CHECK(cudaMalloc(&w, max_w * sizeof(float)));
  MOEKIT_CUDA_CHECK(cudaMalloc(&bias, hb.size() * sizeof(float)));
  MOEKIT_CUDA_CHECK(cudaMalloc(&logits, max_l * sizeof(float)));
  MOEKIT_CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
  MOEKIT_CUDA_CHECK(cudaMemcpy(x, hx.data(), max_x * sizeof(uint16_t), cudaMemcpyHostToDevice));
  MOEKIT_CUDA_CHECK(cudaMemcpy(w, hw.data(), max_w * sizeof(float), cudaMemcpyHostToDevice));
  MOEKIT_CUDA_CHECK(cudaMemcpy(bias, hb.data(), hb.size() * sizeof(float), cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1;
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e0));
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e1));
  cudaDeviceProp prop{};
  MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("bench_router on %s (%d SMs): median of %d launches each, µs, L2 flushed before each\n", prop.name,
              prop.multiProcessorCount, iters);
  std::printf("%-14s %6s %-8s", "model", "tokens", "rule");
  for (const auto& c : configs) std::printf(" %9s", c.c_str());
  std::printf("\n");
  for (const auto& m : models) {
    const auto it = std::find_if(kShapes.begin(), kShapes.end(), [&](const RouterShape& s) { return s.model == m; });
    MOEKIT_CHECK(it != kShapes.end(),
                 "bench_router: --models entry '" + m + "', expected gpt-oss-120b, deepseek-v3 or qwen3.5");
    for (const int t : tokens) {
      const auto pick = gpu::choose_router_config(t, it->num_experts, it->x_cols, prop.multiProcessorCount);
      std::printf("%-14s %6d %-8s", m.c_str(), t, pick.to_string().c_str());
      for (const auto& c : configs) {
        const auto cfg = parse_config(c);
        if (cfg.kernel == gpu::RouterKernel::kTiles && cfg.splits > (it->x_cols + 31) / 32) {
          std::printf(" %9s", "-");
          continue;
        }
        std::vector<double> ms;
        for (int i = 0; i < iters; ++i) {
          MOEKIT_CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
          MOEKIT_CUDA_CHECK(cudaEventRecord(e0));
          gpu::launch_router_logits(x, t, it->hidden, w, it->num_experts, logits, nullptr, {}, bias, it->x_cols, cfg);
          MOEKIT_CUDA_CHECK(cudaEventRecord(e1));
          MOEKIT_CUDA_CHECK(cudaEventSynchronize(e1));
          float v = 0;
          MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&v, e0, e1));
          ms.push_back(v);
        }
        std::printf(" %9.1f", 1000.0 * bench::median(ms));
      }
      std::printf("\n");
    }
  }
  MOEKIT_CUDA_CHECK(cudaGetLastError());
  cudaFree(x);
  cudaFree(w);
  cudaFree(bias);
  cudaFree(logits);
  cudaFree(flush);
  return 0;
}
