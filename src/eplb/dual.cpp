// Both barrier loads from a routing trace: GEMM rows (token-expert pairs) and received tokens
// after per-rank de-duplication (see rebalance_dual in include/moekit/eplb.h).
//
// Packing by counts balances GEMM rows, but the dispatch receive volume of a GPU is the number
// of distinct tokens that touch it: experts that tokens pick together cost one received token
// when they share a GPU and two when they do not. So two GPUs with equal rows can receive very
// different token counts. The search below routes every pair of the trace exactly as
// choose_replicas() will, and swaps slots while the worse of the two normalised loads drops.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "eplb/internal.h"
#include "moekit/check.h"
#include "moekit/eplb.h"
#include "moekit/limits.h"

namespace moekit {
namespace {

void check_trace_fits(const Placement& p, const RoutingTrace& trace) {
  validate_trace(trace);
  MOEKIT_CHECK(trace.num_experts == p.num_experts,
               fmt::format("dual loads: trace has {} experts, the placement {}", trace.num_experts, p.num_experts));
  MOEKIT_CHECK(trace.num_layers() == p.num_layers,
               fmt::format("dual loads: trace has {} layers, the placement {}", trace.num_layers(), p.num_layers));
}

// The rank (GPU) of token t of a step of T tokens, as choose_replicas() defines it.
int rank_of(int64_t t, int64_t T, int num_gpus) { return int(t * num_gpus / T); }

// One layer's routing state: every (step, token, j) pair of the trace routed to a slot, with
// per-GPU rows and de-duplicated received tokens kept up to date as slots are swapped.
class LayerRouting {
 public:
  LayerRouting(const RoutingTrace& trace, int layer, std::vector<int32_t> slot, int num_experts, int num_gpus,
               uint64_t seed)
      : slot_(std::move(slot)),
        num_gpus_(num_gpus),
        per_gpu_(int(slot_.size()) / num_gpus),
        replicas_(num_experts),
        pairs_of_(num_experts),
        rows_(num_gpus, 0),
        recv_(num_gpus, 0) {
    const int k = trace.topk;
    for (const auto& step : trace.layers[layer]) {
      const int64_t T = int64_t(step.size()) / k;
      for (int64_t t = 0; t < T; ++t) {
        const int token = num_tokens_++;
        for (int j = 0; j < k; ++j) {
          const int32_t e = step[t * k + j];
          pairs_of_[e].push_back(int(expert_.size()));
          expert_.push_back(e);
          token_.push_back(token);
          rank_.push_back(rank_of(t, T, num_gpus));
          hash_.push_back(eplb_detail::pair_hash(seed, t, e));
        }
      }
    }
    cnt_.assign(size_t(num_tokens_) * num_gpus, 0);
    choice_.assign(expert_.size(), -1);
    for (int e = 0; e < num_experts; ++e) rebuild_replicas(e), route(e);
  }

  // Exchange the experts of two slots and re-route every pair of both experts.
  void swap_slots(int s1, int s2) {
    const int a = slot_[s1], b = slot_[s2];
    std::swap(slot_[s1], slot_[s2]);
    for (int e : {a, b}) rebuild_replicas(e), route(e);
  }

  const std::vector<int32_t>& slots() const { return slot_; }
  const std::vector<int64_t>& rows() const { return rows_; }
  const std::vector<int64_t>& recv() const { return recv_; }
  int64_t num_pairs() const { return int64_t(expert_.size()); }
  int64_t pairs_of(int e) const { return int64_t(pairs_of_[e].size()); }

 private:
  // Replicas in slot order, which is log2phy order of a placement built from phy2log.
  void rebuild_replicas(int e) {
    replicas_[e].clear();
    for (int s = 0; s < int(slot_.size()); ++s)
      if (slot_[s] == e) replicas_[e].push_back(s);
  }

  void route(int e) {
    const std::vector<int32_t>& reps = replicas_[e];
    for (int i : pairs_of_[e]) {
      if (choice_[i] >= 0) move_pair(i, choice_[i] / per_gpu_, -1);
      choice_[i] = eplb_detail::pick_replica(reps.data(), int(reps.size()), per_gpu_, rank_[i], hash_[i]);
      move_pair(i, choice_[i] / per_gpu_, +1);
    }
  }

