// bench_layer: one MoE layer's decode step on one GPU acting as P EP ranks (the `local`
// transport), against its floor measured in the same run.
//
//   bench_layer [--model deepseek-v3] [--ranks 8] [--batch 8,64,256,1024] [--iters 20] [--redundant 0]
//               [--tbo] [--quick] [--json FILE]
//
// --quick (scripts/gpu-check --quick): B in {8, 256} and 5 iterations unless given.
//
// Weights are random FP8 bytes of the real shapes made in memory (values are irrelevant to time;
// the checkpoint generator would write GBs to disk first). Tokens are random; the model's router
// chooses the experts. Per batch B (global, B/P tokens per rank): the whole step of all P ranks is
// captured in one CUDA Graph and replayed `iters` times (median), the same step run eagerly, and
// one eager step with CUDA events around every stage of every rank (summed over ranks).
// Floor: the bytes of the experts that received tokens (all ranks' slots: they share this GPU)
// over the device copy bandwidth measured here (read + write of a 2 GB buffer), next to the FP8
// FLOPs over the 1272 TFLOP/s measured on an H200 (docs/results.md §Reference rates of the H200);
// floor = the larger. "per rank" = time / P.
// --tbo also times two-batch overlap: each rank's tokens split in two micro-batches, each with its
// own EP group and layer objects (sharing the full-batch layers' weights), issued on two streams in one graph so
// that one micro-batch's dispatch and combine kernels can run beside the other's GEMMs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "moekit/cuda_check.h"
#include "moekit/eplb.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/weights.h"

using namespace moekit;
using namespace moekit::bench;

namespace {

struct Row {
  int batch = 0;
  double graph_us = 0, serial_us = 0, tbo_us = 0, eager_us = 0, floor_us = 0, mem_floor_us = 0, flop_floor_us = 0;
  int hit_slots = 0;
  int64_t rows = 0;
  gpu::GpuStageTimes stages;  // summed over ranks, ms
};

}  // namespace

