// The EP buffer object (include/moekit/ep.h): the rank's private allocation, the host-side
// argument checks of each call, fault reporting, and the `local` transport (P virtual ranks on one
// GPU). The config's checks and sizes are in ep_config.cu.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "ep_format.h"
#include "ep_state.cuh"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/ep.h"

namespace moekit::gpu {

namespace {

const char* phase_name(int phase) {
  static const char* names[] = {"dispatch_send", "dispatch_recv", "combine_send", "combine_recv"};
  return phase >= 0 && phase < 4 ? names[phase] : "?";
}

}  // namespace

struct EpBuffer::Impl {
  EpConfig config;
  int rank = 0;
  EpTransport transport = EpTransport::kLocal;
  std::shared_ptr<EpExchange> exchange;
  int num_ctas = 0;
  EpArgs args{};
  void* private_mem = nullptr;
  void** peer_table = nullptr;
  int expected = kPhaseDispatchSend;  // host-side protocol order check
  // One rank (either mode): the y of a combine_send that launched nothing, for combine_recv.
  const uint16_t* pending_y = nullptr;
};

EpBuffer::EpBuffer(const EpConfig& config, int rank, EpTransport transport, const EpPeers& peers,
                   std::shared_ptr<EpExchange> exchange)
    : impl_(std::make_unique<Impl>()) {
  config.validate();
  const int P = config.num_ranks;
  MOEKIT_CHECK(rank >= 0 && rank < P, fmtr("EpBuffer: rank = {}, expected 0..{}", rank, P - 1));
  MOEKIT_CHECK(int(peers.peer_dispatch.size()) == P && int(peers.peer_combine.size()) == P,
               fmtr("EpBuffer: {} dispatch and {} combine peer pointers, expected {} each",
                           peers.peer_dispatch.size(), peers.peer_combine.size(), P));
  const EpSizes z = ep_sizes(config);
  MOEKIT_CHECK(peers.symmetric != nullptr, "EpBuffer: the symmetric region is null");
  MOEKIT_CHECK(peers.symmetric_bytes >= z.symmetric_bytes,
               fmtr("EpBuffer: symmetric region of {} bytes is undersized, this config needs {} bytes",
                           peers.symmetric_bytes, z.symmetric_bytes));
  for (int r = 0; r < P; ++r)
    MOEKIT_CHECK(peers.peer_dispatch[r] && peers.peer_combine[r], fmtr("EpBuffer: peer pointer of rank {} is null", r));

  Impl& m = *impl_;
  m.config = config;
  m.rank = rank;
  m.transport = transport;
  m.exchange = std::move(exchange);
  int device = 0, clock_khz = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  m.num_ctas = config.num_ctas > 0 ? config.num_ctas : query_device(device).num_sms;

  const PrivateLayout l = private_layout(config);
  MOEKIT_CUDA_CHECK(cudaMalloc(&m.private_mem, l.total));
  MOEKIT_CUDA_CHECK(cudaMemset(m.private_mem, 0, l.total));
  MOEKIT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&m.peer_table), 2 * sizeof(void*) * P));
  std::vector<void*> table(peers.peer_dispatch);
  table.insert(table.end(), peers.peer_combine.begin(), peers.peer_combine.end());
  MOEKIT_CUDA_CHECK(cudaMemcpy(m.peer_table, table.data(), table.size() * sizeof(void*), cudaMemcpyHostToDevice));

  uint8_t* base = static_cast<uint8_t*>(m.private_mem);
  EpArgs& a = m.args;
  a.rank = rank;
  a.num_ranks = P;
  a.max_tokens = config.max_tokens;
  a.hidden = config.hidden;
  a.topk = config.topk;
  a.num_slots = config.num_slots;
  a.local_experts = config.slots_per_rank();
  a.max_m = config.max_m();
  a.block_m = config.block_m;
  a.max_rows = config.mode == EpMode::kNormal ? config.contiguous_rows() : 0;
  a.msg_bytes = int(z.msg_bytes);
  a.msg_scale_off = int(z.msg_scale_off);
  a.msg_meta_off = int(z.msg_meta_off);
  a.dispatch_header_bytes = int(z.dispatch_header_bytes);
  a.dispatch_inbox_bytes = z.dispatch_inbox_bytes;
  a.combine_inbox_bytes = z.combine_inbox_bytes;
  a.parity_mask = peers.double_buffered ? 1 : 0;
  a.self_slab = config.self_slab ? 1 : 0;
  a.direct = P == 1 ? 1 : 0;
  a.contiguous = config.mode == EpMode::kNormal ? 1 : 0;
  a.mxfp4_k_order = config.mxfp4_k_order ? 1 : 0;
  a.token_scales = config.x_scaling == Fp8Scaling::kPerToken ? 1 : 0;
  a.rows_ready = nullptr;  // set per call (dispatch_recv with rows_ready)
  a.x_cols = a.out_cols = config.hidden;  // set per call (dispatch_send's x_cols, combine_recv's out_cols)
  a.timeout_cycles = (long long)(config.timeout_s * double(clock_khz) * 1e3);
  a.symmetric = static_cast<uint8_t*>(peers.symmetric);
  a.peer_dispatch = reinterpret_cast<uint8_t* const*>(m.peer_table);
  a.peer_combine = reinterpret_cast<uint8_t* const*>(m.peer_table + P);
  a.ctr = reinterpret_cast<EpCounters*>(base + l.counters);
  a.status = reinterpret_cast<EpStatusWord*>(base + l.status);
  a.route_ranks = reinterpret_cast<int32_t*>(base + l.route_ranks);
  a.send_msgs = reinterpret_cast<int32_t*>(base + l.send_msgs);
  a.recv_msgs = reinterpret_cast<int32_t*>(base + l.recv_msgs);
  a.map_token = reinterpret_cast<int32_t*>(base + l.map_token);
  a.map_rows = reinterpret_cast<int32_t*>(base + l.map_rows);
  a.map_w = reinterpret_cast<float*>(base + l.map_w);
  a.count_ctas = l.count_ctas;
  a.cta_counts = reinterpret_cast<int32_t*>(base + l.cta_counts);
  a.cta_flags = reinterpret_cast<int32_t*>(base + l.cta_flags);
  a.recv_x = base + l.recv_x;
  a.recv_scales = reinterpret_cast<float*>(base + l.recv_scales);
  a.recv_count = reinterpret_cast<int32_t*>(base + l.recv_count);
  a.recv_src = reinterpret_cast<int32_t*>(base + l.recv_src);
  a.row_expert = config.mode == EpMode::kNormal ? reinterpret_cast<int32_t*>(base + l.row_expert) : nullptr;
  a.total_rows = config.mode == EpMode::kNormal ? reinterpret_cast<int32_t*>(base + l.total_rows) : nullptr;
  a.send_resident_ctas = dispatch_send_resident_ctas(a, query_device(device).num_sms);
}

