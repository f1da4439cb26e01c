// `moekit run --backend cuda` (see run_cuda.h).
#include "cli/cuda/run_cuda.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>

#include "cli/cuda/device_array.h"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/cuda_graph.h"
#include "moekit/eplb.h"
#include "moekit/layer.h"
#include "moekit/weights.h"

namespace moekit::cli {

namespace {

// The EP figures of ep_cpu.h's EpStats, from the routing: one message per (token, distinct target
// rank) of message_bytes, one bf16 vector [d] back per message.
EpStats ep_stats(const std::vector<int32_t>& slots, int num_tokens, int k, int rank, int e_loc, size_t message_bytes,
                 int d) {
  EpStats s;
  s.num_tokens = num_tokens;
  for (int t = 0; t < num_tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int slot = slots[size_t(t) * k + j];
      if (slot < 0) continue;
      bool seen = false;
      for (int i = 0; i < j; ++i) seen |= slots[size_t(t) * k + i] >= 0 && slots[size_t(t) * k + i] / e_loc == slot / e_loc;
      if (seen) continue;
      ++s.dispatch_messages;
      const bool remote = slot / e_loc != rank;
      s.dispatch_bytes += int64_t(message_bytes);
      s.combine_bytes += int64_t(2) * d;
      if (remote) {
        s.dispatch_bytes_remote += int64_t(message_bytes);
        s.combine_bytes_remote += int64_t(2) * d;
      }
    }
  return s;
}

int first_token(int rank, int num_ranks, int64_t batch) { return int((rank * batch + num_ranks - 1) / num_ranks); }

}  // namespace

void require_cuda_device() {
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0)
    throw Error("--backend cuda: no CUDA device is visible on this machine; use --backend cpu");
}

