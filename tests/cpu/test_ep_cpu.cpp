// In-process dispatch/combine (ep_cpu.h): every token-expert pair delivered exactly once, in the
// canonical order, with the payload the sender quantised; combine sums exactly; P ranks move the
// same FP8 bytes as one rank; bad input is rejected before anything moves; a silent peer times out.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "expect_error.h"
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/ep_cpu.h"
#include "moekit/fp8.h"
#include "moekit/layout.h"
#include "moekit/quant.h"

using namespace moekit;

namespace {

// One rank's input: T tokens whose first quantisation block encodes (source rank, token):
// x[0] = 448 fixes the block's scale to exactly 1, so x[1] = rank, x[2] = t % 16, x[3] = t / 16
// (integers <= 16, exact in e4m3) survive quantisation and can be read back from the payload.
struct RankInput {
  int num_tokens = 0;
  std::vector<uint16_t> x;
  std::vector<int32_t> topk_idx;
  std::vector<float> topk_weights;
};

std::vector<RankInput> make_inputs(const EpConfig& c, uint32_t seed, bool full = false) {
  std::mt19937 rng(seed);
  std::vector<RankInput> in(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    RankInput& ri = in[r];
    ri.num_tokens = full ? c.max_tokens : int(rng() % (c.max_tokens + 1));
    if (r == 1) ri.num_tokens = 0;  // a rank with no tokens still takes part
    ri.x.resize(size_t(ri.num_tokens) * c.hidden);
    std::uniform_real_distribution<float> val(-3.0f, 3.0f);
    for (int t = 0; t < ri.num_tokens; ++t) {
      uint16_t* row = ri.x.data() + size_t(t) * c.hidden;
      for (int i = 0; i < c.hidden; ++i) row[i] = float_to_bf16(val(rng));
      row[0] = float_to_bf16(448.0f);
      row[1] = float_to_bf16(float(r));
      row[2] = float_to_bf16(float(t % 16));
      row[3] = float_to_bf16(float(t / 16));
      std::vector<int> slots(c.num_slots);
      for (int s = 0; s < c.num_slots; ++s) slots[s] = s;
      std::shuffle(slots.begin(), slots.end(), rng);
      for (int j = 0; j < c.topk; ++j) {
        // -1 = no expert: the last entry of every fifth token, every entry of rank 0's token 3.
        const bool none = (t % 5 == 4 && j == c.topk - 1) || (r == 0 && t == 3);
        ri.topk_idx.push_back(none ? -1 : slots[j]);
        ri.topk_weights.push_back(std::ldexp(1.0f, -int(rng() % 3)));  // 1, 1/2, 1/4: sums stay exact
      }
    }
  }
  return in;
}

// The source (rank, token) read back from a received FP8 row.
std::pair<int, int> decode_source(const uint8_t* q, float scale0) {
  auto v = [&](int i) { return int(std::lround(fp8_e4m3_to_float(q[i]) * scale0)); };
  return {v(1), v(2) + 16 * v(3)};
}

// Expert outputs chosen so every sum is exact in fp32 and bf16: y(slot, c) = slot % 8 + c % 4.
float y_value(int slot, int c) { return float(slot % 8 + c % 4); }
float add_value(int c) { return float(c % 3); }

struct Received {
  std::vector<uint8_t> x;
  std::vector<float> scales;
  std::vector<int32_t> count, src, row_expert;
  ContiguousRecv contiguous;
  std::vector<uint16_t> out;
};

// Runs one low-latency step on every rank; y is filled from y_value by slot.
std::vector<Received> run_low_latency(LocalEpGroup& group, const std::vector<RankInput>& in) {
  const EpConfig& c = group.config();
  const MaskedLayout layout{c.slots_per_rank(), c.max_m(), c.hidden};
  std::vector<Received> rx(c.num_ranks);
  run_ranks(group, [&](int r) {
    Received& me = rx[r];
    me.x.assign(layout.a_elems(), 0);
    me.scales.assign(layout.scale_elems(), 0.0f);
    me.count.assign(layout.num_experts, -1);
    me.src.assign(size_t(layout.num_experts) * layout.max_m, -1);
    group.dispatch_send(r, in[r].num_tokens, in[r].x.data(), in[r].topk_idx.data(), in[r].topk_weights.data());
    group.dispatch_recv(r, me.x.data(), me.scales.data(), me.count.data(), me.src.data());
    std::vector<uint16_t> y(layout.out_elems(c.hidden), 0xFFFF);  // NaN past recv_count: must not be read
    for (int e = 0; e < layout.num_experts; ++e)
      for (int m = 0; m < me.count[e]; ++m)
        for (int col = 0; col < c.hidden; ++col)
          y[layout.out_offset(e, m, c.hidden) + col] = float_to_bf16(y_value(r * c.slots_per_rank() + e, col));
    group.combine_send(r, y.data());
    std::vector<uint16_t> add(size_t(in[r].num_tokens) * c.hidden);
    for (size_t i = 0; i < add.size(); ++i) add[i] = float_to_bf16(add_value(int(i % c.hidden)));
    me.out.assign(add.size(), 0);
    group.combine_recv(r, add.data(), me.out.data());
  });
  return rx;
}

std::vector<Received> run_normal(LocalEpGroup& group, const std::vector<RankInput>& in) {
  const EpConfig& c = group.config();
  std::vector<Received> rx(c.num_ranks);
  run_ranks(group, [&](int r) {
    Received& me = rx[r];
    me.contiguous = group.normal_notify(r, in[r].num_tokens, in[r].topk_idx.data());
    const ContiguousLayout layout{me.contiguous.total_m, c.hidden};
    me.x.assign(layout.a_elems(), 0xAA);
    me.scales.assign(layout.scale_elems(), -1.0f);
    me.row_expert.assign(layout.total_m, 7);
    me.src.assign(layout.total_m, 7);
    group.normal_dispatch_send(r, in[r].x.data(), in[r].topk_weights.data());
    group.normal_dispatch_recv(r, me.x.data(), me.scales.data(), me.row_expert.data(), me.src.data());
    std::vector<uint16_t> y(size_t(layout.total_m) * c.hidden, 0xFFFF);
    for (int m = 0; m < layout.total_m; ++m)
      if (me.row_expert[m] >= 0)
        for (int col = 0; col < c.hidden; ++col)
          y[size_t(m) * c.hidden + col] = float_to_bf16(y_value(r * c.slots_per_rank() + me.row_expert[m], col));
    group.normal_combine_send(r, y.data());
    std::vector<uint16_t> add(size_t(in[r].num_tokens) * c.hidden);
    for (size_t i = 0; i < add.size(); ++i) add[i] = float_to_bf16(add_value(int(i % c.hidden)));
    me.out.assign(add.size(), 0);
    group.combine_recv(r, add.data(), me.out.data());
  });
  return rx;
}

// The quantised row the sender must have produced, computed here independently.
void quantise_token(const EpConfig& c, const RankInput& ri, int t, std::vector<uint8_t>& q, std::vector<float>& s) {
  std::vector<float> row(c.hidden);
  for (int i = 0; i < c.hidden; ++i) row[i] = bf16_to_float(ri.x[size_t(t) * c.hidden + i]);
  q.resize(c.hidden);
  s.resize(c.k_blocks());
  quantize_row_fp8(row.data(), c.hidden, q.data(), s.data(), 1);
}

// Checks one received row against the sender's token and records the pair (src, token, slot).
void check_row(const EpConfig& c, const std::vector<RankInput>& in, int rank, int e, const uint8_t* q,
               const std::vector<float>& scales, int32_t src_code, std::set<std::tuple<int, int, int>>& seen) {
  const int src = src_code / c.max_tokens, token = src_code % c.max_tokens;
  ASSERT_GE(src, 0);
  ASSERT_LT(src, c.num_ranks);
  ASSERT_LT(token, in[src].num_tokens);
  auto [dec_src, dec_token] = decode_source(q, scales[0]);
  EXPECT_EQ(dec_src, src) << "payload names another source rank than recv_src";
  EXPECT_EQ(dec_token, token) << "payload names another token than recv_src";
  std::vector<uint8_t> want_q;
  std::vector<float> want_s;
  quantise_token(c, in[src], token, want_q, want_s);
  EXPECT_EQ(std::memcmp(q, want_q.data(), c.hidden), 0) << "payload bytes differ from the sender's quantisation";
  EXPECT_EQ(scales, want_s);
  const int slot = rank * c.slots_per_rank() + e;
  bool picked = false;
  for (int j = 0; j < c.topk; ++j) picked |= in[src].topk_idx[size_t(token) * c.topk + j] == slot;
  EXPECT_TRUE(picked) << "token " << token << " of rank " << src << " did not pick slot " << slot;
  EXPECT_TRUE(seen.insert({src, token, slot}).second) << "pair delivered twice";
}

// Token-expert pairs in the inputs (-1 entries are no pair).
size_t total_pairs(const std::vector<RankInput>& in) {
  size_t n = 0;
  for (const auto& ri : in) n += size_t(std::count_if(ri.topk_idx.begin(), ri.topk_idx.end(), [](int32_t s) { return s >= 0; }));
  return n;
}

// Combine expectation: add + sum_j w_j * y(slot_j), exact by construction.
void check_combine(const EpConfig& c, const std::vector<RankInput>& in, const std::vector<Received>& rx) {
  for (int r = 0; r < c.num_ranks; ++r)
    for (int t = 0; t < in[r].num_tokens; ++t)
      for (int col = 0; col < c.hidden; ++col) {
        double want = add_value(col);
        for (int j = 0; j < c.topk; ++j) {
          const int32_t slot = in[r].topk_idx[size_t(t) * c.topk + j];
          if (slot >= 0) want += double(in[r].topk_weights[size_t(t) * c.topk + j]) * y_value(slot, col);
        }
        ASSERT_EQ(double(bf16_to_float(rx[r].out[size_t(t) * c.hidden + col])), want) << "rank " << r << " token " << t;
      }
}

EpConfig config(int p, int slots, int topk = 4) {
  EpConfig c;
  c.num_ranks = p;
  c.max_tokens = 12;
  c.hidden = 256;
  c.topk = topk;
  c.num_slots = slots;
  c.block_m = 8;
  c.timeout_s = 20;
  return c;
}

}  // namespace

