// moekit/rebalance.h: rebalancing while serving, the loop around eplb.h.
//
// A serving loop calls Rebalancer::step() once per step with that step's token counts per
// layer and logical expert (GpuMoeLayer::take_expert_counts, or the top-k ids of the CPU
// layer's routing), and the step's time. The rebalancer
//   1. adds the counts to a LoadRecorder: a window of the last N steps, or exponential decay;
//   2. every `interval_steps` steps (once `warmup_steps` steps are recorded), and only while no
//      decision is being computed and no plan is outstanding, hands a copy of the loads and of
//      the current placement to its own host thread. That thread computes
//      rebalance_with_fewer_moves() (the placement closest to the current one that is within
//      `tolerance` of a fresh rebalance) and the gate below. step() never waits for it;
//   3. returns the result from the first step() call after the thread has finished (or, with
//      lag_steps > 0, from exactly lag_steps steps after it started, waiting if it must: for
//      runs that must be reproducible step for step).
//
// The gate. rebalance_gate() predicts the end-to-end gain g = 1 / (f / (S0/S1) + 1 - f) of the
// candidate over the current placement under the recorded loads (eplb.h). The plan goes ahead
// when g >= 1 + min_gain and, when copy_bytes_per_s > 0, when the time it saves over
// payback_steps steps pays for the time its copies take:
//     mean_step_s * (1 - 1/g) * payback_steps >= max_gpu_bytes_in / copy_bytes_per_s
// where mean_step_s is the mean step time passed to step() since the last decision started (or
// the last plan was applied) and
// max_gpu_bytes_in the bytes copied onto the GPU that receives the most (every GPU copies at the
// same time, so the busiest one decides how long the moves take). Charging the whole copy time
// is conservative: the copies run beside the steps and slow them only by their bandwidth share.
//
// The plan. The new placement and the moves that reach it from the current one: one move per
// slot whose logical expert changes, nothing else. Kept replicas stay in their slots (eplb.h),
// so the moves are exactly the fewest-moves placement's replicas_moved. Each move names a
// source: a slot that holds the expert in the CURRENT placement, on the destination GPU itself
// when it has one (a copy inside the GPU), else on another GPU of the same node, else on any GPU;
// among several GPUs, the one that sources the fewest moves of the plan so far (ties to the
// lowest slot), so copies spread over the links. Sources refer to the current placement because
// the moves are copied while it still serves; a slot that is both a source and a destination
// keeps its old weights until the switch (the layers stage the new ones).
//
// The caller carries the plan out (CpuMoeLayer::apply_moves, or GpuMoeLayer's begin_moves ..
// commit_moves, docs/eplb.md "the move protocol") and then calls applied() once every rank
// serves with the new placement, or abandoned() when it could not (a rank died during the
// moves): the rebalancer then keeps the old placement. No decision starts while a plan is
// outstanding, and the interval restarts when it is applied.
//
// Errors: bad configuration, counts of the wrong shape or negative, a bad step time, applied()
// or abandoned() with no plan outstanding: moekit::Error naming the value, before anything
// changes. An exception inside the thread's computation is rethrown by the step() that would
// have returned its result.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "moekit/eplb.h"

