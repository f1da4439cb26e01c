// EpConfig's checks and byte sizes (include/moekit/ep.h), the memory report, the host-side check
// of a topk_idx, and the layout of a rank's private allocation (ep_state.cuh), which the buffer
// (ep_buffer.cu) carves up. Host code only; no CUDA call.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "ep_format.h"
#include "ep_state.cuh"
#include "moekit/check.h"
#include "moekit/ep.h"

namespace moekit::gpu {

const char* ep_mode_name(EpMode mode) { return mode == EpMode::kLowLatency ? "low-latency" : "normal"; }

const char* ep_transport_name(EpTransport transport) {
  switch (transport) {
    case EpTransport::kLocal: return "local";
    case EpTransport::kNvlink: return "nvlink";
    case EpTransport::kNccl: return "nccl";
  }
  return "?";
}

namespace {

constexpr int kMaxTokens = 32768;   // row positions travel in 16 bits
constexpr int kMaxSlots = 8192;     // per-slot counters live in shared memory

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

std::string mib(size_t bytes) { return fmtr("{:.1f} MiB", double(bytes) / (1024.0 * 1024.0)); }

}  // namespace

PrivateLayout private_layout(const EpConfig& c) {
  PrivateLayout l{};
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t off = at;
    at += align256(bytes);
    return off;
  };
  const size_t P = size_t(c.num_ranks), T = size_t(c.max_tokens), k = size_t(c.topk), E = size_t(c.slots_per_rank());
  l.counters = take(sizeof(EpCounters));
  l.status = take(sizeof(EpStatusWord));
  l.route_ranks = take(4 * T * k);
  l.send_msgs = take(4 * P);
  l.recv_msgs = take(4 * P);
  l.map_token = take(4 * P * T);
  l.map_rows = take(4 * P * T * k);
  l.map_w = take(4 * P * T * k);
  // The send's per-CTA counts (dispatch_send.cu): room for the buffer's grid, or for any SM count
  // up to kDefaultCountCtas when the grid is the device's (num_ctas = 0); one more row and flag for
  // the step's totals, which one rank's send in normal mode publishes (send_count.cuh).
  constexpr int kDefaultCountCtas = 512;
  l.count_ctas = c.num_ctas > 0 ? c.num_ctas : kDefaultCountCtas;
  l.cta_counts = take(4 * (size_t(l.count_ctas) + 1) * (size_t(c.num_slots) + P));
  l.cta_flags = take(4 * (size_t(l.count_ctas) + 1));
  l.state_bytes = at;
  const size_t d = size_t(c.hidden), kb = size_t(c.k_blocks());
  if (c.mode == EpMode::kLowLatency) {
    const size_t slabs = E + (c.self_slab ? 1 : 0);  // the self slab: the rank's own tokens
    const size_t rows = slabs * size_t(c.max_m());
    l.recv_x = take(rows * d);
    l.recv_scales = take(4 * rows * kb);
    l.recv_count = take(4 * slabs);
    l.recv_src = take(4 * rows);
    l.row_expert = l.total_rows = 0;
  } else {
    const size_t rows = size_t(c.contiguous_rows());
    l.recv_x = take(rows * d);
    l.recv_scales = take(4 * rows * kb);
    l.recv_count = take(4 * E);
    l.recv_src = take(4 * rows);
    l.row_expert = take(4 * rows);
    l.total_rows = take(4);
  }
  l.total = at;
  l.output_bytes = l.total - l.state_bytes;
  return l;
}

EpSizes ep_sizes(const EpConfig& c) {
  EpSizes z{};
  const size_t d = size_t(c.hidden), k = size_t(c.topk);
  z.msg_scale_off = d;
  z.msg_meta_off = d + 4 * size_t(c.k_blocks());
  z.msg_bytes = align16(z.msg_meta_off + 4 + 8 * k);
  z.dispatch_header_bytes = kEpFlagBytes + align16(4 * size_t(c.slots_per_rank()));
  z.dispatch_inbox_bytes = z.dispatch_header_bytes + size_t(c.max_tokens) * z.msg_bytes;
  z.combine_inbox_bytes = kEpFlagBytes + size_t(c.max_tokens) * 2 * d;
  z.symmetric_bytes = 2 * size_t(c.num_ranks) * (z.dispatch_inbox_bytes + z.combine_inbox_bytes);
  return z;
}

int64_t EpConfig::worst_case_rows() const {
  const int64_t per_token = std::min(topk, slots_per_rank());
  return int64_t(max_m()) * per_token + int64_t(slots_per_rank()) * (block_m - 1);
}

int EpConfig::contiguous_rows() const {
  // The contiguous GEMM wants M_total a multiple of its block: round to a multiple of 128 and of block_m.
  const int64_t unit = std::lcm(int64_t(kQuantBlock), int64_t(std::max(block_m, 1)));
  const int64_t rows = max_recv_rows > 0 ? max_recv_rows : worst_case_rows();
  return int((rows + unit - 1) / unit * unit);
}

