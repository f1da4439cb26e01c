// GPU dispatch/combine over the `local` transport (P virtual ranks on one GPU) against two
// references: a direct host computation written here from quant.h and layout.h (the canonical
// order walked source by source, no messages), and the CPU protocol of ep_cpu.h (threads as
// ranks). Dispatch outputs must be equal bit for bit; combine within BF16 rounding (the kernels
// use the reference's operation order, so exact equality is also counted and reported).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "expect_error.h"
#include "moekit/ep_cpu.h"
#include "moekit/gemm.h"
#include "moekit/mxfp4.h"
#include "test_ep_reference.h"

using namespace ep_test;

namespace {

class WithStream {
 protected:
  WithStream() { MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream)); }
  ~WithStream() { cudaStreamDestroy(stream); }
  cudaStream_t stream{};
};

class EpLocal : public ::testing::TestWithParam<Shape>, public WithStream {};

// Three steps with fresh routing (changing token counts, one rank idle in a step, a skewed step)
// over one group: checks the parity flip and the device step counters as well as the data.
TEST_P(EpLocal, DispatchAndCombineMatchBothReferences) {
  const Shape shape = GetParam();
  const EpConfig c = make_config(shape);
  const int P = c.num_ranks;
  EpLocalGroup group(c);
  DeviceStep dev(c);
  std::mt19937 rng(1234 + P);
  for (int step = 0; step < 3; ++step) {
    std::vector<RankInput> in;
    std::uniform_int_distribution<int> tokens(0, c.max_tokens);
    for (int r = 0; r < P; ++r) {
      const int T = step == 0 ? c.max_tokens : (step == 1 && r == P - 1 ? 0 : tokens(rng));
      in.push_back(random_input(c, T, rng, step == 2 ? 3 : 0));
      dev.upload(r, in[r]);
      poison_masked(group.rank(r));
    }
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], in[r].num_tokens, stream);
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);

    const Reference ref = masked_reference(c, in);
    for (int r = 0; r < P; ++r) ASSERT_EQ(compare_masked(group.rank(r), ref.ranks[r], r), 0) << "step " << step;

    std::vector<std::vector<uint16_t>> y(P), add(P);
    for (int r = 0; r < P; ++r) {
      y[r] = random_y(c, ref.ranks[r].count, rng);
      MOEKIT_CUDA_CHECK(cudaMemcpy(dev.y[r], y[r].data(), y[r].size() * 2, cudaMemcpyHostToDevice));
      if (r % 2 == 0) {  // half the ranks pass `add` (the shared expert's output)
        add[r] = random_input(c, in[r].num_tokens, rng).x;
        MOEKIT_CUDA_CHECK(cudaMemcpy(dev.add[r], add[r].data(), add[r].size() * 2, cudaMemcpyHostToDevice));
      }
      MOEKIT_CUDA_CHECK(cudaMemset(dev.out[r], 0xFF, size_t(c.max_tokens) * c.hidden * 2));
    }
    for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).combine_recv(add[r].empty() ? nullptr : dev.add[r], dev.out[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    const auto want = combine_reference(c, in, ref.row_of, y, add);
    size_t exact = 0, total = 0;
    for (int r = 0; r < P; ++r) {
      exact += compare_combine(to_host(dev.out[r], size_t(in[r].num_tokens) * c.hidden), want[r], r);
      total += want[r].size();
    }
    std::printf("[ep] %s step %d: combine bit-identical %zu of %zu\n", shape_name(shape).c_str(), step, exact, total);

    // The CPU protocol (ep_cpu.h), same inputs: dispatch bit for bit, combine within bf16 rounding.
    moekit::LocalEpGroup cpu(cpu_config(c));
    const moekit::MaskedLayout lay = group.rank(0).masked_layout();
    std::vector<MaskedRef> cpu_out(P);
    std::vector<std::vector<uint16_t>> cpu_comb(P);
    moekit::run_ranks(cpu, [&](int r) {
      cpu_out[r] = cpu_dispatch(cpu, r, lay, in[r]);
      cpu.combine_send(r, y[r].data());
      cpu_comb[r].resize(size_t(in[r].num_tokens) * c.hidden);
      cpu.combine_recv(r, add[r].empty() ? nullptr : add[r].data(), cpu_comb[r].data());
    });
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(compare_masked(group.rank(r), cpu_out[r], r), 0) << "against ep_cpu.h, step " << step;
      compare_combine(to_host(dev.out[r], size_t(in[r].num_tokens) * c.hidden), cpu_comb[r], r);
    }
  }
}

// EpConfig::self_slab: the send also writes each rank's own tokens, quantised exactly as quant.h
// does, into masked slab E_loc (rows in token order) with recv_count[E_loc] = T; the routed slabs
// are what they are without it, and a second step with fewer tokens rewrites the count.
TEST(EpSelfSlab, OwnTokensInSlabELoc) {
  EpConfig c = make_config({4, 24, 512, 16, 4});
  c.self_slab = true;
  const int P = c.num_ranks, E = c.slots_per_rank(), d = c.hidden, kb = c.k_blocks(), M = c.max_m();
  EpLocalGroup group(c);
  DeviceStep dev(c);
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::mt19937 rng(77);
  for (int step = 0; step < 2; ++step) {
    std::vector<RankInput> in;
    for (int r = 0; r < P; ++r) {
      in.push_back(random_input(c, step == 0 ? c.max_tokens : 5 + r, rng));
      dev.upload(r, in[r]);
      poison_masked(group.rank(r));
    }
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], in[r].num_tokens, stream);
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    const Reference ref = masked_reference(c, in);
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(compare_masked(group.rank(r), ref.ranks[r], r), 0) << "routed slabs, step " << step;
      const int T = in[r].num_tokens;
      const auto count = to_host(group.rank(r).recv_count(), size_t(E) + 1);
      EXPECT_EQ(count[E], T) << "rank " << r << " step " << step;
      const auto x = to_host(group.rank(r).recv_x() + size_t(E) * M * d, size_t(T) * d);
      const auto sc = to_host(group.rank(r).recv_scales() + size_t(E) * kb * M, size_t(kb) * M);
      std::vector<float> row(d);
      std::vector<uint8_t> q(d);
      std::vector<float> qs(kb);
      size_t bad = 0;
      for (int t = 0; t < T; ++t) {
        for (int i = 0; i < d; ++i) row[i] = bf16_to_float(in[r].x[size_t(t) * d + i]);
        moekit::quantize_row_fp8(row.data(), d, q.data(), qs.data(), 1);
        bad += std::memcmp(q.data(), x.data() + size_t(t) * d, d) != 0;
        for (int b = 0; b < kb; ++b) bad += std::memcmp(&qs[b], &sc[size_t(b) * M + t], 4) != 0;
      }
      EXPECT_EQ(bad, 0u) << "rank " << r << " step " << step << ": own tokens in slab E_loc";
    }
    for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
  }
  cudaStreamDestroy(stream);
  EpConfig normal = c;
  normal.mode = EpMode::kNormal;
  EXPECT_THROW(normal.validate(), moekit::Error);  // a masked-layout option only
}

