// GPU tests of the MXFP4 grouped GEMM (gemm.h with WeightFormat::kMxfp4, gemm_mxfp4.cuh):
//  - the on-chip widening (mxfp4_convert.cuh) for every code and every shift, against the
//    format's definition written here (the e2m1 table and ldexp);
//  - the GEMM against a float64 product of the dequantised operands, for every tile path, split-K,
//    bias, scale spreads that take the rounded (deep-shift) path, graph replay with new masked_m
//    and data, the contiguous layout with padding, and bad arguments; each with the weights widened
//    in the math threads' registers (gemm_mxfp4.cuh) and by one or two widening warpgroups in shared
//    memory (gemm_mxfp4_widen.cuh, GemmConfig::mxfp4_widen_wgs); contiguous plans also through an
//    FP8 copy of the weights (GemmConfig::mxfp4_fp8_copy, mxfp4_fp8_copy.cuh), replayed in a graph
//    with new weights.
// Operands are fresh random draws; outputs are poisoned with a BF16 NaN first, so an unwritten
// element fails, and padding rows must keep the poison.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "device_buffer.h"
#include "expect_error.h"
#include "gemm_operands.h"
#include "kernels/cuda/mxfp4_convert.cuh"
#include "moekit/bf16.h"
#include "moekit/cuda_check.h"
#include "moekit/cuda_graph.h"
#include "moekit/fp8.h"
#include "moekit/gemm.h"
#include "moekit/layout.h"
#include "moekit/mxfp4.h"

namespace moekit {
namespace {

constexpr double kE2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};  // the format's magnitudes

// A forced swap-AB config of the MXFP4 kernels; widen: GemmConfig::mxfp4_widen_wgs (0 in registers,
// 1 or 2 widening warpgroups).
GemmConfig forced_mx(int block_m, int splits, int widen) {
  GemmConfig c = forced(true, block_m, splits);
  c.mxfp4_widen_wgs = widen;
  return c;
}
std::string widen_name(int widen) { return " widen_wgs=" + std::to_string(widen); }
// The widenings compiled for masked tiles of block_m tokens: two warpgroups only up to 64 tokens.
std::vector<int> widenings(int block_m) { return block_m <= 64 ? std::vector<int>{0, 1, 2} : std::vector<int>{0, 1}; }

// ---------------------------------------------------------------------------------------------
// The widening, code by code

__global__ void widen_all(uint8_t* out) {  // out[field * 16 + code], field = shift + 13 in [0, 19]
  const int field = blockIdx.x;
  const int code = threadIdx.x;  // 0..15
  const uint2 table = mxfp4_detail::e4m3_table(field);
  // `code` as value (code % 8) of a word of eight values (mxfp4.h's encoding), the others +0.
  const int v = code % 8;
  uint32_t word = uint32_t(code & 7) << (4 * v);
  if (code & 8) word |= 1u << (v < 4 ? 8 * v + 7 : 8 * (v - 4) + 3);
  const uint2 e4m3 = mxfp4_detail::e2m1x8_to_e4m3(word, table);
  out[blockIdx.x * 16 + code] = uint8_t((v < 4 ? e4m3.x : e4m3.y) >> (8 * (v % 4)));
  for (int j = 0; j < 8; ++j)  // the other seven values must read +0
    if (j != v && uint8_t((j < 4 ? e4m3.x : e4m3.y) >> (8 * (j % 4))) != 0) out[blockIdx.x * 16 + code] = 0x7F;
}

TEST(Mxfp4Widening, EveryCodeAndShiftAgainstTheDefinition) {
  const int fields = 20;  // shifts -13 .. 6
  DeviceBuffer<uint8_t> d(fields * 16);
  widen_all<<<fields, 16>>>(d.ptr);
  MOEKIT_CUDA_CHECK(cudaGetLastError());
  const std::vector<uint8_t> got = d.download();
  for (int field = 0; field < fields; ++field)
    for (int code = 0; code < 16; ++code) {
      const int shift = field - kGemmShiftBias;
      const double want = (code & 8 ? -1 : 1) * std::ldexp(kE2m1[code & 7], shift);
      const uint8_t byte = got[field * 16 + code];
      ASSERT_NE(byte & 0x7F, 0x7F) << "code " << code << " shift " << shift << ": NaN or a neighbour not +0";
      const double v = fp8_e4m3_to_float(byte);
      if (shift >= -8) {
        EXPECT_EQ(v, want) << "code " << code << " shift " << shift << ": must be exact";
      } else {  // below e4m3's subnormal grid (2^-9): the nearest grid point
        EXPECT_LE(std::fabs(v - want), std::ldexp(1.0, -10)) << "code " << code << " shift " << shift;
      }
      if (shift == -kGemmShiftBias) EXPECT_EQ(v, 0.0) << "the clamp: every value rounds to 0";
      if (code == 8) EXPECT_TRUE(std::signbit(v)) << "-0 keeps its sign";
    }
}

// ---------------------------------------------------------------------------------------------
// The GEMM

// FP8 activation rows of k values as an MXFP4 GEMM reads them: in its K order (mxfp4.h; the
// references below take the natural order).
std::vector<uint8_t> in_gemm_k_order(const std::vector<uint8_t>& a, int k) {
  std::vector<uint8_t> out(a.size());
  mxfp4_permute_k(a.data(), int64_t(a.size() / k), k, out.data());
  return out;
}

// MXFP4 weights with random codes and scale bytes in [lo, hi]; the last `zero_groups` groups of
// every row hold only zeros (+0 and -0 codes) with scale byte 127, as the loader pads K.
struct Weights {
  Mxfp4WeightLayout layout;
  std::vector<uint8_t> codes, scales, gemm_codes;
  std::vector<uint32_t> gemm_scales;
  std::vector<float> bias;
  std::vector<double> deq;  // [E, N, K], the exact weight values
  Weights(int e, int n, int k, int lo, int hi, std::mt19937& rng, int zero_groups = 0) : layout{e, n, k} {
    codes.resize(layout.w_bytes());
    scales.resize(layout.scale_elems());
    std::uniform_int_distribution<int> byte(0, 255), sc(lo, hi);
    for (auto& c : codes) c = uint8_t(byte(rng));
    for (auto& s : scales) s = uint8_t(sc(rng));
    const int groups = k / kMxfp4Group;
    for (int ex = 0; ex < e; ++ex)
      for (int r = 0; r < n; ++r)
        for (int g = groups - zero_groups; g < groups; ++g) {
          scales[layout.scale_offset(ex, r) + g] = kMxfp4UnitScale;
          for (int b = 0; b < kMxfp4Group / 2; ++b) codes[layout.w_offset(ex, r) + g * kMxfp4Group / 2 + b] = b % 2 ? 0x88 : 0;
        }
    gemm_codes.resize(codes.size());
    mxfp4_codes_for_gemm(layout, codes.data(), gemm_codes.data());
    gemm_scales.resize(scales.size() / 4);
    mxfp4_scales_for_gemm(layout, codes.data(), scales.data(), gemm_scales.data());
    std::uniform_real_distribution<float> b(-4.0f, 4.0f);
    bias.resize(size_t(e) * n);
    for (auto& x : bias) x = b(rng);
    deq.resize(size_t(e) * n * k);
    for (int ex = 0; ex < e; ++ex)
      for (int r = 0; r < n; ++r)
        for (int i = 0; i < k; ++i) {
          const uint8_t byte_i = codes[layout.w_offset(ex, r) + i / 2];
          const int code = i % 2 ? byte_i >> 4 : byte_i & 0xF;
          const int s = scales[layout.scale_offset(ex, r) + i / kMxfp4Group];
          deq[(size_t(ex) * n + r) * k + i] = (code & 8 ? -1 : 1) * std::ldexp(kE2m1[code & 7], s - 127);
        }
  }
};

// out[n] of one token: sum over K blocks of a_scale(kb) · dot(a, w) (+ bias) in float64.
template <class ScaleFn>
std::vector<double> reference_row(const Weights& w, int e, const uint8_t* a, ScaleFn a_scale, bool with_bias) {
  const int n = w.layout.n, k = w.layout.k;
  std::vector<double> a_deq(k), out(n);
  for (int i = 0; i < k; ++i) a_deq[i] = fp8_e4m3_to_float(a[i]);
  for (int r = 0; r < n; ++r) {
    const double* wr = &w.deq[(size_t(e) * n + r) * k];
    double sum = 0;
    for (int kb = 0; kb < k / 128; ++kb) {
      double dot = 0;
      for (int i = kb * 128; i < kb * 128 + 128; ++i) dot += a_deq[i] * wr[i];
      sum += dot * a_scale(kb);
    }
    out[r] = sum + (with_bias ? w.bias[size_t(e) * n + r] : 0.0);
  }
  return out;
}


// The operands of a case: MXFP4 weights (with bias) and FP8 activations (rows of k, natural order
// on the host, the GEMM's K order on the device) with their scales, uploaded.
struct Mxfp4Operands {
  int k;
  Weights w;
  std::vector<uint8_t> a;
  std::vector<float> a_scales;
  DeviceBuffer<uint8_t> d_a, d_w;
  DeviceBuffer<uint32_t> d_ws;
  DeviceBuffer<float> d_as, d_bias;

