// Rebalancing while serving: statistics, a decision on a host thread, and the plan of moves
// (see include/moekit/rebalance.h).
#include "moekit/rebalance.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "moekit/check.h"

namespace moekit {

namespace {

void check_same_shape(const Placement& a, const Placement& b, const char* what) {
  MOEKIT_CHECK(a.num_layers == b.num_layers && a.num_experts == b.num_experts && a.num_slots == b.num_slots &&
                   a.num_gpus == b.num_gpus && a.num_nodes == b.num_nodes,
               fmt::format("{}: placements of {} layers x {} experts in {} slots on {} GPUs ({} nodes) and {} x {} in "
                           "{} on {} ({}) differ in shape",
                           what, a.num_layers, a.num_experts, a.num_slots, a.num_gpus, a.num_nodes, b.num_layers,
                           b.num_experts, b.num_slots, b.num_gpus, b.num_nodes));
}

// The placement `from_candidate` with the layers flagged in `keep` taken from `current` instead
// (rows of phy2log, replica_count and log2phy, the latter at the larger stride).
Placement splice_layers(const Placement& candidate, const Placement& current, const std::vector<char>& keep) {
  Placement p = candidate;
  p.max_replicas = std::max(candidate.max_replicas, current.max_replicas);
  const int L = p.num_layers, E = p.num_experts, S = p.num_slots, R = p.max_replicas;
  p.log2phy.assign(size_t(L) * E * R, -1);
  for (int l = 0; l < L; ++l) {
    const Placement& src = keep[l] ? current : candidate;
    std::copy(src.phy2log_row(l), src.phy2log_row(l) + S, p.phy2log.begin() + size_t(l) * S);
    std::copy(src.replica_count_row(l), src.replica_count_row(l) + E, p.replica_count.begin() + size_t(l) * E);
    for (int e = 0; e < E; ++e)
      std::copy(src.log2phy_row(l) + size_t(e) * src.max_replicas, src.log2phy_row(l) + size_t(e + 1) * src.max_replicas,
                p.log2phy.begin() + (size_t(l) * E + e) * R);
  }
  return p;
}

// Layers whose change from `current` to `candidate` copies more than `limit` slots onto one GPU.
std::vector<char> layers_over_limit(const Placement& current, const Placement& candidate, int limit) {
  std::vector<char> over(current.num_layers, 0);
  if (limit <= 0) return over;
  const int per_gpu = current.slots_per_gpu();
  for (int l = 0; l < current.num_layers; ++l)
    for (int g = 0; g < current.num_gpus && !over[l]; ++g) {
      int changed = 0;
      for (int s = g * per_gpu; s < (g + 1) * per_gpu; ++s)
        changed += current.phy2log_row(l)[s] != candidate.phy2log_row(l)[s];
      over[l] = changed > limit;
    }
  return over;
}

}  // namespace

std::vector<ExpertMove> plan_moves(const Placement& from, const Placement& to) {
  check_same_shape(from, to, "plan_moves");
  const int S = from.num_slots, per_gpu = from.slots_per_gpu();
  std::vector<int64_t> sourced(from.num_gpus, 0);  // moves each GPU sources, over the whole plan
  std::vector<ExpertMove> moves;
  for (int l = 0; l < from.num_layers; ++l) {
    const int32_t* old = from.phy2log_row(l);
    const int32_t* now = to.phy2log_row(l);
    for (int s = 0; s < S; ++s) {
      if (old[s] == now[s]) continue;
      ExpertMove m;
      m.layer = l;
      m.slot = s;
      m.expert = now[s];
      m.dst_gpu = s / per_gpu;
      // Rank of a candidate source: own GPU, then own node, then anywhere; then the GPU that
      // sources the fewest moves so far; then the lowest slot (the scan order).
      auto rank_of = [&](int q) {
        const int g = q / per_gpu;
        const int tier = g == m.dst_gpu ? 0 : from.node_of_gpu(g) == from.node_of_gpu(m.dst_gpu) ? 1 : 2;
        return std::pair<int, int64_t>(tier, tier == 0 ? 0 : sourced[g]);
      };
      int best = -1;
      for (int q = 0; q < S; ++q)
        if (old[q] == m.expert && (best < 0 || rank_of(q) < rank_of(best))) best = q;
      MOEKIT_CHECK(best >= 0, fmt::format("plan_moves: layer {}: expert {} has no replica in the current placement", l,
                                          m.expert));
      m.src_slot = best;
      m.src_gpu = best / per_gpu;
      if (!m.local()) ++sourced[m.src_gpu];
      moves.push_back(m);
    }
  }
  return moves;
}

void validate_moves(const Placement& from, const Placement& to, int layer, const std::vector<ExpertMove>& moves) {
  check_same_shape(from, to, "validate_moves");
  MOEKIT_CHECK(layer >= 0 && layer < from.num_layers,
               fmt::format("validate_moves: layer {} out of range [0, {})", layer, from.num_layers));
  const int S = from.num_slots, per_gpu = from.slots_per_gpu();
  const int32_t* old = from.phy2log_row(layer);
  const int32_t* now = to.phy2log_row(layer);
  std::vector<char> moved(S, 0);
  for (size_t i = 0; i < moves.size(); ++i) {
    const ExpertMove& m = moves[i];
    if (m.layer != layer) continue;
    MOEKIT_CHECK(m.slot >= 0 && m.slot < S && m.src_slot >= 0 && m.src_slot < S,
                 fmt::format("move {}: slot {} or source slot {} out of range [0, {})", i, m.slot, m.src_slot, S));
    MOEKIT_CHECK(!moved[m.slot], fmt::format("move {}: layer {} slot {} is moved twice", i, layer, m.slot));
    MOEKIT_CHECK(now[m.slot] == m.expert && old[m.slot] != m.expert,
                 fmt::format("move {}: layer {} slot {} gets expert {}, but the placements give it {} before and {} "
                             "after",
                             i, layer, m.slot, m.expert, old[m.slot], now[m.slot]));
    MOEKIT_CHECK(old[m.src_slot] == m.expert,
                 fmt::format("move {}: source slot {} holds expert {} in the current placement, not expert {}", i,
                             m.src_slot, old[m.src_slot], m.expert));
    MOEKIT_CHECK(m.dst_gpu == m.slot / per_gpu && m.src_gpu == m.src_slot / per_gpu,
                 fmt::format("move {}: GPUs {} <- {} do not match slots {} <- {} ({} slots per GPU)", i, m.dst_gpu,
                             m.src_gpu, m.slot, m.src_slot, per_gpu));
    moved[m.slot] = 1;
  }
  for (int s = 0; s < S; ++s)
    MOEKIT_CHECK(moved[s] || old[s] == now[s],
                 fmt::format("layer {} slot {} changes from expert {} to {} but no move fills it", layer, s, old[s],
                             now[s]));
}

void validate(const RebalancerConfig& c) {
  MOEKIT_CHECK(c.decay == 0 || (c.decay > 0 && c.decay < 1),
               fmt::format("rebalancer: decay = {} must be in (0, 1), or 0 for the window", c.decay));
  MOEKIT_CHECK(c.decay > 0 || c.window_steps >= 1,
               fmt::format("rebalancer: window_steps = {} must be >= 1", c.window_steps));
  MOEKIT_CHECK(c.interval_steps >= 1, fmt::format("rebalancer: interval_steps = {} must be >= 1", c.interval_steps));
  MOEKIT_CHECK(c.warmup_steps >= 0, fmt::format("rebalancer: warmup_steps = {} must be >= 0", c.warmup_steps));
  MOEKIT_CHECK(c.balanceable_share >= 0 && c.balanceable_share <= 1,
               fmt::format("rebalancer: balanceable_share = {} must be in [0, 1]", c.balanceable_share));
  MOEKIT_CHECK(std::isfinite(c.min_gain) && c.min_gain >= 0,
               fmt::format("rebalancer: min_gain = {} must be finite and >= 0", c.min_gain));
  MOEKIT_CHECK(c.tolerance >= 0 && c.tolerance < 1,
               fmt::format("rebalancer: tolerance = {} must be in [0, 1)", c.tolerance));
  MOEKIT_CHECK(std::isfinite(c.expert_bytes) && c.expert_bytes >= 0,
               fmt::format("rebalancer: expert_bytes = {} must be finite and >= 0", c.expert_bytes));
  MOEKIT_CHECK(std::isfinite(c.copy_bytes_per_s) && c.copy_bytes_per_s >= 0,
               fmt::format("rebalancer: copy_bytes_per_s = {} must be finite and >= 0", c.copy_bytes_per_s));
  MOEKIT_CHECK(c.copy_bytes_per_s == 0 || c.expert_bytes > 0,
               fmt::format("rebalancer: copy_bytes_per_s = {} prices the moves, so expert_bytes (now {}) must be > 0",
                           c.copy_bytes_per_s, c.expert_bytes));
  MOEKIT_CHECK(c.payback_steps >= 1, fmt::format("rebalancer: payback_steps = {} must be >= 1", c.payback_steps));
  MOEKIT_CHECK(c.max_moves_per_gpu >= 0,
               fmt::format("rebalancer: max_moves_per_gpu = {} must be >= 0 (0: no limit)", c.max_moves_per_gpu));
  MOEKIT_CHECK(c.lag_steps >= 0, fmt::format("rebalancer: lag_steps = {} must be >= 0", c.lag_steps));
}

const char* verdict_name(RebalanceVerdict v) {
  switch (v) {
    case RebalanceVerdict::kRebalance: return "rebalance";
    case RebalanceVerdict::kUnchanged: return "unchanged";
    case RebalanceVerdict::kGainTooSmall: return "gain too small";
    case RebalanceVerdict::kMovesCostMore: return "moves cost more";
  }
  return "?";
}

namespace {

struct Job {
  std::vector<std::vector<double>> loads;
  Placement current;
  double mean_step_s = 0;
  int64_t started_step = 0;
};

struct Outcome {
  RebalanceDecision decision;
  std::optional<RebalancePlan> plan;
};

// The thread's work: the candidate, the moves, their cost and the verdict.
Outcome decide(const Job& job, const RebalancerConfig& cfg, const PlacementPolicy& policy) {
  const auto start = std::chrono::steady_clock::now();
  MigrationResult m = policy(job.loads, job.current);
  check_same_shape(job.current, m.placement, "rebalancer policy");
  const std::vector<char> keep = layers_over_limit(job.current, m.placement, cfg.max_moves_per_gpu);
  const int kept = int(std::count(keep.begin(), keep.end(), 1));
  Placement candidate = kept > 0 ? splice_layers(m.placement, job.current, keep) : std::move(m.placement);
  std::vector<ExpertMove> moves = plan_moves(job.current, candidate);

  Outcome out;
  RebalanceDecision& d = out.decision;
  d.started_step = job.started_step;
  d.gate = rebalance_gate(job.loads, job.current, candidate, cfg.balanceable_share, cfg.min_gain);
  d.replicas_moved = int64_t(moves.size());
  d.fresh_replicas_moved = m.fresh_replicas_moved;
  d.layers_kept = kept;
  std::vector<double> bytes_in(job.current.num_gpus, 0.0);
  for (const ExpertMove& mv : moves) bytes_in[mv.dst_gpu] += cfg.expert_bytes;
  d.bytes_moved = double(moves.size()) * cfg.expert_bytes;
  d.max_gpu_bytes_in = *std::max_element(bytes_in.begin(), bytes_in.end());
  d.mean_step_s = job.mean_step_s;
  d.gain_per_step_s = job.mean_step_s * (1.0 - 1.0 / d.gate.end_to_end);
  d.move_cost_s = cfg.copy_bytes_per_s > 0 ? d.max_gpu_bytes_in / cfg.copy_bytes_per_s : 0.0;
  if (moves.empty())
    d.verdict = RebalanceVerdict::kUnchanged;
  else if (!d.gate.rebalance)
    d.verdict = RebalanceVerdict::kGainTooSmall;
  else if (cfg.copy_bytes_per_s > 0 && d.gain_per_step_s * cfg.payback_steps < d.move_cost_s)
    d.verdict = RebalanceVerdict::kMovesCostMore;
  else
    d.verdict = RebalanceVerdict::kRebalance;
  if (d.rebalance()) out.plan = RebalancePlan{std::move(candidate), std::move(moves)};
  d.compute_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

LoadRecorder make_recorder(const Placement& p, const RebalancerConfig& c) {
  return c.decay > 0 ? LoadRecorder::decay(p.num_layers, p.num_experts, c.decay)
                     : LoadRecorder::window(p.num_layers, p.num_experts, c.window_steps);
}

}  // namespace

struct Rebalancer::State {
  RebalancerConfig cfg;
  PlacementPolicy policy;
  Placement current;
  LoadRecorder recorder;
  int64_t steps = 0;       // steps recorded
  int64_t last_start = 0;  // steps recorded when the last decision started or a plan was applied
  double step_time_sum = 0;
  int64_t step_time_count = 0;
  std::optional<RebalancePlan> outstanding;
  bool computing = false;  // a job is with the thread or its outcome not yet picked up
  int64_t job_started = 0;

