// In-process expert parallelism over threads (see include/moekit/ep_cpu.h for the protocol).
#include "moekit/ep_cpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/layout.h"
#include "moekit/quant.h"

namespace moekit {

namespace {

// Byte offsets inside one dispatch message: the payload first (it is what the receiver copies
// in bulk), then the routing, padded to 16 bytes so messages stay vector-aligned on the GPU.
struct MessageLayout {
  int k = 0, d = 0;
  size_t x() const { return 0; }
  size_t scales() const { return size_t(d); }
  size_t token() const { return scales() + 4 * size_t(d / kQuantBlock); }
  size_t idx() const { return token() + 4; }
  size_t weights() const { return idx() + 4 * size_t(k); }
  size_t bytes() const { return (weights() + 4 * size_t(k) + 15) / 16 * 16; }
};

int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

constexpr int kMaxRanks = 64;  // target sets are 64-bit masks

// The combine's map: one received message, its source, and the rows it was expanded into
// (rows [first, first + count) of the rank's row list, in top-k order).
struct CombineItem {
  int src = 0, token = 0, first = 0, count = 0;
};

}  // namespace

size_t EpConfig::message_bytes() const { return MessageLayout{topk, hidden}.bytes(); }

void validate_ep_config(const EpConfig& c) {
  MOEKIT_CHECK(c.num_ranks >= 1 && c.num_ranks <= kMaxRanks,
               fmt::format("EpConfig: num_ranks = {}, expected 1..{}", c.num_ranks, kMaxRanks));
  MOEKIT_CHECK(c.max_tokens >= 1, fmt::format("EpConfig: max_tokens (T_max) = {}, expected >= 1", c.max_tokens));
  MOEKIT_CHECK(c.hidden > 0 && c.hidden % kQuantBlock == 0,
               fmt::format("EpConfig: hidden (K) = {}, expected a positive multiple of {}", c.hidden, kQuantBlock));
  MOEKIT_CHECK(c.num_slots >= 1 && c.num_slots % c.num_ranks == 0,
               fmt::format("EpConfig: num_slots = {}, expected a positive multiple of num_ranks = {}", c.num_slots, c.num_ranks));
  MOEKIT_CHECK(c.topk >= 1 && c.topk <= c.num_slots,
               fmt::format("EpConfig: topk = {}, expected 1..num_slots = {}", c.topk, c.num_slots));
  MOEKIT_CHECK(c.block_m >= 1, fmt::format("EpConfig: block_m = {}, expected >= 1", c.block_m));
  MOEKIT_CHECK(c.timeout_s > 0, fmt::format("EpConfig: timeout_s = {}, expected > 0", c.timeout_s));
  MOEKIT_CHECK(c.x_scaling == Fp8Scaling::kPerBlock || c.x_scaling == Fp8Scaling::kPerToken,
               fmt::format("EpConfig: x_scaling = {}, expected kPerBlock (0) or kPerToken (1)", int(c.x_scaling)));
}

enum class LocalEpGroup::Phase { kIdle, kNotified, kSent, kReceived, kCombineSent };

namespace {
const char* phase_name(int p) {
  static const char* names[] = {"idle", "notified", "dispatch sent", "dispatch received", "combine sent"};
  return names[p];
}
}  // namespace

// One rank's buffers. Peers write into inbox[src] / combine_inbox[src] / counts[src] and then
// raise the matching flag; only the owner reads them, after acquiring the flag.
struct LocalEpGroup::Rank {
  explicit Rank(int num_ranks)
      : inbox(num_ranks),
        inbox_count(num_ranks, 0),
        counts(num_ranks),
        combine_inbox(num_ranks),
        dispatch_flag(new std::atomic<int64_t>[num_ranks]),
        count_flag(new std::atomic<int64_t>[num_ranks]),
        combine_flag(new std::atomic<int64_t>[num_ranks]) {
    for (int i = 0; i < num_ranks; ++i) dispatch_flag[i] = count_flag[i] = combine_flag[i] = 0;
  }

