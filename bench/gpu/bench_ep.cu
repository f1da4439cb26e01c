// bench_ep: dispatch and combine latency on one GPU with the `local` transport (P virtual ranks),
// next to the floor measured in the same run: the bytes the kernels must move through device
// memory over the device's copy bandwidth (a large cudaMemcpy, read + write counted).
//
// On one GPU all P ranks' kernels run on that GPU one after another, so a step's time is the
// work of P ranks; "per rank" divides by P. What crosses NVLink on a real EP deployment (the wire
// bytes, messages to other ranks only) is reported too, with the NVLink floor at 450 GB/s one
// way per GPU for reference; the multi-GPU numbers come from the multi-GPU run.
//
//   bench_ep [--json PATH] [--iters N] [--ranks P] [--tokens T] [--hidden d] [--experts E]
//            [--topk k] [--prefill-tokens T] [--ctas N] [--commit SHA]
// Low-latency mode at (P, T) and normal mode at (P, prefill T) are measured (a count of 0 skips
// that mode, so that a profiler's first kernel of a name is the other mode's), each captured
// in CUDA Graphs: one graph of every rank's dispatch_send + dispatch_recv, one of every rank's
// combine_send + combine_recv, and, measured last because it leaves the ranks out of step, one
// of the sends alone (receive time = dispatch - send).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "moekit/bf16.h"
#include "moekit/cuda_check.h"
#include "moekit/ep.h"

using namespace moekit::gpu;

namespace {

struct Options {
  std::string json;
  std::string commit = "unknown";
  int iters = 200, ranks = 8, tokens = 128, hidden = 7168, experts = 256, topk = 8, prefill_tokens = 4096;
  int ctas = 0;  // EpConfig::num_ctas (0: one per SM)
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_ep: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--json") o.json = next();
    else if (a == "--commit") o.commit = next();
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--ranks") o.ranks = std::stoi(next());
    else if (a == "--tokens") o.tokens = std::stoi(next());
    else if (a == "--hidden") o.hidden = std::stoi(next());
    else if (a == "--experts") o.experts = std::stoi(next());
    else if (a == "--topk") o.topk = std::stoi(next());
    else if (a == "--prefill-tokens") o.prefill_tokens = std::stoi(next());
    else if (a == "--ctas") o.ctas = std::stoi(next());
    else {
      std::fprintf(stderr, "bench_ep: unknown argument %s\n", a.c_str());
      std::exit(2);
    }
  }
  return o;
}

// Random bf16 in [-2, 2) from a hash of the index: inputs of gigabytes without host traffic.
__global__ void fill_bf16(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 15;
    h *= 0x85EBCA77u;
    h ^= h >> 13;
    p[i] = moekit::float_to_bf16((float(h >> 8) * (1.0f / 16777216.0f) - 0.5f) * 4.0f);
  }
}

using moekit::bench::median;
using moekit::bench::Timing;

// One replay's time after 5 warm-up replays.
Timing time_graph(cudaGraphExec_t g, cudaStream_t s, int iters) {
  for (int i = 0; i < 5; ++i) MOEKIT_CUDA_CHECK(cudaGraphLaunch(g, s));
  return moekit::bench::time_replays(g, s, iters);
}

// Device copy bandwidth, bytes read + written per second.
double copy_bandwidth(cudaStream_t s) {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&a, bytes));
  MOEKIT_CUDA_CHECK(cudaMalloc(&b, bytes));
  MOEKIT_CUDA_CHECK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e0));
  MOEKIT_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < 12; ++i) {
    MOEKIT_CUDA_CHECK(cudaEventRecord(e0, s));
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
    MOEKIT_CUDA_CHECK(cudaEventRecord(e1, s));
    MOEKIT_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / median(t);
}

