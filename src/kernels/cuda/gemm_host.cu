// Host pieces shared by the GEMM plans (gemm_host.cuh).
#include <cudaTypedefs.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>

#include "kernels/cuda/gemm_host.cuh"
#include "kernels/cuda/launch.cuh"

namespace moekit {

std::string GemmConfig::to_string() const {
  std::ostringstream os;
  os << (swap_ab ? "swap-AB" : "normal") << " block_m=" << block_m << " block_n=" << block_n
     << " stages=" << num_stages << " splits=" << num_splits << " cluster=" << cluster << " ctas=" << num_ctas
     << " smem=" << smem_bytes;
  if (mxfp4_widen_wgs != 0) os << " widen_wgs=" << mxfp4_widen_wgs;
  if (mxfp4_fp8_copy) os << " fp8_copy";
  if (mxfp4_fp8_copy_ctas > 0) os << " beside_ctas=" << mxfp4_fp8_copy_ctas;
  return os.str();
}

namespace gemm_detail {

namespace {
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    MOEKIT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status));
    MOEKIT_CHECK(status == cudaDriverEntryPointSuccess && p != nullptr,
                 "the driver has no cuTensorMapEncodeTiled (TMA needs a CUDA 12+ driver)");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  return fn;
}
}  // namespace

CUtensorMap make_tma_2d(const void* ptr, bool is_fp32, uint64_t rows, uint64_t cols, uint64_t row_stride,
                        uint32_t box_rows, uint32_t box_cols, int swizzle_bytes) {
  MOEKIT_CHECK(swizzle_bytes == 0 || swizzle_bytes == 64 || swizzle_bytes == 128,
               "make_tma_2d: swizzle of " + std::to_string(swizzle_bytes) + " bytes; expected 0, 64 or 128");
  const CUtensorMapSwizzle swizzle = swizzle_bytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : swizzle_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                           : CU_TENSOR_MAP_SWIZZLE_NONE;
  CUtensorMap map{};
  const uint64_t elem = is_fp32 ? 4 : 1;
  cuuint64_t dims[2] = {cols, rows};
  cuuint64_t strides[1] = {row_stride * elem};
  cuuint32_t box[2] = {box_cols, box_rows};
  cuuint32_t elem_strides[2] = {1, 1};
  CUresult r = encode_fn()(&map, is_fp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
                           const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                           swizzle,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOEKIT_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)) + " for a " +
                                      std::to_string(rows) + "x" + std::to_string(cols) + " tensor, box " +
                                      std::to_string(box_rows) + "x" + std::to_string(box_cols));
  return map;
}

CUtensorMap make_tma_3d(const void* ptr, bool is_fp32, uint64_t d0, uint64_t d1, uint64_t d2, uint32_t b0, uint32_t b1,
                        uint32_t b2) {
  CUtensorMap map{};
  const uint64_t elem = is_fp32 ? 4 : 1;
  cuuint64_t dims[3] = {d0, d1, d2};
  cuuint64_t strides[2] = {d0 * elem, d0 * d1 * elem};
  cuuint32_t box[3] = {b0, b1, b2};
  cuuint32_t elem_strides[3] = {1, 1, 1};
  CUresult r = encode_fn()(&map, is_fp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 3,
                           const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                           CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOEKIT_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)) + " for a " +
                                      std::to_string(d2) + "x" + std::to_string(d1) + "x" + std::to_string(d0) +
                                      " tensor, box " + std::to_string(b2) + "x" + std::to_string(b1) + "x" +
                                      std::to_string(b0));
  return map;
}

void check_shape(int n, int k) {
  MOEKIT_CHECK(n > 0 && n % kBlockK == 0, "GEMM: N = " + std::to_string(n) + " must be a positive multiple of 128");
  MOEKIT_CHECK(k > 0 && k % kBlockK == 0, "GEMM: K = " + std::to_string(k) + " must be a positive multiple of 128");
}