int main(int argc, char** argv) try {
  std::string model_name = "deepseek-v3", batches = "8,64,256,1024", json_path;
  int P = 8, iters = 20, redundant = 0;
  bool tbo = false, quick = false, batch_given = false, iters_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      MOEKIT_CHECK(i + 1 < argc, a + ": a value is missing");
      return argv[++i];
    };
    if (a == "--model") model_name = next();
    else if (a == "--ranks") P = std::stoi(next());
    else if (a == "--batch") batches = next(), batch_given = true;
    else if (a == "--iters") iters = std::stoi(next()), iters_given = true;
    else if (a == "--redundant") redundant = std::stoi(next());
    else if (a == "--json") json_path = next();
    else if (a == "--tbo") tbo = true;
    else if (a == "--quick") quick = true;
    else throw Error("unknown argument '" + a + "'");
  }
  if (quick && !batch_given) batches = "8,256";
  if (quick && !iters_given) iters = 5;
  const ModelSpec model = load_model_spec(model_name);
  const DeviceInfo dev = query_device();
  const int d = int(model.hidden_size), inter = int(model.moe_intermediate_size), E = model.num_routed_experts;
  std::printf("device: %s, %d SMs; model %s, P = %d virtual ranks, %d redundant slots\n", dev.name.c_str(),
              dev.num_sms, model.name.c_str(), P, redundant);

  // Copy bandwidth: a 2 GB device-to-device copy, read + write bytes over the time.
  const double copy_bw = measure_copy_bandwidth();
  std::printf("copy bandwidth (read + write): %.2f TB/s\n", copy_bw / 1e12);

  std::printf("generating random FP8 weights of one layer ...\n");
  const MoeLayerWeights weights = random_layer(model);
  const Placement placement = redundant > 0 ? balanced_placement(std::vector<double>(E, 1.0), redundant, P)
                                            : identity_placement(E, P);
  const size_t expert_bytes = size_t(3) * d * inter + size_t(3) * (d / 128) * (inter / 128) * 4;
  const int shared_inter = int(model.num_shared_experts * model.shared_intermediate_size);

  std::vector<Row> rows;
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int B : parse_list(batches)) {
    const int t_max = (B + P - 1) / P;
    auto first = [&](int r) { return (int64_t(r) * B + P - 1) / P; };
    gpu::EpLocalGroup group(gpu::layer_ep_config(model, placement.num_slots, P, t_max, gpu::EpMode::kLowLatency));
    gpu::GpuLayerConfig cfg;
    cfg.max_tokens = t_max;
    std::vector<std::unique_ptr<gpu::GpuMoeLayer>> layers;
    std::vector<uint16_t*> x(P), out(P);
    for (int r = 0; r < P; ++r) {
      layers.push_back(std::make_unique<gpu::GpuMoeLayer>(model, weights, placement, 0, group.rank(r), cfg));
      MOEKIT_CUDA_CHECK(cudaMalloc(&x[r], size_t(t_max) * d * 2));
      MOEKIT_CUDA_CHECK(cudaMalloc(&out[r], size_t(t_max) * d * 2));
      const std::vector<uint16_t> h = random_bf16(size_t(t_max) * d, r);
      MOEKIT_CUDA_CHECK(cudaMemcpy(x[r], h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    }
    // The copies above and the layers' set-up ran on the legacy default stream, which `stream`
    // (non-blocking) does not wait for, and a pageable cudaMemcpy may return before its DMA lands.
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    auto issue = [&] {
      for (int r = 0; r < P; ++r) layers[r]->dispatch(x[r], int(first(r + 1) - first(r)), first(r), stream);
      for (int r = 0; r < P; ++r) layers[r]->compute(stream);
      for (int r = 0; r < P; ++r) layers[r]->combine(out[r], stream);
    };
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    auto time_us = [&](auto&& body) {
      std::vector<float> t;
      for (int i = 0; i < iters; ++i) {
        cudaEventRecord(e0, stream);
        body();
        cudaEventRecord(e1, stream);
        MOEKIT_CUDA_CHECK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      return 1e3 * t[t.size() / 2];
    };
    // Captures `body` on the stream as one graph, runs it once, and returns the median replay time.
    auto time_graph = [&](auto&& body) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      body();
      MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      const double us = time_us([&] { MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      return us;
    };
    Row row;
    row.batch = B;
    issue();  // warm-up
    for (auto& l : layers) l->check(stream);
    row.eager_us = time_us(issue);
    for (auto& l : layers) l->set_timing(true);
    issue();
    for (auto& l : layers) {
      const gpu::GpuStageTimes t = l->last_times();
      row.stages.gate += t.gate;
      row.stages.dispatch_send += t.dispatch_send;
      row.stages.dispatch_recv += t.dispatch_recv;
      row.stages.gemm1 += t.gemm1;
      row.stages.activation += t.activation;
      row.stages.gemm2 += t.gemm2;
      row.stages.combine_send += t.combine_send;
      row.stages.combine_recv += t.combine_recv;
      l->set_timing(false);
    }
    row.graph_us = time_graph(issue);
    for (auto& l : layers) l->check(stream);
    // The same step with the shared expert in line: the difference is what its overlap hides.
    {
      for (auto& l : layers) l->set_shared_overlap(false);
      row.serial_us = time_graph(issue);
      for (auto& l : layers) l->check(stream);
      for (auto& l : layers) l->set_shared_overlap(true);
    }

    // Two-batch overlap: micro-batch h of rank r holds its tokens [h0, T_r) or [0, h0), h0 = ceil(T_r / 2).
    if (tbo && t_max >= 2) {
      const int t_half = (t_max + 1) / 2;
      std::vector<std::unique_ptr<gpu::EpLocalGroup>> groups;
      std::vector<std::vector<std::unique_ptr<gpu::GpuMoeLayer>>> mb(2);
      gpu::GpuLayerConfig half_cfg = cfg;
      half_cfg.max_tokens = t_half;
      for (int h = 0; h < 2; ++h) {
        gpu::EpConfig half_ep = gpu::layer_ep_config(model, placement.num_slots, P, t_half, gpu::EpMode::kLowLatency);
        half_ep.num_ctas = gpu::two_batch_num_ctas();  // the two micro-batches' receives must not starve each other
        groups.push_back(std::make_unique<gpu::EpLocalGroup>(half_ep));
        for (int r = 0; r < P; ++r)
          mb[h].push_back(std::make_unique<gpu::GpuMoeLayer>(model, weights, placement, 0, groups[h]->rank(r), half_cfg,
                                                             layers[r].get()));
      }
      cudaStream_t stream2;
      cudaEvent_t fork, join;
      MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream2, cudaStreamNonBlocking));
      MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
      MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
      auto part = [&](int h, int r, int& begin, int& count) {
        const int T = int(first(r + 1) - first(r)), h0 = (T + 1) / 2;
        begin = h == 0 ? 0 : h0;
        count = h == 0 ? h0 : T - h0;
      };
      cudaStream_t streams[2] = {stream, stream2};
      row.tbo_us = time_graph([&] {
        MOEKIT_CUDA_CHECK(cudaEventRecord(fork, stream));
        MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream2, fork, 0));
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < P; ++r) {
            int begin, count;
            part(h, r, begin, count);
            mb[h][r]->dispatch(x[r] + size_t(begin) * d, count, first(r) + begin, streams[h]);
          }
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < P; ++r) mb[h][r]->compute(streams[h]);
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < P; ++r) {
            int begin, count;
            part(h, r, begin, count);
            mb[h][r]->combine(out[r] + size_t(begin) * d, streams[h]);
          }
        MOEKIT_CUDA_CHECK(cudaEventRecord(join, stream2));
        MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream, join, 0));
      });
      for (int h = 0; h < 2; ++h)
        for (auto& l : mb[h]) l->check(stream);
      mb.clear();
      groups.clear();
      cudaEventDestroy(fork);
      cudaEventDestroy(join);
      cudaStreamDestroy(stream2);
    }

    // The floor of this routing: weights of the slots that received rows, plus the FLOPs.
    for (int r = 0; r < P; ++r) {
      std::vector<int32_t> count(layers[r]->num_local_experts());
      MOEKIT_CUDA_CHECK(cudaMemcpy(count.data(), group.rank(r).recv_count(), count.size() * 4, cudaMemcpyDeviceToHost));
      for (int c : count) {
        row.hit_slots += c > 0;
        row.rows += c;
      }
    }
    const double bytes = double(row.hit_slots) * expert_bytes + (shared_inter > 0 ? 3.0 * d * shared_inter : 0.0);
    const double flops = 2.0 * 3.0 * d * (double(row.rows) * inter + double(B) * shared_inter);
    row.mem_floor_us = 1e6 * bytes / copy_bw;
    row.flop_floor_us = 1e6 * flops / kFp8Flops;
    row.floor_us = std::max(row.mem_floor_us, row.flop_floor_us);
    rows.push_back(row);
    for (int r = 0; r < P; ++r) {
      cudaFree(x[r]);
      cudaFree(out[r]);
    }
  }

  std::printf("\n%6s %8s %10s %10s %10s %10s %10s %7s %9s %10s\n", "B", "hit", "graph us", "no-overlap", "eager us",
              "floor us", "per rank", "ratio", "tok/s", "rows");
  for (const Row& r : rows)
    std::printf("%6d %8d %10.1f %10.1f %10.1f %10.1f %10.1f %7.2f %9.3g %10lld\n", r.batch, r.hit_slots, r.graph_us,
                r.serial_us, r.eager_us, r.floor_us, r.graph_us / P, r.graph_us / r.floor_us,
                r.batch / (r.graph_us * 1e-6), (long long)r.rows);
  std::printf("no-overlap: the shared expert in line on the main stream instead of on each rank's side stream\n");
  if (tbo) {
    std::printf("\ntwo-batch overlap (two micro-batches on two streams, one graph):\n%6s %10s %10s %8s\n", "B", "graph us",
                "tbo us", "hidden");
    for (const Row& r : rows)
      if (r.tbo_us > 0)
        std::printf("%6d %10.1f %10.1f %7.1f%%\n", r.batch, r.graph_us, r.tbo_us, 100 * (1 - r.tbo_us / r.graph_us));
  }
  std::printf("\nstages (eager, events, summed over the %d ranks, us):\n%6s %8s %8s %8s %8s %8s %8s %8s %8s\n", P, "B",
              "gate", "send", "recv", "gemm1", "act", "gemm2", "c.send", "c.recv");
  for (const Row& r : rows)
    std::printf("%6d %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f\n", r.batch, 1e3 * r.stages.gate,
                1e3 * r.stages.dispatch_send, 1e3 * r.stages.dispatch_recv, 1e3 * r.stages.gemm1,
                1e3 * r.stages.activation, 1e3 * r.stages.gemm2, 1e3 * r.stages.combine_send,
                1e3 * r.stages.combine_recv);
  if (!json_path.empty()) {
    std::ofstream js(json_path);
    js << "{\"bench\": \"layer\", \"device\": \"" << dev.name << "\", \"model\": \"" << model.name << "\", \"ranks\": " << P
       << ", \"redundant\": " << redundant << ", \"copy_bw\": " << copy_bw << ", \"fp8_flops\": " << kFp8Flops
       << ", \"iters\": " << iters << ", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      js << (i ? ", " : "") << "{\"batch\": " << r.batch << ", \"graph_us\": " << r.graph_us
         << ", \"shared_inline_graph_us\": " << r.serial_us << ", \"tbo_graph_us\": " << r.tbo_us << ", \"eager_us\": " << r.eager_us << ", \"floor_us\": " << r.floor_us << ", \"mem_floor_us\": "
         << r.mem_floor_us << ", \"flop_floor_us\": " << r.flop_floor_us << ", \"hit_slots\": " << r.hit_slots
         << ", \"recv_rows\": " << r.rows << ", \"stages_us\": {\"gate\": " << 1e3 * r.stages.gate
         << ", \"dispatch_send\": " << 1e3 * r.stages.dispatch_send << ", \"dispatch_recv\": "
         << 1e3 * r.stages.dispatch_recv << ", \"gemm1\": " << 1e3 * r.stages.gemm1 << ", \"activation\": "
         << 1e3 * r.stages.activation << ", \"gemm2\": " << 1e3 * r.stages.gemm2 << ", \"combine_send\": "
         << 1e3 * r.stages.combine_send << ", \"combine_recv\": " << 1e3 * r.stages.combine_recv << "}}";
    }
    js << "]}\n";
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_layer: error: %s\n", e.what());
  return 2;
}
