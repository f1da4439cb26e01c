// Internal to moekit_cuda: the MoE layer's token quantisation (quantize.cu), bit for bit quant.h's
// quantize_row_fp8 in 1x128 groups. quant_gpu.h's public kernels live in the same file.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/launch.cuh"

namespace moekit::gpu {

// x [T, d] bf16 -> one masked "expert" for the shared expert's GEMM: out [max_m, d] fp8, out_scales
// [d/128, max_m]; also writes masked_m[0] = T (so a captured graph needs no host write).
void launch_quantize_tokens(const uint16_t* x, int num_tokens, int hidden, int max_m, uint8_t* out, float* out_scales,
                            int32_t* masked_m, cudaStream_t stream, const LaunchOptions& opt = {});

}  // namespace moekit::gpu
