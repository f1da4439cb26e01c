// Monte Carlo routing simulator (see include/moekit/simulate.h).
#include "moekit/simulate.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/plan.h"

namespace moekit {

// ---------------------------------------------------------------------------------------------
// Random numbers: std::mt19937_64 (its output is fixed by the standard) and moekit's own
// distributions on top (std::uniform_*_distribution differ between standard libraries).

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::mt19937_64 sample_rng(uint64_t seed, int64_t sample_index) {
  return std::mt19937_64(splitmix64(splitmix64(seed) ^ uint64_t(sample_index)));
}

// Uniform in [0, 1) with 53 random bits.
double uniform01(std::mt19937_64& rng) { return double(rng() >> 11) * 0x1.0p-53; }

// Uniform integer in [0, n), unbiased (Lemire's multiply-and-reject).
uint64_t uniform_below(std::mt19937_64& rng, uint64_t n) {
  unsigned __int128 m = (unsigned __int128)rng() * n;
  uint64_t low = uint64_t(m);
  if (low < n) {
    const uint64_t threshold = (0 - n) % n;
    while (low < threshold) {
      m = (unsigned __int128)rng() * n;
      low = uint64_t(m);
    }
  }
  return uint64_t(m >> 64);
}

// Draws k distinct experts per token.
// Uniform: a partial Fisher–Yates shuffle of 0 … E−1, k swaps.
// Weighted: successive sampling without replacement. Each pick draws from the full weights
// (Walker's alias table, O(1)) and redraws if the expert was taken: conditioned on acceptance
// that is exactly w_j / Σ_{untaken} w. After kMaxRedraws rejections in a row (mass piled on
// the taken experts) it draws from the untaken ones directly, which has the same law.
class TopkSampler {
 public:
  TopkSampler(const std::vector<double>& weights, std::vector<double> log_weights, int topk)
      : k_(topk), weights_(weights), log_weights_(std::move(log_weights)) {
    const int E = int(weights.size());
    uniform_ = std::all_of(weights.begin(), weights.end(), [&](double w) { return w == weights[0]; });
    perm_.resize(E);
    taken_stamp_.assign(E, 0);
    build_alias();
  }

  // Starts a sample: the state is reset so that a sample depends on its own RNG only.
  void reset() { std::iota(perm_.begin(), perm_.end(), 0); }

  void draw(std::mt19937_64& rng, int32_t* out) {
    const int E = int(perm_.size());
    if (uniform_) {
      for (int j = 0; j < k_; ++j) {
        int r = j + int(uniform_below(rng, uint64_t(E - j)));
        std::swap(perm_[j], perm_[r]);
        out[j] = perm_[j];
      }
      return;
    }
    ++stamp_;
    for (int j = 0; j < k_; ++j) {
      int e = -1;
      for (int attempt = 0; attempt < kMaxRedraws; ++attempt) {
        int c = draw_weighted(rng);
        if (taken_stamp_[c] != stamp_) {
          e = c;
          break;
        }
      }
      if (e < 0) e = draw_untaken(rng);
      taken_stamp_[e] = stamp_;
      out[j] = e;
    }
  }

 private:
  static constexpr int kMaxRedraws = 32;

  // Vose's alias method: column i keeps expert i with probability keep_[i], else alias_[i].
  // Each column holds 1/E of the mass, so P(e) = (keep_[e] + Σ_{i: alias_i = e} (1 − keep_[i]))/E
  // = w_e/W. Built in a fixed order, so the table (and the samples) depend on the weights only.
  void build_alias() {
    const int E = int(weights_.size());
    const double total = std::accumulate(weights_.begin(), weights_.end(), 0.0);
    keep_.assign(E, 1.0);
    alias_.resize(E);
    std::iota(alias_.begin(), alias_.end(), 0);
    std::vector<double> scaled(E);
    std::vector<int> small, large;
    for (int e = 0; e < E; ++e) {
      scaled[e] = weights_[e] * E / total;
      (scaled[e] < 1.0 ? small : large).push_back(e);
    }
    while (!small.empty() && !large.empty()) {
      int s = small.back(), l = large.back();
      small.pop_back();
      keep_[s] = scaled[s];
      alias_[s] = l;
      scaled[l] -= 1.0 - scaled[s];
      if (scaled[l] < 1.0) large.pop_back(), small.push_back(l);
    }
    // What is left holds (up to rounding) exactly one column's mass: keep it whole.
    for (int e : small) keep_[e] = 1.0;
    for (int e : large) keep_[e] = 1.0;
  }

