// GPU tests of the FP8 grouped GEMM (gemm.h) against a float64 reference computed here on the
// dequantised operands (the oracle of docs/design.md §Numerics and their bounds). Every test draws
// fresh random operands (never zeros), fills the output with a NaN poison first, and checks that
// every real row was written and every padding row left alone.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "device_buffer.h"
#include "expect_error.h"
#include "gemm_operands.h"
#include "kernels/cuda/activation.cuh"
#include "moekit/bf16.h"
#include "moekit/cuda_check.h"
#include "moekit/cuda_graph.h"
#include "moekit/fp8.h"
#include "moekit/gemm.h"
#include "moekit/layout.h"
#include "moekit/reference.h"

namespace moekit {
namespace {



// out[n] for one token row: sum over K blocks of a_scale(kb) * w_scale(n, kb) * dot(a, w) in float64.
struct Operands {
  int num_experts, n, k;
  std::vector<uint8_t> w;
  std::vector<float> w_scales;
  std::vector<double> w_deq;  // dequantised without scales, [E, N, K]
};

Operands make_weights(int e, int n, int k, std::mt19937& rng, bool positive = false) {
  Operands o{e, n, k, random_fp8(size_t(e) * n * k, rng, positive), random_scales(size_t(e) * (n / 128) * (k / 128), rng), {}};
  o.w_deq.resize(o.w.size());
  for (size_t i = 0; i < o.w.size(); ++i) o.w_deq[i] = fp8_e4m3_to_float(o.w[i]);
  return o;
}

// Reference row: `a` is one token's K codes, `a_scale(kb)` its scales.
template <class ScaleFn>
void reference_row(const Operands& w, int e, const uint8_t* a, ScaleFn a_scale, std::vector<double>& out) {
  const int kb_count = w.k / 128;
  WeightLayout wl{w.num_experts, w.n, w.k};
  std::vector<double> a_deq(w.k);
  for (int i = 0; i < w.k; ++i) a_deq[i] = fp8_e4m3_to_float(a[i]);
  out.assign(w.n, 0.0);
  for (int n = 0; n < w.n; ++n) {
    const double* wr = &w.w_deq[wl.w_offset(e, n)];
    double sum = 0;
    for (int kb = 0; kb < kb_count; ++kb) {
      double dot = 0;
      for (int i = kb * 128; i < kb * 128 + 128; ++i) dot += a_deq[i] * wr[i];
      sum += dot * a_scale(kb) * w.w_scales[wl.scale_offset(e, n, kb * 128)];
    }
    out[n] = sum;
  }
}


// ---------------------------------------------------------------------------------------------
// Masked

struct MaskedCase {
  MaskedGemmProblem problem;
  Operands w;
  std::vector<uint8_t> a;
  std::vector<float> a_scales;
  DeviceBuffer<uint8_t> d_a, d_w;
  DeviceBuffer<float> d_as, d_ws;
  DeviceBuffer<int32_t> d_m;
  DeviceBuffer<uint16_t> d_out;
  MaskedLayout layout;

  MaskedCase(const MaskedGemmProblem& p, std::mt19937& rng, bool positive = false)
      : problem(p),
        w(make_weights(p.num_experts, p.n, p.k, rng, positive)),
        d_a(size_t(p.num_experts) * p.max_m * p.k),
        d_w(w.w.size()),
        d_as(size_t(p.num_experts) * (p.k / 128) * p.max_m),
        d_ws(w.w_scales.size()),
        d_m(p.num_experts),
        d_out(size_t(p.num_experts) * p.max_m * p.n),
        layout{p.num_experts, p.max_m, p.k} {
    d_w.upload(w.w);
    d_ws.upload(w.w_scales);
    new_activations(rng, positive);
  }
  void new_activations(std::mt19937& rng, bool positive = false) {
    a = random_fp8(d_a.count, rng, positive);
    a_scales = random_scales(d_as.count, rng);
    d_a.upload(a);
    d_as.upload(a_scales);
  }
  MaskedGemmBuffers buffers() const { return {d_a.ptr, d_as.ptr, d_w.ptr, d_ws.ptr, d_m.ptr, d_out.ptr}; }
  void poison() { MOEKIT_CUDA_CHECK(cudaMemset(d_out.ptr, 0xFF, d_out.count * sizeof(uint16_t))); }

