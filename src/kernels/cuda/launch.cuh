// launch.cuh: one kernel launch, optionally as a programmatic dependent launch (PDL), for every
// kernel family of the decode step (GEMM, EP, gating, activation).
//
// With pdl = true the kernel may be scheduled while the previous kernel on the stream is still
// running. That is only correct for kernels that call ptx::grid_dependency_wait() before they
// read anything an earlier kernel writes (the wait returns once every earlier grid on the stream
// has completed and its memory is visible; without the attribute it returns at once). What PDL
// buys is the launch and the ramp-up of the next grid under the tail of the current one: the
// chain of short kernels of a decode step otherwise drains and refills the GPU at every step.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/stamp.cuh"
#include "moekit/cuda_check.h"

namespace moekit {

// How a kernel of the decode step is launched: as a programmatic dependent launch, and with a
// stage-clock pair (stamp.cuh) or none.
struct LaunchOptions {
  bool pdl = false;
  unsigned long long* stamp = nullptr;
};

// A launched kernel's first step, before it reads anything: wait for the previous kernel (when
// launched early), let the next one be scheduled, and (thread 0) stamp the CTA's start.
__device__ __forceinline__ void begin_kernel(unsigned long long* stamp) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  if (threadIdx.x == 0) stamp_start(stamp);
}
// Thread 0's last step in each CTA.
__device__ __forceinline__ void end_kernel(unsigned long long* stamp) {
  if (threadIdx.x == 0) stamp_end(stamp);
}

// The launch attributes a kernel of this project may need: PDL, and the CTAs per cluster (the
// grid must be a multiple of it). A bare bool reads as "pdl".
struct LaunchShape {
  LaunchShape(bool pdl_, int cluster_ = 1) : pdl(pdl_), cluster(cluster_) {}
  bool pdl;
  int cluster;
};

template <class... Params, class... Args>
void launch_kernel_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                      LaunchShape shape, Args&&... args) {
  cudaLaunchConfig_t lc{};
  lc.gridDim = grid;
  lc.blockDim = block;
  lc.dynamicSmemBytes = smem_bytes;
  lc.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (shape.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (shape.cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = shape.cluster;
    attr[n].val.clusterDim.y = attr[n].val.clusterDim.z = 1;
    ++n;
  }
  lc.attrs = attr;
  lc.numAttrs = n;
  MOEKIT_CUDA_CHECK(cudaLaunchKernelEx(&lc, kernel, std::forward<Args>(args)...));
}

}  // namespace moekit