class EpRanks : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(EpRanks, LowLatencyDeliversEveryPairOnceInCanonicalOrder) {
  auto [p, slots] = GetParam();
  const EpConfig c = config(p, slots);
  LocalEpGroup group(c);
  for (uint32_t step = 0; step < 2; ++step) {  // two steps: the buffers and flags are reused
    const auto in = make_inputs(c, 100 * p + slots + step);
    const auto rx = run_low_latency(group, in);
    const MaskedLayout layout{c.slots_per_rank(), c.max_m(), c.hidden};
    std::set<std::tuple<int, int, int>> seen;
    for (int r = 0; r < p; ++r)
      for (int e = 0; e < layout.num_experts; ++e) {
        // recv_count from the inputs, counted independently.
        int want = 0;
        for (const auto& ri : in)
          for (int32_t s : ri.topk_idx) want += s == r * c.slots_per_rank() + e;
        ASSERT_EQ(rx[r].count[e], want) << "rank " << r << " expert " << e;
        for (int m = 0; m < want; ++m) {
          std::vector<float> scales(c.k_blocks());
          for (int b = 0; b < c.k_blocks(); ++b) scales[b] = rx[r].scales[layout.scale_offset(e, m, b)];
          const int32_t code = rx[r].src[size_t(e) * layout.max_m + m];
          check_row(c, in, r, e, rx[r].x.data() + layout.a_offset(e, m), scales, code, seen);
          if (m > 0) {
            EXPECT_LT(rx[r].src[size_t(e) * layout.max_m + m - 1], code) << "rows not in (rank, token) order";
          }
        }
        for (int m = want; m < layout.max_m; ++m)
          ASSERT_EQ(rx[r].src[size_t(e) * layout.max_m + m], -1) << "row past recv_count written";
      }
    EXPECT_EQ(seen.size(), total_pairs(in));
    check_combine(c, in, rx);
    // Distinct target ranks, counted here from topk_idx.
    for (int r = 0; r < p; ++r) {
      int64_t distinct = 0;
      for (int t = 0; t < in[r].num_tokens; ++t) {
        std::set<int> ranks;
        for (int j = 0; j < c.topk; ++j) {
          const int32_t slot = in[r].topk_idx[size_t(t) * c.topk + j];
          if (slot >= 0) ranks.insert(slot / c.slots_per_rank());
        }
        distinct += int64_t(ranks.size());
      }
      const EpStats& st = group.stats(r);
      EXPECT_EQ(st.dispatch_messages, distinct);
      EXPECT_EQ(st.dispatch_bytes, distinct * int64_t(c.message_bytes()));
      EXPECT_EQ(c.message_bytes(), 304u);  // 256 fp8 + 2 scales + token + 4 slots + 4 weights = 300, padded to 16
    }
  }
}