// dispatch_recv with rows_ready (the hand-off to a GEMM running beside the receive, ep.h): the
// outputs are those of the plain receive; the published word and every slab's row count (the self
// slab's included) are what a GEMM waits for; a receive on a few CTAs (several messages per warp)
// counts each row once. A silent peer: the receive times out as before, with recv_count 0 for the
// routed experts, the word still published and the abort bit raised, so that a waiting GEMM ends.
TEST(EpRowsReady, CountsEveryRowAndPublishesTheCounts) {
  EpConfig c = make_config({4, 24, 512, 16, 4});
  c.self_slab = true;
  c.timeout_s = 0.05;
  const int P = c.num_ranks, E = c.slots_per_rank();
  EpLocalGroup group(c);
  DeviceStep dev(c);
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int32_t* ready = nullptr;
  const size_t n_ready = size_t(P) * (E + 3);
  MOEKIT_CUDA_CHECK(cudaMalloc(&ready, n_ready * sizeof(int32_t)));
  auto ready_of = [&](int r) { return ready + size_t(r) * (E + 3); };
  std::mt19937 rng(91);
  for (int step = 0; step < 2; ++step) {
    MOEKIT_CUDA_CHECK(cudaMemset(ready, 0, n_ready * sizeof(int32_t)));  // a GEMM zeroes them after use
    std::vector<RankInput> in;
    for (int r = 0; r < P; ++r) {
      in.push_back(random_input(c, step == 0 ? c.max_tokens : 3 + 2 * r, rng));
      dev.upload(r, in[r]);
      poison_masked(group.rank(r));
    }
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], in[r].num_tokens, stream);
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream, ready_of(r), r == 0 ? 1 : 2 + step);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    const Reference ref = masked_reference(c, in);
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(compare_masked(group.rank(r), ref.ranks[r], r), 0) << "step " << step;
      const auto count = to_host(group.rank(r).recv_count(), size_t(E) + 1);
      const auto got = to_host(ready_of(r), size_t(E) + 3);
      for (int e = 0; e <= E; ++e) EXPECT_EQ(got[e], count[e]) << "rank " << r << " step " << step << " slab " << e;
      EXPECT_EQ(got[E + 1], 0) << "the consumer's CTA count is not the receive's";
      EXPECT_EQ(got[E + 2], 1) << "rank " << r << " step " << step << ": the counts' word";
    }
    for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
  }
  // Rank 3 silent: rank 1's receive times out, names it, and still publishes (zero rows).
  MOEKIT_CUDA_CHECK(cudaMemset(ready, 0, n_ready * sizeof(int32_t)));
  for (int r = 0; r < 3; ++r) {
    const RankInput in = random_input(c, 4, rng);
    dev.upload(r, in);
    group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], in.num_tokens, stream);
  }
  group.rank(1).dispatch_recv(stream, ready_of(1), 4);
  try {
    group.rank(1).check(stream);
    FAIL() << "a silent peer must make the receive fail";
  } catch (const moekit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("waiting for rank 3 at step 3"), std::string::npos) << e.what();
  }
  const auto count = to_host(group.rank(1).recv_count(), size_t(E) + 1);
  const auto got = to_host(ready_of(1), size_t(E) + 3);
  for (int e = 0; e < E; ++e) EXPECT_EQ(count[e], 0) << "expert " << e << " after the timeout";
  EXPECT_EQ(count[E], 4) << "the self slab holds the rank's own tokens";
  EXPECT_EQ(got[E + 2], 1 | moekit::kRowsReadyAbort) << "published, and the abort raised, after the timeout";
  // Bad arguments name their value before any kernel runs.
  auto rejects = [&](int32_t* rr, int ctas, const char* what) {
    try {
      group.rank(0).dispatch_recv(stream, rr, ctas);
      ADD_FAILURE() << "accepted " << what;
    } catch (const moekit::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  rejects(nullptr, 4, "got null");
  rejects(ready, 0, "num_ctas = 0");
  rejects(ready, 100000, "num_ctas = 100000");
  cudaFree(ready);
  cudaStreamDestroy(stream);
}

// A local group of P ranks with the self slab, its step buffers, a non-blocking stream and each
// rank's y_ready (E_loc + 1 ints, zero), for the send beside a GEMM; all freed at scope end.
struct CombineRig {
  EpConfig c;
  std::unique_ptr<EpLocalGroup> group;
  std::unique_ptr<DeviceStep> dev;
  cudaStream_t stream{};
  int32_t* ready = nullptr;
  size_t ready_ints = 0;
  CombineRig(const Shape& shape, double timeout_s) : c(make_config(shape)) {
    c.self_slab = true;
    c.timeout_s = timeout_s;
    group = std::make_unique<EpLocalGroup>(c);
    dev = std::make_unique<DeviceStep>(c);
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ready_ints = size_t(c.num_ranks) * (c.slots_per_rank() + 1);
    MOEKIT_CUDA_CHECK(cudaMalloc(&ready, ready_ints * sizeof(int32_t)));
    MOEKIT_CUDA_CHECK(cudaMemset(ready, 0, ready_ints * sizeof(int32_t)));
  }
  ~CombineRig() {
    cudaFree(ready);
    cudaStreamDestroy(stream);
  }
  int32_t* ready_of(int r) const { return ready + size_t(r) * (c.slots_per_rank() + 1); }
};

// One rank (ep.h): the send writes the masked layout itself and the receive launches nothing;
// with rows_ready one small kernel publishes the counts (every slab's, the self slab's included);
// combine_send launches nothing and combine_recv sums y itself. Each step runs twice on the same
// inputs: the combine as one kernel, then beside a GEMM (combine_send with y_ready: the two-kernel
// path), and both must give the same bits, match the reference, and give a token with no expert
// exactly `add`.
TEST(EpOneRank, TheSendWritesTheLayoutAndTheCombineSumsY) {
  CombineRig rig({1, 40, 512, 16, 4}, 5.0);
  const EpConfig& c = rig.c;
  EpBuffer& ep = rig.group->rank(0);
  DeviceStep& dev = *rig.dev;
  const cudaStream_t stream = rig.stream;
  const int E = c.slots_per_rank(), d = c.hidden, k = c.topk;
  int32_t* ready = nullptr;  // rows_ready: E routed slabs, the self slab, the consumer's count, the word
  MOEKIT_CUDA_CHECK(cudaMalloc(&ready, sizeof(int32_t) * (E + 3)));
  std::mt19937 rng(2024);
  for (int step = 0; step < 3; ++step) {
    RankInput in = random_input(c, step == 0 ? c.max_tokens : step == 1 ? 0 : 7, rng);
    if (in.num_tokens > 2)
      for (int j = 0; j < k; ++j) in.topk_idx[size_t(2) * k + j] = -1;  // token 2: no expert at all
    std::vector<uint16_t> y, add = random_input(c, in.num_tokens, rng).x, first;
    for (int pass = 0; pass < 2; ++pass) {  // 0: the one-kernel combine, 1: the send beside a GEMM
      dev.upload(0, in);
      poison_masked(ep);
      MOEKIT_CUDA_CHECK(cudaMemset(ready, 0, sizeof(int32_t) * (E + 3)));
      MOEKIT_CUDA_CHECK(cudaMemset(dev.out[0], 0xFF, size_t(c.max_tokens) * d * 2));
      ep.dispatch_send(dev.x[0], dev.idx[0], dev.w[0], in.num_tokens, stream);
      if (pass == 0) ep.dispatch_recv(stream, ready, 1);
      else ep.dispatch_recv(stream);
      ep.check(stream);
      const Reference ref = masked_reference(c, {in});
      ASSERT_EQ(compare_masked(ep, ref.ranks[0], 0), 0) << "step " << step << " pass " << pass;
      const auto count = to_host(ep.recv_count(), size_t(E) + 1);
      EXPECT_EQ(count[E], in.num_tokens) << "the self slab";
      if (pass == 0) {
        const auto got = to_host(ready, size_t(E) + 3);
        for (int e = 0; e <= E; ++e) EXPECT_EQ(got[e], count[e]) << "step " << step << " slab " << e;
        EXPECT_EQ(got[E + 1], 0) << "the consumer's CTA count is not the receive's";
        EXPECT_EQ(got[E + 2], 1) << "step " << step << ": the counts' word";
        y = random_y(c, ref.ranks[0].count, rng);
      }
      MOEKIT_CUDA_CHECK(cudaMemcpy(dev.y[0], y.data(), y.size() * 2, cudaMemcpyHostToDevice));
      MOEKIT_CUDA_CHECK(cudaMemcpy(dev.add[0], add.data(), add.size() * 2, cudaMemcpyHostToDevice));
      if (pass == 0) {
        ep.combine_send(dev.y[0], stream);
      } else {
        std::vector<int32_t> targets;
        for (int e = 0; e <= E; ++e) targets.push_back((d / 64) * count[e]);
        MOEKIT_CUDA_CHECK(cudaMemcpy(rig.ready_of(0), targets.data(), targets.size() * 4, cudaMemcpyHostToDevice));
        ep.combine_send(dev.y[0], stream, rig.ready_of(0), 3);
      }
      ep.combine_recv(dev.add[0], dev.out[0], stream);
      ep.check(stream);
      const auto got = to_host(dev.out[0], size_t(in.num_tokens) * d);
      const auto want = combine_reference(c, {in}, ref.row_of, {y}, {add})[0];
      const size_t exact = compare_combine(got, want, 0);
      std::printf("[ep] one rank, step %d pass %d: combine bit-identical %zu of %zu\n", step, pass, exact, want.size());
      if (in.num_tokens > 2)
        EXPECT_TRUE(std::equal(got.begin() + 2 * d, got.begin() + 3 * d, add.begin() + 2 * d))
            << "a token with no expert gets add";
      if (pass == 0) first = got;
      else EXPECT_TRUE(got == first) << "step " << step << ": the one-kernel combine and the two-kernel one differ";
    }
  }
  const auto left = to_host(rig.ready, rig.ready_ints);
  for (size_t i = 0; i < left.size(); ++i) EXPECT_EQ(left[i], 0) << "y_ready entry " << i << " not zeroed";
  cudaFree(ready);
}

// EpConfig::mxfp4_k_order (an MXFP4 layer's buffer): the rows land in the MXFP4 GEMM's K order
// (mxfp4.h), byte for byte the reference's rows permuted, the scales, counts and sources as
// without it; for one rank (the direct path) and for two (messages), two steps each.
TEST(EpMxfp4KOrder, RowsInTheGemmOrder) {
  for (int P : {1, 2}) {
    EpConfig c = make_config({P, 24, 384, 8, 4});
    c.mxfp4_k_order = true;
    EpLocalGroup group(c);
    DeviceStep dev(c);
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::mt19937 rng(707 + P);
    for (int step = 0; step < 2; ++step) {
      std::vector<RankInput> in;
      for (int r = 0; r < P; ++r) {
        in.push_back(random_input(c, c.max_tokens - r - step, rng));
        dev.upload(r, in[r]);
        poison_masked(group.rank(r));
      }
      for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], in[r].num_tokens, stream);
      for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
      for (int r = 0; r < P; ++r) group.rank(r).check(stream);
      Reference ref = masked_reference(c, in);
      for (int r = 0; r < P; ++r) {
        std::vector<uint8_t> natural = ref.ranks[r].x;
        moekit::mxfp4_permute_k(natural.data(), int64_t(natural.size() / c.hidden), c.hidden, ref.ranks[r].x.data());
        ASSERT_EQ(compare_masked(group.rank(r), ref.ranks[r], r), 0) << "P = " << P << ", step " << step;
      }
      // The step completes (the combine does not depend on the order).
      for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
      for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
      for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    }
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

// EpConfig::x_scaling per token: every row's d/128 scales are its token's one scale, the same
// bits as the direct reference and as ep_cpu.h with the same setting. One CTA, so that a token is
// quantised by the whole CTA (1 token), by teams of 4 and 2 warps (2, 3 tokens) and by one warp
// (5 and 24 tokens): each reduces the token's amax its own way. One rank (the direct path) and
// two; a token with an infinity in one group keeps its other values (the fault is reported).
TEST(EpTokenScales, OneScalePerTokenForEveryTeamSize) {
  for (int P : {1, 2}) {
    EpConfig c = make_config({P, 24, 384, 8, 4});
    c.x_scaling = moekit::Fp8Scaling::kPerToken;
    c.num_ctas = 1;
    EpLocalGroup group(c);
    DeviceStep dev(c);
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::mt19937 rng(811 + P);
    moekit::LocalEpGroup cpu(cpu_config(c));
    for (int tokens : {1, 2, 3, 5, 24}) {
      std::vector<RankInput> in;
      for (int r = 0; r < P; ++r) {
        in.push_back(random_input(c, tokens, rng));
        dev.upload(r, in[r]);
        poison_masked(group.rank(r));
      }
      for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], tokens, stream);
      for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
      for (int r = 0; r < P; ++r) group.rank(r).check(stream);
      const Reference ref = masked_reference(c, in);
      const moekit::MaskedLayout lay = group.rank(0).masked_layout();
      std::vector<MaskedRef> cpu_out(P);
      moekit::run_ranks(cpu, [&](int r) {
        cpu_out[r] = cpu_dispatch(cpu, r, lay, in[r]);
        cpu.combine_send(r, random_y(c, cpu_out[r].count, rng).data());
        std::vector<uint16_t> out(size_t(tokens) * c.hidden);
        cpu.combine_recv(r, nullptr, out.data());
      });
      int mixed = 0;  // rows whose 1x128 scales would differ: the data can tell the two apart
      for (int r = 0; r < P; ++r) {
        ASSERT_EQ(compare_masked(group.rank(r), ref.ranks[r], r), 0) << "P = " << P << ", " << tokens << " tokens";
        ASSERT_EQ(compare_masked(group.rank(r), cpu_out[r], r), 0) << "against ep_cpu.h, P = " << P;
        for (int e = 0; e < lay.num_experts; ++e)
          for (int m = 0; m < ref.ranks[r].count[e]; ++m) {
            const float s0 = ref.ranks[r].scales[lay.scale_offset(e, m, 0)];
            for (int b = 1; b < c.k_blocks(); ++b) ASSERT_EQ(ref.ranks[r].scales[lay.scale_offset(e, m, b)], s0);
            std::vector<float> row(c.hidden), block_scales(c.k_blocks());
            std::vector<uint8_t> q(c.hidden);
            const int src = ref.ranks[r].src[size_t(e) * lay.max_m + m];
            for (int i = 0; i < c.hidden; ++i)
              row[i] = bf16_to_float(in[src / c.max_tokens].x[size_t(src % c.max_tokens) * c.hidden + i]);
            moekit::quantize_row_fp8(row.data(), c.hidden, q.data(), block_scales.data(), 1);
            mixed += std::any_of(block_scales.begin(), block_scales.end(), [&](float v) { return v != block_scales[0]; });
          }
      }
      EXPECT_GT(mixed, 0) << tokens << " tokens";
      for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
      for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
      for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    }
    // Non-finite values in rank 0's tokens: an infinity in group 1 of token 0, a NaN in token 1, a
    // negative infinity beside a NaN in token 2. Reported, and each token's groups keep the scale
    // of its finite values (the amax leaves infinities and NaNs out).
    std::vector<RankInput> in;
    const std::vector<std::pair<int, float>> faults = {
        {200, INFINITY}, {c.hidden + 300, NAN}, {2 * c.hidden + 7, -INFINITY}, {2 * c.hidden + 8, NAN}};
    for (int r = 0; r < P; ++r) {
      in.push_back(random_input(c, 3, rng));
      if (r == 0)
        for (const auto& [i, v] : faults) in[0].x[i] = float_to_bf16(v);
      dev.upload(r, in[r]);
    }
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], 3, stream);
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
    // The first fault recorded wins, and the three tokens' CTAs race for it.
    expect_error([&] { group.rank(0).check(stream); }, {"non-finite x value"});
    for (int t = 0; t < 3; ++t) {
      float amax = 0.0f;
      for (int i = 0; i < c.hidden; ++i) {
        const float v = bf16_to_float(in[0].x[size_t(t) * c.hidden + i]);
        if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
      }
      const int32_t* idx = in[0].topk_idx.data() + size_t(t) * c.topk;
      const int slot = *std::find_if(idx, idx + c.topk, [](int32_t s) { return s >= 0; });
      EpBuffer& owner = group.rank(slot / c.slots_per_rank());
      const moekit::MaskedLayout lay = owner.masked_layout();
      const std::vector<int32_t> src = to_host(owner.recv_src(), size_t(lay.num_experts) * lay.max_m);
      const std::vector<float> scales = to_host(owner.recv_scales(), lay.scale_elems());
      const int e = slot % c.slots_per_rank();
      const std::vector<int32_t> count = to_host(owner.recv_count(), size_t(lay.num_experts));
      int found = 0;
      for (int m = 0; m < count[e]; ++m)  // rows past the count hold earlier steps' tokens
        if (src[size_t(e) * lay.max_m + m] == t) {  // rank 0's token t
          ++found;
          for (int b = 0; b < c.k_blocks(); ++b)
            EXPECT_EQ(scales[lay.scale_offset(e, m, b)], std::max(amax, moekit::kMinAmax) / 448.0f) << "token " << t;
        }
      EXPECT_EQ(found, 1) << "token " << t;
    }
    for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    MOEKIT_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