  // Written by peers.
  std::vector<std::vector<uint8_t>> inbox;          // [src] messages, in the sender's token order
  std::vector<int> inbox_count;                     // [src] messages in inbox[src] this step
  std::vector<std::vector<int>> counts;             // [src] normal mode: rows per local expert, then messages
  std::vector<std::vector<uint16_t>> combine_inbox;  // [peer] [T, d] bf16 partial sums
  std::unique_ptr<std::atomic<int64_t>[]> dispatch_flag, count_flag, combine_flag;  // [peer] = step

  // The owner's own state for the current step.
  int64_t step = 0;
  Phase phase = Phase::kIdle;
  bool normal = false;
  int num_tokens = 0;
  std::vector<uint64_t> targets;  // [T] ranks each token was sent to
  std::vector<int32_t> topk_idx;  // normal mode: kept from notify for the send
  ContiguousRecv contiguous;      // normal mode: the receive layout
  std::vector<CombineItem> items;
  std::vector<int64_t> item_rows;   // row in y
  std::vector<float> item_weights;  // topk_weights of that row
  EpStats stats;
};

LocalEpGroup::LocalEpGroup(const EpConfig& config) : config_(config) {
  validate_ep_config(config_);
  const int p = config_.num_ranks;
  for (int r = 0; r < p; ++r) {
    auto rank = std::make_unique<Rank>(p);
    // Buffers are fixed at set-up: T_max messages per source, T_max tokens per peer.
    for (int s = 0; s < p; ++s) {
      rank->inbox[s].resize(size_t(config_.max_tokens) * config_.message_bytes());
      rank->combine_inbox[s].resize(size_t(config_.max_tokens) * config_.hidden);
    }
    ranks_.push_back(std::move(rank));
  }
}

LocalEpGroup::~LocalEpGroup() = default;

void LocalEpGroup::check_rank(int rank) const {
  MOEKIT_CHECK(rank >= 0 && rank < config_.num_ranks,
               fmt::format("rank = {}, expected 0..{}", rank, config_.num_ranks - 1));
}

const EpStats& LocalEpGroup::stats(int rank) const {
  check_rank(rank);
  return ranks_[rank]->stats;
}

void LocalEpGroup::abort(int rank, const std::string& why) {
  int expected = -1;
  if (abort_rank_.compare_exchange_strong(expected, rank)) {
    abort_why_ = why;
    aborted_.store(true, std::memory_order_release);
  }
}

void LocalEpGroup::advance(Rank& me, Phase from, Phase to, const char* call) {
  MOEKIT_CHECK(me.phase == from, fmt::format("{}: called in phase '{}', expected phase '{}' (the step order is "
                                             "dispatch_send, dispatch_recv, combine_send, combine_recv)",
                                             call, phase_name(int(me.phase)), phase_name(int(from))));
  me.phase = to;
}

void LocalEpGroup::wait_flag(int rank, int peer, const std::atomic<int64_t>& flag, int64_t step, const char* what) const {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (uint64_t spin = 0;; ++spin) {
    if (flag.load(std::memory_order_acquire) >= step) return;
    if (aborted_.load(std::memory_order_acquire))
      throw Error(fmt::format("rank {}: stopped waiting for peer {} ({}, step {}): rank {} failed: {}", rank, peer, what,
                              step, abort_rank_.load(), abort_why_));
    if (spin % 256 == 0 &&
        std::chrono::duration<double>(Clock::now() - start).count() > config_.timeout_s)
      throw Error(fmt::format("rank {}: timed out after {} s waiting for peer {} ({}, step {})", rank, config_.timeout_s,
                              peer, what, step));
    std::this_thread::yield();
  }
}

void LocalEpGroup::check_payload(int rank, int num_tokens, const uint16_t* x, const float* topk_weights) const {
  const int k = config_.topk, d = config_.hidden;
  for (size_t i = 0; i < size_t(num_tokens) * k; ++i)
    MOEKIT_CHECK(std::isfinite(topk_weights[i]),
                 fmt::format("rank {}: topk_weights[{}, {}] = {} is not finite", rank, i / k, i % k, topk_weights[i]));
  for (size_t i = 0; i < size_t(num_tokens) * d; ++i)
    MOEKIT_CHECK(std::isfinite(bf16_to_float(x[i])),
                 fmt::format("rank {}: x[{}, {}] = {} is not finite", rank, i / d, i % d, bf16_to_float(x[i])));
}

void LocalEpGroup::check_tokens(int rank, int num_tokens, const int32_t* topk_idx) const {
  const int k = config_.topk;
  MOEKIT_CHECK(num_tokens >= 0, fmt::format("rank {}: num_tokens = {}, expected >= 0", rank, num_tokens));
  MOEKIT_CHECK(num_tokens <= config_.max_tokens,
               fmt::format("rank {}: {} tokens, more than T_max = {} (the receive buffers are sized for T_max)", rank,
                           num_tokens, config_.max_tokens));
  for (int t = 0; t < num_tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int32_t s = topk_idx[size_t(t) * k + j];
      MOEKIT_CHECK(s >= -1 && s < config_.num_slots,
                   fmt::format("rank {}: topk_idx[{}, {}] = {}, expected a physical slot in 0..{} or -1 (no expert)", rank,
                               t, j, s, config_.num_slots - 1));
      if (s == -1) continue;
      for (int i = 0; i < j; ++i)
        MOEKIT_CHECK(topk_idx[size_t(t) * k + i] != s,
                     fmt::format("rank {}: token {} picks slot {} twice (topk_idx[{}] and [{}])", rank, t, s, i, j));
    }
}

// Quantises each token once and writes one message per distinct target rank (see the header).
void LocalEpGroup::send_messages(int rank, int num_tokens, const uint16_t* x, const int32_t* topk_idx,
                                 const float* topk_weights) {
  const int k = config_.topk, d = config_.hidden, p = config_.num_ranks, spr = config_.slots_per_rank();
  const MessageLayout ml{k, d};
  Rank& me = *ranks_[rank];
  me.num_tokens = num_tokens;
  me.targets.assign(num_tokens, 0);
  me.stats = EpStats{};
  me.stats.num_tokens = num_tokens;
  std::vector<int> cursor(p, 0);
  for (int t = 0; t < num_tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int32_t s = topk_idx[size_t(t) * k + j];
      if (s >= 0) me.targets[t] |= uint64_t(1) << (s / spr);
    }
  std::vector<uint8_t> msg(ml.bytes());
  std::vector<float> row(d);
  for (int t = 0; t < num_tokens; ++t) {
    const int32_t src_token = t;
    std::memcpy(msg.data() + ml.token(), &src_token, 4);
    std::memcpy(msg.data() + ml.idx(), topk_idx + size_t(t) * k, 4 * size_t(k));
    std::memcpy(msg.data() + ml.weights(), topk_weights + size_t(t) * k, 4 * size_t(k));
    for (int c = 0; c < d; ++c) row[c] = bf16_to_float(x[size_t(t) * d + c]);
    std::vector<float> scales(d / kQuantBlock);
    quantize_row_fp8(row.data(), d, msg.data() + ml.x(), scales.data(), 1, config_.x_scaling);  // once per token
    std::memcpy(msg.data() + ml.scales(), scales.data(), 4 * scales.size());
    for (int dst = 0; dst < p; ++dst) {
      if (!((me.targets[t] >> dst) & 1)) continue;
      std::memcpy(ranks_[dst]->inbox[rank].data() + size_t(cursor[dst]) * ml.bytes(), msg.data(), ml.bytes());
      ++cursor[dst];
      me.stats.dispatch_messages += 1;
      me.stats.dispatch_bytes += int64_t(ml.bytes());
      if (dst != rank) me.stats.dispatch_bytes_remote += int64_t(ml.bytes());
    }
  }
  for (int dst = 0; dst < p; ++dst) {
    ranks_[dst]->inbox_count[rank] = cursor[dst];
    ranks_[dst]->dispatch_flag[rank].store(me.step, std::memory_order_release);
  }
}

void LocalEpGroup::dispatch_send(int rank, int num_tokens, const uint16_t* x, const int32_t* topk_idx,
                                 const float* topk_weights) {
  check_rank(rank);
  Rank& me = *ranks_[rank];
  check_tokens(rank, num_tokens, topk_idx);
  check_payload(rank, num_tokens, x, topk_weights);
  advance(me, Phase::kIdle, Phase::kSent, "dispatch_send");
  me.normal = false;
  ++me.step;
  send_messages(rank, num_tokens, x, topk_idx, topk_weights);
}

namespace {

// Walks the messages of every source in the canonical order (source rank, then the sender's
// token order) and, for each local expert a message carries (in top-k order), takes its row from
// row_of(e) and writes it with write(row, e, src, token, fp8 payload, scales); fills the combine
// map. Returns the number of messages read.
template <class RowOf, class Write>
int64_t expand(const EpConfig& c, int rank, const std::vector<std::vector<uint8_t>>& inbox, const std::vector<int>& inbox_count,
               RowOf row_of, Write write, std::vector<CombineItem>& items, std::vector<int64_t>& item_rows,
               std::vector<float>& item_weights) {
  items.clear();
  item_rows.clear();
  item_weights.clear();
  const MessageLayout ml{c.topk, c.hidden};
  const int spr = c.slots_per_rank();
  int64_t messages = 0;
  for (int src = 0; src < c.num_ranks; ++src)
    for (int i = 0; i < inbox_count[src]; ++i) {
      const uint8_t* msg = inbox[src].data() + size_t(i) * ml.bytes();
      const int token = load_i32(msg + ml.token());
      const int first = int(item_rows.size());
      for (int j = 0; j < c.topk; ++j) {
        const int slot = load_i32(msg + ml.idx() + 4 * j);
        if (slot < 0 || slot / spr != rank) continue;  // -1: no expert
        const int e = slot % spr;
        const int64_t row = row_of(e);
        write(row, e, src, token, msg + ml.x(), msg + ml.scales());
        item_rows.push_back(row);
        item_weights.push_back(load_f32(msg + ml.weights() + 4 * j));
      }
      items.push_back({src, token, first, int(item_rows.size()) - first});
      ++messages;
    }
  return messages;
}

}  // namespace

void LocalEpGroup::wait_dispatch(int rank) {
  Rank& me = *ranks_[rank];
  for (int src = 0; src < config_.num_ranks; ++src) wait_flag(rank, src, me.dispatch_flag[src], me.step, "dispatch");
}

void LocalEpGroup::dispatch_recv(int rank, uint8_t* recv_x, float* recv_scales, int32_t* recv_count, int32_t* recv_src) {
  check_rank(rank);
  Rank& me = *ranks_[rank];
  MOEKIT_CHECK(!me.normal || me.phase != Phase::kSent, "dispatch_recv: this step was started in normal mode");
  advance(me, Phase::kSent, Phase::kReceived, "dispatch_recv");
  wait_dispatch(rank);
  const MaskedLayout layout{config_.slots_per_rank(), config_.max_m(), config_.hidden};
  const int d = config_.hidden, kb = config_.k_blocks();
  std::fill(recv_count, recv_count + layout.num_experts, 0);
  me.stats.recv_messages = expand(
      config_, rank, me.inbox, me.inbox_count,
      [&](int e) { return int64_t(e) * layout.max_m + recv_count[e]++; },
      [&](int64_t row, int e, int src, int token, const uint8_t* q, const uint8_t* scales) {
        const int m = int(row - int64_t(e) * layout.max_m);
        std::memcpy(recv_x + layout.a_offset(e, m), q, d);
        for (int b = 0; b < kb; ++b) recv_scales[layout.scale_offset(e, m, b)] = load_f32(scales + 4 * b);
        recv_src[size_t(e) * layout.max_m + m] = src * config_.max_tokens + token;
      },
      me.items, me.item_rows, me.item_weights);
  me.stats.recv_rows = int64_t(me.item_rows.size());
}

void LocalEpGroup::send_combine(int rank, const uint16_t* y) {
  Rank& me = *ranks_[rank];
  const int d = config_.hidden;
  std::vector<float> acc(d);
  std::vector<bool> sent_to(config_.num_ranks, false);
  for (const auto& item : me.items) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int r = item.first; r < item.first + item.count; ++r) {
      const uint16_t* yr = y + size_t(me.item_rows[r]) * d;
      const float w = me.item_weights[r];
      for (int c = 0; c < d; ++c) acc[c] += w * bf16_to_float(yr[c]);
    }
    uint16_t* dst = ranks_[item.src]->combine_inbox[rank].data() + size_t(item.token) * d;
    for (int c = 0; c < d; ++c) dst[c] = float_to_bf16(acc[c]);
    me.stats.combine_bytes += 2 * int64_t(d);
    if (item.src != rank) me.stats.combine_bytes_remote += 2 * int64_t(d);
  }
  for (int src = 0; src < config_.num_ranks; ++src)
    ranks_[src]->combine_flag[rank].store(me.step, std::memory_order_release);
}

