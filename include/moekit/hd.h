// moekit/hd.h: MOEKIT_HD, the qualifier of scalar helpers shared by the host and the kernels:
// __host__ __device__ __forceinline__ under nvcc, plain inline elsewhere (the CPU build).
#pragma once

#if defined(__CUDACC__)
#define MOEKIT_HD __host__ __device__ __forceinline__
#else
#define MOEKIT_HD inline
#endif