TEST_P(EpRanks, NormalModeFillsTheContiguousLayout) {
  auto [p, slots] = GetParam();
  const EpConfig c = config(p, slots);
  LocalEpGroup group(c);
  for (uint32_t step = 0; step < 2; ++step) {
    const auto in = make_inputs(c, 7 * p + slots + step);
    const auto rx = run_normal(group, in);
    std::set<std::tuple<int, int, int>> seen;
    for (int r = 0; r < p; ++r) {
      const ContiguousRecv& cr = rx[r].contiguous;
      const ContiguousLayout layout{cr.total_m, c.hidden};
      int begin = 0;
      for (int e = 0; e < c.slots_per_rank(); ++e) {
        int want = 0;
        for (const auto& ri : in)
          for (int32_t s : ri.topk_idx) want += s == r * c.slots_per_rank() + e;
        ASSERT_EQ(cr.expert_rows[e], want);
        ASSERT_EQ(cr.segment_begin[e], begin);
        const int padded = (want + c.block_m - 1) / c.block_m * c.block_m;
        for (int m = begin; m < begin + padded; ++m) {
          if (m >= begin + want) {
            EXPECT_EQ(rx[r].row_expert[m], -1) << "padding row";
            EXPECT_EQ(rx[r].src[m], -1);
            continue;
          }
          ASSERT_EQ(rx[r].row_expert[m], e);
          std::vector<float> scales(c.k_blocks());
          for (int b = 0; b < c.k_blocks(); ++b) scales[b] = rx[r].scales[layout.scale_offset(m, b)];
          check_row(c, in, r, e, rx[r].x.data() + layout.a_offset(m), scales, rx[r].src[m], seen);
          if (m > begin) {
            EXPECT_LT(rx[r].src[m - 1], rx[r].src[m]);
          }
        }
        begin += padded;
      }
      EXPECT_EQ(cr.total_m, begin);
    }
    EXPECT_EQ(seen.size(), total_pairs(in));
    check_combine(c, in, rx);
  }
}

