// bench_ep_multi: dispatch and combine latency across real GPUs, one process per GPU started by
// launch_ranks, over the `nvlink` transport (CUDA IPC: the kernels write into peers' memory), the
// `nccl` transport (grouped ncclSend/ncclRecv after each send kernel), and `nccl` forced onto its
// network path (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, set before the launch so that the ranks
// inherit it: the path a link between hosts would take). P = every GPU present (at most the
// largest divisor of the expert count).
//
// Timing. A step is only as fast as its slowest rank, and two processes never launch at the same
// instant, so one replay timed on one rank measures mostly launch skew. Each rank therefore
// captures L steps back to back in one CUDA Graph and replays it N times with an event between
// replays; the protocol keeps the ranks in step (every receive waits for every peer), so the
// replays run back to back on every GPU and (time of one replay) / L is the steady-state step.
// Full steps (dispatch_send, dispatch_recv, combine_send, combine_recv) and dispatch-only steps
// (the protocol allows a send right after dispatch_recv) are replayed separately; combine =
// step - dispatch. The ranks meet at a host barrier (a shared page) before each timed run, so
// the barrier stays outside the timed region. N is agreed at a barrier from the slowest rank's
// warm-up replay, so that every rank runs the same number of steps.
//
// Reported per rank: medians over the N replays, the wire bytes (what this rank sends to OTHER
// ranks: messages, count headers and flags), bandwidth = wire bytes / time, and the distinct
// target ranks per token counted on the device (distinct (source, token) pairs in recv_src)
// beside the closed form P (1 - (1 - 1/P)^k). For `nccl` the bytes the transport really moves
// are larger (fixed-size inboxes of T_max messages to every peer) and are reported too.
//
//   bench_ep_multi [--json PATH] [--quick] [--iters N] [--steps L] [--tokens T]
//                  [--prefill-tokens T] [--hidden d] [--experts E] [--topk k]
//                  [--transports nvlink,nccl,nccl-net] [--commit SHA]
// Low-latency mode runs at T tokens per rank (default 128, the DeepSeek-V3 decode shape), normal
// mode at the prefill T (default 4096; 0 leaves it out).
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/ep.h"

using namespace moekit::gpu;

namespace {

constexpr int kMaxRanks = 64;
// Normal-mode steps per graph (1 with --quick): each step takes milliseconds, launch skew is noise.
constexpr int kNormalSteps = 2;
// The issue's targets at EP8 and what DeepEP measured on H200 for the same shape.
constexpr double kTargetDispatchUs = 18.0, kTargetCombineUs = 28.0;
constexpr double kDeepEpDispatchUs = 42.6, kDeepEpCombineUs = 72.0;

struct Options {
  std::string json;
  std::string commit = "unknown";
  bool quick = false;
  int iters = 200, steps = 20, tokens = 128, prefill_tokens = 4096, hidden = 7168, experts = 256, topk = 8;
  std::vector<std::string> transports = {"nvlink", "nccl", "nccl-net"};
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr, "bench_ep_multi: %s\n", what.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  bool iters_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    auto number = [&]() {
      const std::string v = next();
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 0 || n > (1 << 24)) usage_error(a + " = " + v + ", expected a count");
      return int(n);
    };
    if (a == "--json") o.json = next();
    else if (a == "--commit") o.commit = next();
    else if (a == "--quick") o.quick = true;
    else if (a == "--iters") o.iters = number(), iters_given = true;
    else if (a == "--steps") o.steps = number();
    else if (a == "--tokens") o.tokens = number();
    else if (a == "--prefill-tokens") o.prefill_tokens = number();
    else if (a == "--hidden") o.hidden = number();
    else if (a == "--experts") o.experts = number();
    else if (a == "--topk") o.topk = number();
    else if (a == "--transports") {
      o.transports.clear();
      std::stringstream list(next());
      for (std::string t; std::getline(list, t, ',');) {
        if (t != "nvlink" && t != "nccl" && t != "nccl-net")
          usage_error("--transports: " + t + " is not one of nvlink, nccl, nccl-net");
        o.transports.push_back(t);
      }
    } else {
      usage_error("unknown argument " + a);
    }
  }
  if (o.quick && !iters_given) o.iters = 30;
  if (o.iters < 3 || o.steps < 1 || o.tokens < 1) usage_error("--iters must be >= 3, --steps and --tokens >= 1");
  return o;
}

