// moekit/quant_gpu.h: FP8 e4m3 quantisation on the GPU, bit for bit quant.h's rules (the same
// amax, the same kMinAmax clamp, the same fp32 division and rounding), for callers whose tensors
// already live on the device: a serving engine quantising activations before the masked GEMM, or
// weights once at load time.
//
// Tokens (1x128 groups): x [batches, rows, k] -> q [batches, rows, k] and scales
// [batches, k/128, rows], the MN-major order the grouped GEMMs and dispatch read (layout.h).
// Weights (128x128 blocks): w [batches, n, k] -> q [batches, n, k] and scales
// [batches, n/128, k/128]. k must be a positive multiple of 128, n (blocks) a multiple of 128
// (0: nothing is launched).
//
// Non-finite input: the kernels cannot throw, so they report it. `first_bad`, when not null, is a
// device word the caller sets to ~0ull first; a kernel that meets a NaN or infinity lowers it to
// the flattened element index (atomicMin), and the caller reads it back once it may synchronise.
// The quantised output of such a group is unspecified. Nothing here allocates or synchronises, so
// both launches are graph-capturable. Shapes out of range are moekit::Error on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moekit::gpu {

// x holds bf16 bits (uint16_t) or fp32.
void quantize_tokens_fp8(const uint16_t* x, int64_t batches, int64_t rows, int k, uint8_t* q, float* scales,
                         unsigned long long* first_bad, cudaStream_t stream);
void quantize_tokens_fp8(const float* x, int64_t batches, int64_t rows, int k, uint8_t* q, float* scales,
                         unsigned long long* first_bad, cudaStream_t stream);

void quantize_blocks_fp8(const uint16_t* w, int64_t batches, int n, int k, uint8_t* q, float* scales,
                         unsigned long long* first_bad, cudaStream_t stream);
void quantize_blocks_fp8(const float* w, int64_t batches, int n, int k, uint8_t* q, float* scales,
                         unsigned long long* first_bad, cudaStream_t stream);

}  // namespace moekit::gpu
