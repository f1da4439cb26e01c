// The GEMM config heuristic: problem descriptor -> GemmConfig (gemm.h). Pure functions.
//
// Masked: up to 64 expected rows per expert the weights go on the MMA's M side (swap-AB) and
// the tokens on its N side, in the smallest of 16/32/48/64 that holds expected_m (16/32/64 for
// the gated epilogue): the decode
// GEMM is a weight stream (docs/theory.md §Padding), so a token block only has to be wide enough that each
// weight tile is streamed once. Callers should pass an upper-typical count (upper_typical_rows:
// mean + 2·sqrt(mean) for uniform routing, what the layer and the benches pass): an expert above
// it costs a second token block.
// From 65 to 192, tokens on the M side in blocks of 128 (measured, run 18); above, in blocks of
// 64 or 128, whichever pads less. With blocks of 128, 256 weight rows per tile as for the
// contiguous layout (below) where the 256-column tiles fill a wave (they have no split-K).
// Swap-AB with a BF16 output, 16-token blocks and K up to kWideSwapMaxK: 256 weight rows per
// tile (two 128-row slabs) where those tiles fill a wave; 0-1.9% off the decode step at B = 8-256,
// 1.1-1.3% slower with 32- and 64-token blocks (docs/gemm.md runs 41-42).
// Gated (SiLU·up + FP8 epilogue): a tile is 128 gate + 128 up rows, swap-AB, at most 64 tokens
// (two 64-row slabs per warpgroup: 128 tokens would need 256 accumulator registers per thread);
// 32-token blocks instead of 16 where a fuller last expert (last_expert_m) would cost a round.
// Contiguous: BM 128 unless that leaves SMs idle, then BM 64; with BM 128, 256 weight rows per
// tile where the rounds of tiles cost less than with 128 (the stage bytes per FLOP, below).
// Clusters (cluster = 2, the token tile multicast to two CTAs) are never chosen: on the H200 they
// measured 6-7% slower than single CTAs once the epilogue stopped stalling, and equal before
// (docs/gemm.md, runs 9-11); they stay available as a forced config.
// MXFP4 weights: swap-AB always (gemm_mxfp4.cuh); masked as above, with 48-token blocks too, up
// to 128 tokens per block, contiguous with blocks of 128 tokens. (Two CTAs per SM with 16-token
// blocks measured 7-20% slower and were removed: docs/gemm-mxfp4.md run 22.)
#include <algorithm>
#include <climits>
#include <cmath>
#include <initializer_list>

#include "kernels/cuda/gemm_host.cuh"

