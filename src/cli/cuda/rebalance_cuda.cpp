// The CUDA backend of `moekit run --rebalance` (see rebalance_cuda.h).
#include "cli/cuda/rebalance_cuda.h"
#include "cli/cuda/run_cuda.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <random>

#include "cli/cuda/device_array.h"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/reference.h"
#include "moekit/weights.h"

namespace moekit::cli {
namespace {

int first_token(int rank, int num_ranks, int num_tokens) { return (rank * num_tokens + num_ranks - 1) / num_ranks; }

class CudaBackend : public RebalanceBackend {
 public:
  CudaBackend(const RebalanceRunInput& in, const Placement& placement, int max_tokens)
      : spec_(*in.model), weights_(*in.weights), check_(in.check), P_(in.num_ranks), t_max_(max_tokens),
        copy_bytes_per_s_(in.options.copy_gbps * 1e9) {
    require_cuda_device();
    const int L = int(weights_.size()), d = int(spec_.hidden_size), k = spec_.num_experts_per_token;
    const gpu::EpMode mode = in.protocol == "normal" ? gpu::EpMode::kNormal : gpu::EpMode::kLowLatency;
    const gpu::GpuPipeline pipeline = in.fused ? gpu::GpuPipeline::kFused : gpu::GpuPipeline::kStaged;
    group_ = std::make_unique<gpu::EpLocalGroup>(
        gpu::layer_ep_config(spec_, placement.num_slots, P_, t_max_, mode, pipeline));
    gpu::GpuLayerConfig cfg;
    cfg.max_tokens = t_max_;
    cfg.replica_seed = in.seed;
    cfg.pipeline = pipeline;
    cfg.staging_slots = placement.slots_per_gpu();  // a rank may receive every one of its slots
    layers_.resize(L);
    for (int l = 0; l < L; ++l) {
      for (int r = 0; r < P_; ++r)
        layers_[l].push_back(
            std::make_unique<gpu::GpuMoeLayer>(spec_, weights_[l], placement, l, group_->rank(r), cfg));
      // The local transport: every rank's slots are readable here; moves copy from the peers.
      std::vector<gpu::GpuExpertSlots> slots;
      for (auto& layer : layers_[l]) slots.push_back(layer->expert_slots());
      for (auto& layer : layers_[l]) layer->set_peer_slots(slots);
    }
    e_loc_ = layers_[0][0]->num_local_experts();
    const size_t rows = size_t(P_) * t_max_;
    x_ = std::make_unique<DeviceArray<uint16_t>>(rows * d);
    for (int l = 0; l < L; ++l) {
      out_.push_back(std::make_unique<DeviceArray<uint16_t>>(rows * d));
      idx_.push_back(std::make_unique<DeviceArray<int32_t>>(rows * k));
      w_.push_back(std::make_unique<DeviceArray<float>>(rows * k));
    }
    // Every layer's input: the same N(0, 1) tokens (the routing is the trace's, not the router's).
    std::mt19937_64 rng(in.seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    x0_.resize(rows * d);
    for (auto& v : x0_) v = float_to_bf16(normal(rng));
    if (check_)
      for (const auto& w : weights_) oracle_weights_.push_back(dequantize_layer_f64(w));
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MOEKIT_CUDA_CHECK(cudaEventCreate(&start_));
    MOEKIT_CUDA_CHECK(cudaEventCreate(&end_));
  }

  ~CudaBackend() override {
    if (stream_) cudaStreamSynchronize(stream_);
    layers_.clear();
    if (start_) cudaEventDestroy(start_);
    if (end_) cudaEventDestroy(end_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  LoopStep run_step(const std::vector<const std::vector<int32_t>*>& idx, int T) override {
    const int L = int(layers_.size()), d = int(spec_.hidden_size), k = spec_.num_experts_per_token;
    const std::vector<float> w(size_t(T) * k, float(spec_.router.routed_scaling_factor / k));
    for (int r = 0; r < P_; ++r) {
      const int t0 = first_token(r, P_, T), n = first_token(r + 1, P_, T) - t0;
      const size_t at = size_t(r) * t_max_;
      MOEKIT_CUDA_CHECK(cudaMemcpy(x_->ptr + at * d, x0_.data() + size_t(t0) * d, size_t(n) * d * 2,
                                   cudaMemcpyHostToDevice));
      for (int l = 0; l < L; ++l) {
        MOEKIT_CUDA_CHECK(cudaMemcpy(idx_[l]->ptr + at * k, idx[l]->data() + size_t(t0) * k, size_t(n) * k * 4,
                                     cudaMemcpyHostToDevice));
        MOEKIT_CUDA_CHECK(cudaMemcpy(w_[l]->ptr + at * k, w.data() + size_t(t0) * k, size_t(n) * k * 4,
                                     cudaMemcpyHostToDevice));
      }
    }
    // A move's chunks for this step go out right before it, so that they run beside its kernels
    // (on the layers' copy streams), as they would beside a serving loop's next step.
    copied_ = 0;
    if (copying_)
      for (auto& layer : layers_)
        for (auto& rank : layer) copied_ += double(rank->advance_moves(budget_));
    // The step: every layer, every rank, on one stream, timed by events.
    MOEKIT_CUDA_CHECK(cudaEventRecord(start_, stream_));
    for (int l = 0; l < L; ++l) {
      auto tokens = [&](int r) { return first_token(r + 1, P_, T) - first_token(r, P_, T); };
      for (int r = 0; r < P_; ++r)
        layers_[l][r]->dispatch(x_->ptr + size_t(r) * t_max_ * d, tokens(r), first_token(r, P_, T), stream_,
                                idx_[l]->ptr + size_t(r) * t_max_ * k, w_[l]->ptr + size_t(r) * t_max_ * k);
      for (int r = 0; r < P_; ++r) layers_[l][r]->compute(stream_);
      for (int r = 0; r < P_; ++r) layers_[l][r]->combine(out_[l]->ptr + size_t(r) * t_max_ * d, stream_);
    }
    MOEKIT_CUDA_CHECK(cudaEventRecord(end_, stream_));
    for (auto& layer : layers_) for (auto& rank : layer) rank->check(stream_);
    float ms = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, end_));
    LoopStep st;
    st.step_s = 1e-3 * ms;
    last_step_s_ = st.step_s;
    for (int l = 0; l < L; ++l) {
      st.counts.emplace_back(spec_.num_routed_experts, 0);
      st.rows.emplace_back(P_, 0);
      std::vector<int32_t> all_idx;
      std::vector<uint16_t> got(size_t(T) * d);
      for (int r = 0; r < P_; ++r) {
        const std::vector<int64_t> c = layers_[l][r]->take_expert_counts(stream_);
        for (size_t e = 0; e < c.size(); ++e) st.counts[l][e] += c[e];
        const int t0 = first_token(r, P_, T), n = first_token(r + 1, P_, T) - t0;
        // Rows a rank serves: the token-expert pairs sent to its slots.
        for (int32_t slot : download(layers_[l][r]->topk_slot(), size_t(n) * k))
          if (slot >= 0) ++st.rows[l][slot / e_loc_];
        if (check_) {
          const auto i = download(layers_[l][r]->topk_idx(), size_t(n) * k);
          all_idx.insert(all_idx.end(), i.begin(), i.end());
          const auto o = download(out_[l]->ptr + size_t(r) * t_max_ * d, size_t(n) * d);
          std::copy(o.begin(), o.end(), got.begin() + size_t(t0) * d);
        }
      }
      if (check_) {
        std::vector<float> xf(size_t(T) * d);
        for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_float(x0_[i]);
        std::vector<double> want(xf.size()), g(xf.size());
        ref::moe_layer_f64(xf.data(), T, all_idx.data(), w.data(), k, oracle_weights_[l]->view, want.data());
        for (size_t i = 0; i < g.size(); ++i) g[i] = bf16_to_float(got[i]);
        st.error_vs_oracle.push_back(ref::relative_frobenius_error(g.data(), want.data(), g.size()));
      }
    }
    return st;
  }

  void start_moves(const RebalancePlan& plan) override {
    // One budget for the whole plan: --copy-gbps of the last step's time, at least one chunk;
    // 0 GB/s: everything at once.
    budget_ = copy_bytes_per_s_ > 0 ? size_t(std::max(1.0, copy_bytes_per_s_ * last_step_s_))
                                    : std::numeric_limits<size_t>::max() / 2;
    for (int l = 0; l < int(layers_.size()); ++l)
      for (auto& layer : layers_[l]) layer->begin_moves(plan.placement, l, plan.moves, &weights_[l], stream_);
    copying_ = true;
    barrier_ = false;
    copied_ = 0;
  }

  // At each boundary: once every rank's chunks are out (run_step issues them), the stream waits
  // for them and the next step is the barrier; after the barrier step, the switch.
  Progress advance_moves(double) override {
    Progress p;
    if (barrier_) {
      for (auto& layer : layers_)
        for (auto& rank : layer) rank->commit_moves(stream_);
      barrier_ = false;
      p.switched = true;
      return p;
    }
    p.bytes_copied = copied_;  // issued right before the step that just ran
    copied_ = 0;
    bool all = true;
    for (auto& layer : layers_)
      for (auto& rank : layer) all = all && rank->moves_issued();
    if (copying_ && all) {
      for (auto& layer : layers_)
        for (auto& rank : layer) rank->wait_moves(stream_);
      copying_ = false;
      barrier_ = true;
    }
    return p;
  }

 private:
  const ModelSpec& spec_;
  const std::vector<MoeLayerWeights>& weights_;
  bool check_;
  int P_, t_max_, e_loc_ = 0;
  double copy_bytes_per_s_;
  std::unique_ptr<gpu::EpLocalGroup> group_;
  std::vector<std::vector<std::unique_ptr<gpu::GpuMoeLayer>>> layers_;  // [L][P]
  std::unique_ptr<DeviceArray<uint16_t>> x_;
  std::vector<std::unique_ptr<DeviceArray<uint16_t>>> out_;
  std::vector<std::unique_ptr<DeviceArray<int32_t>>> idx_;
  std::vector<std::unique_ptr<DeviceArray<float>>> w_;
  std::vector<uint16_t> x0_;
  std::vector<std::unique_ptr<LayerWeightsF64>> oracle_weights_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, end_ = nullptr;
  double last_step_s_ = 0;
  size_t budget_ = 0;
  bool copying_ = false, barrier_ = false;  // chunks still to issue; the next step is the barrier
  double copied_ = 0;                       // bytes issued before the last step
};

}  // namespace

std::unique_ptr<RebalanceBackend> make_cuda_backend(const RebalanceRunInput& in, const Placement& placement,
                                                    int max_tokens) {
  return std::make_unique<CudaBackend>(in, placement, max_tokens);
}

}  // namespace moekit::cli