// x_cols and out_cols (ep.h; a model whose hidden size the buffer pads, gpt-oss): the send reads
// rows of x_cols columns and counts the rest as zero, the combine writes rows of out_cols columns
// and nothing past them; both equal the references on the zero-padded rows, for one rank (the
// direct path) and for two. Bad values are named.
TEST(EpPaddedRows, XColsAndOutColsEqualAZeroPaddedCopy) {
  for (int P : {1, 2}) {
    const EpConfig c = make_config({P, 16, 512, 8, 4});
    const int d = c.hidden, x_cols = 448, out_cols = 440, T = c.max_tokens;
    EpLocalGroup group(c);
    DeviceStep dev(c);
    cudaStream_t stream;
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::mt19937 rng(606 + P);
    std::vector<RankInput> in;
    std::vector<uint16_t*> x_short(P), out_short(P);
    const size_t canary = 64;
    for (int r = 0; r < P; ++r) {
      in.push_back(random_input(c, T - r, rng));
      std::vector<uint16_t> rows(size_t(in[r].num_tokens) * x_cols);
      for (int t = 0; t < in[r].num_tokens; ++t)
        for (int i = 0; i < d; ++i) {
          uint16_t& v = in[r].x[size_t(t) * d + i];
          if (i >= x_cols) v = 0;  // the reference's padded copy
          else rows[size_t(t) * x_cols + i] = v;
        }
      dev.upload(r, in[r]);
      MOEKIT_CUDA_CHECK(cudaMemset(dev.x[r], 0xFF, size_t(T) * d * 2));  // the send must not read the padded x
      x_short[r] = to_device(rows);
      out_short[r] = to_device(std::vector<uint16_t>(size_t(T) * out_cols + canary, 0x7FC1));
      poison_masked(group.rank(r));
    }
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(x_short[r], dev.idx[r], dev.w[r], in[r].num_tokens, stream, x_cols);
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    const Reference ref = masked_reference(c, in);
    for (int r = 0; r < P; ++r) ASSERT_EQ(compare_masked(group.rank(r), ref.ranks[r], r), 0) << "P = " << P;
    std::vector<std::vector<uint16_t>> y(P);
    for (int r = 0; r < P; ++r) {
      y[r] = random_y(c, ref.ranks[r].count, rng);
      MOEKIT_CUDA_CHECK(cudaMemcpy(dev.y[r], y[r].data(), y[r].size() * 2, cudaMemcpyHostToDevice));
    }
    for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, out_short[r], stream, out_cols);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    const auto want = combine_reference(c, in, ref.row_of, y, std::vector<std::vector<uint16_t>>(P));
    for (int r = 0; r < P; ++r) {
      const int n = in[r].num_tokens;
      const auto got = to_host(out_short[r], size_t(T) * out_cols + canary);
      std::vector<uint16_t> g, w;
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < out_cols; ++i) {
          g.push_back(got[size_t(t) * out_cols + i]);
          w.push_back(want[r][size_t(t) * d + i]);
        }
      compare_combine(g, w, r);
      size_t touched = 0;
      for (size_t i = size_t(n) * out_cols; i < got.size(); ++i) touched += got[i] != 0x7FC1;
      EXPECT_EQ(touched, 0u) << "P = " << P << " rank " << r << ": written past the out rows";
    }
    expect_error([&] { group.rank(0).dispatch_send(x_short[0], dev.idx[0], dev.w[0], 1, stream, 440); }, {"x_cols = 440"});
    expect_error([&] { group.rank(0).dispatch_send(x_short[0], dev.idx[0], dev.w[0], 1, stream, 528); }, {"x_cols = 528"});
    expect_error([&] { group.rank(0).combine_recv(nullptr, out_short[0], stream, 444); }, {"out_cols = 444"});
    for (int r = 0; r < P; ++r) {
      cudaFree(x_short[r]);
      cudaFree(out_short[r]);
    }
    cudaStreamDestroy(stream);
  }
}

