// `moekit run --rebalance` (see run_rebalance.h).
#include "cli/run_rebalance.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#ifdef MOEKIT_WITH_CUDA
#include "cli/cuda/rebalance_cuda.h"
#endif
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/layer_cpu.h"
#include "moekit/limits.h"
#include "moekit/reference.h"
#include "moekit/weights.h"

namespace moekit::cli {

void add_rebalance_options(CLI::App* cmd, RebalanceRunOptions& o) {
  // Every other option here is refused without --rebalance, rather than read and ignored.
  auto* on = cmd->add_flag("--rebalance", o.on,
                "serve many steps of a routing trace and rebalance while serving (rebalance.h): per step the "
                "max/mean rows per GPU, the decisions, the bytes moved and the step time");
  cmd->add_option("--trace", o.trace, "--rebalance: the routing trace (moekit simulate --save-trace); default: "
                                      "--routing sampled for --steps steps of --batch tokens")
      ->needs(on);
  cmd->add_option("--steps", o.steps, "--rebalance: steps sampled from --routing when no --trace is given (200)")
      ->needs(on);
  cmd->add_option("--window", o.window, "--rebalance: steps of expert counts the loads cover")->capture_default_str()
      ->needs(on);
  cmd->add_option("--interval", o.interval, "--rebalance: steps between two decisions")->capture_default_str()
      ->needs(on);
  cmd->add_option("--min-gain", o.min_gain, "--rebalance: the gate's least predicted end-to-end gain (0.02: 2%)")
      ->capture_default_str()
      ->needs(on);
  cmd->add_option("--balanceable-share", o.share,
                  "--rebalance: share f of the step the placement can speed up (1: the step is MoE layers only)")
      ->capture_default_str()
      ->needs(on);
  cmd->add_option("--lag", o.lag, "--rebalance: pick each decision up exactly this many steps after it starts "
                                  "(reproducible runs); 0: whenever the host thread is done")
      ->capture_default_str()
      ->needs(on);
  cmd->add_option("--copy-gbps", o.copy_gbps,
                  "--rebalance: GB/s the weight copies may take (the gate prices moves with it; CUDA: the copies' "
                  "bytes per step); 0: moves cost nothing and copy at once")
      ->capture_default_str()
      ->needs(on);
  cmd->add_option("--payback", o.payback, "--rebalance: steps a rebalance's gain must pay its copies back in")
      ->capture_default_str()
      ->needs(on);
}

RoutingTrace rebalance_trace(const RebalanceRunOptions& o, const Routing& routing, const ModelSpec& model,
                             int num_ranks, int64_t batch, int num_layers, uint64_t seed) {
  const int E = model.num_routed_experts, k = model.num_experts_per_token;
  MOEKIT_CHECK(o.trace.empty() || !o.steps, std::string("--steps goes with a sampled routing; a --trace has its own steps"));
  RoutingTrace t;
  if (!o.trace.empty()) {
    t = read_trace(o.trace);
  } else {
    const int64_t steps = o.steps.value_or(200);
    MOEKIT_CHECK(steps >= 1 && steps <= kMaxTrials, fmt::format("--steps {}: expected 1 .. {}", steps, kMaxTrials));
    MOEKIT_CHECK(batch % num_ranks == 0,
                 fmt::format("--rebalance: --batch {} must be a multiple of --ep {} (the sampled trace spreads a "
                             "step's tokens evenly)", batch, num_ranks));
    SimulateInput sim;
    sim.num_experts = E;
    sim.topk = k;
    sim.num_ranks = num_ranks;
    sim.batch = batch;
    sim.trials = std::max<int64_t>(2, steps);
    sim.seed = seed;
    sim.routing = routing;
    sim.num_threads = 1;
    t = sample_trace(sim, num_layers, steps);
  }
  const std::string what = o.trace.empty() ? std::string("the sampled trace") : fmt::format("--trace '{}'", o.trace);
  MOEKIT_CHECK(t.num_experts == E && t.topk == k,
               fmt::format("{} routes {} experts top-{}, the model {} has {} experts top-{}", what, t.num_experts,
                           t.topk, model.name, E, k));
  MOEKIT_CHECK(t.num_layers() == num_layers,
               fmt::format("{} has {} layers: pass --layers {}", what, t.num_layers(), t.num_layers()));
  for (int l = 1; l < t.num_layers(); ++l)
    MOEKIT_CHECK(t.num_steps(l) == t.num_steps(0),
                 fmt::format("{}: layer {} has {} steps, layer 0 {}", what, l, t.num_steps(l), t.num_steps(0)));
  MOEKIT_CHECK(t.num_steps(0) >= 1, fmt::format("{} has no steps", what));
  for (int s = 0; s < t.num_steps(0); ++s)
    for (int l = 1; l < t.num_layers(); ++l)
      MOEKIT_CHECK(t.num_tokens(l, s) == t.num_tokens(0, s),
                   fmt::format("{}: step {} has {} tokens in layer {}, {} in layer 0", what, s, t.num_tokens(l, s), l,
                               t.num_tokens(0, s)));
  return t;
}

namespace {

using Clock = std::chrono::steady_clock;

int first_token(int rank, int num_ranks, int num_tokens) { return (rank * num_tokens + num_ranks - 1) / num_ranks; }

// Layer 0 of `p` as every one of L layers (rows, replica ranks and counts repeated).
Placement repeat_layer(const Placement& p, int num_layers) {
  Placement out = p;
  out.num_layers = num_layers;
  out.phy2log.clear(), out.log2phy.clear(), out.replica_count.clear();
  for (int l = 0; l < num_layers; ++l) {
    out.phy2log.insert(out.phy2log.end(), p.phy2log_row(0), p.phy2log_row(0) + p.num_slots);
    out.log2phy.insert(out.log2phy.end(), p.log2phy_row(0), p.log2phy_row(0) + size_t(p.num_experts) * p.max_replicas);
    out.replica_count.insert(out.replica_count.end(), p.replica_count_row(0), p.replica_count_row(0) + p.num_experts);
  }
  return out;
}

// The CPU layers of every MoE layer over P in-process ranks; layer l + 1's input is x + layer l's
// output (as cmd_run.cpp's one step).
class CpuBackend : public RebalanceBackend {
 public:
  CpuBackend(const RebalanceRunInput& in, const Placement& placement, int max_tokens)
      : spec_(*in.model), weights_(*in.weights), check_(in.check), P_(in.num_ranks) {
    CpuLayerConfig cfg;
    cfg.num_ranks = P_;
    cfg.max_tokens = max_tokens;
    cfg.protocol = in.protocol == "normal" ? EpProtocol::kNormal : EpProtocol::kLowLatency;
    cfg.replica_seed = in.seed;
    for (int l = 0; l < int(weights_.size()); ++l)
      layers_.push_back(std::make_unique<CpuMoeLayer>(spec_, weights_[l], placement, l, cfg));
    group_ = std::make_unique<LocalEpGroup>(layers_[0]->ep_config());
    std::mt19937_64 rng(in.seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    x0_.resize(size_t(max_tokens) * P_ * spec_.hidden_size);
    for (auto& v : x0_) v = float_to_bf16(normal(rng));
    if (check_)
      for (const auto& w : weights_) oracle_weights_.push_back(dequantize_layer_f64(w));
  }

  LoopStep run_step(const std::vector<const std::vector<int32_t>*>& idx, int T) override {
    const int L = int(layers_.size()), d = int(spec_.hidden_size), k = spec_.num_experts_per_token;
    const std::vector<float> w(size_t(T) * k, float(spec_.router.routed_scaling_factor / k));
    std::vector<std::vector<uint16_t>> x(L + 1, std::vector<uint16_t>(size_t(T) * d)), out(L, x[0]);
    std::copy(x0_.begin(), x0_.begin() + size_t(T) * d, x[0].begin());
    const auto start = Clock::now();
    run_ranks(*group_, [&](int r) {
      const int t0 = first_token(r, P_, T), t1 = first_token(r + 1, P_, T);
      for (int l = 0; l < L; ++l) {
        layers_[l]->forward(*group_, r, t1 - t0, t0, x[l].data() + size_t(t0) * d, out[l].data() + size_t(t0) * d,
                            idx[l]->data() + size_t(t0) * k, w.data() + size_t(t0) * k);
        for (size_t i = size_t(t0) * d; i < size_t(t1) * d; ++i)
          x[l + 1][i] = float_to_bf16(bf16_to_float(x[l][i]) + bf16_to_float(out[l][i]));
      }
    });
    LoopStep st;
    st.step_s = std::chrono::duration<double>(Clock::now() - start).count();
    for (int l = 0; l < L; ++l) {
      st.counts.emplace_back(spec_.num_routed_experts, 0);
      st.rows.emplace_back(P_, 0);
      std::vector<int32_t> all_idx;
      std::vector<float> all_w;
      for (int r = 0; r < P_; ++r) {
        const RankStep& rs = layers_[l]->last_step(r);
        for (int32_t e : rs.topk_idx)
          if (e >= 0) ++st.counts[l][e];
        st.rows[l][r] = rs.ep.recv_rows;
        all_idx.insert(all_idx.end(), rs.topk_idx.begin(), rs.topk_idx.end());
        all_w.insert(all_w.end(), rs.topk_weights.begin(), rs.topk_weights.end());
      }
      if (check_) {
        std::vector<float> xf(size_t(T) * d);
        for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_float(x[l][i]);
        std::vector<double> want(xf.size()), got(xf.size());
        ref::moe_layer_f64(xf.data(), T, all_idx.data(), all_w.data(), k, oracle_weights_[l]->view, want.data());
        for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_float(out[l][i]);
        st.error_vs_oracle.push_back(ref::relative_frobenius_error(got.data(), want.data(), got.size()));
      }
    }
    return st;
  }

  void start_moves(const RebalancePlan& plan) override { plan_ = plan; }

  // Every layer's moves at once, at the step boundary: no step runs while they are copied.
  Progress advance_moves(double) override {
    MOEKIT_CHECK(plan_.has_value(), std::string("advance_moves: no plan was started"));
    Progress p;
    for (auto& layer : layers_) p.bytes_copied += double(layer->apply_moves(plan_->placement, plan_->moves));
    p.switched = true;
    plan_.reset();
    return p;
  }

 private:
  const ModelSpec& spec_;
  const std::vector<MoeLayerWeights>& weights_;
  bool check_;
  int P_;
  std::vector<std::unique_ptr<CpuMoeLayer>> layers_;
  std::unique_ptr<LocalEpGroup> group_;
  std::vector<uint16_t> x0_;
  std::vector<std::unique_ptr<LayerWeightsF64>> oracle_weights_;
  std::optional<RebalancePlan> plan_;
};

// max / mean of a layer's rows per rank (1 when the layer served nothing).
double max_over_mean(const std::vector<int64_t>& rows) {
  int64_t mx = 0, sum = 0;
  for (int64_t r : rows) mx = std::max(mx, r), sum += r;
  return sum > 0 ? double(mx) * double(rows.size()) / double(sum) : 1.0;
}

// --check's bound: the CPU layer's 3e-3 against the float64 oracle; the GPU layer's 1.5e-2
// (cmd_run.cpp's oracle_tolerance, docs/layer-gpu.md).
double oracle_bound(const std::string& backend) { return backend == "cuda" ? 1.5e-2 : 3e-3; }

struct StepRecord {
  int64_t step = 0;
  int tokens = 0;
  std::vector<double> max_over_mean;  // [L]
  double worst = 1, mean = 1;
  double step_s = 0;
  bool started = false, switched = false, moving = false;
  std::optional<RebalanceDecision> decision;
  double bytes_copied = 0;
  std::vector<double> error_vs_oracle;
};

nlohmann::json decision_json(const RebalanceDecision& d) {
  return {{"started_step", d.started_step},
          {"ready_step", d.ready_step},
          {"verdict", verdict_name(d.verdict)},
          {"s0", d.gate.s0},
          {"s1", d.gate.s1},
          {"end_to_end", d.gate.end_to_end},
          {"replicas_moved", d.replicas_moved},
          {"fresh_replicas_moved", d.fresh_replicas_moved},
          {"layers_kept", d.layers_kept},
          {"bytes_moved", d.bytes_moved},
          {"max_gpu_bytes_in", d.max_gpu_bytes_in},
          {"mean_step_s", d.mean_step_s},
          {"gain_per_step_s", d.gain_per_step_s},
          {"move_cost_s", d.move_cost_s},
          {"compute_s", d.compute_s}};
}

std::string decision_text(const RebalanceDecision& d) {
  return fmt::format("{} (started {}, gain {:.3f}, {} moves vs {} fresh)", verdict_name(d.verdict), d.started_step,
                     d.gate.end_to_end, d.replicas_moved, d.fresh_replicas_moved);
}

}  // namespace

std::unique_ptr<RebalanceBackend> make_cpu_backend(const RebalanceRunInput& in, const Placement& placement,
                                                   int max_tokens) {
  return std::make_unique<CpuBackend>(in, placement, max_tokens);
}

void run_rebalance(const RebalanceRunInput& in) {
  const RebalanceRunOptions& o = in.options;
  const ModelSpec& spec = *in.model;
  const RoutingTrace& trace = *in.trace;
  const int L = trace.num_layers(), P = in.num_ranks, steps = trace.num_steps(0);
  const int d = int(spec.hidden_size), inter = int(spec.moe_intermediate_size);
  int max_batch = 0;
  for (int s = 0; s < steps; ++s) max_batch = std::max(max_batch, trace.num_tokens(0, s));
  MOEKIT_CHECK(max_batch >= 1, std::string("--rebalance: the trace's steps hold no tokens"));
  const int max_tokens = (max_batch + P - 1) / P;

  RebalancerConfig cfg;
  cfg.window_steps = o.window;
  cfg.interval_steps = o.interval;
  cfg.warmup_steps = 0;
  cfg.min_gain = o.min_gain;
  cfg.balanceable_share = o.share;
  cfg.lag_steps = o.lag;
  cfg.payback_steps = o.payback;
  // One replica's weights: W1 [2 inter, d] and W2 [d, inter] in FP8 with their 128x128 block scales.
  cfg.expert_bytes = 3.0 * inter * d + 3.0 * (inter / 128) * (d / 128) * 4;
  MOEKIT_CHECK(std::isfinite(o.copy_gbps * 1e9) && o.copy_gbps >= 0,
               fmt::format("--copy-gbps {}: expected a finite rate >= 0 GB/s (0: the moves cost nothing)", o.copy_gbps));
  cfg.copy_bytes_per_s = o.copy_gbps * 1e9;
  try {
    validate(cfg);
  } catch (const Error& e) {  // name the flags, not the struct's fields
    throw Error(fmt::format("--window {} --interval {} --min-gain {} --balanceable-share {} --lag {} --payback {}: {}",
                            o.window, o.interval, o.min_gain, o.share, o.lag, o.payback, e.what()));
  }
  const Placement start = repeat_layer(*in.placement, L);
  const auto make_rebalancer = [&] {
    try {
      return Rebalancer(start, cfg);
    } catch (const Error& e) {  // the window's memory: name the flag
      throw Error(fmt::format("--window {}: {}", o.window, e.what()));
    }
  };
  Rebalancer rebalancer = make_rebalancer();
  std::unique_ptr<RebalanceBackend> backend;
  if (in.backend == "cuda") {
#ifdef MOEKIT_WITH_CUDA
    backend = make_cuda_backend(in, start, max_tokens);
#endif
  } else {
    backend = make_cpu_backend(in, start, max_tokens);
  }

  std::vector<StepRecord> records;
  std::vector<RebalanceDecision> decisions;
  std::vector<int64_t> switched_at;  // per rebalance decision: the last step before its switch
  bool moving = false;
  for (int s = 0; s < steps; ++s) {
    std::vector<const std::vector<int32_t>*> idx(L);
    for (int l = 0; l < L; ++l) idx[l] = &trace.layers[l][s];
    StepRecord rec;
    rec.step = s;
    rec.tokens = trace.num_tokens(0, s);
    rec.moving = moving;
    const LoopStep st = backend->run_step(idx, rec.tokens);
    rec.step_s = st.step_s;
    rec.error_vs_oracle = st.error_vs_oracle;
    double sum = 0;
    for (int l = 0; l < L; ++l) {
      rec.max_over_mean.push_back(max_over_mean(st.rows[l]));
      rec.worst = l == 0 ? rec.max_over_mean[0] : std::max(rec.worst, rec.max_over_mean[l]);
      sum += rec.max_over_mean[l];
    }
    rec.mean = sum / L;
    const RebalanceStep r = rebalancer.step(st.counts, st.step_s);
    rec.started = r.started;
    rec.decision = r.decision;
    if (r.decision) decisions.push_back(*r.decision);
    if (r.plan) {
      backend->start_moves(*r.plan);
      moving = true;
    }
    if (moving) {
      const RebalanceBackend::Progress p = backend->advance_moves(st.step_s);
      rec.bytes_copied = p.bytes_copied;
      if (p.switched) {
        rebalancer.applied();
        rec.switched = true;
        switched_at.push_back(s);
        moving = false;
      }
    }
    for (size_t l = 0; l < rec.error_vs_oracle.size(); ++l)
      MOEKIT_CHECK(rec.error_vs_oracle[l] <= oracle_bound(in.backend),
                   fmt::format("--check: step {} layer {}: relative error {:.3e} against the float64 oracle is above "
                               "the {} backend's bound {}",
                               s, l, rec.error_vs_oracle[l], in.backend, oracle_bound(in.backend)));
    records.push_back(std::move(rec));
  }

  int rebalances = 0;
  int64_t moved = 0, fresh = 0;
  double bytes = 0;
  for (const RebalanceDecision& dd : decisions)
    if (dd.rebalance()) ++rebalances, moved += dd.replicas_moved, fresh += dd.fresh_replicas_moved, bytes += dd.bytes_moved;
  double worst_sum = 0, step_sum = 0, step_moving = 0;
  int n_moving = 0;
  for (const StepRecord& rec : records) {
    worst_sum += rec.worst;
    step_sum += rec.step_s;
    if (rec.moving) step_moving += rec.step_s, ++n_moving;
  }
  const int n_still = steps - n_moving;
  const double step_still = step_sum - step_moving;

  if (in.json) {
    nlohmann::json j;
    j["model"] = spec.name;
    j["backend"] = in.backend;
    j["ep"] = P;
    j["layers"] = L;
    j["protocol"] = in.protocol;
    j["routing"] = in.routing_text;
    j["num_slots"] = start.num_slots;
    j["steps_run"] = steps;
    j["config"] = {{"window", o.window},          {"interval", o.interval}, {"min_gain", o.min_gain},
                   {"balanceable_share", o.share}, {"lag", o.lag},           {"copy_bytes_per_s", cfg.copy_bytes_per_s},
                   {"payback", o.payback},         {"expert_bytes", cfg.expert_bytes}};
    for (const StepRecord& rec : records) {
      nlohmann::json row = {{"step", rec.step},
                            {"tokens", rec.tokens},
                            {"max_over_mean", rec.worst},
                            {"max_over_mean_mean", rec.mean},
                            {"max_over_mean_layers", rec.max_over_mean},
                            {"step_s", rec.step_s},
                            {"started", rec.started},
                            {"moving", rec.moving},
                            {"switched", rec.switched},
                            {"bytes_copied", rec.bytes_copied},
                            {"decision", rec.decision ? decision_json(*rec.decision) : nlohmann::json(nullptr)}};
      if (in.check) row["error_vs_oracle"] = rec.error_vs_oracle;
      j["steps"].push_back(row);
    }
    j["decisions"] = nlohmann::json::array();
    for (const RebalanceDecision& dd : decisions) j["decisions"].push_back(decision_json(dd));
    j["switched_steps"] = switched_at;
    j["summary"] = {{"rebalances", rebalances},
                    {"replicas_moved", moved},
                    {"fresh_replicas_moved", fresh},
                    {"bytes_moved", bytes},
                    {"mean_max_over_mean", worst_sum / steps},
                    {"mean_step_s", step_sum / steps},
                    {"mean_step_s_without_moves", n_still ? nlohmann::json(step_still / n_still) : nlohmann::json(nullptr)},
                    {"mean_step_s_during_moves", n_moving ? nlohmann::json(step_moving / n_moving) : nlohmann::json(nullptr)},
                    {"steps_during_moves", n_moving}};
    fmt::print("{}\n", j.dump(2));
    return;
  }

  fmt::print("moekit run --rebalance: {} on {}, EP {} (in-process ranks), {} layer{}, {} steps of up to {} tokens, {} "
             "protocol\n",
             spec.name, in.backend == "cuda" ? "one GPU" : "the CPU", P, L, L > 1 ? "s" : "", steps, max_batch,
             in.protocol);
  fmt::print("routing: {}\n", in.routing_text);
  fmt::print("placement: {} slots on {} ranks; loads over the last {} steps, a decision every {} steps (gate: gain >= "
             "{:.3f}, f = {}{})\n\n",
             start.num_slots, P, o.window, o.interval, 1 + o.min_gain, o.share,
             o.copy_gbps > 0 ? fmt::format(", copies at {} GB/s paid back in {} steps", o.copy_gbps, o.payback) : "");
  fmt::print("{:>5} {:>6} {:>9} {:>9} {:>9}  {}\n", "step", "tokens", "max/mean", "(mean)", "time ms", "events");
  for (const StepRecord& rec : records) {
    std::string events;
    if (rec.started) events += "decision started; ";
    if (rec.decision) events += decision_text(*rec.decision) + "; ";
    if (rec.bytes_copied > 0) events += fmt::format("copied {:.2f} MB; ", rec.bytes_copied / 1e6);
    if (rec.switched) events += "switched (new placement from the next step); ";
    if (!events.empty()) events.resize(events.size() - 2);
    fmt::print("{:>5} {:>6} {:>9.3f} {:>9.3f} {:>9.3f}  {}\n", rec.step, rec.tokens, rec.worst, rec.mean,
               rec.step_s * 1e3, events);
  }
  fmt::print("\n{} rebalance{} of {} decisions: {} replicas moved ({:.1f} MB), where fresh placements would have moved "
             "{}\n",
             rebalances, rebalances == 1 ? "" : "s", decisions.size(), moved, bytes / 1e6, fresh);
  fmt::print("max/mean rows per GPU (worst layer), mean over steps: {:.3f}; step time: mean {:.3f} ms{}\n",
             worst_sum / steps, 1e3 * step_sum / steps,
             n_moving ? fmt::format(" ({:.3f} ms over {} steps with copies in flight, {:.3f} ms over the others)",
                                    1e3 * step_moving / n_moving, n_moving, n_still ? 1e3 * step_still / n_still : 0.0)
                      : "");
  if (in.check)
    fmt::print("every step's output is within {} of the float64 oracle (--check)\n", oracle_bound(in.backend));
}

}  // namespace moekit::cli