  Mxfp4Operands(Weights weights, size_t a_rows, std::mt19937& rng)
      : k(weights.layout.k),
        w(std::move(weights)),
        d_a(a_rows * k),
        d_w(w.codes.size()),
        d_ws(w.gemm_scales.size()),
        d_as(a_rows * (k / 128)),
        d_bias(w.bias.size()) {
    upload_weights();
    new_activations(rng);
  }
  void upload_weights() {
    d_w.upload(w.gemm_codes);
    d_ws.upload(w.gemm_scales);
    d_bias.upload(w.bias);
  }
  void new_activations(std::mt19937& rng) {
    a = random_fp8(d_a.count, rng);
    a_scales = random_scales(d_as.count, rng);
    d_a.upload(in_gemm_k_order(a, k));
    d_as.upload(a_scales);
  }
};

// The target of the issue: <= 3e-3 relative to a float64 product (BF16 output rounding alone is
// up to 2^-9 = 1.95e-3 of a value, about 1.1e-3 rms).
void expect_good(const ErrorStats& st, const std::string& what) {
  EXPECT_EQ(st.unwritten, 0) << what;
  EXPECT_EQ(st.clobbered, 0) << what << ": padding rows were written";
  EXPECT_LT(st.rel(), 3e-3) << what;
  EXPECT_LT(st.max_rel, 1e-2) << what;
  std::printf("  %-58s rms rel %.2e, max rel %.2e\n", what.c_str(), st.rel(), st.max_rel);
}

struct MaskedCase : Mxfp4Operands {
  MaskedGemmProblem problem;
  DeviceBuffer<int32_t> d_m;
  DeviceBuffer<uint16_t> d_out;

