// GPU dispatch/combine over the `local` transport (P virtual ranks on one GPU) against two
// references: a direct host computation written here from quant.h and layout.h (the canonical
// order walked source by source, no messages), and the CPU protocol of ep_cpu.h (threads as
// ranks). Dispatch outputs must be equal bit for bit; combine within BF16 rounding (the kernels
// use the reference's operation order, so exact equality is also counted and reported).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moekit/bf16.h"
#include "moekit/cuda_check.h"
#include "moekit/ep.h"
#include "moekit/ep_cpu.h"
#include "moekit/layout.h"
#include "moekit/quant.h"

using moekit::bf16_to_float;
using moekit::float_to_bf16;
using namespace moekit::gpu;

namespace {

struct Shape {
  int num_ranks, max_tokens, hidden, num_slots, topk;
};

std::string shape_name(const Shape& s) {
  return "P" + std::to_string(s.num_ranks) + "_T" + std::to_string(s.max_tokens) + "_d" + std::to_string(s.hidden) +
         "_E" + std::to_string(s.num_slots) + "_k" + std::to_string(s.topk);
}

EpConfig make_config(const Shape& s, EpMode mode = EpMode::kLowLatency) {
  EpConfig c;
  c.num_ranks = s.num_ranks;
  c.max_tokens = s.max_tokens;
  c.hidden = s.hidden;
  c.num_slots = s.num_slots;
  c.topk = s.topk;
  c.mode = mode;
  c.block_m = 64;
  c.timeout_s = 5.0;
  return c;
}

// One rank's inputs for one step.
struct RankInput {
  int num_tokens = 0;
  std::vector<uint16_t> x;        // [T, d] bf16
  std::vector<int32_t> topk_idx;  // [T, k]
  std::vector<float> weights;     // [T, k]
};

// Random tokens: every 128-group gets its own magnitude (2^-8 .. 2^8) so the scales differ, and
// about one group in 16 is all zero (the kMinAmax clamp). Slots are distinct per token; a few
// entries are -1. `hot` > 0 skews routing: that many slots take half of all picks.
RankInput random_input(const EpConfig& c, int num_tokens, std::mt19937& rng, int hot = 0) {
  RankInput in;
  in.num_tokens = num_tokens;
  const int d = c.hidden, k = c.topk;
  in.x.resize(size_t(num_tokens) * d);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp_dist(-8, 8), slot(0, c.num_slots - 1), coin(0, 15), hot_slot(0, std::max(hot, 1) - 1);
  for (int t = 0; t < num_tokens; ++t)
    for (int g = 0; g < d / moekit::kQuantBlock; ++g) {
      const float mag = std::ldexp(1.0f, exp_dist(rng));
      const bool zero = coin(rng) == 0;
      for (int i = 0; i < moekit::kQuantBlock; ++i)
        in.x[size_t(t) * d + g * moekit::kQuantBlock + i] = float_to_bf16(zero ? 0.0f : mag * normal(rng));
    }
  in.topk_idx.resize(size_t(num_tokens) * k);
  in.weights.resize(size_t(num_tokens) * k);
  std::uniform_real_distribution<float> wdist(0.05f, 1.0f);
  for (int t = 0; t < num_tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      int s;
      bool fresh;
      do {
        s = (hot > 0 && coin(rng) < 8) ? hot_slot(rng) : slot(rng);
        fresh = true;
        for (int i = 0; i < j; ++i) fresh = fresh && in.topk_idx[size_t(t) * k + i] != s;
      } while (!fresh);
      in.topk_idx[size_t(t) * k + j] = s;
      in.weights[size_t(t) * k + j] = wdist(rng);
    }
    if (coin(rng) == 0) in.topk_idx[size_t(t) * k + (t % k)] = -1;  // a token with one expert fewer
  }
  return in;
}

// The direct reference: masked layout of every rank, and the row map for the combine.
struct MaskedRef {
  std::vector<int> count;                // [E_loc]
  std::vector<uint8_t> x;                // [E_loc, M_max, d]
  std::vector<float> scales;             // layout.h order
  std::vector<int> src;                  // [E_loc, M_max]
};