  int draw_weighted(std::mt19937_64& rng) {
    int column = int(uniform_below(rng, keep_.size()));
    return uniform01(rng) < keep_[column] ? column : alias_[column];
  }

  // Draws from the untaken experts by their weights. The plain weights serve while the largest
  // untaken one is at least 2^-958: a weight that underflowed (below 2^-1022) is then under 2^-64
  // of it, which no 53-bit draw can tell from 0. Below that (zipf:1000's tail, hot:1:1e300's
  // cold experts once the hot one is taken) the ratios are lost, and the weights relative to the
  // largest untaken one are taken from their logs instead.
  int draw_untaken(std::mt19937_64& rng) {
    double largest = 0, largest_log = -HUGE_VAL;
    for (size_t e = 0; e < weights_.size(); ++e)
      if (taken_stamp_[e] != stamp_)
        largest = std::max(largest, weights_[e]), largest_log = std::max(largest_log, log_weights_[e]);
    const bool plain = largest >= 0x1p-958;
    auto weight = [&](size_t e) { return plain ? weights_[e] : std::exp(log_weights_[e] - largest_log); };
    double left = 0;
    int last = -1;
    for (size_t e = 0; e < weights_.size(); ++e)
      if (taken_stamp_[e] != stamp_) left += weight(e), last = int(e);
    double u = uniform01(rng) * left;
    for (size_t e = 0; e < weights_.size(); ++e) {
      if (taken_stamp_[e] == stamp_) continue;
      const double w = weight(e);
      if (u < w) return int(e);
      u -= w;
    }
    return last;  // u ran past the end by rounding
  }

  int k_;
  bool uniform_ = true;
  std::vector<double> weights_;      // expert_weights(): the largest in [1, 2), so their sum is finite
  std::vector<double> log_weights_;  // expert_log_weights(), unscaled
  std::vector<int32_t> perm_;
  std::vector<double> keep_;
  std::vector<int> alias_;
  std::vector<uint64_t> taken_stamp_;
  uint64_t stamp_ = 0;
};

void validate(const SimulateInput& in) {
  MOEKIT_CHECK(in.num_experts >= 1, fmt::format("--experts = {} must be >= 1", in.num_experts));
  MOEKIT_CHECK(in.num_experts <= kMaxExperts, fmt::format("--experts = {} must be <= {}", in.num_experts, kMaxExperts));
  MOEKIT_CHECK(in.topk >= 1 && in.topk <= in.num_experts,
               fmt::format("--topk = {} must be in [1, E = {}]", in.topk, in.num_experts));
  MOEKIT_CHECK(in.num_ranks >= 1, fmt::format("--ranks = {} must be >= 1", in.num_ranks));
  MOEKIT_CHECK(in.num_ranks <= kMaxRanks, fmt::format("--ranks = {} must be <= {}", in.num_ranks, kMaxRanks));
  MOEKIT_CHECK(in.num_experts % in.num_ranks == 0,
               fmt::format("--ranks = {} must divide E = {} (experts are placed E/P per GPU, contiguously)",
                           in.num_ranks, in.num_experts));
  MOEKIT_CHECK(in.batch >= 1, fmt::format("--batch = {} must be >= 1 (tokens per step)", in.batch));
  MOEKIT_CHECK(in.batch <= kMaxBatch, fmt::format("--batch = {} must be <= {} (tokens per step)", in.batch, kMaxBatch));
  MOEKIT_CHECK(in.trials >= 2, fmt::format("--trials = {} must be >= 2 (a standard error needs two samples)", in.trials));
  MOEKIT_CHECK(in.trials <= kMaxTrials, fmt::format("--trials = {} must be <= {}", in.trials, kMaxTrials));
  MOEKIT_CHECK(in.num_threads >= 0, fmt::format("threads = {} must be >= 0 (0: one per hardware thread)", in.num_threads));
  MOEKIT_CHECK(in.num_threads <= kMaxThreads, fmt::format("threads = {} must be <= {}", in.num_threads, kMaxThreads));
  expert_weights(in.routing, in.num_experts);  // validates the routing against E
}

// Welford's running mean and M2; merged in a fixed order (Chan et al.), so the result does
// not depend on which thread summed which chunk.
struct Running {
  double n = 0, mean = 0, m2 = 0;
  void add(double x) {
    n += 1;
    double d = x - mean;
    mean += d / n;
    m2 += d * (x - mean);
  }
  void merge(const Running& o) {
    if (o.n == 0) return;
    double total = n + o.n;
    double d = o.mean - mean;
    mean += d * o.n / total;
    m2 += o.m2 + d * d * n * o.n / total;
    n = total;
  }
  double std_error() const { return n > 1 ? std::sqrt(m2 / (n - 1) / n) : 0.0; }
};

// Per-sample figures: coverage, mean distinct target ranks, S₀, and var/mean² over experts.
struct SampleStats {
  Running coverage, dedup, s0, cv2;
  void merge(const SampleStats& o) {
    coverage.merge(o.coverage), dedup.merge(o.dedup), s0.merge(o.s0), cv2.merge(o.cv2);
  }
};

// Works one sample at a time with buffers reused across samples. Sample i is drawn at step
// i / samples_per_step (a trace's layers of one step share the step's drift phase).
class Worker {
 public:
  explicit Worker(const SimulateInput& in, int64_t samples_per_step = 1)
      : in_(in),
        samples_per_step_(samples_per_step),
        sampler_(expert_weights(in.routing, in.num_experts), expert_log_weights(in.routing, in.num_experts), in.topk),
        experts_per_rank_(in.num_experts / in.num_ranks),
        loads_(in.num_experts),
        rank_stamp_(in.num_ranks, 0),
        token_idx_(in.topk) {}

