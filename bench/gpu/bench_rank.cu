// bench_rank: the decode step of the MoE layers on ONE GPU acting as ONE rank (rank 0) of EP over
// P ranks (issue 7; P = --ranks, 8 by default). Rank 0 holds its local experts of every MoE layer
// (EP8: DeepSeek-V3: 32 of 256 experts x 58 layers, ~85 GB of FP8; Qwen3.5-397B-A17B: 64 of 512 x
// 60; EP1: gpt-oss-120b: all 128 experts x 36 layers, ~64 GB of MXFP4 padded to 2944); the other
// P - 1 ranks are token-only peers on the `local` transport: they dispatch their tokens (to rank 0
// and to each other) and take their combine back, but hold no weights and run no GEMM. So rank 0
// receives the recv_count it would receive in a real EP system of P GPUs, and only rank 0's own
// time is reported. With --ranks 1 there are no peers: rank 0 is the whole model on one GPU.
//
// Usage: kUsage below (bench_rank --help prints it).
// --ranks: P, the EP ranks rank 0 is one of; every model's routed experts must be a multiple of P
// and every batch at least P (one token per rank).
// --pipeline: the decode pipelines to measure (GpuLayerConfig::pipeline), each with its own
// layers over the same weights, routing and floor; staged is the baseline of every ratio.
// --uniform: the uniform case only (no skew, no EPLB placement).
// --recv-ready 0: fused layers with GpuLayerConfig::recv_ready off (GEMM1 waits for the dispatch
// receive's grid instead of taking each expert's rows as they land); --recv-ctas N: the receive's
// grid when it is on (GpuLayerConfig::recv_ctas; 0, the default: the layer's automatic choice).
// --combine-ready 0: fused layers whose combine send waits for GEMM2's grid instead of starting
// beside it (GpuLayerConfig::combine_ready); --combine-ctas N: its grid when it is on
// (GpuLayerConfig::combine_ctas; 0, the default: automatic).
// --overlap-shared 0: GpuLayerConfig::overlap_shared off (the staged step's shared expert on rank
// 0's stream, not the side stream); --ep-ctas N: the EP kernels' grid (EpConfig::num_ctas; 0, the
// default: one CTA per SM); --shared-ctas N: GpuLayerConfig::shared_ctas (the staged step's shared
// expert on N SMs of its own, the routed GEMM1 on the others; 0, the default: every GEMM on every SM).
// --shared-first 0|1|-1: fused layers with GpuLayerConfig::shared_first off, on or automatic (the
// default; GEMM1 walks the merged shared expert first and asks the L2 for its W1 while it waits
// for the receive).
// --fused-max-tokens N: GpuLayerConfig::fused_max_tokens (and the EP buffer's self slab with it):
// decode steps of up to N tokens per rank run fused when fused is asked for.
// --expert-ready 0: fused layers with GpuLayerConfig::expert_ready off (GEMM2 waits for GEMM1's
// grid instead of for each expert's rows), the baseline of that lever.
// --merge-shared 0: fused layers run the shared expert with its own GEMMs (GpuLayerConfig::merge_shared
// off, and the EP buffer without a self slab) in line after the send instead of as expert E_loc of
// the routed GEMMs.
// --timeline: for the uniform case, one more replay of a graph captured with the layers' stage
// clock on (GpuMoeLayer::set_timeline): every stage's start and end on the GPU's global timer for
// the middle layer of the first segment, and the share of rank 0's step during which a GEMM
// (routed or shared) was streaming weights; written into the JSON's "timelines".
// gpt-oss (expert_format "mxfp4"): random MXFP4 weights (bench_common.h random_layer_mxfp4); every
// size below (weights, buffers, floor bytes and FLOPs) uses the padded hidden and inter (2944),
// e.g. bench_rank --model gpt-oss-120b --ranks 1 --batch 1,8,64,256,1024 --uniform --pipeline staged.
//
// Cases per model and global batch B (B/P tokens per rank): uniform routing and skewed routing on
// the identity placement (EPLB off, E slots), and the same skewed routing on an EPLB placement (E +
// N slots, N = E/8 by default: 288 = 36 per rank for DeepSeek-V3) that balanced_placement() makes
// from the skew's expert counts over 16 other sampled steps (not with P = 1: one rank has nothing
// to balance). The routing is the simulator's (simulate.h sample_step, one sample per layer),
// handed to rank 0's layers as the caller's routing and to the peers as physical slots
// (choose_replicas_for_rank, the layer's own rule and seed). The default skew hot:E/32:4 makes
// experts 0 .. E/32-1 four times as likely; identity placement puts them on rank 0, which makes
// rank 0 the busiest rank, and under the all-to-all barrier the busiest rank's time is the layer's
// time. --quick: DeepSeek-V3, B in {8, 256}, uniform routing only, 8 layers, 3 replays.
//
// How it is measured. Weights are random FP8 (or MXFP4) bytes of the real shapes, made once per
// model on all cores; every layer gets its own device copy (one weight-holding GpuMoeLayer per
// layer, built on several threads), and per batch size one GpuMoeLayer per layer with buffers for
// that batch shares them (share_weights_with), in segments of as many layers as the free memory
// holds. All layers use one EP group, one step after another. Each layer is issued on one
// stream as
//     peers' dispatch_send | rank 0 dispatch + compute | peers' dispatch_recv + combine_send |
//     rank 0 combine | peers' combine_recv
// so every receive finds its data already sent: rank 0's kernels never wait for a peer and never
// share the GPU with a peer's kernel (in a real EP system the peers run on other GPUs; with P = 1
// the peers' windows are empty). A segment is captured as one CUDA Graph with an event-record node
// (cudaEventRecordExternal) at each of these boundaries; after every replay rank 0's time of a
// layer is read with cudaEventElapsedTime as its two intervals added. The first replay of each
// segment checks the events: every interval >= 0 and, added up, within 5% of the replay's time
// measured outside the graph. One step = the median over replays of rank 0's time summed over the
// layers; one layer = the median over layers and replays. Next to it: the same step run eagerly
// with the layer's stage events (set_timing; combine_recv from the bench's own events, since the
// layer's spans the peers' middle window), and graph / eager. The shared expert runs on rank 0's
// side stream; what of it outlasts rank 0's compute overlaps the peers' window and is not counted
// (its weights are 1/32 of DeepSeek-V3's local experts'). tok/s = B / step; with fewer layers than
// the model has (--layers, or too little memory) the step is scaled to all of them, and the output
// says so.
// Floor per layer: max(bytes / copy bandwidth, FLOPs / 1272 TFLOP/s), bytes = rank 0's local
// experts that received at least one row + the shared expert + activations (received rows in
// FP8 with scales, returned in BF16; the rank's own tokens in and out in BF16). The copy
// bandwidth is measured in this run (2 GB device copy); the FP8 rate is the one measured on an
// H200 (docs/results.md §Reference rates of the H200), not measured here; MXFP4 models are held
// to it too, since their GEMM widens the codes to FP8 for the same tensor cores. rank 0's
// recv_count is predicted on the host from every rank's routing and compared with the device's
// after the eager and the graph runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "ep/cuda/ep_format.h"  // fmtr: "{}" messages in .cu files (fmt 9 does not compile under nvcc)
#include "moekit/cuda_check.h"
#include "moekit/ep.h"
#include "moekit/eplb.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/simulate.h"
#include "moekit/weights.h"

using namespace moekit;
using namespace moekit::bench;
using moekit::gpu::fmtr;