// ---- What the ranks share with the parent: a page mapped before the fork. ----------------------

using moekit::bench::Timing;

struct RankResult {
  int ok;                      // 1 when every figure below was measured
  char error[512];             // the exception that stopped the rank
  Timing step, dispatch;       // per step, medians over the replays
  int replays, steps_per_graph;
  double warmup_replay_s;      // this rank's warm-up replay of both graphs (agreement on N)
  double messages_sent;        // (token, distinct target rank) pairs, this rank included
  double messages_received;    // counted on the device: distinct (source, token) in recv_src
  double dispatch_wire_bytes;  // to other ranks: messages, count headers, flags
  double combine_wire_bytes;   // to other ranks: one bf16 vector per message received, flags
};

struct SharedPage {
  std::atomic<int> arrived;
  std::atomic<int> generation;
  char device_name[128];
  int num_sms;
  RankResult rank[kMaxRanks];
};

// All ranks wait here until every one has arrived; throws after timeout_s (a peer died).
void barrier(SharedPage& page, int num_ranks, double timeout_s) {
  const int gen = page.generation.load(std::memory_order_acquire);
  if (page.arrived.fetch_add(1, std::memory_order_acq_rel) == num_ranks - 1) {
    page.arrived.store(0, std::memory_order_relaxed);
    page.generation.store(gen + 1, std::memory_order_release);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (page.generation.load(std::memory_order_acquire) == gen) {
    MOEKIT_CHECK(std::chrono::steady_clock::now() < deadline,
                 "bench_ep_multi: a peer did not reach the barrier within " + std::to_string(timeout_s) + " s");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// ---- One rank's measurement. -------------------------------------------------------------------

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

// Uniform routing, k distinct slots per token, from the rank's own seed: every rank can draw
// every rank's routing and so knows what it will receive.
std::vector<int32_t> routing(const EpConfig& c, int rank) {
  std::mt19937 rng(2024u + uint32_t(rank));
  std::uniform_int_distribution<int> slot(0, c.num_slots - 1);
  const int T = c.max_tokens, k = c.topk;
  std::vector<int32_t> idx(size_t(T) * k);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      int v;
      bool fresh;
      do {
        v = slot(rng);
        fresh = true;
        for (int i = 0; i < j; ++i) fresh = fresh && idx[size_t(t) * k + i] != v;
      } while (!fresh);
      idx[size_t(t) * k + j] = v;
    }
  return idx;
}

// Distinct target ranks of token t (ascending).
std::vector<int> targets(const EpConfig& c, const std::vector<int32_t>& idx, int t) {
  std::vector<int> r;
  for (int j = 0; j < c.topk; ++j) r.push_back(idx[size_t(t) * c.topk + j] / c.slots_per_rank());
  std::sort(r.begin(), r.end());
  r.erase(std::unique(r.begin(), r.end()), r.end());
  return r;
}

// Messages this rank received in the last step, counted from its outputs: distinct (source,
// token) pairs among the rows' recv_src.
double count_received(EpBuffer& buf) {
  const EpConfig& c = buf.config();
  std::vector<int32_t> src;
  if (c.mode == EpMode::kLowLatency) {
    const int E = c.slots_per_rank(), M = c.max_m();
    std::vector<int32_t> count(E), all(size_t(E) * M);
    MOEKIT_CUDA_CHECK(cudaMemcpy(count.data(), buf.recv_count(), count.size() * 4, cudaMemcpyDeviceToHost));
    MOEKIT_CUDA_CHECK(cudaMemcpy(all.data(), buf.recv_src(), all.size() * 4, cudaMemcpyDeviceToHost));
    for (int e = 0; e < E; ++e)
      for (int m = 0; m < count[e]; ++m) src.push_back(all[size_t(e) * M + m]);
  } else {
    int total = 0;
    MOEKIT_CUDA_CHECK(cudaMemcpy(&total, buf.recv_total_rows(), 4, cudaMemcpyDeviceToHost));
    src.resize(size_t(total));
    if (total > 0) MOEKIT_CUDA_CHECK(cudaMemcpy(src.data(), buf.recv_src(), src.size() * 4, cudaMemcpyDeviceToHost));
  }
  std::vector<uint8_t> seen(size_t(c.max_m()), 0);
  double distinct = 0;
  for (int32_t v : src) {
    if (v < 0) continue;  // padding rows of the contiguous layout
    MOEKIT_CHECK(v < c.max_m(), "bench_ep_multi: recv_src holds " + std::to_string(v) + ", beyond P * T_max");
    distinct += !seen[size_t(v)];
    seen[size_t(v)] = 1;
  }
  return distinct;
}

struct LaunchArgs {
  const Options* options;
  EpTransport transport;
  EpMode mode;
  int tokens;
  SharedPage* page;
};

void measure(const EpProcessGroup& g, const LaunchArgs& a, RankResult& res) {
  const Options& o = *a.options;
  EpConfig c;
  c.num_ranks = g.num_ranks;
  c.max_tokens = a.tokens;
  c.hidden = o.hidden;
  c.num_slots = o.experts;
  c.topk = o.topk;
  c.mode = a.mode;
  c.block_m = 128;
  c.timeout_s = 10;
  const int P = c.num_ranks, me = g.rank, T = c.max_tokens, d = c.hidden, k = c.topk, E = c.slots_per_rank();
  const double barrier_s = 60;
  std::unique_ptr<EpBuffer> buf = connect_ep(c, g, a.transport);  // selects device g.device
  if (me == 0) {
    const moekit::DeviceInfo dev = moekit::query_device();
    std::snprintf(a.page->device_name, sizeof(a.page->device_name), "%s", dev.name.c_str());
    a.page->num_sms = dev.num_sms;
    std::printf("  %s, %s mode, P=%d T=%d: %s\n", ep_transport_name(a.transport), ep_mode_name(a.mode), P, T,
                ep_memory(c).describe().c_str());
  }
  cudaStream_t s;
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // Inputs: routing from each rank's seed, random x and y, random positive weights.
  std::vector<std::vector<int32_t>> idx(P);
  for (int r = 0; r < P; ++r) idx[r] = routing(c, r);
  std::vector<float> w(size_t(T) * k);
  std::mt19937 wrng(77u + uint32_t(me));
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  for (float& v : w) v = wdist(wrng);
  const size_t y_rows = a.mode == EpMode::kLowLatency ? size_t(E) * c.max_m() : size_t(c.contiguous_rows());
  uint16_t *x = nullptr, *y = nullptr, *out = nullptr;
  int32_t* d_idx = nullptr;
  float* d_w = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&x, size_t(T) * d * 2));
  MOEKIT_CUDA_CHECK(cudaMalloc(&out, size_t(T) * d * 2));
  MOEKIT_CUDA_CHECK(cudaMalloc(&y, y_rows * d * 2));
  MOEKIT_CUDA_CHECK(cudaMalloc(&d_idx, idx[me].size() * 4));
  MOEKIT_CUDA_CHECK(cudaMalloc(&d_w, w.size() * 4));
  fill_bf16<<<1024, 256, 0, s>>>(x, size_t(T) * d, 17u + uint32_t(me));
  MOEKIT_CUDA_CHECK_LAUNCH();
  fill_bf16<<<1024, 256, 0, s>>>(y, y_rows * d, 1000u + uint32_t(me));
  MOEKIT_CUDA_CHECK_LAUNCH();
  MOEKIT_CUDA_CHECK(cudaMemcpyAsync(d_idx, idx[me].data(), idx[me].size() * 4, cudaMemcpyHostToDevice, s));
  MOEKIT_CUDA_CHECK(cudaMemcpyAsync(d_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice, s));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s));

  // Bytes from the routing (ep.h's formulas): a message per (token, distinct target rank); each
  // peer's inbox gets a 16-byte flag and align16(4 E_loc) bytes of counts; the combine sends one
  // bf16 vector [d] back per message received, and a flag to every peer.
  double sent = 0, remote_sent = 0, remote_received = 0, received = 0;
  for (int t = 0; t < T; ++t) {
    const std::vector<int> r = targets(c, idx[me], t);
    sent += double(r.size());
    remote_sent += double(r.size()) - double(std::count(r.begin(), r.end(), me));
  }
  for (int src = 0; src < P; ++src)
    for (int t = 0; t < T; ++t) {
      const std::vector<int> r = targets(c, idx[src], t);
      const bool to_me = std::count(r.begin(), r.end(), me) > 0;
      received += to_me;
      remote_received += to_me && src != me;
    }
  const double header = 16.0 + double((4 * E + 15) / 16 * 16);
  res.messages_sent = sent;
  res.dispatch_wire_bytes = remote_sent * double(c.message_bytes()) + (P - 1) * header;
  res.combine_wire_bytes = remote_received * 2.0 * d + (P - 1) * 16.0;

  auto dispatch = [&] {
    buf->dispatch_send(x, d_idx, d_w, T, s);
    if (a.mode == EpMode::kLowLatency)
      buf->dispatch_recv(s);
    else
      buf->normal_dispatch_recv(s);
  };
  auto combine = [&] {
    buf->combine_send(y, s);
    buf->combine_recv(nullptr, out, s);
  };

  // One eager step: everything runs clean, and the device agrees with the routing.
  barrier(*a.page, P, barrier_s);
  dispatch();
  combine();
  buf->check(s);
  res.messages_received = count_received(*buf);
  MOEKIT_CHECK(res.messages_received == received,
               "bench_ep_multi: rank " + std::to_string(me) + " received " + std::to_string(res.messages_received) +
                   " messages on the device, the routing sends it " + std::to_string(received));

  const int L = a.mode == EpMode::kLowLatency ? o.steps : (o.quick ? 1 : kNormalSteps);
  auto capture = [&](auto&& body) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < L; ++i) body();
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    MOEKIT_CUDA_CHECK(cudaGraphDestroy(graph));
    return exec;
  };
  cudaGraphExec_t g_step = capture([&] {
    dispatch();
    combine();
  });
  cudaGraphExec_t g_dispatch = capture(dispatch);

  // Warm-up: one replay of each graph; the slowest rank's time sets N for everyone.
  barrier(*a.page, P, barrier_s);
  const auto t0 = std::chrono::steady_clock::now();
  MOEKIT_CUDA_CHECK(cudaGraphLaunch(g_step, s));
  MOEKIT_CUDA_CHECK(cudaGraphLaunch(g_dispatch, s));
  buf->check(s);
  res.warmup_replay_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  barrier(*a.page, P, barrier_s);
  double slowest = 0;
  for (int r = 0; r < P; ++r) slowest = std::max(slowest, a.page->rank[r].warmup_replay_s);
  const double budget_s = o.quick ? 0.5 : 2.0;  // per timed run of both graphs
  const int n = std::clamp(int(budget_s / std::max(slowest, 1e-6)), 3, o.iters);

  barrier(*a.page, P, barrier_s);
  res.step = moekit::bench::time_replays(g_step, s, n, L);
  buf->check(s);
  barrier(*a.page, P, barrier_s);
  res.dispatch = moekit::bench::time_replays(g_dispatch, s, n, L);
  buf->check(s);
  res.replays = n;
  res.steps_per_graph = L;

  MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(g_step));
  MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(g_dispatch));
  for (void* p : {static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(out), static_cast<void*>(d_idx),
                  static_cast<void*>(d_w)})
    MOEKIT_CUDA_CHECK(cudaFree(p));
  MOEKIT_CUDA_CHECK(cudaStreamDestroy(s));
  barrier(*a.page, P, barrier_s);  // nobody tears down its memory while a peer may still write into it
}

