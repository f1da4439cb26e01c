// gemm_epilogue.cuh: the FP8 grouped GEMM's stores, straight from the accumulator registers:
// BF16 (both orientations) and the gated tile's SiLU(gate)·up in FP8 with its 1x128 scales.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemm_schedule.cuh"
#include "kernels/cuda/silu_fp8.cuh"
#include "moekit/bf16.h"

namespace moekit::gemm_detail {

// Where a consumer thread's accumulator registers sit in the tile. m64nN fragment: register i
// holds MMA row row + ((i/2) % 2)·8 and MMA column col + (i/4)·8 + i%2.
struct Fragment {
  int row;        // wg·64 + warp_in_wg·16 + lane/4
  int col;        // (lane % 4)·2
  int mtid;       // 0 .. math threads - 1
  int math_warp;  // 0 .. math warps - 1
};

// swap-AB: accumulator rows are weight rows n, columns are tokens. Masked: out[e, t0 + col,
// w0 + row] for tokens below masked_m; contiguous: out[t0 + col, w0 + row] for rows that are not
// padding. args.bias (MXFP4 plans only; null otherwise): bias[e, w0 + row] is added in fp32 before
// the rounding.
template <bool kMasked, int kBlockT, int kRegs>
__device__ __forceinline__ void store_bf16_transposed(const KernelArgs& args, const TileInfo& t, const float* acc,
                                                      const Fragment& f) {
  const size_t row0 = kMasked ? size_t(t.e) * args.rows + t.t0 : size_t(t.t0);
  uint16_t* out = args.out + row0 * args.n + t.w0;
  float bias[2] = {0.0f, 0.0f};
  if (args.bias) {
    bias[0] = __ldg(args.bias + size_t(t.e) * args.n + t.w0 + f.row);
    bias[1] = __ldg(args.bias + size_t(t.e) * args.n + t.w0 + f.row + 8);
  }
  uint16_t v[kRegs];  // converted before the first store (store_bf16 says why)
#pragma unroll
  for (int i = 0; i < kRegs; ++i) v[i] = ptx::to_bf16(acc[i] + bias[(i / 2) % 2]);
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    const int col = (i / 4) * 8 + f.col + i % 2;
    const int row = f.row + ((i / 2) % 2) * 8;
    const bool real = kMasked ? t.t0 + col < t.m_valid : is_real_row(t, col);
    if (real) out[size_t(col) * args.n + row] = v[i];
  }
}

// Split-K: each split of a tile writes its fp32 partials to the workspace; the last split to
// arrive (an atomic counter per tile, which it resets for the next launch) sums them in split
// order, so the result does not depend on which split finished last. Returns true in the CTA
// that stores the tile (acc then holds the sum). Called by all math threads.
template <int kAccRegs, int kMathThreads>
__device__ __forceinline__ bool reduce_splits(const KernelArgs& args, const TileInfo& t, float* acc, int mtid,
                                              int* last_flag) {
  const int splits = args.num_splits;
  float* my = args.partials + (size_t(t.slot) * splits + t.split) * kAccRegs * kMathThreads;
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) __stcg(my + i * kMathThreads + mtid, acc[i]);
  __threadfence();
  math_barrier<kMathThreads>();
  if (mtid == 0) *last_flag = atomicAdd(args.counters + t.slot, 1) == splits - 1;
  math_barrier<kMathThreads>();
  if (!*last_flag) return false;
  __threadfence();
  if (mtid == 0) args.counters[t.slot] = 0;  // every split has arrived: ready for the next launch
  // The loads of one split are independent, so all kAccRegs of them are in flight together: one
  // L2 round trip per split, not per register (the per-register chain cost ~5 us per tile, run 1).
  const float* base = args.partials + size_t(t.slot) * splits * kAccRegs * kMathThreads;
  float sum[kAccRegs];
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) sum[i] = 0.0f;
  for (int sp = 0; sp < splits; ++sp) {
    const float* part_sp = base + size_t(sp) * kAccRegs * kMathThreads + mtid;
    float v[kAccRegs];
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) v[i] = sp == t.split ? acc[i] : __ldcg(part_sp + i * kMathThreads);
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) sum[i] += v[i];
  }
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) acc[i] = sum[i];
  return true;
}

