// The GPU library's host-side rules, which need no GPU: the grouped GEMM's plan heuristics
// (choose_masked_config, mxfp4_wide_tiles, upper_typical_rows) and the router's
// (choose_router_config), each for a 132-SM Hopper part. They link moekit_cuda, so they build only
// with CUDA, and `make test` runs them (label `cpu`): a rule change is checked on every commit, not
// only when the GPU suites run. The figures in the comments are the measurements each pick rests
// on (docs/gemm.md, docs/gemm-mxfp4.md, docs/layer-gpu.md).
#include <gtest/gtest.h>

#include <climits>
#include <string>
#include <tuple>
#include <utility>

#include "expect_error.h"
#include "kernels/cuda/gating.cuh"
#include "moekit/gemm.h"

using namespace moekit;

namespace {
constexpr int kSms = 132;  // H100 and H200 SXM
}  // namespace

// One EP8 rank's GEMM2 at B = 64: Qwen3.5 (K 1024) and DeepSeek-V3 (K 2048) take 256 rows; a deep
// K, the gated epilogue, N an odd multiple of 128 and too few tiles for a wave keep 128.
TEST(GemmHeuristic, MaskedSwapTileRows) {
  EXPECT_EQ(choose_masked_config({65, 4096, 1024, 64, 4}, kSms).block_n, 256);
  EXPECT_EQ(choose_masked_config({33, 7168, 2048, 64, 4}, kSms).block_n, 256);
  EXPECT_EQ(choose_masked_config({33, 7168, 7168, 64, 4}, kSms).block_n, 128);
  EXPECT_EQ(choose_masked_config({33, 4096, 2048, 64, 4, GemmEpilogue::kSiluMulFp8}, kSms).block_n, 128);
  EXPECT_EQ(choose_masked_config({65, 4224, 1024, 64, 4}, kSms).block_n, 128);
  EXPECT_EQ(choose_masked_config({2, 4096, 1024, 64, 4}, kSms).block_n, 128);
  EXPECT_EQ(choose_masked_config({33, 7168, 2048, 64, 44}, kSms).block_n, 128);  // 64-token blocks keep 128 rows
  EXPECT_EQ(choose_masked_config({65, 4096, 1024, 64, 29}, kSms).block_n, 128);  // and 32-token ones
}

TEST(GemmHeuristic, MaskedTokenBlocks) {
  // Above 64 expected rows (up to 192) the tokens go on the MMA's M side in 128-row blocks
  // (docs/gemm.md run 18); below, swap-AB in the smallest block that holds them.
  for (auto [expected, swap, block_m] : {std::tuple{16, true, 16}, std::tuple{33, true, 48}, std::tuple{44, true, 48},
                                         std::tuple{49, true, 64}, std::tuple{64, true, 64}, std::tuple{65, false, 128},
                                         std::tuple{98, false, 128}, std::tuple{151, false, 128},
                                         std::tuple{192, false, 128}}) {
    const GemmConfig cfg = choose_masked_config(MaskedGemmProblem{32, 4096, 7168, 4096, expected}, kSms);
    EXPECT_EQ(cfg.swap_ab, swap) << "expected_m " << expected << ": " << cfg.to_string();
    EXPECT_EQ(cfg.block_m, block_m) << "expected_m " << expected << ": " << cfg.to_string();
    // Tokens on the M side: 256-column tiles, as for the contiguous layout (32 experts x 16 or
    // 32 wide tiles fill the 132 SMs' waves in fewer rounds).
    EXPECT_EQ(cfg.block_n, swap ? 128 : 256) << "expected_m " << expected << ": " << cfg.to_string();
  }
  // Too few tiles for one wave of 256-column tiles (they have no split-K): 128 columns.
  EXPECT_EQ(choose_masked_config(MaskedGemmProblem{2, 512, 7168, 256, 100}, kSms).block_n, 128);
  // GEMM1 (gated) of one EP8 rank of DeepSeek-V3 at B = 256 on 132 SMs: 32 routed experts planned
  // at 14 rows and the merged shared expert with the rank's 32 tokens. 16-token blocks make 34 x 16
  // = 544 tiles (5 rounds), 32-token blocks 33 x 16 = 528 (4): 32. Qwen3.5 (64 routed experts, 8
  // tiles each) has 66 x 8 = 528 against 520, 4 rounds either way: 16. Without a fuller last
  // expert, or with one that fits 16 tokens, 16.
  const auto gated_block = [](MaskedGemmProblem p) { return choose_masked_config(p, kSms).block_m; };
  const auto gated = GemmEpilogue::kSiluMulFp8;
  EXPECT_EQ(gated_block({33, 4096, 7168, 256, 14, gated, WeightFormat::kFp8, 32}), 32);
  EXPECT_EQ(gated_block({65, 2048, 4096, 256, 10, gated, WeightFormat::kFp8, 32}), 16);
  // B = 512 (blocks of 32, the shared expert's 64 rows in two): 32 stays (64 measured slower in
  // the step, docs/layer-gpu.md item 28).
  EXPECT_EQ(gated_block({33, 4096, 7168, 512, 24, gated, WeightFormat::kFp8, 64}), 32);
  EXPECT_EQ(gated_block({33, 4096, 7168, 256, 14, gated}), 16);
  EXPECT_EQ(gated_block({33, 4096, 7168, 256, 14, gated, WeightFormat::kFp8, 16}), 16);
  EXPECT_EQ(choose_masked_config({33, 7168, 2048, 256, 14, GemmEpilogue::kBf16, WeightFormat::kFp8, 32}, kSms).block_m,
            16);  // only the gated GEMM1 (GEMM2 in 32-token tiles: slower in the step, layer-gpu.md item 29)
}

