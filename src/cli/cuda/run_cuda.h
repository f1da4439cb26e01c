// `moekit run --backend cuda`: the step of cmd_run.cpp's CPU backend, on the GPU. The CLI builds
// the same inputs for both backends (weights, placement, tokens, synthetic routing) and prints
// the same tables; this runs the L layers over P virtual ranks on one GPU (the `local` EP
// transport) and reports, per layer and rank, what the CPU layer's last_step() reports.
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/layer_cpu.h"
#include "moekit/spec.h"

namespace moekit {
struct MoeLayerWeights;
struct Placement;
}  // namespace moekit

namespace moekit::cli {

struct CudaRunInput {
  const ModelSpec* model = nullptr;
  int num_ranks = 1;                                    // P
  int64_t batch = 0;                                    // B: rank r holds tokens ceil(rB/P) .. ceil((r+1)B/P) - 1
  EpProtocol protocol = EpProtocol::kLowLatency;
  uint64_t replica_seed = 0;
  const std::vector<MoeLayerWeights>* weights = nullptr;  // [L], all experts of each layer
  const Placement* placement = nullptr;                  // its layer 0 serves every layer
  const std::vector<uint16_t>* x = nullptr;              // [B, d] bf16, the first layer's input
  const std::vector<std::vector<int32_t>>* forced_idx = nullptr;  // [L][B, k] or null: the router
  const std::vector<float>* forced_weights = nullptr;    // [B, k] with forced_idx
  bool fused = false;                                    // GpuPipeline::kFused for decode (--pipeline fused)
};

struct CudaRunResult {
  std::vector<std::vector<uint16_t>> x;         // [L + 1][B, d]: layer l's input (x[l + 1] = x[l] + out[l])
  std::vector<std::vector<uint16_t>> out;       // [L][B, d]
  std::vector<std::vector<RankStep>> steps;     // [L][P]: routing, recv_count, EP figures, stage times (s)
  double wall_s = 0;                            // the eager step of all layers, host copies excluded
  double graph_step_s = 0;                      // one layer's step of all ranks, replayed from a CUDA Graph
};

// Throws moekit::Error for bad input or a device fault (naming the rank).
CudaRunResult run_layers_cuda(const CudaRunInput& in);

// An Error unless a CUDA device is visible: `run --backend cuda` asks before it writes any weights.
void require_cuda_device();

}  // namespace moekit::cli
