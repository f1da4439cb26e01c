// The MoE layer on the GPU (layer.h), all on the caller's stream, so a whole step is captured by
// one CUDA Graph: P virtual ranks of one process on the current GPU (the `local` EP transport,
// forward_all), or, made with connect(), this process's one rank of a group across processes
// (`nvlink` or `nccl`, ep_process.h; forward). Weights come from a DeepSeek-style FP8 checkpoint,
// as for the CPU layer.
#if defined(MOEKIT_WITH_CUDA)

#include <fmt/format.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "ep_process.h"
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
  std::unique_ptr<gpu::EpLocalGroup> group;  // P virtual ranks, or
  std::unique_ptr<gpu::EpBuffer> own_ep;     // this process's rank of a group across processes
  std::vector<std::unique_ptr<gpu::GpuMoeLayer>> ranks;  // destroyed before the EP buffers they use
};

// What a layer of either kind is made from: the model, the mode, the placement and the weights.
struct LayerSource {
  ModelSpec model;
  gpu::EpMode mode = gpu::EpMode::kLowLatency;
  Placement placement;
  MoeLayerWeights weights;
};

LayerSource layer_source(nb::handle model_obj, const std::string& weights_dir, int layer_index, int num_ranks,
                         const std::string& protocol, nb::handle phy2log_obj) {
  LayerSource src;
  src.model = model_arg(model_obj);
  if (protocol == "low-latency" || protocol == "low_latency") src.mode = gpu::EpMode::kLowLatency;
  else if (protocol == "normal") src.mode = gpu::EpMode::kNormal;
  else throw nb::value_error(fmt::format("protocol = '{}': expected 'low-latency' or 'normal'", protocol).c_str());
  const int num_experts = src.model.num_routed_experts;
  if (phy2log_obj.is_none()) {
    src.placement = identity_placement(num_experts, num_ranks);
  } else {
    Tensor phy = take(phy2log_obj, "phy2log", {DType::kInt32, DType::kInt64});
    expect_shape(phy, {{-1, "num_slots"}});
    if (phy.device != Device::kCpu) throw nb::value_error("phy2log must be on the CPU (pass .cpu())");
    std::vector<int32_t> ids(size_t(phy.numel()));
    for (size_t i = 0; i < ids.size(); ++i)
      ids[i] = phy.dtype == DType::kInt32 ? phy.ptr<int32_t>()[i] : int32_t(phy.ptr<int64_t>()[i]);
    src.placement = placement_from_phy2log(ids, 1, num_experts, int(ids.size()), 1, 1, num_ranks);
  }
  nb::gil_scoped_release release;
  src.weights = load_moe_layer(Checkpoint::open(weights_dir), src.model, layer_index, 0, num_experts);
  return src;
}

gpu::GpuLayerConfig layer_config(const gpu::EpConfig& ep, uint64_t replica_seed, int expected_m) {
  gpu::GpuLayerConfig config;
  config.max_tokens = ep.max_tokens;
  config.replica_seed = replica_seed;
  config.expected_m = expected_m;
  return config;
}

void cuda_layer_init(CudaLayer* self, nb::handle model_obj, const std::string& weights_dir, int layer_index, int num_ranks,
                     int max_tokens, const std::string& protocol, nb::handle phy2log_obj, uint64_t replica_seed,
                     int expected_m) {
  LayerSource src = layer_source(model_obj, weights_dir, layer_index, num_ranks, protocol, phy2log_obj);
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  gpu::EpConfig ep = gpu::layer_ep_config(src.model, src.placement.num_slots, num_ranks, max_tokens, src.mode);
  auto group = std::make_unique<gpu::EpLocalGroup>(ep);
  const gpu::GpuLayerConfig config = layer_config(ep, replica_seed, expected_m);
  std::vector<std::unique_ptr<gpu::GpuMoeLayer>> ranks;
  for (int r = 0; r < num_ranks; ++r)
    ranks.push_back(std::make_unique<gpu::GpuMoeLayer>(src.model, src.weights, src.placement, 0, group->rank(r), config));
  new (self) CudaLayer{src.model, device, src.mode, std::move(group), nullptr, std::move(ranks)};
}