// P in {1, 2, 4, 8}; 16 slots (no redundancy) or 24 (8 redundant slots, 3 per rank at P = 8).
INSTANTIATE_TEST_SUITE_P(Ranks, EpRanks,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Values(16, 24)));

// The FP8 bytes of every (token, slot) row are the same whether the tokens sit on P ranks or one.
TEST(Ep, PRanksMoveTheSameBytesAsOneRank) {
  const int p = 4;
  EpConfig cp = config(p, 16);
  const auto in = make_inputs(cp, 99, /*full=*/true);
  // The same tokens on one rank, in the same global order.
  EpConfig c1 = cp;
  c1.num_ranks = 1;
  c1.max_tokens = p * cp.max_tokens;
  RankInput all;
  for (const auto& ri : in) {
    all.num_tokens += ri.num_tokens;
    all.x.insert(all.x.end(), ri.x.begin(), ri.x.end());
    all.topk_idx.insert(all.topk_idx.end(), ri.topk_idx.begin(), ri.topk_idx.end());
    all.topk_weights.insert(all.topk_weights.end(), ri.topk_weights.begin(), ri.topk_weights.end());
  }
  LocalEpGroup gp(cp), g1(c1);
  const auto rp = run_low_latency(gp, in);
  const auto r1 = run_low_latency(g1, {all});
  // (global token, slot) -> bytes of the row and its scales.
  using Rows = std::map<std::pair<int, int>, std::vector<uint8_t>>;
  std::vector<int> first_token(p, 0);  // global index of each rank's token 0
  for (int r = 1; r < p; ++r) first_token[r] = first_token[r - 1] + in[r - 1].num_tokens;
  auto collect = [](const EpConfig& c, const std::vector<Received>& rx, const std::vector<int>& first) {
    Rows rows;
    const MaskedLayout layout{c.slots_per_rank(), c.max_m(), c.hidden};
    for (int r = 0; r < c.num_ranks; ++r)
      for (int e = 0; e < layout.num_experts; ++e)
        for (int m = 0; m < rx[r].count[e]; ++m) {
          const int code = rx[r].src[size_t(e) * layout.max_m + m];
          const int global = first[code / c.max_tokens] + code % c.max_tokens;
          std::vector<uint8_t> bytes(rx[r].x.begin() + layout.a_offset(e, m), rx[r].x.begin() + layout.a_offset(e, m) + c.hidden);
          for (int b = 0; b < c.k_blocks(); ++b) {
            const float s = rx[r].scales[layout.scale_offset(e, m, b)];
            const uint8_t* sb = reinterpret_cast<const uint8_t*>(&s);
            bytes.insert(bytes.end(), sb, sb + 4);
          }
          rows[{global, r * c.slots_per_rank() + e}] = bytes;
        }
    return rows;
  };
  const Rows a = collect(cp, rp, first_token), b = collect(c1, r1, {0});
  EXPECT_EQ(a.size(), total_pairs({all}));
  EXPECT_TRUE(a == b);
  // The outputs agree too: the partial sums here are exact, so rank splitting cannot change them.
  for (int r = 0; r < p; ++r)
    for (size_t i = 0; i < rp[r].out.size(); ++i)
      ASSERT_EQ(rp[r].out[i], r1[0].out[size_t(first_token[r]) * cp.hidden + i]);
}

