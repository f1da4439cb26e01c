// Shared by the EP GPU tests: random inputs, the direct host reference of the low-latency
// protocol (canonical order walked source by source, from quant.h and layout.h: no messages, no
// positions) and the comparisons. Header-only, test code.
#pragma once

#include <gtest/gtest.h>

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

namespace ep_test {

using moekit::bf16_to_float;
using moekit::float_to_bf16;
using namespace moekit::gpu;

struct Shape {
  int num_ranks, max_tokens, hidden, num_slots, topk;
};

inline std::string shape_name(const Shape& s) {
  return "P" + std::to_string(s.num_ranks) + "_T" + std::to_string(s.max_tokens) + "_d" + std::to_string(s.hidden) +
         "_E" + std::to_string(s.num_slots) + "_k" + std::to_string(s.topk);
}

inline EpConfig make_config(const Shape& s, EpMode mode = EpMode::kLowLatency) {
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
inline RankInput random_input(const EpConfig& c, int num_tokens, std::mt19937& rng, int hot = 0) {
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

inline Reference masked_reference(const EpConfig& c, const std::vector<RankInput>& in) {
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
      moekit::quantize_row_fp8(row.data(), d, q[s].data() + size_t(t) * d, qs[s].data() + size_t(t) * kb, 1,
                               c.x_scaling);
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
inline std::vector<std::vector<uint16_t>> combine_reference(const EpConfig& c, const std::vector<RankInput>& in,
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

// ep_cpu.h's config of the same shape, padding and scaling.
inline moekit::EpConfig cpu_config(const EpConfig& c) {
  moekit::EpConfig cc;
  cc.num_ranks = c.num_ranks;
  cc.max_tokens = c.max_tokens;
  cc.hidden = c.hidden;
  cc.topk = c.topk;
  cc.num_slots = c.num_slots;
  cc.block_m = c.block_m;
  cc.x_scaling = c.x_scaling;
  return cc;
}

// Rank r's low-latency dispatch through ep_cpu.h (send and receive), as a MaskedRef.
inline MaskedRef cpu_dispatch(moekit::LocalEpGroup& cpu, int r, const moekit::MaskedLayout& lay, const RankInput& in) {
  MaskedRef o;
  o.count.assign(lay.num_experts, 0);
  o.x.assign(lay.a_elems(), 0);
  o.scales.assign(lay.scale_elems(), 0.0f);
  o.src.assign(size_t(lay.num_experts) * lay.max_m, -1);
  cpu.dispatch_send(r, in.num_tokens, in.x.data(), in.topk_idx.data(), in.weights.data());
  cpu.dispatch_recv(r, o.x.data(), o.scales.data(), o.count.data(), o.src.data());
  return o;
}

template <class T>
inline T* to_device(const std::vector<T>& v) {
  T* p = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (!v.empty()) MOEKIT_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <class T>
inline std::vector<T> to_host(const T* p, size_t n) {
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
    if (in.num_tokens == 0) return;
    MOEKIT_CUDA_CHECK(cudaMemcpy(x[r], in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaMemcpy(idx[r], in.topk_idx.data(), in.topk_idx.size() * 4, cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaMemcpy(w[r], in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice));
  }
};

// Random expert outputs for the rows that exist; NaN in every other row, so a combine that reads a
// row it should not turns the result into NaN.
inline std::vector<uint16_t> random_y(const EpConfig& c, const std::vector<int>& count, std::mt19937& rng) {
  const int d = c.hidden, M = c.max_m();
  std::vector<uint16_t> y(size_t(c.slots_per_rank()) * M * d, 0x7FC0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int e = 0; e < c.slots_per_rank(); ++e)
    for (int m = 0; m < count[e]; ++m)
      for (int i = 0; i < d; ++i) y[(size_t(e) * M + m) * d + i] = float_to_bf16(normal(rng));
  return y;
}

inline void poison_masked(EpBuffer& b) {
  const moekit::MaskedLayout l = b.masked_layout();
  MOEKIT_CUDA_CHECK(cudaMemset(b.recv_x(), 0x7F, l.a_elems()));
  MOEKIT_CUDA_CHECK(cudaMemset(b.recv_scales(), 0xFF, l.scale_elems() * 4));
  MOEKIT_CUDA_CHECK(cudaMemset(b.recv_src(), 0xEE, size_t(l.num_experts) * l.max_m * 4));
  MOEKIT_CUDA_CHECK(cudaMemset(b.recv_count(), 0xEE, size_t(l.num_experts) * 4));
}

// Compares rank r's masked output with the reference (rows below the count only); returns the
// number of mismatching fields and prints the first few.
inline int compare_masked(EpBuffer& b, const MaskedRef& ref, int rank) {
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
inline size_t compare_combine(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int rank) {
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

}  // namespace ep_test