EpBuffer::~EpBuffer() {
  // Destructors do not throw: a failed free at exit has nothing left to protect.
  if (impl_->peer_table) cudaFree(impl_->peer_table);
  if (impl_->private_mem) cudaFree(impl_->private_mem);
}

std::vector<void*> EpExchange::map_peer_allocations(void*) {
  throw Error("map_peer_allocations: this transport maps no peer memory");
}

std::vector<void*> EpBuffer::map_peer_allocations(void* mine) {
  const Impl& m = *impl_;
  MOEKIT_CHECK(mine != nullptr, fmtr("rank {}: map_peer_allocations of a null pointer", m.rank));
  MOEKIT_CHECK(m.transport == EpTransport::kNvlink && m.exchange,
               fmtr("rank {}: map_peer_allocations needs the nvlink transport, this buffer's is {} ({})", m.rank,
                    ep_transport_name(m.transport),
                    m.transport == EpTransport::kLocal ? "in-process ranks: pass their pointers directly"
                                                       : "no peer memory is mapped: copy through the host"));
  return m.exchange->map_peer_allocations(mine);
}

const EpConfig& EpBuffer::config() const { return impl_->config; }
int EpBuffer::rank() const { return impl_->rank; }
EpTransport EpBuffer::transport() const { return impl_->transport; }