struct Reference {
  std::vector<MaskedRef> ranks;
  // row_of[src][t][j]: row (e * M_max + m) on rank slot/E_loc of entry j of token t of src, or -1.
  std::vector<std::vector<int>> row_of;
};

Reference masked_reference(const EpConfig& c, const std::vector<RankInput>& in) {
  const int P = c.num_ranks, E = c.slots_per_rank(), d = c.hidden, k = c.topk, kb = c.k_blocks();
  const moekit::MaskedLayout lay{E, c.max_m(), d};
  Reference ref;
  std::vector<std::vector<uint8_t>> q(P);
  std::vector<std::vector<float>> qs(P);
  for (int s = 0; s < P; ++s) {
    const int T = in[s].num_tokens;
    q[s].resize(size_t(T) * d);
    qs[s].resize(size_t(T) * kb);
    std::vector<float> row(d);
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < d; ++i) row[i] = bf16_to_float(in[s].x[size_t(t) * d + i]);
      moekit::quantize_row_fp8(row.data(), d, q[s].data() + size_t(t) * d, qs[s].data() + size_t(t) * kb, 1);
    }
    ref.row_of.emplace_back(size_t(T) * k, -1);
  }
  for (int dst = 0; dst < P; ++dst) {
    MaskedRef r;
    r.count.assign(E, 0);
    r.x.assign(lay.a_elems(), 0);
    r.scales.assign(lay.scale_elems(), 0.0f);
    r.src.assign(size_t(E) * c.max_m(), -1);
    for (int e = 0; e < E; ++e)
      for (int s = 0; s < P; ++s)
        for (int t = 0; t < in[s].num_tokens; ++t)
          for (int j = 0; j < k; ++j)
            if (in[s].topk_idx[size_t(t) * k + j] == dst * E + e) {
              const int m = r.count[e]++;
              std::memcpy(&r.x[lay.a_offset(e, m)], &q[s][size_t(t) * d], d);
              for (int b = 0; b < kb; ++b) r.scales[lay.scale_offset(e, m, b)] = qs[s][size_t(t) * kb + b];
              r.src[size_t(e) * c.max_m() + m] = s * c.max_tokens + t;
              ref.row_of[s][size_t(t) * k + j] = e * c.max_m() + m;
            }
    ref.ranks.push_back(std::move(r));
  }
  return ref;
}

// out[s][t] = bf16(add + sum over target ranks ascending of bf16(sum over entries on that rank in
// top-k order of w * y)), fp32 throughout, as ep.h specifies.
std::vector<std::vector<uint16_t>> combine_reference(const EpConfig& c, const std::vector<RankInput>& in,
                                                     const std::vector<std::vector<int>>& row_of,
                                                     const std::vector<std::vector<uint16_t>>& y,
                                                     const std::vector<std::vector<uint16_t>>& add) {
  const int P = c.num_ranks, E = c.slots_per_rank(), d = c.hidden, k = c.topk;
  std::vector<std::vector<uint16_t>> out(P);
  for (int s = 0; s < P; ++s) {
    const int T = in[s].num_tokens;
    out[s].resize(size_t(T) * d);
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < d; ++i) {
        float acc = add[s].empty() ? 0.0f : bf16_to_float(add[s][size_t(t) * d + i]);
        for (int r = 0; r < P; ++r) {
          float part = 0.0f;
          bool any = false;
          for (int j = 0; j < k; ++j) {
            const int slot = in[s].topk_idx[size_t(t) * k + j];
            if (slot < 0 || slot / E != r) continue;
            any = true;
            const int row = row_of[s][size_t(t) * k + j];
            part += in[s].weights[size_t(t) * k + j] * bf16_to_float(y[r][size_t(row) * d + i]);
          }
          if (any) acc += bf16_to_float(float_to_bf16(part));
        }
        out[s][size_t(t) * d + i] = float_to_bf16(acc);
      }
  }
  return out;
}