// This process's rank of a layer across processes; the exchange arguments as in ep_process.h.
CudaLayer* cuda_layer_connect(nb::handle model_obj, const std::string& weights_dir, int layer_index, int rank,
                              int num_ranks, int device, const std::string& transport, nb::bytes nccl_unique_id,
                              nb::handle all_gather, int max_tokens, const std::string& protocol, nb::handle phy2log_obj,
                              uint64_t replica_seed, int expected_m, double timeout_s) {
  LayerSource src = layer_source(model_obj, weights_dir, layer_index, num_ranks, protocol, phy2log_obj);
  gpu::EpConfig ep = gpu::layer_ep_config(src.model, src.placement.num_slots, num_ranks, max_tokens, src.mode);
  ep.timeout_s = timeout_s;
  auto own = connect_process(ep, rank, num_ranks, device, transport, nccl_unique_id, all_gather);
  DeviceGuard guard(device);  // the layer's weights and buffers go to the buffer's GPU
  std::vector<std::unique_ptr<gpu::GpuMoeLayer>> ranks;
  ranks.push_back(std::make_unique<gpu::GpuMoeLayer>(src.model, src.weights, src.placement, 0, *own,
                                                     layer_config(ep, replica_seed, expected_m)));
  return new CudaLayer{src.model, device, src.mode, nullptr, std::move(own), std::move(ranks)};
}

// One rank's arguments of a step, checked: x [T, d] bf16 on the layer's GPU, T <= max_tokens,
// out [T, d] bf16, and the caller's routing [T, k] (int32 logical experts, fp32) or none.
struct RankArgs {
  Tensor x, out, idx, w;
  const int32_t* idx_ptr() const { return idx.data ? idx.ptr<int32_t>() : nullptr; }
  const float* w_ptr() const { return w.data ? w.ptr<float>() : nullptr; }
};

RankArgs rank_args(const CudaLayer& self, int rank, nb::handle x_obj, nb::handle out_obj, nb::handle idx_obj,
                   nb::handle w_obj) {
  const int64_t d = self.model.hidden_size, k = self.model.num_experts_per_token;
  const int max_tokens = self.ranks[0]->config().max_tokens;
  RankArgs a;
  a.x = take(x_obj, "x", {DType::kBf16});
  expect_shape(a.x, {{-1, "num_tokens"}, {d, "hidden"}});
  expect_contiguous(a.x);
  int64_t t = a.x.dim(0);
  if (t > max_tokens)
    throw nb::value_error(fmt::format("rank {}: {} tokens, more than max_tokens = {}", rank, t, max_tokens).c_str());
  a.out = take(out_obj, "out", {DType::kBf16}, Access::kWrite);
  expect_shape(a.out, {{t, "num_tokens"}, {d, "hidden"}});
  expect_contiguous(a.out);
  if (!idx_obj.is_none()) {
    a.idx = take(idx_obj, "topk_idx", {DType::kInt32});
    expect_shape(a.idx, {{t, "num_tokens"}, {k, "num_topk"}});
    expect_contiguous(a.idx);
    a.w = take(w_obj, "topk_weights", {DType::kFloat32});
    expect_shape(a.w, {{t, "num_tokens"}, {k, "num_topk"}});
    expect_contiguous(a.w);
    expect_same_device({&a.x, &a.idx, &a.w});
  }
  if (expect_same_device({&a.x, &a.out}) != Device::kCuda || a.x.device_id != self.device)
    throw nb::value_error(fmt::format("rank {}: x must be on cuda:{}, the layer's GPU", rank, self.device).c_str());
  return a;
}