struct PhaseCheck {
  static void expect(int& expected, int phase, int rank, const char* call) {
    // A step may stop after dispatch_recv (dispatch-only loops): then a send may follow it.
    const bool ok = expected == phase || (phase == kPhaseDispatchSend && expected == kPhaseCombineSend);
    MOEKIT_CHECK(ok, fmtr("EP rank {}: {} called out of order, expected {} next", rank, call, phase_name(expected)));
    expected = (phase + 1) % 4;
  }
};

void EpBuffer::dispatch_send(const uint16_t* x, const int32_t* topk_idx, const float* topk_weights, int num_tokens,
                             cudaStream_t stream, int x_cols) {
  Impl& m = *impl_;
  MOEKIT_CHECK(num_tokens >= 0 && num_tokens <= m.config.max_tokens,
               fmtr("EP rank {}: dispatch_send: num_tokens = {}, expected 0..T_max = {}", m.rank, num_tokens,
                           m.config.max_tokens));
  MOEKIT_CHECK(num_tokens == 0 || (x && topk_idx && topk_weights),
               fmtr("EP rank {}: dispatch_send: x, topk_idx and topk_weights must be device pointers, got null",
                           m.rank));
  MOEKIT_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0,
               fmtr("EP rank {}: dispatch_send: x must be 16-byte aligned", m.rank));
  MOEKIT_CHECK(x_cols >= 0 && x_cols <= m.config.hidden && x_cols % 16 == 0,
               fmtr("EP rank {}: dispatch_send: x_cols = {}, expected 0 (= d) or a multiple of 16 up to d = {}", m.rank,
                    x_cols, m.config.hidden));
  PhaseCheck::expect(m.expected, kPhaseDispatchSend, m.rank, "dispatch_send");
  EpArgs args = m.args;
  args.x_cols = x_cols > 0 ? x_cols : m.config.hidden;
  launch_dispatch_send(args, x, topk_idx, topk_weights, num_tokens, m.num_ctas, stream);
  if (m.exchange && !m.args.direct) m.exchange->after_dispatch_send(stream);
}

namespace {

// Both low-latency receives: the mode and the phase, then the kernel (rows_ready null: no hand-off).
void launch_low_latency_recv(EpBuffer::Impl& m, int32_t* rows_ready, int num_ctas, cudaStream_t stream) {
  MOEKIT_CHECK(m.config.mode == EpMode::kLowLatency,
               fmtr("EP rank {}: dispatch_recv needs a low-latency buffer; this one is normal mode "
                    "(call normal_dispatch_recv)", m.rank));
  PhaseCheck::expect(m.expected, kPhaseDispatchRecv, m.rank, "dispatch_recv");
  EpArgs args = m.args;
  args.rows_ready = rows_ready;
  if (!args.direct) launch_dispatch_recv(args, false, num_ctas, stream);
  else if (rows_ready) launch_publish_direct(args, stream);  // one rank: the send wrote the layout
}

}  // namespace

void EpBuffer::dispatch_recv(cudaStream_t stream) { launch_low_latency_recv(*impl_, nullptr, impl_->num_ctas, stream); }