  // Draws sample i; writes its indices to `out` ([B][k]) when given.
  void run(int64_t i, SampleStats* stats, int32_t* out) {
    const int E = in_.num_experts, k = in_.topk, P = in_.num_ranks;
    std::mt19937_64 rng = sample_rng(in_.seed, i);
    const int shift = routing_shift(in_.routing, E, i / samples_per_step_);
    sampler_.reset();
    std::fill(loads_.begin(), loads_.end(), 0);
    int64_t distinct_sum = 0;
    for (int64_t t = 0; t < in_.batch; ++t) {
      int32_t* idx = out ? out + t * k : token_idx_.data();
      sampler_.draw(rng, idx);
      if (shift)
        for (int j = 0; j < k; ++j) idx[j] = (idx[j] + shift) % E;
      ++stamp_;
      for (int j = 0; j < k; ++j) {
        ++loads_[idx[j]];
        int rank = idx[j] / experts_per_rank_;
        if (rank_stamp_[rank] != stamp_) rank_stamp_[rank] = stamp_, ++distinct_sum;
      }
    }
    if (!stats) return;
    int hit = 0;
    int64_t max_rank_load = 0;
    const double mean_expert = double(in_.batch) * k / E;
    double ss = 0;
    for (int r = 0; r < P; ++r) {
      int64_t rank_load = 0;
      for (int e = r * experts_per_rank_; e < (r + 1) * experts_per_rank_; ++e) {
        rank_load += loads_[e];
        hit += loads_[e] > 0;
        double d = double(loads_[e]) - mean_expert;
        ss += d * d;
      }
      max_rank_load = std::max(max_rank_load, rank_load);
    }
    stats->coverage.add(double(hit) / E);
    stats->dedup.add(double(distinct_sum) / double(in_.batch));
    stats->s0.add(double(max_rank_load) / (double(in_.batch) * k / P));
    stats->cv2.add(ss / E / (mean_expert * mean_expert));
  }

