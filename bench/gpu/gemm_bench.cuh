// gemm_bench.cuh: what the GEMM benchmarks share: device allocation, random FP8 codes and
// scales filled on the device, the median of per-iteration CUDA-event times, and the JSON file.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "moekit/check.h"
#include "moekit/cuda_check.h"

namespace moekit::gemm_bench {

// Writes `text` (the benchmark's JSON) to `path`; an Error naming the path when it cannot.
inline void write_text_file(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "w");
  MOEKIT_CHECK(f != nullptr, "cannot write " + path);
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

template <class T>
T* device_alloc(size_t n) {
  T* p = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}

// Random bytes of a hash of (index, seed); fp8: the two NaN codes become 0x3C.
__global__ void fill_random_bytes(uint8_t* p, size_t n, uint32_t seed, bool fp8) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    uint8_t c = uint8_t(h);
    if (fp8 && (c & 0x7F) == 0x7F) c = 0x3C;  // no NaN codes
    p[i] = c;
  }
}

__global__ void fill_random_scales(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2246822519u ^ seed;
    h ^= h >> 15;
    p[i] = 1e-3f * (0.5f + float(h & 0xFFFF) / 65536.0f);
  }
}

void fill_fp8(uint8_t* p, size_t n, uint32_t seed) {
  fill_random_bytes<<<1024, 256>>>(p, n, seed, true);
  MOEKIT_CUDA_CHECK_LAUNCH();
}
void fill_bytes(uint8_t* p, size_t n, uint32_t seed) {  // any byte (MXFP4 codes)
  fill_random_bytes<<<1024, 256>>>(p, n, seed, false);
  MOEKIT_CUDA_CHECK_LAUNCH();
}
void fill_scales(float* p, size_t n, uint32_t seed) {
  fill_random_scales<<<1024, 256>>>(p, n, seed);
  MOEKIT_CUDA_CHECK_LAUNCH();
}

// Median time in microseconds of `iters` calls of body(i), each between two events.
template <class F>
double median_us(int iters, F&& body, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) body(i);
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) MOEKIT_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    MOEKIT_CUDA_CHECK(cudaEventRecord(ev[2 * i]));
    body(i);
    MOEKIT_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1]));
  }
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> t(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    t[i] = ms * 1e3;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(t.begin(), t.end());
  return t[iters / 2];
}

}  // namespace moekit::gemm_bench