void EpBuffer::dispatch_recv(cudaStream_t stream, int32_t* rows_ready, int num_ctas) {
  Impl& m = *impl_;
  MOEKIT_CHECK(rows_ready != nullptr && reinterpret_cast<uintptr_t>(rows_ready) % 4 == 0,
               fmtr("EP rank {}: dispatch_recv: rows_ready must be a device array of {} ints, got {}", m.rank,
                    m.config.slots_per_rank() + (m.config.self_slab ? 1 : 0) + 2,
                    rows_ready ? "a misaligned pointer" : "null"));
  MOEKIT_CHECK(num_ctas >= 1 && num_ctas <= m.num_ctas,
               fmtr("EP rank {}: dispatch_recv: num_ctas = {}, expected 1..{}", m.rank, num_ctas, m.num_ctas));
  launch_low_latency_recv(m, rows_ready, num_ctas, stream);
}

void EpBuffer::normal_dispatch_recv(cudaStream_t stream) {
  Impl& m = *impl_;
  MOEKIT_CHECK(m.config.mode == EpMode::kNormal,
               fmtr("EP rank {}: normal_dispatch_recv needs a normal-mode buffer; this one is low-latency "
                           "(call dispatch_recv)", m.rank));
  PhaseCheck::expect(m.expected, kPhaseDispatchRecv, m.rank, "normal_dispatch_recv");
  if (!m.args.direct) launch_dispatch_recv(m.args, true, m.num_ctas, stream);  // one rank: the send placed the rows
}

namespace {

void launch_send_back(EpBuffer::Impl& m, const uint16_t* y, int32_t* y_ready, int num_ctas, cudaStream_t stream) {
  MOEKIT_CHECK(y != nullptr && reinterpret_cast<uintptr_t>(y) % 16 == 0,
               fmtr("EP rank {}: combine_send: y must be a 16-byte aligned device pointer", m.rank));
  PhaseCheck::expect(m.expected, kPhaseCombineSend, m.rank, "combine_send");
  // One rank, not beside a GEMM: combine_recv sums the rows itself (one kernel for both).
  m.pending_y = m.args.num_ranks == 1 && !y_ready ? y : nullptr;
  if (m.pending_y) return;
  launch_combine_send(m.args, y, y_ready, num_ctas, stream);
  if (m.exchange && !m.args.direct) m.exchange->after_combine_send(stream);
}

}  // namespace

void EpBuffer::combine_send(const uint16_t* y, cudaStream_t stream) {
  launch_send_back(*impl_, y, nullptr, impl_->num_ctas, stream);
}

void EpBuffer::combine_send(const uint16_t* y, cudaStream_t stream, int32_t* y_ready, int num_ctas) {
  Impl& m = *impl_;
  MOEKIT_CHECK(m.config.mode == EpMode::kLowLatency,
               fmtr("EP rank {}: combine_send with y_ready needs a low-latency buffer (the masked layout); this one "
                    "is normal mode", m.rank));
  MOEKIT_CHECK(y_ready != nullptr && reinterpret_cast<uintptr_t>(y_ready) % 4 == 0,
               fmtr("EP rank {}: combine_send: y_ready must be a device array of {} ints, got {}", m.rank,
                    m.config.slots_per_rank() + (m.config.self_slab ? 1 : 0),
                    y_ready ? "a misaligned pointer" : "null"));
  MOEKIT_CHECK(num_ctas >= 1 && num_ctas <= m.num_ctas,
               fmtr("EP rank {}: combine_send: num_ctas = {}, expected 1..{}", m.rank, num_ctas, m.num_ctas));
  launch_send_back(m, y, y_ready, num_ctas, stream);
}

