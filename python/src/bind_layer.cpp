// The MoE layer on the CPU over P in-process ranks (layer_cpu.h), with its weights loaded from a
// DeepSeek-style FP8 checkpoint (weights.h), and the random-checkpoint writer for tests and demos.
#include <fmt/format.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "moekit/eplb.h"
#include "moekit/layer_cpu.h"
#include "moekit/safetensors.h"
#include "moekit/weights.h"
#include "tensor.h"

namespace nb = nanobind;

namespace moekit::py {

namespace {

// One layer and the group its ranks exchange through.
struct Layer {
  ModelSpec model;
  std::unique_ptr<CpuMoeLayer> layer;
  std::unique_ptr<LocalEpGroup> group;
};

EpProtocol protocol_arg(const std::string& name) {
  if (name == "low-latency" || name == "low_latency") return EpProtocol::kLowLatency;
  if (name == "normal") return EpProtocol::kNormal;
  throw nb::value_error(fmt::format("protocol = '{}': expected 'low-latency' or 'normal'", name).c_str());
}

void layer_init(Layer* self, nb::handle model_obj, const std::string& weights_dir, int layer_index, int num_ranks,
                int max_tokens, const std::string& protocol, nb::handle phy2log_obj, int block_m, uint64_t replica_seed,
                double timeout_s) {
  ModelSpec model = model_arg(model_obj);
  CpuLayerConfig config;
  config.num_ranks = num_ranks;
  config.max_tokens = max_tokens;
  config.protocol = protocol_arg(protocol);
  config.block_m = block_m;
  config.replica_seed = replica_seed;
  config.timeout_s = timeout_s;
  int num_experts = model.num_routed_experts;
  Placement placement;
  if (phy2log_obj.is_none()) {
    placement = identity_placement(num_experts, num_ranks);
  } else {
    Tensor phy = take(phy2log_obj, "phy2log", {DType::kInt32, DType::kInt64});
    expect_shape(phy, {{-1, "num_slots"}});
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
  auto layer = std::make_unique<CpuMoeLayer>(model, weights, placement, 0, config);
  auto group = std::make_unique<LocalEpGroup>(layer->ep_config());
  new (self) Layer{model, std::move(layer), std::move(group)};
}

void forward(Layer& self, int rank, nb::handle x_obj, nb::handle out_obj, int64_t first_token, nb::handle idx_obj,
             nb::handle w_obj) {
  const int64_t d = self.model.hidden_size, k = self.model.num_experts_per_token;
  Tensor x = take(x_obj, "x", {DType::kBf16});
  expect_shape(x, {{-1, "num_tokens"}, {d, "hidden"}});
  expect_contiguous(x);
  int64_t num_tokens = x.dim(0);
  Tensor out = take(out_obj, "out", {DType::kBf16}, Access::kWrite);
  expect_shape(out, {{num_tokens, "num_tokens"}, {d, "hidden"}});
  expect_contiguous(out);
  if (idx_obj.is_none() != w_obj.is_none()) throw nb::value_error("pass topk_idx and topk_weights together, or neither");
  Tensor idx, w;
  if (!idx_obj.is_none()) {
    idx = take(idx_obj, "topk_idx", {DType::kInt32});
    expect_shape(idx, {{num_tokens, "num_tokens"}, {k, "num_topk"}});
    expect_contiguous(idx);
    w = take(w_obj, "topk_weights", {DType::kFloat32});
    expect_shape(w, {{num_tokens, "num_tokens"}, {k, "num_topk"}});
    expect_contiguous(w);
  }
  if (expect_same_device({&x, &out}) != Device::kCpu)
    throw nb::value_error("x is on a GPU: MoELayer is the CPU reference layer; pass CPU tensors");
  nb::gil_scoped_release release;
  self.layer->forward(*self.group, rank, int(num_tokens), first_token, x.ptr<uint16_t>(), out.ptr<uint16_t>(),
                      idx.data ? idx.ptr<int32_t>() : nullptr, w.data ? w.ptr<float>() : nullptr);
}

nb::dict last_step(const Layer& self, int rank) {
  const RankStep& s = self.layer->last_step(rank);
  nb::dict d;
  d["num_tokens"] = s.num_tokens;
  d["topk_idx"] = s.topk_idx;
  d["topk_weights"] = s.topk_weights;
  d["topk_slot"] = s.topk_slot;
  d["recv_count"] = s.recv_count;
  d["dispatch_messages"] = s.ep.dispatch_messages;
  d["targets_per_token"] = s.ep.targets_per_token();
  nb::dict times;
  times["gate"] = s.times.gate;
  times["dispatch"] = s.times.dispatch;
  times["gemm1"] = s.times.gemm1;
  times["activation"] = s.times.activation;
  times["gemm2"] = s.times.gemm2;
  times["combine"] = s.times.combine;
  times["shared"] = s.times.shared;
  d["times"] = times;
  return d;
}

nb::dict write_weights(nb::handle model_obj, const std::string& dir, int num_layers, uint64_t seed) {
  ModelSpec model = model_arg(model_obj);
  RandomWeightsOptions options;
  options.num_layers = num_layers;
  options.seed = seed;
  RandomWeightsPlan plan;
  {
    nb::gil_scoped_release release;
    plan = write_random_weights(model, options, dir);
  }
  nb::dict d;
  d["num_files"] = plan.shards.size();
  d["tensor_bytes"] = plan.tensor_bytes;
  d["file_bytes"] = plan.file_bytes;
  return d;
}

}  // namespace

void bind_layer(nb::module_& m) {
  nb::class_<Layer>(m, "CpuMoeLayer")
      .def("__init__", &layer_init, nb::arg("model"), nb::arg("weights_dir"), nb::arg("layer"), nb::arg("num_ranks"),
           nb::arg("max_tokens"), nb::arg("protocol") = "low-latency", nb::arg("phy2log").none() = nb::none(),
           nb::arg("block_m") = 64, nb::arg("replica_seed") = 0, nb::arg("timeout_s") = 60.0)
      .def_prop_ro("hidden", [](const Layer& l) { return l.model.hidden_size; })
      .def_prop_ro("num_topk", [](const Layer& l) { return l.model.num_experts_per_token; })
      .def_prop_ro("num_ranks", [](const Layer& l) { return l.layer->config().num_ranks; })
      .def_prop_ro("max_tokens", [](const Layer& l) { return l.layer->config().max_tokens; })
      .def_prop_ro("num_local_experts", [](const Layer& l) { return l.layer->num_local_experts(); })
      .def("forward", &forward, nb::arg("rank"), nb::arg("x"), nb::arg("out"), nb::arg("first_token"),
           nb::arg("topk_idx").none(), nb::arg("topk_weights").none())
      .def("last_step", &last_step, nb::arg("rank"));
  m.def("write_random_weights", &write_weights, nb::arg("model"), nb::arg("dir"), nb::arg("num_layers") = 1,
        nb::arg("seed") = 0,
        "Writes a random FP8 checkpoint of `model` (DeepSeek-V3's tensor names) into dir: the first num_layers MoE layers.");
}

}  // namespace moekit::py