  void move_pair(int i, int gpu, int delta) {
    rows_[gpu] += delta;
    int& c = cnt_[size_t(token_[i]) * num_gpus_ + gpu];
    if (delta > 0 && c++ == 0) ++recv_[gpu];
    if (delta < 0 && --c == 0) --recv_[gpu];
  }

  std::vector<int32_t> slot_;
  int num_gpus_, per_gpu_, num_tokens_ = 0;
  std::vector<std::vector<int32_t>> replicas_;
  std::vector<std::vector<int>> pairs_of_;
  std::vector<int32_t> expert_, token_, rank_, choice_;
  std::vector<uint64_t> hash_;
  std::vector<int> cnt_;  // [token][gpu]: pairs of the token routed to the GPU
  std::vector<int64_t> rows_, recv_;
};

// The larger of a GPU's two normalised loads, and the layer figure the search lowers:
// (max over GPUs, sum of squares as a tie-break so that plateaus of equal maxima still move).
struct Score {
  double max = 0, sum_sq = 0;
  bool better_than(const Score& o) const {
    const double eps = 1e-12;
    return max < o.max - eps || (max <= o.max + eps && sum_sq < o.sum_sq - eps);
  }
};

Score score(const std::vector<int64_t>& rows, const std::vector<int64_t>& recv, double rows_norm, double recv_norm) {
  Score s;
  for (size_t g = 0; g < rows.size(); ++g) {
    const double v = std::max(rows[g] / rows_norm, recv[g] / recv_norm);
    s.max = std::max(s.max, v);
    s.sum_sq += v * v;
  }
  return s;
}

// Worst over layers of max(max rows / rows_norm, max recv / recv_norm), per-layer norms.
double worst_imbalance(const DualLoads& loads, const std::vector<double>& rows_norm,
                       const std::vector<double>& recv_norm) {
  double worst = 0;
  const int G = loads.num_gpus;
  for (size_t l = 0; l < rows_norm.size(); ++l)
    for (int g = 0; g < G; ++g)
      worst = std::max({worst, loads.gemm_rows[l * G + g] / rows_norm[l], loads.recv_tokens[l * G + g] / recv_norm[l]});
  return worst;
}

}  // namespace

std::vector<std::vector<double>> trace_loads(const RoutingTrace& trace) {
  validate_trace(trace);
  std::vector<std::vector<double>> w(trace.num_layers(), std::vector<double>(trace.num_experts, 0.0));
  for (int l = 0; l < trace.num_layers(); ++l)
    for (const auto& step : trace.layers[l])
      for (int32_t e : step) w[l][e] += 1;
  return w;
}

DualLoads dual_loads(const Placement& p, const RoutingTrace& trace, uint64_t seed) {
  check_trace_fits(p, trace);
  DualLoads d;
  d.num_gpus = p.num_gpus;
  d.gemm_rows.assign(size_t(p.num_layers) * p.num_gpus, 0);
  d.recv_tokens.assign(size_t(p.num_layers) * p.num_gpus, 0);
  const int k = trace.topk, per_gpu = p.slots_per_gpu();
  std::vector<int32_t> slot;
  std::vector<int> last_token(p.num_gpus);
  for (int l = 0; l < p.num_layers; ++l) {
    int64_t* rows = &d.gemm_rows[size_t(l) * p.num_gpus];
    int64_t* recv = &d.recv_tokens[size_t(l) * p.num_gpus];
    for (const auto& step : trace.layers[l]) {
      const int T = int(step.size()) / k;
      slot.resize(step.size());
      choose_replicas(p, l, step.data(), T, k, seed, slot.data());
      std::fill(last_token.begin(), last_token.end(), -1);
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) {
          const int g = slot[size_t(t) * k + j] / per_gpu;
          ++rows[g];
          if (last_token[g] != t) last_token[g] = t, ++recv[g];  // once per token and GPU
        }
    }
  }
  return d;
}