  // Shared with the thread, under `mu`.
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::optional<Job> job;          // handed over, not yet taken
  std::optional<Outcome> outcome;  // finished, not yet picked up
  std::exception_ptr error;
  std::thread thread;

  State(const Placement& p, const RebalancerConfig& c, PlacementPolicy pol)
      : cfg(c), policy(std::move(pol)), current(p), recorder(make_recorder(p, c)) {}

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || job.has_value(); });
      if (stop) return;
      Job j = std::move(*job);
      job.reset();
      lock.unlock();
      std::optional<Outcome> o;
      std::exception_ptr e;
      try {
        o = decide(j, cfg, policy);
      } catch (...) {
        e = std::current_exception();
      }
      lock.lock();
      outcome = std::move(o);
      error = e;
      cv.notify_all();
    }
  }

  // The outcome, if it is due at this step: ready (lag 0), or exactly lag_steps after the start.
  std::optional<Outcome> pick_up(int64_t step_index) {
    if (!computing) return std::nullopt;
    std::unique_lock<std::mutex> lock(mu);
    if (cfg.lag_steps > 0) {
      if (step_index != job_started + cfg.lag_steps) return std::nullopt;
      cv.wait(lock, [&] { return outcome.has_value() || error; });
    } else if (!outcome && !error) {
      return std::nullopt;
    }
    computing = false;
    if (error) {
      std::exception_ptr e = error;
      error = nullptr;
      std::rethrow_exception(e);
    }
    std::optional<Outcome> o = std::move(outcome);
    outcome.reset();
    return o;
  }
};