// swap-AB, staged: a warp's 16 weight rows are 16 neighbouring output columns, 32 bytes of each
// token's output row. The warp writes its values (as BF16) into 32-byte token rows of its own
// shared memory, then each lane writes 16-byte halves of them: kBlockT / 16 stores per thread
// instead of kRegs 2-byte ones. The two halves of a token row swap places for tokens with bit 2
// set, so the fragment's writes (4 token pairs x 8 weight rows per instruction) and the 16-byte
// reads (4 tokens per quarter warp) each hit 32 distinct banks.
template <bool kMasked, int kBlockT, int kRegs>
__device__ __forceinline__ void store_bf16_transposed_staged(const KernelArgs& args, const TileInfo& t,
                                                             const float* acc, const Fragment& f,
                                                             uint8_t* warp_rows) {
  static_assert(kRegs == kBlockT / 2 && kBlockT % 16 == 0, "an m64 x kBlockT accumulator");
  const int lane = f.mtid % 32;
  const int warp_col0 = f.row - lane / 4;  // the warp's first weight row in the tile
  uint16_t* half_words = reinterpret_cast<uint16_t*>(warp_rows);
  float bias[2] = {0.0f, 0.0f};
  if (args.bias) {
    bias[0] = __ldg(args.bias + size_t(t.e) * args.n + t.w0 + f.row);
    bias[1] = __ldg(args.bias + size_t(t.e) * args.n + t.w0 + f.row + 8);
  }
  auto word_of = [](int c, int half) { return 8 * c + 4 * (half ^ ((c >> 2) & 1)); };  // a token row's half
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    const int r = lane / 4 + ((i / 2) % 2) * 8;  // weight row within the warp's 16
    const int c = (i / 4) * 8 + (lane % 4) * 2 + i % 2;
    half_words[2 * (word_of(c, r >> 3) + ((r & 7) >> 1)) + (r & 1)] = ptx::to_bf16(acc[i] + bias[(i / 2) % 2]);
  }
  __syncwarp();
  const size_t row0 = kMasked ? size_t(t.e) * args.rows + t.t0 : size_t(t.t0);
  uint16_t* out = args.out + row0 * args.n + t.w0 + warp_col0;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(warp_rows);
#pragma unroll
  for (int s = 0; s < kBlockT / 16; ++s) {
    const int c = (s * 32 + lane) / 2, half = lane % 2;
    const uint4 v = *reinterpret_cast<const uint4*>(words + word_of(c, half));
    const bool real = kMasked ? t.t0 + c < t.m_valid : is_real_row(t, c);
    if (real) *reinterpret_cast<uint4*>(out + size_t(c) * args.n + half * 8) = v;
  }
  __syncwarp();  // the staging rows are free for the next tile
}

// Normal orientation: accumulator rows are tokens, columns weight rows. Straight from the
// fragment each store instruction of a warp would write 4-byte pieces of 8 rows, and the stores
// of a tile queue up at the load-store unit (a fifth of the contiguous GEMM's time, run 10). So
// each warp stages its 16 rows through its own shared-memory rows, 64 columns at a time, and
// writes them back as 16-byte pieces of whole 128-byte row segments: a quarter of the store
// instructions, each one row-contiguous. Only the warp itself touches its staging rows
// (__syncwarp orders them). Rows are padded to 36 words so that the fragment's writes (8 rows x
// 4 words per instruction) and the 16-byte reads each hit 32 distinct banks.
constexpr int kEpiRowWords = 36;                          // 64 BF16 columns + 4 words of padding
constexpr int kEpiWarpBytes = 16 * kEpiRowWords * 4;      // 16 rows per warp
// Swap-AB tiles of 32, 48 and 64 tokens stage too (store_bf16_transposed_staged): 32 bytes per
// token per warp. (16 tokens store 8 values per thread, little to gain; 128 made ptxas spill.)
constexpr bool stages_transposed(bool swap_ab, bool gated, int block_t) {
  return swap_ab && !gated && (block_t == 32 || block_t == 48 || block_t == 64);
}
// The staging rows of a kernel instance.
constexpr int epilogue_smem_bytes(bool swap_ab, bool gated, int math_wgs, int block_t) {
  return (!swap_ab && !gated)                          ? math_wgs * 4 * kEpiWarpBytes
         : stages_transposed(swap_ab, gated, block_t) ? math_wgs * 4 * block_t * 32
                                                       : 0;
}
// kAffine (an MXFP4 plan's FP8 copy, mxfp4_fp8_copy.cuh): column n's value is acc · out_col_scale[e, n]
// + bias[e, n] in fp32 before the rounding (the row factor 2^(base - 127) of the MXFP4 kernels, a
// power of two, and gpt-oss's bias), as gemm_mxfp4.cuh computes it.
template <bool kMasked, int kRegs, bool kAffine = false>
__device__ __forceinline__ void store_bf16(const KernelArgs& args, const TileInfo& t, const float* acc,
                                           const Fragment& f, uint8_t* warp_rows) {
  static_assert(kRegs == 64 || kRegs == 128, "a 64 x 128 or 64 x 256 accumulator per warpgroup");
  const int lane = f.mtid % 32, q = lane % 4;
  const int warp_row0 = f.row - lane / 4;  // the warp's first tile row
  uint32_t* buf = reinterpret_cast<uint32_t*>(warp_rows);
  const size_t row_base = kMasked ? size_t(t.e) * args.rows + t.t0 : size_t(t.t0);
  uint16_t* out = args.out + (row_base + warp_row0) * args.n + t.w0;
  // 64 columns at a time; a 256-column tile that reaches past N stores only its columns below N
  // (N and w0 are multiples of 128).
#pragma unroll
  for (int part = 0; part < kRegs / 32; ++part) {
    if (t.w0 + part * 64 >= args.n) break;
    // Register pair i holds row lane/4 + 8·((i/2) % 2), columns (i/4)·8 + 2q, +1.
    float scale[8][2], bias[8][2];  // kAffine: this part's columns j·8 + 2q, +1 of the thread
    if constexpr (kAffine) {
      const size_t col0 = size_t(t.e) * args.n + t.w0 + part * 64 + 2 * q;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          scale[j][c] = __ldg(args.out_col_scale + col0 + j * 8 + c);
          bias[j][c] = args.bias ? __ldg(args.bias + col0 + j * 8 + c) : 0.0f;
        }
    }
#pragma unroll
    for (int ii = 0; ii < 32; ii += 2) {
      const int i = part * 32 + ii;
      const int r = lane / 4 + ((i / 2) % 2) * 8, j = ii / 4;
      float lo = acc[i], hi = acc[i + 1];
      if constexpr (kAffine) {
        lo = lo * scale[j][0] + bias[j][0];
        hi = hi * scale[j][1] + bias[j][1];
      }
      buf[r * kEpiRowWords + j * 4 + q] = ptx::pack_bf16x2(lo, hi);
    }
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 4; ++s) {  // 4 rows x 128 bytes per instruction
      const int r = lane / 8 + s * 4, chunk = lane % 8;
      const uint4 v = *reinterpret_cast<const uint4*>(buf + r * kEpiRowWords + chunk * 4);
      const bool real = kMasked ? t.t0 + warp_row0 + r < t.m_valid : is_real_row(t, warp_row0 + r);
      if (real) *reinterpret_cast<uint4*>(out + size_t(r) * args.n + part * 64 + chunk * 8) = v;
    }
    __syncwarp();  // the staging rows are free for the next 64 columns
  }
}