void EpBuffer::combine_recv(const uint16_t* add, uint16_t* out, cudaStream_t stream, int out_cols) {
  Impl& m = *impl_;
  MOEKIT_CHECK(out != nullptr && reinterpret_cast<uintptr_t>(out) % 16 == 0 && reinterpret_cast<uintptr_t>(add) % 16 == 0,
               fmtr("EP rank {}: combine_recv: out (and add, if given) must be 16-byte aligned device pointers",
                           m.rank));
  MOEKIT_CHECK(out_cols >= 0 && out_cols <= m.config.hidden && out_cols % 8 == 0,
               fmtr("EP rank {}: combine_recv: out_cols = {}, expected 0 (= d) or a multiple of 8 up to d = {}", m.rank,
                    out_cols, m.config.hidden));
  MOEKIT_CHECK(out_cols == 0 || out_cols == m.config.hidden || add != out,
               fmtr("EP rank {}: combine_recv: add is out with out_cols = {} < d = {} (their rows would not line up)",
                    m.rank, out_cols, m.config.hidden));
  PhaseCheck::expect(m.expected, kPhaseCombineRecv, m.rank, "combine_recv");
  EpArgs args = m.args;
  args.out_cols = out_cols > 0 ? out_cols : m.config.hidden;
  launch_combine_recv(args, add, out, m.num_ctas, m.config.max_tokens, m.pending_y, stream);
  m.pending_y = nullptr;
}

void EpBuffer::set_overlap(bool on) { impl_->args.pdl = on ? 1 : 0; }

void EpBuffer::set_timeline(unsigned long long* stamps) { impl_->args.stamps = stamps; }

MaskedLayout EpBuffer::masked_layout() const {
  const EpConfig& c = impl_->config;
  return MaskedLayout{c.slots_per_rank(), c.max_m(), c.hidden};
}
ContiguousLayout EpBuffer::contiguous_layout() const {
  return ContiguousLayout{impl_->args.max_rows, impl_->config.hidden};
}
uint8_t* EpBuffer::recv_x() const { return impl_->args.recv_x; }
float* EpBuffer::recv_scales() const { return impl_->args.recv_scales; }
int32_t* EpBuffer::recv_count() const { return impl_->args.recv_count; }
int32_t* EpBuffer::recv_src() const { return impl_->args.recv_src; }
int32_t* EpBuffer::row_expert() const { return impl_->args.row_expert; }
int32_t* EpBuffer::recv_total_rows() const { return impl_->args.total_rows; }