void check_pointer(const void* p, const char* name) {
  MOEKIT_CHECK(p != nullptr, std::string("GEMM: ") + name + " is null; expected a device pointer");
  MOEKIT_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0,
               std::string("GEMM: ") + name + " is not 16-byte aligned (TMA needs 16-byte aligned global memory)");
}

void check_weight_buffers(bool mxfp4, const void* w, const float* w_scales, const uint32_t* w_mx_scales, const float* bias) {
  check_pointer(w, "w");
  if (mxfp4) {
    MOEKIT_CHECK(w_scales == nullptr, "GEMM: w_scales is set with MXFP4 weights; their scales go in w_mx_scales (gemm.h)");
    check_pointer(w_mx_scales, "w_mx_scales");
    MOEKIT_CHECK(bias == nullptr || reinterpret_cast<uintptr_t>(bias) % 4 == 0,
                 "GEMM: bias is not 4-byte aligned; expected an fp32 device array [E_loc, N]");
  } else {
    check_pointer(w_scales, "w_scales");
    MOEKIT_CHECK(w_mx_scales == nullptr, "GEMM: w_mx_scales is set with FP8 weights; expected weights = WeightFormat::kMxfp4");
    MOEKIT_CHECK(bias == nullptr, "GEMM: bias is supported with MXFP4 weights only (gpt-oss); FP8 plans take none");
  }
}

void check_cluster(const GemmConfig& cfg, int cols) {
  if (cfg.cluster == 1) return;
  MOEKIT_CHECK(cfg.num_splits == 1, "GEMM config " + cfg.to_string() + ": a cluster of " +
                                        std::to_string(cfg.cluster) + " needs num_splits = 1");
  MOEKIT_CHECK(cols % (cfg.cluster * cfg.block_n) == 0,
               "GEMM config " + cfg.to_string() + ": a cluster of " + std::to_string(cfg.cluster) + " needs " +
                   std::to_string(cols) + " output columns to be a multiple of cluster x block_n = " +
                   std::to_string(cfg.cluster * cfg.block_n));
}

void maybe_print_plan(const std::string& what) {
  const char* env = std::getenv("MOEKIT_PRINT_CONFIGS");
  if (env && env[0] == '1') std::fprintf(stderr, "moekit %s\n", what.c_str());
}

void maybe_print_config(const char* kind, const std::string& problem, const GemmConfig& cfg) {
  maybe_print_plan(std::string("gemm ") + kind + " [" + problem + "]: " + cfg.to_string());
}

void apply_mxfp4_widen_knob(GemmConfig& cfg, bool masked) {
  const char* env = std::getenv("MOEKIT_MXFP4_WIDEN");
  if (env == nullptr || env[0] == '\0') return;
  const std::string v = env;
  MOEKIT_CHECK(v == "smem" || v == "smem2" || v == "registers",
               "MOEKIT_MXFP4_WIDEN = '" + v + "'; expected registers, smem or smem2 (or unset)");
  const bool two = v == "smem2" && masked && cfg.block_m <= 64;  // where two are compiled
  cfg.mxfp4_widen_wgs = v == "registers" ? 0 : two ? 2 : 1;
}

void apply_mxfp4_prefill_knob(GemmConfig& cfg, const ContiguousGemmProblem& p) {
  const char* env = std::getenv("MOEKIT_MXFP4_PREFILL");
  if (env == nullptr || env[0] == '\0') return;
  const std::string v = env;
  const int sms = cfg.num_ctas > 0 ? cfg.num_ctas : num_sms();
  const std::string bad = "MOEKIT_MXFP4_PREFILL = '" + v + "'; expected copy, beside, beside:N (N SMs for the copy, 1.." +
                          std::to_string(sms - 1) + ") or registers (or unset)";
  if (v.rfind("beside", 0) == 0) {
    int ctas = 0;
    if (v != "beside") {
      MOEKIT_CHECK(v.size() > 7 && v[6] == ':' && v.find_first_not_of("0123456789", 7) == std::string::npos &&
                       v.size() <= 10,
                   bad);
      ctas = std::stoi(v.substr(7));
      MOEKIT_CHECK(ctas >= 1 && ctas < sms, bad);
    }
    cfg = choose_mxfp4_fp8_copy_beside_config(p, sms, ctas);
    return;
  }
  MOEKIT_CHECK(v == "copy" || v == "registers", bad);
  if (v == "copy") cfg = choose_mxfp4_fp8_copy_config(p, sms);
  else cfg.mxfp4_fp8_copy = false;
}

