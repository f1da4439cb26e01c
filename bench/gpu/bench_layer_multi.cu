// bench_layer_multi: the MoE layer's decode step at EP = the number of GPUs, one process per GPU,
// each GPU a real rank (the `nvlink` transport) holding E/P experts of each of L layers, against
// its floor: issue 9's "full MoE layer at EP8, batch sweep, step time against the floor
// including communication".
//
//   bench_layer_multi [--model deepseek-v3] [--batch 8,64,256,1024] [--layers 4] [--iters 30]
//                     [--ranks P] [--gpu h200] [--pipeline staged|fused] [--recv-ready 0|1] [--no-tbo]
//                     [--quick] [--json FILE]
//
// --pipeline: the per-batch layers' decode pipeline (GpuLayerConfig::pipeline); run the bench once
// per pipeline in one call to compare them on the same GPUs. --recv-ready 0: fused layers whose
// GEMM1 waits for the dispatch receive's grid instead of taking each expert's rows as they land
// (GpuLayerConfig::recv_ready, on by default).
//
// Weights are random FP8 bytes of the real shapes (bench_common.h, as bench_layer makes them), made
// in memory once by this process, which never touches CUDA, and shared by the rank processes that
// launch_ranks forks. Each of the L layers gets its own device copy of the rank's experts and its own router
// rows, and reads its own random tokens (chaining outputs would add nothing to the time, and random
// weights would let the values drift). A step is the L layers one after another; per global batch
// B (B/P tokens per rank), every rank measures, with all ranks released together by a host barrier
// before every run (so no rank times its peers' start-up):
//   graph       the step captured in one CUDA Graph, median of --iters replays after warm-up
//   eager       the same step issued eagerly
//   stages      one eager step with CUDA events around each stage (GpuMoeLayer::set_timing)
//   inline      the graph with the shared expert in line instead of on its side stream
//   comm        dispatch + combine alone (the EP buffer's four calls with the step's own routing)
//   tbo         two-batch overlap: two micro-batches, each with its own EP buffer and layers that
//               share the first layers' weights (share_weights_with), on two streams in one graph;
//               against the same two micro-batches one after another on one stream (tbo serial)
//               and their dispatch + combine alone (tbo comm)
// hidden = (t_serial - t_overlap) / t_comm, the share of communication time an overlap hides
// (docs/theory.md §Overlap: DeepEP's hook overlap hides 20-27% at EP4). Times are per layer (step / L).
// Floors, per rank and layer, the larger rank reported:
//   measured  max(bytes of the rank's experts that received rows + its shared expert, over the
//             device copy bandwidth measured in this run; FP8 FLOPs over 1272 TFLOP/s) + the
//             bytes the rank puts on NVLink (dispatch messages and combine vectors, the larger of
//             sent and received per phase) over the NVLink copy bandwidth measured in this run
//             (every rank copying to the next at once, CUDA IPC)
//   planner   plan.h's terms for one MoE layer from the GPU spec: coverage x routed expert bytes / P
//             + the shared expert, over the spec's HBM bandwidth, or its FLOPs over the spec's FP8
//             rate, whichever is larger, + comm_ms / num_moe_layers (dispatch + combine on NVLink).
// Without two GPUs it prints why and exits 0.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "moekit/cuda_check.h"
#include "moekit/cuda_graph.h"
#include "moekit/ep.h"
#include "moekit/eplb.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/plan.h"
#include "moekit/weights.h"

using namespace moekit;

namespace {

constexpr int kMaxRanks = 8, kMaxLayers = 16, kMaxBatches = 16, kMaxIds = 64, kIdBytes = 128;
constexpr int kNumStages = 8;
constexpr const char* kStageNames[kNumStages] = {"gate",       "dispatch_send", "dispatch_recv", "gemm1",
                                                 "activation", "gemm2",         "combine_send",  "combine_recv"};
constexpr double kWaitTimeout = 10.0;      // s, every GPU wait on a peer (EpConfig::timeout_s)
constexpr double kBarrierTimeout = 120.0;  // s, a host barrier (set-up of the largest batch included)
constexpr size_t kNvlinkBytes = size_t(256) << 20;

// The router rows of layer `layer`: uniform in +-1.7/sqrt(d), a different draw per layer (layer
// 0's are random_layer's).
void fill_router(MoeLayerWeights& w, int layer) {
  const double d = double(w.hidden_size);
  for (size_t i = 0; i < w.router_weight.size(); ++i)
    w.router_weight[i] = float((double(bench::mix((uint64_t(layer) << 40) + i + 3) >> 11) / 9007199254740992.0 - 0.5) *
                               3.4 / std::sqrt(d));
}

// A barrier of the rank processes in a shared page. It spins (the ranks are released within about
// a microsecond of each other, which is what keeps timed runs in step); a rank that fails raises
// `failed`, and its peers stop at their next barrier instead of waiting out the timeout.
struct RankSync {
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  std::atomic<int> failed{0};
  int num_ranks = 0;

  void wait() {
    const int gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == num_ranks) {
      arrived.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_release);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kBarrierTimeout);
    for (uint64_t spin = 0; generation.load(std::memory_order_acquire) == gen; ++spin) {
      if (spin % 4096 != 0) continue;
      MOEKIT_CHECK(failed.load(std::memory_order_acquire) == 0,
                   std::string("a peer rank failed (its message is above)"));
      MOEKIT_CHECK(std::chrono::steady_clock::now() < deadline,
                   "rank barrier: not every rank arrived within " + std::to_string(kBarrierTimeout) + " s");
    }
  }
};