// One step of every rank on `stream`: all dispatches, then all computes, then all combines
// (a rank's receive waits for every peer's send, and they share the stream).
void forward_all(CudaLayer& self, nb::list xs, nb::list outs, std::vector<int64_t> first_tokens, nb::handle idx_list,
                 nb::handle w_list, uintptr_t stream_value) {
  if (self.own_ep)
    throw nb::value_error(fmt::format("forward_all runs every rank of an in-process layer; this layer is rank {} of a "
                                      "process group: call forward() with this rank's tokens",
                                      self.own_ep->rank())
                              .c_str());
  const int num_ranks = int(self.ranks.size());
  if (nb::len(xs) != size_t(num_ranks) || nb::len(outs) != size_t(num_ranks) || first_tokens.size() != size_t(num_ranks))
    throw nb::value_error(fmt::format("xs, outs and first_tokens must hold one entry per rank ({})", num_ranks).c_str());
  if (idx_list.is_none() != w_list.is_none()) throw nb::value_error("pass topk_idx and topk_weights together, or neither");
  auto item = [](nb::handle list, int r) -> nb::object {
    if (list.is_none()) return nb::none();
    return list[r];
  };
  std::vector<RankArgs> args;
  for (int r = 0; r < num_ranks; ++r)
    args.push_back(rank_args(self, r, xs[r], outs[r], item(idx_list, r), item(w_list, r)));
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_value);
  for (int r = 0; r < num_ranks; ++r) {
    RankArgs& a = args[size_t(r)];
    self.ranks[size_t(r)]->dispatch(a.x.ptr<uint16_t>(), int(a.x.dim(0)), first_tokens[size_t(r)], stream, a.idx_ptr(),
                                    a.w_ptr());
  }
  for (auto& layer : self.ranks) layer->compute(stream);
  for (int r = 0; r < num_ranks; ++r) self.ranks[size_t(r)]->combine(args[size_t(r)].out.ptr<uint16_t>(), stream);
}

// This process's step of a layer across processes: dispatch, compute and combine on `stream`.
void forward_own(CudaLayer& self, nb::handle x_obj, nb::handle out_obj, int64_t first_token, nb::handle idx_obj,
                 nb::handle w_obj, uintptr_t stream_value) {
  if (!self.own_ep) throw nb::value_error("forward() with one rank is for a layer over a process group; use forward_all");
  if (idx_obj.is_none() != w_obj.is_none()) throw nb::value_error("pass topk_idx and topk_weights together, or neither");
  const RankArgs a = rank_args(self, self.own_ep->rank(), x_obj, out_obj, idx_obj, w_obj);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_value);
  gpu::GpuMoeLayer& layer = *self.ranks[0];
  if (self.mode == gpu::EpMode::kLowLatency)
    layer.forward_decode(a.x.ptr<uint16_t>(), int(a.x.dim(0)), first_token, a.out.ptr<uint16_t>(), stream, a.idx_ptr(),
                         a.w_ptr());
  else
    layer.forward_prefill(a.x.ptr<uint16_t>(), int(a.x.dim(0)), first_token, a.out.ptr<uint16_t>(), stream,
                          a.idx_ptr(), a.w_ptr());
}

}  // namespace

void bind_layer_cuda(nb::module_& m) {
  nb::class_<CudaLayer>(m, "CudaMoeLayer")
      .def("__init__", &cuda_layer_init, nb::arg("model"), nb::arg("weights_dir"), nb::arg("layer"), nb::arg("num_ranks"),
           nb::arg("max_tokens"), nb::arg("protocol") = "low-latency", nb::arg("phy2log").none() = nb::none(),
           nb::arg("replica_seed") = 0, nb::arg("expected_m") = 0)
      .def_static("connect", &cuda_layer_connect, nb::arg("model"), nb::arg("weights_dir"), nb::arg("layer"),
                  nb::arg("rank"), nb::arg("num_ranks"), nb::arg("device"), nb::arg("transport"),
                  nb::arg("nccl_unique_id"), nb::arg("all_gather").none(), nb::arg("max_tokens"),
                  nb::arg("protocol") = "low-latency", nb::arg("phy2log").none() = nb::none(),
                  nb::arg("replica_seed") = 0, nb::arg("expected_m") = 0, nb::arg("timeout_s") = 30.0,
                  "This process's rank of the layer over a group across processes (one per GPU), connected with "
                  "what the caller's process group swapped (ep_process.h).")
      .def_prop_ro("hidden", [](const CudaLayer& l) { return l.model.hidden_size; })
      .def_prop_ro("num_ranks", [](const CudaLayer& l) { return l.ranks[0]->ep().config().num_ranks; })
      .def_prop_ro("max_tokens", [](const CudaLayer& l) { return l.ranks[0]->config().max_tokens; })
      .def("forward_all", &forward_all, nb::arg("xs"), nb::arg("outs"), nb::arg("first_tokens"), nb::arg("topk_idx").none(),
           nb::arg("topk_weights").none(), nb::arg("stream"))
      .def("forward", &forward_own, nb::arg("x"), nb::arg("out"), nb::arg("first_token"), nb::arg("topk_idx").none(),
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