// The expected_m a caller that knows only the batch passes: mean + 2 sqrt(mean), at least 1
// (DeepSeek-V3 at EP8: 256 slots, top-8; B = 2048 is a mean of 64 rows, B = 1024 of 32).
TEST(GemmHeuristic, UpperTypicalRows) {
  EXPECT_EQ(upper_typical_rows(2048 * 8, 256), 80);
  EXPECT_EQ(upper_typical_rows(1024 * 8, 256), 44);
  EXPECT_EQ(upper_typical_rows(8 * 8, 256), 2);
  EXPECT_EQ(upper_typical_rows(0, 5), 1);
  EXPECT_EQ(upper_typical_rows(int64_t(1) << 62, 1), INT_MAX);  // saturates instead of wrapping
  expect_error([] { upper_typical_rows(16, 0); }, {"experts = 0"});
}

// One rank of gpt-oss-120b at B = 1024: 32 rows per expert on average, planned at the upper-typical
// 44 (mean + 2 sqrt(mean)): one 48-token block each (7-8% faster than 64-token tiles on the same
// rows, docs/gemm-mxfp4.md run 23). 33..48 take 48, 49..64 keep 64.
TEST(GemmHeuristic, Mxfp4TokenBlocks) {
  MaskedGemmProblem p{128, 5888, 2944, 256, upper_typical_rows(4096, 128)};
  p.weights = WeightFormat::kMxfp4;
  EXPECT_EQ(p.expected_m, 44);
  for (auto [expected, block_m] : {std::pair{32, 32}, std::pair{33, 48}, std::pair{44, 48}, std::pair{48, 48},
                                   std::pair{49, 64}}) {
    p.expected_m = expected;
    EXPECT_EQ(choose_masked_config(p, kSms).block_m, block_m) << "expected_m " << expected;
  }
}

