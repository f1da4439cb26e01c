// bench_gemm: the FP8 grouped GEMM on the issue's problems, each figure next to its floor
// measured in the same run.
//   ceilings: device copy bandwidth (cudaMemcpy D2D, bytes read + written), streaming read
//             bandwidth (a vectorised read kernel), FP8 matrix rate of our own dense GEMM
//             (one expert, 8192 x 8192 x 8192 through the contiguous path).
//   problem 1: 8 DeepSeek-V3 experts, GEMM1 N=4096 K=7168 + GEMM2 N=7168 K=2048 (352 MB of FP8
//             weights), M_max = 128, masked_m all 5 / all 16 / random 1..16 / all 64:
//             effective TB/s = weight bytes / time of both GEMMs.
//   problem 2: one EP8 rank of DeepSeek-V3 (32 local experts) and Qwen3.5-397B-A17B (64 local
//             experts, hidden 4096, inter 1024), masked_m from uniform top-k routing of global
//             batches 64..4096; floor = max(bytes of experts with tokens / copy bandwidth,
//             FLOPs / FP8 rate).
//   problem 3: contiguous prefill, 8 experts of the GEMM1 shape (N 4096 K 7168) and of the GEMM2
//             shape (N 7168 K 2048), 512/2048/8192 rows each: TFLOP/s, also in clusters of 2.
//   problem 4: the A/B driver for kernel changes: problem 3's two shapes at 2048 rows per expert on
//             constant data (random data moves the tensor-core rate by up to ~15% run to run),
//             single CTAs of 128 and 256 weight rows and clusters of 2. Not in the default run.
//   problem 5: problem 2 at batches 1024, 2048 and 4096 with each masked tile config forced on both
//             GEMMs. Not in the default run.
// Times are medians of per-iteration CUDA events; input sets rotate so the L2 never holds a
// whole problem from the previous iteration. Usage: bench_gemm [--json PATH] [--quick] [--only 12345]
// [--model NAME] [--batch N,N..] (problems 2 and 5: that model, those batches only).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "gemm_bench.cuh"
#include "moekit/cuda_check.h"
#include "moekit/gemm.h"
#include "moekit/reference.h"

using namespace moekit;
using nlohmann::json;
using namespace moekit::gemm_bench;

namespace {

__global__ void read_kernel(const int4* p, size_t n, int* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    int4 v = __ldcs(p + i);
    acc.x ^= v.x;
    acc.y ^= v.y;
    acc.z ^= v.z;
    acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x7fffffff) *sink = 1;  // keeps the loads alive
}

// One masked GEMM's buffers (a set of weights, activations, masked_m, output).
struct MaskedSet {
  MaskedGemmProblem p;
  uint8_t *a = nullptr, *w = nullptr;
  float *as = nullptr, *ws = nullptr;
  int32_t* m = nullptr;
  uint16_t* out = nullptr;
  MaskedSet(const MaskedGemmProblem& prob, uint32_t seed) : p(prob) {
    size_t ae = size_t(p.num_experts) * p.max_m * p.k, we = size_t(p.num_experts) * p.n * p.k;
    a = device_alloc<uint8_t>(ae);
    w = device_alloc<uint8_t>(we);
    as = device_alloc<float>(size_t(p.num_experts) * (p.k / 128) * p.max_m);
    ws = device_alloc<float>(we / (128 * 128));
    m = device_alloc<int32_t>(p.num_experts);
    out = device_alloc<uint16_t>(size_t(p.num_experts) * p.max_m * p.n);
    fill_fp8(a, ae, seed);
    fill_fp8(w, we, seed + 1);
    fill_scales(as, size_t(p.num_experts) * (p.k / 128) * p.max_m, seed + 2);
    fill_scales(ws, we / (128 * 128), seed + 3);
  }
  ~MaskedSet() {
    cudaFree(a);
    cudaFree(w);
    cudaFree(as);
    cudaFree(ws);
    cudaFree(m);
    cudaFree(out);
  }
  void set_m(const std::vector<int32_t>& mm) {
    MOEKIT_CUDA_CHECK(cudaMemcpy(m, mm.data(), mm.size() * 4, cudaMemcpyHostToDevice));
  }
  MaskedGemmBuffers buffers() const { return {a, as, w, ws, m, out}; }
};

struct Ceilings {
  double copy_tbps = 0, read_tbps = 0, fp8_tflops = 0;
};