 private:
  const SimulateInput& in_;
  int64_t samples_per_step_;
  TopkSampler sampler_;
  int experts_per_rank_;
  std::vector<int64_t> loads_;
  std::vector<uint64_t> rank_stamp_;
  uint64_t stamp_ = 0;
  std::vector<int32_t> token_idx_;
};

// Runs fn(worker, chunk) over fixed chunks of samples on `threads` threads; calls progress
// from this thread.
template <class Fn>
void run_chunks(const SimulateInput& in, int64_t num_samples, int64_t chunk, const ProgressFn& progress, Fn&& fn,
                int64_t samples_per_step = 1) {
  const int64_t num_chunks = (num_samples + chunk - 1) / chunk;
  int threads = in.num_threads > 0 ? in.num_threads : int(std::max(1u, std::thread::hardware_concurrency()));
  threads = int(std::min<int64_t>(threads, num_chunks));
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::exception_ptr error;
  auto body = [&] {
    try {
      Worker w(in, samples_per_step);
      for (int64_t c; (c = next.fetch_add(1)) < num_chunks;) {
        fn(w, c);
        done += std::min(chunk, num_samples - c * chunk);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
      next = num_chunks;
    }
    std::lock_guard<std::mutex> lock(mu);
    ++finished;
    cv.notify_all();
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(body);
  {
    std::unique_lock<std::mutex> lock(mu);
    while (!cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return finished == threads; }))
      if (progress) progress(done.load(), num_samples);
  }
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  if (progress) progress(num_samples, num_samples);
}

// docs/theory.md §All-to-all bytes, for top-k *without* replacement: a GPU holding e = E/P experts receives none of
// a token's k distinct picks with probability C(E − e, k)/C(E, k) = Π_{i<k} (E − e − i)/(E − i).
double dedup_targets_exact_uniform(int E, int k, int P) {
  const int e = E / P;
  double none = 1.0;
  for (int i = 0; i < k; ++i) none *= std::max(0.0, double(E - e - i) / double(E - i));
  return P * (1.0 - none);
}

// docs/theory.md §Statistical skew, refined for uniform top-k. One GPU's load sums B independent hypergeometric
// counts (k draws from E holding e of its experts): variance B·k·(e/E)(1 − e/E)(E − k)/(E − 1).
// The P loads sum to exactly B·k, so as Gaussians they are σ·sqrt(P/(P − 1))·(Z_i − Z̄) and
// E[max] = mean + σ·sqrt(P/(P − 1))·E[max of P standard normals].
double s0_gaussian_uniform(int E, int k, int P, double B) {
  if (P == 1) return 1.0;
  const double e = double(E) / P;
  const double mean = B * k * e / E;
  const double var = B * k * (e / E) * (1.0 - e / E) * (E - k) / (E - 1.0);
  return 1.0 + expected_max_std_normal(P) * std::sqrt(double(P) / (P - 1)) * std::sqrt(var) / mean;
}

}  // namespace

double expected_max_std_normal(int n) {
  MOEKIT_CHECK(n >= 1, fmt::format("expected_max_std_normal: n = {} must be >= 1", n));
  if (n == 1) return 0.0;
  // E[max] = ∫ x·n·φ(x)·Φ(x)^(n−1) dx, Simpson's rule on [−12, 12] (the tails beyond carry < 1e-30).
  const int steps = 4800;
  const double a = -12, b = 12, h = (b - a) / steps;
  auto f = [n](double x) {
    double phi = std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
    double Phi = 0.5 * std::erfc(-x / std::sqrt(2.0));
    return x * n * phi * std::pow(Phi, n - 1);
  };
  double sum = f(a) + f(b);
  for (int i = 1; i < steps; ++i) sum += f(a + i * h) * (i % 2 ? 4 : 2);
  return sum * h / 3;
}

std::optional<double> Metric::gap_in_se(double value) const {
  if (std_error <= 0) return std::nullopt;
  return (simulated - value) / std_error;
}

std::vector<int32_t> sample_step(const SimulateInput& in, int64_t sample_index) {
  validate(in);
  std::vector<int32_t> out(size_t(in.batch) * in.topk);
  Worker(in).run(sample_index, nullptr, out.data());
  return out;
}

void check_simulate_work(const SimulateInput& in) {
  validate(in);
  // Each of trials and batch is bounded alone (validate); their product is the run time.
  // trials <= 2^22, batch <= 2^24 and topk <= 2^16: the product fits in an int64.
  const int64_t picks = in.trials * in.batch * in.topk;
  MOEKIT_CHECK(picks <= kMaxSimulatePicks,
               fmt::format("--trials = {} x --batch = {} x topk = {} = {} expert picks, more than the limit of {} "
                           "(2^34, minutes of work); lower --trials or --batch",
                           in.trials, in.batch, in.topk, picks, kMaxSimulatePicks));
}