namespace moekit {
namespace gemm_detail {

int choose_splits(long tiles, int num_sms, int k_blocks) {
  // Split only when the tiles do not even fill one wave: a partial last wave of a long stream
  // is cheaper than the partials' round trip (measured, docs/gemm.md).
  // Then as many splits as keep all units in one wave, each split at least 4 K blocks deep.
  if (tiles <= 0 || tiles >= num_sms) return 1;
  long s = std::min<long>({8, k_blocks / 4, num_sms / tiles});
  return int(std::max<long>(s, 1));
}

int planned_rows(const MaskedGemmProblem& p) { return p.expected_m > 0 ? std::min(p.expected_m, p.max_m) : p.max_m; }

}  // namespace gemm_detail

namespace {
// The normal orientation's share of the tensor rate per tile width, measured on the H200
// (docs/gemm.md run 17): what the tile-width choice below weighs.
constexpr double kEff128 = 0.62, kEff256 = 0.70;
// The deepest K at which swap-AB tiles take 256 weight rows (16 blocks of 128).
constexpr int kWideSwapMaxK = 2048;

// Normal orientation, 128-token blocks: 256 weight rows per tile where the rounds of tiles cost
// less than with 128. 256-column tiles take in fewer stage bytes per FLOP (48 KB per 128-deep
// block against 2 x 32 KB for two 128 x 128 tiles), and with every SM loading each takes in only
// ~40 B of stages per cycle from the L2 (bench_wgmma, docs/gemm.md runs 17 and 21; twice that with
// half the SMs loading): ~62% of the tensor rate for 128 x 128, ~83% for 128 x 256 with nothing
// else in the kernel, 0.62 and 0.70 measured in the GEMM. Where N is an odd multiple of 128 the
// last tile of an expert is half empty, and the wider tiles fill the last round of SMs
// differently: compare rounds x tile time, 256 where it is 5% faster. token_blocks: the launch's
// 128-token blocks (for each, cols / block_n tiles).
int wide_or_narrow(long token_blocks, int cols, int num_sms) {
  const auto rounds = [&](long tiles) { return double((tiles + num_sms - 1) / num_sms); };
  const auto cost = [&](int bn, double efficiency) {
    return rounds(token_blocks * ((cols + bn - 1) / bn)) * bn / efficiency;
  };
  return cost(256, kEff256) < 0.95 * cost(128, kEff128) ? 256 : 128;
}

// Gated tiles of 16 tokens where a known fuller last expert (the merged shared expert: every
// token of the rank, 32 rows at DeepSeek-V3's B = 256 on EP8) takes a second token block: its
// second block's tiles spill past a whole number of rounds (544 on 132 SMs: a fifth tile for 16
// CTAs). Blocks of 32 tokens for every expert fit one round fewer (528 tiles): that GEMM1 takes
// 233-236 us against 248-250 (bench_stream; 230-233 for 528 tiles of 16, so the wider tile costs
// ~1% here), and the step is 12 us per layer faster (docs/layer-gpu.md item 26). Not 32 -> 64
// (B = 512, the shared expert's 64 rows): 2% faster alone, 4.6% slower in the step (item 28).
bool gated_blocks_of_32_save_a_round(const MaskedGemmProblem& p, int m, int num_sms) {
  if (p.last_expert_m <= 16 || p.last_expert_m > 32 || m > 16 || p.num_experts < 1) return false;
  const long w_blocks = (p.n / 2 + 127) / 128;  // 128 gate + 128 up rows per tile
  const auto rounds = [&](int bt) {
    const long blocks = long(p.num_experts - 1) * ((m + bt - 1) / bt) + (p.last_expert_m + bt - 1) / bt;
    return (blocks * w_blocks + num_sms - 1) / num_sms;
  };
  return 1.1 * double(rounds(32)) < double(rounds(16));  // a wider tile may cost up to 10%
}

// The smallest of a kernel's compiled token blocks (ascending) that holds m rows; the largest
// where none does (the rest take more blocks).
int smallest_block(int m, std::initializer_list<int> blocks) {
  for (int b : blocks)
    if (m <= b) return b;
  return *(blocks.end() - 1);
}
}  // namespace

GemmConfig choose_masked_config(const MaskedGemmProblem& p, int num_sms) {
  GemmConfig cfg;
  const int m = gemm_detail::planned_rows(p);
  cfg.block_n = 128;
  if (p.epilogue == GemmEpilogue::kSiluMulFp8) {
    cfg.swap_ab = true;
    cfg.block_m = smallest_block(m, {16, 32, 64});
    if (cfg.block_m == 16 && gated_blocks_of_32_save_a_round(p, m, num_sms)) cfg.block_m = 32;
  } else if (p.weights == WeightFormat::kMxfp4) {
    // The only MXFP4 orientation; more tokens take more 128-token blocks. 48-token tiles for
    // 33..48 rows: a tile's tensor work and promotion grow with its tokens, and 48 holds the
    // upper-typical 44 rows of 32 per expert (gpt-oss-120b at B = 1024) in one block: 7-8% faster
    // than 64-token tiles on the same rows (docs/gemm-mxfp4.md run 23).
    cfg.swap_ab = true;
    cfg.block_m = smallest_block(m, {16, 32, 48, 64, 128});
    // The widening stays in the math threads' registers (mxfp4_widen_wgs = 0). Two widening
    // warpgroups (gemm_mxfp4_widen.cuh) won 2% on gpt-oss-120b's step while the register kernel
    // made eight e4m3 tables per stage (run 24); with mxfp4.h's K order it makes two, and the
    // registers won that step at B = 1, 8, 64 and 1024 (1.4-7%) and lost 0.9% at B = 256, in
    // three calls on H100s (docs/gemm-mxfp4.md run 27). MOEKIT_MXFP4_WIDEN picks the others.
  } else if (m <= 64) {
    cfg.swap_ab = true;
    // 48 where it holds the rows: the pair 3% faster than 64-token tiles at DeepSeek-V3's 44
    // upper-typical rows (docs/gemm.md run 78).
    cfg.block_m = smallest_block(m, {16, 32, 48, 64});
  } else if (m <= 192) {
    // 65..192 rows: tokens on the M side in blocks of 128, even where two blocks hold ~130-190
    // rows. Measured faster than swap-AB 128-token tiles at ~100 rows per expert and than
    // blocks of 64 (one math warpgroup) or swap-AB 160/192-token tiles at ~150 (docs/gemm.md
    // run 18).
    cfg.swap_ab = false;
    cfg.block_m = 128;
  } else {
    // Big batches: tokens on the M side; the block that wastes fewer padded rows.
    cfg.swap_ab = false;
    cfg.block_m = (m + 63) / 64 * 64 < (m + 127) / 128 * 128 ? 64 : 128;
  }
  const int cols = p.epilogue == GemmEpilogue::kSiluMulFp8 ? p.n / 2 : p.n;  // output columns
  const long token_blocks = long(p.num_experts) * ((m + cfg.block_m - 1) / cfg.block_m);
  if (!cfg.swap_ab && cfg.block_m == 128) {
    // As for the contiguous layout; the 256-column tile has no split-K, so only where its tiles
    // fill a wave.
    const int bn = wide_or_narrow(token_blocks, cols, num_sms);
    if (bn == 256 && token_blocks * ((cols + 255) / 256) >= num_sms) cfg.block_n = 256;
  }
  if (cfg.swap_ab && cfg.block_m == 16 && p.epilogue == GemmEpilogue::kBf16 && p.weights == WeightFormat::kFp8 &&
      p.n % 256 == 0 && p.k <= kWideSwapMaxK && token_blocks * (p.n / 256) >= num_sms) {
    // Short K: 256 weight rows per tile halve the tiles' fixed work per byte; only where the
    // tiles still fill a wave, so that split-K is not needed to keep the SMs busy. Only with
    // 16-token blocks: with 32 and 64 the step was 1.1-1.3% slower (runs 41-42).
    cfg.block_n = 256;
  }
  long tiles = token_blocks * ((cols + cfg.block_n - 1) / cfg.block_n);
  // block_n = 64 (swap-AB, 16 tokens) fills the last wave better but measured slower once the
  // GEMMs overlap (docs/gemm.md, run 7): not chosen here, available as a forced config.
  cfg.num_ctas = num_sms;
  cfg.num_splits = gemm_detail::choose_splits(tiles, cfg.num_ctas, p.k / 128);
  return cfg;
}

// The bytes per SM cycle from which run 36's 256-row tiles are predicted to pay: the 128-row kernel's
// chain takes ~605 SM cycles for a 10.7 KB stage when HBM is not in the way, ~18 B per cycle, and
// on an H100 (~13 B per cycle at its peak) both tilings take ~700 from HBM. Between the two GPUs.
// The 32- and 48-token tiles' chains shorten likewise (runs 37-39: -18% and -24% from the L2; at
// the H100's base clock -9% and -16% on gpt-oss-120b's GEMM1, -14% at DeepSeek-V3's 44 rows).
// Measured on an H200 (run 42), the rule takes 48-token plans only: there the pair is 11-12%
// faster (DeepSeek-V3 x 8 and gpt-oss-120b x 32 at 32-48 rows) and one rank of gpt-oss-120b 6.7%
// at B = 1024; at 16 tokens the wider tiles were -1% to +3% (+8% at B = 1, where 4 experts of 128
// have rows and half as many tiles stream their weights), and at 32 tokens +1.5% (B = 512).
constexpr double kMxfp4WideTilesBytesPerCycle = 15.0;

bool mxfp4_wide_tiles(const MaskedGemmProblem& p, const GemmConfig& cfg, int num_sms, double hbm_bytes_per_sm_cycle) {
  if (p.weights != WeightFormat::kMxfp4 || !cfg.swap_ab || cfg.block_m != 48 || cfg.block_n != 128 ||
      cfg.mxfp4_widen_wgs != 0 || num_sms < 1 || hbm_bytes_per_sm_cycle < kMxfp4WideTilesBytesPerCycle)
    return false;
  const int m = gemm_detail::planned_rows(p);
  const long token_blocks = long(p.num_experts) * ((m + cfg.block_m - 1) / cfg.block_m);
  const long tiles128 = token_blocks * (p.n / 128), tiles256 = token_blocks * ((p.n + 255) / 256);
  if (tiles128 < num_sms) return false;  // the 128-row plan splits K to fill the SMs; no room for wider tiles
  const auto rounds = [&](long tiles) { return double((tiles + num_sms - 1) / num_sms); };
  // A 256-row tile is two 128-row tiles' work (an odd N/128's last one too: its second slab is
  // computed, not stored): no more rounds of it than the narrow plan's (5% slack: with many rounds
  // the last one's quantisation is noise; gpt-oss-120b x 8's 184 tiles on 132 SMs cost a third
  // more, 10-13% slower measured in run 34).
  return 2 * rounds(tiles256) <= 1.05 * rounds(tiles128);
}

int upper_typical_rows(int64_t rows, int experts) {
  MOEKIT_CHECK(rows >= 0 && experts >= 1, "upper_typical_rows: rows = " + std::to_string(rows) + " and experts = " +
                                               std::to_string(experts) + ", expected rows >= 0 and experts >= 1");
  const double mean = double(rows) / experts;
  return int(std::min(double(INT_MAX), std::max(1.0, std::ceil(mean + 2 * std::sqrt(mean)))));
}

GemmConfig choose_contiguous_config(const ContiguousGemmProblem& p, int num_sms) {
  GemmConfig cfg;
  cfg.block_n = 128;
  cfg.num_splits = 1;
  cfg.num_ctas = num_sms;
  if (p.weights == WeightFormat::kMxfp4) {  // swap-AB, 128 tokens on the MMA's N side
    cfg.swap_ab = true;
    cfg.block_m = 128;
    return cfg;
  }
  cfg.swap_ab = false;
  long tiles128 = long(p.total_m / 128) * (p.n / 128);
  cfg.block_m = tiles128 >= num_sms ? 128 : 64;
  if (cfg.block_m == 128) cfg.block_n = wide_or_narrow(p.total_m / 128, p.n, num_sms);
  return cfg;
}

GemmConfig choose_mxfp4_fp8_copy_config(const ContiguousGemmProblem& p, int num_sms) {
  MOEKIT_CHECK(p.weights == WeightFormat::kMxfp4,
               "choose_mxfp4_fp8_copy_config: the problem's weights are FP8; the FP8 copy is of MXFP4 weights");
  GemmConfig cfg;  // the FP8 kernel's prefill tile (docs/gemm.md runs 17-29)
  cfg.swap_ab = false;
  cfg.block_m = 128;
  cfg.block_n = 256;
  cfg.num_splits = 1;
  cfg.num_ctas = num_sms;
  cfg.mxfp4_fp8_copy = true;
  return cfg;
}

// The copy beside the GEMM must finish no later than the GEMM on the SMs left to it. Per SM, the
// FP8 kernel multiplies at ~9 TFLOP/s (1200 over 132 SMs) and a copy CTA moves ~50 GB/s of the
// copy's 1.53 bytes per weight (4.25 bits read, 8 written): 49-53 measured on one H100 with 4 to 32
// copy SMs (docs/gemm-mxfp4.md run 33). With x = copy bytes per copy SM over FLOPs per GEMM SM in
// time, C SMs suffice when C / (SMs - C) >= x; a quarter more for the GEMM's head start on the
// first row blocks, and at least 4, at most half the SMs.
GemmConfig choose_mxfp4_fp8_copy_beside_config(const ContiguousGemmProblem& p, int num_sms, int copy_ctas) {
  MOEKIT_CHECK(copy_ctas >= 0 && copy_ctas < num_sms, "choose_mxfp4_fp8_copy_beside_config: copy_ctas = " +
                                                          std::to_string(copy_ctas) + "; expected 0 (the heuristic's) "
                                                          "or 1.." + std::to_string(num_sms - 1));
  GemmConfig cfg = choose_mxfp4_fp8_copy_config(p, num_sms);
  if (copy_ctas == 0) {
    constexpr double kGemmFlopsPerSm = 9.0e12, kCopyBytesPerSm = 50e9;
    const double weights = double(p.num_experts) * p.n * p.k;
    const double flops = 2.0 * double(p.total_m) * p.n * p.k;
    const double x = 1.53 * weights / kCopyBytesPerSm / (flops / kGemmFlopsPerSm);
    const double c = 1.25 * num_sms * x / (1 + x);
    copy_ctas = std::clamp(int(std::ceil(c)), std::min(4, num_sms / 2), num_sms / 2);
  }
  cfg.mxfp4_fp8_copy_ctas = copy_ctas;
  cfg.num_ctas = num_sms - copy_ctas;
  return cfg;
}

}  // namespace moekit