TEST(Ep, BadConfigIsRejected) {
  EpConfig c = config(2, 16);
  c.hidden = 200;
  expect_error([&] { LocalEpGroup g(c); }, {"hidden (K) = 200", "multiple of 128"});
  c = config(3, 16);
  expect_error([&] { LocalEpGroup g(c); }, {"num_slots = 16", "multiple of num_ranks = 3"});
  c = config(2, 16, 17);
  expect_error([&] { LocalEpGroup g(c); }, {"topk = 17"});
  c = config(2, 16);
  c.max_tokens = 0;
  expect_error([&] { LocalEpGroup g(c); }, {"T_max"});
  c = config(2, 16);
  c.x_scaling = Fp8Scaling(3);
  expect_error([&] { LocalEpGroup g(c); }, {"x_scaling = 3"});
}

// Bad input on one rank: rejected before anything is written, so the same step can go on with
// good input and deliver correctly.
TEST(Ep, BadInputIsRejectedBeforeAnythingMoves) {
  const EpConfig c = config(1, 16);
  LocalEpGroup group(c);
  auto in = make_inputs(c, 5, /*full=*/true);
  RankInput& ri = in[0];
  std::vector<uint16_t> big_x(size_t(c.max_tokens + 1) * c.hidden, 0);
  std::vector<int32_t> big_idx(size_t(c.max_tokens + 1) * c.topk, 0);
  for (size_t i = 0; i < big_idx.size(); ++i) big_idx[i] = int32_t(i % c.topk);
  std::vector<float> big_w(big_idx.size(), 1.0f);
  expect_error([&] { group.dispatch_send(0, c.max_tokens + 1, big_x.data(), big_idx.data(), big_w.data()); },
               {"13 tokens", "T_max = 12"});
  expect_error([&] { group.normal_notify(0, c.max_tokens + 1, big_idx.data()); }, {"T_max = 12"});

  auto bad_idx = ri.topk_idx;
  bad_idx[5] = c.num_slots;
  expect_error([&] { group.dispatch_send(0, ri.num_tokens, ri.x.data(), bad_idx.data(), ri.topk_weights.data()); },
               {"topk_idx[1, 1] = 16", "0..15"});
  bad_idx[5] = -2;
  expect_error([&] { group.normal_notify(0, ri.num_tokens, bad_idx.data()); }, {"topk_idx[1, 1] = -2"});
  bad_idx = ri.topk_idx;
  bad_idx[5] = bad_idx[4];
  expect_error([&] { group.dispatch_send(0, ri.num_tokens, ri.x.data(), bad_idx.data(), ri.topk_weights.data()); },
               {"token 1 picks slot", "twice"});
  auto bad_w = ri.topk_weights;
  bad_w[2] = NAN;
  expect_error([&] { group.dispatch_send(0, ri.num_tokens, ri.x.data(), ri.topk_idx.data(), bad_w.data()); },
               {"topk_weights[0, 2]", "not finite"});
  auto bad_x = ri.x;
  bad_x[c.hidden + 7] = float_to_bf16(INFINITY);
  expect_error([&] { group.dispatch_send(0, ri.num_tokens, bad_x.data(), ri.topk_idx.data(), ri.topk_weights.data()); },
               {"x[1, 7]", "not finite"});
  // Out of order calls.
  std::vector<uint16_t> y(1);
  expect_error([&] { group.combine_send(0, y.data()); }, {"combine_send", "phase 'idle'"});

  // Nothing moved: the step runs normally now and every pair arrives once.
  const auto rx = run_low_latency(group, in);
  std::set<std::tuple<int, int, int>> seen;
  const MaskedLayout layout{c.slots_per_rank(), c.max_m(), c.hidden};
  for (int e = 0; e < layout.num_experts; ++e)
    for (int m = 0; m < rx[0].count[e]; ++m) {
      std::vector<float> scales(c.k_blocks());
      for (int b = 0; b < c.k_blocks(); ++b) scales[b] = rx[0].scales[layout.scale_offset(e, m, b)];
      check_row(c, in, 0, e, rx[0].x.data() + layout.a_offset(e, m), scales, rx[0].src[size_t(e) * layout.max_m + m], seen);
    }
  EXPECT_EQ(seen.size(), total_pairs(in));
  check_combine(c, in, rx);
}

