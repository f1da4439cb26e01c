// The MoE layer on the GPU (layer.h): P virtual ranks of one process on the current GPU (the
// `local` EP transport), all on the caller's stream, so a whole step is captured by one CUDA
// Graph. Weights come from a DeepSeek-style FP8 checkpoint, as for the CPU layer.
#if defined(MOEKIT_WITH_CUDA)

#include <fmt/format.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "moekit/cuda_check.h"
#include "moekit/ep.h"
#include "moekit/eplb.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/safetensors.h"
#include "moekit/weights.h"
#include "tensor.h"

namespace nb = nanobind;

namespace moekit::py {

namespace {

struct CudaLayer {
  ModelSpec model;
  int device = 0;
  gpu::EpMode mode = gpu::EpMode::kLowLatency;
  std::unique_ptr<gpu::EpLocalGroup> group;
  std::vector<std::unique_ptr<gpu::GpuMoeLayer>> ranks;  // destroyed before the group they use
};

void cuda_layer_init(CudaLayer* self, nb::handle model_obj, const std::string& weights_dir, int layer_index, int num_ranks,
                     int max_tokens, const std::string& protocol, nb::handle phy2log_obj, uint64_t replica_seed,
                     int expected_m) {
  ModelSpec model = model_arg(model_obj);
  gpu::EpMode mode;
  if (protocol == "low-latency" || protocol == "low_latency") mode = gpu::EpMode::kLowLatency;
  else if (protocol == "normal") mode = gpu::EpMode::kNormal;
  else throw nb::value_error(fmt::format("protocol = '{}': expected 'low-latency' or 'normal'", protocol).c_str());
  const int num_experts = model.num_routed_experts;
  Placement placement;
  if (phy2log_obj.is_none()) {
    placement = identity_placement(num_experts, num_ranks);
  } else {
    Tensor phy = take(phy2log_obj, "phy2log", {DType::kInt32, DType::kInt64});
    expect_shape(phy, {{-1, "num_slots"}});
    if (phy.device != Device::kCpu) throw nb::value_error("phy2log must be on the CPU (pass .cpu())");
    std::vector<int32_t> ids(size_t(phy.numel()));
    for (size_t i = 0; i < ids.size(); ++i)
      ids[i] = phy.dtype == DType::kInt32 ? phy.ptr<int32_t>()[i] : int32_t(phy.ptr<int64_t>()[i]);
    placement = placement_from_phy2log(ids, 1, num_experts, int(ids.size()), 1, 1, num_ranks);
  }
  MoeLayerWeights weights;
  {
    nb::gil_scoped_release release;
    weights = load_moe_layer(Checkpoint::open(weights_dir), model, layer_index, 0, num_experts);
  }
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  gpu::EpConfig ep = gpu::layer_ep_config(model, placement.num_slots, num_ranks, max_tokens, mode);
  auto group = std::make_unique<gpu::EpLocalGroup>(ep);
  gpu::GpuLayerConfig config;
  config.max_tokens = ep.max_tokens;
  config.replica_seed = replica_seed;
  config.expected_m = expected_m;
  std::vector<std::unique_ptr<gpu::GpuMoeLayer>> ranks;
  for (int r = 0; r < num_ranks; ++r)
    ranks.push_back(std::make_unique<gpu::GpuMoeLayer>(model, weights, placement, 0, group->rank(r), config));
  new (self) CudaLayer{model, device, mode, std::move(group), std::move(ranks)};
}

// One step of every rank on `stream`: all dispatches, then all computes, then all combines
// (a rank's receive waits for every peer's send, and they share the stream).
void forward_all(CudaLayer& self, nb::list xs, nb::list outs, std::vector<int64_t> first_tokens, nb::handle idx_list,
                 nb::handle w_list, uintptr_t stream_value) {
  const int num_ranks = int(self.ranks.size());
  const int64_t d = self.model.hidden_size, k = self.model.num_experts_per_token;
  const int max_tokens = self.ranks[0]->config().max_tokens;
  if (nb::len(xs) != size_t(num_ranks) || nb::len(outs) != size_t(num_ranks) || first_tokens.size() != size_t(num_ranks))
    throw nb::value_error(fmt::format("xs, outs and first_tokens must hold one entry per rank ({})", num_ranks).c_str());
  if (idx_list.is_none() != w_list.is_none()) throw nb::value_error("pass topk_idx and topk_weights together, or neither");
  struct RankArgs {
    Tensor x, out, idx, w;
  };
  std::vector<RankArgs> args(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) {
    RankArgs& a = args[size_t(r)];
    a.x = take(xs[r], "x", {DType::kBf16});
    expect_shape(a.x, {{-1, "num_tokens"}, {d, "hidden"}});
    expect_contiguous(a.x);
    int64_t t = a.x.dim(0);
    if (t > max_tokens)
      throw nb::value_error(fmt::format("rank {}: {} tokens, more than max_tokens = {}", r, t, max_tokens).c_str());
    a.out = take(outs[r], "out", {DType::kBf16}, Access::kWrite);
    expect_shape(a.out, {{t, "num_tokens"}, {d, "hidden"}});
    expect_contiguous(a.out);
    if (!idx_list.is_none()) {
      a.idx = take(idx_list[r], "topk_idx", {DType::kInt32});
      expect_shape(a.idx, {{t, "num_tokens"}, {k, "num_topk"}});
      expect_contiguous(a.idx);
      a.w = take(w_list[r], "topk_weights", {DType::kFloat32});
      expect_shape(a.w, {{t, "num_tokens"}, {k, "num_topk"}});
      expect_contiguous(a.w);
      expect_same_device({&a.x, &a.idx, &a.w});
    }
    if (expect_same_device({&a.x, &a.out}) != Device::kCuda || a.x.device_id != self.device)
      throw nb::value_error(fmt::format("rank {}: x must be on cuda:{}, the layer's GPU", r, self.device).c_str());
  }
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_value);
  for (int r = 0; r < num_ranks; ++r) {
    RankArgs& a = args[size_t(r)];
    self.ranks[size_t(r)]->dispatch(a.x.ptr<uint16_t>(), int(a.x.dim(0)), first_tokens[size_t(r)], stream,
                                    a.idx.data ? a.idx.ptr<int32_t>() : nullptr, a.w.data ? a.w.ptr<float>() : nullptr);
  }
  for (auto& layer : self.ranks) layer->compute(stream);
  for (int r = 0; r < num_ranks; ++r) self.ranks[size_t(r)]->combine(args[size_t(r)].out.ptr<uint16_t>(), stream);
}

}  // namespace

