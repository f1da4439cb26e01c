// moekit/simulate.h: Monte Carlo routing, to check the closed forms of the planner
// (docs/theory.md §Coverage, §All-to-all bytes, §Statistical skew).
//
// One sample is one decode step: B tokens each pick k distinct experts out of E by a routing
// distribution; experts sit on P GPUs contiguously (expert e on GPU e / (E/P)). Over `trials`
// samples it estimates, with a standard error:
//   coverage        share of experts hit in the step                    closed form 1 − (1 − k/E)^B
//   dedup_targets   distinct GPUs a token is sent to, mean over tokens  closed form P·[1 − (1 − 1/P)^k]
//   s0              busiest GPU's load over the mean GPU load (S₀)      closed form 1 + sqrt(2 ln P)·CV_e/sqrt(E/P)
//   cv_expert       CV of the expert loads, sqrt(E[var over experts])/mean
//                                                                       closed form sqrt((1 − k/E)/(B·k/E))
// The closed forms are the planner's, derived for uniform routing; each comes with what it
// assumes and, under uniform routing, a sharper reference where one exists (see
// docs/planner.md): top-k picks k *distinct* experts, so the picks of one token are not
// independent; one expert's load is still exactly Binomial(B, k/E), but the ranks a token
// reaches follow the hypergeometric law and the GPU loads sum to exactly B·k.
//
// Routing: uniform; zipf:S (expert i has weight (i + 1)^−S); hot:H:R (experts 0 … H−1 are R
// times as likely as the rest: they sit on the first GPUs, the worst contiguous placement);
// drift:H:R:PERIOD (hot:H:R whose hot block moves on by H experts every PERIOD steps: at step s
// the hot experts are (⌊s/PERIOD⌋·H + j) mod E, j < H; a step's tokens are those of hot:H:R
// with every id rotated by that shift, so each phase has exactly hot:H:R's law).
// k distinct experts per token are drawn by successive sampling without replacement (each
// next expert with probability proportional to its weight among those not yet picked), the
// rule of a top-k over Gumbel-perturbed log-weights.
//
// Determinism: sample i draws from its own std::mt19937_64 seeded from (seed, i) and uses
// moekit's own integer and real distributions (std:: distributions differ across standard
// libraries), so the samples, the statistics and a saved trace depend on the seed only,
// not on the number of threads or the machine.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/trace.h"

namespace moekit {

struct Routing {
  enum class Kind { uniform, zipf, hot, drift };
  Kind kind = Kind::uniform;
  double zipf_s = 0;     // zipf: weight of expert i is (i + 1)^-s, s >= 0
  int hot_count = 0;     // hot, drift: experts 0 … hot_count−1 …
  double hot_ratio = 1;  // … are hot_ratio times as likely as the others (> 0)
  int64_t drift_period = 0;  // drift: steps between two moves of the hot block (>= 1)
};

// "uniform" | "zipf:S" | "hot:H:R" | "drift:H:R:PERIOD"; malformed text is an Error naming it and
// the expected forms.
Routing parse_routing(std::string_view s);
std::string to_string(const Routing& r);
// The weight of each expert, relative: scaled by a power of two so that the largest is in
// [1, 2) (exact, and the sum of E weights stays finite for any R); validates the routing
// against E (H <= E). For drift, the weights of its first phase (steps 0 … PERIOD−1).
std::vector<double> expert_weights(const Routing& r, int num_experts);
// The natural log of each weight, finite for every routing parse_routing() accepts: weights
// such as zipf:1000's (i + 1)^−1000 underflow to 0 as doubles, their logs do not. The sampler
// draws by them where the plain weights have lost the ratios, so that the samples follow the
// routing's law for every S and R that parse_routing() accepts.
std::vector<double> expert_log_weights(const Routing& r, int num_experts);
// The rotation of the expert ids at `step`: ⌊step/PERIOD⌋·H mod E for drift, 0 otherwise.
int routing_shift(const Routing& r, int num_experts, int64_t step);
// The weights at `step`: expert_weights() rotated by routing_shift().
std::vector<double> expert_weights_at(const Routing& r, int num_experts, int64_t step);

// Bounds (moekit/limits.h): E <= kMaxExperts, P <= kMaxRanks, B <= kMaxBatch, trials and
// trace steps <= kMaxTrials, trace layers <= kMaxLayers, threads <= kMaxThreads, and for
// simulate() trials x B x k <= kMaxSimulatePicks; past them an Error names the value.
struct SimulateInput {
  int num_experts = 0;  // E
  int topk = 0;         // k
  int num_ranks = 1;    // P, must divide E
  int64_t batch = 0;    // B, tokens per step (all ranks together)
  int64_t trials = 0;   // samples (decode steps); >= 2 for a standard error
  uint64_t seed = 1;
  Routing routing;
  int num_threads = 0;  // 0: one per hardware thread; results do not depend on it
};

// One simulated figure next to its closed form.
struct Metric {
  double simulated = 0;
  double std_error = 0;              // of `simulated`, from the spread over trials
  double closed_form = 0;            // the planner's, for uniform routing
  std::string closed_form_assumes;   // what the closed form takes for granted
  std::optional<double> reference;   // uniform routing only: exact, or a sharper approximation
  std::string reference_is;          // what `reference` is
  double gap() const { return simulated - closed_form; }
  // gap in standard errors; nullopt when the standard error is 0 (no spread over trials)
  std::optional<double> gap_in_se(double value) const;
};

struct SimulateResult {
  SimulateInput input;
  Metric coverage, dedup_targets, s0, cv_expert;
};

// done/total samples; called from the calling thread about every 100 ms, and once at the end.
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

// The checks simulate() starts with (the bounds above, and trials x B x k <= kMaxSimulatePicks),
// alone: a caller that does other work first (simulate --save-trace samples the trace) asks here.
void check_simulate_work(const SimulateInput& in);
SimulateResult simulate(const SimulateInput& input, const ProgressFn& progress = {});

// The top-k indices of sample i, row-major [B][k]: the samples simulate() draws. Sample i is
// step i (a drifting routing's phase).
std::vector<int32_t> sample_step(const SimulateInput& input, int64_t sample_index);

// A trace of `num_layers` × `num_steps` samples: layers[l][s] is sample s·num_layers + l, drawn
// at step s (every layer of a step in the same phase of a drifting routing), so with one layer
// and num_steps = trials it holds exactly the samples simulate() used.
// num_ranks of the trace is P; B must be a multiple of P (the trace spreads tokens evenly).
RoutingTrace sample_trace(const SimulateInput& input, int num_layers, int64_t num_steps);

// E[max of n independent standard normals], by quadrature (n >= 1; 0 for n = 1).
double expected_max_std_normal(int n);

std::string simulate_to_json(const SimulateResult& result);

}  // namespace moekit
