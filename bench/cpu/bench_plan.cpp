// The planner's speed. The target: a full plan of 20 batch sizes under 50 ms. Cases:
// the plan alone (DeepSeek-V3 on 8 x H200, B = 1 … 2^19, with a TPOT SLA so that B_SLA's
// bisection runs), the same with spec loading and the JSON (what `moekit plan --json` does
// besides starting the process), one row, and a small routing simulation for scale.
//   build/bench_plan --benchmark_min_time=0.5s
#include <benchmark/benchmark.h>

#include "moekit/plan.h"
#include "moekit/simulate.h"
#include "moekit/spec.h"

namespace {

moekit::PlanInput deepseek_20_batches() {
  moekit::PlanInput in;
  in.model = moekit::load_model_spec("deepseek-v3");
  in.gpu = moekit::load_gpu_spec("h200");
  in.ep = 8;
  for (int i = 0; i < 20; ++i) in.batches.push_back(int64_t(1) << i);
  in.tpot_sla_ms = 30.0;
  return in;
}

void BM_Plan_20Batches(benchmark::State& state) {
  const moekit::PlanInput in = deepseek_20_batches();
  for (auto _ : state) {
    moekit::PlanResult r = moekit::plan(in);
    benchmark::DoNotOptimize(r.rows.data());
  }
}
BENCHMARK(BM_Plan_20Batches)->Unit(benchmark::kMicrosecond);

void BM_Plan_20Batches_SpecsAndJson(benchmark::State& state) {
  for (auto _ : state) {
    moekit::PlanInput in = deepseek_20_batches();  // parses and validates both embedded specs
    std::string json = moekit::plan_to_json(moekit::plan(in));
    benchmark::DoNotOptimize(json.data());
  }
}
BENCHMARK(BM_Plan_20Batches_SpecsAndJson)->Unit(benchmark::kMicrosecond);

void BM_PlanRow(benchmark::State& state) {
  const moekit::PlanInput in = deepseek_20_batches();
  int64_t b = 1;
  for (auto _ : state) {
    moekit::PlanRow r = moekit::plan_row(in, b);
    benchmark::DoNotOptimize(r.floor_ms);
    b = b % 4096 + 1;
  }
}
BENCHMARK(BM_PlanRow)->Unit(benchmark::kNanosecond);

// One worker thread (real time: the work runs off the calling thread), DeepSeek-V3 routing (E = 256, k = 8) on 8 GPUs, B = 1024: picks per second.
void BM_Simulate(benchmark::State& state, const char* routing) {
  moekit::SimulateInput in;
  in.num_experts = 256;
  in.topk = 8;
  in.num_ranks = 8;
  in.batch = 1024;
  in.trials = 16;
  in.routing = moekit::parse_routing(routing);
  in.num_threads = 1;
  for (auto _ : state) {
    moekit::SimulateResult r = moekit::simulate(in);
    benchmark::DoNotOptimize(r.s0.simulated);
  }
  state.SetItemsProcessed(state.iterations() * in.trials * in.batch * in.topk);
}
BENCHMARK_CAPTURE(BM_Simulate, uniform, "uniform")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Simulate, hot_8_4, "hot:8:4")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Simulate, zipf_1, "zipf:1")->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