int max_smem_per_block() {
  int dev = 0, v = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return v;
}

int num_sms() {
  int dev = 0, v = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
  return v;
}

double hbm_bytes_per_sm_cycle() {
  int dev = 0, mem_khz = 0, bus_bits = 0, sm_khz = 0, sms = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev));
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, dev));
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (mem_khz <= 0 || bus_bits <= 0 || sm_khz <= 0 || sms <= 0) return 0.0;
  return 2.0 * mem_khz * (bus_bits / 8.0) / (double(sms) * sm_khz);
}

void set_mxfp4_rows(GemmConfig& cfg, const MaskedGemmProblem& p, int rows) {
  cfg.block_n = rows;
  cfg.num_stages = 0;  // the ring depth follows the stage's size
  const int m = planned_rows(p);
  const long tiles = long(p.num_experts) * ((m + cfg.block_m - 1) / cfg.block_m) * ((p.n + rows - 1) / rows);
  cfg.num_splits = choose_splits(tiles, num_sms(), p.k / 128);
}

void apply_mxfp4_rows_knob(GemmConfig& cfg, const MaskedGemmProblem& p) {
  const char* env = std::getenv("MOEKIT_MXFP4_ROWS");
  if (env == nullptr || env[0] == '\0') return;
  const std::string v = env;
  MOEKIT_CHECK(v == "128" || v == "256", "MOEKIT_MXFP4_ROWS = '" + v + "'; expected 128 or 256 (or unset)");
  const bool compiled = cfg.block_m == 16 || cfg.block_m == 32 || cfg.block_m == 48;
  if (!compiled || cfg.mxfp4_widen_wgs != 0) return;
  set_mxfp4_rows(cfg, p, std::stoi(v));
}

void check_register_split(const void* kernel, const GemmConfig& cfg, int launch_regs) {
  cudaFuncAttributes attr{};
  MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  MOEKIT_CHECK(attr.numRegs >= launch_regs,
               "GEMM config " + cfg.to_string() + ": the kernel was compiled to " + std::to_string(attr.numRegs) +
                   " registers per thread; its warpgroups' setmaxnreg split needs " + std::to_string(launch_regs));
}

void allow_smem(const void* kernel, int smem_bytes) {
  // The limit each kernel was raised to on each device, so that the launchers that call this on
  // every launch (the router's tiles, the activation's held values) pay a lookup after the first.
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> raised;
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = raised.find({device, kernel});
  int limit = it != raised.end() ? it->second : 0;
  if (it == raised.end()) {
    int optin = 0;
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cudaFuncAttributes attr{};
    MOEKIT_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    limit = optin - int(attr.sharedSizeBytes);
  }
  MOEKIT_CHECK(smem_bytes <= limit, "kernel needs " + std::to_string(smem_bytes) +
                                        " B of dynamic shared memory, the device allows " + std::to_string(limit));
  if (it == raised.end()) {
    MOEKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
    raised.emplace(std::make_pair(device, kernel), limit);
  }
}

