// Expert-parallel dispatch and combine on the GPU (ep.h), in the mode chosen at construction (ep.h
// sizes a buffer's outputs for one mode): low-latency (masked layout, decode) or normal
// (contiguous layout, prefill). A CudaEpGroup holds either P virtual ranks of this process on one
// GPU (the `local` transport; on one stream every rank's send must come before any rank's
// receive, ep.h) or, made with connect(), this process's one rank of a group that spans processes
// (`nvlink` or `nccl`, ep_process.h). Every call launches on the caller's stream and returns at
// once (graph-capturable); the receive tensors are the ranks' own device memory, handed to Python
// as PyTorch tensors over DLPack that keep the group alive (no copies).
#if defined(MOEKIT_WITH_CUDA)

#include <fmt/format.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "ep_process.h"
#include "moekit/cuda_check.h"
#include "moekit/ep.h"
#include "tensor.h"

namespace nb = nanobind;

namespace moekit::py {

namespace {

struct GpuGroup {
  int device = 0;
  std::unique_ptr<gpu::EpLocalGroup> group;  // P virtual ranks, or
  std::unique_ptr<gpu::EpBuffer> own;        // this process's rank of a group across processes

  gpu::EpBuffer& rank(int r) {
    if (own) {
      if (r != own->rank())
        throw nb::value_error(
            fmt::format("rank = {}: this process holds rank {} of the group, and only that one", r, own->rank()).c_str());
      return *own;
    }
    if (r < 0 || r >= group->num_ranks())
      throw nb::value_error(fmt::format("rank = {}: expected 0..{}", r, group->num_ranks() - 1).c_str());
    return group->rank(r);
  }
  const gpu::EpConfig& config() { return own ? own->config() : group->rank(0).config(); }
  bool normal() { return config().mode == gpu::EpMode::kNormal; }
};

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

void expect_on(const GpuGroup& g, std::initializer_list<const Tensor*> tensors) {
  if (expect_same_device(tensors) != Device::kCuda || (*tensors.begin())->device_id != g.device)
    throw nb::value_error(fmt::format("{} must be on cuda:{}, the group's GPU", (*tensors.begin())->name, g.device).c_str());
}

// The outputs of one mode's buffers, asked for on a group of the other mode, would alias the wrong
// memory: refused by name.
void expect_mode(GpuGroup& g, gpu::EpMode mode, const char* call) {
  if (g.config().mode != mode)
    throw nb::value_error(fmt::format("{} needs a group made with protocol='{}'; this one is '{}'", call,
                                      gpu::ep_mode_name(mode), gpu::ep_mode_name(g.config().mode))
                              .c_str());
}

gpu::EpMode mode_arg(const std::string& protocol) {
  if (protocol == "low-latency" || protocol == "low_latency") return gpu::EpMode::kLowLatency;
  if (protocol == "normal") return gpu::EpMode::kNormal;
  throw nb::value_error(fmt::format("protocol = '{}': expected 'low-latency' or 'normal'", protocol).c_str());
}

// A device array of the group as a PyTorch tensor (DLPack), owned by the group's Python object.
nb::object device_tensor(nb::handle owner, const GpuGroup& g, void* data, std::vector<size_t> shape,
                         std::vector<int64_t> strides, nb::dlpack::dtype dtype) {
  nb::ndarray<nb::pytorch> a(data, shape.size(), shape.data(), owner, strides.data(), dtype, nb::device::cuda::value, g.device);
  return nb::cast(a);
}

gpu::EpConfig ep_config(int num_ranks, int max_tokens, int hidden, int topk, int num_slots, double timeout_s,
                        const std::string& protocol, int block_m, int max_recv_rows, const std::string& fp8_scaling) {
  gpu::EpConfig c;
  c.x_scaling = fp8_scaling_arg(fp8_scaling);
  c.num_ranks = num_ranks;
  c.max_tokens = max_tokens;
  c.hidden = hidden;
  c.topk = topk;
  c.num_slots = num_slots;
  c.mode = mode_arg(protocol);
  c.block_m = block_m;
  c.max_recv_rows = max_recv_rows;
  c.timeout_s = timeout_s;
  c.validate();
  return c;
}

void gpu_group_init(GpuGroup* self, int num_ranks, int max_tokens, int hidden, int topk, int num_slots,
                    double timeout_s, const std::string& protocol, int block_m, int max_recv_rows,
                    const std::string& fp8_scaling) {
  const gpu::EpConfig c = ep_config(num_ranks, max_tokens, hidden, topk, num_slots, timeout_s, protocol, block_m,
                                    max_recv_rows, fp8_scaling);
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  auto group = std::make_unique<gpu::EpLocalGroup>(c);
  new (self) GpuGroup{device, std::move(group), nullptr};
}

// This process's rank of a group across processes (ep_process.h says what the exchange arguments are).
GpuGroup* gpu_group_connect(int rank, int num_ranks, int device, const std::string& transport, nb::bytes nccl_unique_id,
                            nb::handle all_gather, int max_tokens, int hidden, int topk, int num_slots, double timeout_s,
                            const std::string& protocol, int block_m, int max_recv_rows,
                            const std::string& fp8_scaling) {
  const gpu::EpConfig c = ep_config(num_ranks, max_tokens, hidden, topk, num_slots, timeout_s, protocol, block_m,
                                    max_recv_rows, fp8_scaling);
  auto own = connect_process(c, rank, num_ranks, device, transport, nccl_unique_id, all_gather);
  return new GpuGroup{device, nullptr, std::move(own)};
}

void dispatch_send(GpuGroup& g, int rank, nb::handle x_obj, nb::handle idx_obj, nb::handle w_obj, uintptr_t stream) {
  const gpu::EpConfig& c = g.config();
  Tensor idx = take(idx_obj, "topk_idx", {DType::kInt32});
  expect_shape(idx, {{-1, "num_tokens"}, {c.topk, "num_topk"}});
  expect_contiguous(idx);
  int64_t num_tokens = idx.dim(0);
  if (num_tokens > c.max_tokens)
    throw nb::value_error(fmt::format("topk_idx holds {} tokens, more than num_max_dispatch_tokens_per_rank = {}", num_tokens,
                                      c.max_tokens)
                              .c_str());
  Tensor x = take(x_obj, "x", {DType::kBf16});
  expect_shape(x, {{num_tokens, "num_tokens"}, {c.hidden, "hidden"}});
  expect_contiguous(x);
  Tensor w = take(w_obj, "topk_weights", {DType::kFloat32});
  expect_shape(w, {{num_tokens, "num_tokens"}, {c.topk, "num_topk"}});
  expect_contiguous(w);
  expect_on(g, {&x, &idx, &w});
  g.rank(rank).dispatch_send(x.ptr<uint16_t>(), idx.ptr<int32_t>(), w.ptr<float>(), int(num_tokens), as_stream(stream));
}

// A combine's out [T, d] bf16 and optional add [T, d] bf16, on the group's GPU.
struct CombineOut {
  Tensor out, add;
  bool has_add = false;
  const uint16_t* add_ptr() const { return has_add ? add.ptr<uint16_t>() : nullptr; }
};

CombineOut combine_out_args(GpuGroup& g, int num_tokens, nb::handle add_obj, nb::handle out_obj) {
  const gpu::EpConfig& c = g.config();
  CombineOut r;
  r.out = take(out_obj, "out", {DType::kBf16}, Access::kWrite);
  expect_shape(r.out, {{num_tokens, "num_tokens"}, {c.hidden, "hidden"}});
  expect_contiguous(r.out);
  expect_on(g, {&r.out});
  if (!add_obj.is_none()) {
    r.has_add = true;
    r.add = take(add_obj, "add", {DType::kBf16});
    expect_shape(r.add, {{num_tokens, "num_tokens"}, {c.hidden, "hidden"}});
    expect_contiguous(r.add);
    expect_on(g, {&r.add});
  }
  return r;
}

// y: the expert outputs in the received layout, [E_loc, M_max, d] (low-latency) or [rows, d]
// (normal, rows = the contiguous buffers' rows; rows the step did not fill are not read). The
// receive's out and add are checked here too: a bad one refused at the hook, after this send
// was queued, would leave the rank's step half done.
void combine_send(GpuGroup& g, int rank, nb::handle y_obj, int num_tokens, nb::handle add_obj, nb::handle out_obj,
                  uintptr_t stream) {
  const gpu::EpConfig& c = g.config();
  Tensor y = take(y_obj, "x", {DType::kBf16});
  if (g.normal())
    expect_shape(y, {{g.rank(rank).contiguous_layout().total_m, "max_recv_rows"}, {c.hidden, "hidden"}});
  else
    expect_shape(y, {{c.slots_per_rank(), "E_loc"}, {c.max_m(), "M_max"}, {c.hidden, "hidden"}});
  expect_contiguous(y);
  expect_on(g, {&y});
  combine_out_args(g, num_tokens, add_obj, out_obj);
  g.rank(rank).combine_send(y.ptr<uint16_t>(), as_stream(stream));
}

void combine_recv(GpuGroup& g, int rank, int num_tokens, nb::handle add_obj, nb::handle out_obj, uintptr_t stream) {
  CombineOut a = combine_out_args(g, num_tokens, add_obj, out_obj);
  g.rank(rank).combine_recv(a.add_ptr(), a.out.ptr<uint16_t>(), as_stream(stream));
}

// The receive tensors of one rank: recv_x [E_loc, M_max, d] uint8 (e4m3 bytes), recv_scales
// [E_loc, M_max, d/128] MN-major, recv_count [E_loc], recv_src [E_loc, M_max].
nb::tuple outputs(nb::handle self, int rank) {
  GpuGroup& g = nb::cast<GpuGroup&>(self);
  expect_mode(g, gpu::EpMode::kLowLatency, "outputs");
  gpu::EpBuffer& b = g.rank(rank);
  const gpu::EpConfig& c = b.config();
  size_t e = size_t(c.slots_per_rank()), m = size_t(c.max_m()), d = size_t(c.hidden), kb = size_t(c.k_blocks());
  auto u8 = nb::dtype<uint8_t>();
  auto f32 = nb::dtype<float>();
  auto i32 = nb::dtype<int32_t>();
  return nb::make_tuple(
      device_tensor(self, g, b.recv_x(), {e, m, d}, {int64_t(m * d), int64_t(d), 1}, u8),
      device_tensor(self, g, b.recv_scales(), {e, m, kb}, {int64_t(kb * m), 1, int64_t(m)}, f32),
      device_tensor(self, g, b.recv_count(), {e}, {1}, i32),
      device_tensor(self, g, b.recv_src(), {e, m}, {int64_t(m), 1}, i32));
}

// Normal mode's receive tensors of one rank, over the whole contiguous buffers (rows =
// contiguous_rows(), fixed for the group's life): recv_x [rows, d] uint8 (e4m3 bytes),
// recv_scales [rows, d/128] MN-major (memory [d/128, rows]), row_expert [rows] (the contiguous
// GEMM's m_indices: -1 for padding and for rows past the step's total), recv_src [rows],
// recv_total_rows [1] (the step's padded M_total), recv_count [E_loc] (real rows per expert).
nb::tuple normal_outputs(nb::handle self, int rank) {
  GpuGroup& g = nb::cast<GpuGroup&>(self);
  expect_mode(g, gpu::EpMode::kNormal, "normal_outputs");
  gpu::EpBuffer& b = g.rank(rank);
  const ContiguousLayout l = b.contiguous_layout();
  size_t rows = size_t(l.total_m), d = size_t(l.k), kb = size_t(l.k_blocks()), e = size_t(b.config().slots_per_rank());
  auto u8 = nb::dtype<uint8_t>();
  auto f32 = nb::dtype<float>();
  auto i32 = nb::dtype<int32_t>();
  return nb::make_tuple(device_tensor(self, g, b.recv_x(), {rows, d}, {int64_t(d), 1}, u8),
                        device_tensor(self, g, b.recv_scales(), {rows, kb}, {1, int64_t(rows)}, f32),
                        device_tensor(self, g, b.row_expert(), {rows}, {1}, i32),
                        device_tensor(self, g, b.recv_src(), {rows}, {1}, i32),
                        device_tensor(self, g, b.recv_total_rows(), {1}, {1}, i32),
                        device_tensor(self, g, b.recv_count(), {e}, {1}, i32));
}

}  // namespace

gpu::EpTransport transport_arg(const std::string& transport) {
  if (transport == "nvlink") return gpu::EpTransport::kNvlink;
  if (transport == "nccl") return gpu::EpTransport::kNccl;
  throw nb::value_error(fmt::format("transport = '{}': expected 'nvlink' or 'nccl'", transport).c_str());
}

std::unique_ptr<gpu::EpBuffer> connect_process(const gpu::EpConfig& config, int rank, int num_ranks, int device,
                                               const std::string& transport, nb::bytes nccl_unique_id,
                                               nb::handle all_gather) {
  gpu::EpProcessGroup g;
  g.rank = rank;
  g.num_ranks = num_ranks;
  g.device = device;
  const auto* id = static_cast<const uint8_t*>(nccl_unique_id.data());
  g.nccl_unique_id.assign(id, id + nccl_unique_id.size());
  if (!all_gather.is_none()) {
    nb::object fn = nb::borrow(all_gather);
    g.all_gather = [fn](const std::vector<uint8_t>& mine) {
      nb::object got = fn(nb::bytes(mine.data(), mine.size()));
      if (!nb::isinstance<nb::bytes>(got))
        throw nb::type_error(
            fmt::format("all_gather must return bytes, got {}", nb::type_name(got.type()).c_str()).c_str());
      nb::bytes all = nb::borrow<nb::bytes>(got);
      const auto* p = static_cast<const uint8_t*>(all.data());
      return std::vector<uint8_t>(p, p + all.size());
    };
  }
  const gpu::EpTransport kind = transport_arg(transport);
  DeviceGuard guard(device);  // connect_ep selects `device`; the caller's current device comes back
  return gpu::connect_ep(config, g, kind);
}

void bind_ep_cuda(nb::module_& m) {
  m.def(
      "nccl_unique_id",
      [] {
        const std::vector<uint8_t> id = gpu::make_nccl_unique_id();
        return nb::bytes(id.data(), id.size());
      },
      "A fresh NCCL unique id (128 bytes) for CudaEpGroup.connect(transport='nccl'); loads NCCL.");
  nb::class_<GpuGroup>(m, "CudaEpGroup")
      .def("__init__", &gpu_group_init, nb::arg("num_ranks"), nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("topk"),
           nb::arg("num_slots"), nb::arg("timeout_s") = 30.0, nb::arg("protocol") = "low-latency",
           nb::arg("block_m") = 128, nb::arg("max_recv_rows") = 0, nb::arg("fp8_scaling") = "1x128")
      .def_static("connect", &gpu_group_connect, nb::arg("rank"), nb::arg("num_ranks"), nb::arg("device"),
                  nb::arg("transport"), nb::arg("nccl_unique_id"), nb::arg("all_gather").none(), nb::arg("max_tokens"),
                  nb::arg("hidden"), nb::arg("topk"), nb::arg("num_slots"), nb::arg("timeout_s") = 30.0,
                  nb::arg("protocol") = "low-latency", nb::arg("block_m") = 128, nb::arg("max_recv_rows") = 0,
                  nb::arg("fp8_scaling") = "1x128",
                  "This process's rank of an EP group across processes (one per GPU): the peers are connected "
                  "with what the caller's process group swapped (ep_process.h).")
      .def_prop_ro("num_ranks", [](GpuGroup& g) { return g.config().num_ranks; })
      .def_prop_ro("max_tokens", [](GpuGroup& g) { return g.config().max_tokens; })
      .def_prop_ro("hidden", [](GpuGroup& g) { return g.config().hidden; })
      .def_prop_ro("topk", [](GpuGroup& g) { return g.config().topk; })
      .def_prop_ro("num_slots", [](GpuGroup& g) { return g.config().num_slots; })
      .def_prop_ro("num_local_experts", [](GpuGroup& g) { return g.config().slots_per_rank(); })
      .def_prop_ro("max_m", [](GpuGroup& g) { return g.config().max_m(); })
      .def_prop_ro("device", [](GpuGroup& g) { return g.device; })
      .def_prop_ro("protocol", [](GpuGroup& g) { return std::string(gpu::ep_mode_name(g.config().mode)); })
      .def_prop_ro("block_m", [](GpuGroup& g) { return g.config().block_m; })
      .def_prop_ro("fp8_scaling", [](GpuGroup& g) { return std::string(fp8_scaling_name(g.config().x_scaling)); })
      .def_prop_ro("max_recv_rows", [](GpuGroup& g) { return g.normal() ? g.config().contiguous_rows() : 0; },
                   "Rows of the normal mode's contiguous receive buffers (0 in low-latency mode).")
      .def("dispatch_send", &dispatch_send, nb::arg("rank"), nb::arg("x"), nb::arg("topk_idx"), nb::arg("topk_weights"),
           nb::arg("stream"))
      .def("dispatch_recv", [](GpuGroup& g, int rank, uintptr_t stream) { g.rank(rank).dispatch_recv(as_stream(stream)); },
           nb::arg("rank"), nb::arg("stream"))
      .def("combine_send", &combine_send, nb::arg("rank"), nb::arg("x"), nb::arg("num_tokens"), nb::arg("add").none(),
           nb::arg("out"), nb::arg("stream"))
      .def("combine_recv", &combine_recv, nb::arg("rank"), nb::arg("num_tokens"), nb::arg("add").none(), nb::arg("out"),
           nb::arg("stream"))
      .def("normal_dispatch_recv",
           [](GpuGroup& g, int rank, uintptr_t stream) { g.rank(rank).normal_dispatch_recv(as_stream(stream)); },
           nb::arg("rank"), nb::arg("stream"))
      .def("outputs", &outputs, nb::arg("rank"))
      .def("normal_outputs", &normal_outputs, nb::arg("rank"))
      .def("check", [](GpuGroup& g, int rank, uintptr_t stream) { g.rank(rank).check(as_stream(stream)); }, nb::arg("rank"),
           nb::arg("stream"),
           "Synchronises the stream and raises moekit.Error if a kernel of this rank recorded a fault (a timeout, a bad slot).");
}

}  // namespace moekit::py

#endif  // MOEKIT_WITH_CUDA
