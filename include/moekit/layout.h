// moekit/layout.h: the memory layouts shared by `ep` (which writes them) and `kernels`
// (which reads them). Both sides index through these functions and nothing else.
//
// Quantisation blocks: activations carry one fp32 scale per (row, 128 columns of K), weights
// one per 128x128 block. K and N of every GEMM are multiples of kQuantBlock.
//
// Masked (decode), per local expert e of E_loc, up to M_max rows:
//   A        [E_loc, M_max, K] fp8 e4m3, K contiguous.
//   A scales [E_loc, K/128, M_max] fp32: for one expert and one K block the scales of all rows
//            are contiguous, because the GEMM loads the scales of a group of rows (its MMA N side
//            in swap-AB, its M side otherwise) for one K block at a time.
//   masked_m [E_loc] int32 on the device; rows at or past masked_m[e] are never read for
//            results and never written.
//   out      [E_loc, M_max, N] bf16.
//   Written by the dispatch receive side (recv_x, recv_scales, recv_count = masked_m) in a
//   canonical order, so every transport and the CPU reference produce the same bytes: the rows
//   of expert e are ordered by source rank, then by source token index.
//   recv_src [E_loc, M_max] int32: src_rank * T_max + src_token of each row (the combine's map).
//   M_max = P * T_max (every token of every rank may pick the expert).
// Weights ("NT", DeepSeek-V3 checkpoint format):
//   W        [E_loc, N, K] fp8 e4m3, K contiguous.
//   W scales [E_loc, N/128, K/128] fp32.
// MXFP4 weights (gpt-oss's checkpoint format, weights.h; the values in mxfp4.h):
//   W        [E_loc, N, K/2] bytes: two e2m1 codes per byte, K contiguous; element 2j of a row in
//            the low nibble of byte j, element 2j + 1 in the high nibble.
//   W scales [E_loc, N, K/32] e8m0 bytes: one power of two per 32 consecutive values of a row.
//   K and N multiples of kQuantBlock like every GEMM operand here (the loader pads gpt-oss's 2880
//   with zero weights), so the activations keep their 1x128 FP8 groups.
// Contiguous (prefill): every expert's rows together, each segment padded to a multiple of
//   the GEMM's block M:
//   A        [M_total, K] fp8; A scales [K/128, M_total] fp32 (same reason as above);
//   row_expert [M_total] int32: the local expert of each row, -1 for a padding row (skipped:
//            its output row is not written).
//   out      [M_total, N] bf16.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moekit {

constexpr int kQuantBlock = 128;
constexpr int kMxfp4Group = 32;  // values per e8m0 scale of an MXFP4 weight row

struct MaskedLayout {
  int num_experts = 0;  // E_loc
  int max_m = 0;        // M_max
  int k = 0;            // K, a multiple of kQuantBlock

  int k_blocks() const { return k / kQuantBlock; }
  size_t a_elems() const { return size_t(num_experts) * max_m * k; }
  size_t a_offset(int e, int m) const { return (size_t(e) * max_m + m) * k; }
  size_t scale_elems() const { return size_t(num_experts) * k_blocks() * max_m; }
  size_t scale_offset(int e, int m, int kb) const { return (size_t(e) * k_blocks() + kb) * max_m + m; }
  size_t out_elems(int n) const { return size_t(num_experts) * max_m * n; }
  size_t out_offset(int e, int m, int n_cols) const { return (size_t(e) * max_m + m) * n_cols; }
};

struct WeightLayout {
  int num_experts = 0;  // E_loc
  int n = 0;            // output features, a multiple of kQuantBlock
  int k = 0;            // input features, a multiple of kQuantBlock

  size_t w_elems() const { return size_t(num_experts) * n * k; }
  size_t w_offset(int e, int row) const { return (size_t(e) * n + row) * k; }
  size_t scale_elems() const { return size_t(num_experts) * (n / kQuantBlock) * (k / kQuantBlock); }
  size_t scale_offset(int e, int row, int col) const {
    return (size_t(e) * (n / kQuantBlock) + row / kQuantBlock) * (k / kQuantBlock) + col / kQuantBlock;
  }
};

struct Mxfp4WeightLayout {
  int num_experts = 0;  // E_loc
  int n = 0;            // output features, a multiple of kQuantBlock
  int k = 0;            // input features, a multiple of kQuantBlock

  size_t row_bytes() const { return size_t(k) / 2; }
  size_t row_scales() const { return size_t(k) / kMxfp4Group; }
  size_t w_bytes() const { return size_t(num_experts) * n * row_bytes(); }
  size_t w_offset(int e, int row) const { return (size_t(e) * n + row) * row_bytes(); }
  size_t scale_elems() const { return size_t(num_experts) * n * row_scales(); }
  size_t scale_offset(int e, int row) const { return (size_t(e) * n + row) * row_scales(); }
};

struct ContiguousLayout {
  int total_m = 0;  // M_total, sum of padded segments
  int k = 0;

  int k_blocks() const { return k / kQuantBlock; }
  size_t a_elems() const { return size_t(total_m) * k; }
  size_t a_offset(int m) const { return size_t(m) * k; }
  size_t scale_elems() const { return size_t(k_blocks()) * total_m; }
  size_t scale_offset(int m, int kb) const { return size_t(kb) * total_m + m; }
};

}  // namespace moekit