namespace {

constexpr const char* kUsage =
    "bench_rank [--model deepseek-v3,qwen3.5-397b-a17b] [--ranks 8] [--batch 8,64,256,1024,2048] [--layers N]\n"
    "           [--iters 10] [--skew hot:H:R|zipf:S] [--redundant N] [--pipeline staged,fused]\n"
    "           [--timeline] [--uniform] [--quick] [--expert-ready 0|1] [--merge-shared 0|1]\n"
    "           [--recv-ready 0|1] [--recv-ctas N] [--combine-ready 0|1] [--combine-ctas N]\n"
    "           [--shared-first 0|1|-1] [--fused-max-tokens N] [--overlap-shared 0|1] [--ep-ctas N]\n"
    "           [--shared-ctas N]\n"
    "           [--json FILE] [--help]\n";
constexpr uint64_t kReplicaSeed = 7;       // choose_replicas' seed, on the device and on the host
constexpr uint64_t kUniformSeed = 11, kSkewSeed = 12, kStatsSeed = 13;
constexpr double kEpTimeoutS = 10;         // every receive's data is sent before it: a wait means a bug
constexpr size_t kReserveBytes = size_t(2) << 30;  // graphs, events, the driver: never planned into
constexpr int kMaxBuildThreads = 8;        // weight uploads in parallel (host gather + pageable copy)
constexpr int kStatsSteps = 16;            // sampled steps of B = 4096 behind the EPLB placement
constexpr double kGB = 1e9;

// Event-record nodes per layer, at the boundaries of the issue order.
enum Mark { kPeersSend, kRank0Dispatch, kPeersMiddle, kRank0Combine, kPeersCombineRecv, kNumMarks };

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

size_t free_device_bytes() {
  size_t free = 0, total = 0;
  MOEKIT_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

// Global token index of rank r's first token of P ranks: token t lives on rank floor(t P / B) (eplb.h).
int64_t first_token(int r, int batch, int ranks) { return (int64_t(r) * batch + ranks - 1) / ranks; }
int rank_tokens(int r, int batch, int ranks) {
  return int(first_token(r + 1, batch, ranks) - first_token(r, batch, ranks));
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { MOEKIT_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(bytes, 16))); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

class Events {
 public:
  explicit Events(size_t n) : ev_(n, nullptr) {
    for (auto& e : ev_) MOEKIT_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~Events() {
    for (auto e : ev_)
      if (e) cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t operator[](size_t i) const { return ev_[i]; }

 private:
  std::vector<cudaEvent_t> ev_;
};

double elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

// The sizes every estimate and floor uses. MXFP4 models: d and inter are padded to multiples of
// 128 (gpt-oss: 2880 -> 2944), as the layer holds and computes them.
struct Shape {
  bool mxfp4 = false, expert_bias = false;
  int d = 0, inter = 0, shared_inter = 0, num_experts = 0, topk = 0;
  explicit Shape(const ModelSpec& m)
      : mxfp4(m.expert_format == "mxfp4"),
        expert_bias(m.expert_bias),
        d(int(loaded_expert_sizes(m).hidden)),
        inter(int(loaded_expert_sizes(m).intermediate)),
        shared_inter(int(m.num_shared_experts * m.shared_intermediate_size)),
        num_experts(m.num_routed_experts),
        topk(m.num_experts_per_token) {}
  const char* format_name() const { return mxfp4 ? "MXFP4" : "FP8"; }
  // W1 [2 inter, d] + W2 [d, inter] in FP8 with one fp32 scale per 128x128 block.
  double mlp_bytes(int n_inter) const { return 3.0 * d * n_inter + 3.0 * (d / 128) * (n_inter / 128) * 4; }
  // The same in MXFP4: half a byte per weight and one e8m0 byte per 32 (4.25 bits), plus an fp32
  // bias per output row of W1 and W2 where the model has expert biases.
  double mxfp4_mlp_bytes() const {
    return 3.0 * d * inter * (0.5 + 1.0 / kMxfp4Group) + (expert_bias ? 4.0 * (2.0 * inter + d) : 0.0);
  }
  double expert_bytes() const { return mxfp4 ? mxfp4_mlp_bytes() : mlp_bytes(inter); }
  double shared_bytes() const { return shared_inter > 0 ? mlp_bytes(shared_inter) : 0.0; }
};

// What one GpuMoeLayer allocates for its weights (rank 0's slots, the router in fp32, the shared
// expert), before it is measured; the 64 MB covers the small per-token state.
size_t holder_bytes_estimate(const Shape& s, int e_loc) {
  return size_t(e_loc * s.expert_bytes() + s.shared_bytes()) + size_t(s.num_experts) * s.d * 4 + (size_t(64) << 20);
}

// What one GpuMoeLayer allocates besides weights for T_max tokens: docs/layer-gpu.md's routed
// buffers E_loc M_max (2·2 inter + inter + 4 inter/128 + 2 d), per-token state and the shared
// expert's buffers; +10% for the GEMM plans' workspace. Used until the first layer of a batch
// is measured.
size_t layer_buffer_estimate(const Shape& s, int e_loc, int m_max, int t_max) {
  const size_t rows = size_t(e_loc) * m_max, t_pad = size_t(t_max + 3) / 4 * 4;
  size_t b = rows * (4 * size_t(s.inter) + s.inter + 4 * (s.inter / 128) + 2 * size_t(s.d));
  b += size_t(t_max) * (size_t(s.num_experts) * 4 + size_t(s.topk) * 12);
  if (s.shared_inter > 0)
    b += t_pad * (size_t(s.d) + 4 * (s.d / 128) + 5 * size_t(s.shared_inter) + 4 * (s.shared_inter / 128) + 2 * s.d);
  return b + b / 10 + (size_t(64) << 20);
}

// The peers' GEMM output that their combine_send reads (its values are irrelevant); none without peers.
size_t peers_y_bytes(const gpu::EpConfig& ec, const Shape& s) {
  return ec.num_ranks > 1 ? size_t(ec.slots_per_rank()) * ec.max_m() * s.d * 2 : 0;
}

// A batch's fixed device memory: the EP group of P ranks, the peers' y, tokens in and out, routing.
size_t batch_fixed_bytes(const gpu::EpConfig& ec, const Shape& s, int layers) {
  const size_t t = size_t(ec.max_tokens), ranks = size_t(ec.num_ranks);
  return ranks * gpu::ep_memory(ec).total() + peers_y_bytes(ec, s) + 3 * t * s.d * 2 +
         size_t(layers) * ranks * t * s.topk * 4 + t * s.topk * 4;
}

// The EP group of placement's P ranks for global batch B: B/P tokens per rank, rounded up.
gpu::EpConfig batch_ep_config(const ModelSpec& model, const Placement& placement, int batch,
                              gpu::GpuPipeline pipeline = gpu::GpuPipeline::kStaged,
                              int fused_max_tokens = gpu::kFusedMaxTokens, bool merge_shared = true) {
  const int ranks = placement.num_gpus;
  gpu::EpConfig ec = gpu::layer_ep_config(model, placement.num_slots, ranks, (batch + ranks - 1) / ranks,
                                          gpu::EpMode::kLowLatency, pipeline, fused_max_tokens, merge_shared);
  ec.timeout_s = kEpTimeoutS;
  return ec;
}

struct Case {
  std::string routing_name;
  Routing routing;
  uint64_t seed = 0;
};

// One case's routing at one batch, every layer: what the device gets and what the host expects.
struct CaseRouting {
  std::vector<int32_t> image;               // [L][P][T_max][k]: rank 0 logical experts, peers slots, -1 padding
  std::vector<std::vector<int32_t>> recv0;  // [L][E_loc]: rank 0's recv_count
  std::vector<double> max_over_mean;        // [L]: busiest rank's rows over the mean
  std::vector<double> rank0_over_mean;      // [L]
};

CaseRouting make_routing(const Shape& s, const Placement& placement, const Case& c, int batch, int t_max,
                         int layers) {
  const int ranks = placement.num_gpus;
  SimulateInput in;
  in.num_experts = s.num_experts;
  in.topk = s.topk;
  in.num_ranks = ranks;
  in.batch = batch;
  in.trials = 2;
  in.seed = c.seed;
  in.routing = c.routing;
  const int k = s.topk, e_loc = placement.slots_per_gpu();
  CaseRouting out;
  out.image.assign(size_t(layers) * ranks * t_max * k, -1);
  std::vector<int32_t> slots(size_t(batch) * k);
  for (int l = 0; l < layers; ++l) {
    const std::vector<int32_t> logical = sample_step(in, l);
    std::vector<int64_t> slot_rows(placement.num_slots, 0), rank_rows(ranks, 0);
    for (int r = 0; r < ranks; ++r) {
      const int64_t f = first_token(r, batch, ranks);
      const int n = rank_tokens(r, batch, ranks);
      choose_replicas_for_rank(placement, 0, r, logical.data() + f * k, n, k, f, kReplicaSeed, slots.data() + f * k);
      const int32_t* src = (r == 0 ? logical.data() : slots.data()) + f * k;
      std::copy(src, src + size_t(n) * k, out.image.begin() + (size_t(l) * ranks + r) * t_max * k);
    }
    for (int32_t slot : slots)
      if (slot >= 0) ++slot_rows[slot], ++rank_rows[placement.gpu_of_slot(slot)];
    out.recv0.emplace_back(slot_rows.begin(), slot_rows.begin() + e_loc);
    double sum = 0, max = 0;
    for (int64_t v : rank_rows) sum += double(v), max = std::max(max, double(v));
    const double mean = sum / ranks;
    out.max_over_mean.push_back(max / mean);
    out.rank0_over_mean.push_back(double(rank_rows[0]) / mean);
  }
  return out;
}

// Expert counts of the skewed routing over steps other than the measured ones: EPLB's statistics.
std::vector<double> skew_counts(const Shape& s, const Routing& skew, int ranks) {
  SimulateInput in;
  in.num_experts = s.num_experts;
  in.topk = s.topk;
  in.num_ranks = ranks;
  in.batch = 4096;
  in.trials = 2;
  in.seed = kStatsSeed;
  in.routing = skew;
  std::vector<double> counts(s.num_experts, 0.0);
  for (int step = 0; step < kStatsSteps; ++step)
    for (int32_t e : sample_step(in, step)) counts[e] += 1;
  return counts;
}

struct Result {
  std::string model, routing, pipeline;
  bool eplb = false;
  int slots = 0, local_slots = 0, batch = 0, layers = 0, model_layers = 0, segments = 0;
  std::vector<double> step_ms;   // [iters]: rank 0's time summed over the layers (segments added)
  std::vector<double> graph_ms;  // [iters]: the replays' own time (every rank's kernels)
  std::vector<double> layer_ms;  // rank 0's time of each layer in each replay
  gpu::GpuStageTimes stages;     // eager, ms summed over layers (combine_recv: rank 0's combine)
  double eager_ms = 0;           // eager, rank 0's two intervals summed over layers
  double mem_floor_ms = 0, flop_floor_ms = 0, floor_ms = 0;  // summed over layers (floor: per-layer max)
  double weight_bytes = 0;  // summed over layers: the hit experts' and the shared expert's weights
  std::vector<double> layer_floor_ms;                        // each layer's floor
  int64_t recv_rows = 0, hit_slots = 0;                      // summed over layers
  double max_over_mean = 0, rank0_over_mean = 0;             // mean over layers
  double events_ratio_min = 1e30, events_ratio_max = 0;      // first replays: intervals added / replay time
  bool events_ok = true;
  int timeline_layer = -1;                  // --timeline: the layer whose stage clock is kept
  std::vector<gpu::GpuStageClock> timeline;  // by GpuStage
  std::vector<double> clock_step_ms;         // --timeline: rank 0's step from the stage clock, per replay
  std::vector<double> clock_layer_ms;        // its layers

  double step() const { return median(step_ms); }
  // The stage clock's step over the floor of the same layers (the first segment's): the clock's
  // counterpart of step() / floor_ms. (The median layer over the mean layer's floor, the JSON's
  // clock_ratio, reads low where the layers' hit experts spread widely, as at B = 8.)
  double clock_step_ratio() const {
    const size_t n = clock_layer_ms.size() / clock_step_ms.size();
    double floor = 0;
    for (size_t l = 0; l < n; ++l) floor += layer_floor_ms[l];
    return median(clock_step_ms) / floor;
  }
  double scaled_step() const { return step() * model_layers / layers; }
  double tokens_per_s() const { return batch / (scaled_step() * 1e-3); }
  // The weights' bytes over the eager GEMM1 + GEMM2 stage times (TB/s): the GEMMs' own stream rate,
  // to read against the copy bandwidth (the FP8 GEMMs follow it; MXFP4's did not on an H200).
  double gemm_weight_tbps() const {
    const double ms = stages.gemm1 + stages.gemm2;
    return ms > 0 ? weight_bytes / (ms * 1e-3) / 1e12 : 0.0;
  }
  double stage_sum() const {
    return stages.gate + stages.dispatch_send + stages.dispatch_recv + stages.gemm1 + stages.activation +
           stages.gemm2 + stages.combine_send + stages.combine_recv;
  }
};

struct Options {
  std::vector<std::string> models = {"deepseek-v3", "qwen3.5-397b-a17b"};
  std::vector<int> batches = {8, 64, 256, 1024, 2048};
  int layers = 0;  // 0: every MoE layer of the model
  int iters = 10;
  int ranks = 8;       // P: rank 0 on this GPU, P - 1 token-only peers
  std::string skew;    // empty: hot:E/32:4
  int redundant = -1;  // -1: E/8
  bool uniform_only = false;
  std::string json_path;
  std::vector<gpu::GpuPipeline> pipelines = {gpu::GpuPipeline::kStaged, gpu::GpuPipeline::kFused};
  bool timeline = false;
  bool expert_ready = true;  // GpuLayerConfig::expert_ready (--expert-ready 0: GEMM2 waits for GEMM1's grid)
  bool merge_shared = true;  // GpuLayerConfig::merge_shared (--merge-shared 0: the shared expert's own GEMMs)
  bool recv_ready = true;    // GpuLayerConfig::recv_ready (--recv-ready 0: GEMM1 waits for the receive's grid)
  int recv_ctas = gpu::GpuLayerConfig{}.recv_ctas;
  bool combine_ready = true;  // GpuLayerConfig::combine_ready (--combine-ready 0: the send waits for GEMM2's grid)
  int combine_ctas = gpu::GpuLayerConfig{}.combine_ctas;
  int shared_first = gpu::GpuLayerConfig{}.shared_first;  // --shared-first 0|1|-1
  int fused_max_tokens = gpu::kFusedMaxTokens;               // --fused-max-tokens N
  bool overlap_shared = true;  // --overlap-shared 0: GpuLayerConfig::overlap_shared off (staged: shared expert in line)
  int ep_ctas = 0;             // --ep-ctas N: EpConfig::num_ctas (0: every SM)
  int shared_ctas = 0;         // --shared-ctas N: GpuLayerConfig::shared_ctas (0: every GEMM on every SM)
};

// Rank 0's time of one layer from its stage clock, in ms: the span of its dispatch and compute
// kernels (both streams: a side-stream shared expert that outlasts the compute counts, since the
// combine waits for it) plus the span of its combine receive. Unlike the events it holds no
// event-record node (each costs several microseconds of idle GPU in a graph).
double clock_layer_ms(const std::vector<gpu::GpuStageClock>& c) {
  uint64_t lo = ~0ull, hi = 0;
  for (int st = 0; st < int(gpu::GpuStage::kCount); ++st)
    if (st != int(gpu::GpuStage::kCombineRecv) && c[st].ran())
      lo = std::min(lo, c[st].start_ns), hi = std::max(hi, c[st].end_ns);
  const gpu::GpuStageClock& r = c[int(gpu::GpuStage::kCombineRecv)];
  return ((hi > lo ? hi - lo : 0) + (r.ran() ? r.end_ns - r.start_ns : 0)) * 1e-6;
}

// The share of rank 0's own time of a layer (clock_layer_ms) during which at least one GEMM stage
// (routed or shared, both GEMMs) was running: when HBM was streaming weights.
double weight_stream_share(const std::vector<gpu::GpuStageClock>& c) {
  std::vector<std::pair<uint64_t, uint64_t>> gemm;
  for (gpu::GpuStage g : {gpu::GpuStage::kGemm1, gpu::GpuStage::kGemm2, gpu::GpuStage::kSharedGemm1,
                          gpu::GpuStage::kSharedGemm2})
    if (c[int(g)].ran()) gemm.emplace_back(c[int(g)].start_ns, c[int(g)].end_ns);
  std::sort(gemm.begin(), gemm.end());
  uint64_t covered = 0, cur_lo = 0, cur_hi = 0;
  for (auto [a, b] : gemm) {
    if (a > cur_hi) {
      covered += cur_hi - cur_lo;
      cur_lo = a, cur_hi = b;
    } else {
      cur_hi = std::max(cur_hi, b);
    }
  }
  covered += cur_hi - cur_lo;
  const double own_ns = clock_layer_ms(c) * 1e6;
  return own_ns > 0 ? double(covered) / own_ns : 0.0;
}

// Rank 0's weights of every layer of one placement: one GpuMoeLayer per layer on a tiny EP
// buffer (T_max = 1), whose weights the per-batch layers share.
struct Holders {
  std::unique_ptr<gpu::EpLocalGroup> group;
  std::vector<std::unique_ptr<gpu::GpuMoeLayer>> layers;
};

Holders build_holders(const ModelSpec& model, const Shape& s, const MoeLayerWeights& weights,
                      const Placement& placement, const Options& opt, int wanted_layers) {
  const int e_loc = placement.slots_per_gpu();
  int b_max = 0;
  for (int b : opt.batches) b_max = std::max(b_max, b);
  const gpu::EpConfig ec_max = batch_ep_config(model, placement, b_max);
  const size_t batch_need = batch_fixed_bytes(ec_max, s, wanted_layers) +
                            layer_buffer_estimate(s, e_loc, ec_max.max_m(), ec_max.max_tokens);
  Holders h;
  h.group = std::make_unique<gpu::EpLocalGroup>(batch_ep_config(model, placement, placement.num_gpus));
  const size_t free0 = free_device_bytes(), estimate = holder_bytes_estimate(s, e_loc);
  MOEKIT_CHECK(free0 >= estimate + batch_need + kReserveBytes,
               fmtr("device memory: {:.1f} GB free, but one layer's weights on rank 0 need {:.2f} GB and "
                           "B = {} needs {:.1f} GB (+{:.0f} GB reserve): nothing fits",
                           free0 / kGB, estimate / kGB, b_max, batch_need / kGB, kReserveBytes / kGB));
  gpu::GpuLayerConfig cfg;
  cfg.max_tokens = 1;
  cfg.replica_seed = kReplicaSeed;
  const auto t0 = Clock::now();
  h.layers.push_back(std::make_unique<gpu::GpuMoeLayer>(model, weights, placement, 0, h.group->rank(0), cfg));
  const double first_secs = seconds_since(t0);
  const size_t free1 = free_device_bytes();
  const size_t per_layer = std::max<size_t>(free0 - std::min(free0, free1), 1);
  const int64_t fit = free1 >= batch_need + kReserveBytes ? 1 + int64_t((free1 - batch_need - kReserveBytes) / per_layer) : 1;
  const int layers = int(std::min<int64_t>(wanted_layers, fit));
  if (layers < wanted_layers)
    std::printf("  device memory: %.1f GB free; rank 0's weights take %.2f GB per layer and B = %d needs %.1f GB "
                "(EP group, peers' y, one layer's buffers) + %.0f GB reserve: %d of %d layers fit, so %d layers are "
                "measured and every step is scaled to the model's layers\n",
                free0 / kGB, per_layer / kGB, b_max, batch_need / kGB, kReserveBytes / kGB, layers, wanted_layers,
                layers);
  std::printf("  uploading rank 0's weights: %d layers x %d slots, %.1f GB (the first layer alone: %.2f s) ...\n",
              layers, e_loc, double(per_layer) * layers / kGB, first_secs);
  std::fflush(stdout);
  // Several threads: each layer's upload is a host gather of its slots and a pageable copy, both
  // of which overlap across threads (the layer's constructor touches only its own state).
  h.layers.resize(layers);
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  const int num_threads =
      std::max(1, std::min({kMaxBuildThreads, int(std::thread::hardware_concurrency()) / 2, layers - 1}));
  std::atomic<int> next{1};
  std::vector<std::exception_ptr> errors(num_threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < num_threads; ++t)
    pool.emplace_back([&, t] {
      try {
        MOEKIT_CUDA_CHECK(cudaSetDevice(device));
        for (int l = next++; l < layers; l = next++)
          h.layers[l] = std::make_unique<gpu::GpuMoeLayer>(model, weights, placement, 0, h.group->rank(0), cfg);
      } catch (...) {
        errors[t] = std::current_exception();
        next = layers;
      }
    });
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the legacy default stream
  const double secs = seconds_since(t0);
  std::printf("  uploaded in %.1f s (%.1f GB/s, %d threads), %.1f GB of device memory left\n", secs,
              double(per_layer) * layers / kGB / secs, num_threads, free_device_bytes() / kGB);
  std::fflush(stdout);
  return h;
}

// Every case of one placement at one batch size: the per-batch layers in segments, each segment
// captured once and replayed for every case (the routing arrays' contents change, not the graph).
void run_batch(const ModelSpec& model, const Shape& s, const MoeLayerWeights& weights, const Placement& placement,
               bool eplb, const std::vector<Case>& cases, const Holders& holders, int batch, gpu::GpuPipeline pipeline,
               const Options& opt, double copy_bw, cudaStream_t stream, std::vector<Result>& results) {
  const int layers = int(holders.layers.size()), k = s.topk, d = s.d, e_loc = placement.slots_per_gpu();
  const int ranks = placement.num_gpus, t_max = (batch + ranks - 1) / ranks;
  gpu::EpConfig ec = batch_ep_config(model, placement, batch, pipeline, opt.fused_max_tokens, opt.merge_shared);
  if (opt.ep_ctas > 0) ec.num_ctas = opt.ep_ctas;
  // Tokens are d wide, the EP group's (padded for MXFP4); rank 0's layer reads and writes the
  // model's hidden size, their first part.
  MOEKIT_CHECK(ec.hidden == d, fmtr("model '{}': the EP group's hidden is {}, the bench sizes its tokens and floor "
                                    "for {}", model.name, ec.hidden, d));
  gpu::EpLocalGroup group(ec);
  const int m_max = ec.max_m();
  DeviceBuffer x(size_t(t_max) * d * 2), out0(size_t(t_max) * d * 2), peer_out(size_t(t_max) * d * 2);
  DeviceBuffer y(peers_y_bytes(ec, s));
  DeviceBuffer routing(size_t(layers) * ranks * t_max * k * 4), topk_w(size_t(t_max) * k * 4);
  {
    // On the bench's stream: it does not wait for the legacy default stream (non-blocking), and a
    // pageable cudaMemcpy may return before its DMA lands. The device sync covers the EP group's
    // set-up, made on the legacy stream.
    const std::vector<uint16_t> hx = random_bf16(size_t(t_max) * d, 1);
    const std::vector<float> hw(size_t(t_max) * k, 1.0f / k);
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(x.as<void>(), hx.data(), hx.size() * 2, cudaMemcpyHostToDevice, stream));
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(y.as<void>(), 0, peers_y_bytes(ec, s), stream));
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(topk_w.as<void>(), hw.data(), hw.size() * 4, cudaMemcpyHostToDevice, stream));
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  auto route = [&](int l, int r) { return routing.as<int32_t>() + (size_t(l) * ranks + r) * t_max * k; };

  std::vector<CaseRouting> routings;
  std::vector<Result> res(cases.size());
  const int t0 = rank_tokens(0, batch, ranks);
  for (size_t c = 0; c < cases.size(); ++c) {
    routings.push_back(make_routing(s, placement, cases[c], batch, t_max, layers));
    Result& r = res[c];
    r.model = model.name;
    r.routing = cases[c].routing_name;
    r.pipeline = gpu::gpu_pipeline_name(pipeline);
    r.eplb = eplb;
    r.slots = placement.num_slots;
    r.local_slots = e_loc;
    r.batch = batch;
    r.layers = layers;
    r.model_layers = model.num_moe_layers;
    r.step_ms.assign(opt.iters, 0.0);
    r.graph_ms.assign(opt.iters, 0.0);
    for (int l = 0; l < layers; ++l) {
      int64_t rows = 0, hit = 0;
      for (int32_t v : routings[c].recv0[l]) rows += v, hit += v > 0;
      const double weights = double(hit) * s.expert_bytes() + s.shared_bytes();
      r.weight_bytes += weights;
      const double bytes = weights + double(rows) * (d + 4.0 * (d / 128) + 2.0 * d) + 2.0 * t0 * 2.0 * d;
      // MXFP4: d and inter are padded, and the padding's FLOPs are counted: the kernel computes them.
      const double flops = 2.0 * 3.0 * d * (double(rows) * s.inter + double(t0) * s.shared_inter);
      const double mem_ms = 1e3 * bytes / copy_bw, flop_ms = 1e3 * flops / kFp8Flops;
      r.mem_floor_ms += mem_ms;
      r.flop_floor_ms += flop_ms;
      r.floor_ms += std::max(mem_ms, flop_ms);
      r.layer_floor_ms.push_back(std::max(mem_ms, flop_ms));
      r.recv_rows += rows;
      r.hit_slots += hit;
      r.max_over_mean += routings[c].max_over_mean[l] / layers;
      r.rank0_over_mean += routings[c].rank0_over_mean[l] / layers;
    }
  }

  gpu::GpuLayerConfig cfg;
  cfg.max_tokens = t_max;
  cfg.replica_seed = kReplicaSeed;
  cfg.pipeline = pipeline;
  cfg.expert_ready = opt.expert_ready;
  cfg.merge_shared = opt.merge_shared;
  cfg.recv_ready = opt.recv_ready;
  cfg.recv_ctas = opt.recv_ctas;
  cfg.combine_ready = opt.combine_ready;
  cfg.combine_ctas = opt.combine_ctas;
  cfg.shared_first = opt.shared_first;
  cfg.fused_max_tokens = opt.fused_max_tokens;
  cfg.overlap_shared = opt.overlap_shared;
  cfg.shared_ctas = opt.shared_ctas;
  Events marks(size_t(kNumMarks) * layers + 1), outer(2);
  size_t per_layer = layer_buffer_estimate(s, e_loc, m_max, t_max);
  for (int first = 0; first < layers;) {
    // Rank 0's layers of this segment: as many as the free memory holds.
    std::vector<std::unique_ptr<gpu::GpuMoeLayer>> seg;
    while (first + int(seg.size()) < layers) {
      const size_t free = free_device_bytes();
      if (free < per_layer + kReserveBytes) break;
      seg.push_back(std::make_unique<gpu::GpuMoeLayer>(model, weights, placement, 0, group.rank(0), cfg,
                                                       holders.layers[first + seg.size()].get()));
      if (seg.size() == 1) per_layer = std::max<size_t>(free - std::min(free, free_device_bytes()), 1);
    }
    // The layers' constructors copy and clear on the legacy default stream: let that land first.
    MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    MOEKIT_CHECK(!seg.empty(), fmtr("B = {}: {:.1f} GB free, one layer's buffers need {:.2f} GB + {:.0f} GB "
                                           "reserve", batch, free_device_bytes() / kGB, per_layer / kGB,
                                           kReserveBytes / kGB));
    const int n = int(seg.size());
    auto mark = [&](int l, int m) { return marks[size_t(l - first) * kNumMarks + m]; };
    cudaEvent_t seg_end = marks[size_t(n) * kNumMarks];
    auto next_mark = [&](int l, int m) { return m + 1 < kNumMarks ? mark(l, m + 1) : l + 1 < first + n ? mark(l + 1, 0) : seg_end; };
    auto issue = [&](bool capturing) {
      auto record = [&](cudaEvent_t e) {
        if (capturing) MOEKIT_CUDA_CHECK(cudaEventRecordWithFlags(e, stream, cudaEventRecordExternal));
        else MOEKIT_CUDA_CHECK(cudaEventRecord(e, stream));
      };
      for (int l = first; l < first + n; ++l) {
        gpu::GpuMoeLayer& rank0 = *seg[l - first];
        record(mark(l, kPeersSend));
        for (int r = 1; r < ranks; ++r)
          group.rank(r).dispatch_send(x.as<uint16_t>(), route(l, r), topk_w.as<float>(), rank_tokens(r, batch, ranks),
                                      stream);
        record(mark(l, kRank0Dispatch));
        rank0.dispatch(x.as<uint16_t>(), t0, 0, stream, route(l, 0), topk_w.as<float>());
        rank0.compute(stream);
        record(mark(l, kPeersMiddle));
        for (int r = 1; r < ranks; ++r) {
          group.rank(r).dispatch_recv(stream);
          group.rank(r).combine_send(y.as<uint16_t>(), stream);
        }
        record(mark(l, kRank0Combine));
        rank0.combine(out0.as<uint16_t>(), stream);
        record(mark(l, kPeersCombineRecv));
        for (int r = 1; r < ranks; ++r) group.rank(r).combine_recv(nullptr, peer_out.as<uint16_t>(), stream);
      }
      record(seg_end);
    };
    auto rank0_ms = [&](int l) {
      return elapsed_ms(mark(l, kRank0Dispatch), mark(l, kPeersMiddle)) +
             elapsed_ms(mark(l, kRank0Combine), mark(l, kPeersCombineRecv));
    };
    auto check_all = [&] {
      for (auto& layer : seg) layer->check(stream);
      for (int r = 1; r < ranks; ++r) group.rank(r).check(stream);
    };
    // recv_count is left by the segment's last layer; the host predicted every layer's.
    auto check_recv = [&](size_t c, const char* run) {
      std::vector<int32_t> got(e_loc);
      MOEKIT_CUDA_CHECK(cudaMemcpy(got.data(), group.rank(0).recv_count(), got.size() * 4, cudaMemcpyDeviceToHost));
      const std::vector<int32_t>& want = routings[c].recv0[first + n - 1];
      for (int i = 0; i < e_loc; ++i)
        MOEKIT_CHECK(got[i] == want[i], fmtr("{} B = {} {}: rank 0's recv_count[{}] = {} after the {} run of "
                                                    "layer {}, the host predicts {}", model.name, batch,
                                                    cases[c].routing_name, i, got[i], run, first + n - 1, want[i]));
    };

    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    issue(true);
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    for (size_t c = 0; c < cases.size(); ++c) {
      Result& r = res[c];
      ++r.segments;
      // Ordered on the stream (see above): the previous case's replays are done, the next step reads it.
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(routing.as<void>(), routings[c].image.data(), routings[c].image.size() * 4,
                                        cudaMemcpyHostToDevice, stream));
      issue(false);  // warm-up
      check_all();
      check_recv(c, "eager");
      for (auto& layer : seg) layer->set_timing(true);
      issue(false);
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));  // the bench's own events come after the layer's
      for (int l = first; l < first + n; ++l) {
        gpu::GpuStageTimes t = seg[l - first]->last_times();
        r.stages.gate += t.gate;
        r.stages.dispatch_send += t.dispatch_send;
        r.stages.dispatch_recv += t.dispatch_recv;
        r.stages.gemm1 += t.gemm1;
        r.stages.activation += t.activation;
        r.stages.gemm2 += t.gemm2;
        r.stages.combine_send += t.combine_send;
        r.stages.combine_recv += float(elapsed_ms(mark(l, kRank0Combine), mark(l, kPeersCombineRecv)));
        r.eager_ms += rank0_ms(l);
      }
      for (auto& layer : seg) layer->set_timing(false);

      MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
      for (int i = 0; i < opt.iters; ++i) {
        MOEKIT_CUDA_CHECK(cudaEventRecord(outer[0], stream));
        MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        MOEKIT_CUDA_CHECK(cudaEventRecord(outer[1], stream));
        MOEKIT_CUDA_CHECK(cudaEventSynchronize(outer[1]));
        const double replay = elapsed_ms(outer[0], outer[1]);
        if (i == 0) {
          // The events must partition the replay: no interval negative, together the whole replay.
          double sum = 0;
          bool ordered = true;
          for (int l = first; l < first + n; ++l)
            for (int m = 0; m < kNumMarks; ++m) {
              const double v = elapsed_ms(mark(l, m), next_mark(l, m));
              ordered = ordered && v >= 0;
              sum += v;
            }
          const double ratio = sum / replay;
          r.events_ratio_min = std::min(r.events_ratio_min, ratio);
          r.events_ratio_max = std::max(r.events_ratio_max, ratio);
          if (!ordered || ratio < 0.95 || ratio > 1.01) {
            r.events_ok = false;
            std::printf("  WARNING: B = %d %s layers %d..%d: the graph's events do not partition the replay "
                        "(intervals %s, their sum %.3f ms, the replay %.3f ms)\n",
                        batch, r.routing.c_str(), first, first + n - 1, ordered ? ">= 0" : "NEGATIVE", sum, replay);
          }
        }
        double step = 0;
        for (int l = first; l < first + n; ++l) {
          const double v = rank0_ms(l);
          r.layer_ms.push_back(v);
          step += v;
        }
        r.step_ms[i] += step;
        r.graph_ms[i] += replay;
      }
      check_all();
      check_recv(c, "graph");
    }
    MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOEKIT_CUDA_CHECK(cudaGraphDestroy(graph));
    if (opt.timeline && first == 0) {
      // The stage clock from its own graph, so its resets and atomics stay out of the figures above.
      for (auto& layer : seg) layer->set_timeline(true);
      MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      issue(true);
      MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(routing.as<void>(), routings[0].image.data(), routings[0].image.size() * 4,
                                        cudaMemcpyHostToDevice, stream));
      MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up
      res[0].clock_step_ms.assign(opt.iters, 0.0);
      for (int i = 0; i < opt.iters; ++i) {
        MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        for (int l = 0; l < n; ++l) {
          const double v = clock_layer_ms(seg[l]->last_timeline(stream));
          res[0].clock_layer_ms.push_back(v);
          res[0].clock_step_ms[i] += v;
        }
      }
      check_all();
      res[0].timeline_layer = n / 2;
      res[0].timeline = seg[n / 2]->last_timeline(stream);
      MOEKIT_CUDA_CHECK(cudaGraphExecDestroy(exec));
      MOEKIT_CUDA_CHECK(cudaGraphDestroy(graph));
      for (auto& layer : seg) layer->set_timeline(false);
    }
    first += n;
  }
  for (Result& r : res) {
    std::printf("  %-6s B = %4d %-10s %-4s %3d slots: layer %8.1f us, step %8.3f ms%s, %9.0f tok/s, floor %7.3f ms, "
                "ratio %5.2f, recv %7.0f rows/layer, max/mean %.2f (rank 0 %.2f), graph/eager %.3f, %d segment%s\n",
                r.pipeline.c_str(), r.batch, r.routing.c_str(), r.eplb ? "eplb" : "", r.slots, 1e3 * median(r.layer_ms),
                r.step(),
                r.layers < r.model_layers ? fmtr(" ({} layers)", r.layers).c_str() : "", r.tokens_per_s(),
                r.floor_ms, r.step() / r.floor_ms, double(r.recv_rows) / r.layers, r.max_over_mean,
                r.rank0_over_mean, r.step() / r.stage_sum(), r.segments, r.segments > 1 ? "s" : "");
    std::fflush(stdout);
    results.push_back(std::move(r));
  }
}

