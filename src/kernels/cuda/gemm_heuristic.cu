// The GEMM config heuristic: problem descriptor -> GemmConfig (gemm.h). Pure functions.
//
// Masked: below 128 expected rows per expert the weights go on the MMA's M side (swap-AB) and
// the tokens on its N side, in the smallest of 16/32/64/128 that holds expected_m: the decode
// GEMM is a weight stream (KERNELS.md), so a token block only has to be wide enough that each
// weight tile is streamed once. Above that, 128x128 tiles with the tokens on the M side.
// Contiguous: BM 128 unless that leaves SMs idle, then BM 64.
#include <algorithm>

#include "kernels/cuda/gemm_host.cuh"

namespace moekit {
namespace gemm_detail {

int choose_splits(long tiles, int num_sms, int k_blocks) {
  if (tiles <= 0) return 1;
  int best = 1;
  double best_fill = 0;
  for (int s = 1; s <= std::min(4, k_blocks); ++s) {
    long units = tiles * s;
    long waves = (units + num_sms - 1) / num_sms;
    double fill = double(units) / double(waves * num_sms);
    if (fill >= 0.9) return s;
    if (fill > best_fill + 1e-9) best_fill = fill, best = s;
  }
  return best;
}

}  // namespace gemm_detail

GemmConfig choose_masked_config(const MaskedGemmProblem& p, int num_sms) {
  GemmConfig cfg;
  const int m = p.expected_m > 0 ? std::min(p.expected_m, p.max_m) : p.max_m;
  cfg.block_n = 128;
  if (m <= 128) {
    cfg.swap_ab = true;
    cfg.block_m = m <= 16 ? 16 : m <= 32 ? 32 : m <= 64 ? 64 : 128;
  } else {
    cfg.swap_ab = false;
    cfg.block_m = 128;
  }
  long tiles = long(p.num_experts) * (p.n / cfg.block_n) * ((m + cfg.block_m - 1) / cfg.block_m);
  cfg.num_splits = gemm_detail::choose_splits(tiles, num_sms, p.k / 128);
  cfg.num_ctas = num_sms;
  return cfg;
}

GemmConfig choose_contiguous_config(const ContiguousGemmProblem& p, int num_sms) {
  GemmConfig cfg;
  cfg.swap_ab = false;
  cfg.block_n = 128;
  long tiles128 = long(p.total_m / 128) * (p.n / 128);
  cfg.block_m = tiles128 >= num_sms ? 128 : 64;
  cfg.num_splits = 1;
  cfg.num_ctas = num_sms;
  return cfg;
}

}  // namespace moekit
