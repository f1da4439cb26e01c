// Shared by the GPU layer tests (test_layer, test_layer_multi): tiny-moe weights written by the
// checkpoint generator and read back, random tokens and caller routing, the placements, the CPU
// layer's step over all ranks (the oracle of every GPU step) and P GPU layers over one
// EpLocalGroup (the `local` transport). Header-only test code; nothing here initialises CUDA
// until a GpuRig or a DeviceArray is made, so a process that forks ranks may load the fixture.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "moekit/bf16.h"
#include "moekit/cuda_check.h"
#include "moekit/ep_cpu.h"
#include "moekit/eplb.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/reference.h"
#include "moekit/weights.h"

namespace layer_test {

using namespace moekit;
namespace fs = std::filesystem;

inline constexpr int kBatch = 64;  // B, all ranks together
// End to end, GPU against the CPU layer (and the float64 oracle). The 3e-3 bound of one GEMM
// (docs/design.md §Numerics and their bounds) is too tight for a layer, which re-quantises
// GEMM1's output to FP8 and so amplifies the tensor core's rounding: about 10% of the GPU GEMM's
// bf16 outputs are one ulp off the reference (docs/gemm.md), a bf16 ulp (2^-8) moves an FP8 value
// across a rounding boundary with probability ~2^-8 / 2^-3.5, so ~0.5% of the activations land
// one FP8 step (~9%) apart: sqrt(0.005) * 0.09 = 6e-3 relative, 4.7e-3 to 7.3e-3 measured on the
// H200 (docs/layer-gpu.md). The bound is twice the measured worst; test_layer's stage checks hold
// every stage to its own, tight bound.
inline constexpr double kLayerTolerance = 1.5e-2;
inline constexpr uint16_t kPoison = 0x7FC1;  // a bf16 NaN

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceArray(size_t n = 0) { resize(n); }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : ptr(o.ptr), count(o.count) { o.ptr = nullptr; }
  void resize(size_t n) {
    cudaFree(ptr);
    ptr = nullptr;
    count = n;
    if (n) MOEKIT_CUDA_CHECK(cudaMalloc(&ptr, n * sizeof(T)));
  }
  void upload(const T* host, size_t n) { MOEKIT_CUDA_CHECK(cudaMemcpy(ptr, host, n * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> download(size_t n) const {
    std::vector<T> h(n);
    if (n) MOEKIT_CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

template <class T>
inline std::vector<T> download(const T* ptr, size_t n) {
  std::vector<T> h(n);
  if (n) MOEKIT_CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// A model's layer 0 written by the checkpoint generator and read back (tiny-moe by default).
struct Fixture {
  ModelSpec model;
  fs::path dir;
  MoeLayerWeights weights;
  explicit Fixture(ModelSpec m = load_model_spec("tiny-moe"), uint64_t seed = 7)
      : model(std::move(m)),
        dir(fs::temp_directory_path() / ("test_layer_gpu_weights." + model.name + "." + std::to_string(getpid()))) {
    fs::remove_all(dir);
    RandomWeightsOptions opt;
    opt.num_layers = 1;
    opt.seed = seed;
    write_random_weights(model, opt, dir.string());
    weights = load_moe_layer(Checkpoint::open(dir.string()), model, 0, 0, model.num_routed_experts);
  }
  ~Fixture() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

inline const Fixture& fixture() {
  static const Fixture f;
  return f;
}

inline int first_token(int rank, int num_ranks, int batch) { return (rank * batch + num_ranks - 1) / num_ranks; }

inline std::vector<uint16_t> random_tokens(int num_tokens, int d, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(size_t(num_tokens) * d);
  for (auto& v : x) v = float_to_bf16(normal(rng));
  return x;
}

// Caller routing with a hot spot: half the picks come from experts 0..7 (distinct per token).
inline void random_routing(int num_tokens, int E, int k, std::mt19937& rng, std::vector<int32_t>& idx,
                           std::vector<float>& w) {
  idx.resize(size_t(num_tokens) * k);
  w.assign(size_t(num_tokens) * k, 0.0f);
  std::uniform_int_distribution<int> any(0, E - 1), hot(0, 7), coin(0, 1);
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  for (int t = 0; t < num_tokens; ++t)
    for (int j = 0; j < k; ++j) {
      int e;
      bool dup;
      do {
        e = coin(rng) ? hot(rng) : any(rng);
        dup = false;
        for (int i = 0; i < j; ++i) dup |= idx[size_t(t) * k + i] == e;
      } while (dup);
      idx[size_t(t) * k + j] = e;
      w[size_t(t) * k + j] = weight(rng);
    }
}

// E + redundant slots, a multiple of P. No redundant experts and P dividing E: the identity
// placement. Otherwise EPLB's placement for hot experts 0..7, with 8 redundant slots (or none)
// rounded up so that P divides the slots (P = 3, 5, 6, 7 need a few more).
inline Placement make_placement(int num_ranks, bool redundant) {
  const int E = fixture().model.num_routed_experts;
  const int slots = (E + (redundant ? 8 : 0) + num_ranks - 1) / num_ranks * num_ranks;
  if (slots == E) return identity_placement(E, num_ranks);
  std::vector<double> load(E, 1.0);
  for (int e = 0; e < 8; ++e) load[e] = 8.0;  // the hot experts get the replicas
  return balanced_placement(load, slots - E, num_ranks);
}

// Two placements of the same E + 8 slots over P ranks with different hot experts (the first 8,
// the last 8): a rebalance between them moves replicas between ranks and inside ranks.
// The second placement's GPU rows are rotated by one: balanced_placement keeps expert e on GPU
// e mod P (its replicas too), so without the rotation every move's source would be on its own GPU
// and the peer and host copy paths would never run (seen on an H200, 2026-11-30). With it, every
// changed slot takes its expert from another rank.
inline std::pair<Placement, Placement> drifted_placements(int num_ranks) {
  const int E = fixture().model.num_routed_experts;
  std::vector<double> load_a(E, 1.0), load_b(E, 1.0);
  for (int e = 0; e < 8; ++e) load_a[e] = 8.0, load_b[E - 1 - e] = 8.0;
  const Placement a = balanced_placement(load_a, 8, num_ranks), drifted = balanced_placement(load_b, 8, num_ranks);
  const int slots = drifted.num_slots, e_loc = drifted.slots_per_gpu();
  std::vector<int32_t> rotated(slots);
  for (int g = 0; g < num_ranks; ++g)
    for (int i = 0; i < e_loc; ++i)
      rotated[size_t(g) * e_loc + i] = drifted.phy2log_row(0)[size_t((g + 1) % num_ranks) * e_loc + i];
  return {a, placement_from_phy2log(rotated, 1, E, slots, 1, 1, num_ranks)};
}

// How many of rank `rank`'s live slots do not hold, bit for bit, the W1, W2 and scales of the
// logical expert `placement` (layer 0) puts there.
inline int slots_not_holding(const gpu::GpuMoeLayer& layer, const Placement& placement, int rank) {
  const MoeLayerWeights& w = fixture().weights;
  const gpu::GpuExpertSlots slots = layer.expert_slots();
  const int e_loc = layer.num_local_experts();
  int bad = 0;
  for (int i = 0; i < e_loc; ++i) {
    const size_t e = size_t(placement.phy2log_row(0)[rank * e_loc + i]);
    bool same = true;
    auto compare = [&](const auto* device, const auto& host, size_t per) {
      const auto got = download(device + i * per, per);
      same = same && std::equal(got.begin(), got.end(), host.begin() + e * per);
    };
    compare(slots.w1, w.w1.w, w.w1.w.size() / w.w1.layout.num_experts);
    compare(slots.w1_scales, w.w1.scales, w.w1.scales.size() / w.w1.layout.num_experts);
    compare(slots.w2, w.w2.w, w.w2.w.size() / w.w2.layout.num_experts);
    compare(slots.w2_scales, w.w2.scales, w.w2.scales.size() / w.w2.layout.num_experts);
    bad += !same;
  }
  return bad;
}

// The CPU layer's step over all B tokens: the oracle's output and routing.
struct CpuResult {
  std::vector<uint16_t> out;
  std::vector<int32_t> topk_idx;
  std::vector<float> topk_weights;
  std::vector<std::vector<int32_t>> recv_count;  // [P][E_loc]
};

inline CpuResult run_cpu(int P, EpProtocol protocol, const Placement& placement, const std::vector<uint16_t>& x,
                  const std::vector<int32_t>* idx, const std::vector<float>* w, uint64_t seed,
                  const Fixture& f = fixture()) {
  const int d = int(f.model.hidden_size), k = f.model.num_experts_per_token;
  CpuLayerConfig cfg;
  cfg.num_ranks = P;
  cfg.max_tokens = (kBatch + P - 1) / P;
  cfg.protocol = protocol;
  cfg.replica_seed = seed;
  CpuMoeLayer layer(f.model, f.weights, placement, 0, cfg);
  LocalEpGroup group(layer.ep_config());
  CpuResult r;
  r.out.assign(size_t(kBatch) * d, 0);
  run_ranks(group, [&](int rank) {
    const int t0 = first_token(rank, P, kBatch), t1 = first_token(rank + 1, P, kBatch);
    layer.forward(group, rank, t1 - t0, t0, x.data() + size_t(t0) * d, r.out.data() + size_t(t0) * d,
                  idx ? idx->data() + size_t(t0) * k : nullptr, w ? w->data() + size_t(t0) * k : nullptr);
  });
  for (int rank = 0; rank < P; ++rank) {
    const RankStep& st = layer.last_step(rank);
    r.topk_idx.insert(r.topk_idx.end(), st.topk_idx.begin(), st.topk_idx.end());
    r.topk_weights.insert(r.topk_weights.end(), st.topk_weights.begin(), st.topk_weights.end());
    r.recv_count.push_back(st.recv_count);
  }
  return r;
}

// P GPU layers of a fixture's model over one EpLocalGroup, with per-rank device inputs and outputs.
struct GpuRig {
  const Fixture& fx;
  int P;
  gpu::EpMode mode;
  std::unique_ptr<gpu::EpLocalGroup> group;
  std::vector<std::unique_ptr<gpu::GpuMoeLayer>> layers;
  std::vector<DeviceArray<uint16_t>> x, out;
  std::vector<DeviceArray<int32_t>> idx;
  std::vector<DeviceArray<float>> w;
  cudaStream_t stream{};
  int batch = kBatch;  // B, all ranks together

  // share: a rig of the same P and placement whose layers' weights these layers use.
  // pipeline: GpuLayerConfig::pipeline (decode). staging_slots, move_chunk_bytes: the layers'
  // staged moves (GpuLayerConfig; 0: none). edit: any other change to the layers' GpuLayerConfig.
  // batch_tokens: B (T_max = B / P rounded up).
  GpuRig(int num_ranks, gpu::EpMode m, const Placement& placement, uint64_t seed, const GpuRig* share = nullptr,
         gpu::GpuPipeline pipeline = gpu::GpuPipeline::kStaged, bool merge_shared = true, int staging_slots = 0,
         size_t move_chunk_bytes = size_t(4) << 20, const Fixture& f = fixture(), bool expert_ready = true,
         bool recv_ready = true, bool combine_ready = true,
         const std::function<void(gpu::GpuLayerConfig&)>& edit = {}, int batch_tokens = kBatch)
      : fx(f), P(num_ranks), mode(m), batch(batch_tokens) {
    const int t_max = (batch + P - 1) / P, d = int(f.model.hidden_size), k = f.model.num_experts_per_token;
    group = std::make_unique<gpu::EpLocalGroup>(gpu::layer_ep_config(f.model, placement.num_slots, P, t_max, mode, pipeline,
                                                                      gpu::kFusedMaxTokens, merge_shared));
    gpu::GpuLayerConfig cfg;
    cfg.max_tokens = t_max;
    cfg.replica_seed = seed;
    cfg.pipeline = pipeline;
    cfg.merge_shared = merge_shared;
    cfg.staging_slots = staging_slots;
    cfg.move_chunk_bytes = move_chunk_bytes;
    cfg.expert_ready = expert_ready;
    cfg.recv_ready = recv_ready;
    cfg.combine_ready = combine_ready;
    if (edit) edit(cfg);
    for (int r = 0; r < P; ++r) {
      layers.push_back(std::make_unique<gpu::GpuMoeLayer>(f.model, f.weights, placement, 0, group->rank(r), cfg,
                                                           share ? share->layers[r].get() : nullptr));
      x.emplace_back(size_t(t_max) * d);
      out.emplace_back(size_t(t_max) * d);
      idx.emplace_back(size_t(t_max) * k);
      w.emplace_back(size_t(t_max) * k);
    }
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  ~GpuRig() {
    layers.clear();
    cudaStreamDestroy(stream);
  }
  int tokens(int r) const { return first_token(r + 1, P, batch) - first_token(r, P, batch); }

  // Copies rank slices of x (and routing) in and poisons the outputs.
  void load(const std::vector<uint16_t>& all_x, const std::vector<int32_t>* all_idx, const std::vector<float>* all_w) {
    const int d = int(fx.model.hidden_size), k = fx.model.num_experts_per_token;
    for (int r = 0; r < P; ++r) {
      const int t0 = first_token(r, P, batch);
      x[r].upload(all_x.data() + size_t(t0) * d, size_t(tokens(r)) * d);
      if (all_idx) {
        idx[r].upload(all_idx->data() + size_t(t0) * k, size_t(tokens(r)) * k);
        w[r].upload(all_w->data() + size_t(t0) * k, size_t(tokens(r)) * k);
      }
      std::vector<uint16_t> poison(out[r].count, kPoison);
      out[r].upload(poison.data(), poison.size());
    }
  }
  // Issues one step of every rank on `stream` (all dispatches, all computes, all combines).
  void issue(bool caller_routing) {
    for (int r = 0; r < P; ++r)
      layers[r]->dispatch(x[r].ptr, tokens(r), first_token(r, P, batch), stream, caller_routing ? idx[r].ptr : nullptr,
                          caller_routing ? w[r].ptr : nullptr);
    for (int r = 0; r < P; ++r) layers[r]->compute(stream);
    for (int r = 0; r < P; ++r) layers[r]->combine(out[r].ptr, stream);
  }
  void check() {
    for (int r = 0; r < P; ++r) layers[r]->check(stream);
  }
  std::vector<uint16_t> gather_out() const {
    const int d = int(fx.model.hidden_size);
    std::vector<uint16_t> all;
    for (int r = 0; r < P; ++r) {
      auto part = out[r].download(size_t(tokens(r)) * d);
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }
};

// The GPU step's routing (logical experts exactly, weights within 1e-6 relative) and every rank's
// recv_count against the CPU layer's; *same_weight_bits (when given): how many weights have the CPU's bits.
inline void expect_same_routing(const GpuRig& rig, const CpuResult& cpu, const std::string& what,
                                size_t* same_weight_bits = nullptr) {
  const int k = rig.fx.model.num_experts_per_token;
  std::vector<int32_t> idx;
  std::vector<float> w;
  for (int r = 0; r < rig.P; ++r) {
    auto i = download(rig.layers[r]->topk_idx(), size_t(rig.tokens(r)) * k);
    auto ww = download(rig.layers[r]->topk_weights(), size_t(rig.tokens(r)) * k);
    idx.insert(idx.end(), i.begin(), i.end());
    w.insert(w.end(), ww.begin(), ww.end());
  }
  ASSERT_EQ(idx, cpu.topk_idx) << what << ": routing differs from the CPU gate";
  for (size_t i = 0; i < w.size(); ++i) {
    if (same_weight_bits) *same_weight_bits += std::memcmp(&w[i], &cpu.topk_weights[i], 4) == 0;
    ASSERT_NEAR(w[i], cpu.topk_weights[i], 1e-6 * std::fabs(cpu.topk_weights[i])) << what << ": weight " << i;
  }
  for (int r = 0; r < rig.P; ++r) {
    auto count = download(rig.group->rank(r).recv_count(), size_t(rig.layers[r]->num_local_experts()));
    ASSERT_EQ(count, cpu.recv_count[r]) << what << ": recv_count of rank " << r;
  }
}

inline double rel_error(const std::vector<uint16_t>& got, const std::vector<double>& want) {
  std::vector<double> g(got.size());
  for (size_t i = 0; i < got.size(); ++i) g[i] = bf16_to_float(got[i]);
  return ref::relative_frobenius_error(g.data(), want.data(), g.size());
}

inline std::vector<double> to_double(const std::vector<uint16_t>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = bf16_to_float(v[i]);
  return d;
}

}  // namespace layer_test