int rank_body(const EpProcessGroup& g, void* arg) {
  const LaunchArgs& a = *static_cast<const LaunchArgs*>(arg);
  RankResult& res = a.page->rank[g.rank];
  try {
    measure(g, a, res);
    res.ok = 1;
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(res.error, sizeof(res.error), "%s", e.what());
    throw;  // the launcher prints it and counts the rank as failed
  }
}

// ---- The parent: runs, gathers, prints and writes. ---------------------------------------------

struct Run {
  std::string transport, path, env, mode;
  int tokens = 0;
  bool ok = false;
  std::string error;
  std::vector<RankResult> ranks;
  double seconds = 0;
};

// Environment for one launch, restored afterwards (the ranks inherit it at fork).
class ScopedEnv {
 public:
  void set(const char* name, const char* value) {
    const char* old = std::getenv(name);
    saved_.push_back({name, old ? old : "", old != nullptr});
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it)
      if (it->had)
        setenv(it->name.c_str(), it->value.c_str(), 1);
      else
        unsetenv(it->name.c_str());
  }

 private:
  struct Saved {
    std::string name, value;
    bool had;
  };
  std::vector<Saved> saved_;
};

double closed_form_targets(int P, int k) { return P * (1.0 - std::pow(1.0 - 1.0 / P, k)); }