  ErrorStats check(const std::vector<int32_t>& masked_m) const {
    std::vector<uint16_t> out = d_out.download();
    ErrorStats st;
    std::vector<double> ref;
    for (int e = 0; e < problem.num_experts; ++e) {
      for (int m = 0; m < problem.max_m; ++m) {
        const uint16_t* got = &out[layout.out_offset(e, m, problem.n)];
        if (m >= masked_m[e]) {
          st.check_untouched(got, problem.n);
          continue;
        }
        reference_row(w, e, &a[layout.a_offset(e, m)],
                      [&](int kb) { return double(a_scales[layout.scale_offset(e, m, kb)]); }, ref);
        st.add_row(got, ref);
      }
    }
    return st;
  }
};

// The CPU reference GEMM (reference.h) follows the same order of operations (scale product,
// then one fmaf per 128 block): the outputs should agree to a bf16 ulp or so, apart from the
// tensor core's own partial-sum precision. Returns the relative Frobenius distance and prints
// the share of bit-identical elements.
double compare_with_cpu_reference(const MaskedCase& c, const std::vector<int32_t>& masked_m) {
  std::vector<uint16_t> ref(c.d_out.count, kPoison);
  WeightLayout wl{c.problem.num_experts, c.problem.n, c.problem.k};
  ref::grouped_gemm_masked(c.layout, c.a.data(), c.a_scales.data(), masked_m.data(), wl, c.w.w.data(),
                           c.w.w_scales.data(), ref.data());
  std::vector<uint16_t> got = c.d_out.download();
  double num = 0, den = 0;
  long same = 0, total = 0;
  for (int e = 0; e < c.problem.num_experts; ++e)
    for (int m = 0; m < masked_m[e]; ++m)
      for (int n = 0; n < c.problem.n; ++n) {
        size_t i = c.layout.out_offset(e, m, c.problem.n) + n;
        double g = bf16_to_float(got[i]), r = bf16_to_float(ref[i]);
        num += (g - r) * (g - r);
        den += r * r;
        same += got[i] == ref[i];
        ++total;
      }
  std::printf("  vs CPU reference: %.1f%% bit-identical, relative distance %.2e\n", 100.0 * same / total,
              std::sqrt(num / den));
  return std::sqrt(num / den);
}

ErrorStats run_masked(MaskedCase& c, const std::vector<int32_t>& masked_m, const GemmConfig* cfg) {
  c.d_m.upload(masked_m);
  c.poison();
  MaskedGemm gemm(c.problem, c.buffers(), cfg);
  gemm.run(nullptr);
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  return c.check(masked_m);
}

void expect_good(const ErrorStats& st, double tol, const std::string& what) {
  EXPECT_EQ(st.unwritten, 0) << what;
  EXPECT_EQ(st.clobbered, 0) << what;
  EXPECT_LE(st.rel(), tol) << what;
  EXPECT_GT(st.den, 0) << what;
}


// masked_m for replay `replay` of a graph: random rows, expert replay % E empty and the next full.
std::vector<int32_t> replay_masked_m(int E, int max_m, int replay, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(0, max_m);
  std::vector<int32_t> masked_m(E);
  for (auto& m : masked_m) m = dist(rng);
  masked_m[replay % E] = 0;
  masked_m[(replay + 1) % E] = max_m;
  return masked_m;
}

// One plan of `cfg` captured in a graph and replayed three times, each with new masked_m (one
// expert empty, one full) and new activations, every output checked.
void expect_graph_replays(MaskedCase& c, const GemmConfig& cfg, std::mt19937& rng, const std::string& what) {
  MaskedGemm gemm(c.problem, c.buffers(), &cfg);
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  const CapturedGraph graph(stream, [&] { gemm.run(stream); });
  for (int replay = 0; replay < 3; ++replay) {
    const std::vector<int32_t> m = replay_masked_m(c.problem.num_experts, c.problem.max_m, replay, rng);
    c.new_activations(rng);
    c.d_m.upload(m);
    c.poison();
    graph.launch(stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_good(c.check(m), 3e-3, what + " " + std::to_string(replay));
  }
  cudaStreamDestroy(stream);
}

TEST(GemmMasked, EveryTilePath) {
  std::mt19937 rng(1234);
  // M_max not a multiple of any block: the last token block of a full expert is partial.
  MaskedCase c({5, 384, 1024, 132, 0}, rng);
  const std::vector<int32_t> masked_m = {0, 1, 17, 132, 70};
  struct Path {
    bool swap;
    int block_m, splits, block_n = 128;
  };
  for (Path p : {Path{true, 16, 1}, Path{true, 32, 1}, Path{true, 48, 1}, Path{true, 64, 1}, Path{true, 128, 1},
                 Path{true, 16, 3}, Path{true, 48, 3}, Path{true, 64, 8}, Path{true, 16, 1, 64}, Path{true, 16, 2, 64}, Path{false, 64, 1},
                 Path{false, 128, 1}, Path{false, 128, 2}, Path{false, 128, 1, 256}}) {
    GemmConfig cfg = forced(p.swap, p.block_m, p.splits);
    cfg.block_n = p.block_n;
    ErrorStats st = run_masked(c, masked_m, &cfg);
    expect_good(st, 3e-3, cfg.to_string());
    EXPECT_LE(compare_with_cpu_reference(c, masked_m), 3e-3) << cfg.to_string();
    c.new_activations(rng);
  }
}

// Tiles of 1 to 5 K blocks on every orientation (normal BM64/BM128, swap-AB 16/32/48/64/128): a tile
// shorter than the ring, a ring position carried from one short tile to the next, and split-K 2 at
// K = 640 (tiles of 2 and 3 blocks in one launch). Added with a k-block loop that kept two partial
// sums in flight (docs/gemm.md run 16), whose head and odd/even tails these shapes reach.
TEST(GemmMasked, FewKBlocksPerTile) {
  std::mt19937 rng(4321);
  for (int k : {128, 256, 384, 512, 640}) {
    MaskedCase c({3, 256, k, 132, 0}, rng);
    const std::vector<int32_t> masked_m = {1, 132, 70};
    for (auto [swap, block_m, splits, block_n] :
         {std::tuple{true, 16, 1, 128}, std::tuple{true, 32, 1, 128}, std::tuple{true, 48, 1, 128},
          std::tuple{true, 64, 1, 128}, std::tuple{true, 128, 1, 128}, std::tuple{false, 64, 1, 128}, std::tuple{false, 128, 1, 128},
          std::tuple{false, 128, k == 640 ? 2 : 1, 128}, std::tuple{false, 128, 1, 256}}) {
      GemmConfig cfg = forced(swap, block_m, splits);
      cfg.block_n = block_n;
      ErrorStats st = run_masked(c, masked_m, &cfg);
      expect_good(st, 3e-3, cfg.to_string() + " K=" + std::to_string(k));
      EXPECT_LE(compare_with_cpu_reference(c, masked_m), 3e-3) << cfg.to_string() << " K=" << k;
      c.new_activations(rng);
    }
  }
}

// Clusters of 2 (the token tile multicast to two CTAs with neighbouring weight blocks): every
// compiled cluster path, ragged experts around the token block (0, 1, 127, 128, 129 rows), a
// shallow ring that wraps often, and the heuristic's pick for big batches.
TEST(GemmMasked, ClusterPaths) {
  std::mt19937 rng(77);
  MaskedCase c({6, 512, 1024, 132, 0}, rng);
  const std::vector<int32_t> masked_m = {0, 1, 127, 128, 129, 70};
  for (auto [swap, block_m, stages] : {std::tuple{true, 64, 0}, std::tuple{true, 128, 0}, std::tuple{false, 128, 0},
                                       std::tuple{true, 64, 2}, std::tuple{false, 128, 2}}) {
    GemmConfig cfg = forced(swap, block_m, 1);
    cfg.cluster = 2;
    cfg.num_stages = stages;
    ErrorStats st = run_masked(c, masked_m, &cfg);
    expect_good(st, 3e-3, cfg.to_string());
    EXPECT_LE(compare_with_cpu_reference(c, masked_m), 3e-3) << cfg.to_string();
    c.new_activations(rng);
  }
}

// Tokens on the M side (blocks of 128 rows, two math warpgroups of 64 each): ragged experts on
// both sides of every 64-row boundary (a warpgroup's rows all past masked_m, or some of them),
// 128- and 256-column tiles, split-K, clusters, a 2-stage ring, and graph replay of the
// 256-column plan with new masked_m and new data.
TEST(GemmMasked, NormalTilesRaggedExperts) {
  std::mt19937 rng(64);
  MaskedCase c({12, 512, 512, 260, 0}, rng);
  const std::vector<int32_t> masked_m = {0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 260};
  GemmConfig wide = forced(false, 128, 1);
  wide.block_n = 256;
  GemmConfig wide_shallow = wide;
  wide_shallow.num_stages = 2;
  GemmConfig cluster = forced(false, 128, 1);
  cluster.cluster = 2;
  for (const GemmConfig& cfg : {forced(false, 128, 1), forced(false, 128, 2), wide, wide_shallow, cluster}) {
    ErrorStats st = run_masked(c, masked_m, &cfg);
    expect_good(st, 3e-3, cfg.to_string());
    EXPECT_LE(compare_with_cpu_reference(c, masked_m), 3e-3) << cfg.to_string();
    c.new_activations(rng);
  }
  expect_graph_replays(c, wide, rng, "256-column graph replay");
}

// Swap-AB tiles of 256 weight rows (two 128-row slabs per warpgroup): every token block (16, 32,
// 64), split-K, a 2-stage ring, ragged experts around each block (0, 1, 15, 16, 17, 64, 65, 132
// rows), K from one block to eight, graph replay with new masked_m and data, and the heuristic's
// rule (short K, 16-token blocks, tiles that fill a wave, N a multiple of 256, BF16 output).
TEST(GemmMasked, WideSwapTiles) {
  std::mt19937 rng(256);
  for (int k : {128, 640, 1024}) {
    MaskedCase c({8, 768, k, 132, 0}, rng);
    const std::vector<int32_t> masked_m = {0, 1, 15, 16, 17, 64, 65, 132};
    for (auto [block_m, splits, stages] : {std::tuple{16, 1, 0}, std::tuple{32, 1, 0}, std::tuple{64, 1, 0},
                                           std::tuple{16, 1, 2}, std::tuple{64, 1, 2}, std::tuple{16, 3, 0},
                                           std::tuple{32, 2, 0}}) {
      if (splits > k / 128) continue;
      GemmConfig cfg = forced(true, block_m, splits);
      cfg.block_n = 256;
      cfg.num_stages = stages;
      ErrorStats st = run_masked(c, masked_m, &cfg);
      expect_good(st, 3e-3, cfg.to_string() + " K=" + std::to_string(k));
      EXPECT_LE(compare_with_cpu_reference(c, masked_m), 3e-3) << cfg.to_string() << " K=" << k;
      c.new_activations(rng);
    }
  }
  MaskedCase c({8, 512, 1024, 64, 0}, rng);
  GemmConfig wide = forced(true, 32, 1);
  wide.block_n = 256;
  expect_graph_replays(c, wide, rng, "256-row swap-AB graph replay");
  // Which problems the heuristic gives these tiles: tests/host/test_heuristics.cu.
}

// The heuristic's configs for every expected_m (its picks: tests/host/test_heuristics.cu), each run
// with the shallowest ring, which wraps the most often, and as the heuristic's own default.
TEST(GemmMasked, HeuristicConfigsAndStages) {
  std::mt19937 rng(99);
  MaskedCase c({8, 512, 2048, 64, 8}, rng);
  std::vector<int32_t> masked_m = {3, 0, 8, 64, 1, 5, 0, 16};
  for (int expected : {0, 5, 16, 40, 64, 100}) {
    MaskedGemmProblem p = c.problem;
    p.expected_m = expected;
    GemmConfig cfg = choose_masked_config(p, query_device().num_sms);
    cfg.num_stages = 2;  // the shallowest ring wraps the most often
    expect_good(run_masked(c, masked_m, &cfg), 3e-3, cfg.to_string());
    expect_good(run_masked(c, masked_m, nullptr), 3e-3, "heuristic default");
  }
}

TEST(GemmMasked, AccuracyK7168) {
  std::mt19937 rng(7);
  MaskedCase c({3, 256, 7168, 32, 16}, rng);
  std::vector<int32_t> masked_m = {16, 32, 9};
  for (bool swap : {true, false}) {
    GemmConfig cfg = forced(swap, swap ? 16 : 64, 1);
    ErrorStats st = run_masked(c, masked_m, &cfg);
    std::printf("K=7168 random data, %s: relative Frobenius error %.3e\n", cfg.to_string().c_str(), st.rel());
    expect_good(st, 3e-3, cfg.to_string());
  }
}

// Without promotion the tensor core's accumulator keeps about 14 significant bits (DeepSeek-V3
// report): each k32 step's products are aligned to the accumulator's exponent and the bits
// below its 14th are dropped. Emulated on the unscaled sums of one token row (the scales are
// per block and would only reweight the blocks) against the exact float64 sum.
double single_level_error(const MaskedCase& c, int e, int m) {
  MaskedLayout l = c.layout;
  WeightLayout wl{c.problem.num_experts, c.problem.n, c.problem.k};
  double num = 0, den = 0;
  for (int n = 0; n < c.problem.n; ++n) {
    double acc = 0, exact = 0;
    for (int k0 = 0; k0 < c.problem.k; k0 += 32) {
      double quantum = acc > 0 ? std::ldexp(1.0, std::ilogb(acc) - 13) : 0;
      double step = 0;
      for (int i = k0; i < k0 + 32; ++i) {
        double p = fp8_e4m3_to_float(c.a[l.a_offset(e, m) + i]) * c.w.w_deq[wl.w_offset(e, n) + i];
        exact += p;
        step += quantum > 0 ? std::floor(p / quantum) * quantum : p;
      }
      acc += step;
    }
    num += (acc - exact) * (acc - exact);
    den += exact * exact;
  }
  return std::sqrt(num / den);
}

TEST(GemmMasked, AccuracyPositiveK16384) {
  std::mt19937 rng(11);
  MaskedCase c({2, 128, 16384, 16, 8}, rng, /*positive=*/true);
  std::vector<int32_t> masked_m = {8, 5};
  for (bool swap : {true, false}) {
    GemmConfig cfg = forced(swap, swap ? 16 : 64, 1);
    ErrorStats st = run_masked(c, masked_m, &cfg);
    std::printf("K=16384 all-positive data, %s: two-level relative error %.3e\n", cfg.to_string().c_str(), st.rel());
    expect_good(st, 5e-3, cfg.to_string());
  }
  double single = single_level_error(c, 0, 0);
  std::printf("K=16384 all-positive data: emulated single-level (14-bit accumulator) relative error %.3e\n", single);
  EXPECT_GT(single, 5e-3);  // the reason for two-level accumulation
}

TEST(GemmMasked, GraphReplayWithNewMaskedMAndData) {
  // The heuristic's plan (16-token tiles), and 48-token tiles with split-K (whose tile counters
  // must be back at zero for the next replay).
  std::mt19937 rng(5);
  MaskedCase c({6, 256, 1024, 48, 8}, rng);
  const GemmConfig wide_split = forced(true, 48, 2);
  for (const GemmConfig* cfg : {(const GemmConfig*)nullptr, &wide_split}) {
    std::vector<int32_t> masked_m = {4, 0, 48, 7, 1, 30};
    c.d_m.upload(masked_m);
    MaskedGemm gemm(c.problem, c.buffers(), cfg);
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
    {
      const CapturedGraph graph(stream, [&] { gemm.run(stream); });
      std::uniform_int_distribution<int> d(0, 48);
      for (int replay = 0; replay < 4; ++replay) {
        if (replay > 0) {
          for (auto& m : masked_m) m = d(rng);
          masked_m[replay] = 0;
          c.new_activations(rng);
          c.d_m.upload(masked_m);
        }
        c.poison();
        graph.launch(stream);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
        expect_good(c.check(masked_m), 3e-3, gemm.config().to_string() + ", graph replay " + std::to_string(replay));
      }
    }
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

// The previous kernel writes the GEMM's inputs and lets dependents launch at once; the GEMM,
// launched with programmatic dependent launch, must still read the new contents (its
// griddepcontrol.wait), in a graph replayed with new data.
__global__ void copy_inputs_kernel(const uint8_t* a_src, uint8_t* a, size_t a_bytes, const float* s_src, float* s,
                                   size_t s_count, const int32_t* m_src, int32_t* m, int num_m) {
  cudaTriggerProgrammaticLaunchCompletion();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < a_bytes; i += size_t(gridDim.x) * blockDim.x)
    a[i] = a_src[i];
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < s_count; i += size_t(gridDim.x) * blockDim.x)
    s[i] = s_src[i];
  if (m_src && blockIdx.x == 0 && int(threadIdx.x) < num_m) m[threadIdx.x] = m_src[threadIdx.x];
}

TEST(GemmMasked, OverlapWithPreviousKernelInGraph) {
  GemmConfig cluster = forced(true, 64, 1);  // early weights loaded by both CTAs of a cluster
  cluster.cluster = 2;
  for (auto [overlap, cfg] : {std::pair{Overlap::kPreviousKernel, (const GemmConfig*)nullptr},
                              std::pair{Overlap::kPreviousKernelStaticWeights, (const GemmConfig*)nullptr},
                              std::pair{Overlap::kPreviousKernelStaticWeights, (const GemmConfig*)&cluster}}) {
    std::mt19937 rng(8);
    MaskedCase c({4, 256, 2048, 32, 16}, rng);
    const bool copy_m = overlap == Overlap::kPreviousKernel;  // the static-weights mode promises masked_m is ready
    std::vector<int32_t> masked_m = {16, 0, 32, 3};
    c.d_m.upload(masked_m);
    DeviceBuffer<uint8_t> a_src(c.d_a.count);
    DeviceBuffer<float> s_src(c.d_as.count);
    DeviceBuffer<int32_t> m_src(c.d_m.count);
    MaskedGemm gemm(c.problem, c.buffers(), cfg);
    gemm.set_overlap(overlap);
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    copy_inputs_kernel<<<264, 256, 0, stream>>>(a_src.ptr, c.d_a.ptr, c.d_a.count, s_src.ptr, c.d_as.ptr, c.d_as.count,
                                                copy_m ? m_src.ptr : nullptr, c.d_m.ptr, 4);
    MOEKIT_CUDA_CHECK_LAUNCH();
    gemm.run(stream);
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::uniform_int_distribution<int> d(0, 32);
    for (int replay = 0; replay < 3; ++replay) {
      c.poison();
      std::vector<uint8_t> old_a = c.a;  // what the GEMM's input buffer holds before the copy
      c.a = random_fp8(c.d_a.count, rng);
      c.a_scales = random_scales(c.d_as.count, rng);
      a_src.upload(c.a);
      s_src.upload(c.a_scales);
      if (copy_m) {
        for (auto& m : masked_m) m = d(rng);
        m_src.upload(masked_m);
      }
      MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
      expect_good(c.check(masked_m), 3e-3, "overlap mode " + std::to_string(int(overlap)) + ", replay " +
                                               std::to_string(replay) + ", " + gemm.config().to_string());
      EXPECT_NE(old_a, c.a);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

TEST(GemmMasked, SplitKGraphReplayResetsCounters) {
  std::mt19937 rng(21);
  MaskedCase c({2, 256, 2048, 16, 8}, rng);
  std::vector<int32_t> masked_m = {9, 16};
  c.d_m.upload(masked_m);
  GemmConfig cfg = forced(true, 16, 4);
  MaskedGemm gemm(c.problem, c.buffers(), &cfg);
  for (int i = 0; i < 3; ++i) {
    c.new_activations(rng);
    c.poison();
    gemm.run(nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    expect_good(c.check(masked_m), 3e-3, "split-K run " + std::to_string(i));
  }
}

TEST(GemmMasked, BadArgumentsRejected) {
  std::mt19937 rng(3);
  MaskedCase c({2, 256, 256, 16, 8}, rng);
  auto make = [&](MaskedGemmProblem p, MaskedGemmBuffers b, const GemmConfig* cfg = nullptr) {
    MaskedGemm g(p, b, cfg);
  };
  MaskedGemmProblem p = c.problem;
  MaskedGemmBuffers b = c.buffers();
  EXPECT_THROW(make({2, 200, 256, 16, 8}, b), Error);   // N not a multiple of 128
  EXPECT_THROW(make({2, 256, 100, 16, 8}, b), Error);   // K not a multiple of 128
  EXPECT_THROW(make({0, 256, 256, 16, 8}, b), Error);   // no experts
  EXPECT_THROW(make({2, 256, 256, 18, 8}, b), Error);   // M_max not a multiple of 4
  MaskedGemmProblem neg = p;
  neg.last_expert_m = -1;
  expect_error([&] { make(neg, b); }, {"last_expert_m = -1", ">= 0"});
  MaskedGemmBuffers nul = b;
  nul.masked_m = nullptr;
  EXPECT_THROW(make(p, nul), Error);
  MaskedGemmBuffers mis = b;
  mis.a = b.a + 8;
  EXPECT_THROW(make(p, mis), Error);
  GemmConfig bad = forced(true, 24, 1);
  EXPECT_THROW(make(p, b, &bad), Error);  // no such instance
  GemmConfig too_split = forced(true, 16, 3);
  EXPECT_THROW(make(p, b, &too_split), Error);  // K/128 = 2 blocks cannot take 3 splits
  // Clusters: N = 256 is two weight blocks, one cluster tile; each refusal names what is wrong.
  GemmConfig cl = forced(true, 64, 1);
  cl.cluster = 2;
  EXPECT_NO_THROW(make(p, b, &cl));
  const auto refused = [&](GemmConfig cfg, MaskedGemmProblem prob, const char* needle) {
    try {
      make(prob, b, &cfg);
      ADD_FAILURE() << cfg.to_string() << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  GemmConfig cl_split = cl;
  cl_split.num_splits = 2;
  refused(cl_split, p, "num_splits = 1");
  // 256-column tiles: the normal orientation, block_m 128, single CTAs, no split-K.
  GemmConfig wide = forced(false, 128, 1);
  wide.block_n = 256;
  EXPECT_NO_THROW(make(p, b, &wide));
  GemmConfig wide_swap = forced(true, 128, 1), wide_bm64 = forced(false, 64, 1), wide_cl = wide, wide_split = wide;
  wide_swap.block_n = wide_bm64.block_n = 256;
  wide_cl.cluster = 2;
  wide_split.num_splits = 2;
  for (const GemmConfig& w : {wide_swap, wide_bm64, wide_cl, wide_split}) refused(w, p, "with block_n = 256");
  // 256-row swap-AB tiles: up to 64 tokens, single CTAs, N in whole tiles.
  GemmConfig swap_wide = forced(true, 16, 1), swap_wide_cl = forced(true, 64, 1);
  swap_wide.block_n = swap_wide_cl.block_n = 256;
  EXPECT_NO_THROW(make(p, b, &swap_wide));
  swap_wide_cl.cluster = 2;
  refused(swap_wide_cl, p, "cluster = 1 for swap-AB with block_n = 256");
  MaskedCase c384({2, 384, 256, 16, 8}, rng);
  try {
    MaskedGemm g(c384.problem, c384.buffers(), &swap_wide);
    ADD_FAILURE() << "N = 384 accepted with 256-row swap-AB tiles";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("N a multiple of 256; N = 384"), std::string::npos) << e.what();
  }
  GemmConfig cl16 = cl;
  cl16.block_m = 16;
  refused(cl16, p, "block_m in {64, 128} for swap-AB with cluster = 2");
  GemmConfig cl3 = cl;
  cl3.cluster = 3;
  refused(cl3, p, "cluster in {1, 2}");
  GemmConfig cl_ctas = cl;
  cl_ctas.num_ctas = 5;
  refused(cl_ctas, p, "num_ctas = 5 must be a multiple of cluster = 2");
  DeviceBuffer<uint8_t> w384(size_t(2) * 384 * 256);
  DeviceBuffer<float> ws384(size_t(2) * 3 * 2);
  DeviceBuffer<uint16_t> out384(size_t(2) * 16 * 384);
  MaskedGemmBuffers b384 = b;
  b384.w = w384.ptr;
  b384.w_scales = ws384.ptr;
  b384.out = out384.ptr;
  try {  // 384 output columns: three weight blocks cannot pair up
    make({2, 384, 256, 16, 8}, b384, &cl);
    ADD_FAILURE() << "N = 384 with cluster = 2 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("384 output columns"), std::string::npos) << e.what();
  }
  try {
    make({2, 256, 100, 16, 8}, b);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("K = 100"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Masked with the SiLU·up + FP8 epilogue (the fused decode pipeline's GEMM1)

// SiLU's gate table for the activation kernel, made once (kept to the process's end).
const GpuActivation& silu_activation() {
  static const gpu::ActivationTable* table = new gpu::ActivationTable(ref::Activation{});
  return table->act();
}

// The gated plan's act must be the activation kernel's output on the plain plan's BF16 gate_up,
// byte for byte, when both split K alike (the same accumulation); rows past masked_m untouched.
struct GatedCheck {
  long differ = 0, scales_differ = 0, unwritten = 0, clobbered = 0, rows = 0;
};

GatedCheck run_gated_against_staged(MaskedCase& c, const std::vector<int32_t>& masked_m, const GemmConfig& cfg,
                                    cudaStream_t stream = nullptr, int replays = 1) {
  const MaskedGemmProblem& p = c.problem;
  const int inter = p.n / 2, groups = inter / 128;
  c.d_m.upload(masked_m);
  // Staged: the plain GEMM's BF16 gate_up, then the activation kernel.
  DeviceBuffer<uint8_t> ref_act(size_t(p.num_experts) * p.max_m * inter);
  DeviceBuffer<float> ref_scales(size_t(p.num_experts) * groups * p.max_m);
  c.poison();
  MaskedGemm plain(p, c.buffers(), &cfg);
  plain.run(stream);
  gpu::launch_silu_mul_quant_masked(c.d_out.ptr, p.num_experts, p.max_m, inter, c.d_m.ptr, ref_act.ptr,
                                    ref_scales.ptr, stream, {}, silu_activation());
  // Fused: one gated GEMM.
  MaskedGemmProblem gp = p;
  gp.epilogue = GemmEpilogue::kSiluMulFp8;
  DeviceBuffer<uint8_t> act(ref_act.count);
  DeviceBuffer<float> scales(ref_scales.count);
  MaskedGemmBuffers b = c.buffers();
  b.out = nullptr;
  b.act = act.ptr;
  b.act_scales = scales.ptr;
  MaskedGemm gated(gp, b, &cfg);
  act.poison(0xFF);  // 0xFF is an e4m3 NaN: the quantisation never writes it
  scales.poison(0xFF);
  for (int i = 0; i < replays; ++i) gated.run(stream);
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = act.download(), want = ref_act.download();
  const std::vector<float> got_s = scales.download(), want_s = ref_scales.download();
  GatedCheck r;
  for (int e = 0; e < p.num_experts; ++e)
    for (int m = 0; m < p.max_m; ++m) {
      const bool real = m < masked_m[e];
      r.rows += real;
      for (int j = 0; j < inter; ++j) {
        const uint8_t g = got[(size_t(e) * p.max_m + m) * inter + j];
        if (!real) {
          r.clobbered += g != 0xFF;
          continue;
        }
        r.unwritten += g == 0xFF;
        r.differ += g != want[(size_t(e) * p.max_m + m) * inter + j];
      }
      for (int gi = 0; gi < groups; ++gi) {
        const size_t i = (size_t(e) * groups + gi) * p.max_m + m;
        uint32_t bits;
        std::memcpy(&bits, &got_s[i], 4);
        if (!real) {
          r.clobbered += bits != 0xFFFFFFFFu;
          continue;
        }
        r.scales_differ += std::memcmp(&got_s[i], &want_s[i], 4) != 0;
      }
    }
  return r;
}

void expect_same_as_staged(const GatedCheck& r, const std::string& what) {
  EXPECT_GT(r.rows, 0) << what;
  EXPECT_EQ(r.unwritten, 0) << what;
  EXPECT_EQ(r.clobbered, 0) << what;
  EXPECT_EQ(r.differ, 0) << what;
  EXPECT_EQ(r.scales_differ, 0) << what;
}

TEST(GemmGated, EveryTilePathEqualsStaged) {
  std::mt19937 rng(4321);
  // inter = 384 (three act groups), M_max not a multiple of any block, ragged experts.
  MaskedCase c({6, 768, 1024, 132, 0}, rng);
  const std::vector<int32_t> masked_m = {0, 1, 17, 132, 70, 129};
  for (int block_m : {16, 32, 64})
    for (int splits : {1, 3}) {
      const GemmConfig cfg = forced(true, block_m, splits);
      expect_same_as_staged(run_gated_against_staged(c, masked_m, cfg), "gated " + cfg.to_string());
      c.new_activations(rng);
    }
}

TEST(GemmGated, HeuristicAndK7168) {
  std::mt19937 rng(77);
  MaskedCase c({4, 512, 7168, 64, 0}, rng);
  const std::vector<int32_t> masked_m = {5, 64, 0, 33};
  for (int expected : {1, 20, 64, 200}) {
    MaskedGemmProblem gp = c.problem;
    gp.expected_m = expected;
    gp.epilogue = GemmEpilogue::kSiluMulFp8;
    const GemmConfig cfg = choose_masked_config(gp, query_device().num_sms);
    EXPECT_TRUE(cfg.swap_ab && cfg.block_m <= 64) << cfg.to_string();
    expect_same_as_staged(run_gated_against_staged(c, masked_m, cfg), "heuristic " + cfg.to_string());
  }
}

// Split-K counters reset by the last split, so repeated runs (as in a replayed graph) stay right.
TEST(GemmGated, SplitKRepeatedRuns) {
  std::mt19937 rng(88);
  MaskedCase c({2, 256, 2048, 16, 8}, rng);
  expect_same_as_staged(run_gated_against_staged(c, {9, 16}, forced(true, 16, 4), nullptr, 3), "split-K x3");
}

TEST(GemmGated, GraphReplayWithNewMaskedMAndData) {
  std::mt19937 rng(55);
  MaskedCase c({5, 512, 1024, 40, 8}, rng);
  const MaskedGemmProblem& p = c.problem;
  const int inter = p.n / 2;
  MaskedGemmProblem gp = p;
  gp.epilogue = GemmEpilogue::kSiluMulFp8;
  DeviceBuffer<uint8_t> act(size_t(p.num_experts) * p.max_m * inter), ref_act(act.count);
  DeviceBuffer<float> scales(size_t(p.num_experts) * (inter / 128) * p.max_m), ref_scales(scales.count);
  MaskedGemmBuffers b = c.buffers();
  b.out = nullptr, b.act = act.ptr, b.act_scales = scales.ptr;
  MaskedGemm gated(gp, b);
  gated.set_overlap(Overlap::kPreviousKernel);
  MaskedGemm plain(p, c.buffers(), &gated.config());
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  gated.run(stream);
  MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::uniform_int_distribution<int> d(0, 40);
  std::vector<int32_t> masked_m(p.num_experts);
  for (int replay = 0; replay < 3; ++replay) {
    for (auto& m : masked_m) m = d(rng);
    masked_m[replay] = 0;
    c.new_activations(rng);
    c.d_m.upload(masked_m);
    act.poison(0xFF);
    MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    plain.run(stream);
    gpu::launch_silu_mul_quant_masked(c.d_out.ptr, p.num_experts, p.max_m, inter, c.d_m.ptr, ref_act.ptr,
                                      ref_scales.ptr, stream, {}, silu_activation());
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<uint8_t> got = act.download(), want = ref_act.download();
    long differ = 0, unwritten = 0;
    for (int e = 0; e < p.num_experts; ++e)
      for (int m = 0; m < masked_m[e]; ++m)
        for (int j = 0; j < inter; ++j) {
          const size_t i = (size_t(e) * p.max_m + m) * inter + j;
          differ += got[i] != want[i];
          unwritten += got[i] == 0xFF;
        }
    EXPECT_EQ(differ, 0) << "replay " << replay;
    EXPECT_EQ(unwritten, 0) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(GemmGated, BadArgumentsRejected) {
  std::mt19937 rng(6);
  MaskedCase c({2, 384, 256, 16, 8}, rng);
  DeviceBuffer<uint8_t> act(size_t(2) * 16 * 192);
  DeviceBuffer<float> scales(64);
  MaskedGemmBuffers b = c.buffers();
  b.act = act.ptr, b.act_scales = scales.ptr;
  MaskedGemmProblem p = c.problem;
  p.epilogue = GemmEpilogue::kSiluMulFp8;
  auto message = [&](MaskedGemmProblem q, MaskedGemmBuffers bb, const GemmConfig* cfg) -> std::string {
    try {
      MaskedGemm g(q, bb, cfg);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  // N = 384 is 2 x 192: inter is not a multiple of 128.
  EXPECT_NE(message(p, b, nullptr).find("N = 384"), std::string::npos);
  p.n = 512;
  MaskedGemmBuffers no_act = b;
  no_act.act = nullptr;
  EXPECT_NE(message(p, no_act, nullptr).find("act is null"), std::string::npos);
  const GemmConfig wide = forced(true, 128, 1);
  EXPECT_NE(message(p, b, &wide).find("block_m in {16, 32, 64}"), std::string::npos);
  const GemmConfig normal = forced(false, 64, 1);
  EXPECT_NE(message(p, b, &normal).find("swap-AB"), std::string::npos);
  GemmConfig cluster = forced(true, 64, 1);
  cluster.cluster = 2;
  EXPECT_NE(message(p, b, &cluster).find("cluster = 1 for the SiLU"), std::string::npos);
}

// GEMM1 (gated, signalling each stored tile) -> GEMM2 (waiting per expert, PDL) as a decode step
// runs them, captured once and replayed with new masked_m and activations: GEMM2's output equals,
// byte for byte, the same GEMM2 config run after the whole of GEMM1 had finished, no real row is
// left unwritten, and the counters are back at zero after every replay (the waiting GEMM's last CTA
// resets them). GEMM1 with and without split-K (only the storing split signals), 16- and 32-token
// tiles, ragged experts and experts without rows.
TEST(GemmExpertReady, PairInGraphEqualsGridWait) {
  std::mt19937 rng(2024);
  const int E = 6, inter = 384, d = 512, max_m = 40;
  MaskedCase c1({E, 2 * inter, 1024, max_m, 8}, rng);
  Operands w2 = make_weights(E, d, inter, rng);
  DeviceBuffer<uint8_t> d_w2(w2.w.size());
  DeviceBuffer<float> d_w2s(w2.w_scales.size());
  d_w2.upload(w2.w);
  d_w2s.upload(w2.w_scales);
  DeviceBuffer<uint8_t> act(size_t(E) * max_m * inter), ref_act(act.count);
  DeviceBuffer<float> act_s(size_t(E) * (inter / 128) * max_m), ref_act_s(act_s.count);
  DeviceBuffer<uint16_t> out(size_t(E) * max_m * d), ref_out(out.count);
  DeviceBuffer<int32_t> ready(E + 1);
  MOEKIT_CUDA_CHECK(cudaMemset(ready.ptr, 0, sizeof(int32_t) * (E + 1)));
  MaskedGemmProblem p1 = c1.problem;
  p1.epilogue = GemmEpilogue::kSiluMulFp8;
  const MaskedGemmProblem p2{E, d, inter, max_m, 8};
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  GemmConfig wide2 = forced(true, 16, 1);  // GEMM2 in 256-row swap-AB tiles
  wide2.block_n = 256;
  for (auto [cfg1, cfg2] : {std::pair{forced(true, 16, 1), (const GemmConfig*)nullptr},
                            std::pair{forced(true, 32, 2), (const GemmConfig*)nullptr},
                            std::pair{forced(true, 16, 1), (const GemmConfig*)&wide2}}) {
    MaskedGemmBuffers b1 = c1.buffers();
    b1.out = nullptr, b1.act = act.ptr, b1.act_scales = act_s.ptr, b1.ready_out = ready.ptr;
    MaskedGemm g1(p1, b1, &cfg1);
    g1.set_overlap(Overlap::kPreviousKernel);
    MaskedGemmBuffers b2{act.ptr, act_s.ptr, d_w2.ptr, d_w2s.ptr, c1.d_m.ptr, out.ptr};
    b2.ready_in = ready.ptr;
    MaskedGemm g2(p2, b2, cfg2);
    g2.set_overlap(Overlap::kPreviousGemmPerExpert);
    // The reference: the same configs, GEMM2 started after GEMM1 completed.
    MaskedGemmBuffers r1 = b1;
    r1.act = ref_act.ptr, r1.act_scales = ref_act_s.ptr, r1.ready_out = nullptr;
    MaskedGemm g1_ref(p1, r1, &cfg1);
    MaskedGemm g2_ref(p2, MaskedGemmBuffers{ref_act.ptr, ref_act_s.ptr, d_w2.ptr, d_w2s.ptr, c1.d_m.ptr, ref_out.ptr},
                      &g2.config());
    const CapturedGraph graph(stream, [&] {
      g1.run(stream);
      g2.run(stream);
    });
    for (int replay = 0; replay < 4; ++replay) {
      const std::vector<int32_t> masked_m = replay_masked_m(E, max_m, replay, rng);
      c1.new_activations(rng);
      c1.d_m.upload(masked_m);
      out.poison(0xFF);
      graph.launch(stream);
      g1_ref.run(stream);
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
      g2_ref.run(stream);
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> got = out.download(), want = ref_out.download();
      long differ = 0, unwritten = 0;
      for (int e = 0; e < E; ++e)
        for (int m = 0; m < masked_m[e]; ++m)
          for (int j = 0; j < d; ++j) {
            const size_t i = (size_t(e) * max_m + m) * d + j;
            differ += got[i] != want[i];
            unwritten += got[i] == 0xFFFF;
          }
      const std::string what =
          cfg1.to_string() + " then " + g2.config().to_string() + " replay " + std::to_string(replay);
      EXPECT_EQ(differ, 0) << what;
      EXPECT_EQ(unwritten, 0) << what;
      for (int32_t v : ready.download()) EXPECT_EQ(v, 0) << what << ": counters not reset";
    }
  }
  cudaStreamDestroy(stream);
}

// kDispatchPerExpert (the EP receive's hand-off, gemm.h): a one-CTA kernel stands in for the
// receive. It lets the GEMM be scheduled at once (PDL trigger first), then writes masked_m and
// publishes it, and copies the experts' rows and scales into the GEMM's inputs one expert at a
// time, last expert first, with a pause before each, counting each expert's rows in (release).
// The GEMM, resident meanwhile, must give the bits of a plain run on the same inputs, write
// nothing past masked_m, and leave all E + 2 counters at zero, replay after replay of one graph;
// also when it walks the last expert first and asks the L2 for its weights while it waits
// (set_last_expert_first, the fused layer's merged shared expert).
__global__ void land_rows_kernel(const uint8_t* a, const float* a_scales, const int32_t* masked_m, uint8_t* a_dst,
                                 float* a_scales_dst, int32_t* m_dst, int32_t* ready, int E, int max_m, int k,
                                 int abort_at = -1) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  for (int e = threadIdx.x; e < E; e += blockDim.x) m_dst[e] = masked_m[e];
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicExch(ready + E + 1, 1);
  }
  const int kb = k / 128;
  for (int e = E - 1; e >= 0; --e) {
    __nanosleep(2000);  // the experts land one by one while the GEMM waits for them
    if (e == abort_at) {  // a timed-out receive: the rest never land
      if (threadIdx.x == 0) atomicOr(ready + E + 1, kRowsReadyAbort);
      return;
    }
    const int m = masked_m[e];
    for (size_t i = threadIdx.x; i < size_t(m) * k; i += blockDim.x) a_dst[size_t(e) * max_m * k + i] = a[size_t(e) * max_m * k + i];
    for (int i = threadIdx.x; i < kb * m; i += blockDim.x) {
      const size_t at = (size_t(e) * kb + i / m) * max_m + i % m;
      a_scales_dst[at] = a_scales[at];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(ready + e, m);
    }
  }
}

// The hand-off tests' rig: staging inputs (c), the GEMM's own inputs that land_rows_kernel copies
// them into, the counters, and GEMMs on those inputs that wait per expert.
struct LandingRig {
  static constexpr int E = 5, n = 256, k = 512, max_m = 40;
  MaskedCase c;
  DeviceBuffer<uint8_t> a;
  DeviceBuffer<float> a_s;
  DeviceBuffer<int32_t> m, ready;
  DeviceBuffer<uint16_t> out;
  cudaStream_t stream = nullptr;
  explicit LandingRig(std::mt19937& rng)
      : c({E, n, k, max_m, 8}, rng), a(c.d_a.count), a_s(c.d_as.count), m(E), ready(E + 2), out(c.d_out.count) {
    MOEKIT_CUDA_CHECK(cudaMemset(ready.ptr, 0, sizeof(int32_t) * (E + 2)));
    MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  }
  ~LandingRig() { cudaStreamDestroy(stream); }
  std::unique_ptr<MaskedGemm> waiting_gemm(const GemmConfig& cfg, bool last_first = false) {
    MaskedGemmBuffers b{a.ptr, a_s.ptr, c.d_w.ptr, c.d_ws.ptr, m.ptr, out.ptr};
    b.ready_in = ready.ptr;
    auto g = std::make_unique<MaskedGemm>(c.problem, b, &cfg);
    g->set_last_expert_first(last_first);  // (before or after set_overlap: either keeps the other)
    g->set_overlap(Overlap::kDispatchPerExpert);
    return g;
  }
  void land(int abort_at = -1) {
    land_rows_kernel<<<1, 256, 0, stream>>>(c.d_a.ptr, c.d_as.ptr, c.d_m.ptr, a.ptr, a_s.ptr, m.ptr, ready.ptr, E,
                                            max_m, k, abort_at);
    MOEKIT_CUDA_CHECK(cudaGetLastError());
  }
};

TEST(GemmDispatchReady, RowsAsTheyLandEqualAPlainRun) {
  std::mt19937 rng(77);
  LandingRig rig(rng);
  constexpr int E = LandingRig::E, n = LandingRig::n, max_m = LandingRig::max_m;
  MaskedCase& c = rig.c;
  DeviceBuffer<uint8_t>& a = rig.a;
  DeviceBuffer<float>& a_s = rig.a_s;
  DeviceBuffer<int32_t>& ready = rig.ready;
  DeviceBuffer<uint16_t>& out = rig.out;
  cudaStream_t stream = rig.stream;
  GemmConfig wide16 = forced(true, 16, 1), wide32 = forced(true, 32, 2);  // 256-row swap-AB tiles
  wide16.block_n = wide32.block_n = 256;
  for (const bool last_first : {false, true}) {
    for (const GemmConfig cfg : {forced(true, 16, 1), forced(true, 32, 2), forced(false, 128, 1), wide16, wide32}) {
      const auto g = rig.waiting_gemm(cfg, last_first);
      MaskedGemm plain(c.problem, c.buffers(), &cfg);  // on the staging inputs, after they are written
      const CapturedGraph graph(stream, [&] {
        rig.land();
        g->run(stream);
      });
      for (int replay = 0; replay < 3; ++replay) {
        const std::vector<int32_t> masked_m = replay_masked_m(E, max_m, replay, rng);
        c.new_activations(rng);
        c.d_m.upload(masked_m);
        a.poison(0x7F);  // NaN in e4m3: a row read before it landed shows in the output
        a_s.poison(0x7F);
        out.poison(0xFF);
        c.poison();
        graph.launch(stream);
        plain.run(stream);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
        const std::vector<uint16_t> got = out.download(), want = c.d_out.download();
        long differ = 0, unwritten = 0, past = 0;
        for (int e = 0; e < E; ++e)
          for (int r = 0; r < max_m; ++r)
            for (int j = 0; j < n; ++j) {
              const size_t i = (size_t(e) * max_m + r) * n + j;
              if (r < masked_m[e]) {
                differ += got[i] != want[i];
                unwritten += got[i] == 0xFFFF;
              } else {
                past += got[i] != 0xFFFF;
              }
            }
        const std::string what =
            cfg.to_string() + (last_first ? " last expert first" : "") + " replay " + std::to_string(replay);
        EXPECT_EQ(differ, 0) << what;
        EXPECT_EQ(unwritten, 0) << what;
        EXPECT_EQ(past, 0) << what << ": rows past masked_m written";
        for (int32_t v : ready.download()) EXPECT_EQ(v, 0) << what << ": counters not reset";
      }
    }
  }
  // The mode needs the counters.
  MaskedGemm no_ready(c.problem, c.buffers());
  EXPECT_THROW(no_ready.set_overlap(Overlap::kDispatchPerExpert), Error);
}

// The receive's abort (gemm.h kRowsReadyAbort): experts 4 and 3 land, then the stand-in raises
// the abort bit instead of landing the rest. The GEMM must end (not spin until its trap), the
// landed experts' outputs be those of a plain run, and every counter be zero afterwards; the next
// replay without the abort is whole again.
TEST(GemmDispatchReady, AnAbortEndsTheWaits) {
  std::mt19937 rng(78);
  LandingRig rig(rng);
  constexpr int E = LandingRig::E, n = LandingRig::n, max_m = LandingRig::max_m;
  GemmConfig wide = forced(true, 16, 1);
  wide.block_n = 256;
  for (const GemmConfig cfg : {forced(true, 16, 1), forced(true, 32, 2), wide}) {
    const auto g = rig.waiting_gemm(cfg);
    MaskedGemm plain(rig.c.problem, rig.c.buffers(), &cfg);
    for (int abort_at : {2, -1}) {
      const CapturedGraph graph(rig.stream, [&] {
        rig.land(abort_at);
        g->run(rig.stream);
      });
      std::vector<int32_t> masked_m = {7, 40, 0, 13, 40};
      rig.c.new_activations(rng);
      rig.c.d_m.upload(masked_m);
      rig.out.poison(0xFF);
      rig.c.poison();
      graph.launch(rig.stream);
      plain.run(rig.stream);
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(rig.stream));
      const std::vector<uint16_t> got = rig.out.download(), want = rig.c.d_out.download();
      long differ = 0;
      for (int e = abort_at + 1; e < E; ++e)
        for (int r = 0; r < masked_m[e]; ++r)
          for (int j = 0; j < n; ++j) {
            const size_t i = (size_t(e) * max_m + r) * n + j;
            differ += got[i] != want[i];
          }
      const std::string what = cfg.to_string() + (abort_at >= 0 ? " aborted" : " whole");
      EXPECT_EQ(differ, 0) << what << ": the experts that landed";
      for (int32_t v : rig.ready.download()) EXPECT_EQ(v, 0) << what << ": counters not reset";
    }
  }
}

TEST(GemmExpertReady, BadArgumentsRejected) {
  std::mt19937 rng(9);
  MaskedCase c({2, 256, 256, 16, 8}, rng);
  DeviceBuffer<int32_t> ready(3);
  auto message = [&](auto&& make) -> std::string {
    try {
      make();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message([&] {
              MaskedGemm g(c.problem, c.buffers());
              g.set_overlap(Overlap::kPreviousGemmPerExpert);
            }).find("kPreviousGemmPerExpert needs ready_in"),
            std::string::npos);
  MaskedGemmBuffers same = c.buffers();
  same.ready_in = same.ready_out = ready.ptr;
  EXPECT_NE(message([&] { MaskedGemm g(c.problem, same); }).find("ready_in and ready_out are the same"),
            std::string::npos);
  EXPECT_NE(message([&] {
              MaskedGemm g(c.problem, c.buffers());
              g.set_early_trigger(true);
            }).find("set_early_trigger needs ready_out"),
            std::string::npos);
  MaskedGemmBuffers signals = c.buffers();
  signals.ready_out = ready.ptr;
  MaskedGemm g(c.problem, signals);
  EXPECT_NO_THROW(g.set_early_trigger(true));
  EXPECT_NO_THROW(g.set_early_trigger(false));
}

// ---------------------------------------------------------------------------------------------
// Contiguous

// One contiguous GEMM of ragged, padded expert segments against the float64 oracle and the CPU
// reference, for each config (N: output columns; clusters need an even number of weight blocks).
void check_contiguous_segments(int N, std::vector<GemmConfig> configs, std::mt19937& rng) {
  const int E = 4, K = 2048;
  const std::vector<int> seg_rows = {130, 0, 7, 256};  // real rows per expert
  std::vector<int32_t> row_expert;
  for (int e = 0; e < E; ++e) {
    int padded = (seg_rows[e] + kContiguousAlign - 1) / kContiguousAlign * kContiguousAlign;
    for (int r = 0; r < padded; ++r) row_expert.push_back(r < seg_rows[e] ? e : -1);
  }
  row_expert.insert(row_expert.end(), kContiguousAlign, -1);  // a trailing all-padding segment
  const int total = int(row_expert.size());
  Operands w = make_weights(E, N, K, rng);
  ContiguousLayout l{total, K};
  DeviceBuffer<uint8_t> d_a(l.a_elems()), d_w(w.w.size());
  DeviceBuffer<float> d_as(l.scale_elems()), d_ws(w.w_scales.size());
  DeviceBuffer<int32_t> d_re(total);
  DeviceBuffer<uint16_t> d_out(size_t(total) * N);
  d_w.upload(w.w);
  d_ws.upload(w.w_scales);
  d_re.upload(row_expert);
  for (const GemmConfig& cfg : configs) {
    std::vector<uint8_t> a = random_fp8(l.a_elems(), rng);
    std::vector<float> as = random_scales(l.scale_elems(), rng);
    d_a.upload(a);
    d_as.upload(as);
    MOEKIT_CUDA_CHECK(cudaMemset(d_out.ptr, 0xFF, d_out.count * 2));
    ContiguousGemm gemm({E, N, K, total}, {d_a.ptr, d_as.ptr, d_re.ptr, d_w.ptr, d_ws.ptr, d_out.ptr}, &cfg);
    gemm.run(nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> out = d_out.download();
    ErrorStats st;
    std::vector<double> ref;
    for (int m = 0; m < total; ++m) {
      if (row_expert[m] < 0) {
        st.check_untouched(&out[size_t(m) * N], N);
        continue;
      }
      reference_row(w, row_expert[m], &a[l.a_offset(m)], [&](int kb) { return double(as[l.scale_offset(m, kb)]); }, ref);
      st.add_row(&out[size_t(m) * N], ref);
    }
    expect_good(st, 3e-3, gemm.config().to_string());
    std::vector<uint16_t> cpu(out.size(), kPoison);
    WeightLayout wl{E, N, K};
    ref::grouped_gemm_contiguous(l, a.data(), as.data(), row_expert.data(), wl, w.w.data(), w.w_scales.data(),
                                 cpu.data());
    double sq = 0;
    for (uint16_t v : cpu) sq += row_expert.empty() || v == kPoison ? 0 : double(bf16_to_float(v)) * bf16_to_float(v);
    // Both apply the same fp32 order of operations and round to bf16; they differ by the tensor
    // core's partial sums, which keep fewer bits than an exact sum: a bf16 ulp or two on most
    // elements, and near-zero outputs (cancellation) an absolute error up to about 1.3e-3 of
    // the RMS output (seen on the H200, run 5). Tolerance: 4e-3 RMS + two bf16 ulps.
    const double rms = std::sqrt(sq / double(cpu.size()));
    long differ = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const double r = bf16_to_float(cpu[i]);
      const bool bad = (out[i] == kPoison) != (cpu[i] == kPoison) ||
                       std::fabs(bf16_to_float(out[i]) - r) > 4e-3 * rms + std::ldexp(std::fabs(r), -6);
      if (bad && ++differ <= 5) {
        const int m = int(i / N), n = int(i % N);
        reference_row(w, row_expert[m], &a[l.a_offset(m)], [&](int kb) { return double(as[l.scale_offset(m, kb)]); },
                      ref);
        std::printf("  differs: row %d (expert %d) col %d: gpu %.6g (0x%04x), cpu reference %.6g (0x%04x), float64 %.6g, "
                    "rms %.3g\n",
                    m, row_expert[m], n, bf16_to_float(out[i]), out[i], r, cpu[i], ref[n], rms);
      }
    }
    EXPECT_EQ(differ, 0) << "elements further from the CPU reference than the tensor core's precision explains";
  }
  EXPECT_THROW(ContiguousGemm({E, N, K, 100}, {d_a.ptr, d_as.ptr, d_re.ptr, d_w.ptr, d_ws.ptr, d_out.ptr}), Error);
  EXPECT_THROW(ContiguousGemm({E, N, K, total}, {d_a.ptr, d_as.ptr, nullptr, d_w.ptr, d_ws.ptr, d_out.ptr}), Error);
  if (N % 256 != 0) {  // an odd number of weight blocks cannot pair up in clusters
    GemmConfig cl = forced(false, 128, 1);
    cl.cluster = 2;
    SCOPED_TRACE("N = " + std::to_string(N) + " with cluster = 2");
    expect_error([&] { ContiguousGemm g({E, N, K, total}, {d_a.ptr, d_as.ptr, d_re.ptr, d_w.ptr, d_ws.ptr, d_out.ptr}, &cl); },
                 {std::to_string(N) + " output columns"});
  }
}

// Also on 2 CTAs, each walking many tiles, so that every warp's staging rows and the ring are reused
// from tile to tile, through tiles with and without padding rows.
TEST(GemmContiguous, SegmentsWithPadding) {
  std::mt19937 rng(42);
  GemmConfig few = forced(false, 128, 1);
  few.num_ctas = 2;
  check_contiguous_segments(384, {forced(false, 64, 1), forced(false, 128, 1), few}, rng);
}

// 256-column tiles: two 128-column halves promoted one after the other with their own scale
// blocks; where N is an odd multiple of 128 (384, 640) the last tile of each expert has its
// second half entirely past N, which must be neither stored nor scaled from past the expert's
// scales. Also a 2-stage ring, and the configs that are refused.
TEST(GemmContiguous, WideColumnTiles) {
  std::mt19937 rng(44);
  GemmConfig wide = forced(false, 128, 1);
  wide.block_n = 256;
  GemmConfig shallow = wide;
  shallow.num_stages = 2;
  GemmConfig few = wide;  // 3 CTAs walk every tile: staging rows and ring reused from tile to tile
  few.num_ctas = 3;
  check_contiguous_segments(384, {wide}, rng);
  check_contiguous_segments(512, {wide, shallow, few}, rng);
  check_contiguous_segments(640, {wide, few}, rng);
  // Only BM 128 in single CTAs without split-K has wide tiles; the rest is refused, naming it.
  GemmConfig bm64 = wide;
  bm64.block_m = 64;
  GemmConfig clustered = wide;
  clustered.cluster = 2;
  GemmConfig split = wide;
  split.num_splits = 2;
  DeviceBuffer<uint8_t> a(size_t(256) * 256), w(size_t(256) * 256);
  DeviceBuffer<float> as(2 * 256), ws(2 * 2);
  DeviceBuffer<int32_t> re(256);
  DeviceBuffer<uint16_t> out(size_t(256) * 256);
  for (const GemmConfig& bad : {bm64, clustered, split}) {
    SCOPED_TRACE(bad.to_string());
    expect_error([&] { ContiguousGemm g({1, 256, 256, 256}, {a.ptr, as.ptr, re.ptr, w.ptr, ws.ptr, out.ptr}, &bad); },
                 {"with block_n = 256"});
  }
}

// The token tile multicast to clusters of 2; a two-stage ring wraps every other block.
TEST(GemmContiguous, ClusterSegmentsWithPadding) {
  std::mt19937 rng(43);
  GemmConfig cl = forced(false, 128, 1);
  cl.cluster = 2;
  GemmConfig cl_shallow = cl;
  cl_shallow.num_stages = 2;
  GemmConfig cl_few = cl;
  cl_few.num_ctas = 2;  // one cluster walks every tile
  check_contiguous_segments(512, {cl, cl_shallow, cl_few}, rng);
}

}  // namespace
}  // namespace moekit
