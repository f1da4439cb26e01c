// The EP buffer's host-side checks, which need no GPU: every field EpConfig::validate refuses,
// each message naming the field and its value; the contiguous layout's row counts; and
// validate_topk_idx on a host copy of the routing. (What the kernels do with a bad entry on the
// device is tests/gpu/test_ep_local.cu's.)
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "expect_error.h"
#include "gpu/test_ep_reference.h"
#include "moekit/ep.h"

using moekit::Fp8Scaling;
using namespace moekit::gpu;

namespace {

EpConfig base_config() { return ep_test::make_config({4, 8, 256, 16, 4}); }  // 4 ranks of 8 tokens, d 256, 16 slots, top-4

// validate() refuses the config `change` makes of base_config(), with `fragments` in its message.
void expect_refused(const std::function<void(EpConfig&)>& change, std::initializer_list<std::string> fragments) {
  EpConfig c = base_config();
  change(c);
  expect_error([&] { c.validate(); }, fragments);
}

}  // namespace

TEST(EpConfigRules, EveryBadFieldIsNamedWithItsValue) {
  EXPECT_NO_THROW(base_config().validate());
  expect_refused([](EpConfig& c) { c.num_ranks = 0; }, {"num_ranks = 0", "1..1024"});
  expect_refused([](EpConfig& c) { c.num_ranks = kEpMaxRanks + 1; }, {"num_ranks = 1025"});
  expect_refused([](EpConfig& c) { c.max_tokens = 0; }, {"max_tokens (T_max) = 0", "1..32768"});
  expect_refused([](EpConfig& c) { c.max_tokens = 32769; }, {"max_tokens (T_max) = 32769"});
  expect_refused([](EpConfig& c) { c.hidden = 200; }, {"hidden (d) = 200", "multiple of 128"});
  expect_refused([](EpConfig& c) { c.hidden = -128; }, {"hidden (d) = -128"});
  expect_refused([](EpConfig& c) { c.num_slots = 18; }, {"num_slots = 18", "multiple of num_ranks = 4"});
  expect_refused([](EpConfig& c) { c.num_slots = 0; }, {"num_slots = 0"});
  expect_refused([](EpConfig& c) { c.topk = 0; }, {"topk = 0", "1..16"});
  expect_refused([](EpConfig& c) { c.topk = 17; }, {"topk = 17", "1..16"});  // at most the slots
  expect_refused([](EpConfig& c) { c.num_slots = 64, c.topk = 40; }, {"topk = 40", "1..32"});  // at most 32
  expect_refused([](EpConfig& c) { c.num_ranks = 1024, c.num_slots = 1024, c.max_tokens = 32768; },
                 {"M_max = num_ranks * max_tokens = 33554432", "2^24"});
  expect_refused([](EpConfig& c) { c.block_m = 0; }, {"block_m = 0", "1..4096"});
  expect_refused([](EpConfig& c) { c.max_recv_rows = -1; }, {"max_recv_rows = -1"});
  expect_refused([](EpConfig& c) { c.timeout_s = 0; }, {"timeout_s = 0", "(0, 3600]"});
  expect_refused([](EpConfig& c) { c.timeout_s = std::numeric_limits<double>::quiet_NaN(); }, {"timeout_s = nan"});
  expect_refused([](EpConfig& c) { c.num_ctas = -1; }, {"num_ctas = -1", "0..65535"});
  expect_refused([](EpConfig& c) { c.x_scaling = Fp8Scaling(7); }, {"x_scaling = 7"});
  expect_refused([](EpConfig& c) { c.mode = EpMode::kNormal, c.self_slab = true; },
                 {"self_slab is a low-latency (masked layout) option"});
  // (Normal mode's bound of 2^30 worst-case rows is not reachable past the limits above: M_max <=
  // 2^24 rows of at most 32 entries, and E_loc (block_m - 1) < 8192 * 4096.)
}

// Normal mode's contiguous rows: every token of every rank on min(k, E_loc) local experts plus
// block_m - 1 padding rows per expert, rounded up to lcm(128, block_m); or max_recv_rows, rounded.
TEST(EpConfigRules, ContiguousRows) {
  EpConfig c = base_config();
  c.mode = EpMode::kNormal;
  c.block_m = 64;
  EXPECT_EQ(c.slots_per_rank(), 4);
  EXPECT_EQ(c.max_m(), 32);
  EXPECT_EQ(c.worst_case_rows(), 32 * 4 + 4 * 63);  // 380
  EXPECT_EQ(c.contiguous_rows(), 384);
  c.topk = 8;  // more entries per token than local experts: each lands on at most E_loc of them
  EXPECT_EQ(c.worst_case_rows(), 32 * 4 + 4 * 63);
  c.num_slots = 32;
  EXPECT_EQ(c.worst_case_rows(), 32 * 8 + 8 * 63);
  c.max_recv_rows = 100;
  EXPECT_EQ(c.contiguous_rows(), 128);
  c.block_m = 96;  // lcm(128, 96) = 384
  EXPECT_EQ(c.contiguous_rows(), 384);
}

// A host copy of topk_idx: every entry a slot in [0, num_slots) or -1, no slot twice in a token;
// the message names the token, the entry and the value.
TEST(EpConfigRules, HostRoutingIsCheckedBeforeAnyKernel) {
  const EpConfig c = base_config();
  std::vector<int32_t> idx = {0, 1, 2, 3, 4, -1, -1, 6};
  EXPECT_NO_THROW(validate_topk_idx(c, idx.data(), 2));  // -1 may repeat
  idx = {0, 1, 2, 3, 4, 5, 5, 6};
  expect_error([&] { validate_topk_idx(c, idx.data(), 2); }, {"topk_idx[1][2] = 5 repeats entry 1"});
  idx = {0, 1, 2, 16, 4, 5, 6, 7};
  expect_error([&] { validate_topk_idx(c, idx.data(), 2); }, {"topk_idx[0][3] = 16", "[0, 16) or -1"});
  idx = {0, 1, 2, -2, 4, 5, 6, 7};
  expect_error([&] { validate_topk_idx(c, idx.data(), 2); }, {"topk_idx[0][3] = -2"});
  expect_error([&] { validate_topk_idx(c, idx.data(), 9); }, {"num_tokens = 9", "0..T_max = 8"});
  EpConfig bad = c;
  bad.hidden = 100;
  expect_error([&] { validate_topk_idx(bad, idx.data(), 1); }, {"hidden (d) = 100"});  // the config first
}