double max_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }
double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / double(v.size());
}

std::string json_array(const std::vector<double>& v, const char* fmt = "%.3f") {
  std::string s = "[";
  char b[64];
  for (size_t i = 0; i < v.size(); ++i) {
    std::snprintf(b, sizeof(b), fmt, v[i]);
    s += b;
    if (i + 1 < v.size()) s += ", ";
  }
  return s + "]";
}

std::string json_escape(const std::string& in) {
  std::string out;
  for (char ch : in) {
    if (ch == '"' || ch == '\\') out += '\\', out += ch;
    else if (ch == '\n') out += "\\n";
    else if (uint8_t(ch) < 0x20) out += ' ';
    else out += ch;
  }
  return out;
}

// Per-run figures derived from the ranks' results.
struct Figures {
  std::vector<double> step, dispatch, combine, dispatch_wire, combine_wire, dispatch_gbps, combine_gbps;
  double targets_device = 0, targets_routing = 0;
};

Figures figures(const Run& run, int P) {
  Figures f;
  double received = 0, sent = 0;
  for (const RankResult& r : run.ranks) {
    f.step.push_back(r.step.median_us);
    f.dispatch.push_back(r.dispatch.median_us);
    f.combine.push_back(r.step.median_us - r.dispatch.median_us);
    f.dispatch_wire.push_back(r.dispatch_wire_bytes);
    f.combine_wire.push_back(r.combine_wire_bytes);
    f.dispatch_gbps.push_back(r.dispatch_wire_bytes / (r.dispatch.median_us * 1e3));
    f.combine_gbps.push_back(r.combine_wire_bytes / ((r.step.median_us - r.dispatch.median_us) * 1e3));
    received += r.messages_received;
    sent += r.messages_sent;
  }
  f.targets_device = received / (double(P) * run.tokens);
  f.targets_routing = sent / (double(P) * run.tokens);
  return f;
}

