// Expert-parallel dispatch and combine over P in-process ranks (ep_cpu.h's LocalEpGroup, the
// `local` transport on the CPU). One Python object is the group; every call names its rank and
// writes into tensors the caller passes (the package's Buffer allocates them once, as DeepEP's
// buffer owns its receive tensors). Every call releases the GIL, so ranks can run on Python
// threads; a single thread works too when it calls every rank's send before any receive.
#include <fmt/format.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "bindings.h"
#include "moekit/ep_cpu.h"
#include "moekit/layout.h"
#include "tensor.h"

namespace nb = nanobind;

namespace moekit::py {

namespace {

void expect_cpu(std::initializer_list<const Tensor*> tensors) {
  if (expect_same_device(tensors) != Device::kCpu)
    throw nb::value_error(fmt::format("{} is on a GPU: this group is the CPU `local` transport; pass CPU tensors",
                                      (*tensors.begin())->name)
                              .c_str());
}

// topk_idx [T, k] as int32: int32 is used in place; int64 (DeepEP's and PyTorch's index type) is
// narrowed into `storage`, the one conversion the binding makes (indices, not payload).
const int32_t* topk_idx_arg(const Tensor& idx, std::vector<int32_t>& storage) {
  if (idx.dtype == DType::kInt32) return idx.ptr<int32_t>();
  storage.resize(size_t(idx.numel()));
  const int64_t* src = idx.ptr<int64_t>();
  for (size_t i = 0; i < storage.size(); ++i) {
    if (src[i] < -1 || src[i] > INT32_MAX)
      throw nb::value_error(fmt::format("topk_idx[{}, {}] = {} is not a slot id", i / idx.dim(1), i % idx.dim(1), src[i]).c_str());
    storage[i] = int32_t(src[i]);
  }
  return storage.data();
}

struct Routing {
  Tensor idx;
  std::vector<int32_t> idx32;
  int num_tokens = 0;
};

Routing routing_arg(const EpConfig& c, nb::handle topk_idx) {
  Routing r{take(topk_idx, "topk_idx", {DType::kInt32, DType::kInt64}), {}, 0};
  expect_shape(r.idx, {{-1, "num_tokens"}, {c.topk, "num_topk"}});
  expect_contiguous(r.idx);
  r.num_tokens = int(r.idx.dim(0));
  if (r.num_tokens > c.max_tokens)
    throw nb::value_error(fmt::format("topk_idx holds {} tokens, more than num_max_dispatch_tokens_per_rank = {}",
                                      r.num_tokens, c.max_tokens)
                              .c_str());
  return r;
}

Tensor weights_arg(const EpConfig& c, nb::handle topk_weights, int num_tokens) {
  Tensor w = take(topk_weights, "topk_weights", {DType::kFloat32});
  expect_shape(w, {{num_tokens, "num_tokens"}, {c.topk, "num_topk"}});
  expect_contiguous(w);
  return w;
}

Tensor tokens_arg(const EpConfig& c, nb::handle x_obj, int num_tokens, const char* name, Access access = Access::kRead) {
  Tensor x = take(x_obj, name, {DType::kBf16}, access);
  expect_shape(x, {{num_tokens, "num_tokens"}, {c.hidden, "hidden"}});
  expect_contiguous(x);
  return x;
}

void dispatch_send(LocalEpGroup& g, int rank, nb::handle x_obj, nb::handle idx_obj, nb::handle w_obj) {
  const EpConfig& c = g.config();
  Routing r = routing_arg(c, idx_obj);
  Tensor x = tokens_arg(c, x_obj, r.num_tokens, "x");
  Tensor w = weights_arg(c, w_obj, r.num_tokens);
  expect_cpu({&x, &r.idx, &w});
  const int32_t* idx = topk_idx_arg(r.idx, r.idx32);
  nb::gil_scoped_release release;
  g.dispatch_send(rank, r.num_tokens, x.ptr<uint16_t>(), idx, w.ptr<float>());
}

void dispatch_recv(LocalEpGroup& g, int rank, nb::handle recv_x_obj, nb::handle recv_scales_obj, nb::handle recv_count_obj,
                   nb::handle recv_src_obj) {
  const EpConfig& c = g.config();
  int64_t e = c.slots_per_rank(), m = c.max_m();
  Tensor recv_x = take(recv_x_obj, "recv_x", {DType::kFp8}, Access::kWrite);
  expect_shape(recv_x, {{e, "E_loc"}, {m, "M_max"}, {c.hidden, "hidden"}});
  expect_contiguous(recv_x);
  Tensor recv_scales = take(recv_scales_obj, "recv_scales", {DType::kFloat32}, Access::kWrite);
  expect_shape(recv_scales, {{e, "E_loc"}, {m, "M_max"}, {c.k_blocks(), "hidden/128"}});
  expect_mn_major(recv_scales);
  Tensor recv_count = take(recv_count_obj, "recv_count", {DType::kInt32}, Access::kWrite);
  expect_shape(recv_count, {{e, "E_loc"}});
  Tensor recv_src = take(recv_src_obj, "recv_src", {DType::kInt32}, Access::kWrite);
  expect_shape(recv_src, {{e, "E_loc"}, {m, "M_max"}});
  expect_contiguous(recv_src);
  expect_cpu({&recv_x, &recv_scales, &recv_count, &recv_src});
  nb::gil_scoped_release release;
  g.dispatch_recv(rank, recv_x.ptr<uint8_t>(), recv_scales.ptr<float>(), recv_count.ptr<int32_t>(), recv_src.ptr<int32_t>());
}

void combine_send(LocalEpGroup& g, int rank, nb::handle y_obj) {
  const EpConfig& c = g.config();
  Tensor y = take(y_obj, "x", {DType::kBf16});
  expect_shape(y, {{c.slots_per_rank(), "E_loc"}, {c.max_m(), "M_max"}, {c.hidden, "hidden"}});
  expect_contiguous(y);
  expect_cpu({&y});
  nb::gil_scoped_release release;
  g.combine_send(rank, y.ptr<uint16_t>());
}

void combine_recv(LocalEpGroup& g, int rank, int num_tokens, nb::handle add_obj, nb::handle out_obj) {
  const EpConfig& c = g.config();
  Tensor out = tokens_arg(c, out_obj, num_tokens, "out", Access::kWrite);
  const uint16_t* add = nullptr;
  Tensor add_t;
  if (!add_obj.is_none()) {
    add_t = tokens_arg(c, add_obj, num_tokens, "add");
    expect_cpu({&out, &add_t});
    add = add_t.ptr<uint16_t>();
  }
  expect_cpu({&out});
  nb::gil_scoped_release release;
  g.combine_recv(rank, add, out.ptr<uint16_t>());
}

nb::dict normal_notify(LocalEpGroup& g, int rank, nb::handle idx_obj) {
  Routing r = routing_arg(g.config(), idx_obj);
  expect_cpu({&r.idx});
  const int32_t* idx = topk_idx_arg(r.idx, r.idx32);
  ContiguousRecv recv;
  {
    nb::gil_scoped_release release;
    recv = g.normal_notify(rank, r.num_tokens, idx);
  }
  nb::dict d;
  d["num_tokens"] = r.num_tokens;
  d["total_m"] = recv.total_m;
  d["expert_rows"] = recv.expert_rows;
  d["segment_begin"] = recv.segment_begin;
  return d;
}

void normal_dispatch_send(LocalEpGroup& g, int rank, int num_tokens, nb::handle x_obj, nb::handle w_obj) {
  const EpConfig& c = g.config();
  Tensor x = tokens_arg(c, x_obj, num_tokens, "x");
  Tensor w = weights_arg(c, w_obj, num_tokens);
  expect_cpu({&x, &w});
  nb::gil_scoped_release release;
  g.normal_dispatch_send(rank, x.ptr<uint16_t>(), w.ptr<float>());
}

void normal_dispatch_recv(LocalEpGroup& g, int rank, int total_m, nb::handle recv_x_obj, nb::handle recv_scales_obj,
                          nb::handle row_expert_obj, nb::handle recv_src_obj) {
  const EpConfig& c = g.config();
  Tensor recv_x = take(recv_x_obj, "recv_x", {DType::kFp8}, Access::kWrite);
  expect_shape(recv_x, {{total_m, "M_total"}, {c.hidden, "hidden"}});
  expect_contiguous(recv_x);
  Tensor recv_scales = take(recv_scales_obj, "recv_scales", {DType::kFloat32}, Access::kWrite);
  expect_shape(recv_scales, {{total_m, "M_total"}, {c.k_blocks(), "hidden/128"}});
  expect_mn_major(recv_scales);
  Tensor row_expert = take(row_expert_obj, "m_indices", {DType::kInt32}, Access::kWrite);
  expect_shape(row_expert, {{total_m, "M_total"}});
  Tensor recv_src = take(recv_src_obj, "recv_src", {DType::kInt32}, Access::kWrite);
  expect_shape(recv_src, {{total_m, "M_total"}});
  expect_cpu({&recv_x, &recv_scales, &row_expert, &recv_src});
  nb::gil_scoped_release release;
  g.normal_dispatch_recv(rank, recv_x.ptr<uint8_t>(), recv_scales.ptr<float>(), row_expert.ptr<int32_t>(),
                         recv_src.ptr<int32_t>());
}

void normal_combine_send(LocalEpGroup& g, int rank, int total_m, nb::handle y_obj) {
  const EpConfig& c = g.config();
  Tensor y = take(y_obj, "x", {DType::kBf16});
  expect_shape(y, {{total_m, "M_total"}, {c.hidden, "hidden"}});
  expect_contiguous(y);
  expect_cpu({&y});
  nb::gil_scoped_release release;
  g.normal_combine_send(rank, y.ptr<uint16_t>());
}

nb::dict stats(const LocalEpGroup& g, int rank) {
  const EpStats& s = g.stats(rank);
  nb::dict d;
  d["num_tokens"] = s.num_tokens;
  d["dispatch_messages"] = s.dispatch_messages;
  d["dispatch_bytes"] = s.dispatch_bytes;
  d["dispatch_bytes_remote"] = s.dispatch_bytes_remote;
  d["recv_messages"] = s.recv_messages;
  d["recv_rows"] = s.recv_rows;
  d["combine_bytes"] = s.combine_bytes;
  d["combine_bytes_remote"] = s.combine_bytes_remote;
  d["targets_per_token"] = s.targets_per_token();
  return d;
}

}  // namespace

Fp8Scaling fp8_scaling_arg(const std::string& name) {
  if (name == "1x128") return Fp8Scaling::kPerBlock;
  if (name == "per-token" || name == "per_token") return Fp8Scaling::kPerToken;
  throw nb::value_error(fmt::format("fp8_scaling = '{}': expected '1x128' or 'per-token'", name).c_str());
}

void bind_ep(nb::module_& m) {
  nb::class_<LocalEpGroup>(m, "LocalEpGroup")
      .def(
          "__init__",
          [](LocalEpGroup* self, int num_ranks, int max_tokens, int hidden, int topk, int num_slots, int block_m,
             double timeout_s, const std::string& fp8_scaling) {
            EpConfig c;
            c.x_scaling = fp8_scaling_arg(fp8_scaling);
            c.num_ranks = num_ranks;
            c.max_tokens = max_tokens;
            c.hidden = hidden;
            c.topk = topk;
            c.num_slots = num_slots;
            c.block_m = block_m;
            c.timeout_s = timeout_s;
            new (self) LocalEpGroup(c);
          },
          nb::arg("num_ranks"), nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("topk"), nb::arg("num_slots"),
          nb::arg("block_m") = 64, nb::arg("timeout_s") = 30.0, nb::arg("fp8_scaling") = "1x128")
      .def_prop_ro("num_ranks", [](const LocalEpGroup& g) { return g.config().num_ranks; })
      .def_prop_ro("fp8_scaling", [](const LocalEpGroup& g) { return std::string(fp8_scaling_name(g.config().x_scaling)); })
      .def_prop_ro("max_tokens", [](const LocalEpGroup& g) { return g.config().max_tokens; })
      .def_prop_ro("hidden", [](const LocalEpGroup& g) { return g.config().hidden; })
      .def_prop_ro("topk", [](const LocalEpGroup& g) { return g.config().topk; })
      .def_prop_ro("num_slots", [](const LocalEpGroup& g) { return g.config().num_slots; })
      .def_prop_ro("num_local_experts", [](const LocalEpGroup& g) { return g.config().slots_per_rank(); })
      .def_prop_ro("max_m", [](const LocalEpGroup& g) { return g.config().max_m(); })
      .def("dispatch_send", &dispatch_send, nb::arg("rank"), nb::arg("x"), nb::arg("topk_idx"), nb::arg("topk_weights"))
      .def("dispatch_recv", &dispatch_recv, nb::arg("rank"), nb::arg("recv_x"), nb::arg("recv_scales"), nb::arg("recv_count"),
           nb::arg("recv_src"))
      .def("combine_send", &combine_send, nb::arg("rank"), nb::arg("x"))
      .def("combine_recv", &combine_recv, nb::arg("rank"), nb::arg("num_tokens"), nb::arg("add").none(), nb::arg("out"))
      .def("normal_notify", &normal_notify, nb::arg("rank"), nb::arg("topk_idx"))
      .def("normal_dispatch_send", &normal_dispatch_send, nb::arg("rank"), nb::arg("num_tokens"), nb::arg("x"),
           nb::arg("topk_weights"))
      .def("normal_dispatch_recv", &normal_dispatch_recv, nb::arg("rank"), nb::arg("total_m"), nb::arg("recv_x"),
           nb::arg("recv_scales"), nb::arg("m_indices"), nb::arg("recv_src"))
      .def("normal_combine_send", &normal_combine_send, nb::arg("rank"), nb::arg("total_m"), nb::arg("x"))
      .def("stats", &stats, nb::arg("rank"))
      .def("abort", &LocalEpGroup::abort, nb::arg("rank"), nb::arg("why"));
}

}  // namespace moekit::py