void write_json(const std::string& path, const DeviceInfo& dev, double copy_bw, const Options& opt,
                const std::vector<Result>& results) {
  std::ofstream js(path);
  MOEKIT_CHECK(js.good(), "--json " + path + ": cannot open for writing");
  js << "{\"bench\": \"rank\", \"device\": \"" << dev.name << "\", \"ranks\": " << opt.ranks
     << ", \"rank\": 0, \"copy_bw\": " << copy_bw << ", \"fp8_flops\": " << kFp8Flops
     << ", \"fp8_flops_source\": \"docs/results.md §Reference rates of the H200 (FP8 GEMM measured on an "
        "H200), not measured in this run\""
     << ", \"iters\": " << opt.iters << ", \"expert_ready\": " << (opt.expert_ready ? "true" : "false")
     << ", \"merge_shared\": " << (opt.merge_shared ? "true" : "false")
     << ", \"recv_ready\": " << (opt.recv_ready ? "true" : "false") << ", \"recv_ctas\": " << opt.recv_ctas
     << ", \"combine_ready\": " << (opt.combine_ready ? "true" : "false") << ", \"combine_ctas\": " << opt.combine_ctas
     << ", \"shared_first\": " << opt.shared_first
     << ", \"fused_max_tokens\": " << opt.fused_max_tokens << ", \"shared_ctas\": " << opt.shared_ctas
     << ", \"timing\": \"rank 0's kernels only: event-record nodes inside one CUDA Graph per segment of layers, "
        "rank 0's two intervals per layer (dispatch + compute, combine) added; step = median over replays of the "
        "sum over layers, layer = median over layers and replays\""
     << ", \"rows\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const gpu::GpuStageTimes& t = r.stages;
    const double per = 1e3 / r.layers;  // ms summed over layers -> us per layer
    js << (i ? ",\n  " : "\n  ") << "{\"model\": \"" << r.model << "\", \"pipeline\": \"" << r.pipeline
       << "\", \"batch\": " << r.batch << ", \"routing\": \""
       << r.routing << "\", \"eplb\": " << (r.eplb ? "true" : "false") << ", \"slots\": " << r.slots
       << ", \"local_slots\": " << r.local_slots << ", \"layers\": " << r.layers
       << ", \"model_layers\": " << r.model_layers << ", \"segments\": " << r.segments
       << ", \"tokens_per_s\": " << r.tokens_per_s() << ", \"layer_us\": " << 1e3 * median(r.layer_ms)
       << ", \"step_us\": " << 1e3 * r.step() << ", \"step_scaled_to_model_us\": " << 1e3 * r.scaled_step()
       << ", \"graph_replay_all_ranks_us\": " << 1e3 * median(r.graph_ms) << ", \"eager_rank0_us\": "
       << 1e3 * r.eager_ms << ", \"eager_stage_sum_us\": " << 1e3 * r.stage_sum()
       << ", \"graph_over_eager\": " << r.step() / r.stage_sum() << ", \"gemm_weight_TBps\": " << r.gemm_weight_tbps()
       << ", \"stages_us_per_layer\": {\"gate\": "
       << per * t.gate << ", \"dispatch_send\": " << per * t.dispatch_send << ", \"dispatch_recv\": "
       << per * t.dispatch_recv << ", \"gemm1\": " << per * t.gemm1 << ", \"activation\": " << per * t.activation
       << ", \"gemm2\": " << per * t.gemm2 << ", \"combine_send\": " << per * t.combine_send
       << ", \"combine_recv\": " << per * t.combine_recv << "}, \"floor_us\": " << 1e3 * r.floor_ms
       << ", \"mem_floor_us\": " << 1e3 * r.mem_floor_ms << ", \"flop_floor_us\": " << 1e3 * r.flop_floor_ms
       << ", \"ratio\": " << r.step() / r.floor_ms << ", \"recv_rows_total\": " << r.recv_rows
       << ", \"recv_rows_per_layer\": " << double(r.recv_rows) / r.layers
       << ", \"hit_slots_per_layer\": " << double(r.hit_slots) / r.layers
       << ", \"max_over_mean_load\": " << r.max_over_mean << ", \"rank0_over_mean_load\": " << r.rank0_over_mean
       << ", \"events_ok\": " << (r.events_ok ? "true" : "false") << ", \"events_ratio_min\": " << r.events_ratio_min
       << ", \"events_ratio_max\": " << r.events_ratio_max;
    if (!r.clock_step_ms.empty())
      js << ", \"clock_layers\": " << r.clock_layer_ms.size() / r.clock_step_ms.size()
         << ", \"clock_layers_step_us\": " << 1e3 * median(r.clock_step_ms) << ", \"clock_layer_us\": "
         << 1e3 * median(r.clock_layer_ms) << ", \"clock_ratio\": " << median(r.clock_layer_ms) / (r.floor_ms / r.layers)
         << ", \"events_ratio_per_layer\": " << median(r.layer_ms) / (r.floor_ms / r.layers)
         << ", \"clock_step_ratio\": " << r.clock_step_ratio();
    if (!r.clock_layer_ms.empty()) {  // the last replay's layers, to see how they spread
      const size_t n = r.clock_layer_ms.size() / r.clock_step_ms.size();
      js << ", \"clock_last_replay_layers_us\": [";
      for (size_t l = 0; l < n; ++l) js << (l ? ", " : "") << 1e3 * r.clock_layer_ms[r.clock_layer_ms.size() - n + l];
      js << "]";
    }
    js << "}";
  }
  js << "\n], \"timelines\": [";
  bool first = true;
  for (const Result& r : results) {
    if (r.timeline.empty()) continue;
    uint64_t t0 = ~0ull, t1 = 0;
    for (const auto& c : r.timeline)
      if (c.ran()) t0 = std::min(t0, c.start_ns), t1 = std::max(t1, c.end_ns);
    js << (first ? "\n  " : ",\n  ") << "{\"model\": \"" << r.model << "\", \"pipeline\": \"" << r.pipeline
       << "\", \"batch\": " << r.batch << ", \"routing\": \"" << r.routing << "\", \"layer\": " << r.timeline_layer
       << ", \"span_us\": " << (t1 - t0) * 1e-3 << ", \"weight_stream_share\": " << weight_stream_share(r.timeline)
       << ", \"stages\": [";
    first = false;
    bool first_stage = true;
    for (int st = 0; st < int(gpu::GpuStage::kCount); ++st) {
      const auto& c = r.timeline[st];
      if (!c.ran()) continue;
      js << (first_stage ? "" : ", ") << "{\"stage\": \"" << gpu::gpu_stage_name(gpu::GpuStage(st))
         << "\", \"start_us\": " << (c.start_ns - t0) * 1e-3 << ", \"end_us\": " << (c.end_ns - t0) * 1e-3 << "}";
      first_stage = false;
    }
    js << "]}";
  }
  js << "\n]}\n";
}

