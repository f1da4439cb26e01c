// Internal to moekit_cuda: a kernel that asks L2 for a range of device memory and returns (the
// decode step's first kernel, l2_prefetch.cu).
//
// Why a kernel of its own: the bytes a step is sure to read (the shared expert's W1) could leave
// HBM while the gate and the dispatch run, when HBM is otherwise idle, but the GEMM that reads
// them cannot start its CTAs then: each needs a whole SM's registers, and the dispatch's CTAs
// hold every SM until they end (measured: a prefetch issued by GEMM1's CTAs before their PDL wait
// ran after the receive, and the step got slower). This kernel's CTAs are one warp each; they
// issue bulk prefetches (cp.async.bulk.prefetch.L2, no completion to wait for) and exit, so the
// bytes stream under the kernels that follow.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/launch.cuh"

namespace moekit::gpu {

// [p, p + bytes): p 16-byte aligned, bytes a multiple of 16 (both checked, the value named).
// With opt.pdl the kernel waits for the previous kernel on the stream before it lets the next
// be scheduled (launch.cuh's chain rule), then issues; the next kernel runs meanwhile. opt.stamp:
// the stage-clock pair its CTAs stamp (the layer's gate stage, which it opens).
void launch_l2_prefetch(const void* p, size_t bytes, cudaStream_t stream, const LaunchOptions& opt = {});

}  // namespace moekit::gpu