// combine_send with y_ready (the send beside the GEMM that writes y, ep.h): the same bits as the
// plain send of the same step; a rank whose y and counters land only after its send has started
// (a copy on another stream, 20 ms later) still sends the new rows, so the send waited for the
// counters; every counter is zero afterwards. A counter that never gets there is a named
// timeout; bad arguments name their value.
TEST(EpCombineReady, SendsEachMessageOnceItsRowsAreCounted) {
  CombineRig rig({4, 24, 512, 16, 4}, 5.0);
  const EpConfig& c = rig.c;
  EpLocalGroup& group = *rig.group;
  DeviceStep& dev = *rig.dev;
  const cudaStream_t stream = rig.stream;
  const int P = c.num_ranks, E = c.slots_per_rank(), d = c.hidden;
  cudaStream_t late;  // rank 1's rows and counters arrive on it
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&late, cudaStreamNonBlocking));
  std::mt19937 rng(404);
  std::vector<RankInput> in;
  for (int r = 0; r < P; ++r) in.push_back(random_input(c, c.max_tokens - r, rng));
  std::vector<std::vector<uint16_t>> y(P), out(P);
  for (int pass = 0; pass < 2; ++pass) {  // 0: plain send, 1: beside (same inputs, so the same map)
    for (int r = 0; r < P; ++r) {
      dev.upload(r, in[r]);
      MOEKIT_CUDA_CHECK(cudaMemset(dev.out[r], 0xFF, size_t(c.max_tokens) * d * 2));
    }
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], in[r].num_tokens, stream);
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    const Reference ref = masked_reference(c, in);
    std::vector<std::vector<int32_t>> targets(P);
    for (int r = 0; r < P; ++r) {
      if (pass == 0) y[r] = random_y(c, ref.ranks[r].count, rng);
      const auto count = to_host(group.rank(r).recv_count(), size_t(E) + 1);
      for (int e = 0; e <= E; ++e) targets[r].push_back((d / 64) * count[e]);
      // Rank 1 in the second pass: poisoned rows, and counters short of their targets, for now.
      const bool delayed = pass == 1 && r == 1;
      if (delayed) MOEKIT_CUDA_CHECK(cudaMemset(dev.y[r], 0xFF, y[r].size() * 2));
      else MOEKIT_CUDA_CHECK(cudaMemcpy(dev.y[r], y[r].data(), y[r].size() * 2, cudaMemcpyHostToDevice));
      if (pass == 1 && !delayed)
        MOEKIT_CUDA_CHECK(
            cudaMemcpy(rig.ready_of(r), targets[r].data(), targets[r].size() * 4, cudaMemcpyHostToDevice));
    }
    for (int r = 0; r < P; ++r) {
      if (pass == 0) group.rank(r).combine_send(dev.y[r], stream);
      else group.rank(r).combine_send(dev.y[r], stream, rig.ready_of(r), r == 0 ? 1 : 3);
    }
    if (pass == 1) {  // rank 1's rows, then its counters, land while its send waits
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(dev.y[1], y[1].data(), y[1].size() * 2, cudaMemcpyHostToDevice, late));
      MOEKIT_CUDA_CHECK(
          cudaMemcpyAsync(rig.ready_of(1), targets[1].data(), targets[1].size() * 4, cudaMemcpyHostToDevice, late));
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(late));
    }
    for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    const auto want = combine_reference(c, in, ref.row_of, y, std::vector<std::vector<uint16_t>>(P));
    for (int r = 0; r < P; ++r) {
      const auto got = to_host(dev.out[r], size_t(in[r].num_tokens) * d);
      compare_combine(got, want[r], r);
      if (pass == 0) out[r] = got;
      else EXPECT_TRUE(got == out[r]) << "rank " << r << ": the send beside the GEMM changed the bits";
    }
  }
  const auto left = to_host(rig.ready, rig.ready_ints);
  for (size_t i = 0; i < left.size(); ++i) EXPECT_EQ(left[i], 0) << "y_ready entry " << i << " not zeroed";
  cudaStreamDestroy(late);
}