void print_tables(const std::vector<Result>& results, int ranks) {
  std::printf("\nrank 0 of EP%d, MoE layers only (CUDA Graph replay, rank 0's kernels timed by events inside it):\n",
              ranks);
  std::printf("%-18s %-6s %5s %-10s %-4s %5s %9s %10s %10s %9s %6s %9s %8s %8s %8s\n", "model", "pipe", "B", "routing",
              "eplb", "slots", "layer us", "step ms", "tok/s", "floor ms", "ratio", "recv/lay", "hit/lay", "max/mean",
              "r0/mean");
  for (const Result& r : results)
    std::printf("%-18s %-6s %5d %-10s %-4s %5d %9.1f %10.3f %10.0f %9.3f %6.2f %9.0f %8.1f %8.2f %8.2f\n",
                r.model.c_str(), r.pipeline.c_str(), r.batch, r.routing.c_str(), r.eplb ? "on" : "off", r.slots,
                1e3 * median(r.layer_ms), r.step(),
                r.tokens_per_s(), r.floor_ms, r.step() / r.floor_ms, double(r.recv_rows) / r.layers,
                double(r.hit_slots) / r.layers, r.max_over_mean, r.rank0_over_mean);
  for (const Result& r : results)
    if (r.layers < r.model_layers) {
      std::printf("(rows with fewer layers than the model: step and floor are over the measured layers, tok/s "
                  "over the step scaled to all layers)\n");
      break;
    }
  std::printf("\nrank 0's stages per layer, eager (GpuMoeLayer events; c.recv = rank 0's combine), us; "
              "graph/eager = graph step over the eager sum:\n");
  std::printf("(w TB/s: the hit experts' and the shared expert's weight bytes over gemm1 + gemm2)\n");
  std::printf("%-18s %-6s %5s %-10s %-4s %7s %7s %7s %7s %7s %7s %7s %7s %10s %10s %7s %12s %7s\n", "model", "pipe", "B",
              "routing", "eplb", "gate", "send", "recv", "gemm1", "act", "gemm2", "c.send", "c.recv", "eager ms", "graph ms",
              "g/e", "all ranks ms", "w TB/s");
  for (const Result& r : results) {
    const gpu::GpuStageTimes& t = r.stages;
    const double per = 1e3 / r.layers;
    std::printf("%-18s %-6s %5d %-10s %-4s %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %10.3f %10.3f %7.3f %12.3f %7.2f\n",
                r.model.c_str(), r.pipeline.c_str(), r.batch, r.routing.c_str(), r.eplb ? "on" : "off", per * t.gate,
                per * t.dispatch_send, per * t.dispatch_recv, per * t.gemm1, per * t.activation, per * t.gemm2,
                per * t.combine_send, per * t.combine_recv, r.stage_sum(), r.step(), r.step() / r.stage_sum(),
                median(r.graph_ms), r.gemm_weight_tbps());
  }
  bool all_ok = true;
  double lo = 1e30, hi = 0;
  for (const Result& r : results) {
    all_ok = all_ok && r.events_ok;
    lo = std::min(lo, r.events_ratio_min);
    hi = std::max(hi, r.events_ratio_max);
  }
  // Fused against staged on the same case: the step, and each against its floor.
  bool fused_header = false;
  for (const Result& f : results) {
    if (f.pipeline != "fused") continue;
    for (const Result& st : results)
      if (st.pipeline == "staged" && st.model == f.model && st.batch == f.batch && st.routing == f.routing &&
          st.eplb == f.eplb) {
        if (!fused_header) std::printf("\nfused against staged (rank 0's step; ratio to the same floor):\n");
        fused_header = true;
        std::printf("  %-18s B = %4d %-10s %-4s staged %8.3f ms (%.2fx) -> fused %8.3f ms (%.2fx): %.3f\n",
                    f.model.c_str(), f.batch, f.routing.c_str(), f.eplb ? "eplb" : "", st.step(), st.step() / st.floor_ms,
                    f.step(), f.step() / f.floor_ms, f.step() / st.step());
      }
  }
  bool clock_header = false;
  for (const Result& r : results) {
    if (r.clock_step_ms.empty()) continue;
    if (!clock_header)
      std::printf("\nrank 0's step from the stage clock (first segment's layers; no event-record nodes) against the "
                  "events' (same layers):\n");
    clock_header = true;
    std::printf("  %-18s %-6s B = %4d: clock step %.2fx the floor (median layer %7.1f us, %.2fx the mean "
                "layer's), events layer %7.1f us (%.2fx)\n",
                r.model.c_str(), r.pipeline.c_str(), r.batch, r.clock_step_ratio(), 1e3 * median(r.clock_layer_ms),
                median(r.clock_layer_ms) / (r.floor_ms / r.layers), 1e3 * median(r.layer_ms),
                median(r.layer_ms) / (r.floor_ms / r.layers));
  }
  for (const Result& r : results)
    if (!r.timeline.empty()) {
      std::printf("\ntimeline %s %s B = %d layer %d (us from the layer's first stage start; weights streaming %.0f%% "
                  "of the span):\n",
                  r.model.c_str(), r.pipeline.c_str(), r.batch, r.timeline_layer, 100.0 * weight_stream_share(r.timeline));
      uint64_t t0 = ~0ull;
      for (const auto& c : r.timeline)
        if (c.ran()) t0 = std::min(t0, c.start_ns);
      for (int st = 0; st < int(gpu::GpuStage::kCount); ++st)
        if (r.timeline[st].ran())
          std::printf("  %-18s %8.1f %8.1f\n", gpu::gpu_stage_name(gpu::GpuStage(st)),
                      (r.timeline[st].start_ns - t0) * 1e-3, (r.timeline[st].end_ns - t0) * 1e-3);
    }
  std::printf("graph events (first replay of every segment): intervals added / replay time in [%.4f, %.4f]: %s\n", lo,
              hi, all_ok ? "they partition the replay" : "NOT SANE, see the warnings above");
  // EPLB: the same skewed routing without and with the rebalanced placement.
  bool header = false;
  for (const Result& on : results) {
    if (!on.eplb) continue;
    for (const Result& off : results)
      if (!off.eplb && off.model == on.model && off.batch == on.batch && off.routing == on.routing &&
          off.pipeline == on.pipeline) {
        if (!header)
          std::printf("\nEPLB: max/mean per-GPU rows over the %d ranks (mean over layers; target <= 1.10 where "
                      "replicas allow, small B is sampling noise):\n",
                      ranks);
        header = true;
        std::printf("  %-18s %-6s B = %4d %-10s %.2f (%d slots) -> %.2f (%d slots); rank 0's step %.3f -> %.3f ms\n",
                    on.model.c_str(), on.pipeline.c_str(), on.batch, on.routing.c_str(), off.max_over_mean, off.slots, on.max_over_mean,
                    on.slots, off.step(), on.step());
      }
  }
}