// Bytes the `nccl` transport moves per rank and phase: fixed-size inboxes to every other rank.
double nccl_moved_bytes(const Options& o, int P, int tokens, bool dispatch) {
  EpConfig c;
  c.num_ranks = P;
  c.max_tokens = tokens;
  c.hidden = o.hidden;
  c.num_slots = o.experts;
  c.topk = o.topk;
  const double inbox = dispatch ? 16.0 + double((4 * c.slots_per_rank() + 15) / 16 * 16) +
                                      double(tokens) * double(c.message_bytes())
                                : 16.0 + double(tokens) * 2.0 * o.hidden;
  return (P - 1) * inbox;
}

int write_skip_json(const Options& o, int gpus, const std::string& reason) {
  if (o.json.empty()) return 0;
  FILE* f = std::fopen(o.json.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "bench_ep_multi: cannot write %s\n", o.json.c_str());
    return 1;
  }
  std::fprintf(f, "{\n  \"benchmark\": \"ep_multi\",\n  \"commit\": \"%s\",\n  \"gpus\": %d,\n  \"skipped\": true,\n"
               "  \"reason\": \"%s\"\n}\n", json_escape(o.commit).c_str(), gpus, json_escape(reason).c_str());
  std::fclose(f);
  std::printf("wrote %s\n", o.json.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const int gpus = count_devices_in_child();
  int P = 0;
  for (int p = std::min(gpus, kMaxRanks); p >= 2 && P == 0; --p)
    if (o.experts % p == 0) P = p;
  if (P < 2) {
    const std::string reason = std::to_string(gpus) + " GPU(s): the cross-process transports need at least 2";
    std::printf("bench_ep_multi: skipped: %s\n", reason.c_str());
    return write_skip_json(o, gpus, reason);
  }
  if (P != gpus) std::printf("bench_ep_multi: %d GPUs, using P = %d (a divisor of %d experts)\n", gpus, P, o.experts);

  void* mem = mmap(nullptr, sizeof(SharedPage), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::fprintf(stderr, "bench_ep_multi: mmap of %zu bytes failed\n", sizeof(SharedPage));
    return 1;
  }
  const double launch_timeout_s = o.quick ? 25 : 60;
  std::vector<Run> runs;
  std::string device = "unknown";
  int sms = 0;
  const auto start = std::chrono::steady_clock::now();
  struct ModeRun {
    EpMode mode;
    int tokens;
  };
  std::vector<ModeRun> modes = {{EpMode::kLowLatency, o.tokens}};
  if (o.prefill_tokens > 0) modes.push_back({EpMode::kNormal, o.prefill_tokens});
  std::printf("bench_ep_multi: P=%d, hidden %d, %d experts, top-%d, %s\n", P, o.hidden, o.experts, o.topk,
              o.quick ? "quick" : "full");
  for (const std::string& path : o.transports)
    for (const ModeRun& m : modes) {
      SharedPage* page = new (mem) SharedPage{};
      Run run;
      run.path = path;
      run.transport = path == "nvlink" ? "nvlink" : "nccl";
      run.mode = ep_mode_name(m.mode);
      run.tokens = m.tokens;
      LaunchArgs args{&o, path == "nvlink" ? EpTransport::kNvlink : EpTransport::kNccl, m.mode, m.tokens, page};
      const auto t0 = std::chrono::steady_clock::now();
      int failed;
      {
        ScopedEnv env;
        env.set("NCCL_NVLS_ENABLE", "0");
        if (path == "nccl-net") {
          env.set("NCCL_P2P_DISABLE", "1");
          env.set("NCCL_SHM_DISABLE", "1");
          run.env = "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0";
        } else {
          run.env = "NCCL_NVLS_ENABLE=0";
        }
        std::printf("%s (%s), %s mode, %d tokens per rank...\n", path.c_str(), run.env.c_str(), run.mode.c_str(),
                    m.tokens);
        std::fflush(stdout);
        failed = launch_ranks(P, launch_timeout_s, rank_body, &args);
      }
      run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (page->device_name[0]) {
        device = page->device_name;
        sms = page->num_sms;
      }
      run.ok = failed == 0;
      for (int r = 0; r < P; ++r) {
        run.ranks.push_back(page->rank[r]);
        run.ok = run.ok && page->rank[r].ok;
        if (!page->rank[r].ok && run.error.empty())
          run.error = "rank " + std::to_string(r) + ": " +
                      (page->rank[r].error[0] ? page->rank[r].error : "no result (crashed or killed at the limit)");
      }
      if (!run.ok && run.error.empty()) run.error = std::to_string(failed) + " rank(s) failed";
      std::printf("  %s in %.1f s\n", run.ok ? "done" : ("FAILED: " + run.error).c_str(), run.seconds);
      if (run.ok) {
        const Figures f = figures(run, P);
        for (int r = 0; r < P; ++r)
          std::printf("    rank %d: step %.2f us, dispatch %.2f us, combine %.2f us (%d replays of %d steps)\n", r,
                      f.step[r], f.dispatch[r], f.combine[r], run.ranks[r].replays, run.ranks[r].steps_per_graph);
      }
      runs.push_back(std::move(run));
    }
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double closed = closed_form_targets(P, o.topk);

  std::printf("\ndevice: %d x %s, %d SMs; P = %d; headline = the slowest rank's median; GB/s = wire bytes / time\n",
              P, device.c_str(), sms, P);
  std::printf("%-9s %-12s %5s %-9s %10s %10s %11s %9s %10s  %s\n", "path", "mode", "T", "phase", "max (us)", "mean (us)",
              "wire/rank", "GB/s", "nccl moves", "target at EP8");
  bool all_ok = true;
  for (const Run& run : runs) {
    all_ok = all_ok && run.ok;
    if (!run.ok) {
      std::printf("%-9s %-12s %5d FAILED: %s\n", run.path.c_str(), run.mode.c_str(), run.tokens, run.error.c_str());
      continue;
    }
    const Figures f = figures(run, P);
    const bool ll = run.mode == ep_mode_name(EpMode::kLowLatency);
    auto row = [&](const char* phase, const std::vector<double>& t, const std::vector<double>& wire, bool is_dispatch,
                   double target, double deepep) {
      char moved[32] = "";
      if (run.transport == "nccl")
        std::snprintf(moved, sizeof(moved), "%.2f MB", nccl_moved_bytes(o, P, run.tokens, is_dispatch) / 1e6);
      char tgt[64] = "";
      if (ll && target > 0)
        std::snprintf(tgt, sizeof(tgt), "<= %.0f us (DeepEP %.1f)%s", target, deepep, P == 8 ? "" : ", P differs");
      std::printf("%-9s %-12s %5d %-9s %10.2f %10.2f %8.3f MB %9.1f %10s  %s\n", run.path.c_str(), run.mode.c_str(),
                  run.tokens, phase, max_of(t), mean_of(t), mean_of(wire) / 1e6, mean_of(wire) / (max_of(t) * 1e3),
                  moved, tgt);
    };
    row("dispatch", f.dispatch, f.dispatch_wire, true, kTargetDispatchUs, kDeepEpDispatchUs);
    row("combine", f.combine, f.combine_wire, false, kTargetCombineUs, kDeepEpCombineUs);
    std::printf("%-9s %-12s %5d %-9s %10.2f %10.2f\n", run.path.c_str(), run.mode.c_str(), run.tokens, "step",
                max_of(f.step), mean_of(f.step));
    std::printf("%-9s %-12s %5d targets/token: %.3f on the device (routing %.3f), closed form %.3f\n", run.path.c_str(),
                run.mode.c_str(), run.tokens, f.targets_device, f.targets_routing, closed);
  }
  std::printf("total %.1f s\n", total_s);

  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "bench_ep_multi: cannot write %s\n", o.json.c_str());
      return 1;
    }
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    std::string transports;
    for (const std::string& t : o.transports) transports += (transports.empty() ? "" : ",") + t;
    std::fprintf(f, "{\n  \"benchmark\": \"ep_multi\",\n  \"date\": \"%s\",\n  \"commit\": \"%s\",\n", date,
                 json_escape(o.commit).c_str());
    std::fprintf(f,
                 "  \"command\": \"bench_ep_multi%s --iters %d --steps %d --tokens %d --prefill-tokens %d --hidden %d "
                 "--experts %d --topk %d --transports %s\",\n",
                 o.quick ? " --quick" : "", o.iters, o.steps, o.tokens, o.prefill_tokens, o.hidden, o.experts, o.topk,
                 transports.c_str());
    std::fprintf(f, "  \"device\": {\"name\": \"%s\", \"sms\": %d, \"gpus\": %d},\n", json_escape(device).c_str(), sms,
                 gpus);
    std::fprintf(f, "  \"ranks\": %d, \"hidden\": %d, \"experts\": %d, \"topk\": %d,\n", P, o.hidden, o.experts, o.topk);
    std::fprintf(f, "  \"timing\": \"per rank: median over replays of a graph of steps_per_graph steps, divided by "
                    "steps_per_graph; combine = step - dispatch (dispatch-only graph); headline = max over ranks\",\n");
    std::fprintf(f, "  \"targets_per_token_closed_form\": %.4f,\n", closed);
    std::fprintf(f, "  \"targets_us_at_ep8\": {\"dispatch\": %.1f, \"combine\": %.1f},\n", kTargetDispatchUs,
                 kTargetCombineUs);
    std::fprintf(f, "  \"deepep_h200_us\": {\"dispatch\": %.1f, \"combine\": %.1f},\n", kDeepEpDispatchUs,
                 kDeepEpCombineUs);
    std::fprintf(f, "  \"seconds\": %.1f,\n  \"runs\": [\n", total_s);
    for (size_t i = 0; i < runs.size(); ++i) {
      const Run& run = runs[i];
      std::fprintf(f, "    {\"path\": \"%s\", \"transport\": \"%s\", \"env\": \"%s\", \"mode\": \"%s\", "
                      "\"tokens_per_rank\": %d, \"ok\": %s, \"seconds\": %.1f",
                   run.path.c_str(), run.transport.c_str(), run.env.c_str(), run.mode.c_str(), run.tokens,
                   run.ok ? "true" : "false", run.seconds);
      if (!run.ok) {
        std::fprintf(f, ", \"error\": \"%s\"}%s\n", json_escape(run.error).c_str(), i + 1 < runs.size() ? "," : "");
        continue;
      }
      const Figures g = figures(run, P);
      std::vector<double> step_min, step_max, disp_min, disp_max;
      for (const RankResult& r : run.ranks) {
        step_min.push_back(r.step.min_us);
        step_max.push_back(r.step.max_us);
        disp_min.push_back(r.dispatch.min_us);
        disp_max.push_back(r.dispatch.max_us);
      }
      std::fprintf(f, ",\n     \"replays\": %d, \"steps_per_graph\": %d,\n", run.ranks[0].replays,
                   run.ranks[0].steps_per_graph);
      std::fprintf(f, "     \"dispatch_us\": {\"max\": %.3f, \"mean\": %.3f, \"per_rank\": %s, \"per_rank_min\": %s, "
                      "\"per_rank_max\": %s},\n",
                   max_of(g.dispatch), mean_of(g.dispatch), json_array(g.dispatch).c_str(), json_array(disp_min).c_str(),
                   json_array(disp_max).c_str());
      std::fprintf(f, "     \"combine_us\": {\"max\": %.3f, \"mean\": %.3f, \"per_rank\": %s},\n", max_of(g.combine),
                   mean_of(g.combine), json_array(g.combine).c_str());
      std::fprintf(f, "     \"step_us\": {\"max\": %.3f, \"mean\": %.3f, \"per_rank\": %s, \"per_rank_min\": %s, "
                      "\"per_rank_max\": %s},\n",
                   max_of(g.step), mean_of(g.step), json_array(g.step).c_str(), json_array(step_min).c_str(),
                   json_array(step_max).c_str());
      std::fprintf(f, "     \"dispatch_wire_bytes_per_rank\": %s, \"combine_wire_bytes_per_rank\": %s,\n",
                   json_array(g.dispatch_wire, "%.0f").c_str(), json_array(g.combine_wire, "%.0f").c_str());
      std::fprintf(f, "     \"dispatch_GBps_per_rank\": %s, \"combine_GBps_per_rank\": %s,\n",
                   json_array(g.dispatch_gbps, "%.2f").c_str(), json_array(g.combine_gbps, "%.2f").c_str());
      if (run.transport == "nccl")
        std::fprintf(f, "     \"nccl_moved_bytes_per_rank\": {\"dispatch\": %.0f, \"combine\": %.0f},\n",
                     nccl_moved_bytes(o, P, run.tokens, true), nccl_moved_bytes(o, P, run.tokens, false));
      std::fprintf(f, "     \"targets_per_token\": {\"device\": %.4f, \"routing\": %.4f, \"closed_form\": %.4f}}%s\n",
                   g.targets_device, g.targets_routing, closed, i + 1 < runs.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
    std::printf("wrote %s\n", o.json.c_str());
  }
  munmap(mem, sizeof(SharedPage));
  return all_ok ? 0 : 1;
}