SimulateResult simulate(const SimulateInput& in, const ProgressFn& progress) {
  check_simulate_work(in);
  // Chunks of a fixed size (not one per thread) keep the merge order, and so every digit of
  // the result, independent of the thread count.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(256, (1 << 20) / (in.batch * in.topk)));
  const int64_t num_chunks = (in.trials + chunk - 1) / chunk;
  std::vector<SampleStats> per_chunk(num_chunks);
  run_chunks(in, in.trials, chunk, progress, [&](Worker& w, int64_t c) {
    for (int64_t i = c * chunk; i < std::min(in.trials, (c + 1) * chunk); ++i) w.run(i, &per_chunk[c], nullptr);
  });
  SampleStats all;
  for (const auto& s : per_chunk) all.merge(s);

  const int E = in.num_experts, k = in.topk, P = in.num_ranks;
  const double B = double(in.batch);
  const std::vector<double> weights = expert_weights(in.routing, E);
  const bool uniform = std::all_of(weights.begin(), weights.end(), [&](double w) { return w == weights[0]; });
  SimulateResult res;
  res.input = in;

  res.coverage.simulated = all.coverage.mean;
  res.coverage.std_error = all.coverage.std_error();
  res.coverage.closed_form = coverage_closed_form(E, k, B);
  res.coverage.closed_form_assumes =
      "each token picks a given expert with probability k/E, independently of the other tokens (uniform routing)";

  res.dedup_targets.simulated = all.dedup.mean;
  res.dedup_targets.std_error = all.dedup.std_error();
  res.dedup_targets.closed_form = dedup_targets_closed_form(P, k);
  res.dedup_targets.closed_form_assumes =
      "the k picks land on independent uniform ranks (sampling with replacement); top-k picks distinct experts";

  res.s0.simulated = all.s0.mean;
  res.s0.std_error = all.s0.std_error();
  res.s0.closed_form = imbalance_closed_form(E, k, P, B);
  res.s0.closed_form_assumes =
      "Gaussian per-GPU loads with CV_e/sqrt(E/P) and E[max of P] ~ sqrt(2 ln P) standard deviations, an upper "
      "bound that overstates S0 at small P";

  // CV over experts: sqrt of the mean (over trials) of var/mean², with the delta-method error.
  res.cv_expert.simulated = std::sqrt(all.cv2.mean);
  res.cv_expert.std_error = all.cv2.mean > 0 ? all.cv2.std_error() / (2.0 * res.cv_expert.simulated) : 0.0;
  res.cv_expert.closed_form = cv_expert_closed_form(E, k, B);
  res.cv_expert.closed_form_assumes =
      "one expert's load is Binomial(B, k/E) (uniform routing); exact for top-k without replacement";

  if (uniform) {
    res.coverage.reference = res.coverage.closed_form;
    res.coverage.reference_is = "exact for uniform top-k";
    res.dedup_targets.reference = dedup_targets_exact_uniform(E, k, P);
    res.dedup_targets.reference_is = "exact for uniform top-k: P·[1 − C(E − E/P, k)/C(E, k)]";
    res.s0.reference = s0_gaussian_uniform(E, k, P, B);
    res.s0.reference_is =
        "Gaussian loads with hypergeometric variance and fixed sum, exact E[max of P normals] (no skewness)";
    res.cv_expert.reference = res.cv_expert.closed_form;
    res.cv_expert.reference_is = "exact for uniform top-k (Binomial marginal)";
  }
  return res;
}

RoutingTrace sample_trace(const SimulateInput& in, int num_layers, int64_t num_steps) {
  validate(in);
  MOEKIT_CHECK(num_layers >= 1 && num_layers <= kMaxLayers,
               fmt::format("--layers = {} must be >= 1 and <= {}", num_layers, kMaxLayers));
  MOEKIT_CHECK(num_steps >= 1 && num_steps <= kMaxTrials,
               fmt::format("--steps = {} must be >= 1 and <= {}", num_steps, kMaxTrials));
  MOEKIT_CHECK(in.batch % in.num_ranks == 0,
               fmt::format("--save-trace: --batch = {} must be a multiple of --ranks = {} (a trace spreads a step's "
                           "tokens evenly over the ranks)",
                           in.batch, in.num_ranks));
  const double indices = double(num_layers) * double(num_steps) * double(in.batch) * in.topk;
  MOEKIT_CHECK(indices <= double(1 << 30),
               fmt::format("--save-trace: {} layers x {} steps x {} tokens x {} experts = {:.3g} indices is too many "
                           "(at most 2^30); lower --steps or --layers",
                           num_layers, num_steps, in.batch, in.topk, indices));
  RoutingTrace t;
  t.num_experts = in.num_experts;
  t.topk = in.topk;
  t.num_ranks = in.num_ranks;
  t.layers.assign(num_layers, std::vector<std::vector<int32_t>>(num_steps));
  const int64_t total = int64_t(num_layers) * num_steps;
  run_chunks(in, total, 16, {}, [&](Worker& w, int64_t c) {
    for (int64_t i = c * 16; i < std::min(total, (c + 1) * 16); ++i) {
      auto& step = t.layers[i % num_layers][i / num_layers];
      step.resize(size_t(in.batch) * in.topk);
      w.run(i, nullptr, step.data());
    }
  }, num_layers);
  return t;
}

}  // namespace moekit