void bind_layer_cuda(nb::module_& m) {
  nb::class_<CudaLayer>(m, "CudaMoeLayer")
      .def("__init__", &cuda_layer_init, nb::arg("model"), nb::arg("weights_dir"), nb::arg("layer"), nb::arg("num_ranks"),
           nb::arg("max_tokens"), nb::arg("protocol") = "low-latency", nb::arg("phy2log").none() = nb::none(),
           nb::arg("replica_seed") = 0, nb::arg("expected_m") = 0)
      .def_prop_ro("hidden", [](const CudaLayer& l) { return l.model.hidden_size; })
      .def_prop_ro("num_ranks", [](const CudaLayer& l) { return int(l.ranks.size()); })
      .def_prop_ro("max_tokens", [](const CudaLayer& l) { return l.ranks[0]->config().max_tokens; })
      .def("forward_all", &forward_all, nb::arg("xs"), nb::arg("outs"), nb::arg("first_tokens"), nb::arg("topk_idx").none(),
           nb::arg("topk_weights").none(), nb::arg("stream"))
      .def(
          "check",
          [](CudaLayer& l, uintptr_t stream) {
            for (auto& layer : l.ranks) layer->check(reinterpret_cast<cudaStream_t>(stream));
          },
          nb::arg("stream"), "Synchronises and raises moekit.Error for a fault any rank's kernels recorded.");
}

}  // namespace moekit::py

#endif  // MOEKIT_WITH_CUDA