// Checks `model` against the options (an MoE model, experts and redundant slots a multiple of
// --ranks, --layers within the model); returns the EPLB placement's redundant slots.
int checked_redundant(const ModelSpec& model, const Options& opt) {
  MOEKIT_CHECK(model.is_moe() && model.num_routed_experts % opt.ranks == 0,
               fmtr("model '{}': {} routed experts, expected a multiple of --ranks {}", model.name,
                    model.num_routed_experts, opt.ranks));
  MOEKIT_CHECK(opt.layers <= model.num_moe_layers,
               fmtr("--layers {}: model '{}' has {} MoE layers", opt.layers, model.name, model.num_moe_layers));
  const int redundant = opt.redundant >= 0 ? opt.redundant : model.num_routed_experts / 8;
  MOEKIT_CHECK(redundant % opt.ranks == 0,
               fmtr("--redundant {}: expected a multiple of {} (slots per rank stay equal)", redundant, opt.ranks));
  return redundant;
}

}  // namespace

int main(int argc, char** argv) try {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Options opt;
  bool quick = false, models_given = false, batch_given = false, layers_given = false, iters_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      MOEKIT_CHECK(i + 1 < argc, a + ": a value is missing");
      return argv[++i];
    };
    auto next_int = [&](int lo) {
      const std::string v = next();
      size_t used = 0;
      int n = 0;
      try {
        n = std::stoi(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      MOEKIT_CHECK(used == v.size() && n >= lo, fmtr("{} '{}': expected an integer >= {}", a, v, lo));
      return n;
    };
    if (a == "--model") {
      opt.models.clear();
      std::stringstream ss(next());
      for (std::string m; std::getline(ss, m, ',');) opt.models.push_back(m);
      models_given = true;
    } else if (a == "--ranks") {
      opt.ranks = next_int(1);
      MOEKIT_CHECK(opt.ranks <= gpu::kEpMaxRanks, fmtr("--ranks {}: expected at most {}", opt.ranks, gpu::kEpMaxRanks));
    } else if (a == "--batch") {
      opt.batches = parse_list(next());
      batch_given = true;
    } else if (a == "--layers") {
      opt.layers = next_int(1);
      layers_given = true;
    } else if (a == "--iters") {
      opt.iters = next_int(1);
      iters_given = true;
    } else if (a == "--skew") {
      opt.skew = next();
    } else if (a == "--redundant") {
      opt.redundant = next_int(0);
    } else if (a == "--json") {
      opt.json_path = next();
    } else if (a == "--pipeline") {
      opt.pipelines.clear();
      std::stringstream ss(next());
      for (std::string p; std::getline(ss, p, ',');) {
        MOEKIT_CHECK(p == "staged" || p == "fused", fmtr("--pipeline '{}': expected staged, fused or both", p));
        opt.pipelines.push_back(p == "fused" ? gpu::GpuPipeline::kFused : gpu::GpuPipeline::kStaged);
      }
    } else if (a == "--merge-shared") {
      opt.merge_shared = next_int(0) != 0;
    } else if (a == "--expert-ready") {
      opt.expert_ready = next_int(0) != 0;
    } else if (a == "--recv-ready") {
      opt.recv_ready = next_int(0) != 0;
    } else if (a == "--recv-ctas") {
      opt.recv_ctas = next_int(0);
    } else if (a == "--combine-ready") {
      opt.combine_ready = next_int(0) != 0;
    } else if (a == "--combine-ctas") {
      opt.combine_ctas = next_int(0);
    } else if (a == "--shared-first") {
      opt.shared_first = next_int(-1);
    } else if (a == "--fused-max-tokens") {
      opt.fused_max_tokens = next_int(0);
    } else if (a == "--overlap-shared") {
      opt.overlap_shared = next_int(0) != 0;
    } else if (a == "--ep-ctas") {
      opt.ep_ctas = next_int(0);
    } else if (a == "--shared-ctas") {
      opt.shared_ctas = next_int(0);
    } else if (a == "--timeline") {
      opt.timeline = true;
    } else if (a == "--uniform") {
      opt.uniform_only = true;
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--help" || a == "-h") {
      std::printf("usage: %s", kUsage);
      return 0;
    } else {
      throw Error("unknown argument '" + a + "'; usage:\n" + kUsage);
    }
  }
  if (quick) {
    if (!models_given) opt.models = {"deepseek-v3"};
    if (!batch_given) opt.batches = {8, 256};
    if (!layers_given) opt.layers = 8;
    if (!iters_given) opt.iters = 3;
    opt.uniform_only = true;
  }
  const int ranks = opt.ranks;
  for (int b : opt.batches)
    MOEKIT_CHECK(b >= ranks, fmtr("--batch {}: expected >= {} (at least one token per rank)", b, ranks));
  if (!opt.skew.empty()) parse_routing(opt.skew);  // a bad --skew fails before any GPU work
  for (const std::string& name : opt.models) checked_redundant(load_model_spec(name), opt);  // so does a bad model

  const auto t_start = Clock::now();
  const DeviceInfo dev = query_device();
  size_t free0 = 0, total = 0;
  MOEKIT_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
  std::printf("device: %s, %d SMs, %.1f GB of %.1f GB free; one GPU as rank 0 of EP%d (%s)\n", dev.name.c_str(),
              dev.num_sms, free0 / kGB, total / kGB, ranks,
              ranks > 1 ? fmtr("{} token-only peers, `local` transport", ranks - 1).c_str() : "no peers");
  const double copy_bw = measure_copy_bandwidth();
  std::printf("copy bandwidth (read + write, 2 GB device copy): %.2f TB/s; FP8 rate for the floor: %.0f TFLOP/s "
              "(docs/results.md §Reference rates of the H200, not measured in this run)\n",
              copy_bw / 1e12, kFp8Flops / 1e12);
  if (opt.shared_ctas > 0)
    std::printf("staged layers: the shared expert's GEMMs on %d CTAs, the routed GEMM1 on %d (--shared-ctas)\n",
                opt.shared_ctas, dev.num_sms - opt.shared_ctas);
  cudaStream_t stream = nullptr;
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::vector<Result> results;
  for (const std::string& name : opt.models) {
    const ModelSpec model = load_model_spec(name);
    const Shape s(model);
    const int redundant = checked_redundant(model, opt);
    const int layers = opt.layers > 0 ? opt.layers : model.num_moe_layers;
    const Routing skew = opt.skew.empty() ? parse_routing(fmtr("hot:{}:4", std::max(1, s.num_experts / 32)))
                                          : parse_routing(opt.skew);
    const std::string padded =
        s.mxfp4 ? fmtr(" (MXFP4: padded from {} and {})", model.hidden_size, model.moe_intermediate_size) : "";
    std::printf("\nmodel %s: %d MoE layers (%d measured), %d experts top-%d, %d local on rank 0, hidden %d, "
                "inter %d, shared inter %d%s\n",
                model.name.c_str(), model.num_moe_layers, layers, s.num_experts, s.topk, s.num_experts / ranks, s.d,
                s.inter, s.shared_inter, padded.c_str());
    auto t0 = Clock::now();
    const MoeLayerWeights weights = random_layer(model);
    std::printf("  random %s weights of one layer (all %d experts, %.1f GB) on the host in %.1f s\n", s.format_name(),
                s.num_experts, (s.num_experts * s.expert_bytes() + s.shared_bytes()) / kGB, seconds_since(t0));

    struct Phase {
      Placement placement;
      bool eplb;
      std::vector<Case> cases;
    };
    std::vector<Phase> phases;
    phases.push_back({identity_placement(s.num_experts, ranks), false, {{"uniform", Routing{}, kUniformSeed}}});
    if (!opt.uniform_only) {
      const Case skewed{to_string(skew), skew, kSkewSeed};
      phases[0].cases.push_back(skewed);
      if (ranks > 1) {  // with one rank holding every expert there is nothing to balance
        Placement balanced = balanced_placement(skew_counts(s, skew, ranks), redundant, ranks);
        std::printf("  EPLB placement from %d sampled steps of %s: %d slots (%d per rank), up to %d replicas of an "
                    "expert\n",
                    kStatsSteps, skewed.routing_name.c_str(), balanced.num_slots, balanced.slots_per_gpu(),
                    balanced.max_replicas);
        phases.push_back({std::move(balanced), true, {skewed}});
      }
    }
    for (const Phase& ph : phases) {
      std::printf("  placement %s (%d slots, %d per rank):\n", ph.eplb ? "EPLB" : "identity", ph.placement.num_slots,
                  ph.placement.slots_per_gpu());
      const Holders holders = build_holders(model, s, weights, ph.placement, opt, layers);
      for (int b : opt.batches) {
        t0 = Clock::now();
        for (gpu::GpuPipeline pipeline : opt.pipelines)
          run_batch(model, s, weights, ph.placement, ph.eplb, ph.cases, holders, b, pipeline, opt, copy_bw, stream,
                    results);
        std::printf("  (B = %d done in %.1f s, %.0f s since the start)\n", b, seconds_since(t0),
                    seconds_since(t_start));
      }
    }
    if (!opt.json_path.empty()) write_json(opt.json_path, dev, copy_bw, opt, results);
  }
  print_tables(results, ranks);
  if (!opt.json_path.empty()) std::printf("wrote %s\n", opt.json_path.c_str());
  std::printf("total %.1f s\n", seconds_since(t_start));
  MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_rank: error: %s\n", e.what());
  return 2;
}