CudaRunResult run_layers_cuda(const CudaRunInput& in) {
  MOEKIT_CHECK(in.model && in.weights && in.placement && in.x, "run_layers_cuda: missing input");
  const ModelSpec& spec = *in.model;
  const int P = in.num_ranks, L = int(in.weights->size()), d = int(spec.hidden_size), k = spec.num_experts_per_token;
  const int64_t B = in.batch;
  MOEKIT_CHECK(in.x->size() == size_t(B) * d, fmt::format("run_layers_cuda: x holds {} values, expected B d = {}",
                                                         in.x->size(), B * d));
  require_cuda_device();
  const int t_max = int((B + P - 1) / P);
  const gpu::EpMode mode = in.protocol == EpProtocol::kNormal ? gpu::EpMode::kNormal : gpu::EpMode::kLowLatency;
  const gpu::EpConfig ec = gpu::layer_ep_config(spec, in.placement->num_slots, P, t_max, mode,
                                                    in.fused ? gpu::GpuPipeline::kFused : gpu::GpuPipeline::kStaged);
  gpu::EpLocalGroup group(ec);
  gpu::GpuLayerConfig cfg;
  cfg.max_tokens = t_max;
  cfg.replica_seed = in.replica_seed;
  cfg.pipeline = in.fused ? gpu::GpuPipeline::kFused : gpu::GpuPipeline::kStaged;
  std::vector<std::vector<std::unique_ptr<gpu::GpuMoeLayer>>> layers(L);  // [L][P]
  for (int l = 0; l < L; ++l)
    for (int r = 0; r < P; ++r)
      layers[l].push_back(std::make_unique<gpu::GpuMoeLayer>(spec, (*in.weights)[l], *in.placement, 0, group.rank(r), cfg));
  const int e_loc = layers[0][0]->num_local_experts();

  DeviceArray<uint16_t> x(size_t(P) * t_max * d), out(size_t(P) * t_max * d);
  DeviceArray<int32_t> idx(size_t(P) * t_max * k);
  DeviceArray<float> w(size_t(P) * t_max * k);
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto rank_x = [&](int r) { return x.ptr + size_t(r) * t_max * d; };
  auto rank_out = [&](int r) { return out.ptr + size_t(r) * t_max * d; };
  auto tokens = [&](int r) { return first_token(r + 1, P, B) - first_token(r, P, B); };
  auto issue = [&](int l, bool forced) {
    for (int r = 0; r < P; ++r)
      layers[l][r]->dispatch(rank_x(r), tokens(r), first_token(r, P, B), stream,
                             forced ? idx.ptr + size_t(r) * t_max * k : nullptr,
                             forced ? w.ptr + size_t(r) * t_max * k : nullptr);
    for (int r = 0; r < P; ++r) layers[l][r]->compute(stream);
    for (int r = 0; r < P; ++r) layers[l][r]->combine(rank_out(r), stream);
  };
  auto upload_rows = [&](auto* dev, const auto& host, int width) {
    for (int r = 0; r < P; ++r)
      MOEKIT_CUDA_CHECK(cudaMemcpy(dev + size_t(r) * t_max * width, host.data() + size_t(first_token(r, P, B)) * width,
                                   size_t(tokens(r)) * width * sizeof(host[0]), cudaMemcpyHostToDevice));
  };

  CudaRunResult res;
  res.x.push_back(*in.x);
  res.out.resize(L);
  res.steps.resize(L);
  const bool forced = in.forced_idx != nullptr;
  for (int l = 0; l < L; ++l) {
    upload_rows(x.ptr, res.x[l], d);
    if (forced) {
      upload_rows(idx.ptr, (*in.forced_idx)[l], k);
      upload_rows(w.ptr, *in.forced_weights, k);
    }
    for (auto& layer : layers[l]) layer->set_timing(true);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto start = std::chrono::steady_clock::now();
    issue(l, forced);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    res.wall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (auto& layer : layers[l]) layer->check(stream);

    res.out[l].resize(size_t(B) * d);
    std::vector<uint16_t> next(size_t(B) * d);
    for (int r = 0; r < P; ++r) {
      const int t0 = first_token(r, P, B), T = tokens(r);
      MOEKIT_CUDA_CHECK(cudaMemcpy(res.out[l].data() + size_t(t0) * d, rank_out(r), size_t(T) * d * 2,
                                   cudaMemcpyDeviceToHost));
      gpu::GpuMoeLayer& layer = *layers[l][r];
      RankStep st;
      st.num_tokens = T;
      st.topk_idx = download(layer.topk_idx(), size_t(T) * k);
      st.topk_weights = download(layer.topk_weights(), size_t(T) * k);
      st.topk_slot = download(layer.topk_slot(), size_t(T) * k);
      st.recv_count = download(group.rank(r).recv_count(), size_t(e_loc));
      st.ep = ep_stats(st.topk_slot, T, k, r, e_loc, ec.message_bytes(), ec.hidden);  // the rows the EP moves (MXFP4: padded)
      for (int c : st.recv_count) st.ep.recv_rows += c;
      const gpu::GpuStageTimes t = layer.last_times();
      // The shared expert runs on a side stream under dispatch: it is hidden, not a stage.
      st.times = StageTimes{1e-3 * t.gate, 1e-3 * (t.dispatch_send + t.dispatch_recv), 1e-3 * t.gemm1,
                            1e-3 * t.activation, 1e-3 * t.gemm2, 1e-3 * (t.combine_send + t.combine_recv), 0.0};
      layer.set_timing(false);
      res.steps[l].push_back(std::move(st));
    }
    for (size_t i = 0; i < next.size(); ++i)
      next[i] = float_to_bf16(bf16_to_float(res.x[l][i]) + bf16_to_float(res.out[l][i]));
    res.x.push_back(std::move(next));
  }

  // One layer's step of all ranks, captured once and replayed (the same inputs as its eager run).
  {
    upload_rows(x.ptr, res.x[L - 1], d);
    const CapturedGraph graph(stream, [&] { issue(L - 1, forced); });
    graph.launch(stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    constexpr int kReplays = 20;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kReplays; ++i) graph.launch(stream);
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    res.graph_step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kReplays;
    for (auto& layer : layers[L - 1]) layer->check(stream);
  }
  layers.clear();
  cudaStreamDestroy(stream);
  return res;
}

}  // namespace moekit::cli