void LocalEpGroup::combine_send(int rank, const uint16_t* y) {
  check_rank(rank);
  Rank& me = *ranks_[rank];
  MOEKIT_CHECK(!me.normal, "combine_send: this step runs in normal mode, call normal_combine_send");
  advance(me, Phase::kReceived, Phase::kCombineSent, "combine_send");
  send_combine(rank, y);
}

void LocalEpGroup::combine_recv(int rank, const uint16_t* add, uint16_t* out) {
  check_rank(rank);
  Rank& me = *ranks_[rank];
  advance(me, Phase::kCombineSent, Phase::kIdle, "combine_recv");
  for (int peer = 0; peer < config_.num_ranks; ++peer) wait_flag(rank, peer, me.combine_flag[peer], me.step, "combine");
  const int d = config_.hidden;
  for (int t = 0; t < me.num_tokens; ++t)
    for (int c = 0; c < d; ++c) {
      float acc = add ? bf16_to_float(add[size_t(t) * d + c]) : 0.0f;
      for (int r = 0; r < config_.num_ranks; ++r)
        if ((me.targets[t] >> r) & 1) acc += bf16_to_float(me.combine_inbox[r][size_t(t) * d + c]);
      out[size_t(t) * d + c] = float_to_bf16(acc);
    }
}