TEST(EpCombineReady, ACounterShortOfItsTargetIsANamedTimeout) {
  CombineRig rig({2, 8, 256, 8, 2}, 0.05);
  EpLocalGroup& group = *rig.group;
  DeviceStep& dev = *rig.dev;
  const cudaStream_t stream = rig.stream;
  const int P = rig.c.num_ranks;
  const EpConfig& c = rig.c;
  std::mt19937 rng(8);
  for (int r = 0; r < P; ++r) {
    RankInput in = random_input(c, 8, rng);
    for (int t = 0; t < 8; ++t) {  // every token on slots 0 and 1: rank 0's experts, so rank 1 waits for none
      in.topk_idx[size_t(t) * 2] = 0;
      in.topk_idx[size_t(t) * 2 + 1] = 1;
    }
    dev.upload(r, in);
  }
  for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], 8, stream);
  for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
  for (int r = 0; r < P; ++r) group.rank(r).check(stream);
  // Bad arguments first: named, and nothing launched (the phase does not advance).
  auto rejects = [&](int32_t* rr, int ctas, const char* what) {
    try {
      group.rank(0).combine_send(dev.y[0], stream, rr, ctas);
      ADD_FAILURE() << "accepted " << what;
    } catch (const moekit::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  rejects(nullptr, 4, "got null");
  rejects(rig.ready, 0, "num_ctas = 0");
  rejects(rig.ready, 100000, "num_ctas = 100000");
  // Rank 0's counters stay at zero: its send gives up after the timeout, naming expert 0.
  for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream, rig.ready_of(r), 2);
  try {
    group.rank(0).check(stream);
    FAIL() << "a counter that never reaches its target must time out";
  } catch (const moekit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("combine_send timed out"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rows of local expert 0"), std::string::npos) << e.what();
  }
  for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
  EXPECT_NO_THROW(group.rank(1).check(stream));  // its peer's send still raised its flag
}

// Payloads that encode where they came from: token t of rank s has group 0 equal to s + 1 and
// group 1 equal to t + 1 (all 128 values), so its scales are (s + 1) / 448 and (t + 1) / 448.
// Decoding every received row must find each (source, token, slot) triple exactly once.
TEST_P(EpLocal, EveryTokenExpertPairArrivesOnce) {
  const Shape shape = GetParam();
  if (shape.hidden < 256 || shape.max_tokens > 255) GTEST_SKIP() << "needs two groups and T_max < 256";
  const EpConfig c = make_config(shape);
  const int P = c.num_ranks, E = c.slots_per_rank(), k = c.topk;
  EpLocalGroup group(c);
  DeviceStep dev(c);
  std::mt19937 rng(99);
  std::vector<RankInput> in;
  for (int r = 0; r < P; ++r) {
    in.push_back(random_input(c, c.max_tokens - r % 3, rng, 2));
    for (int t = 0; t < in[r].num_tokens; ++t)
      for (int i = 0; i < c.hidden; ++i)
        in[r].x[size_t(t) * c.hidden + i] = float_to_bf16(i < 128 ? float(r + 1) : i < 256 ? float(t + 1) : 1.0f);
    dev.upload(r, in[r]);
    poison_masked(group.rank(r));
  }
  for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], in[r].num_tokens, stream);
  for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
  for (int r = 0; r < P; ++r) group.rank(r).check(stream);
  // seen[s][t][slot]
  std::vector<int> seen(size_t(P) * c.max_tokens * c.num_slots, 0);
  int64_t rows = 0;
  for (int dst = 0; dst < P; ++dst) {
    EpBuffer& b = group.rank(dst);
    const moekit::MaskedLayout l = b.masked_layout();
    const auto count = to_host(b.recv_count(), E);
    const auto scales = to_host(b.recv_scales(), l.scale_elems());
    const auto x = to_host(b.recv_x(), l.a_elems());
    for (int e = 0; e < E; ++e)
      for (int m = 0; m < count[e]; ++m) {
        const int s = int(std::lround(scales[l.scale_offset(e, m, 0)] * 448.0f)) - 1;
        const int t = int(std::lround(scales[l.scale_offset(e, m, 1)] * 448.0f)) - 1;
        ASSERT_TRUE(s >= 0 && s < P && t >= 0 && t < in[s].num_tokens) << "row decodes to source " << s << " token " << t;
        EXPECT_EQ(x[l.a_offset(e, m)], 0x7E) << "448 / scale encodes as the largest fp8 value";
        ++seen[(size_t(s) * c.max_tokens + t) * c.num_slots + dst * E + e];
        ++rows;
      }
  }
  int64_t pairs = 0;
  for (int s = 0; s < P; ++s)
    for (int t = 0; t < in[s].num_tokens; ++t)
      for (int j = 0; j < k; ++j) {
        const int slot = in[s].topk_idx[size_t(t) * k + j];
        if (slot < 0) continue;
        ++pairs;
        EXPECT_EQ(seen[(size_t(s) * c.max_tokens + t) * c.num_slots + slot], 1)
            << "source " << s << " token " << t << " slot " << slot;
      }
  EXPECT_EQ(rows, pairs) << "rows delivered to a slot the token did not pick";
}