Ceilings measure_ceilings(json& out, bool quick) {
  Ceilings c;
  size_t bytes = size_t(2) << 30;
  uint8_t* x = device_alloc<uint8_t>(bytes);
  uint8_t* y = device_alloc<uint8_t>(bytes);
  int* sink = device_alloc<int>(1);
  fill_fp8(x, bytes, 1);
  double us = median_us(20, [&](int) { MOEKIT_CUDA_CHECK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice)); });
  c.copy_tbps = 2.0 * bytes / (us * 1e-6) / 1e12;
  us = median_us(20, [&](int) {
    read_kernel<<<132 * 8, 512>>>(reinterpret_cast<const int4*>(x), bytes / 16, sink);
  });
  c.read_tbps = double(bytes) / (us * 1e-6) / 1e12;
  cudaFree(x);
  cudaFree(y);
  cudaFree(sink);
  // FP8 rate: one expert, 8192^3, our own contiguous path (every row real).
  const int M = quick ? 4096 : 8192, N = 8192, K = 8192;
  uint8_t* a = device_alloc<uint8_t>(size_t(M) * K);
  uint8_t* w = device_alloc<uint8_t>(size_t(N) * K);
  float* as = device_alloc<float>(size_t(M) * K / 128);
  float* ws = device_alloc<float>(size_t(N / 128) * (K / 128));
  int32_t* re = device_alloc<int32_t>(M);
  uint16_t* o = device_alloc<uint16_t>(size_t(M) * N);
  fill_fp8(a, size_t(M) * K, 5);
  fill_fp8(w, size_t(N) * K, 6);
  fill_scales(as, size_t(M) * K / 128, 7);
  fill_scales(ws, size_t(N / 128) * (K / 128), 8);
  MOEKIT_CUDA_CHECK(cudaMemset(re, 0, M * 4));
  {
    ContiguousGemm g({1, N, K, M}, {a, as, re, w, ws, o});
    us = median_us(10, [&](int) { g.run(nullptr); });
    c.fp8_tflops = 2.0 * M * N * K / (us * 1e-6) / 1e12;
    out["dense_fp8_config"] = g.config().to_string();
  }
  {  // the same tile in clusters of 2 (token tile multicast), for comparison
    GemmConfig f = choose_contiguous_config({1, N, K, M}, 132);
    f.block_n = 128;  // clusters have 128-column tiles only
    f.cluster = 2;
    f.num_ctas = 0;
    ContiguousGemm g({1, N, K, M}, {a, as, re, w, ws, o}, &f);
    const double us2 = median_us(10, [&](int) { g.run(nullptr); });
    out["dense_fp8_TFLOPs_cluster2"] = 2.0 * M * N * K / (us2 * 1e-6) / 1e12;
    std::printf("own dense FP8 in clusters of 2: %.0f TFLOP/s (%s)\n", out["dense_fp8_TFLOPs_cluster2"].get<double>(),
                g.config().to_string().c_str());
  }
  for (void* p : {(void*)a, (void*)w, (void*)as, (void*)ws, (void*)re, (void*)o}) cudaFree(p);
  out["copy_TBps"] = c.copy_tbps;
  out["read_TBps"] = c.read_tbps;
  out["dense_fp8_TFLOPs"] = c.fp8_tflops;
  std::printf("ceilings: copy %.3f TB/s, streaming read %.3f TB/s, FP8 dense (own GEMM %dx%dx%d) %.0f TFLOP/s\n",
              c.copy_tbps, c.read_tbps, M, N, K, c.fp8_tflops);
  return c;
}

// Problem 1 and 2: two masked GEMMs (gate_up, down) of `num_experts` experts.
struct MoeShape {
  const char* name;
  int num_experts, hidden, inter;
};

// Both GEMMs of one rank: the weight bytes of every expert and of the experts with tokens, and the
// FLOPs of the real rows.
struct PairWork {
  double all_bytes = 0, touched_bytes = 0, flops = 0;
};
PairWork pair_work(const MoeShape& s, const std::vector<int32_t>& masked_m) {
  PairWork w;
  const double per = double(2 * s.inter) * s.hidden + double(s.hidden) * s.inter;
  for (int e = 0; e < s.num_experts; ++e) {
    w.all_bytes += per;
    if (masked_m[e] > 0) w.touched_bytes += per;
    w.flops += 2.0 * masked_m[e] * per;
  }
  return w;
}