namespace moekit {

// One slot whose logical expert changes. The destination GPU is slot / slots_per_gpu.
struct ExpertMove {
  int layer = 0;     // placement layer
  int slot = 0;      // destination slot
  int expert = 0;    // the logical expert it holds from the switch on
  int src_slot = 0;  // a slot holding `expert` in the current placement
  int dst_gpu = 0, src_gpu = 0;
  bool local() const { return dst_gpu == src_gpu; }  // a copy inside one GPU
};

// The moves from `from` to `to` (same shape): one per slot whose expert differs, in (layer, slot)
// order, sources chosen by the rule above. Errors: placements of different shapes.
std::vector<ExpertMove> plan_moves(const Placement& from, const Placement& to);
// Checks that `moves` take layer `layer` of `from` exactly to layer `layer` of `to`: every slot
// that changes has one move, no other slot has one, every source holds the expert in `from`.
// Errors name the move, the slot and the expert. What the layers check before they copy.
void validate_moves(const Placement& from, const Placement& to, int layer, const std::vector<ExpertMove>& moves);

struct RebalancerConfig {
  // Statistics: exactly one of a window (steps) or a decay factor in (0, 1).
  int window_steps = 100;
  double decay = 0;  // > 0: LoadRecorder::decay(decay) instead of the window
  int interval_steps = 100;  // steps between two decisions
  int warmup_steps = 0;      // steps recorded before the first decision
  // The gate.
  double balanceable_share = 1.0;  // f: 1 when the step is MoE layers only
  double min_gain = 0.02;          // predicted end-to-end gain must reach 1 + min_gain
  double tolerance = 0.01;         // rebalance_with_fewer_moves' tolerance
  bool per_layer_target = true;    // and its per-layer target
  double expert_bytes = 0;         // bytes of one replica's weights (W1, W2 and their scales)
  double copy_bytes_per_s = 0;     // 0: moves cost nothing in the gate
  int payback_steps = 100;         // steps the gain must pay the copies back in
  // A layer whose new placement changes more than this many slots on one GPU keeps its current
  // placement in the plan (the GPU layer stages at most this many experts at once); 0: no limit.
  int max_moves_per_gpu = 0;
  int lag_steps = 0;  // > 0: results are picked up exactly this many steps after they start
};
void validate(const RebalancerConfig& config);

enum class RebalanceVerdict {
  kRebalance,     // the plan goes ahead
  kUnchanged,     // the plan has no moves: the fewest-moves placement is the current one, or
                  // max_moves_per_gpu held back every changed layer
  kGainTooSmall,  // g < 1 + min_gain
  kMovesCostMore  // the copies cost more than the gain saves over payback_steps
};
const char* verdict_name(RebalanceVerdict verdict);  // "rebalance" | "unchanged" | "gain too small" | "moves cost more"

struct RebalanceDecision {
  int64_t started_step = 0;  // the step after whose counts the computation started
  int64_t ready_step = 0;    // the step() call that returned it
  RebalanceVerdict verdict = RebalanceVerdict::kUnchanged;
  GateDecision gate;                 // current vs candidate under the recorded loads
  int64_t replicas_moved = 0;        // the plan's moves
  int64_t fresh_replicas_moved = 0;  // what a fresh rebalance would move
  int layers_kept = 0;               // layers held back by max_moves_per_gpu
  double bytes_moved = 0;            // replicas_moved * expert_bytes
  double max_gpu_bytes_in = 0;       // the GPU receiving the most
  double mean_step_s = 0;
  double gain_per_step_s = 0;  // mean_step_s * (1 - 1/g)
  double move_cost_s = 0;      // max_gpu_bytes_in / copy_bytes_per_s (0 when that is 0)
  double compute_s = 0;        // host time of the placement and the gate, on the thread
  bool rebalance() const { return verdict == RebalanceVerdict::kRebalance; }
};

struct RebalancePlan {
  Placement placement;             // the new placement
  std::vector<ExpertMove> moves;   // plan_moves(current, placement)
};

struct RebalanceStep {
  int64_t step = 0;                           // index of this step, from 0
  bool started = false;                       // a decision started after this step's counts
  std::optional<RebalanceDecision> decision;  // a decision finished and was picked up now
  std::optional<RebalancePlan> plan;          // when it says rebalance: carry it out
};

// What the thread computes: the fewest-moves placement for the loads, from the current one.
// Replaceable (tests slow it down; another policy can be tried) but it must keep the shape.
using PlacementPolicy =
    std::function<MigrationResult(const std::vector<std::vector<double>>& loads, const Placement& current)>;

class Rebalancer {
 public:
  // `initial`: the placement the layers start with (its layers are the layers of step()'s
  // counts). policy: null for rebalance_with_fewer_moves(loads, current, tolerance,
  // per_layer_target).
  Rebalancer(const Placement& initial, const RebalancerConfig& config, PlacementPolicy policy = nullptr);
  ~Rebalancer();  // waits for a computation in flight to finish
  Rebalancer(const Rebalancer&) = delete;
  Rebalancer& operator=(const Rebalancer&) = delete;

  // counts[l][e] >= 0: tokens of the step routed to logical expert e in layer l (all ranks);
  // step_time_s >= 0, finite (0 when unknown: the gain then saves no time).
  RebalanceStep step(const std::vector<std::vector<int64_t>>& counts, double step_time_s);

  void applied();    // the outstanding plan's placement now serves
  void abandoned();  // it never will: keep the current placement

  const Placement& placement() const;  // the one serving
  bool plan_outstanding() const;
  bool computing() const;  // a decision is being computed
  std::vector<std::vector<double>> loads() const;
  const RebalancerConfig& config() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace moekit