// One whole step (every rank's four calls) captured once and replayed with new routing, data and
// token counts held in the same device buffers.
TEST_P(EpLocal, GraphCaptureAndReplay) {
  const Shape shape = GetParam();
  const EpConfig c = make_config(shape);
  const int P = c.num_ranks;
  EpLocalGroup group(c);
  DeviceStep dev(c);
  std::mt19937 rng(7);
  // Token counts are a launch argument (host side), so the captured step keeps them; only data,
  // routing and expert outputs change between replays.
  std::vector<int> tokens(P);
  for (int r = 0; r < P; ++r) tokens[r] = std::max(c.max_tokens - r, 0);
  cudaGraph_t graph;
  MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], tokens[r], stream);
  for (int r = 0; r < P; ++r) group.rank(r).dispatch_recv(stream);
  for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
  for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
  MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    std::vector<RankInput> in;
    for (int r = 0; r < P; ++r) {
      in.push_back(random_input(c, tokens[r], rng, replay));
      dev.upload(r, in[r]);
    }
    const Reference ref = masked_reference(c, in);
    // The expert outputs are inputs of the captured combine: the reference's counts say which rows exist.
    std::vector<std::vector<uint16_t>> y(P), add(P);
    for (int r = 0; r < P; ++r) {
      y[r] = random_y(c, ref.ranks[r].count, rng);
      MOEKIT_CUDA_CHECK(cudaMemcpy(dev.y[r], y[r].data(), y[r].size() * 2, cudaMemcpyHostToDevice));
      poison_masked(group.rank(r));
    }
    MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    for (int r = 0; r < P; ++r) ASSERT_EQ(compare_masked(group.rank(r), ref.ranks[r], r), 0) << "replay " << replay;
    const auto want = combine_reference(c, in, ref.row_of, y, add);
    for (int r = 0; r < P; ++r) compare_combine(to_host(dev.out[r], size_t(tokens[r]) * c.hidden), want[r], r);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

const Shape kShapes[] = {
    {1, 16, 256, 8, 4},    // one rank: the send writes the layout, the combine is one kernel (ep.h)
    {1, 64, 2944, 128, 4}, // ... gpt-oss-120b on one GPU: 128 experts, top-4, d = 2880 padded to 2944
    {1, 1200, 256, 8, 4},  // ... more tokens than the one-rank combine has warps: they loop
    {1, 3, 1152, 8, 4},    // ... 144 chunks: a token's second pass has work for half a warp's lanes
    {2, 16, 256, 8, 4},
    {4, 24, 384, 32, 6},
    {8, 32, 512, 64, 8},
    {8, 128, 7168, 256, 8},  // DeepSeek-V3 decode: 256 experts, top-8, d = 7168, 128 tokens per rank
    {8, 2, 7168, 256, 8},    // ... at 2 tokens per rank: combine_recv cuts each token over 4 CTAs
    {2, 600, 2944, 128, 4},  // more tokens per rank than CTAs: the combine receive's warp path
};
INSTANTIATE_TEST_SUITE_P(Shapes, EpLocal, ::testing::ValuesIn(kShapes),
                         [](const ::testing::TestParamInfo<Shape>& i) { return shape_name(i.param); });

// Normal mode: the contiguous layout (segments padded to block_m, padding rows zero with expert
// and source -1, rows past the total marked -1) against the masked reference re-laid out here,
// and against ep_cpu.h's normal protocol; then the combine over y [rows, d].
class EpNormal : public ::testing::TestWithParam<Shape>, public WithStream {};