// One rank's GEMM1 and GEMM2 problems and `num_sets` input sets of each (rotated so that the L2
// never holds a whole problem from the previous iteration), masked_m uploaded.
struct RankSets {
  MaskedGemmProblem p1, p2;
  std::vector<std::unique_ptr<MaskedSet>> s1, s2;
};
RankSets make_rank_sets(const MoeShape& s, int max_m, int expected_m, const std::vector<int32_t>& masked_m,
                        int num_sets) {
  RankSets r;
  r.p1 = {s.num_experts, 2 * s.inter, s.hidden, max_m, expected_m};
  r.p2 = {s.num_experts, s.hidden, s.inter, max_m, expected_m};
  for (int i = 0; i < num_sets; ++i) {
    r.s1.push_back(std::make_unique<MaskedSet>(r.p1, 100 + 10 * i));
    r.s2.push_back(std::make_unique<MaskedSet>(r.p2, 200 + 10 * i));
    r.s1.back()->set_m(masked_m);
    r.s2.back()->set_m(masked_m);
  }
  return r;
}

json run_masked_pair(const MoeShape& s, int max_m, const std::vector<int32_t>& masked_m, int expected_m,
                     const Ceilings& ceil, int num_sets, int iters, const GemmConfig* force1 = nullptr,
                     const GemmConfig* force2 = nullptr, Overlap overlap1 = Overlap::kNone,
                     Overlap overlap2 = Overlap::kNone) {
  const RankSets sets = make_rank_sets(s, max_m, expected_m, masked_m, num_sets);
  std::vector<std::unique_ptr<MaskedGemm>> g1, g2;
  for (int i = 0; i < num_sets; ++i) {
    g1.push_back(std::make_unique<MaskedGemm>(sets.p1, sets.s1[i]->buffers(), force1));
    g2.push_back(std::make_unique<MaskedGemm>(sets.p2, sets.s2[i]->buffers(), force2));
    g1.back()->set_overlap(overlap1);
    g2.back()->set_overlap(overlap2);
  }
  double t_both = median_us(iters, [&](int i) {
    g1[i % num_sets]->run(nullptr);
    g2[i % num_sets]->run(nullptr);
  });
  // The same pairs captured in one CUDA Graph (how a decode step runs): launch gaps between
  // kernels shrink and, with an overlap mode, each kernel starts under the previous one's tail.
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  const int graph_pairs = 20;
  MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < graph_pairs; ++i) {
    g1[i % num_sets]->run(stream);
    g2[i % num_sets]->run(stream);
  }
  MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  double t_graph = median_us(std::max(5, iters / 4), [&](int) {
                     MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, nullptr));
                   }) / graph_pairs;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  double t1 = median_us(iters, [&](int i) { g1[i % num_sets]->run(nullptr); });
  double t2 = median_us(iters, [&](int i) { g2[i % num_sets]->run(nullptr); });
  const PairWork w = pair_work(s, masked_m);
  const double wbytes = w.touched_bytes, all_bytes = w.all_bytes;
  double floor_mem_us = wbytes / (ceil.copy_tbps * 1e12) * 1e6;
  double floor_flop_us = w.flops / (ceil.fp8_tflops * 1e12) * 1e6;
  double floor_us = std::max(floor_mem_us, floor_flop_us);
  json r;
  r["model"] = s.name;
  r["num_experts"] = s.num_experts;
  r["max_m"] = max_m;
  r["expected_m"] = expected_m;
  r["rows"] = std::accumulate(masked_m.begin(), masked_m.end(), 0);
  r["experts_with_tokens"] = std::count_if(masked_m.begin(), masked_m.end(), [](int m) { return m > 0; });
  r["config_gemm1"] = g1[0]->config().to_string();
  r["config_gemm2"] = g2[0]->config().to_string();
  auto name = [](Overlap o) {
    return o == Overlap::kNone ? "none" : o == Overlap::kPreviousKernel ? "pdl" : "pdl+w";
  };
  r["overlap"] = std::string(name(overlap1)) + "/" + name(overlap2);
  r["us_both"] = t_both;
  r["us_both_in_graph"] = t_graph;
  r["effective_TBps_in_graph"] = wbytes / (t_graph * 1e-6) / 1e12;
  r["us_gemm1"] = t1;
  r["us_gemm2"] = t2;
  r["weight_MB_all"] = all_bytes / 1e6;
  r["weight_MB_touched"] = wbytes / 1e6;
  r["effective_TBps"] = wbytes / (t_both * 1e-6) / 1e12;
  r["floor_us"] = floor_us;
  r["floor_mem_us"] = floor_mem_us;
  r["floor_flop_us"] = floor_flop_us;
  r["memory_bound"] = floor_mem_us >= floor_flop_us;
  r["time_over_floor"] = t_both / floor_us;
  return r;
}

