// moekit/quant.h: FP8 e4m3 quantisation on the CPU (the reference the CUDA kernels match).
//
// Activations: one fp32 scale per (row, 128 columns): scale = amax / 448 over the group
// (amax clamped below at kMinAmax so an all-zero group gets a finite scale), q = fp8(x / scale)
// with round-to-nearest-even and saturation (fp8.h). Dequantised value: fp8_to_float(q) * scale.
// Or, per token (Fp8Scaling::kPerToken), the same rule with the group the whole row; its one scale
// is written into each of the row's k/128 scale slots, so a reader of 1x128 scales gets the same
// values and one that takes a scale per row (gemm.h ContiguousGemmProblem::a_row_scales) reads the
// first slot.
// Weights: one fp32 scale per 128x128 block, the same rule over the block.
// The division x / scale is done in fp32 exactly as written here, so the GPU kernels that
// compute `x / scale` in fp32 produce the same bits.
// Round trip (docs/numerics.md): |x - dequantised| <= max(2^-4 |x|, 2^-10 scale), plus fp32
// rounding, with either scaling (a token's scale is its largest group's, so its small groups lose
// more of their values to the 2^-10 scale term). Errors: k or a shape not a multiple of 128, a NaN or infinite input (named by its
// index); the whole input is checked before anything is written.
#pragma once

#include <cstdint>

namespace moekit {

constexpr float kMinAmax = 1e-4f;

// How an activation row is scaled: one scale per 128 columns (DeepSeek-V3's recipe), or one per
// token.
enum class Fp8Scaling { kPerBlock, kPerToken };
const char* fp8_scaling_name(Fp8Scaling scaling);  // "1x128", "per-token"

// One row of k values (k a multiple of 128): q[k] and k/128 scales written at
// scales[0], scales[scale_stride], ... (the stride lets callers write the layout.h order).
void quantize_row_fp8(const float* x, int k, uint8_t* q, float* scales, int64_t scale_stride,
                      Fp8Scaling scaling = Fp8Scaling::kPerBlock);

// A [rows, cols] matrix in 128x128 blocks (rows, cols multiples of 128); scales [rows/128, cols/128].
void quantize_blocks_fp8(const float* x, int rows, int cols, uint8_t* q, float* scales);

// Inverse of quantize_row_fp8.
void dequantize_row_fp8(const uint8_t* q, const float* scales, int64_t scale_stride, int k, float* x);

}  // namespace moekit