// The rule for 256-row MXFP4 tiles (mxfp4_wide_tiles): plans of 16, 32 or 48 tokens in registers,
// no more rounds of tile work than 128-row tiles, and only where HBM gives at least ~15 B per SM
// cycle (an H200's ~19, not an H100's ~13).
TEST(GemmHeuristic, Mxfp4WideTiles) {
  auto wide = [](int e, int n, int k, int expected, double bytes) {
    MaskedGemmProblem p{e, n, k, 128, expected};
    p.weights = WeightFormat::kMxfp4;
    return mxfp4_wide_tiles(p, choose_masked_config(p, kSms), kSms, bytes);
  };
  // 48-token plans (33..48 expected rows) on an H200's bytes per SM cycle:
  EXPECT_TRUE(wide(8, 4096, 7168, 44, 19.0));    // DeepSeek-V3 x 8 GEMM1: 256 tiles (2 rounds) -> 128 (1)
  EXPECT_TRUE(wide(32, 5888, 2944, 44, 19.0));   // gpt-oss-120b x 32 GEMM1: 12 rounds -> 6
  EXPECT_TRUE(wide(128, 5888, 2944, 44, 19.0));  // one rank of gpt-oss-120b at B = 1024: 45 rounds -> 23
  EXPECT_TRUE(wide(128, 2944, 2944, 44, 19.0));  // its GEMM2: 23 rounds -> 12
  EXPECT_TRUE(wide(8, 2944, 2944, 44, 19.0));    // gpt-oss-120b x 8 GEMM2 (N/128 = 23): 184 tiles (2 rounds) -> 96 (1)
  EXPECT_FALSE(wide(8, 5888, 2944, 44, 19.0));   // its GEMM1: 3 rounds -> 2 of double work
  EXPECT_FALSE(wide(8, 4096, 7168, 44, 13.0));   // an H100's bytes per cycle
  EXPECT_FALSE(wide(8, 4096, 7168, 44, 0.0));    // unknown
  EXPECT_FALSE(wide(2, 4096, 7168, 44, 19.0));   // 64 tiles: the 128-row plan splits K
  // 16- and 32-token plans keep 128 rows (run 42), 64-token ones have no 256-row kernel:
  EXPECT_FALSE(wide(8, 4096, 7168, 16, 19.0));
  EXPECT_FALSE(wide(128, 5888, 2944, 5, 19.0));  // one rank of gpt-oss-120b at B = 64
  EXPECT_FALSE(wide(8, 4096, 7168, 20, 19.0));   // 32-token tiles
  EXPECT_FALSE(wide(8, 4096, 7168, 60, 19.0));
  MaskedGemmProblem fp8{8, 4096, 7168, 128, 44};
  EXPECT_FALSE(mxfp4_wide_tiles(fp8, choose_masked_config(fp8, kSms), kSms, 19.0));
}

// The router's rule, by its two kernels' measured costs (router_logits.cu; bench_router on one
// H100, whose fastest configuration is named where the rule's differs): whole tiles at prefill
// sizes, K split over a cluster of up to 16 while the CTAs are few, the warp kernel for a token or
// two of a small router.
TEST(RouterHeuristic, Picks) {
  auto rule = [](int T, int E, int d) { return gpu::choose_router_config(T, E, d, kSms).to_string(); };
  EXPECT_EQ(rule(8192, 128, 2944), "tiles:1");  // gpt-oss-120b's prefill: 131.1 us (2 splits 132.9)
  EXPECT_EQ(rule(4160, 128, 2944), "tiles:2");
  EXPECT_EQ(rule(4096, 128, 2944), "tiles:2");  // 73.6 us (1 split 92.7, 4 splits 89.8)
  EXPECT_EQ(rule(1024, 128, 2944), "tiles:8");  // its decode at B = 1024 on one rank: 35.0 us (16: 34.8)
  EXPECT_EQ(rule(256, 128, 2944), "tiles:16");  // 18.0 us (8 splits 19.7)
  EXPECT_EQ(rule(64, 128, 2944), "tiles:16");   // 13.8 us; the warp kernel 74.2
  EXPECT_EQ(rule(1, 128, 2944), "tiles:16");    // 13.3 us; the warp kernel 15.6
  EXPECT_EQ(rule(128, 256, 7168), "tiles:16");  // DeepSeek-V3's 128 tokens per rank (B = 1024, EP8): 29.3 us
  EXPECT_EQ(rule(2, 256, 7168), "tiles:16");
  EXPECT_EQ(rule(1024, 256, 7168), "tiles:4");  // 123.4 us; 8 splits were faster (106.1): the fit's worst pick
  EXPECT_EQ(rule(8192, 256, 7168), "tiles:1");  // 592.8 us (2 splits 582.2)
  EXPECT_EQ(rule(256, 512, 4096), "tiles:8");   // Qwen3.5: 43.0 us (16 splits 40.7)
  EXPECT_EQ(rule(1, 64, 1024), "warps");        // a small router's single token: 8 passes of 128 columns
  EXPECT_EQ(rule(8, 64, 1024), "tiles:16");
}