std::vector<int32_t> uniform_routing(int batch, int topk, int total_experts, int local_experts, int rank,
                                     std::mt19937& rng) {
  std::vector<int32_t> m(local_experts, 0);
  std::vector<int> ids(total_experts);
  std::iota(ids.begin(), ids.end(), 0);
  for (int t = 0; t < batch; ++t) {
    for (int j = 0; j < topk; ++j) {  // partial Fisher-Yates: k distinct experts
      std::uniform_int_distribution<int> d(j, total_experts - 1);
      std::swap(ids[j], ids[d(rng)]);
      int e = ids[j] - rank * local_experts;
      if (e >= 0 && e < local_experts) ++m[e];
    }
  }
  return m;
}

// Problems 2 and 5: rank 0 of EP8 for each model (its local experts; top-k of all of them).
struct RankModel {
  MoeShape shape;
  int topk, total_experts;
};
const RankModel kRankModels[] = {{{"deepseek-v3", 32, 7168, 2048}, 8, 256},
                                 {{"qwen3.5-397b-a17b", 64, 4096, 1024}, 10, 512}};

// Rank 0's rows per local expert under uniform routing of `batch` tokens, with the M_max and the
// expected_m the bench plans for: upper_typical_rows (gemm.h), the mean rows per expert plus two
// standard deviations, so that few experts need a second token block.
struct RankRouting {
  std::vector<int32_t> masked_m;
  int max_m, expected_m;
};
RankRouting rank_routing(const RankModel& model, int batch, std::mt19937& rng) {
  RankRouting r;
  r.masked_m = uniform_routing(batch, model.topk, model.total_experts, model.shape.num_experts, 0, rng);
  r.max_m = std::max(4, (batch + 3) / 4 * 4);
  r.expected_m = upper_typical_rows(int64_t(batch) * model.topk, model.total_experts);
  return r;
}