// Gated swap-AB tile: register i of `gate` and of `up` are the same (act column, token), act
// column = w0 + f.row + ((i/2) % 2)·8, so SiLU(gate)·up needs no data movement. Each value is
// first rounded to BF16, as the staged path's GEMM output is, and then goes through the
// activation kernel's exact operations (silu_fp8.cuh): the FP8 codes and scales are the staged
// path's bits whenever the accumulators are. The tile's 128 act columns are one quantisation
// group, so a token's amax is a reduction over the 8 math warps: 16 rows per warp by shuffle,
// then through shared memory.
template <int kBlockT, int kRegs, int kMathThreads>
__device__ __forceinline__ void store_silu_mul_fp8(const KernelArgs& args, const TileInfo& t, const float* gate,
                                                   const float* up, const Fragment& f) {
  constexpr int kMathWarps = kMathThreads / 32;
  constexpr int kCols = kBlockT / 8;  // token column groups a thread holds, two columns each
  __shared__ float warp_amax[kMathWarps][kBlockT];
  const int lane = f.mtid % 32;
  float v[kRegs];
  float amax[kCols][2];
#pragma unroll
  for (int j = 0; j < kCols; ++j) amax[j][0] = amax[j][1] = 0.0f;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    v[i] = silu_mul(bf16_to_float(float_to_bf16(gate[i])), bf16_to_float(float_to_bf16(up[i])));
    amax[i / 4][i % 2] = fmaxf(amax[i / 4][i % 2], fabsf(v[i]));
  }
  // Lanes with the same lane % 4 hold the same token columns: reduce over lane / 4.
#pragma unroll
  for (int j = 0; j < kCols; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) amax[j][c] = fmaxf(amax[j][c], __shfl_xor_sync(0xFFFFFFFFu, amax[j][c], o));
  if (lane < 4) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      warp_amax[f.math_warp][j * 8 + f.col] = amax[j][0];
      warp_amax[f.math_warp][j * 8 + f.col + 1] = amax[j][1];
    }
  }
  math_barrier<kMathThreads>();
  float scale[kCols][2];
  double inv[kCols][2];  // reciprocal_rn of each scale, once for its 8 values
#pragma unroll
  for (int j = 0; j < kCols; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float a = 0.0f;
#pragma unroll
      for (int w = 0; w < kMathWarps; ++w) a = fmaxf(a, warp_amax[w][j * 8 + f.col + c]);
      scale[j][c] = fp8_group_scale(a);
      inv[j][c] = reciprocal_rn(scale[j][c]);
    }
  math_barrier<kMathThreads>();  // warp_amax is free for the next tile
  const int inter = args.n / 2;
  uint8_t* out = args.act + (size_t(t.e) * args.rows + t.t0) * inter + t.w0;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    const int col = (i / 4) * 8 + f.col + i % 2;
    const int row = f.row + ((i / 2) % 2) * 8;
    if (t.t0 + col < t.m_valid) out[size_t(col) * inter + row] = fp8_quantize_by(v[i], inv[i / 4][i % 2]);
  }
  if (f.mtid < 4) {  // one thread per pair of token columns writes their scales
    float* sc = args.act_scales + (size_t(t.e) * (inter / kBlockK) + t.w0 / kBlockK) * args.rows + t.t0;
#pragma unroll
    for (int j = 0; j < kCols; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (t.t0 + j * 8 + f.col + c < t.m_valid) sc[j * 8 + f.col + c] = scale[j][c];
  }
}

}  // namespace moekit::gemm_detail