DualResult rebalance_dual(const RoutingTrace& trace, int num_slots, int num_groups, int num_nodes, int num_gpus,
                          uint64_t seed, bool balance_recv) {
  DualResult r;
  const std::vector<std::vector<double>> counts = trace_loads(trace);
  r.counts_placement = rebalance(counts, num_slots, num_groups, num_nodes, num_gpus);
  // The search keeps a counter per token and GPU of each layer: bound that table first.
  for (int l = 0; l < trace.num_layers(); ++l) {
    int64_t tokens = 0;
    for (const auto& step : trace.layers[l]) tokens += int64_t(step.size()) / trace.topk;
    MOEKIT_CHECK(tokens <= kMaxTableEntries / num_gpus,
                 fmt::format("dual loads: layer {} of the trace holds {} tokens, and {} tokens x {} GPUs exceed the "
                             "limit of {} counters: use fewer steps",
                             l, tokens, tokens, num_gpus, kMaxTableEntries));
  }
  r.counts_loads = dual_loads(r.counts_placement, trace, seed);
  const Placement& base = r.counts_placement;
  const int L = base.num_layers, G = num_gpus, per_gpu = base.slots_per_gpu();

  // Normalisers shared by both placements: the mean rows (fixed by the trace) and the counts
  // placement's mean received tokens, so lowering the total receive volume counts as a gain.
  std::vector<double> rows_norm(L), recv_norm(L);
  for (int l = 0; l < L; ++l) {
    int64_t rows = 0, recv = 0;
    for (int g = 0; g < G; ++g)
      rows += r.counts_loads.gemm_rows[size_t(l) * G + g], recv += r.counts_loads.recv_tokens[size_t(l) * G + g];
    rows_norm[l] = std::max(1.0, double(rows) / G);
    recv_norm[l] = std::max(1.0, double(recv) / G);
  }

  std::vector<int32_t> phy2log(base.phy2log);
  for (int l = 0; l < L; ++l) {
    LayerRouting routing(trace, l, std::vector<int32_t>(base.phy2log_row(l), base.phy2log_row(l) + num_slots),
                         base.num_experts, G, seed);
    // Without balance_recv the search sees rows only (the comparison the tests draw).
    const double search_recv_norm = balance_recv ? recv_norm[l] : std::numeric_limits<double>::infinity();
    Score current = score(routing.rows(), routing.recv(), rows_norm[l], search_recv_norm);
    // First-improvement descent on swaps between the GPU with the largest normalised load and
    // the others (its node only when hierarchical), coolest partners first. The pair budget
    // bounds the time on long traces.
    int64_t budget = 100 * routing.num_pairs() + 100000;
    bool improved = true;
    while (improved && budget > 0) {
      improved = false;
      std::vector<double> v(G);
      for (int g = 0; g < G; ++g)
        v[g] = std::max(routing.rows()[g] / rows_norm[l], routing.recv()[g] / search_recv_norm);
      const int hot = int(std::max_element(v.begin(), v.end()) - v.begin());
      std::vector<int> partners;
      for (int g = 0; g < G; ++g)
        if (g != hot && (!base.hierarchical() || base.node_of_gpu(g) == base.node_of_gpu(hot))) partners.push_back(g);
      std::stable_sort(partners.begin(), partners.end(), [&](int a, int b) { return v[a] < v[b]; });
      for (int s1 = hot * per_gpu; s1 < (hot + 1) * per_gpu && !improved && budget > 0; ++s1)
        for (int h : partners) {
          for (int s2 = h * per_gpu; s2 < (h + 1) * per_gpu && !improved && budget > 0; ++s2) {
            const int a = routing.slots()[s1], b = routing.slots()[s2];
            if (a == b) continue;
            budget -= 2 * (routing.pairs_of(a) + routing.pairs_of(b));
            routing.swap_slots(s1, s2);
            Score next = score(routing.rows(), routing.recv(), rows_norm[l], search_recv_norm);
            if (next.better_than(current))
              current = next, improved = true;
            else
              routing.swap_slots(s1, s2);
          }
          if (improved || budget <= 0) break;
        }
    }
    std::copy(routing.slots().begin(), routing.slots().end(), phy2log.begin() + size_t(l) * num_slots);
  }
  r.placement = placement_from_phy2log(phy2log, L, base.num_experts, num_slots, num_groups, num_nodes, G);
  r.loads = dual_loads(r.placement, trace, seed);
  r.counts_worst_imbalance = worst_imbalance(r.counts_loads, rows_norm, recv_norm);
  r.worst_imbalance = worst_imbalance(r.loads, rows_norm, recv_norm);
  // The search routes replicas in slot order where the counts placement uses creation order,
  // so guard the promise: never worse than packing by counts.
  if (balance_recv && r.worst_imbalance > r.counts_worst_imbalance) {
    r.placement = r.counts_placement;
    r.loads = r.counts_loads;
    r.worst_imbalance = r.counts_worst_imbalance;
  }
  return r;
}

}  // namespace moekit