// Problem 5: the heuristic's configs (first) and each of `forced` on both GEMMs of one rank, over
// the same two input sets, timed round-robin: every round runs each config's pair once (and
// then each GEMM alone), so a slow stretch of the clock hits all configs. Medians of the rounds.
std::vector<json> run_masked_configs(const MoeShape& s, const RankRouting& rr, const std::vector<GemmConfig>& forced,
                                     const Ceilings& ceil, int iters) {
  constexpr int kSets = 2;
  const RankSets sets = make_rank_sets(s, rr.max_m, rr.expected_m, rr.masked_m, kSets);
  const int configs = 1 + int(forced.size());  // 0: the heuristic's
  std::vector<std::vector<std::unique_ptr<MaskedGemm>>> g1(configs), g2(configs);
  for (int c = 0; c < configs; ++c)
    for (int i = 0; i < kSets; ++i) {
      const GemmConfig* f = c == 0 ? nullptr : &forced[c - 1];
      g1[c].push_back(std::make_unique<MaskedGemm>(sets.p1, sets.s1[i]->buffers(), f));
      g2[c].push_back(std::make_unique<MaskedGemm>(sets.p2, sets.s2[i]->buffers(), f));
      g1[c].back()->set_overlap(Overlap::kPreviousKernel);  // as in a decode step (problem 2)
      g2[c].back()->set_overlap(Overlap::kPreviousKernelStaticWeights);
    }
  const int warmup = 2, rounds = warmup + iters;
  enum { kBoth, kFirst, kSecond };
  std::vector<cudaEvent_t> ev(size_t(rounds) * configs * 3 * 2);
  for (auto& e : ev) MOEKIT_CUDA_CHECK(cudaEventCreate(&e));
  auto at = [&](int r, int c, int what) { return &ev[((size_t(r) * configs + c) * 3 + what) * 2]; };
  for (int r = 0; r < rounds; ++r)
    for (int what : {kBoth, kFirst, kSecond})
      for (int c = 0; c < configs; ++c) {
        cudaEvent_t* e = at(r, c, what);
        MOEKIT_CUDA_CHECK(cudaEventRecord(e[0]));
        if (what != kSecond) g1[c][r % kSets]->run(nullptr);
        if (what != kFirst) g2[c][r % kSets]->run(nullptr);
        MOEKIT_CUDA_CHECK(cudaEventRecord(e[1]));
      }
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  auto median = [&](int c, int what) {
    std::vector<double> t;
    for (int r = warmup; r < rounds; ++r) {
      float ms = 0;
      MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, at(r, c, what)[0], at(r, c, what)[1]));
      t.push_back(ms * 1e3);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const PairWork w = pair_work(s, rr.masked_m);
  const double floor_us =
      std::max(w.touched_bytes / (ceil.copy_tbps * 1e12), w.flops / (ceil.fp8_tflops * 1e12)) * 1e6;
  std::vector<json> rows;
  for (int c = 0; c < configs; ++c) {
    json r;
    r["model"] = s.name;
    r["rows"] = std::accumulate(rr.masked_m.begin(), rr.masked_m.end(), 0);
    r["expected_m"] = rr.expected_m;
    r["config_gemm1"] = g1[c][0]->config().to_string();
    r["config_gemm2"] = g2[c][0]->config().to_string();
    r["forced"] = c > 0;
    r["us_both"] = median(c, kBoth);
    r["us_gemm1"] = median(c, kFirst);
    r["us_gemm2"] = median(c, kSecond);
    r["floor_us"] = floor_us;
    r["time_over_floor"] = r["us_both"].get<double>() / floor_us;
    rows.push_back(r);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return rows;
}

// constant: every code 1.0 and every scale 1.0 instead of random data. Random operands draw more
// power and cost the tensor cores up to ~15% of their rate run to run; constant ones isolate
// what a kernel change does (problem 4).
json run_contiguous(int num_experts, int rows_per_expert, int N, int K, const Ceilings& ceil, int iters,
                    const GemmConfig* force = nullptr, bool constant = false) {
  const int total = num_experts * rows_per_expert;  // rows_per_expert is a multiple of 128: no padding
  uint8_t* a = device_alloc<uint8_t>(size_t(total) * K);
  uint8_t* w = device_alloc<uint8_t>(size_t(num_experts) * N * K);
  float* as = device_alloc<float>(size_t(total) * K / 128);
  float* ws = device_alloc<float>(size_t(num_experts) * (N / 128) * (K / 128));
  int32_t* re = device_alloc<int32_t>(total);
  uint16_t* o = device_alloc<uint16_t>(size_t(total) * N);
  if (constant) {
    MOEKIT_CUDA_CHECK(cudaMemset(a, 0x38, size_t(total) * K));  // e4m3 1.0
    MOEKIT_CUDA_CHECK(cudaMemset(w, 0x38, size_t(num_experts) * N * K));
    const std::vector<float> ones(std::max<size_t>(size_t(total) * K / 128, size_t(num_experts) * (N / 128) * (K / 128)), 1.0f);
    MOEKIT_CUDA_CHECK(cudaMemcpy(as, ones.data(), size_t(total) * K / 128 * 4, cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaMemcpy(ws, ones.data(), size_t(num_experts) * (N / 128) * (K / 128) * 4, cudaMemcpyHostToDevice));
  } else {
    fill_fp8(a, size_t(total) * K, 11);
    fill_fp8(w, size_t(num_experts) * N * K, 12);
    fill_scales(as, size_t(total) * K / 128, 13);
    fill_scales(ws, size_t(num_experts) * (N / 128) * (K / 128), 14);
  }
  std::vector<int32_t> h(total);
  for (int i = 0; i < total; ++i) h[i] = i / rows_per_expert;
  ref::check_contiguous_segments(h.data(), total, kContiguousAlign, num_experts);  // the layout the kernels assume
  MOEKIT_CUDA_CHECK(cudaMemcpy(re, h.data(), total * 4, cudaMemcpyHostToDevice));
  json r;
  {
    ContiguousGemm g({num_experts, N, K, total}, {a, as, re, w, ws, o}, force);
    double us = median_us(iters, [&](int) { g.run(nullptr); });
    double flops = 2.0 * total * N * K;
    r["rows_per_expert"] = rows_per_expert;
    r["n"] = N;
    r["k"] = K;
    r["config"] = g.config().to_string();
    r["us"] = us;
    r["TFLOPs"] = flops / (us * 1e-6) / 1e12;
    r["fraction_of_dense_fp8"] = flops / (us * 1e-6) / 1e12 / ceil.fp8_tflops;
  }
  for (void* p : {(void*)a, (void*)w, (void*)as, (void*)ws, (void*)re, (void*)o}) cudaFree(p);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  bool quick = false;
  std::string only = "123";  // problems to run
  std::string model_only;    // problems 2 and 5: only this model
  std::string batch_arg;     // problems 2 and 5: only these batches ("2048,4096")
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--model") && i + 1 < argc) model_only = argv[++i];
    else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) batch_arg = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_gemm [--json PATH] [--quick] [--only 12345] [--model NAME] [--batch N,N..]\n");
      return 2;
    }
  }
  try {
    DeviceInfo dev = query_device();
    std::printf("device: %s, %d SMs, L2 %d MB, smem/block %d KB\n", dev.name.c_str(), dev.num_sms, dev.l2_bytes >> 20,
                dev.max_smem_per_block >> 10);
    json out;
    out["device"] = dev.name;
    out["num_sms"] = dev.num_sms;
    Ceilings ceil = measure_ceilings(out["ceilings"], quick);
    const int iters = quick ? 10 : 30;
    const std::vector<int> batch_only = batch_arg.empty() ? std::vector<int>{} : bench::parse_list(batch_arg);
    const auto skip_batch = [&](int batch) {
      return !batch_only.empty() && std::find(batch_only.begin(), batch_only.end(), batch) == batch_only.end();
    };

    std::mt19937 rng(2026);
    // ---- problem 1
    if (only.find('1') != std::string::npos) {
    std::printf("\nproblem 1: 8 DeepSeek-V3 experts, GEMM1 4096x7168 + GEMM2 7168x2048, M_max=128\n");
    std::printf("%-14s %-44s %9s %9s %9s %8s %8s %9s %8s\n", "masked_m", "config (gemm1)", "us both", "us g1", "us g2",
                "TB/s", "%copy", "us graph", "TB/s");
    const MoeShape dsv3_8{"deepseek-v3", 8, 7168, 2048};
    std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
        {"all 5", std::vector<int32_t>(8, 5)}, {"all 16", std::vector<int32_t>(8, 16)}, {"rand 1..16", {}},
        {"all 64", std::vector<int32_t>(8, 64)}};
    std::uniform_int_distribution<int> d16(1, 16);
    for (int e = 0; e < 8; ++e) cases[2].second.push_back(d16(rng));
    for (auto& [name, mm] : cases) {
      int expected = *std::max_element(mm.begin(), mm.end());
      json r = run_masked_pair(dsv3_8, 128, mm, expected, ceil, 2, iters);
      r["case"] = name;
      r["masked_m"] = mm;
      r["fraction_of_copy"] = r["effective_TBps"].get<double>() / ceil.copy_tbps;
      std::printf("%-14s %-44s %9.1f %9.1f %9.1f %8.3f %7.1f%% %9.1f %8.3f\n", name.c_str(),
                  r["config_gemm1"].get<std::string>().substr(0, 44).c_str(), r["us_both"].get<double>(),
                  r["us_gemm1"].get<double>(), r["us_gemm2"].get<double>(), r["effective_TBps"].get<double>(),
                  100 * r["fraction_of_copy"].get<double>(), r["us_both_in_graph"].get<double>(),
                  r["effective_TBps_in_graph"].get<double>());
      out["problem1"].push_back(r);
    }
    // Variants on "all 16": the tuning knobs, each against the heuristic's choice.
    for (auto [bm, splits, bn] : {std::tuple{16, 1, 128}, std::tuple{16, 1, 64}, std::tuple{32, 1, 128},
                                  std::tuple{16, 2, 128}, std::tuple{16, 4, 128}}) {
      GemmConfig f;
      f.swap_ab = true;
      f.block_m = bm;
      f.block_n = bn;
      f.num_splits = splits;
      json r = run_masked_pair(dsv3_8, 128, cases[1].second, 16, ceil, 2, iters, &f, &f);
      r["case"] = "all 16 (forced)";
      std::printf("%-14s %-44s %9.1f %9.1f %9.1f %8.3f %7.1f%%\n", "all 16 forced",
                  r["config_gemm1"].get<std::string>().substr(0, 44).c_str(), r["us_both"].get<double>(),
                  r["us_gemm1"].get<double>(), r["us_gemm2"].get<double>(), r["effective_TBps"].get<double>(),
                  100 * r["effective_TBps"].get<double>() / ceil.copy_tbps);
      out["problem1_variants"].push_back(r);
    }
    // "all 64" with the token tile multicast to clusters of 2 (both GEMMs).
    for (int cluster : {1, 2}) {
      GemmConfig f;
      f.swap_ab = true;
      f.block_m = 64;
      f.block_n = 128;
      f.cluster = cluster;
      json r = run_masked_pair(dsv3_8, 128, cases[3].second, 64, ceil, 2, iters, &f, &f);
      r["case"] = "all 64 (forced)";
      std::printf("%-14s %-44s %9.1f %9.1f %9.1f %8.3f %7.1f%% %9.1f %8.3f\n", "all 64 forced",
                  r["config_gemm1"].get<std::string>().substr(0, 44).c_str(), r["us_both"].get<double>(),
                  r["us_gemm1"].get<double>(), r["us_gemm2"].get<double>(), r["effective_TBps"].get<double>(),
                  100 * r["effective_TBps"].get<double>() / ceil.copy_tbps, r["us_both_in_graph"].get<double>(),
                  r["effective_TBps_in_graph"].get<double>());
      out["problem1_variants"].push_back(r);
    }
    // Programmatic dependent launch: GEMM2 overlaps GEMM1's tail (both back to back).
    for (int c : {0, 1, 2, 3}) {
      // GEMM1/GEMM2 modes: PDL only; a decode step (GEMM1 follows the dispatch, which writes
      // masked_m: no early weights; GEMM2 follows the activation kernel: early weights); both early.
      const Overlap kP = Overlap::kPreviousKernel, kW = Overlap::kPreviousKernelStaticWeights;
      for (auto [ov1, ov2] : {std::pair{kP, kP}, std::pair{kP, kW}, std::pair{kW, kW}}) {
        auto& [name, mm] = cases[c];
        int expected = *std::max_element(mm.begin(), mm.end());
        json r = run_masked_pair(dsv3_8, 128, mm, expected, ceil, 2, iters, nullptr, nullptr, ov1, ov2);
        r["case"] = name;
        std::printf("%-28s %-30s %9.1f %9.1f %9.1f %8.3f %7.1f%% %9.1f %8.3f\n",
                    (name + " " + r["overlap"].get<std::string>()).c_str(),
                    r["config_gemm1"].get<std::string>().substr(0, 30).c_str(), r["us_both"].get<double>(),
                    r["us_gemm1"].get<double>(), r["us_gemm2"].get<double>(), r["effective_TBps"].get<double>(),
                    100 * r["effective_TBps"].get<double>() / ceil.copy_tbps, r["us_both_in_graph"].get<double>(),
                    r["effective_TBps_in_graph"].get<double>());
        out["problem1_overlap"].push_back(r);
      }
    }
    }

    // ---- problem 2
    if (only.find('2') != std::string::npos) {
    std::printf("\nproblem 2: one EP8 rank, uniform routing\n");
    std::printf("%-20s %6s %6s %6s %9s %9s %8s %9s  %s\n", "model", "batch", "rows", "exp>0", "us", "floor us",
                "x floor", "us graph", "config (gemm1)");
    for (const RankModel& model : kRankModels) {
      if (!model_only.empty() && model_only != model.shape.name) continue;
      for (int batch : {64, 256, 1024, 2048, 4096}) {
        if ((quick && batch > 1024 && batch_only.empty()) || skip_batch(batch)) continue;
        const RankRouting rr = rank_routing(model, batch, rng);
        // Overlap as in a decode step: GEMM1 after the dispatch, GEMM2 after the activation.
        json r = run_masked_pair(model.shape, rr.max_m, rr.masked_m, rr.expected_m, ceil, 2, iters, nullptr, nullptr,
                                 Overlap::kPreviousKernel, Overlap::kPreviousKernelStaticWeights);
        r["batch"] = batch;
        std::printf("%-20s %6d %6d %6d %9.1f %9.1f %8.2f %9.1f  %s\n", model.shape.name, batch, r["rows"].get<int>(),
                    r["experts_with_tokens"].get<int>(), r["us_both"].get<double>(), r["floor_us"].get<double>(),
                    r["time_over_floor"].get<double>(), r["us_both_in_graph"].get<double>(),
                    r["config_gemm1"].get<std::string>().c_str());
        out["problem2"].push_back(r);
      }
    }
    }

    // ---- problem 3
    if (only.find('3') != std::string::npos) {
    for (auto [N, K] : {std::pair{4096, 7168}, std::pair{7168, 2048}}) {
    std::printf("\nproblem 3: contiguous prefill, 8 experts, N=%d K=%d\n", N, K);
    for (int rows : {512, 2048, 8192}) {
      // One row of the table: the heuristic's config (force null) or a forced one, into out[key].
      auto row = [&](const GemmConfig* force, const char* key) {
        json r = run_contiguous(8, rows, N, K, ceil, quick ? 5 : 10, force);
        std::printf("rows/expert %5d  %9.1f us  %7.1f TFLOP/s  %5.1f%% of dense  %s%s\n", rows, r["us"].get<double>(),
                    r["TFLOPs"].get<double>(), 100 * r["fraction_of_dense_fp8"].get<double>(),
                    r["config"].get<std::string>().c_str(), force ? " (forced)" : "");
        out[key].push_back(r);
      };
      row(nullptr, "problem3");
      // Each tile width the heuristic weighs, forced (what its choice costs or saves), then the
      // 128-column tile in clusters of 2 (what the multicast of the token tile buys).
      for (auto [block_n, cluster] : {std::pair{128, 1}, std::pair{256, 1}, std::pair{128, 2}}) {
        GemmConfig f;
        f.block_m = 128;
        f.block_n = block_n;
        f.cluster = cluster;
        row(&f, cluster == 1 ? "problem3_widths" : "problem3_cluster2");
      }
    }
    }
    }
    // ---- problem 4: the A/B driver of kernel changes (constant data, 2048 rows per expert)
    if (only.find('4') != std::string::npos) {
    std::printf("\nproblem 4: contiguous, 8 experts x 2048 rows, constant data (kernel A/B)\n");
    for (auto [N, K] : {std::pair{7168, 2048}, std::pair{4096, 7168}}) {
      for (auto [cluster, block_n] : {std::pair{1, 128}, std::pair{1, 256}, std::pair{2, 128}}) {
        GemmConfig f;
        f.block_m = 128;
        f.block_n = block_n;
        f.cluster = cluster;
        json r = run_contiguous(8, 2048, N, K, ceil, 10, &f, true);
        std::printf("N=%d K=%d  %9.1f us  %7.1f TFLOP/s  %s\n", N, K, r["us"].get<double>(), r["TFLOPs"].get<double>(),
                    r["config"].get<std::string>().c_str());
        out["problem4"].push_back(r);
      }
    }
    }
    // ---- problem 5: problem 2's largest batches with every masked tile config forced on both GEMMs
    // (what the heuristic's choice costs against the others). Not in the default run. The configs
    // are timed round-robin, one of each per round on the same buffers, so that the clock's drift
    // under the power cap (several % over seconds of FP8 work) falls on all of them alike.
    if (only.find('5') != std::string::npos) {
    std::printf("\nproblem 5: one EP8 rank, batches 1024, 2048 and 4096, masked configs timed round-robin\n");
    std::vector<GemmConfig> forced;
    for (auto [swap, bm, cluster, bn] : {std::tuple{true, 48, 1, 128}, std::tuple{true, 64, 1, 128},
                                         std::tuple{true, 128, 1, 128},
                                         std::tuple{true, 128, 2, 128}, std::tuple{false, 64, 1, 128},
                                         std::tuple{false, 128, 1, 128}, std::tuple{false, 128, 1, 256}}) {
      GemmConfig f;
      f.swap_ab = swap;
      f.block_m = bm;
      f.block_n = bn;
      f.cluster = cluster;
      forced.push_back(f);
    }
    for (const RankModel& model : kRankModels) {
      if (!model_only.empty() && model_only != model.shape.name) continue;
      for (int batch : {1024, 2048, 4096}) {
        if (skip_batch(batch)) continue;
        const RankRouting rr = rank_routing(model, batch, rng);
        for (json& r : run_masked_configs(model.shape, rr, forced, ceil, iters)) {
          r["batch"] = batch;
          std::printf("%-20s %5d %5d rows  g1 %7.1f  g2 %7.1f  both %7.1f  floor %7.1f  x %5.2f  %s%s\n",
                      model.shape.name, batch, r["rows"].get<int>(), r["us_gemm1"].get<double>(),
                      r["us_gemm2"].get<double>(), r["us_both"].get<double>(), r["floor_us"].get<double>(),
                      r["time_over_floor"].get<double>(), r["config_gemm1"].get<std::string>().c_str(),
                      r["forced"].get<bool>() ? " (forced)" : "");
          out["problem5"].push_back(r);
        }
      }
    }
    }
    if (!json_path.empty()) write_text_file(json_path, out.dump(1));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