ContiguousRecv LocalEpGroup::normal_notify(int rank, int num_tokens, const int32_t* topk_idx) {
  check_rank(rank);
  Rank& me = *ranks_[rank];
  check_tokens(rank, num_tokens, topk_idx);
  advance(me, Phase::kIdle, Phase::kNotified, "normal_notify");
  me.normal = true;
  ++me.step;
  const int p = config_.num_ranks, k = config_.topk, spr = config_.slots_per_rank();
  me.num_tokens = num_tokens;
  me.topk_idx.assign(topk_idx, topk_idx + size_t(num_tokens) * k);
  // counts[dst] = rows for each of dst's local experts, then the number of messages.
  std::vector<std::vector<int>> counts(p, std::vector<int>(spr + 1, 0));
  for (int t = 0; t < num_tokens; ++t) {
    uint64_t mask = 0;
    for (int j = 0; j < k; ++j) {
      const int s = topk_idx[size_t(t) * k + j];
      if (s < 0) continue;  // no expert
      counts[s / spr][s % spr] += 1;
      mask |= uint64_t(1) << (s / spr);
    }
    for (int dst = 0; dst < p; ++dst) counts[dst][spr] += int((mask >> dst) & 1);
  }
  for (int dst = 0; dst < p; ++dst) {
    ranks_[dst]->counts[rank] = counts[dst];
    ranks_[dst]->count_flag[rank].store(me.step, std::memory_order_release);
  }
  for (int src = 0; src < p; ++src) wait_flag(rank, src, me.count_flag[src], me.step, "counts");
  ContiguousRecv recv;
  recv.expert_rows.assign(spr, 0);
  recv.segment_begin.assign(spr, 0);
  for (int src = 0; src < p; ++src)
    for (int e = 0; e < spr; ++e) recv.expert_rows[e] += me.counts[src][e];
  for (int e = 0; e < spr; ++e) {
    recv.segment_begin[e] = recv.total_m;
    const int bm = config_.block_m;
    recv.total_m += (recv.expert_rows[e] + bm - 1) / bm * bm;
  }
  me.contiguous = recv;
  return recv;
}