struct Result {
  std::string mode;
  int tokens = 0;
  Timing dispatch, combine, send;
  double dispatch_bytes = 0, combine_bytes = 0;            // through device memory, all ranks
  double dispatch_wire = 0, combine_wire = 0;              // to other ranks, per rank (mean)
  double messages_per_token = 0, rows = 0;
};

// One mode at one shape: uniform random routing (distinct slots per token), random data.
Result run_mode(const Options& o, EpMode mode, int tokens, cudaStream_t s) {
  EpConfig c;
  c.num_ranks = o.ranks;
  c.max_tokens = tokens;
  c.hidden = o.hidden;
  c.num_slots = o.experts;
  c.topk = o.topk;
  c.mode = mode;
  c.block_m = 128;
  c.timeout_s = 10;
  c.num_ctas = o.ctas;
  const int P = c.num_ranks, d = c.hidden, k = c.topk, E = c.slots_per_rank();
  std::printf("%s mode, P=%d T=%d: %s\n", ep_mode_name(mode), P, tokens, ep_memory(c).describe().c_str());
  EpLocalGroup group(c);
  std::mt19937 rng(2024);
  std::uniform_int_distribution<int> slot(0, c.num_slots - 1);
  const size_t y_rows = mode == EpMode::kLowLatency ? size_t(E) * c.max_m() : size_t(c.contiguous_rows());
  std::vector<uint16_t*> x(P), y(P), out(P);
  std::vector<int32_t*> idx(P);
  std::vector<float*> w(P);
  std::vector<std::vector<int32_t>> host_idx(P);
  const size_t x_elems = size_t(tokens) * d, y_elems = y_rows * d;
  for (int r = 0; r < P; ++r) {
    host_idx[r].resize(size_t(tokens) * k);
    for (int t = 0; t < tokens; ++t)
      for (int j = 0; j < k; ++j) {
        int v;
        bool fresh;
        do {
          v = slot(rng);
          fresh = true;
          for (int i = 0; i < j; ++i) fresh = fresh && host_idx[r][size_t(t) * k + i] != v;
        } while (!fresh);
        host_idx[r][size_t(t) * k + j] = v;
      }
    std::vector<float> hw(size_t(tokens) * k, 0.125f);
    MOEKIT_CUDA_CHECK(cudaMalloc(&x[r], x_elems * 2));
    MOEKIT_CUDA_CHECK(cudaMalloc(&out[r], x_elems * 2));
    MOEKIT_CUDA_CHECK(cudaMalloc(&y[r], y_elems * 2));
    MOEKIT_CUDA_CHECK(cudaMalloc(&idx[r], host_idx[r].size() * 4));
    MOEKIT_CUDA_CHECK(cudaMalloc(&w[r], hw.size() * 4));
    fill_bf16<<<1024, 256, 0, s>>>(x[r], x_elems, 17u + r);
    fill_bf16<<<1024, 256, 0, s>>>(y[r], y_elems, 1000u + r);
    MOEKIT_CUDA_CHECK_LAUNCH();
    MOEKIT_CUDA_CHECK(cudaMemcpy(idx[r], host_idx[r].data(), host_idx[r].size() * 4, cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaMemcpy(w[r], hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
  }

  // Bytes, from the routing: messages (token, distinct target rank) and rows (token, slot).
  Result res;
  res.mode = ep_mode_name(mode);
  res.tokens = tokens;
  const double msg = double(c.message_bytes()), kb = d / 128.0;
  double msgs = 0, remote_msgs = 0, rows = 0;
  for (int r = 0; r < P; ++r)
    for (int t = 0; t < tokens; ++t) {
      std::vector<int> ranks;
      for (int j = 0; j < k; ++j) {
        const int dst = host_idx[r][size_t(t) * k + j] / E;
        if (std::find(ranks.begin(), ranks.end(), dst) == ranks.end()) ranks.push_back(dst);
      }
      msgs += ranks.size();
      remote_msgs += ranks.size() - (std::find(ranks.begin(), ranks.end(), r) != ranks.end());
      rows += k;
    }
  const double x_bytes = double(P) * tokens * d * 2;
  // One rank has no inbox in either mode (ep.h): its send writes the rows and its combine sums y's
  // rows itself, so no message is written and read back.
  const double round_trips = P > 1 ? 2 : 0;
  // dispatch: read x, write messages, read messages, write rows (payload, scales, source).
  res.dispatch_bytes = x_bytes + round_trips * msgs * msg + rows * (d + 4 * kb + 4);
  // combine: read y rows, write one bf16 vector per message, read them, write out.
  res.combine_bytes = rows * d * 2 + round_trips * msgs * d * 2 + x_bytes;
  res.dispatch_wire = remote_msgs * msg / P;
  res.combine_wire = remote_msgs * d * 2.0 / P;
  res.messages_per_token = msgs / (double(P) * tokens);
  res.rows = rows;

  // One eager step to check that everything runs clean.
  for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(x[r], idx[r], w[r], tokens, s);
  for (int r = 0; r < P; ++r)
    mode == EpMode::kLowLatency ? group.rank(r).dispatch_recv(s) : group.rank(r).normal_dispatch_recv(s);
  for (int r = 0; r < P; ++r) group.rank(r).combine_send(y[r], s);
  for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, out[r], s);
  for (int r = 0; r < P; ++r) group.rank(r).check(s);

  auto capture = [&](auto&& body) {
    cudaGraph_t g;
    cudaGraphExec_t e;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    body();
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    cudaGraphDestroy(g);
    return e;
  };
  cudaGraphExec_t g_disp = capture([&] {
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(x[r], idx[r], w[r], tokens, s);
    for (int r = 0; r < P; ++r)
      mode == EpMode::kLowLatency ? group.rank(r).dispatch_recv(s) : group.rank(r).normal_dispatch_recv(s);
  });
  cudaGraphExec_t g_comb = capture([&] {
    for (int r = 0; r < P; ++r) group.rank(r).combine_send(y[r], s);
    for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, out[r], s);
  });
  cudaGraphExec_t g_send = capture([&] {
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(x[r], idx[r], w[r], tokens, s);
  });
  res.dispatch = time_graph(g_disp, s, o.iters);
  res.combine = time_graph(g_comb, s, o.iters);
  for (int r = 0; r < P; ++r) group.rank(r).check(s);
  res.send = time_graph(g_send, s, o.iters);  // last: the ranks' send steps now run ahead
  for (auto* g : {g_disp, g_comb, g_send}) cudaGraphExecDestroy(g);
  for (int r = 0; r < P; ++r) {
    cudaFree(x[r]);
    cudaFree(y[r]);
    cudaFree(out[r]);
    cudaFree(idx[r]);
    cudaFree(w[r]);
  }
  return res;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  cudaStream_t s;
  MOEKIT_CUDA_CHECK(cudaStreamCreate(&s));
  const moekit::DeviceInfo dev = moekit::query_device();
  const double bw = copy_bandwidth(s);
  std::printf("device: %s, %d SMs, copy bandwidth %.2f TB/s (read + write)\n", dev.name.c_str(), dev.num_sms, bw / 1e12);
  std::vector<Result> results;
  if (o.tokens > 0) results.push_back(run_mode(o, EpMode::kLowLatency, o.tokens, s));
  if (o.prefill_tokens > 0) results.push_back(run_mode(o, EpMode::kNormal, o.prefill_tokens, s));

  const double nvlink = 450e9;
  std::printf("\n%-12s %6s %9s %11s %11s %11s %10s %11s %9s %12s\n", "mode", "T", "phase", "time (us)", "per rank",
              "HBM bytes", "floor (us)", "time/floor", "wire/rank", "NVLink floor");
  for (const Result& r : results) {
    const double P = o.ranks;
    auto row = [&](const char* phase, const Timing& t, double bytes, double wire) {
      const double floor_us = bytes / bw * 1e6;
      std::printf("%-12s %6d %9s %11.1f %11.2f %9.1f MB %10.1f %11.2f %7.2f MB %9.1f us\n", r.mode.c_str(), r.tokens, phase,
                  t.median_us, t.median_us / P, bytes / 1e6, floor_us, t.median_us / floor_us, wire / 1e6,
                  wire / nvlink * 1e6);
    };
    row("dispatch", r.dispatch, r.dispatch_bytes, r.dispatch_wire);
    row("combine", r.combine, r.combine_bytes, r.combine_wire);
    std::printf("%-12s %6d %9s %11.1f %11.2f   (receive = dispatch - send = %.1f us)\n", r.mode.c_str(), r.tokens, "send",
                r.send.median_us, r.send.median_us / P, r.dispatch.median_us - r.send.median_us);
  }

  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "bench_ep: cannot write %s\n", o.json.c_str());
      return 1;
    }
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    std::fprintf(f, "{\n  \"benchmark\": \"ep\",\n  \"date\": \"%s\",\n  \"commit\": \"%s\",\n", date, o.commit.c_str());
    std::fprintf(f, "  \"command\": \"bench_ep --iters %d --ranks %d --tokens %d --hidden %d --experts %d --topk %d --prefill-tokens %d --ctas %d\",\n",
                 o.iters, o.ranks, o.tokens, o.hidden, o.experts, o.topk, o.prefill_tokens, o.ctas);
    std::fprintf(f, "  \"device\": {\"name\": \"%s\", \"sms\": %d, \"copy_bandwidth_Bps\": %.6g},\n", dev.name.c_str(),
                 dev.num_sms, bw);
    std::fprintf(f, "  \"transport\": \"local\",\n  \"ranks\": %d, \"hidden\": %d, \"experts\": %d, \"topk\": %d,\n", o.ranks,
                 o.hidden, o.experts, o.topk);
    std::fprintf(f, "  \"runs\": [\n");
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      auto timing = [&](const Timing& t) {
        char b[128];
        std::snprintf(b, sizeof(b), "{\"median_us\": %.3f, \"min_us\": %.3f, \"max_us\": %.3f}", t.median_us, t.min_us,
                      t.max_us);
        return std::string(b);
      };
      std::fprintf(f,
                   "    {\"mode\": \"%s\", \"tokens_per_rank\": %d, \"messages_per_token\": %.4f, \"rows\": %.0f,\n"
                   "     \"dispatch\": %s, \"combine\": %s, \"send\": %s,\n"
                   "     \"dispatch_hbm_bytes\": %.0f, \"combine_hbm_bytes\": %.0f,\n"
                   "     \"dispatch_floor_us\": %.3f, \"combine_floor_us\": %.3f,\n"
                   "     \"dispatch_wire_bytes_per_rank\": %.0f, \"combine_wire_bytes_per_rank\": %.0f,\n"
                   "     \"nvlink_floor_us_at_450GBps\": {\"dispatch\": %.3f, \"combine\": %.3f}}%s\n",
                   r.mode.c_str(), r.tokens, r.messages_per_token, r.rows, timing(r.dispatch).c_str(),
                   timing(r.combine).c_str(), timing(r.send).c_str(), r.dispatch_bytes, r.combine_bytes,
                   r.dispatch_bytes / bw * 1e6, r.combine_bytes / bw * 1e6, r.dispatch_wire, r.combine_wire,
                   r.dispatch_wire / nvlink * 1e6, r.combine_wire / nvlink * 1e6, i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
    std::printf("wrote %s\n", o.json.c_str());
  }
  cudaStreamDestroy(s);
  return 0;
} catch (const std::exception& e) {  // a CUDA error or bad input: a message, not std::terminate
  std::fprintf(stderr, "bench_ep: error: %s\n", e.what());
  return 2;
}
