// Device properties moekit sizes its grids and shared memory from.
#include "moekit/cuda_check.h"

namespace moekit {

DeviceInfo query_device(int device) {
  if (device < 0) MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceInfo info;
  info.device = device;
  info.name = prop.name;
  info.num_sms = prop.multiProcessorCount;
  info.l2_bytes = prop.l2CacheSize;
  info.max_smem_per_block = int(prop.sharedMemPerBlockOptin);
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  return info;
}

}  // namespace moekit