// What each rank measured, per global batch; read by this process after the ranks exit.
struct RankRow {
  int tokens = 0;
  // Per layer (the step's time / L), medians over --iters runs; tbo fields < 0: not run.
  double graph_us = 0, eager_us = 0, inline_us = 0, comm_us = 0;
  double tbo_us = -1, tbo_serial_us = -1, tbo_comm_us = -1;
  double stages_us[kNumStages] = {};        // eager, events, mean over the layers
  int hit_slots[kMaxLayers] = {};           // local slots that received rows
  int64_t rows[kMaxLayers] = {};            // rows received (sum of recv_count)
  int msgs_to[kMaxLayers][kMaxRanks] = {};  // tokens with an expert on each rank: one message each
};

struct RankInfo {
  char device[128] = {};
  int num_sms = 0;
  double copy_bw = 0;    // B/s, read + write of a 2 GB device copy
  double nvlink_bw = 0;  // B/s, one direction, to the next rank while every rank copies
};

struct Shared {
  RankSync sync;
  std::atomic<int> ids_published{0};  // the NCCL unique ids rank 0 has made, after the launcher's
  uint8_t ids[kMaxIds][kIdBytes] = {};
  cudaIpcMemHandle_t nvlink_handles[kMaxRanks] = {};
  RankInfo info[kMaxRanks];
  RankRow rows[kMaxBatches][kMaxRanks];
};

struct Options {
  std::string model = "deepseek-v3", gpu = "h200", json;
  std::vector<int> batches = {8, 64, 256, 1024};
  int layers = 4, iters = 30, ranks = 0;
  bool tbo = true, quick = false, recv_ready = true;
  gpu::GpuPipeline pipeline = gpu::GpuPipeline::kStaged;
};

struct Args {
  Options opt;
  ModelSpec model;
  Placement placement;
  MoeLayerWeights* weights = nullptr;  // all E experts; each rank rewrites the router rows per layer
  Shared* shared = nullptr;
};

int first_token(int rank, int num_ranks, int batch) { return int((int64_t(rank) * batch + num_ranks - 1) / num_ranks); }

// ---------------------------------------------------------------------------------------------
// The rank process.

