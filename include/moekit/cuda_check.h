// moekit/cuda_check.h: CUDA error checks at the API boundary (needs the CUDA runtime).
//
// MOEKIT_CUDA_CHECK(call) throws moekit::Error naming the call, its error string, file and line.
// MOEKIT_CUDA_CHECK_LAUNCH() checks the last launch error right after a kernel launch.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "moekit/check.h"

#define MOEKIT_CUDA_CHECK(call)                                                                        \
  do {                                                                                                 \
    cudaError_t moekit_err_ = (call);                                                                  \
    if (moekit_err_ != cudaSuccess)                                                                    \
      ::moekit::detail::throw_error(__FILE__, __LINE__, #call,                                         \
                                    std::string("CUDA error: ") + cudaGetErrorString(moekit_err_));    \
  } while (0)

#define MOEKIT_CUDA_CHECK_LAUNCH() MOEKIT_CUDA_CHECK(cudaGetLastError())

namespace moekit {

// What moekit reads off the device instead of hard-coding it.
struct DeviceInfo {
  int device = 0;
  std::string name;
  int num_sms = 0;
  int l2_bytes = 0;
  int max_smem_per_block = 0;  // opt-in limit
  int cc_major = 0, cc_minor = 0;
};

DeviceInfo query_device(int device = -1);  // -1: the current device

}  // namespace moekit
