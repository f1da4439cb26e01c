// `moekit run --rebalance`: the serving loop of rebalance.h over a routing trace. Every step runs
// the L layers on the trace's routing with the placement in use, hands the step's expert counts
// and time to a Rebalancer, carries out the plans it returns (CPU: apply_moves at the step
// boundary; CUDA: the staged moves of layer.h) and prints, per step, the max/mean rows per GPU,
// the decisions, the bytes copied and the step time (or JSON). The backends share this loop
// through RebalanceBackend.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moekit/eplb.h"
#include "moekit/rebalance.h"
#include "moekit/simulate.h"
#include "moekit/spec.h"
#include "moekit/trace.h"

namespace moekit {
struct MoeLayerWeights;
}

namespace moekit::cli {

struct RebalanceRunOptions {
  bool on = false;           // --rebalance
  std::string trace;         // --trace FILE; empty: sampled from --routing for --steps steps
  std::optional<int64_t> steps;  // --steps (default 200)
  int window = 20;           // --window
  int interval = 20;         // --interval
  double min_gain = 0.02;    // --min-gain
  double share = 1.0;        // --balanceable-share
  int lag = 0;               // --lag
  double copy_gbps = 0;      // --copy-gbps: the copies' share of bandwidth, GB/s (0: free, all at once)
  int payback = 100;         // --payback
};
void add_rebalance_options(CLI::App* cmd, RebalanceRunOptions& options);

// The routing of the run: the trace file, or `routing` sampled for options.steps steps of
// `batch` tokens (seeded). Checks it against the model (E, k) and the layers, before any weight
// is written.
RoutingTrace rebalance_trace(const RebalanceRunOptions& options, const Routing& routing, const ModelSpec& model,
                             int num_ranks, int64_t batch, int num_layers, uint64_t seed);

// What one step of all layers reports to the loop.
struct LoopStep {
  std::vector<std::vector<int64_t>> counts;  // [L][E] tokens per logical expert, all ranks
  std::vector<std::vector<int64_t>> rows;    // [L][P] token-expert rows each rank served
  double step_s = 0;
  std::vector<double> error_vs_oracle;       // [L], with --check
};

// A backend of the loop: runs steps with the placement in use and carries plans out.
class RebalanceBackend {
 public:
  virtual ~RebalanceBackend() = default;
  // One step of every layer; idx[l] is layer l's routing [T, k] (logical ids).
  virtual LoopStep run_step(const std::vector<const std::vector<int32_t>*>& idx, int num_tokens) = 0;
  // Starts carrying `plan` out, after a step. advance_moves() is then called after every step
  // (the first time right after start_moves) until it says the new placement serves from the
  // next step on.
  virtual void start_moves(const RebalancePlan& plan) = 0;
  struct Progress {
    bool switched = false;
    double bytes_copied = 0;  // by this call's copies, all ranks
  };
  virtual Progress advance_moves(double last_step_s) = 0;
};

struct RebalanceRunInput {
  const ModelSpec* model = nullptr;
  std::string backend = "cpu";
  int num_ranks = 1;
  std::string protocol = "low-latency";
  bool fused = false;
  uint64_t seed = 1;
  const std::vector<MoeLayerWeights>* weights = nullptr;  // [L]
  const Placement* placement = nullptr;                   // layer 0: every layer's starting placement
  const RoutingTrace* trace = nullptr;
  std::string routing_text;  // what the trace is, for the output
  bool check = false;
  bool json = false;
  RebalanceRunOptions options;
};
void run_rebalance(const RebalanceRunInput& in);

// The CPU backend (CpuMoeLayer, apply_moves at the step boundary).
std::unique_ptr<RebalanceBackend> make_cpu_backend(const RebalanceRunInput& in, const Placement& placement,
                                                   int max_tokens);

}  // namespace moekit::cli