void LocalEpGroup::normal_dispatch_send(int rank, const uint16_t* x, const float* topk_weights) {
  check_rank(rank);
  Rank& me = *ranks_[rank];
  check_payload(rank, me.num_tokens, x, topk_weights);
  advance(me, Phase::kNotified, Phase::kSent, "normal_dispatch_send");
  send_messages(rank, me.num_tokens, x, me.topk_idx.data(), topk_weights);
}

void LocalEpGroup::normal_dispatch_recv(int rank, uint8_t* recv_x, float* recv_scales, int32_t* row_expert, int32_t* recv_src) {
  check_rank(rank);
  Rank& me = *ranks_[rank];
  MOEKIT_CHECK(me.normal || me.phase != Phase::kSent, "normal_dispatch_recv: this step was started in low-latency mode");
  advance(me, Phase::kSent, Phase::kReceived, "normal_dispatch_recv");
  wait_dispatch(rank);
  const ContiguousRecv& cr = me.contiguous;
  const ContiguousLayout layout{cr.total_m, config_.hidden};
  const int d = config_.hidden, kb = config_.k_blocks();
  // Padding rows first: zero payload, expert -1, no source.
  std::fill(row_expert, row_expert + cr.total_m, -1);
  std::fill(recv_src, recv_src + cr.total_m, -1);
  std::fill(recv_x, recv_x + layout.a_elems(), uint8_t(0));
  std::fill(recv_scales, recv_scales + layout.scale_elems(), 0.0f);
  std::vector<int> cursor(cr.expert_rows.size(), 0);
  me.stats.recv_messages = expand(
      config_, rank, me.inbox, me.inbox_count, [&](int e) { return int64_t(cr.segment_begin[e]) + cursor[e]++; },
      [&](int64_t row, int e, int src, int token, const uint8_t* q, const uint8_t* scales) {
        std::memcpy(recv_x + layout.a_offset(int(row)), q, d);
        for (int b = 0; b < kb; ++b) recv_scales[layout.scale_offset(int(row), b)] = load_f32(scales + 4 * b);
        row_expert[row] = e;
        recv_src[row] = src * config_.max_tokens + token;
      },
      me.items, me.item_rows, me.item_weights);
  for (size_t e = 0; e < cursor.size(); ++e)
    MOEKIT_CHECK(cursor[e] == cr.expert_rows[e], fmt::format("rank {}: local expert {} received {} rows, the counts said {}",
                                                             rank, e, cursor[e], cr.expert_rows[e]));
  me.stats.recv_rows = int64_t(me.item_rows.size());
}

void LocalEpGroup::normal_combine_send(int rank, const uint16_t* y) {
  check_rank(rank);
  Rank& me = *ranks_[rank];
  MOEKIT_CHECK(me.normal, "normal_combine_send: this step runs in low-latency mode, call combine_send");
  advance(me, Phase::kReceived, Phase::kCombineSent, "normal_combine_send");
  send_combine(rank, y);
}

void run_ranks(LocalEpGroup& group, const std::function<void(int rank)>& fn) {
  const int p = group.config().num_ranks;
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(p);
  for (int r = 0; r < p; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) first = std::current_exception();
        }
        group.abort(r, e.what());
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace moekit