Rebalancer::Rebalancer(const Placement& initial, const RebalancerConfig& config, PlacementPolicy policy) {
  validate(config);
  MOEKIT_CHECK(initial.num_layers >= 1 && initial.num_experts >= 1 && initial.num_gpus >= 1,
               fmt::format("rebalancer: the initial placement has {} layers, {} experts, {} GPUs; expected >= 1 each",
                           initial.num_layers, initial.num_experts, initial.num_gpus));
  if (!policy) {
    const double tolerance = config.tolerance;
    const bool per_layer = config.per_layer_target;
    policy = [tolerance, per_layer](const std::vector<std::vector<double>>& loads, const Placement& current) {
      return rebalance_with_fewer_moves(loads, current, tolerance, per_layer);
    };
  }
  state_ = std::make_unique<State>(initial, config, std::move(policy));
  state_->thread = std::thread([s = state_.get()] { s->run(); });
}

Rebalancer::~Rebalancer() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  state_->thread.join();
}

RebalanceStep Rebalancer::step(const std::vector<std::vector<int64_t>>& counts, double step_time_s) {
  State& s = *state_;
  const int L = s.current.num_layers, E = s.current.num_experts;
  MOEKIT_CHECK(int(counts.size()) == L,
               fmt::format("Rebalancer::step: counts for {} layers, expected {} (the placement's)", counts.size(), L));
  for (int l = 0; l < L; ++l) {
    MOEKIT_CHECK(int(counts[l].size()) == E,
                 fmt::format("Rebalancer::step: layer {} has {} counts, expected {} experts", l, counts[l].size(), E));
    for (int e = 0; e < E; ++e)
      MOEKIT_CHECK(counts[l][e] >= 0,
                   fmt::format("Rebalancer::step: layer {} expert {} count {} is negative", l, e, counts[l][e]));
  }
  MOEKIT_CHECK(std::isfinite(step_time_s) && step_time_s >= 0,
               fmt::format("Rebalancer::step: step_time_s = {} must be finite and >= 0", step_time_s));

  for (int l = 0; l < L; ++l) s.recorder.record_counts(l, counts[l].data());
  s.recorder.end_step();
  RebalanceStep r;
  r.step = s.steps++;
  s.step_time_sum += step_time_s;
  ++s.step_time_count;

  if (std::optional<Outcome> o = s.pick_up(r.step)) {
    o->decision.ready_step = r.step;
    r.decision = std::move(o->decision);
    if (o->plan) {
      s.outstanding = *o->plan;
      r.plan = std::move(o->plan);
    }
  }
  if (!s.computing && !s.outstanding && s.steps >= s.cfg.warmup_steps &&
      s.steps - s.last_start >= s.cfg.interval_steps) {
    Job j{s.recorder.loads(), s.current, s.step_time_sum / double(s.step_time_count), r.step};
    s.last_start = s.steps;
    s.step_time_sum = 0;
    s.step_time_count = 0;
    s.computing = true;
    s.job_started = r.step;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.job = std::move(j);
    }
    s.cv.notify_all();
    r.started = true;
  }
  return r;
}

void Rebalancer::applied() {
  State& s = *state_;
  MOEKIT_CHECK(s.outstanding.has_value(), std::string("Rebalancer::applied: no plan is outstanding"));
  s.current = std::move(s.outstanding->placement);
  s.outstanding.reset();
  s.last_start = s.steps;
  s.step_time_sum = 0;
  s.step_time_count = 0;
}

void Rebalancer::abandoned() {
  State& s = *state_;
  MOEKIT_CHECK(s.outstanding.has_value(), std::string("Rebalancer::abandoned: no plan is outstanding"));
  s.outstanding.reset();
}

const Placement& Rebalancer::placement() const { return state_->current; }
bool Rebalancer::plan_outstanding() const { return state_->outstanding.has_value(); }
bool Rebalancer::computing() const { return state_->computing; }
std::vector<std::vector<double>> Rebalancer::loads() const { return state_->recorder.loads(); }
const RebalancerConfig& Rebalancer::config() const { return state_->cfg; }

}  // namespace moekit