TEST_P(EpNormal, ContiguousLayoutAndCombineMatchBothReferences) {
  const Shape shape = GetParam();
  const EpConfig c = make_config(shape, EpMode::kNormal);
  const int P = c.num_ranks, E = c.slots_per_rank(), d = c.hidden, kb = c.k_blocks(), cap = c.contiguous_rows();
  EpLocalGroup group(c);
  DeviceStep dev(c);
  std::mt19937 rng(4321 + P);
  for (int step = 0; step < 2; ++step) {
    // Step 1: token 2 of every rank has no expert (no message anywhere), and the combine adds
    // `add` (one rank's combine is one kernel over the receive's map, which that token is not in).
    std::vector<RankInput> in;
    for (int r = 0; r < P; ++r) {
      in.push_back(random_input(c, step == 0 ? c.max_tokens : c.max_tokens / 2 + r, rng, step));
      if (step == 1)
        for (int j = 0; j < c.topk; ++j) in[r].topk_idx[size_t(2) * c.topk + j] = -1;
      dev.upload(r, in[r]);
      EpBuffer& b = group.rank(r);
      MOEKIT_CUDA_CHECK(cudaMemset(b.recv_x(), 0x7F, size_t(cap) * d));
      MOEKIT_CUDA_CHECK(cudaMemset(b.recv_scales(), 0xFF, size_t(cap) * kb * 4));
      MOEKIT_CUDA_CHECK(cudaMemset(b.row_expert(), 0xEE, size_t(cap) * 4));
      MOEKIT_CUDA_CHECK(cudaMemset(b.recv_src(), 0xEE, size_t(cap) * 4));
    }
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], in[r].num_tokens, stream);
    for (int r = 0; r < P; ++r) group.rank(r).normal_dispatch_recv(stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);

    // Reference: the masked rows of each expert, moved into padded segments.
    const EpConfig masked_c = make_config(shape);
    const Reference ref = masked_reference(masked_c, in);
    const moekit::MaskedLayout ml{E, c.max_m(), d};
    std::vector<int> total(P);
    std::vector<std::vector<int>> seg_begin(P, std::vector<int>(E));
    for (int r = 0; r < P; ++r) {
      EpBuffer& b = group.rank(r);
      const MaskedRef& mr = ref.ranks[r];
      for (int e = 0; e < E; ++e) {
        seg_begin[r][e] = total[r];
        total[r] += (mr.count[e] + c.block_m - 1) / c.block_m * c.block_m;
      }
      ASSERT_EQ(to_host(b.recv_total_rows(), 1)[0], total[r]) << "rank " << r;
      EXPECT_EQ(to_host(b.recv_count(), E), mr.count) << "rank " << r;
      const auto x = to_host(b.recv_x(), size_t(cap) * d);
      const auto sc = to_host(b.recv_scales(), size_t(cap) * kb);
      const auto rexp = to_host(b.row_expert(), cap);
      const auto src = to_host(b.recv_src(), cap);
      int bad = 0;
      for (int row = 0; row < cap; ++row) {
        int e = -1, m = -1;
        for (int f = 0; f < E; ++f)
          if (row >= seg_begin[r][f] && row < seg_begin[r][f] + mr.count[f]) e = f, m = row - seg_begin[r][f];
        const int want_src = e >= 0 ? mr.src[size_t(e) * c.max_m() + m] : -1;
        if ((rexp[row] != e || src[row] != want_src) && bad++ < 5)
          ADD_FAILURE() << "rank " << r << " row " << row << ": expert " << rexp[row] << " source " << src[row]
                        << ", expected " << e << " and " << want_src;
        if (row >= total[r]) continue;
        std::vector<uint8_t> want_x(d, 0);
        if (e >= 0) std::memcpy(want_x.data(), &mr.x[ml.a_offset(e, m)], d);
        if (std::memcmp(&x[size_t(row) * d], want_x.data(), d) != 0 && bad++ < 5)
          ADD_FAILURE() << "rank " << r << " row " << row << " payload differs";
        for (int g = 0; g < kb; ++g) {
          const float want = e >= 0 ? mr.scales[ml.scale_offset(e, m, g)] : 0.0f;
          if (std::memcmp(&sc[size_t(g) * cap + row], &want, 4) != 0 && bad++ < 5)
            ADD_FAILURE() << "rank " << r << " row " << row << " scale " << g << " = " << sc[size_t(g) * cap + row]
                          << ", expected " << want;
        }
      }
      ASSERT_EQ(bad, 0) << "step " << step;
    }

    // Combine: y rows that hold a token get random values, every other row NaN.
    std::vector<std::vector<uint16_t>> y(P), add(P), y_masked(P);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int r = 0; r < P; ++r) {
      const auto rexp = to_host(group.rank(r).row_expert(), cap);
      y[r].assign(size_t(cap) * d, 0x7FC0);
      y_masked[r].assign(ml.out_elems(d), 0x7FC0);
      for (int e = 0; e < E; ++e)
        for (int m = 0; m < ref.ranks[r].count[e]; ++m)
          for (int i = 0; i < d; ++i) {
            const uint16_t v = float_to_bf16(normal(rng));
            y[r][size_t(seg_begin[r][e] + m) * d + i] = v;
            y_masked[r][ml.out_offset(e, m, d) + i] = v;
          }
      MOEKIT_CUDA_CHECK(cudaMemcpy(dev.y[r], y[r].data(), y[r].size() * 2, cudaMemcpyHostToDevice));
      MOEKIT_CUDA_CHECK(cudaMemset(dev.out[r], 0xFF, size_t(c.max_tokens) * d * 2));
      if (step == 1) {
        add[r] = random_input(c, in[r].num_tokens, rng).x;
        MOEKIT_CUDA_CHECK(cudaMemcpy(dev.add[r], add[r].data(), add[r].size() * 2, cudaMemcpyHostToDevice));
      }
    }
    for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).combine_recv(step == 1 ? dev.add[r] : nullptr, dev.out[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).check(stream);
    const auto want = combine_reference(masked_c, in, ref.row_of, y_masked, add);
    for (int r = 0; r < P; ++r) {
      const auto got = to_host(dev.out[r], size_t(in[r].num_tokens) * d);
      compare_combine(got, want[r], r);
      if (step == 1)
        EXPECT_TRUE(std::equal(got.begin() + 2 * d, got.begin() + 3 * d, add[r].begin() + 2 * d))
            << "rank " << r << ": a token with no expert gets add";
    }

    // ep_cpu.h's normal protocol on the same inputs.
    moekit::LocalEpGroup cpu(cpu_config(c));
    std::vector<std::vector<uint16_t>> cpu_out(P);
    std::vector<std::vector<int32_t>> cpu_rexp(P), cpu_src(P);
    std::vector<std::vector<uint8_t>> cpu_x(P);
    std::vector<std::vector<float>> cpu_sc(P);
    std::vector<int> cpu_total(P);
    moekit::run_ranks(cpu, [&](int r) {
      const moekit::ContiguousRecv cr = cpu.normal_notify(r, in[r].num_tokens, in[r].topk_idx.data());
      cpu_total[r] = cr.total_m;
      cpu_x[r].assign(size_t(cr.total_m) * d, 0);
      cpu_sc[r].assign(size_t(cr.total_m) * kb, 0.0f);
      cpu_rexp[r].assign(cr.total_m, 0);
      cpu_src[r].assign(cr.total_m, 0);
      cpu.normal_dispatch_send(r, in[r].x.data(), in[r].weights.data());
      cpu.normal_dispatch_recv(r, cpu_x[r].data(), cpu_sc[r].data(), cpu_rexp[r].data(), cpu_src[r].data());
      cpu.normal_combine_send(r, y[r].data());
      cpu_out[r].resize(size_t(in[r].num_tokens) * d);
      cpu.combine_recv(r, step == 1 ? add[r].data() : nullptr, cpu_out[r].data());
    });
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(cpu_total[r], total[r]) << "rank " << r;
      EpBuffer& b = group.rank(r);
      const int T = total[r];
      const auto x = to_host(b.recv_x(), size_t(T) * d);
      const auto sc = to_host(b.recv_scales(), size_t(cap) * kb);
      EXPECT_EQ(to_host(b.row_expert(), T), cpu_rexp[r]) << "rank " << r;
      EXPECT_EQ(to_host(b.recv_src(), T), cpu_src[r]) << "rank " << r;
      EXPECT_TRUE(x == cpu_x[r]) << "rank " << r << " payload differs from ep_cpu.h";
      for (int g = 0; g < kb; ++g)
        EXPECT_EQ(0, std::memcmp(&sc[size_t(g) * cap], &cpu_sc[r][size_t(g) * T], size_t(T) * 4)) << "rank " << r << " scales block " << g;
      compare_combine(to_host(dev.out[r], size_t(in[r].num_tokens) * d), cpu_out[r], r);
    }
  }
}

const Shape kNormalShapes[] = {
    {2, 48, 256, 8, 4},
    {4, 64, 512, 32, 8},
    {1, 1200, 2944, 128, 4},  // gpt-oss-120b's prefill on one rank: more tokens than CTAs
    {1, 24, 256, 8, 4},       // one rank, fewer tokens than CTAs: a CTA per token
    {4, 300, 512, 32, 8},
};
INSTANTIATE_TEST_SUITE_P(Shapes, EpNormal, ::testing::ValuesIn(kNormalShapes),
                         [](const ::testing::TestParamInfo<Shape>& i) { return shape_name(i.param); });

// One rank in normal mode places its rows after its CTAs share the step's totals: the CTAs wait for
// the last one only where the GPU holds the whole grid at once. A grid of 1024 CTAs (more than an
// H100 or H200 holds) on enough tokens for the look-back must count the totals directly instead of
// waiting for a CTA that cannot start: the same layout as the device's grid, and no timeout.
class EpOneRankNormal : public ::testing::Test, public WithStream {};
TEST_F(EpOneRankNormal, GridLargerThanTheGpuHoldsGivesTheSameLayout) {
  EpConfig c = make_config({1, 1200, 256, 8, 2}, EpMode::kNormal);
  EpConfig wide = c;
  wide.num_ctas = 1024;
  const int cap = c.contiguous_rows(), d = c.hidden, kb = c.k_blocks(), E = c.slots_per_rank();
  ASSERT_EQ(wide.contiguous_rows(), cap);
  EpLocalGroup narrow_group(c), wide_group(wide);
  DeviceStep dev(c);
  std::mt19937 rng(17);
  dev.upload(0, random_input(c, c.max_tokens, rng));
  for (EpLocalGroup* g : {&narrow_group, &wide_group}) {
    EpBuffer& b = g->rank(0);
    MOEKIT_CUDA_CHECK(cudaMemset(b.recv_x(), 0x7F, size_t(cap) * d));
    MOEKIT_CUDA_CHECK(cudaMemset(b.row_expert(), 0xEE, size_t(cap) * 4));
    b.dispatch_send(dev.x[0], dev.idx[0], dev.w[0], c.max_tokens, stream);
    b.normal_dispatch_recv(stream);
    b.check(stream);
  }
  EpBuffer &n = narrow_group.rank(0), &w = wide_group.rank(0);
  const int total = to_host(n.recv_total_rows(), 1)[0];
  ASSERT_GT(total, 0);
  EXPECT_EQ(to_host(w.recv_total_rows(), 1)[0], total);
  EXPECT_EQ(to_host(w.recv_count(), E), to_host(n.recv_count(), E));
  EXPECT_EQ(to_host(w.row_expert(), cap), to_host(n.row_expert(), cap));
  EXPECT_EQ(to_host(w.recv_src(), cap), to_host(n.recv_src(), cap));
  EXPECT_TRUE(to_host(w.recv_x(), size_t(total) * d) == to_host(n.recv_x(), size_t(total) * d));
  EXPECT_TRUE(to_host(w.recv_scales(), size_t(cap) * kb) == to_host(n.recv_scales(), size_t(cap) * kb));
}