void launch_kernel(const Launch& launch, const GemmConfig& cfg, const CUtensorMap& tma_a, const CUtensorMap& tma_w,
                   const CUtensorMap& tma_sa, const CUtensorMap& tma_ws, const KernelArgs& args, cudaStream_t stream) {
  const bool pdl = (args.flags & kFlagPdl) != 0;
  if (launch.kernel_mxfp4) {
    launch_kernel_ex(launch.kernel_mxfp4, dim3(cfg.num_ctas), dim3(launch.threads), cfg.smem_bytes, stream, pdl, tma_a,
                     tma_w, tma_sa, tma_ws, args);
  } else {
    launch_kernel_ex(launch.kernel, dim3(cfg.num_ctas), dim3(launch.threads), cfg.smem_bytes, stream,
                     LaunchShape{pdl, cfg.cluster}, tma_a, tma_w, tma_sa, args);
  }
}

int cluster_ctas(const Launch& launch, const GemmConfig& cfg) {
  if (cfg.cluster == 1) return cfg.num_ctas;
  cudaLaunchConfig_t lc{};
  lc.gridDim = dim3(num_sms());
  lc.blockDim = dim3(launch.threads);
  lc.dynamicSmemBytes = cfg.smem_bytes;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cfg.cluster;
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  lc.attrs = &attr;
  lc.numAttrs = 1;
  int clusters = 0;
  MOEKIT_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, launch.kernel, &lc));
  MOEKIT_CHECK(clusters > 0, "GEMM config " + cfg.to_string() + ": no cluster of " + std::to_string(cfg.cluster) +
                                 " CTAs fits on this device");
  const int most = clusters * cfg.cluster;
  if (cfg.num_ctas <= 0) return most;
  MOEKIT_CHECK(cfg.num_ctas % cfg.cluster == 0, "GEMM config: num_ctas = " + std::to_string(cfg.num_ctas) +
                                                    " must be a multiple of cluster = " + std::to_string(cfg.cluster));
  return cfg.num_ctas;
}

void PlanCore::bind(int num_experts, int n, int k, int rows, const float* w_scales, uint16_t* out,
                    size_t split_slots, int slabs) {
  args.num_experts = num_experts;
  args.n = n;
  args.k = k;
  args.rows = rows;
  args.w_scales = w_scales;
  args.out = out;
  args.num_splits = cfg.num_splits;
  args.num_stages = cfg.num_stages;
  if (cfg.num_splits > 1) {
    workspace.allocate(split_slots, cfg.num_splits, cfg.block_m * cfg.block_n * slabs);
    args.partials = workspace.partials;
    args.counters = workspace.counters;
  }
}

void PlanCore::run(cudaStream_t stream) const {
  launch_kernel(launch, cfg, tma_a, tma_w, tma_sa, tma_ws, args, stream);
}

void PlanCore::set_overlap(Overlap overlap) {
  args.flags = (args.flags & (kFlagEarlyTrigger | kFlagLastExpertFirst | kFlagWeightsReady)) |
               (overlap == Overlap::kNone                        ? 0
               : overlap == Overlap::kPreviousKernel            ? kFlagPdl
               : overlap == Overlap::kPreviousKernelStaticWeights ? kFlagPdl | kFlagEarlyWeights
               : overlap == Overlap::kPreviousGemmPerExpert     ? kFlagPdl | kFlagEarlyWeights | kFlagExpertReady
                                                                : kFlagPdl | kFlagEarlyWeights | kFlagExpertReady | kFlagRowsReady);
}

void SplitWorkspace::allocate(size_t slots, int splits, int tile_elems) {
  MOEKIT_CUDA_CHECK(cudaMalloc(&partials, slots * splits * size_t(tile_elems) * sizeof(float)));
  MOEKIT_CUDA_CHECK(cudaMalloc(&counters, slots * sizeof(int)));
  MOEKIT_CUDA_CHECK(cudaMemset(counters, 0, slots * sizeof(int)));
}

SplitWorkspace::~SplitWorkspace() {
  cudaFree(partials);  // no throw from a destructor; freeing null is a no-op
  cudaFree(counters);
}

}  // namespace gemm_detail
}  // namespace moekit