struct Stream {
  cudaStream_t s{};
  Stream() { MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { MOEKIT_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

struct Events {
  cudaEvent_t start{}, stop{};
  Events() {
    MOEKIT_CUDA_CHECK(cudaEventCreate(&start));
    MOEKIT_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~Events() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  // Microseconds of body() on `stream`, after a barrier of all ranks when `sync` is given.
  template <class Body>
  double run_us(RankSync* sync, cudaStream_t stream, Body&& body) {
    if (sync) sync->wait();
    MOEKIT_CUDA_CHECK(cudaEventRecord(start, stream));
    body();
    MOEKIT_CUDA_CHECK(cudaEventRecord(stop, stream));
    MOEKIT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return 1e3 * ms;
  }
  // Median of `iters` runs, each released together with the peers' runs.
  template <class Body>
  double median_us(RankSync& sync, cudaStream_t stream, int iters, Body&& body) {
    std::vector<double> t;
    for (int i = 0; i < iters; ++i) t.push_back(run_us(&sync, stream, body));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

// One direction of NVLink: every rank copies kNvlinkBytes into the next rank's buffer (mapped
// with CUDA IPC) at the same time, best of 5.
double measure_nvlink_bw(Shared& sh, int me, int P, Events& ev, cudaStream_t stream) {
  DeviceBuffer src(kNvlinkBytes), dst(kNvlinkBytes);
  MOEKIT_CUDA_CHECK(cudaMemsetAsync(src.ptr, 0, kNvlinkBytes, stream));
  MOEKIT_CUDA_CHECK(cudaIpcGetMemHandle(&sh.nvlink_handles[me], dst.ptr));
  sh.sync.wait();
  void* peer = nullptr;
  MOEKIT_CUDA_CHECK(cudaIpcOpenMemHandle(&peer, sh.nvlink_handles[(me + 1) % P], cudaIpcMemLazyEnablePeerAccess));
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    const double us = ev.run_us(&sh.sync, stream, [&] {
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(peer, src.ptr, kNvlinkBytes, cudaMemcpyDefault, stream));
    });
    if (i > 0) best = std::min(best, us);
  }
  sh.sync.wait();  // every copy into `dst` has finished before it is freed
  MOEKIT_CUDA_CHECK(cudaIpcCloseMemHandle(peer));
  sh.sync.wait();
  return kNvlinkBytes / (best * 1e-6);
}

// The process group of the next EP buffer. connect_ep makes one NCCL communicator per buffer and
// an NCCL unique id serves one communicator, so after the launcher's id rank 0 makes a fresh one
// for each buffer and publishes it in the shared page; every rank connects its buffers in the
// same order, so the i-th buffer of every rank gets id i.
gpu::EpProcessGroup group_for_buffer(const gpu::EpProcessGroup& g, Shared& sh, int index) {
  if (index == 0) return g;
  MOEKIT_CHECK(index < kMaxIds, "more than " + std::to_string(kMaxIds) + " EP buffers");
  MOEKIT_CHECK(g.nccl_unique_id.size() <= size_t(kIdBytes),
               "the NCCL unique id has " + std::to_string(g.nccl_unique_id.size()) + " bytes, expected <= 128");
  if (g.rank == 0) {
    const char* path = std::getenv("MOEKIT_NCCL_LIBRARY");
    void* lib = dlopen(path ? path : "libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);  // loaded already by connect_ep
    MOEKIT_CHECK(lib != nullptr, std::string("cannot load NCCL: ") + dlerror());
    auto get_unique_id = reinterpret_cast<int (*)(void*)>(dlsym(lib, "ncclGetUniqueId"));
    MOEKIT_CHECK(get_unique_id != nullptr, std::string("ncclGetUniqueId not found in the loaded NCCL"));
    const int rc = get_unique_id(sh.ids[index]);
    MOEKIT_CHECK(rc == 0, "ncclGetUniqueId failed with NCCL result " + std::to_string(rc));
    sh.ids_published.store(index, std::memory_order_release);
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kBarrierTimeout);
    while (sh.ids_published.load(std::memory_order_acquire) < index) {
      MOEKIT_CHECK(sh.sync.failed.load(std::memory_order_acquire) == 0, std::string("a peer rank failed"));
      MOEKIT_CHECK(std::chrono::steady_clock::now() < deadline,
                   "no NCCL unique id " + std::to_string(index) + " from rank 0");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  gpu::EpProcessGroup out = g;
  out.nccl_unique_id.assign(sh.ids[index], sh.ids[index] + g.nccl_unique_id.size());
  return out;
}

int run_rank(const gpu::EpProcessGroup& g, Args& a) {
  Shared& sh = *a.shared;
  RankSync& sync = sh.sync;
  const Options& opt = a.opt;
  const ModelSpec& model = a.model;
  const Placement& placement = a.placement;
  const int P = g.num_ranks, me = g.rank, L = opt.layers;
  const int d = int(model.hidden_size), k = model.num_experts_per_token, e_loc = placement.slots_per_gpu();
  const bool talk = me == 0;  // rank 0 prints progress
  MOEKIT_CUDA_CHECK(cudaSetDevice(g.device));
  const DeviceInfo dev = query_device();
  RankInfo& info = sh.info[me];
  std::snprintf(info.device, sizeof info.device, "%s", dev.name.c_str());
  info.num_sms = dev.num_sms;
  Stream stream, stream2;
  Events ev;
  info.copy_bw = bench::measure_copy_bandwidth();
  info.nvlink_bw = measure_nvlink_bw(sh, me, P, ev, stream.s);
  if (talk)
    std::printf("rank 0: %s, copy %.2f TB/s, NVLink copy to rank 1 %.0f GB/s\n", info.device, info.copy_bw / 1e12,
                info.nvlink_bw / 1e9);

  int next_id = 0;
  // tbo: a micro-batch's buffer, staged (see layer_config below).
  auto connect = [&](int t_max, int num_ctas = 0, bool tbo = false) {
    gpu::EpConfig ec = gpu::layer_ep_config(model, placement.num_slots, P, t_max, gpu::EpMode::kLowLatency,
                                            tbo ? gpu::GpuPipeline::kStaged : opt.pipeline);
    ec.timeout_s = kWaitTimeout;
    ec.num_ctas = num_ctas;
    return gpu::connect_ep(ec, group_for_buffer(g, sh, next_id++), gpu::EpTransport::kNvlink);
  };
  // Two micro-batches stay staged: their EP kernels on two streams must not hold SMs waiting
  // (EpBuffer::set_overlap), so the tbo rows compare with staged single batches only.
  auto layer_config = [&](int t_max, bool tbo = false) {
    gpu::GpuLayerConfig c;
    c.max_tokens = t_max;
    c.pipeline = tbo ? gpu::GpuPipeline::kStaged : opt.pipeline;
    c.recv_ready = opt.recv_ready;
    return c;
  };

  // The owners of the device weights: the layers of the largest batch.
  const int b_max = *std::max_element(opt.batches.begin(), opt.batches.end());
  const int t_owner = (b_max + P - 1) / P;
  std::unique_ptr<gpu::EpBuffer> owner_ep = connect(t_owner);
  std::vector<std::unique_ptr<gpu::GpuMoeLayer>> owners;
  for (int l = 0; l < L; ++l) {
    fill_router(*a.weights, l);
    owners.push_back(
        std::make_unique<gpu::GpuMoeLayer>(model, *a.weights, placement, 0, *owner_ep, layer_config(t_owner)));
  }
  if (talk) std::printf("rank 0: %d layers of %d local experts on the device\n", L, e_loc);

  for (size_t bi = 0; bi < opt.batches.size(); ++bi) {
    const int B = opt.batches[bi];
    const int t_max = (B + P - 1) / P, first = first_token(me, P, B), T = first_token(me + 1, P, B) - first;
    RankRow& row = sh.rows[bi][me];
    row.tokens = T;
    // This batch's EP buffer and layers (the owners at the largest batch; else layers on the owners' weights).
    std::unique_ptr<gpu::EpBuffer> own_ep;
    std::vector<std::unique_ptr<gpu::GpuMoeLayer>> own_layers;
    gpu::EpBuffer* ep = owner_ep.get();
    std::vector<gpu::GpuMoeLayer*> layers;
    if (t_max == t_owner) {
      for (auto& l : owners) layers.push_back(l.get());
    } else {
      own_ep = connect(t_max);
      ep = own_ep.get();
      for (int l = 0; l < L; ++l) {
        own_layers.push_back(std::make_unique<gpu::GpuMoeLayer>(model, *a.weights, placement, 0, *own_ep,
                                                                layer_config(t_max), owners[l].get()));
        layers.push_back(own_layers.back().get());
      }
    }
    // Random tokens per (layer, rank); outputs per layer.
    std::vector<std::unique_ptr<DeviceBuffer>> x, out;
    for (int l = 0; l < L; ++l) {
      const std::vector<uint16_t> h =
          bench::random_bf16(size_t(t_max) * d, (uint64_t(l) << 48) + (uint64_t(me) << 56) + uint64_t(B));
      x.push_back(std::make_unique<DeviceBuffer>(h.size() * 2));
      out.push_back(std::make_unique<DeviceBuffer>(h.size() * 2));
      MOEKIT_CUDA_CHECK(cudaMemcpy(x[l]->ptr, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    }
    auto xs = [&](int l) { return x[l]->as<uint16_t>(); };
    auto outs = [&](int l) { return out[l]->as<uint16_t>(); };
    auto issue = [&] {
      for (int l = 0; l < L; ++l) layers[l]->forward_decode(xs(l), T, first, outs(l), stream.s);
    };
    auto check_all = [&] {
      for (auto* l : layers) l->check(stream.s);
    };
    for (int i = 0; i < 2; ++i) ev.run_us(&sync, stream.s, issue);  // warm-up
    check_all();

    // The routing of each layer (the same in every run: fixed tokens, deterministic router).
    sync.wait();
    for (int l = 0; l < L; ++l) {
      layers[l]->forward_decode(xs(l), T, first, outs(l), stream.s);
      layers[l]->check(stream.s);
      std::vector<int32_t> count(e_loc), slot(size_t(T) * k);
      MOEKIT_CUDA_CHECK(cudaMemcpy(count.data(), ep->recv_count(), count.size() * 4, cudaMemcpyDeviceToHost));
      if (T > 0)
        MOEKIT_CUDA_CHECK(cudaMemcpy(slot.data(), layers[l]->topk_slot(), slot.size() * 4, cudaMemcpyDeviceToHost));
      for (int c : count) {
        row.hit_slots[l] += c > 0;
        row.rows[l] += c;
      }
      for (int t = 0; t < T; ++t) {
        bool to[kMaxRanks] = {};
        for (int j = 0; j < k; ++j)
          if (slot[size_t(t) * k + j] >= 0) to[slot[size_t(t) * k + j] / e_loc] = true;
        for (int r = 0; r < P; ++r) row.msgs_to[l][r] += to[r];
      }
    }

    row.eager_us = ev.median_us(sync, stream.s, opt.iters, issue) / L;
    check_all();
    for (auto* l : layers) l->set_timing(true);
    ev.run_us(&sync, stream.s, issue);
    for (auto* l : layers) {
      const gpu::GpuStageTimes t = l->last_times();
      const float ms[kNumStages] = {t.gate,       t.dispatch_send, t.dispatch_recv, t.gemm1,
                                    t.activation, t.gemm2,         t.combine_send,  t.combine_recv};
      for (int s = 0; s < kNumStages; ++s) row.stages_us[s] += 1e3 * ms[s] / L;
      l->set_timing(false);
    }
    auto time_graph = [&](const CapturedGraph& graph) {
      for (int i = 0; i < 2; ++i) ev.run_us(&sync, stream.s, [&] { graph.launch(stream.s); });
      return ev.median_us(sync, stream.s, opt.iters, [&] { graph.launch(stream.s); }) / L;
    };
    {
      CapturedGraph graph(stream.s, issue);
      row.graph_us = time_graph(graph);
      check_all();
    }
    {
      for (auto* l : layers) l->set_shared_overlap(false);
      CapturedGraph graph(stream.s, issue);
      row.inline_us = time_graph(graph);
      check_all();
      for (auto* l : layers) l->set_shared_overlap(true);
    }
    // Dispatch + combine alone: the EP buffer's four calls per layer with the layer's own routing
    // and expert outputs of the last step.
    auto issue_comm = [&](gpu::EpBuffer& buf, gpu::GpuMoeLayer& layer, const uint16_t* xp, int count, uint16_t* o,
                          cudaStream_t s) {
      buf.dispatch_send(xp, layer.topk_slot(), layer.topk_weights(), count, s);
      buf.dispatch_recv(s);
      buf.combine_send(layer.expert_buffers().y, s);
      buf.combine_recv(nullptr, o, s);
    };
    {
      CapturedGraph graph(stream.s, [&] {
        for (int l = 0; l < L; ++l) issue_comm(*ep, *layers[l], xs(l), T, outs(l), stream.s);
      });
      row.comm_us = time_graph(graph);
      ep->check(stream.s);
    }

    // Two-batch overlap: micro-batch 0 holds the rank's tokens [0, h0), micro-batch 1 [h0, T).
    if (opt.tbo && t_max >= 2) {
      const int t_half = (t_max + 1) / 2, h0 = (T + 1) / 2;
      const int begin[2] = {0, h0}, count[2] = {h0, T - h0};
      std::unique_ptr<gpu::EpBuffer> mb_ep[2];
      std::vector<std::unique_ptr<gpu::GpuMoeLayer>> mb[2];
      for (int h = 0; h < 2; ++h) {
        mb_ep[h] = connect(t_half, gpu::two_batch_num_ctas(), true);
        for (int l = 0; l < L; ++l)
          mb[h].push_back(std::make_unique<gpu::GpuMoeLayer>(model, *a.weights, placement, 0, *mb_ep[h],
                                                             layer_config(t_half, true), owners[l].get()));
      }
      cudaStream_t streams[2] = {stream.s, stream2.s};
      cudaEvent_t fork, join;
      MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
      MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
      auto check_mb = [&] {
        for (int h = 0; h < 2; ++h)
          for (auto& l : mb[h]) l->check(stream.s);
      };
      {
        CapturedGraph graph(stream.s, [&] {
          MOEKIT_CUDA_CHECK(cudaEventRecord(fork, stream.s));
          MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream2.s, fork, 0));
          for (int l = 0; l < L; ++l) {
            for (int h = 0; h < 2; ++h)
              mb[h][l]->dispatch(xs(l) + size_t(begin[h]) * d, count[h], first + begin[h], streams[h]);
            for (int h = 0; h < 2; ++h) mb[h][l]->compute(streams[h]);
            for (int h = 0; h < 2; ++h) mb[h][l]->combine(outs(l) + size_t(begin[h]) * d, streams[h]);
          }
          MOEKIT_CUDA_CHECK(cudaEventRecord(join, stream2.s));
          MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream.s, join, 0));
        });
        row.tbo_us = time_graph(graph);
        check_mb();
      }
      {
        CapturedGraph graph(stream.s, [&] {
          for (int l = 0; l < L; ++l)
            for (int h = 0; h < 2; ++h)
              mb[h][l]->forward_decode(xs(l) + size_t(begin[h]) * d, count[h], first + begin[h],
                                       outs(l) + size_t(begin[h]) * d, stream.s);
        });
        row.tbo_serial_us = time_graph(graph);
        check_mb();
      }
      {
        CapturedGraph graph(stream.s, [&] {
          for (int l = 0; l < L; ++l)
            for (int h = 0; h < 2; ++h)
              issue_comm(*mb_ep[h], *mb[h][l], xs(l) + size_t(begin[h]) * d, count[h], outs(l) + size_t(begin[h]) * d,
                         stream.s);
        });
        row.tbo_comm_us = time_graph(graph);
        for (int h = 0; h < 2; ++h) mb_ep[h]->check(stream.s);
      }
      cudaEventDestroy(fork);
      cudaEventDestroy(join);
      sync.wait();  // no rank frees a buffer a peer may still write into
      for (int h = 0; h < 2; ++h) mb[h].clear();
    }
    if (talk)
      std::printf(
          "rank 0: B = %d (%d tokens): graph %.1f us/layer, eager %.1f, shared in line %.1f, comm alone %.1f, "
          "tbo %.1f (serial %.1f, comm %.1f)\n",
          B, T, row.graph_us, row.eager_us, row.inline_us, row.comm_us, row.tbo_us, row.tbo_serial_us, row.tbo_comm_us);
    sync.wait();
    own_layers.clear();
  }
  sync.wait();
  return 0;
}

int rank_body(const gpu::EpProcessGroup& g, void* arg) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Args& a = *static_cast<Args*>(arg);
  try {
    return run_rank(g, a);
  } catch (...) {
    a.shared->sync.failed.store(1, std::memory_order_release);
    throw;  // launch_ranks prints it
  }
}

// ---------------------------------------------------------------------------------------------
// The report (this process, from the shared page).

struct Report {
  int batch = 0;
  // The slowest rank's (graph_min: the fastest rank's).
  double graph_us = 0, graph_min_us = 0, eager_us = 0, inline_us = 0, comm_us = 0;
  double tbo_us = -1, tbo_serial_us = -1, tbo_comm_us = -1;
  double stages_us[kNumStages] = {};  // mean over ranks
  // The floor of the rank with the largest one, and its terms.
  double floor_us = 0, mem_us = 0, flop_us = 0, wire_us = 0, wire_bytes = 0;
  std::optional<double> plan_floor_us, plan_weights_us, plan_compute_us, plan_comm_us, plan_coverage;
  double hidden_shared = 0;
  std::optional<double> hidden_tbo;
};

Report report_row(const Args& a, int bi, int P) {
  const ModelSpec& m = a.model;
  const Options& opt = a.opt;
  const int B = opt.batches[bi], L = opt.layers;
  const double d = double(m.hidden_size), inter = double(m.moe_intermediate_size);
  const double shared_inter = double(m.num_shared_experts) * double(m.shared_intermediate_size);
  const double expert_bytes = 3.0 * d * inter + 3.0 * (d / 128) * (inter / 128) * 4;
  const double shared_bytes = 3.0 * d * shared_inter;
  const int t_max = (B + P - 1) / P;
  const double msg_bytes =
      double(gpu::layer_ep_config(m, a.placement.num_slots, P, t_max, gpu::EpMode::kLowLatency).message_bytes());
  const auto& rows = a.shared->rows[bi];
  Report r;
  r.batch = B;
  r.graph_min_us = 1e30;
  for (int me = 0; me < P; ++me) {
    const RankRow& x = rows[me];
    r.graph_us = std::max(r.graph_us, x.graph_us);
    r.graph_min_us = std::min(r.graph_min_us, x.graph_us);
    r.eager_us = std::max(r.eager_us, x.eager_us);
    r.inline_us = std::max(r.inline_us, x.inline_us);
    r.comm_us = std::max(r.comm_us, x.comm_us);
    r.tbo_us = std::max(r.tbo_us, x.tbo_us);
    r.tbo_serial_us = std::max(r.tbo_serial_us, x.tbo_serial_us);
    r.tbo_comm_us = std::max(r.tbo_comm_us, x.tbo_comm_us);
    for (int s = 0; s < kNumStages; ++s) r.stages_us[s] += x.stages_us[s] / P;
    // This rank's floor, averaged over the layers.
    const RankInfo& info = a.shared->info[me];
    double mem = 0, flop = 0, wire = 0, wire_bytes = 0;
    for (int l = 0; l < L; ++l) {
      mem += (x.hit_slots[l] * expert_bytes + shared_bytes) / info.copy_bw / L;
      flop += 2.0 * 3.0 * d * (double(x.rows[l]) * inter + double(x.tokens) * shared_inter) / bench::kFp8Flops / L;
      double sent = 0, received = 0;  // messages to and from other ranks
      for (int p = 0; p < P; ++p)
        if (p != me) sent += x.msgs_to[l][p], received += rows[p].msgs_to[l][me];
      // Dispatch sends `sent` messages and receives `received`; combine returns one bf16 vector per
      // received message. NVLink is full duplex: a phase takes the larger direction.
      const double phase_bytes = std::max(sent, received) * msg_bytes + std::max(sent, received) * 2.0 * d;
      wire += phase_bytes / info.nvlink_bw / L;
      wire_bytes += (sent * msg_bytes + received * 2.0 * d) / L;
    }
    const double floor = std::max(mem, flop) + wire;
    if (1e6 * floor > r.floor_us) {
      r.floor_us = 1e6 * floor;
      r.mem_us = 1e6 * mem;
      r.flop_us = 1e6 * flop;
      r.wire_us = 1e6 * wire;
      r.wire_bytes = wire_bytes;
    }
  }
  r.hidden_shared = (r.inline_us - r.graph_us) / r.comm_us;
  if (r.tbo_us > 0) r.hidden_tbo = (r.tbo_serial_us - r.tbo_us) / r.tbo_comm_us;
  // The planner's terms for one MoE layer (it needs P to divide E).
  if (m.num_routed_experts % P == 0) {
    PlanInput in;
    in.model = m;
    in.gpu = load_gpu_spec(opt.gpu);
    in.ep = P;
    in.batches = {B};
    const PlanResult plan_result = plan(in);
    const PlanRow& pr = plan_result.rows[0];
    const double bpp = m.weight_bytes_per_param;
    const double weights_s = (pr.coverage * m.num_routed_experts * m.params_per_expert() / P + 3.0 * d * shared_inter) *
                             bpp / in.gpu.hbm_bandwidth;
    const double compute_s =
        2.0 * 3.0 * d * (m.num_experts_per_token * inter + shared_inter) * (double(B) / P) / in.gpu.fp8_flops;
    const double comm_s = pr.comm_ms.value_or(0.0) * 1e-3 / m.num_moe_layers;
    r.plan_coverage = pr.coverage;
    r.plan_weights_us = 1e6 * weights_s;
    r.plan_compute_us = 1e6 * compute_s;
    r.plan_comm_us = 1e6 * comm_s;
    r.plan_floor_us = 1e6 * (std::max(weights_s, compute_s) + comm_s);
  }
  return r;
}

std::string json_number(std::optional<double> v) {
  if (!v || !std::isfinite(*v)) return "null";
  std::ostringstream os;
  os << *v;
  return os.str();
}

void write_json(const std::string& path, const Args& a, int P, const std::vector<Report>& reports) {
  std::ofstream js(path);
  MOEKIT_CHECK(js.good(), "cannot write '" + path + "'");
  const Shared& sh = *a.shared;
  auto per_rank = [&](auto field) {
    std::ostringstream os;
    os << "[";
    for (int r = 0; r < P; ++r) os << (r ? ", " : "") << field(r);
    os << "]";
    return os.str();
  };
  js << "{\"bench\": \"layer_multi\", \"pipeline\": \"" << gpu::gpu_pipeline_name(a.opt.pipeline)
     << "\", \"recv_ready\": " << (a.opt.recv_ready ? "true" : "false")
     << ", \"device\": \"" << sh.info[0].device << "\", \"model\": \"" << a.model.name
     << "\", \"ranks\": " << P << ", \"transport\": \"nvlink\", \"layers\": " << a.opt.layers
     << ", \"slots\": " << a.placement.num_slots << ", \"iters\": " << a.opt.iters
     << ", \"copy_bw\": " << per_rank([&](int r) { return sh.info[r].copy_bw; })
     << ", \"nvlink_bw\": " << per_rank([&](int r) { return sh.info[r].nvlink_bw; })
     << ", \"fp8_flops\": " << bench::kFp8Flops << ", \"planner_gpu\": \"" << a.opt.gpu
     << "\", \"times\": \"us per layer\", \"rows\": [";
  for (size_t i = 0; i < reports.size(); ++i) {
    const Report& r = reports[i];
    const auto& rows = sh.rows[i];
    js << (i ? ", " : "") << "{\"batch\": " << r.batch
       << ", \"tokens_per_rank\": " << per_rank([&](int p) { return rows[p].tokens; })
       << ", \"graph_us\": " << r.graph_us
       << ", \"graph_us_per_rank\": " << per_rank([&](int p) { return rows[p].graph_us; })
       << ", \"eager_us\": " << r.eager_us << ", \"shared_inline_graph_us\": " << r.inline_us
       << ", \"comm_alone_us\": " << r.comm_us << ", \"hidden_shared\": " << json_number(r.hidden_shared)
       << ", \"floor_us\": " << r.floor_us << ", \"floor\": {\"mem_us\": " << r.mem_us << ", \"flop_us\": " << r.flop_us
       << ", \"wire_us\": " << r.wire_us << ", \"wire_bytes\": " << r.wire_bytes
       << "}, \"ratio\": " << r.graph_us / r.floor_us << ", \"planner_floor_us\": " << json_number(r.plan_floor_us)
       << ", \"planner\": {\"coverage\": " << json_number(r.plan_coverage)
       << ", \"weights_us\": " << json_number(r.plan_weights_us)
       << ", \"compute_us\": " << json_number(r.plan_compute_us) << ", \"comm_us\": " << json_number(r.plan_comm_us)
       << "}, \"planner_ratio\": "
       << json_number(r.plan_floor_us ? std::optional<double>(r.graph_us / *r.plan_floor_us) : std::nullopt)
       << ", \"tbo\": {\"overlap_us\": " << json_number(r.tbo_us > 0 ? std::optional<double>(r.tbo_us) : std::nullopt)
       << ", \"serial_us\": " << json_number(r.tbo_us > 0 ? std::optional<double>(r.tbo_serial_us) : std::nullopt)
       << ", \"comm_alone_us\": " << json_number(r.tbo_us > 0 ? std::optional<double>(r.tbo_comm_us) : std::nullopt)
       << ", \"hidden\": " << json_number(r.hidden_tbo) << "}, \"hit_slots_per_rank\": " << per_rank([&](int p) {
            double hit = 0;
            for (int l = 0; l < a.opt.layers; ++l) hit += rows[p].hit_slots[l];
            return hit / a.opt.layers;
          })
       << ", \"stages_us\": {";
    for (int s = 0; s < kNumStages; ++s) js << (s ? ", " : "") << "\"" << kStageNames[s] << "\": " << r.stages_us[s];
    js << "}}";
  }
  js << "]}\n";
}

void print_report(const Args& a, int P, const std::vector<Report>& reports) {
  const Shared& sh = *a.shared;
  std::printf("\n%s x %d ranks (nvlink), %s, %d layers of %d local slots each; times in us per layer\n",
              sh.info[0].device, P, a.model.name.c_str(), a.opt.layers, a.placement.slots_per_gpu());
  for (int r = 0; r < P; ++r)
    std::printf("  rank %d: copy %.2f TB/s, NVLink copy %.0f GB/s\n", r, sh.info[r].copy_bw / 1e12,
                sh.info[r].nvlink_bw / 1e9);
  std::printf("\n%6s %9s %9s %9s %9s %9s %9s %7s %9s %7s %9s %9s %8s\n", "B", "graph", "fastest", "eager", "floor",
              "(mem", "wire)", "ratio", "planner", "ratio", "inline", "comm", "hidden");
  for (const Report& r : reports) {
    char plan_floor[32] = "-", plan_ratio[32] = "-";
    if (r.plan_floor_us) {
      std::snprintf(plan_floor, sizeof plan_floor, "%.1f", *r.plan_floor_us);
      std::snprintf(plan_ratio, sizeof plan_ratio, "%.2f", r.graph_us / *r.plan_floor_us);
    }
    std::printf("%6d %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %7.2f %9s %7s %9.1f %9.1f %7.1f%%\n", r.batch, r.graph_us,
                r.graph_min_us, r.eager_us, r.floor_us, std::max(r.mem_us, r.flop_us), r.wire_us,
                r.graph_us / r.floor_us, plan_floor, plan_ratio, r.inline_us, r.comm_us, 100 * r.hidden_shared);
  }
  std::printf(
      "graph: slowest rank's median replay; floor: measured bandwidths (mem = experts + shared expert over copy, "
      "or FLOPs; wire = NVLink bytes over the NVLink copy);\nplanner: plan.h's per-layer terms from the GPU "
      "spec; inline: shared expert on the main stream; hidden = (inline - graph) / comm\n");
  std::printf(
      "\ntwo-batch overlap (two micro-batches, own EP buffers, two streams, one graph):\n%6s %9s %9s %9s %9s %8s\n",
      "B", "graph", "tbo", "serial", "comm", "hidden");
  for (const Report& r : reports)
    if (r.hidden_tbo)
      std::printf("%6d %9.1f %9.1f %9.1f %9.1f %7.1f%%\n", r.batch, r.graph_us, r.tbo_us, r.tbo_serial_us,
                  r.tbo_comm_us, 100 * *r.hidden_tbo);
  std::printf(
      "hidden = (serial - tbo) / comm: the share of the two micro-batches' dispatch + combine the overlap hides "
      "(docs/theory.md §Overlap: 20-27%% for DeepEP at EP4)\n");
  std::printf("\nstages (eager, events, mean over ranks and layers, us):\n%6s", "B");
  for (const char* s : kStageNames) std::printf(" %13s", s);
  std::printf("\n");
  for (const Report& r : reports) {
    std::printf("%6d", r.batch);
    for (double v : r.stages_us) std::printf(" %13.1f", v);
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) try {
  Options opt;
  bool batches_given = false, layers_given = false, iters_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      MOEKIT_CHECK(i + 1 < argc, arg + ": a value is missing");
      return argv[++i];
    };
    if (arg == "--model") opt.model = next();
    else if (arg == "--gpu") opt.gpu = next();
    else if (arg == "--batch") opt.batches = bench::parse_list(next()), batches_given = true;
    else if (arg == "--layers") opt.layers = std::stoi(next()), layers_given = true;
    else if (arg == "--iters") opt.iters = std::stoi(next()), iters_given = true;
    else if (arg == "--ranks") opt.ranks = std::stoi(next());
    else if (arg == "--no-tbo") opt.tbo = false;
    else if (arg == "--pipeline") {
      const std::string v = next();
      MOEKIT_CHECK(v == "staged" || v == "fused", "--pipeline '" + v + "': expected staged or fused");
      opt.pipeline = v == "fused" ? gpu::GpuPipeline::kFused : gpu::GpuPipeline::kStaged;
    }
    else if (arg == "--recv-ready") {
      const std::string v = next();
      MOEKIT_CHECK(v == "0" || v == "1", "--recv-ready '" + v + "': expected 0 or 1");
      opt.recv_ready = v == "1";
    }
    else if (arg == "--quick") opt.quick = true;
    else if (arg == "--json") opt.json = next();
    else throw Error("unknown argument '" + arg + "'");
  }
  if (opt.quick) {  // under 40 s: two batches, two layers, fewer runs
    if (!batches_given) opt.batches = {8, 256};
    if (!layers_given) opt.layers = 2;
    if (!iters_given) opt.iters = 10;
  }
  MOEKIT_CHECK(!opt.batches.empty() && int(opt.batches.size()) <= kMaxBatches,
               "--batch: 1.." + std::to_string(kMaxBatches) + " batches expected");
  for (int b : opt.batches) MOEKIT_CHECK(b >= 1, "--batch: batch " + std::to_string(b) + " must be >= 1");
  MOEKIT_CHECK(opt.layers >= 1 && opt.layers <= kMaxLayers,
               "--layers " + std::to_string(opt.layers) + ", expected 1.." + std::to_string(kMaxLayers));
  MOEKIT_CHECK(opt.iters >= 1, "--iters " + std::to_string(opt.iters) + ", expected >= 1");

  MOEKIT_CHECK(opt.ranks == 0 || opt.ranks >= 2, "--ranks " + std::to_string(opt.ranks) + ", expected >= 2");

  const int gpus = gpu::count_devices_in_child();
  const int P = opt.ranks > 0 ? opt.ranks : std::min(gpus, kMaxRanks);
  if (gpus < 2) {
    std::printf("bench_layer_multi: %d GPU(s): one rank per GPU needs at least 2; skipped\n", gpus);
    if (!opt.json.empty())
      std::ofstream(opt.json) << "{\"bench\": \"layer_multi\", \"skipped\": \"" << gpus << " GPU(s), 2 needed\"}\n";
    return 0;
  }
  MOEKIT_CHECK(P <= gpus && P <= kMaxRanks, "--ranks " + std::to_string(P) + ": " + std::to_string(gpus) +
                                                " GPU(s) here, at most " + std::to_string(kMaxRanks) + " ranks");

  Args a;
  a.opt = opt;
  a.model = load_model_spec(opt.model);
  load_gpu_spec(opt.gpu);  // a bad --gpu fails here, not after the run
  const int E = a.model.num_routed_experts;
  // E / P experts per rank; when P does not divide E, the fewest redundant slots that make it.
  const int slots = (E + P - 1) / P * P;
  a.placement = slots == E ? identity_placement(E, P) : balanced_placement(std::vector<double>(E, 1.0), slots - E, P);
  std::printf("bench_layer_multi: %s, P = %d ranks (of %d GPUs), %d slots, %d layers, batches", a.model.name.c_str(), P,
              gpus, slots, opt.layers);
  for (int b : opt.batches) std::printf(" %d", b);
  std::printf("; generating random FP8 weights of one layer ...\n");
  const auto t0 = std::chrono::steady_clock::now();
  MoeLayerWeights weights = bench::random_layer(a.model);
  a.weights = &weights;
  std::printf("weights ready in %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  void* page = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  MOEKIT_CHECK(page != MAP_FAILED, std::string("mmap of the shared page failed"));
  a.shared = new (page) Shared();
  a.shared->sync.num_ranks = P;
  std::fflush(nullptr);
  const int failed = gpu::launch_ranks(P, opt.quick ? 150.0 : 380.0, rank_body, &a);
  std::printf("ranks done in %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  int rc = 0;
  if (failed != 0) {
    std::fprintf(stderr, "bench_layer_multi: %d of %d ranks failed (their messages are above)\n", failed, P);
    rc = 1;
  } else {
    std::vector<Report> reports;
    for (size_t i = 0; i < opt.batches.size(); ++i) reports.push_back(report_row(a, int(i), P));
    print_report(a, P, reports);
    if (!opt.json.empty()) write_json(opt.json, a, P, reports);
  }
  a.shared->~Shared();
  munmap(page, sizeof(Shared));
  return rc;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_layer_multi: error: %s\n", e.what());
  return 2;
}
