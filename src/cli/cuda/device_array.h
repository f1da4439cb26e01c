// Internal to src/cli/cuda: a device array owned by the host code of the CUDA backends, and a
// download helper.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "moekit/cuda_check.h"

namespace moekit::cli {

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  explicit DeviceArray(size_t n) { MOEKIT_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T))); }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

template <class T>
std::vector<T> download(const T* p, size_t n) {
  std::vector<T> h(n);
  if (n) MOEKIT_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace moekit::cli