size_t EpConfig::message_bytes() const { return ep_sizes(*this).msg_bytes; }

void EpConfig::validate() const {
  MOEKIT_CHECK(num_ranks >= 1 && num_ranks <= kEpMaxRanks,
               fmtr("EpConfig: num_ranks = {}, expected 1..{}", num_ranks, kEpMaxRanks));
  MOEKIT_CHECK(max_tokens >= 1 && max_tokens <= kMaxTokens,
               fmtr("EpConfig: max_tokens (T_max) = {}, expected 1..{}", max_tokens, kMaxTokens));
  MOEKIT_CHECK(hidden > 0 && hidden % kQuantBlock == 0 && hidden <= (1 << 20),
               fmtr("EpConfig: hidden (d) = {}, expected a positive multiple of {} up to {}", hidden, kQuantBlock,
                    1 << 20));
  MOEKIT_CHECK(num_slots >= 1 && num_slots <= kMaxSlots && num_slots % num_ranks == 0,
               fmtr("EpConfig: num_slots = {}, expected a multiple of num_ranks = {} in 1..{}", num_slots,
                           num_ranks, kMaxSlots));
  MOEKIT_CHECK(topk >= 1 && topk <= std::min(kEpMaxTopk, num_slots),
               fmtr("EpConfig: topk = {}, expected 1..{}", topk, std::min(kEpMaxTopk, num_slots)));
  MOEKIT_CHECK(int64_t(num_ranks) * max_tokens <= (1 << 24),
               fmtr("EpConfig: M_max = num_ranks * max_tokens = {} is too large (at most 2^24)",
                           int64_t(num_ranks) * max_tokens));
  MOEKIT_CHECK(block_m >= 1 && block_m <= 4096, fmtr("EpConfig: block_m = {}, expected 1..4096", block_m));
  MOEKIT_CHECK(max_recv_rows >= 0, fmtr("EpConfig: max_recv_rows = {}, expected >= 0 (0: worst case)", max_recv_rows));
  MOEKIT_CHECK(mode == EpMode::kLowLatency || worst_case_rows() <= (int64_t(1) << 30),
               fmtr("EpConfig: normal mode worst case of {} rows is too large; set max_recv_rows", worst_case_rows()));
  MOEKIT_CHECK(std::isfinite(timeout_s) && timeout_s > 0 && timeout_s <= 3600,
               fmtr("EpConfig: timeout_s = {}, expected in (0, 3600]", timeout_s));
  MOEKIT_CHECK(num_ctas >= 0 && num_ctas <= 65535, fmtr("EpConfig: num_ctas = {}, expected 0..65535", num_ctas));
  MOEKIT_CHECK(x_scaling == Fp8Scaling::kPerBlock || x_scaling == Fp8Scaling::kPerToken,
               fmtr("EpConfig: x_scaling = {}, expected kPerBlock (0) or kPerToken (1)", int(x_scaling)));
  MOEKIT_CHECK(!self_slab || mode == EpMode::kLowLatency,
               "EpConfig: self_slab is a low-latency (masked layout) option; this config is normal mode");
}

std::string EpMemory::describe() const {
  return fmtr("symmetric {} + outputs {} + state {} = {} per rank", mib(symmetric_bytes), mib(output_bytes),
                     mib(state_bytes), mib(total()));
}

EpMemory ep_memory(const EpConfig& config) {
  config.validate();
  const PrivateLayout l = private_layout(config);
  EpMemory m;
  m.symmetric_bytes = ep_sizes(config).symmetric_bytes;
  m.output_bytes = l.output_bytes;
  m.state_bytes = l.state_bytes;
  return m;
}

void validate_topk_idx(const EpConfig& config, const int32_t* topk_idx_host, int num_tokens) {
  config.validate();
  MOEKIT_CHECK(num_tokens >= 0 && num_tokens <= config.max_tokens,
               fmtr("num_tokens = {}, expected 0..T_max = {}", num_tokens, config.max_tokens));
  const int k = config.topk;
  for (int t = 0; t < num_tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int v = topk_idx_host[size_t(t) * k + j];
      MOEKIT_CHECK(v >= -1 && v < config.num_slots,
                   fmtr("topk_idx[{}][{}] = {}, expected a slot in [0, {}) or -1", t, j, v, config.num_slots));
      for (int i = 0; i < j; ++i)
        MOEKIT_CHECK(v == -1 || topk_idx_host[size_t(t) * k + i] != v,
                     fmtr("topk_idx[{}][{}] = {} repeats entry {} of the same token", t, j, v, i));
    }
}

}  // namespace moekit::gpu
