// The expert-parallel load balancer (eplb.h) in EPLB's vocabulary:
// rebalance(weight, num_slots, num_groups, num_nodes, num_gpus) -> (phy2log, log2phy, replica_count).
#include <fmt/format.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "bindings.h"
#include "moekit/eplb.h"
#include "tensor.h"

namespace nb = nanobind;

namespace moekit::py {

namespace {

// weight [L, E] of any numeric dtype -> rows of doubles (loads are small and host-side).
std::vector<std::vector<double>> load_rows(nb::handle obj, const char* name) {
  Tensor w = take(obj, name, {DType::kFloat32, DType::kFloat64, DType::kInt32, DType::kInt64});
  expect_shape(w, {{-1, "num_layers"}, {-1, "num_experts"}});
  expect_contiguous(w);
  if (w.device != Device::kCpu) throw nb::value_error(fmt::format("{} must be on the CPU (pass .cpu())", name).c_str());
  std::vector<std::vector<double>> rows(size_t(w.dim(0)), std::vector<double>(size_t(w.dim(1))));
  for (int64_t l = 0; l < w.dim(0); ++l)
    for (int64_t e = 0; e < w.dim(1); ++e) {
      int64_t i = l * w.dim(1) + e;
      double v = 0;
      switch (w.dtype) {
        case DType::kFloat32: v = w.ptr<float>()[i]; break;
        case DType::kFloat64: v = w.ptr<double>()[i]; break;
        case DType::kInt32: v = w.ptr<int32_t>()[i]; break;
        default: v = double(w.ptr<int64_t>()[i]); break;
      }
      rows[size_t(l)][size_t(e)] = v;
    }
  return rows;
}

// A new int64 NumPy array holding `values` (EPLB returns int64 index tensors).
nb::object int64_array(const std::vector<int32_t>& values, std::vector<size_t> shape) {
  auto* data = new std::vector<int64_t>(values.begin(), values.end());
  nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, int64_t>(data->data(), shape.size(), shape.data(), owner));
}

nb::tuple rebalance_py(nb::handle weight, int num_slots, int num_groups, int num_nodes, int num_gpus) {
  std::vector<std::vector<double>> rows = load_rows(weight, "weight");
  Placement p;
  {
    nb::gil_scoped_release release;
    p = rebalance(rows, num_slots, num_groups, num_nodes, num_gpus);
  }
  size_t L = size_t(p.num_layers), E = size_t(p.num_experts);
  return nb::make_tuple(int64_array(p.phy2log, {L, size_t(p.num_slots)}),
                        int64_array(p.log2phy, {L, E, size_t(p.max_replicas)}), int64_array(p.replica_count, {L, E}));
}

// Per-GPU loads and balancedness of a placement given by phy2log, before (identity placement)
// and after: the figures `moekit eplb` prints.
nb::dict balance_py(nb::handle weight, nb::handle phy2log_obj, int num_groups, int num_nodes, int num_gpus) {
  std::vector<std::vector<double>> rows = load_rows(weight, "weight");
  Tensor phy = take(phy2log_obj, "phy2log", {DType::kInt32, DType::kInt64});
  expect_shape(phy, {{int64_t(rows.size()), "num_layers"}, {-1, "num_slots"}});
  expect_contiguous(phy);
  std::vector<int32_t> ids(size_t(phy.numel()));
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = phy.dtype == DType::kInt32 ? phy.ptr<int32_t>()[i] : int32_t(phy.ptr<int64_t>()[i]);
  int num_experts = rows.empty() ? 0 : int(rows[0].size());
  Placement p = placement_from_phy2log(ids, int(rows.size()), num_experts, int(phy.dim(1)), num_groups, num_nodes, num_gpus);
  BalanceReport r = balance_report(p, rows);
  nb::dict d;
  d["gpu_load_before"] = r.gpu_load_before;
  d["gpu_load_after"] = r.gpu_load_after;
  d["balancedness_before"] = r.balancedness_before;
  d["balancedness_after"] = r.balancedness_after;
  d["mean_balancedness_before"] = r.mean_balancedness_before;
  d["mean_balancedness_after"] = r.mean_balancedness_after;
  return d;
}

}  // namespace

void bind_eplb(nb::module_& m) {
  m.def("rebalance", &rebalance_py, nb::arg("weight"), nb::arg("num_slots"), nb::arg("num_groups"), nb::arg("num_nodes"),
        nb::arg("num_gpus"),
        "DeepSeek's EPLB placement (eplb.h): weight [L, E] loads -> (phy2log [L, num_slots], "
        "log2phy [L, E, max_replicas] (-1 padded), replica_count [L, E]), int64 NumPy arrays.");
  m.def("balance", &balance_py, nb::arg("weight"), nb::arg("phy2log"), nb::arg("num_groups"), nb::arg("num_nodes"),
        nb::arg("num_gpus"),
        "Per-GPU loads ([L][G], flattened) and balancedness (mean/max) of the identity placement and of phy2log.");
}

}  // namespace moekit::py
