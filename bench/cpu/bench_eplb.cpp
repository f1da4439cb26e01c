// EPLB placement time at DeepSeek-V3 scale: 58 MoE layers x 256 experts, 288 slots per layer,
// (a) 4 nodes x 8 GPUs, 8 groups: hierarchical; (b) 144 GPUs in 18 nodes: global (8 groups do
// not divide over 18 nodes). Target: under 10 ms each on one core. Loads are heavy-tailed
// (log-normal, sigma 1) from a fixed seed.
//   build-eplb/bench_eplb --benchmark_min_time=1s
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>

#include "moekit/eplb.h"

namespace {

std::vector<std::vector<double>> deepseek_loads(int layers = 58, int experts = 256) {
  std::mt19937_64 rng(1);
  std::lognormal_distribution<double> heavy(0.0, 1.0);
  std::vector<std::vector<double>> w(layers, std::vector<double>(experts));
  for (auto& row : w)
    for (double& v : row) v = std::round(1000 * heavy(rng));
  return w;
}

void run(benchmark::State& state, int slots, int groups, int nodes, int gpus) {
  const auto w = deepseek_loads();
  double balancedness = 0;
  for (auto _ : state) {
    moekit::Placement p = moekit::rebalance(w, slots, groups, nodes, gpus);
    benchmark::DoNotOptimize(p.phy2log.data());
    state.PauseTiming();
    balancedness = moekit::balance_report(p, w).mean_balancedness_after;
    state.ResumeTiming();
  }
  state.counters["layers"] = double(w.size());
  state.counters["balancedness"] = balancedness;
  state.counters["identity_balancedness"] =
      moekit::balance_report(moekit::rebalance(w, slots, groups, nodes, gpus), w).mean_balancedness_before;
}

void BM_RebalanceHierarchical_58x256_288slots_4x8gpus(benchmark::State& state) { run(state, 288, 8, 4, 32); }
void BM_RebalanceGlobal_58x256_288slots_144gpus(benchmark::State& state) { run(state, 288, 8, 18, 144); }

// The fewer-moves search on the same scale after a 10% drift (hierarchical), for reference:
// every layer held within 1% of its fresh figure (per_layer), or only the worst layer.
void fewer_moves(benchmark::State& state, bool per_layer) {
  const auto w0 = deepseek_loads();
  auto w1 = w0;
  std::mt19937_64 rng(2);
  std::lognormal_distribution<double> drift(0.0, 0.1);
  for (auto& row : w1)
    for (double& v : row) v = std::round(v * drift(rng));
  const moekit::Placement current = moekit::rebalance(w0, 288, 8, 4, 32);
  int64_t moved = 0, fresh = 0;
  for (auto _ : state) {
    moekit::MigrationResult m = moekit::rebalance_with_fewer_moves(w1, current, 0.01, per_layer);
    moved = m.replicas_moved, fresh = m.fresh_replicas_moved;
  }
  state.counters["replicas_moved"] = double(moved);
  state.counters["fresh_replicas_moved"] = double(fresh);
}

void BM_FewerMovesPerLayer_58x256_288slots_4x8gpus(benchmark::State& state) { fewer_moves(state, true); }
void BM_FewerMovesWorstLayer_58x256_288slots_4x8gpus(benchmark::State& state) { fewer_moves(state, false); }

}  // namespace

BENCHMARK(BM_RebalanceHierarchical_58x256_288slots_4x8gpus)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RebalanceGlobal_58x256_288slots_144gpus)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FewerMovesPerLayer_58x256_288slots_4x8gpus)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FewerMovesWorstLayer_58x256_288slots_4x8gpus)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