  MaskedCase(const MaskedGemmProblem& p, std::mt19937& rng, int s_lo = 118, int s_hi = 124, int zero_groups = 0)
      : Mxfp4Operands(Weights(p.num_experts, p.n, p.k, s_lo, s_hi, rng, zero_groups), size_t(p.num_experts) * p.max_m,
                      rng),
        problem(p),
        d_m(p.num_experts),
        d_out(size_t(p.num_experts) * p.max_m * p.n) {}
  MaskedGemmBuffers buffers(bool bias) const {
    MaskedGemmBuffers b;
    b.a = d_a.ptr;
    b.a_scales = d_as.ptr;
    b.w = d_w.ptr;
    b.w_mx_scales = d_ws.ptr;
    b.masked_m = d_m.ptr;
    b.out = d_out.ptr;
    b.bias = bias ? d_bias.ptr : nullptr;
    return b;
  }
  ErrorStats check(const std::vector<int32_t>& masked_m, bool bias) const {
    const std::vector<uint16_t> out = d_out.download();
    const int k_blocks = problem.k / 128;
    ErrorStats st;
    for (int e = 0; e < problem.num_experts; ++e)
      for (int m = 0; m < problem.max_m; ++m) {
        const uint16_t* got = &out[(size_t(e) * problem.max_m + m) * problem.n];
        if (m >= std::clamp(masked_m[e], 0, problem.max_m)) {
          st.check_untouched(got, problem.n);
          continue;
        }
        const uint8_t* arow = &a[(size_t(e) * problem.max_m + m) * problem.k];
        auto sc = [&](int kb) { return double(a_scales[(size_t(e) * k_blocks + kb) * problem.max_m + m]); };
        st.add_row(got, reference_row(w, e, arow, sc, bias));
      }
    return st;
  }
  // One run of a fresh plan on poisoned outputs (run_once also checks them against float64).
  void run(const std::vector<int32_t>& masked_m, const GemmConfig* cfg, bool bias) {
    d_m.upload(masked_m);
    d_out.poison(0xFF);
    MaskedGemmProblem p = problem;
    p.weights = WeightFormat::kMxfp4;
    MaskedGemm gemm(p, buffers(bias), cfg);
    gemm.run(nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ErrorStats run_once(const std::vector<int32_t>& masked_m, const GemmConfig* cfg, bool bias) {
    run(masked_m, cfg, bias);
    return check(masked_m, bias);
  }
};


TEST(GemmMxfp4Masked, EveryTilePathAndSplitK) {
  std::mt19937 rng(101);
  MaskedCase c({6, 512, 1024, 136, 0}, rng);
  const std::vector<int32_t> masked_m = {0, 1, 17, 136, 64, 200};  // none, one, odd, full, block edge, clamped
  for (int bm : {16, 32, 48, 64, 128})
    for (int widen : widenings(bm))
      for (int splits : {1, 3}) {
        const GemmConfig cfg = forced_mx(bm, splits, widen);
        for (bool bias : {false, true})
          expect_good(c.run_once(masked_m, &cfg, bias), "block_m " + std::to_string(bm) + " splits " +
                                                             std::to_string(splits) + (bias ? " bias" : "") +
                                                             widen_name(widen));
      }
}

TEST(GemmMxfp4Masked, FewKBlocksPerTile) {
  // The pipelined loops (16-token tiles in pairs, 48-token tiles with two partials, and 128-token
  // tiles in two halves) with one, two and three k blocks per tile (K 128; K 384 whole or split 2
  // ways into 1 + 2): the odd and even tails.
  std::mt19937 rng(107);
  // The widening warpgroup's kernel too: a tile of one k block, and a ring that wraps mid-tile.
  for (int k : {128, 384}) {
    MaskedCase c({3, 256, k, 128, 0}, rng);
    for (int bm : {16, 48, 128})
      for (int widen : widenings(bm))
        for (int splits : {1, 2}) {
          if (splits > k / 128) continue;
          const GemmConfig cfg = forced_mx(bm, splits, widen);
          expect_good(c.run_once({16, 3, 100}, &cfg, true), "K " + std::to_string(k) + " splits " +
                                                                std::to_string(splits) + " block_m " +
                                                                std::to_string(bm) + widen_name(widen));
        }
  }
}

TEST(GemmMxfp4Masked, WideningInSharedMemoryGivesTheSameBits) {
  // Both kernels multiply the same e4m3 values (the same widening, the same row base) with the
  // same four k32 wgmmas per block and promote in the same order, so the outputs should match bit
  // for bit; a difference means a misplaced byte or scale even where it stays within the float64
  // check's bound.
  std::mt19937 rng(109);
  MaskedCase c({4, 384, 1024, 128, 0}, rng);
  const std::vector<int32_t> masked_m = {16, 0, 45, 128};
  for (int bm : {16, 48, 128})
    for (int splits : {1, 2}) {
      std::vector<uint16_t> out[3];
      for (int widen : widenings(bm)) {
        const GemmConfig cfg = forced_mx(bm, splits, widen);
        c.run(masked_m, &cfg, true);
        out[widen] = c.d_out.download();
        if (widen == 0) continue;
        size_t differ = 0;
        for (size_t i = 0; i < out[0].size(); ++i) differ += out[0][i] != out[widen][i];
        EXPECT_EQ(differ, 0u) << "block_m " << bm << " splits " << splits << widen_name(widen) << ": " << differ
                              << " of " << out[0].size() << " outputs differ from the widening in registers";
      }
    }
}

TEST(GemmMxfp4Masked, TwoSlabTilesGiveTheSameBits) {
  // A 256-row tile (block_n 256: two 128-row slabs a stage, one activation tile) multiplies every
  // row with the same four k32 wgmmas per block and promotes it in the same order as two 128-row
  // tiles, so the outputs match bit for bit; and both against float64. K 128 / 384 / 1024 give the
  // two-partial loop one, three and eight blocks (its odd and even tails), split 1 and 3 ways;
  // tiles of 16, 32 and 48 tokens (the 128-row tiles of 32 tokens run the paired loop, the 256-row
  // ones the two-partial loop; at 48 tokens the 128-row tiles run two partials, the 256-row ones
  // one: the same products, promoted in the same order). N = 384 (three slabs, as gpt-oss-120b's
  // GEMM2 has 23): each expert's last tile computes a second slab past N on the next expert's first
  // rows, or (the last expert, which has rows) on TMA's zero fill, and stores neither.
  std::mt19937 rng(111);
  for (int n : {512, 384})
  for (int k : {128, 384, 1024}) {
    MaskedCase c({5, n, k, 48, 0}, rng);
    const std::vector<int32_t> masked_m = {16, 0, 1, 29, 60};  // full, none, one, odd, clamped to 48
    for (int bm : {16, 32, 48})
    for (int splits : {1, 3}) {
      if (splits > k / 128) continue;
      GemmConfig narrow = forced_mx(bm, splits, 0), wide = narrow;
      wide.block_n = 256;
      const std::string what = "N " + std::to_string(n) + " block_m " + std::to_string(bm) + " K " +
                               std::to_string(k) + " splits " + std::to_string(splits);
      expect_good(c.run_once(masked_m, &narrow, true), what + " block_n 128");
      const std::vector<uint16_t> base = c.d_out.download();
      expect_good(c.run_once(masked_m, &wide, true), what + " block_n 256");
      const std::vector<uint16_t> got = c.d_out.download();
      size_t differ = 0;
      for (size_t i = 0; i < base.size(); ++i) differ += base[i] != got[i];
      EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << base.size()
                            << " outputs of the 256-row tiles differ from the 128-row tiles'";
    }
  }
  // In a graph: GraphReplayWithNewMaskedMAndData.
}

TEST(GemmMxfp4Masked, RowScalesOnEveryTile) {
  // One activation scale per row (MaskedGemmProblem::a_row_scales): each row's K/128 slots hold one
  // random scale, as a per-token quantisation writes them, and the register kernel multiplies it
  // once after the K loop. Every tile of 16 to 128 tokens, 128- and 256-row tiles (up to 48), K 128,
  // 384 and 1024 (the paired loop of up to 32 tokens with one, two, three and eight blocks: its odd
  // and even tails; the single loop beyond), split 1 and 3 ways; and a config that widens in a
  // warpgroup of its own, which reads the slots as 1x128 scales. All against float64.
  std::mt19937 rng(113);
  for (int k : {128, 384, 1024}) {
    MaskedCase c({5, 384, k, 128, 0}, rng);
    const int k_blocks = k / 128;
    for (int e = 0; e < 5; ++e)  // slot kb of row (e, m) at (e K/128 + kb) M_max + m: slot 0's value in all
      for (int kb = 1; kb < k_blocks; ++kb)
        for (int m = 0; m < 128; ++m)
          c.a_scales[(size_t(e) * k_blocks + kb) * 128 + m] = c.a_scales[size_t(e) * k_blocks * 128 + m];
    c.d_as.upload(c.a_scales);
    c.problem.a_row_scales = true;
    const std::vector<int32_t> masked_m = {16, 0, 1, 45, 200};  // full tile, none, one, odd, clamped
    for (int bm : {16, 32, 48, 64, 128})
      for (int rows : {128, 256})
        for (int splits : {1, 3}) {
          if (splits > k_blocks || (rows == 256 && bm > 48)) continue;
          GemmConfig cfg = forced_mx(bm, splits, 0);
          cfg.block_n = rows;
          expect_good(c.run_once(masked_m, &cfg, true), "row scales K " + std::to_string(k) + " block_m " +
                                                            std::to_string(bm) + " block_n " + std::to_string(rows) +
                                                            " splits " + std::to_string(splits));
        }
    const GemmConfig smem = forced_mx(16, 1, 1);
    expect_good(c.run_once(masked_m, &smem, true), "row scales K " + std::to_string(k) + " widen_wgs=1");
    if (k != 128) continue;
    MaskedGemmProblem fp8 = c.problem;  // (weights stays kFp8: run() is what sets MXFP4)
    MaskedGemmBuffers fb = c.buffers(false);
    fb.w_mx_scales = nullptr;
    fb.w_scales = c.d_as.ptr;
    expect_error([&] { MaskedGemm g(fp8, fb); }, {"a_row_scales", "needs MXFP4 weights"});
  }
}

TEST(GemmMxfp4Masked, HeuristicOnGptOssShapes) {
  // gpt-oss-120b's expert GEMMs after the loader's padding (hidden 2880 -> 2944): W1 is
  // [2·2944, 2944], W2 [2944, 2944]; 8 local experts, a handful of tokens each.
  std::mt19937 rng(102);
  for (int n : {5888, 2944}) {
    MaskedCase c({8, n, 2944, 16, 8}, rng);
    expect_good(c.run_once({3, 8, 0, 16, 5, 1, 9, 12}, nullptr, true), "gpt-oss N " + std::to_string(n));
  }
  // The heuristic's token blocks at gpt-oss-120b's shapes (33..48 rows take 48): tests/host/test_heuristics.cu.
  MaskedCase c({8, 2944, 2944, 64, 44}, rng);
  expect_good(c.run_once({44, 31, 0, 48, 26, 1, 47, 33}, nullptr, true), "gpt-oss GEMM2, 26..48 rows, heuristic");
  expect_good(c.run_once({64, 49, 12, 0, 48, 3, 60, 40}, nullptr, true), "gpt-oss GEMM2, rows past 48, heuristic");
}

// 256-row MXFP4 tiles (mxfp4_wide_tiles; the rule's picks: tests/host/test_heuristics.cu):
// MOEKIT_MXFP4_ROWS sets them over the heuristic.
TEST(GemmMxfp4Masked, WideTilesRule) {
  // The knob: 128 or 256 over the heuristic's plan (where compiled), anything else refused by name.
  std::mt19937 rng(105);
  MaskedCase c({4, 512, 512, 16, 16}, rng);
  MaskedGemmProblem p = c.problem;
  p.weights = WeightFormat::kMxfp4;
  for (const char* v : {"256", "128"}) {
    setenv("MOEKIT_MXFP4_ROWS", v, 1);
    MaskedGemm g(p, c.buffers(false));
    EXPECT_EQ(g.config().block_n, std::atoi(v)) << g.config().to_string();
  }
  setenv("MOEKIT_MXFP4_ROWS", "512", 1);
  expect_error([&] { MaskedGemm g(p, c.buffers(false)); }, {"MOEKIT_MXFP4_ROWS = '512'", "128 or 256"});
  unsetenv("MOEKIT_MXFP4_ROWS");
  expect_good(c.run_once({16, 3, 0, 9}, nullptr, true), "the heuristic's plan after the knob");
}

TEST(GemmMxfp4Masked, WideScaleSpreadTakesTheRoundedPath) {
  // Scale bytes over [100, 140]: groups of one row differ by up to 2^40, so many shifts are
  // below -5 (the rounded table) and many below -8 (rounded values). The error stays far below
  // the BF16 output rounding: the rounded values are below 2^-14 of their row's largest.
  // The heuristic's pick, and tiles of 16 and 32 tokens forced (with the bias).
  std::mt19937 rng(103);
  MaskedCase c({4, 256, 2048, 32, 0}, rng, 100, 140);
  expect_good(c.run_once({32, 7, 20, 1}, nullptr, false), "scale bytes 100..140");
  for (int bm : {16, 32})
    for (int widen : widenings(bm)) {
      const GemmConfig cfg = forced_mx(bm, 1, widen);
      expect_good(c.run_once({32, 7, 20, 1}, &cfg, true),
                  "scale bytes 100..140, block_m " + std::to_string(bm) + widen_name(widen));
    }
}

TEST(GemmMxfp4Masked, ZeroGroupsDoNotSetTheRowBase) {
  // Real groups at scale bytes 96..102 and the last two groups of every row all zero at 127 (the
  // loader's K padding): the row's base must come from the real groups, else every real value
  // would sit 2^19 and more below it and round to zero. Exact widening, fast tables only.
  std::mt19937 rng(108);
  MaskedCase c({3, 256, 1024, 16, 0}, rng, 96, 102, 2);
  for (int bm : {16, 128})
    for (int widen : widenings(bm)) {
      const GemmConfig cfg = forced_mx(bm, 1, widen);
      expect_good(c.run_once({16, 5, 11}, &cfg, true),
                  "zero groups at 127, block_m " + std::to_string(bm) + widen_name(widen));
    }
}

TEST(GemmMxfp4Masked, GraphReplayWithNewMaskedMAndData) {
  // The heuristic's plan, and 16- and 48-token tiles with split-K (the tile counters must be back
  // at zero for the next replay); 256-row tiles (N 512) with split-K too.
  std::mt19937 rng(104);
  auto replay = [&](MaskedCase& c, const GemmConfig* cfg) {
    MaskedGemmProblem p = c.problem;
    p.weights = WeightFormat::kMxfp4;
    MaskedGemm gemm(p, c.buffers(true), cfg);
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
    {
      const CapturedGraph graph(stream, [&] { gemm.run(stream); });
      std::uniform_int_distribution<int> m(0, p.max_m);
      for (int rep = 0; rep < 3; ++rep) {
        std::vector<int32_t> masked_m(p.num_experts);
        for (auto& x : masked_m) x = m(rng);
        c.new_activations(rng);
        c.d_m.upload(masked_m);
        c.d_out.poison(0xFF);
        graph.launch(stream);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
        expect_good(c.check(masked_m, true), gemm.config().to_string() + ", graph replay " + std::to_string(rep));
      }
    }
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
  };
  MaskedCase c({5, 384, 768, 48, 16}, rng);
  const GemmConfig narrow_split = forced(true, 16, 2), wide_split = forced(true, 48, 2);
  const GemmConfig widen_narrow = forced_mx(16, 2, 1), widen_wide = forced_mx(48, 1, 1);
  const GemmConfig widen2_narrow = forced_mx(16, 2, 2), widen2_wide = forced_mx(48, 1, 2);
  for (const GemmConfig* cfg :
       {static_cast<const GemmConfig*>(nullptr), &narrow_split, &wide_split, &widen_narrow, &widen_wide, &widen2_narrow,
        &widen2_wide})
    replay(c, cfg);
  MaskedCase c512({4, 512, 512, 16, 16}, rng);
  GemmConfig rows256 = forced_mx(16, 2, 0);
  rows256.block_n = 256;
  replay(c512, &rows256);
}

TEST(GemmMxfp4Masked, BadArgumentsAreNamed) {
  std::mt19937 rng(105);
  MaskedCase c({2, 256, 256, 16, 0}, rng);
  MaskedGemmProblem p = c.problem;
  p.weights = WeightFormat::kMxfp4;
  MaskedGemmBuffers b = c.buffers(false);
  b.w_mx_scales = nullptr;
  expect_error([&] { MaskedGemm g(p, b); }, {"w_mx_scales is null"});
  b = c.buffers(false);
  b.w_scales = c.d_as.ptr;
  expect_error([&] { MaskedGemm g(p, b); }, {"w_scales is set with MXFP4"});
  MaskedGemmProblem gated = p;
  gated.epilogue = GemmEpilogue::kSiluMulFp8;
  expect_error([&] { MaskedGemm g(gated, c.buffers(false)); }, {"SiLU·up epilogue needs FP8 weights"});
  expect_error(
      [&] {
        MaskedGemm g(p, c.buffers(false));
        g.set_last_expert_first(true);
      },
      {"set_last_expert_first needs FP8 weights"});
  GemmConfig normal;
  normal.block_m = 64;
  normal.block_n = 128;
  expect_error([&] { MaskedGemm g(p, c.buffers(false), &normal); }, {"swap-AB with block_n = 128"});
  // 256-row tiles: 16, 32 or 48 tokens, widened in registers (any N: TwoSlabTilesGiveTheSameBits
  // runs N = 384; the FP8 kernel's refusal of an odd N/128 is test_gemm's).
  GemmConfig wide64 = forced_mx(64, 1, 0), wide_smem = forced_mx(16, 1, 1);
  wide64.block_n = wide_smem.block_n = 256;
  expect_error([&] { MaskedGemm g(p, c.buffers(false), &wide64); },
               {"block_m=64", "block_m = 16, 32 or 48 and mxfp4_widen_wgs = 0"});
  expect_error([&] { MaskedGemm g(p, c.buffers(false), &wide_smem); }, {"widen_wgs=1", "block_n = 256"});
  // The widening warpgroup with FP8 weights, and a bad value of its study knob, both named.
  MaskedGemmProblem fp8_problem = c.problem;
  MaskedGemmBuffers fp8_buffers = c.buffers(false);
  fp8_buffers.w_mx_scales = nullptr;
  fp8_buffers.w_scales = c.d_as.ptr;
  const GemmConfig widen = forced_mx(16, 1, 1);
  expect_error([&] { MaskedGemm g(fp8_problem, fp8_buffers, &widen); },
               {"widen_wgs=1", "mxfp4_widen_wgs (the widening warpgroups) needs MXFP4 weights"});
  const GemmConfig widen3 = forced_mx(16, 1, 3), widen2_wide = forced_mx(128, 1, 2);
  expect_error([&] { MaskedGemm g(p, c.buffers(false), &widen3); }, {"widen_wgs=3", "is not compiled"});
  expect_error([&] { MaskedGemm g(p, c.buffers(false), &widen2_wide); }, {"block_m=128", "widen_wgs=2", "at most 64"});
  setenv("MOEKIT_MXFP4_WIDEN", "shared", 1);
  expect_error([&] { MaskedGemm g(p, c.buffers(false)); },
               {"MOEKIT_MXFP4_WIDEN = 'shared'", "registers, smem or smem2"});
  for (auto [value, wgs] : {std::pair{"smem", 1}, std::pair{"smem2", 2}, std::pair{"registers", 0}}) {
    setenv("MOEKIT_MXFP4_WIDEN", value, 1);
    MaskedGemm g(p, c.buffers(false));
    EXPECT_EQ(g.config().mxfp4_widen_wgs, wgs) << value << ": " << g.config().to_string();
  }
  unsetenv("MOEKIT_MXFP4_WIDEN");
  // The heuristic's pick with the knob unset (choose_masked_config): the registers, for few and
  // many experts and every tile width.
  EXPECT_EQ(MaskedGemm(p, c.buffers(false)).config().mxfp4_widen_wgs, 0);
  for (int max_m : {16, 48, 256}) {
    MaskedCase many({32, 256, 256, max_m, 0}, rng);
    MaskedGemmProblem pm = many.problem;
    pm.weights = WeightFormat::kMxfp4;
    const MaskedGemm g(pm, many.buffers(false));
    EXPECT_EQ(g.config().mxfp4_widen_wgs, 0) << "32 experts, M_max " << max_m << ": " << g.config().to_string();
  }
  MaskedGemmProblem fp8 = c.problem;  // FP8 weights with an MXFP4-only buffer
  MaskedGemmBuffers fb = c.buffers(true);
  fb.w_mx_scales = nullptr;
  fb.w_scales = c.d_as.ptr;
  expect_error([&] { MaskedGemm g(fp8, fb); }, {"bias is supported with MXFP4 weights only"});
}

// A contiguous problem: E experts with the given real rows each, every segment padded to
// kContiguousAlign rows (padding rows keep their poison), fresh random weights and activations.
struct ContiguousCase : Mxfp4Operands {
  std::vector<int32_t> row_expert;
  int total = 0;
  ContiguousGemmProblem problem;
  DeviceBuffer<int32_t> d_re;
  DeviceBuffer<uint16_t> d_out;

  static std::vector<int32_t> rows_of(const std::vector<int>& rows) {
    std::vector<int32_t> re;
    for (int e = 0; e < int(rows.size()); ++e) {
      const int padded = (rows[e] + kContiguousAlign - 1) / kContiguousAlign * kContiguousAlign;
      for (int r = 0; r < padded; ++r) re.push_back(r < rows[e] ? e : -1);
    }
    return re;
  }
  ContiguousCase(const std::vector<int>& rows, int n, int k, std::mt19937& rng, int s_lo = 118, int s_hi = 124)
      : Mxfp4Operands(Weights(int(rows.size()), n, k, s_lo, s_hi, rng), rows_of(rows).size(), rng),
        row_expert(rows_of(rows)),
        total(int(row_expert.size())),
        problem{int(rows.size()), n, k, total},
        d_re(row_expert.size()),
        d_out(size_t(total) * n) {
    problem.weights = WeightFormat::kMxfp4;
    d_re.upload(row_expert);
  }
  void new_weights(std::mt19937& rng) {
    w = Weights(problem.num_experts, problem.n, problem.k, 118, 124, rng);
    upload_weights();
  }
  ContiguousGemmBuffers buffers(bool bias) const {
    ContiguousGemmBuffers b;
    b.a = d_a.ptr;
    b.a_scales = d_as.ptr;
    b.row_expert = d_re.ptr;
    b.w = d_w.ptr;
    b.w_mx_scales = d_ws.ptr;
    b.bias = bias ? d_bias.ptr : nullptr;
    b.out = d_out.ptr;
    return b;
  }
  ErrorStats check(bool bias) const {
    const std::vector<uint16_t> out = d_out.download();
    const int n = problem.n, k = problem.k;
    ErrorStats st;
    for (int m = 0; m < total; ++m) {
      const uint16_t* got = &out[size_t(m) * n];
      if (row_expert[m] < 0) {
        st.check_untouched(got, n);
        continue;
      }
      // (Row scales: the first M_total of the random scales, one per row for every block.)
      auto sc = [&](int kb) { return double(a_scales[problem.a_row_scales ? m : size_t(kb) * total + m]); };
      st.add_row(got, reference_row(w, row_expert[m], &a[size_t(m) * k], sc, bias));
    }
    return st;
  }
  ErrorStats run_once(const GemmConfig* cfg, bool bias) {
    d_out.poison(0xFF);
    ContiguousGemm gemm(problem, buffers(bias), cfg);
    gemm.run(nullptr);
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    return check(bias);
  }
};

// The FP8 copy made beside the GEMM on `copy_ctas` SMs (1: the GEMM waits for almost every row
// block) with the GEMM on the rest of this device's SMs.
GemmConfig beside_config(const ContiguousGemmProblem& p, int copy_ctas) {
  return choose_mxfp4_fp8_copy_beside_config(p, query_device().num_sms, copy_ctas);
}

// The contiguous configs: the register kernel's 128-token tiles, one widening warpgroup, the
// FP8 copy (the FP8 kernel's 128 x 256 tiles on the widened weights) made first, and made beside
// the GEMM on 1 and on 5 SMs.
std::vector<GemmConfig> contiguous_configs(const ContiguousGemmProblem& p) {
  std::vector<GemmConfig> out;
  for (int widen : {0, 1}) {
    GemmConfig cfg = choose_contiguous_config(p, 132);
    cfg.mxfp4_widen_wgs = widen;
    cfg.num_ctas = 0;
    out.push_back(cfg);
  }
  GemmConfig copy = choose_mxfp4_fp8_copy_config(p, 132);
  copy.num_ctas = 0;
  out.push_back(copy);
  for (int ctas : {1, 5}) out.push_back(beside_config(p, ctas));
  return out;
}

TEST(GemmMxfp4Contiguous, SegmentsWithPadding) {
  // N = 384: the FP8 copy's last 256-column tile of each expert reaches past N (its second half
  // is never stored); an expert without rows; segments of 130, 256 and 5 rows.
  std::mt19937 rng(106);
  ContiguousCase c({130, 0, 256, 5}, 384, 1024, rng);
  for (const GemmConfig& cfg : contiguous_configs(c.problem))
    for (bool bias : {true, false}) {
      const ErrorStats st = c.run_once(&cfg, bias);
      expect_good(st, "contiguous, 4 experts with padding, " + cfg.to_string() + (bias ? ", bias" : ""));
    }
  // MOEKIT_MXFP4_WIDEN=smem2 over a contiguous plan: one widening warpgroup (two are compiled for
  // masked tiles only).
  setenv("MOEKIT_MXFP4_WIDEN", "smem2", 1);
  {
    ContiguousGemm gemm(c.problem, c.buffers(true));
    EXPECT_EQ(gemm.config().mxfp4_widen_wgs, 1) << gemm.config().to_string();
  }
  unsetenv("MOEKIT_MXFP4_WIDEN");
}

TEST(GemmMxfp4Contiguous, RaggedExpertsOnEveryPath) {
  // Segments of 0, 1, 127, 128 and 129 real rows: a segment's last block is full, one row short,
  // one row long, or a single row.
  std::mt19937 rng(110);
  ContiguousCase c({1, 127, 0, 128, 129}, 256, 512, rng);
  for (const GemmConfig& cfg : contiguous_configs(c.problem))
    expect_good(c.run_once(&cfg, true), "contiguous, ragged experts, " + cfg.to_string());
}

TEST(GemmMxfp4Contiguous, RowScalesOnEveryTile) {
  // One activation scale per row (ContiguousGemmProblem::a_row_scales): the register kernel with
  // the whole K in one accumulator, 64- and 128-token tiles, split-K 1 and 3 (each split's partial
  // scaled before the reduction), with and without bias, on padded and on ragged segments; one
  // K block per tile (K 128) and an odd count (K 384, split 3 gives one block each) among them.
  std::mt19937 rng(121);
  for (const std::vector<int>& rows : {std::vector<int>{130, 0, 256, 5}, std::vector<int>{1, 127, 0, 128, 129}})
    for (int k : {1024, 128, 384}) {
      ContiguousCase c(rows, 384, k, rng);
      c.problem.a_row_scales = true;
      for (int block_m : {64, 128})
        for (int splits : {1, 3}) {
          if (splits > k / 128) continue;
          GemmConfig cfg = choose_contiguous_config(c.problem, 132);
          cfg.block_m = block_m;
          cfg.num_splits = splits;
          cfg.num_ctas = 0;
          for (bool bias : {true, false})
            expect_good(c.run_once(&cfg, bias), "contiguous, row scales, K " + std::to_string(k) + ", " +
                                                    cfg.to_string() + (bias ? ", bias" : ""));
        }
      // The heuristic's plan takes them too, whatever the prefill knob says (it picks kernels that
      // take block scales).
      setenv("MOEKIT_MXFP4_PREFILL", "copy", 1);
      c.d_out.poison(0xFF);
      const ContiguousGemm g(c.problem, c.buffers(true));
      unsetenv("MOEKIT_MXFP4_PREFILL");
      EXPECT_FALSE(g.config().mxfp4_fp8_copy) << g.config().to_string();
      g.run(nullptr);
      MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
      expect_good(c.check(true), "contiguous, row scales, K " + std::to_string(k) + ", the heuristic's plan");
    }
}

TEST(GemmMxfp4Contiguous, RowScalesBadArgumentsAreNamed) {
  std::mt19937 rng(122);
  ContiguousCase c({128}, 256, 256, rng);
  c.problem.a_row_scales = true;
  GemmConfig copy = choose_mxfp4_fp8_copy_config(c.problem, 132);
  expect_error([&] { ContiguousGemm g(c.problem, c.buffers(true), &copy); }, {"fp8_copy", "a_row_scales"});
  GemmConfig widen = choose_contiguous_config(c.problem, 132);
  widen.mxfp4_widen_wgs = 1;
  expect_error([&] { ContiguousGemm g(c.problem, c.buffers(true), &widen); },
               {"widen_wgs=1", "a_row_scales", "register kernel only"});
  ContiguousGemmProblem fp8 = c.problem;
  fp8.weights = WeightFormat::kFp8;
  ContiguousGemmBuffers fb = c.buffers(false);
  fb.w_mx_scales = nullptr;
  fb.w_scales = c.d_as.ptr;
  expect_error([&] { ContiguousGemm g(fp8, fb); }, {"a_row_scales", "needs MXFP4 weights"});
}

TEST(GemmMxfp4Contiguous, Fp8CopyOnGptOssShapesAndWideSpread) {
  std::mt19937 rng(107);
  {  // gpt-oss-120b's GEMM2 shape after the loader's padding (N = K = 2944, an odd number of 128s)
    ContiguousCase c({200, 128}, 2944, 2944, rng);
    const GemmConfig copy = choose_mxfp4_fp8_copy_config(c.problem, 132);
    expect_good(c.run_once(&copy, true), "contiguous fp8_copy, N 2944 K 2944");
    const GemmConfig beside = beside_config(c.problem, 0);  // the heuristic's count
    EXPECT_GT(beside.mxfp4_fp8_copy_ctas, 0) << beside.to_string();
    expect_good(c.run_once(&beside, true), "contiguous fp8_copy beside, N 2944 K 2944, " + beside.to_string());
  }
  {  // scale bytes over 100..140: many groups take the widening's rounded tables
    ContiguousCase c({128, 70}, 256, 1024, rng, 100, 140);
    const GemmConfig copy = choose_mxfp4_fp8_copy_config(c.problem, 132);
    expect_good(c.run_once(&copy, true), "contiguous fp8_copy, scale bytes 100..140");
  }
}

TEST(GemmMxfp4Contiguous, Fp8CopyGraphReplayWithNewWeightsAndData) {
  // The copy is made in every run: a graph replayed after new weights were uploaded must use
  // them (a stale copy fails here), and the plan's overlap with a kernel before it keeps the order.
  std::mt19937 rng(108);
  // Beside the GEMM, the row-block counters must also start again from zero in every replay.
  ContiguousCase c({100, 256, 30}, 512, 768, rng);
  // The second plan writes its copy into the caller's workspace (fp8_copy_workspace).
  DeviceBuffer<uint8_t> workspace(mxfp4_fp8_copy_bytes(c.problem));
  for (const GemmConfig& copy : {choose_mxfp4_fp8_copy_config(c.problem, 132), beside_config(c.problem, 2)})
  for (Overlap overlap : {Overlap::kNone, Overlap::kPreviousKernel}) {
    ContiguousGemmBuffers b = c.buffers(true);
    if (overlap == Overlap::kPreviousKernel) b.fp8_copy_workspace = workspace.ptr;
    ContiguousGemm gemm(c.problem, b, &copy);
    gemm.set_overlap(overlap);
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
    {
      const CapturedGraph graph(stream, [&] { gemm.run(stream); });
      for (int rep = 0; rep < 3; ++rep) {
        c.new_weights(rng);
        c.new_activations(rng);
        c.d_out.poison(0xFF);
        graph.launch(stream);
        MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
        expect_good(c.check(true), "fp8_copy graph replay " + std::to_string(rep) + ", " + copy.to_string() +
                                       (overlap == Overlap::kNone ? "" : ", overlap, the caller's workspace"));
      }
    }
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

TEST(GemmMxfp4Contiguous, Fp8CopyBadArgumentsAreNamed) {
  std::mt19937 rng(109);
  ContiguousCase c({128}, 256, 256, rng);
  GemmConfig copy = choose_mxfp4_fp8_copy_config(c.problem, 132);
  copy.block_n = 128;
  expect_error([&] { ContiguousGemm g(c.problem, c.buffers(true), &copy); },
               {"fp8_copy", "block_n = 256", "choose_mxfp4_fp8_copy_config"});
  copy = choose_mxfp4_fp8_copy_config(c.problem, 132);
  copy.mxfp4_widen_wgs = 1;
  expect_error([&] { ContiguousGemm g(c.problem, c.buffers(true), &copy); }, {"widen_wgs=1", "fp8_copy"});
  ContiguousGemmProblem fp8 = c.problem;
  fp8.weights = WeightFormat::kFp8;
  expect_error([&] { choose_mxfp4_fp8_copy_config(fp8, 132); }, {"weights are FP8"});
  DeviceBuffer<uint8_t> workspace(mxfp4_fp8_copy_bytes(c.problem) + 16);
  ContiguousGemmBuffers wb = c.buffers(true);
  wb.fp8_copy_workspace = workspace.ptr;
  expect_error([&] { ContiguousGemm g(c.problem, wb); }, {"fp8_copy_workspace is set", "no FP8 copy"});
  wb.fp8_copy_workspace = workspace.ptr + 8;
  copy = choose_mxfp4_fp8_copy_config(c.problem, 132);
  expect_error([&] { ContiguousGemm g(c.problem, wb, &copy); }, {"fp8_copy_workspace is not 16-byte aligned"});
  expect_error([&] { mxfp4_fp8_copy_bytes(ContiguousGemmProblem{0, 256, 256, 128}); }, {"E_loc = 0"});
  ContiguousGemmBuffers fb = c.buffers(false);
  fb.w_mx_scales = nullptr;
  fb.w_scales = c.d_as.ptr;
  copy = choose_mxfp4_fp8_copy_config(c.problem, 132);
  expect_error([&] { ContiguousGemm g(fp8, fb, &copy); }, {"fp8_copy", "needs MXFP4 weights"});
  MaskedCase m({2, 256, 256, 16, 0}, rng);
  MaskedGemmProblem mp = m.problem;
  mp.weights = WeightFormat::kMxfp4;
  GemmConfig masked_copy = forced_mx(16, 1, 0);
  masked_copy.mxfp4_fp8_copy = true;
  expect_error([&] { MaskedGemm g(mp, m.buffers(false), &masked_copy); }, {"fp8_copy", "contiguous plans"});
  // Beside the GEMM: the copy's SM count must leave the GEMM some, and the two fit the device.
  const int sms = query_device().num_sms;
  expect_error([&] { choose_mxfp4_fp8_copy_beside_config(c.problem, 132, 132); }, {"copy_ctas = 132", "1..131"});
  expect_error([&] { choose_mxfp4_fp8_copy_beside_config(c.problem, 132, -1); }, {"copy_ctas = -1"});
  copy = beside_config(c.problem, 4);
  copy.num_ctas = sms;
  expect_error([&] { ContiguousGemm g(c.problem, c.buffers(true), &copy); },
               {"beside_ctas=4", "ctas + beside_ctas <= the device's " + std::to_string(sms) + " SMs"});
  copy.num_ctas = 0;
  expect_error([&] { ContiguousGemm g(c.problem, c.buffers(true), &copy); }, {"beside_ctas", "with ctas set"});
  // The study knob over the heuristic: a bad value is named; copy, beside and registers are taken.
  for (const char* bad : {"fp8", "beside:", "beside:0", "beside:x", "besides", "beside:99999999"}) {
    setenv("MOEKIT_MXFP4_PREFILL", bad, 1);
    expect_error([&] { ContiguousGemm g(c.problem, c.buffers(true)); },
                 {"MOEKIT_MXFP4_PREFILL = '" + std::string(bad) + "'", "copy, beside, beside:N"});
  }
  setenv("MOEKIT_MXFP4_PREFILL", "beside:3", 1);
  {
    const ContiguousGemm g(c.problem, c.buffers(true));
    EXPECT_EQ(g.config().mxfp4_fp8_copy_ctas, 3) << g.config().to_string();
    EXPECT_EQ(g.config().num_ctas, sms - 3) << g.config().to_string();
  }
  setenv("MOEKIT_MXFP4_PREFILL", "beside", 1);
  EXPECT_GT(ContiguousGemm(c.problem, c.buffers(true)).config().mxfp4_fp8_copy_ctas, 0);
  setenv("MOEKIT_MXFP4_PREFILL", "copy", 1);
  EXPECT_TRUE(ContiguousGemm(c.problem, c.buffers(true)).config().mxfp4_fp8_copy);
  setenv("MOEKIT_MXFP4_PREFILL", "registers", 1);
  EXPECT_FALSE(ContiguousGemm(c.problem, c.buffers(true)).config().mxfp4_fp8_copy);
  unsetenv("MOEKIT_MXFP4_PREFILL");
  EXPECT_FALSE(ContiguousGemm(c.problem, c.buffers(true)).config().mxfp4_fp8_copy) << "not the heuristic's pick yet";
}

}  // namespace
}  // namespace moekit