template <class T>
T* to_device(const std::vector<T>& v) {
  T* p = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (!v.empty()) MOEKIT_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <class T>
std::vector<T> to_host(const T* p, size_t n) {
  std::vector<T> v(n);
  if (n) MOEKIT_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// Device copies of one step's inputs, at fixed addresses (graph replays reuse them).
struct DeviceStep {
  std::vector<uint16_t*> x, y, add, out;
  std::vector<int32_t*> idx;
  std::vector<float*> w;
  DeviceStep(const EpConfig& c) {
    const int P = c.num_ranks;
    const size_t xt = size_t(c.max_tokens) * c.hidden, yr = size_t(c.slots_per_rank()) * c.max_m() * c.hidden;
    for (int r = 0; r < P; ++r) {
      x.push_back(to_device(std::vector<uint16_t>(xt)));
      add.push_back(to_device(std::vector<uint16_t>(xt)));
      out.push_back(to_device(std::vector<uint16_t>(xt)));
      y.push_back(to_device(std::vector<uint16_t>(c.mode == EpMode::kLowLatency ? yr : size_t(c.contiguous_rows()) * c.hidden)));
      idx.push_back(to_device(std::vector<int32_t>(size_t(c.max_tokens) * c.topk)));
      w.push_back(to_device(std::vector<float>(size_t(c.max_tokens) * c.topk)));
    }
  }
  ~DeviceStep() {
    for (auto* v : {&x, &y, &add, &out})
      for (auto* p : *v) cudaFree(p);
    for (auto* p : idx) cudaFree(p);
    for (auto* p : w) cudaFree(p);
  }
  void upload(int r, const RankInput& in) {
    MOEKIT_CUDA_CHECK(cudaMemcpy(x[r], in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaMemcpy(idx[r], in.topk_idx.data(), in.topk_idx.size() * 4, cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaMemcpy(w[r], in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice));
  }
};

// Random expert outputs for the rows that exist; NaN in every other row, so a combine that reads a
// row it should not turns the result into NaN.
std::vector<uint16_t> random_y(const EpConfig& c, const std::vector<int>& count, std::mt19937& rng) {
  const int d = c.hidden, M = c.max_m();
  std::vector<uint16_t> y(size_t(c.slots_per_rank()) * M * d, 0x7FC0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int e = 0; e < c.slots_per_rank(); ++e)
    for (int m = 0; m < count[e]; ++m)
      for (int i = 0; i < d; ++i) y[(size_t(e) * M + m) * d + i] = float_to_bf16(normal(rng));
  return y;
}

void poison_masked(EpBuffer& b) {
  const moekit::MaskedLayout l = b.masked_layout();
  MOEKIT_CUDA_CHECK(cudaMemset(b.recv_x(), 0x7F, l.a_elems()));
  MOEKIT_CUDA_CHECK(cudaMemset(b.recv_scales(), 0xFF, l.scale_elems() * 4));
  MOEKIT_CUDA_CHECK(cudaMemset(b.recv_src(), 0xEE, size_t(l.num_experts) * l.max_m * 4));
  MOEKIT_CUDA_CHECK(cudaMemset(b.recv_count(), 0xEE, size_t(l.num_experts) * 4));
}

// Compares rank r's masked output with the reference (rows below the count only); returns the
// number of mismatching fields and prints the first few.
int compare_masked(EpBuffer& b, const MaskedRef& ref, int rank) {
  const moekit::MaskedLayout l = b.masked_layout();
  const int E = l.num_experts, M = l.max_m, d = l.k, kb = l.k_blocks();
  int bad = 0;
  const auto count = to_host(b.recv_count(), E);
  for (int e = 0; e < E; ++e)
    if (count[e] != ref.count[e] && bad++ < 5)
      ADD_FAILURE() << "rank " << rank << " recv_count[" << e << "] = " << count[e] << ", expected " << ref.count[e];
  if (bad) return bad;
  const auto x = to_host(b.recv_x(), l.a_elems());
  const auto scales = to_host(b.recv_scales(), l.scale_elems());
  const auto src = to_host(b.recv_src(), size_t(E) * M);
  for (int e = 0; e < E; ++e)
    for (int m = 0; m < count[e]; ++m) {
      if (src[size_t(e) * M + m] != ref.src[size_t(e) * M + m] && bad++ < 5)
        ADD_FAILURE() << "rank " << rank << " recv_src[" << e << "][" << m << "] = " << src[size_t(e) * M + m]
                      << ", expected " << ref.src[size_t(e) * M + m];
      if (std::memcmp(&x[l.a_offset(e, m)], &ref.x[l.a_offset(e, m)], d) != 0 && bad++ < 5)
        ADD_FAILURE() << "rank " << rank << " recv_x row (" << e << ", " << m << ") differs";
      for (int g = 0; g < kb; ++g) {
        const size_t o = l.scale_offset(e, m, g);
        if (std::memcmp(&scales[o], &ref.scales[o], 4) != 0 && bad++ < 5)
          ADD_FAILURE() << "rank " << rank << " recv_scales(" << e << ", " << m << ", " << g << ") = " << scales[o]
                        << ", expected " << ref.scales[o];
      }
    }
  return bad;
}

// Combine outputs against the reference: within one bf16 rounding (relative 2^-8, or 1e-6
// absolute near zero); returns how many values were bit-identical.
size_t compare_combine(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int rank) {
  size_t exact = 0;
  int bad = 0;
  EXPECT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    const float g = bf16_to_float(got[i]), w = bf16_to_float(want[i]);
    exact += got[i] == want[i];
    const bool close = std::fabs(g - w) <= std::ldexp(std::fabs(w), -8) + 1e-6f;
    if (!close && bad++ < 5) ADD_FAILURE() << "rank " << rank << " out[" << i << "] = " << g << ", expected " << w;
  }
  return exact;
}

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
    moekit::EpConfig cc;
    cc.num_ranks = P;
    cc.max_tokens = c.max_tokens;
    cc.hidden = c.hidden;
    cc.topk = c.topk;
    cc.num_slots = c.num_slots;
    moekit::LocalEpGroup cpu(cc);
    const moekit::MaskedLayout lay = group.rank(0).masked_layout();
    std::vector<MaskedRef> cpu_out(P);
    std::vector<std::vector<uint16_t>> cpu_comb(P);
    moekit::run_ranks(cpu, [&](int r) {
      MaskedRef& o = cpu_out[r];
      o.count.assign(lay.num_experts, 0);
      o.x.assign(lay.a_elems(), 0);
      o.scales.assign(lay.scale_elems(), 0.0f);
      o.src.assign(size_t(lay.num_experts) * lay.max_m, -1);
      cpu.dispatch_send(r, in[r].num_tokens, in[r].x.data(), in[r].topk_idx.data(), in[r].weights.data());
      cpu.dispatch_recv(r, o.x.data(), o.scales.data(), o.count.data(), o.src.data());
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
  for (int r = 0; r < P; ++r) tokens[r] = c.max_tokens - r;
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
    {2, 16, 256, 8, 4},
    {4, 24, 384, 32, 6},
    {8, 32, 512, 64, 8},
    {8, 128, 7168, 256, 8},  // DeepSeek-V3 decode: 256 experts, top-8, d = 7168, 128 tokens per rank
};
INSTANTIATE_TEST_SUITE_P(Shapes, EpLocal, ::testing::ValuesIn(kShapes),
                         [](const ::testing::TestParamInfo<Shape>& i) { return shape_name(i.param); });

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

TEST_F(EpFaults, BadConfigAndArgumentsAreRejectedBeforeAnyKernel) {
  EpConfig c = make_config({4, 8, 256, 16, 4});
  auto rejects = [](EpConfig bad, const char* what) {
    try {
      bad.validate();
      ADD_FAILURE() << "accepted " << what;
    } catch (const moekit::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  EpConfig bad = c;
  bad.hidden = 200;
  rejects(bad, "hidden (d) = 200");
  bad = c;
  bad.num_slots = 18;
  rejects(bad, "num_slots = 18");
  bad = c;
  bad.topk = 40;
  rejects(bad, "topk = 40");
  bad = c;
  bad.max_tokens = 0;
  rejects(bad, "max_tokens (T_max) = 0");

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

  // Host copies of topk_idx: checked before anything runs.
  std::vector<int32_t> idx = {0, 1, 2, 3, 4, 5, 5, 6};
  EXPECT_THROW(validate_topk_idx(c, idx.data(), 2), moekit::Error);  // slot 5 twice in token 1
  idx = {0, 1, 2, 16, 4, 5, 6, 7};
  EXPECT_THROW(validate_topk_idx(c, idx.data(), 2), moekit::Error);  // slot 16 of 16
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

}  // namespace