class EpFaults : public ::testing::Test, public WithStream {};

// A rank that never sends: its peers' receive times out and reports rank, peer and step; nothing
// hangs (the whole test is bounded by the timeouts).
TEST_F(EpFaults, SilentPeerTimesOutWithRankPeerAndStep) {
  EpConfig c = make_config({4, 8, 256, 16, 4});
  c.timeout_s = 0.05;
  EpLocalGroup group(c);
  DeviceStep dev(c);
  std::mt19937 rng(5);
  std::vector<RankInput> in;
  for (int r = 0; r < 4; ++r) {
    in.push_back(random_input(c, 8, rng));
    dev.upload(r, in[r]);
  }
  // Step 1 completes normally (so the failure is at step 2, not at the first step).
  for (int r = 0; r < 4; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], 8, stream);
  for (int r = 0; r < 4; ++r) group.rank(r).dispatch_recv(stream);
  for (int r = 0; r < 4; ++r) group.rank(r).check(stream);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < 3; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], 8, stream);  // rank 3 is silent
  group.rank(1).dispatch_recv(stream);
  try {
    group.rank(1).check(stream);
    FAIL() << "a silent peer must make the receive fail";
  } catch (const moekit::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("EP rank 1: dispatch_recv timed out"), std::string::npos) << msg;
    EXPECT_NE(msg.find("waiting for rank 3 at step 2"), std::string::npos) << msg;
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 5.0) << "the timeout is 0.05 s";
  // The record was cleared by the throw.
  EXPECT_NO_THROW(group.rank(1).check(stream));
}

// Host-side arguments of a live buffer (the config's own checks and a host copy of topk_idx:
// tests/host/test_ep_config.cu).
TEST_F(EpFaults, BadConfigAndArgumentsAreRejectedBeforeAnyKernel) {
  EpConfig c = make_config({4, 8, 256, 16, 4});
  EpLocalGroup group(c);
  DeviceStep dev(c);
  EXPECT_THROW(group.rank(0).dispatch_send(dev.x[0], dev.idx[0], dev.w[0], 9, stream), moekit::Error);  // T > T_max
  EXPECT_THROW(group.rank(0).dispatch_recv(stream), moekit::Error);               // out of order
  EXPECT_THROW(group.rank(0).normal_dispatch_recv(stream), moekit::Error);        // wrong mode
  EXPECT_THROW(group.rank(0).combine_send(nullptr, stream), moekit::Error);

  // An undersized symmetric region.
  EpPeers peers;
  peers.symmetric = dev.x[0];
  peers.symmetric_bytes = ep_memory(c).symmetric_bytes - 16;
  for (int r = 0; r < 4; ++r) {
    peers.peer_dispatch.push_back(dev.x[r]);
    peers.peer_combine.push_back(dev.x[r]);
  }
  try {
    EpBuffer b(c, 0, EpTransport::kLocal, peers);
    FAIL() << "accepted an undersized symmetric region";
  } catch (const moekit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("undersized"), std::string::npos) << e.what();
  }
}

// Slot ids live on the device: the send kernel skips a bad entry, still completes the step (the
// peers are not left waiting) and check() names the token, the entry and the value.
TEST_F(EpFaults, BadSlotOnTheDeviceIsReportedAndSkipped) {
  const EpConfig c = make_config({2, 4, 256, 8, 2});
  EpLocalGroup group(c);
  DeviceStep dev(c);
  std::mt19937 rng(3);
  for (int r = 0; r < 2; ++r) {
    RankInput in = random_input(c, 4, rng);
    if (r == 1) {
      in.topk_idx[2 * 2 + 1] = 8;  // token 2, entry 1: one past the last slot
      in.topk_idx[3 * 2 + 0] = 1;
      in.topk_idx[3 * 2 + 1] = 1;  // token 3 repeats slot 1
    }
    dev.upload(r, in);
  }
  for (int r = 0; r < 2; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], 4, stream);
  for (int r = 0; r < 2; ++r) group.rank(r).dispatch_recv(stream);
  EXPECT_NO_THROW(group.rank(0).check(stream));
  try {
    group.rank(1).check(stream);
    FAIL() << "an out-of-range slot must be reported";
  } catch (const moekit::Error& e) {
    const std::string msg = e.what();
    const bool names_it = msg.find("topk_idx[2][1] = 8") != std::string::npos || msg.find("topk_idx[3][1] = 1") != std::string::npos;
    EXPECT_TRUE(names_it) << msg;
  }
  // The step completed on both ranks, so the next one runs.
  for (int r = 0; r < 2; ++r) group.rank(r).combine_send(dev.y[r], stream);
  for (int r = 0; r < 2; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
  for (int r = 0; r < 2; ++r) EXPECT_NO_THROW(group.rank(r).check(stream));
}

// A step whose contiguous layout needs more rows than max_recv_rows: check() names both counts,
// total_rows reads 0, and no row is written (every row_expert -1, the payload untouched), whether
// one rank's send places the rows or the receive does; the step still completes, so the next runs.
TEST_F(EpFaults, ContiguousCapacityIsReportedAndNothingIsPlaced) {
  for (const int P : {1, 2}) {
    EpConfig c = make_config({P, 256, 256, 8, 2}, EpMode::kNormal);
    c.max_recv_rows = 128;
    const int cap = c.contiguous_rows(), d = c.hidden;
    ASSERT_EQ(cap, 128);
    EpLocalGroup group(c);
    DeviceStep dev(c);
    std::mt19937 rng(11 + P);
    for (int r = 0; r < P; ++r) {
      dev.upload(r, random_input(c, c.max_tokens, rng));
      EpBuffer& b = group.rank(r);
      MOEKIT_CUDA_CHECK(cudaMemset(b.recv_x(), 0x7F, size_t(cap) * d));
      MOEKIT_CUDA_CHECK(cudaMemset(b.row_expert(), 0xEE, size_t(cap) * 4));
    }
    for (int r = 0; r < P; ++r) group.rank(r).dispatch_send(dev.x[r], dev.idx[r], dev.w[r], c.max_tokens, stream);
    for (int r = 0; r < P; ++r) group.rank(r).normal_dispatch_recv(stream);
    for (int r = 0; r < P; ++r) {
      EpBuffer& b = group.rank(r);
      try {
        b.check(stream);
        FAIL() << "P = " << P << ", rank " << r << ": a layout past max_recv_rows must be reported";
      } catch (const moekit::Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("the buffer has 128 (raise max_recv_rows)"), std::string::npos) << msg;
      }
      EXPECT_EQ(to_host(b.recv_total_rows(), 1)[0], 0) << "P = " << P << ", rank " << r;
      const auto rexp = to_host(b.row_expert(), cap);
      EXPECT_EQ(std::count(rexp.begin(), rexp.end(), -1), cap) << "P = " << P << ", rank " << r;
      const auto x = to_host(b.recv_x(), size_t(cap) * d);
      EXPECT_EQ(std::count(x.begin(), x.end(), uint8_t(0x7F)), int64_t(cap) * d) << "P = " << P << ", rank " << r;
    }
    for (int r = 0; r < P; ++r) group.rank(r).combine_send(dev.y[r], stream);
    for (int r = 0; r < P; ++r) group.rank(r).combine_recv(nullptr, dev.out[r], stream);
    for (int r = 0; r < P; ++r) EXPECT_NO_THROW(group.rank(r).check(stream)) << "P = " << P;
  }
}

}  // namespace
