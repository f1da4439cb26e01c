// Load statistics (a sliding window or exponential decay of top-k counts) and the rebalance
// gate (docs/theory.md §EPLB gain: end-to-end gain 1 / (f / (S0/S1) + 1 - f)).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "eplb/internal.h"
#include "moekit/check.h"
#include "moekit/eplb.h"

namespace moekit {

LoadRecorder::LoadRecorder(int num_layers, int num_experts, int window, double factor)
    : num_layers_(num_layers), num_experts_(num_experts), window_(window), factor_(factor) {
  MOEKIT_CHECK(num_layers > 0 && num_experts > 0,
               fmt::format("LoadRecorder: {} layers x {} experts, expected both > 0", num_layers, num_experts));
  const size_t cells = size_t(num_layers) * num_experts;
  // The window keeps every step's counts: bounded, so that a huge window is a message, not a
  // std::bad_alloc that names nothing.
  constexpr double kMaxWindowBytes = double(uint64_t(1) << 32);
  const double ring_bytes = double(std::max(window, 0)) * double(cells) * sizeof(int64_t);
  MOEKIT_CHECK(ring_bytes <= kMaxWindowBytes,
               fmt::format("LoadRecorder: a window of {} steps over {} layers x {} experts keeps {:.1f} GB of counts; "
                           "expected at most {:.1f} GB (a shorter window, or decay)",
                           window, num_layers, num_experts, ring_bytes / 1e9, kMaxWindowBytes / 1e9));
  open_.assign(cells, 0);
  total_.assign(cells, 0.0);
  if (window_ > 0) ring_.assign(size_t(window_) * cells, 0);
}

LoadRecorder LoadRecorder::window(int num_layers, int num_experts, int num_steps) {
  MOEKIT_CHECK(num_steps >= 1, fmt::format("LoadRecorder::window: num_steps = {} must be >= 1", num_steps));
  return LoadRecorder(num_layers, num_experts, num_steps, 0.0);
}

LoadRecorder LoadRecorder::decay(int num_layers, int num_experts, double factor) {
  MOEKIT_CHECK(factor > 0 && factor < 1, fmt::format("LoadRecorder::decay: factor = {} must be in (0, 1)", factor));
  return LoadRecorder(num_layers, num_experts, 0, factor);
}

void LoadRecorder::record(int layer, const int32_t* topk_idx, int num_tokens, int topk) {
  MOEKIT_CHECK(layer >= 0 && layer < num_layers_,
               fmt::format("LoadRecorder::record: layer {} out of range [0, {})", layer, num_layers_));
  MOEKIT_CHECK(
      num_tokens >= 0 && topk > 0,
      fmt::format("LoadRecorder::record: num_tokens = {}, topk = {}: expected >= 0 and > 0", num_tokens, topk));
  const size_t n = size_t(num_tokens) * topk;
  // Validate the whole batch before counting any of it, so a bad id leaves the step untouched.
  for (size_t i = 0; i < n; ++i)
    MOEKIT_CHECK(topk_idx[i] >= -1 && topk_idx[i] < num_experts_,
                 fmt::format("LoadRecorder::record: layer {} token {} expert id {} out of range [0, {})", layer,
                             i / topk, topk_idx[i], num_experts_));
  int64_t* row = &open_[size_t(layer) * num_experts_];
  for (size_t i = 0; i < n; ++i)
    if (topk_idx[i] >= 0) ++row[topk_idx[i]];
}

void LoadRecorder::record_counts(int layer, const int64_t* counts) {
  MOEKIT_CHECK(layer >= 0 && layer < num_layers_,
               fmt::format("LoadRecorder::record_counts: layer {} out of range [0, {})", layer, num_layers_));
  for (int e = 0; e < num_experts_; ++e)
    MOEKIT_CHECK(counts[e] >= 0, fmt::format("LoadRecorder::record_counts: layer {} expert {} count {} is negative",
                                             layer, e, counts[e]));
  int64_t* row = &open_[size_t(layer) * num_experts_];
  for (int e = 0; e < num_experts_; ++e) row[e] += counts[e];
}

void LoadRecorder::end_step() {
  const size_t cells = open_.size();
  if (window_ > 0) {
    // The ring slot of the step that leaves the window is replaced by the closing step.
    int64_t* slot = &ring_[size_t(steps_ % window_) * cells];
    for (size_t i = 0; i < cells; ++i) {
      total_[i] += double(open_[i] - slot[i]);
      slot[i] = open_[i];
    }
  } else {
    for (size_t i = 0; i < cells; ++i) total_[i] = factor_ * total_[i] + double(open_[i]);
  }
  std::fill(open_.begin(), open_.end(), 0);
  ++steps_;
}

std::vector<std::vector<double>> LoadRecorder::loads() const {
  std::vector<std::vector<double>> out(num_layers_);
  for (int l = 0; l < num_layers_; ++l)
    out[l].assign(total_.begin() + size_t(l) * num_experts_, total_.begin() + size_t(l + 1) * num_experts_);
  return out;
}

double end_to_end_gain(double layer_speedup, double balanceable_share) {
  MOEKIT_CHECK(layer_speedup > 0 && std::isfinite(layer_speedup),
               fmt::format("end_to_end_gain: layer speed-up {} must be finite and > 0", layer_speedup));
  MOEKIT_CHECK(balanceable_share >= 0 && balanceable_share <= 1,
               fmt::format("end_to_end_gain: balanceable share f = {} must be in [0, 1]", balanceable_share));
  return 1.0 / (balanceable_share / layer_speedup + 1.0 - balanceable_share);
}

namespace {

// Sum over layers of the max GPU load, over the sum of mean GPU loads (1 when there is no load).
double step_skew(const Placement& p, const std::vector<std::vector<double>>& weight) {
  std::vector<double> load = gpu_loads(p, weight);
  double sum_max = 0, sum_mean = 0;
  for (int l = 0; l < p.num_layers; ++l) {
    const double* row = &load[size_t(l) * p.num_gpus];
    double mx = 0, sum = 0;
    for (int g = 0; g < p.num_gpus; ++g) mx = std::max(mx, row[g]), sum += row[g];
    sum_max += mx;
    sum_mean += sum / p.num_gpus;
  }
  return sum_mean > 0 ? sum_max / sum_mean : 1.0;
}

}  // namespace

GateDecision rebalance_gate(const std::vector<std::vector<double>>& weight, const Placement& current,
                            const Placement& candidate, double balanceable_share, double min_gain) {
  MOEKIT_CHECK(min_gain >= 0 && std::isfinite(min_gain),
               fmt::format("rebalance_gate: min_gain = {} must be finite and >= 0", min_gain));
  MOEKIT_CHECK(current.num_gpus == candidate.num_gpus && current.num_layers == candidate.num_layers,
               fmt::format("rebalance_gate: current ({} layers, {} GPUs) and candidate ({} layers, {} GPUs) differ",
                           current.num_layers, current.num_gpus, candidate.num_layers, candidate.num_gpus));
  GateDecision d;
  d.s0 = step_skew(current, weight);
  d.s1 = step_skew(candidate, weight);
  d.layer_speedup = d.s0 / d.s1;
  d.end_to_end = end_to_end_gain(d.layer_speedup, balanceable_share);
  d.rebalance = d.end_to_end >= 1.0 + min_gain;
  return d;
}

}  // namespace moekit