// Waits for the stream. Where the exchange's kernels wait for peers without a deadline (NCCL's),
// a dead peer would block this wait forever: once timeout_s has passed, the exchange is aborted,
// its kernels return, and the receive kernel behind them times out on the missing inbox and
// records which peer sent nothing, so the error below names it (after about 2 x timeout_s).
static void wait_for_stream(EpBuffer::Impl& m, cudaStream_t stream) {
  if (!m.exchange || !m.exchange->needs_watchdog()) {
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(m.config.timeout_s);
  bool aborted = false;
  cudaError_t e;
  while ((e = cudaStreamQuery(stream)) == cudaErrorNotReady) {
    if (!aborted && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "moekit: EP rank %d: the stream has not finished %.1f s after check() began: aborting the "
                   "NCCL communicator (a peer is gone or stuck)\n", m.rank, m.config.timeout_s);
      m.exchange->abort();
      aborted = true;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  MOEKIT_CUDA_CHECK(e);
}

void EpBuffer::check(cudaStream_t stream) {
  Impl& m = *impl_;
  wait_for_stream(m, stream);
  EpStatusWord s{};
  MOEKIT_CUDA_CHECK(cudaMemcpy(&s, m.args.status, sizeof(s), cudaMemcpyDeviceToHost));
  if (s.kind == 0) return;
  MOEKIT_CUDA_CHECK(cudaMemset(m.args.status, 0, sizeof(s)));
  const char* phase = phase_name(s.phase);
  switch (EpErrorKind(s.kind)) {
    case EpErrorKind::kTimeout:
      MOEKIT_CHECK(s.phase != kPhaseCombineSend || s.peer != s.rank,
                   fmtr("EP rank {}: {} timed out after {} s at step {} waiting for the GEMM beside it to store the "
                        "rows of local expert {} (y_ready[{}] below {}: a GEMM not signalling into y_ready)", s.rank,
                        phase, m.config.timeout_s, s.step, s.index, s.index, s.value));
      MOEKIT_CHECK(s.phase != kPhaseDispatchSend || s.peer != s.rank,
                   fmtr("EP rank {}: {} timed out after {} s at step {} waiting for its CTA {} to publish its token "
                        "counts (a grid larger than the GPU holds at once)", s.rank, phase, m.config.timeout_s, s.step,
                        s.index));
      MOEKIT_CHECK(false, fmtr("EP rank {}: {} timed out after {} s waiting for rank {} at step {}", s.rank, phase,
                                      m.config.timeout_s, s.peer, s.step));
    case EpErrorKind::kBadSlot:
      MOEKIT_CHECK(false, fmtr("EP rank {}: {} at step {}: topk_idx[{}][{}] = {}, expected a slot in [0, {}) or -1 "
                                      "(the entry was skipped)", s.rank, phase, s.step, s.token, s.index, s.value,
                                      m.config.num_slots));
    case EpErrorKind::kDuplicateSlot:
      MOEKIT_CHECK(false, fmtr("EP rank {}: {} at step {}: topk_idx[{}][{}] = {} repeats an earlier slot of the "
                                      "token (the entry was skipped)", s.rank, phase, s.step, s.token, s.index, s.value));
    case EpErrorKind::kNotFinite:
      MOEKIT_CHECK(false, fmtr("EP rank {}: {} at step {}: token {} has a non-finite {} at index {}", s.rank, phase,
                                      s.step, s.token, s.value ? "x value" : "topk weight", s.index));
    case EpErrorKind::kCapacity:
      MOEKIT_CHECK(false, fmtr("EP rank {}: {} at step {}: the contiguous layout needs {} rows, the buffer has {} "
                                      "(raise max_recv_rows)", s.rank, phase, s.step, s.value, s.index));
    default:
      MOEKIT_CHECK(false, fmtr("EP rank {}: unknown fault kind {} in the status word", s.rank, s.kind));
  }
}

EpLocalGroup::EpLocalGroup(const EpConfig& config) {
  config.validate();
  const int P = config.num_ranks;
  const EpSizes z = ep_sizes(config);
  symmetric_.assign(P, nullptr);
  try {
    for (int r = 0; r < P; ++r) {
      MOEKIT_CUDA_CHECK(cudaMalloc(&symmetric_[r], z.symmetric_bytes));
      MOEKIT_CUDA_CHECK(cudaMemset(symmetric_[r], 0, z.symmetric_bytes));
    }
    for (int me = 0; me < P; ++me) {
      EpPeers peers;
      peers.symmetric = symmetric_[me];
      peers.symmetric_bytes = z.symmetric_bytes;
      for (int r = 0; r < P; ++r) {
        uint8_t* peer = static_cast<uint8_t*>(symmetric_[r]);
        // Rank r's inboxes for source `me`, parity 0 (the kernels add the parity offset).
        peers.peer_dispatch.push_back(peer + size_t(me) * z.dispatch_inbox_bytes);
        peers.peer_combine.push_back(peer + 2 * size_t(P) * z.dispatch_inbox_bytes + size_t(me) * z.combine_inbox_bytes);
      }
      ranks_.push_back(std::make_unique<EpBuffer>(config, me, EpTransport::kLocal, peers));
    }
  } catch (...) {
    ranks_.clear();
    for (void* p : symmetric_)
      if (p) cudaFree(p);
    throw;
  }
}

EpLocalGroup::~EpLocalGroup() {
  ranks_.clear();
  for (void* p : symmetric_)
    if (p) cudaFree(p);
}

EpBuffer& EpLocalGroup::rank(int r) {
  MOEKIT_CHECK(r >= 0 && r < num_ranks(), fmtr("EpLocalGroup: rank {} out of range 0..{}", r, num_ranks() - 1));
  return *ranks_[r];
}

int two_batch_num_ctas(int device) { return std::max(1, (query_device(device).num_sms - 16) / 2); }

}  // namespace moekit::gpu
