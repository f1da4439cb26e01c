// `moekit eplb`: expert placement from loads (JSON/CSV) or a routing trace; writes the
// placement JSON and prints a per-layer table and a summary. Every input is read and checked
// before anything is written, so bad input leaves --out untouched.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <optional>

#include "cli/commands.h"
#include "io/file_io.h"
#include "moekit/check.h"
#include "moekit/eplb.h"
#include "moekit/trace.h"

namespace moekit::cli {
namespace {

using nlohmann::json;

struct EplbArgs {
  std::string load, trace, current, model, out;
  int slots = 0, groups = 0, nodes = 0, gpus = 0;
  double tolerance = 0.01;
  uint64_t seed = 0;
  bool json_stdout = false;
  bool worst_layer = false;
};

template <class T>
json rows_of(const std::vector<T>& flat, size_t width) {
  json rows = json::array();
  for (size_t i = 0; i < flat.size(); i += width)
    rows.push_back(std::vector<T>(flat.begin() + i, flat.begin() + i + width));
  return rows;
}

// Max over mean of one row (1 when the row is all zero): the layer's slowdown S.
template <class T>
double skew(const T* row, int n) {
  double sum = 0, mx = 0;
  for (int i = 0; i < n; ++i) sum += double(row[i]), mx = std::max(mx, double(row[i]));
  return sum > 0 ? mx / (sum / n) : 1.0;
}

void run(const EplbArgs& a) {
  MOEKIT_CHECK(a.load.empty() != a.trace.empty(), "eplb: give exactly one of --load FILE or --trace FILE");
  MOEKIT_CHECK(a.tolerance >= 0 && a.tolerance < 1, fmt::format("eplb: --tolerance {} must be in [0, 1)", a.tolerance));
  check_output_option(a.out, "--out", {{a.load, "--load"}, {a.trace, "--trace"}, {a.current, "--current"},
                                       {a.model, "--model"}});
  std::optional<RoutingTrace> trace;
  std::vector<std::vector<double>> weight;
  if (!a.trace.empty()) {
    trace = read_trace(a.trace);
    weight = trace_loads(*trace);
  } else {
    weight = read_loads(a.load);
  }
  validate_rebalance_args(weight, a.slots, a.groups, a.nodes, a.gpus);
  std::optional<double> bytes_per_expert;
  if (!a.model.empty()) bytes_per_expert = expert_bytes(a.model);
  std::optional<Placement> current;
  if (!a.current.empty()) {
    current = read_placement(a.current);
    MOEKIT_CHECK(current->num_layers == int(weight.size()) && current->num_experts == int(weight[0].size()) &&
                     current->num_slots == a.slots && current->num_gpus == a.gpus && current->num_nodes == a.nodes &&
                     current->num_groups == a.groups,
                 fmt::format("eplb: --current '{}' is {} layers x {} experts, {} slots, {} groups, {} nodes, {} GPUs; "
                             "expected {} x {}, {}, {}, {}, {}",
                             a.current, current->num_layers, current->num_experts, current->num_slots,
                             current->num_groups, current->num_nodes, current->num_gpus, weight.size(),
                             weight[0].size(), a.slots, a.groups, a.nodes, a.gpus));
  }

  // Every input is valid from here on.
  Placement placement;
  std::optional<MigrationResult> migration;
  std::optional<DualResult> dual;
  if (current) {
    migration = rebalance_with_fewer_moves(weight, *current, a.tolerance, !a.worst_layer);
    placement = migration->placement;
  } else if (trace) {
    dual = rebalance_dual(*trace, a.slots, a.groups, a.nodes, a.gpus, a.seed);
    placement = dual->placement;
  } else {
    placement = rebalance(weight, a.slots, a.groups, a.nodes, a.gpus);
  }
  const BalanceReport report = balance_report(placement, weight);
  const int L = placement.num_layers, G = placement.num_gpus;

  json j = {{"format", "moekit-placement"},
            {"policy", placement.hierarchical() ? "hierarchical" : "global"},
            {"num_layers", L},
            {"num_experts", placement.num_experts},
            {"num_slots", placement.num_slots},
            {"num_groups", placement.num_groups},
            {"num_nodes", placement.num_nodes},
            {"num_gpus", G},
            {"max_replicas", placement.max_replicas},
            {"phy2log", rows_of(placement.phy2log, placement.num_slots)},
            {"replica_count", rows_of(placement.replica_count, placement.num_experts)},
            {"gpu_loads_before", rows_of(report.gpu_load_before, G)},
            {"gpu_loads_after", rows_of(report.gpu_load_after, G)},
            {"balancedness_before", report.balancedness_before},
            {"balancedness_after", report.balancedness_after},
            {"mean_balancedness_before", report.mean_balancedness_before},
            {"mean_balancedness_after", report.mean_balancedness_after},
            {"worst_balancedness_before", report.worst_balancedness_before},
            {"worst_balancedness_after", report.worst_balancedness_after}};
  json log2phy = json::array();
  for (int l = 0; l < L; ++l)
    log2phy.push_back(
        rows_of(std::vector<int32_t>(placement.log2phy_row(l),
                                     placement.log2phy_row(l) + placement.num_experts * placement.max_replicas),
                placement.max_replicas));
  j["log2phy"] = log2phy;
  j["replicas_moved"] = migration ? json(migration->replicas_moved) : json(nullptr);
  j["bytes_moved"] =
      migration && bytes_per_expert ? json(*bytes_per_expert * migration->replicas_moved) : json(nullptr);
  if (migration)
    j["migration"] = {{"tolerance", a.tolerance},
                      {"target", a.worst_layer ? "worst-layer" : "per-layer"},
                      {"target_balancedness", migration->target_balancedness},
                      {"fresh_worst_balancedness", migration->fresh_worst_balancedness},
                      {"fresh_replicas_moved", migration->fresh_replicas_moved},
                      {"fresh_bytes_moved",
                       bytes_per_expert ? json(*bytes_per_expert * migration->fresh_replicas_moved) : json(nullptr)},
                      {"expert_bytes", bytes_per_expert ? json(*bytes_per_expert) : json(nullptr)},
                      {"replicas_moved_per_layer", migration->replicas_moved_per_layer}};
  if (dual)
    j["dual"] = {{"seed", a.seed},
                 {"gemm_rows", rows_of(dual->loads.gemm_rows, G)},
                 {"recv_tokens", rows_of(dual->loads.recv_tokens, G)},
                 {"counts_gemm_rows", rows_of(dual->counts_loads.gemm_rows, G)},
                 {"counts_recv_tokens", rows_of(dual->counts_loads.recv_tokens, G)},
                 {"worst_imbalance", dual->worst_imbalance},
                 {"counts_worst_imbalance", dual->counts_worst_imbalance}};
  const std::string text = j.dump(1) + "\n";

  if (a.json_stdout) {
    fmt::print("{}", text);
  } else {
    fmt::print("eplb: {} layers x {} experts -> {} slots on {} GPUs ({} nodes, {} groups), {} policy\n", L,
               placement.num_experts, placement.num_slots, G, placement.num_nodes, placement.num_groups,
               placement.hierarchical() ? "hierarchical" : "global");
    fmt::print("{:>5}  {:>11} {:>11}  {:>10} {:>10}{}{}\n", "layer", "bal before", "bal after", "S before", "S after",
               migration ? fmt::format("  {:>6}", "moved") : "",
               dual ? fmt::format("  {:>9} {:>9}  {:>9} {:>9}", "rows S", "recv S", "rows S*", "recv S*") : "");
    for (int l = 0; l < L; ++l) {
      std::string extra;
      if (migration) extra += fmt::format("  {:>6}", migration->replicas_moved_per_layer[l]);
      if (dual) {
        const size_t o = size_t(l) * G;
        extra += fmt::format("  {:>9.3f} {:>9.3f}  {:>9.3f} {:>9.3f}", skew(&dual->counts_loads.gemm_rows[o], G),
                             skew(&dual->counts_loads.recv_tokens[o], G), skew(&dual->loads.gemm_rows[o], G),
                             skew(&dual->loads.recv_tokens[o], G));
      }
      fmt::print("{:>5}  {:>11.3f} {:>11.3f}  {:>10.3f} {:>10.3f}{}\n", l, report.balancedness_before[l],
                 report.balancedness_after[l], skew(&report.gpu_load_before[size_t(l) * G], G),
                 skew(&report.gpu_load_after[size_t(l) * G], G), extra);
    }
    fmt::print("balancedness (mean over layers): {:.3f} -> {:.3f}; worst layer {:.3f} -> {:.3f}\n",
               report.mean_balancedness_before, report.mean_balancedness_after, report.worst_balancedness_before,
               report.worst_balancedness_after);
    if (migration) {
      auto bytes = [&](int64_t n) {
        return bytes_per_expert ? fmt::format("{:.2f} GB", n * *bytes_per_expert / 1e9) : std::string("n/a (--model)");
      };
      fmt::print(
          "moves: {} replicas, {} (a fresh rebalance: {} replicas, {}); worst layer {:.4f} vs fresh {:.4f}, "
          "target {:.4f} (tolerance {}, {})\n",
          migration->replicas_moved, bytes(migration->replicas_moved), migration->fresh_replicas_moved,
          bytes(migration->fresh_replicas_moved), migration->worst_balancedness, migration->fresh_worst_balancedness,
          migration->target_balancedness, a.tolerance, a.worst_layer ? "worst layer only" : "every layer");
    }
    if (dual)
      fmt::print(
          "dual loads (S = max/mean; * = balancing both): worse of rows/recv, worst layer: {:.3f} by counts "
          "alone -> {:.3f}\n",
          dual->counts_worst_imbalance, dual->worst_imbalance);
  }
  if (!a.out.empty()) {
    write_file_atomically(a.out, text, "placement file");
    if (!a.json_stdout) fmt::print("wrote {}\n", a.out);
  }
}

}  // namespace

void add_eplb_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("eplb", "Expert placement (EPLB): replicate and pack experts over GPUs");
  static EplbArgs a;
  cmd->add_option("--load", a.load, "loads per layer: JSON {\"layers\": [[...], ...]} or CSV, one line per layer");
  auto* trace = cmd->add_option("--trace", a.trace,
                  "routing trace (moekit simulate --save-trace): balances GEMM rows and received "
                  "tokens");
  cmd->add_option("--slots", a.slots, "physical expert slots per layer (experts + redundant), a multiple of --gpus")
      ->required();
  cmd->add_option("--groups", a.groups, "expert groups (consecutive id ranges)")->required();
  cmd->add_option("--nodes", a.nodes, "nodes")->required();
  cmd->add_option("--gpus", a.gpus, "GPUs in all")->required();
  auto* current = cmd->add_option("--current", a.current, "current placement JSON: move as few replicas as possible");
  // The options of one mode are refused without it, rather than read and ignored.
  cmd->add_option("--tolerance", a.tolerance,
                  "with --current: worst-layer balancedness may trail a fresh rebalance "
                  "by this fraction (default 0.01)")
      ->needs(current);
  cmd->add_flag("--worst-layer", a.worst_layer,
                "with --current: hold only the worst layer to the tolerance, not every "
                "layer (fewer moves, slower good layers)")
      ->needs(current);
  cmd->add_option("--model", a.model, "with --current: model spec (name or JSON) for the bytes of one expert moved")
      ->needs(current);
  cmd->add_option("--seed", a.seed, "seed of the token -> replica choice (with --trace)")->check(kUint64)->needs(trace);
  cmd->add_option("--out", a.out, "write the placement JSON to this file");
  cmd->add_flag("--json", a.json_stdout, "print the placement JSON on stdout instead of the table");
  cmd->callback([] { run(a); });
}

}  // namespace moekit::cli
