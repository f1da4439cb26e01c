// tests/gpu: a typed device allocation for the GPU tests, freed with its owner, moved to and from
// host vectors, and filled with a poison byte pattern so that an unwritten output never passes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "moekit/cuda_check.h"

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n) : count(n) { MOEKIT_CUDA_CHECK(cudaMalloc(&ptr, n * sizeof(T))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& v) {
    MOEKIT_CUDA_CHECK(cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(count);
    MOEKIT_CUDA_CHECK(cudaMemcpy(v.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  void poison(unsigned char byte) { MOEKIT_CUDA_CHECK(cudaMemset(ptr, byte, count * sizeof(T))); }
};
