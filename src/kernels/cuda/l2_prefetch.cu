// l2_prefetch.cu: launch_l2_prefetch (l2_prefetch.cuh).
#include "kernels/cuda/l2_prefetch.cuh"

#include <algorithm>
#include <cstdint>
#include <string>

#include "moekit/check.h"
#include "moekit/cuda_check.h"

namespace moekit::gpu {
namespace {

// 8 KB per bulk prefetch, one per lane: a 29 MB expert is ~3 600 of them, spread over as many
// SMs as there are (each SM's copy engine works through its own requests).
constexpr size_t kPiece = size_t(8) << 10;

__global__ void l2_prefetch_kernel(const char* p, size_t bytes, unsigned long long* stamp) {
  begin_kernel(stamp);
  const size_t pieces = (bytes + kPiece - 1) / kPiece;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pieces; i += size_t(gridDim.x) * blockDim.x) {
    const size_t off = i * kPiece;
    ptx::prefetch_l2_bulk(p + off, uint32_t(bytes - off < kPiece ? bytes - off : kPiece));
  }
  end_kernel(stamp);
}

}  // namespace

void launch_l2_prefetch(const void* p, size_t bytes, cudaStream_t stream, const LaunchOptions& opt) {
  MOEKIT_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0,
               "l2_prefetch: the address must be 16-byte aligned (offset " +
                   std::to_string(reinterpret_cast<uintptr_t>(p) % 16) + ")");
  MOEKIT_CHECK(bytes % 16 == 0, "l2_prefetch: bytes = " + std::to_string(bytes) + " must be a multiple of 16");
  if (bytes == 0) return;
  const size_t pieces = (bytes + kPiece - 1) / kPiece;
  int device = 0, sms = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int ctas = int(std::min<size_t>((pieces + 31) / 32, size_t(sms)));
  launch_kernel_ex(l2_prefetch_kernel, dim3(ctas), dim3(32), 0, stream, opt.pdl, static_cast<const char*>(p), bytes,
                   opt.stamp);
}

}  // namespace moekit::gpu