// A peer that never sends: the wait ends with an error naming the rank, the peer and the step.
TEST(Ep, SilentPeerTimesOut) {
  EpConfig c = config(2, 16);
  c.timeout_s = 0.2;
  LocalEpGroup group(c);
  const auto in = make_inputs(c, 3, /*full=*/true);
  const MaskedLayout layout{c.slots_per_rank(), c.max_m(), c.hidden};
  std::vector<uint8_t> x(layout.a_elems());
  std::vector<float> s(layout.scale_elems());
  std::vector<int32_t> count(layout.num_experts), src(size_t(layout.num_experts) * layout.max_m);
  group.dispatch_send(0, in[0].num_tokens, in[0].x.data(), in[0].topk_idx.data(), in[0].topk_weights.data());
  expect_error([&] { group.dispatch_recv(0, x.data(), s.data(), count.data(), src.data()); },
               {"rank 0: timed out", "peer 1", "dispatch, step 1"});
}

// A rank failing on bad input stops its peers at once; run_ranks reports the failing rank's error.
TEST(Ep, FailingRankAbortsItsPeers) {
  EpConfig c = config(4, 16);
  c.timeout_s = 30;  // far longer than the test may take: the abort must end the waits
  LocalEpGroup group(c);
  auto in = make_inputs(c, 11, /*full=*/true);
  in[2].topk_idx[0] = 99;
  expect_error([&] { run_low_latency(group, in); }, {"rank 2: topk_idx[0, 0] = 99"});
}
