// `moekit run`: L MoE layers for one decode step of B tokens over P in-process ranks, on the CPU
// reference path (include/moekit/layer_cpu.h) or, in a binary built with CUDA, on one GPU
// (cli/cuda/run_cuda.h: the same inputs, the same tables), with per-stage times, bytes moved per
// rank, recv_count statistics, the measured de-duplicated target count next to the planner's
// closed form, and the load skew.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "cli/commands.h"
#include "io/file_io.h"
#include "cli/run_rebalance.h"
#ifdef MOEKIT_WITH_CUDA
#include "cli/cuda/run_cuda.h"
#endif
#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/eplb.h"
#include "moekit/layer_cpu.h"
#include "moekit/limits.h"
#include "moekit/simulate.h"
#include "moekit/spec.h"
#include "moekit/weights.h"

namespace moekit::cli {
namespace {

struct RunOptions {
  std::string model = "tiny-moe";
  std::string backend = "cpu";
  int ep = 4;
  int64_t batch = 64;
  int layers = 1;
  int first_layer = 0;
  std::string weights;
  std::string save_weights;
  std::string routing;  // empty: the model's router
  std::string protocol = "low-latency";
  std::string pipeline = "staged";  // --backend cuda, decode: staged | fused (layer.h GpuPipeline)
  int redundant = 0;
  uint64_t seed = 1;
  bool check = false;
  bool json = false;
  RebalanceRunOptions rebalance;  // --rebalance and its flags (run_rebalance.h)
};

// A temporary checkpoint directory, removed when the run ends (also on error, SIGINT and SIGTERM).
struct TempDir {
  std::string path;
  std::optional<InterruptCleanup> on_interrupt;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "moekit-run-XXXXXX").string();
    MOEKIT_CHECK(mkdtemp(tmpl.data()) != nullptr, fmt::format("cannot create a temporary directory {}", tmpl));
    path = tmpl;
    on_interrupt.emplace(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// Per-layer figures gathered from every rank's last step.
struct LayerFigures {
  StageTimes slowest;             // each stage's max over ranks
  std::vector<RankStep> ranks;    // [P]
  double error_vs_oracle = -1;    // --check
};

double max_stage(const std::vector<RankStep>& ranks, double StageTimes::*stage) {
  double m = 0;
  for (const auto& r : ranks) m = std::max(m, r.times.*stage);
  return m;
}

int first_token(int rank, int num_ranks, int64_t batch) { return int((rank * batch + num_ranks - 1) / num_ranks); }

// One step of L layers, from either backend: what every rank's last_step() saw, and the tensors.
struct StepResult {
  std::vector<std::vector<RankStep>> steps;  // [L][P]
  std::vector<std::vector<uint16_t>> x;      // [L + 1][B, d]: layer l's input, x[l + 1] = x[l] + out[l]
  std::vector<std::vector<uint16_t>> out;    // [L][B, d]
  double wall_s = 0;
  double graph_step_s = 0;  // cuda only: one layer's step replayed from a CUDA Graph
};

// The CPU backend: every rank runs the L layers in order; layer l + 1's input is x + layer l's
// output (a residual add, no attention in between).
StepResult run_layers_cpu(const ModelSpec& spec, const std::vector<MoeLayerWeights>& weights, const Placement& placement,
                          EpProtocol protocol, uint64_t seed, int64_t B, const std::vector<uint16_t>& x0,
                          const std::vector<std::vector<int32_t>>* forced_idx, const std::vector<float>& forced_w) {
  const int L = int(weights.size()), P = placement.num_gpus, d = int(spec.hidden_size), k = spec.num_experts_per_token;
  CpuLayerConfig cfg;
  cfg.num_ranks = P;
  cfg.max_tokens = int((B + P - 1) / P);
  cfg.protocol = protocol;
  cfg.replica_seed = seed;
  std::vector<std::unique_ptr<CpuMoeLayer>> layers;
  for (const auto& w : weights) layers.push_back(std::make_unique<CpuMoeLayer>(spec, w, placement, 0, cfg));
  StepResult res;
  res.x.assign(L + 1, std::vector<uint16_t>(size_t(B) * d));
  res.x[0] = x0;
  res.out.assign(L, std::vector<uint16_t>(size_t(B) * d));
  LocalEpGroup group(layers[0]->ep_config());
  const auto start = std::chrono::steady_clock::now();
  run_ranks(group, [&](int r) {
    const int t0 = first_token(r, P, B), t1 = first_token(r + 1, P, B);
    for (int l = 0; l < L; ++l) {
      layers[l]->forward(group, r, t1 - t0, t0, res.x[l].data() + size_t(t0) * d, res.out[l].data() + size_t(t0) * d,
                         forced_idx ? (*forced_idx)[l].data() + size_t(t0) * k : nullptr,
                         forced_idx ? forced_w.data() + size_t(t0) * k : nullptr);
      for (size_t i = size_t(t0) * d; i < size_t(t1) * d; ++i)
        res.x[l + 1][i] = float_to_bf16(bf16_to_float(res.x[l][i]) + bf16_to_float(res.out[l][i]));
    }
  });
  res.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int l = 0; l < L; ++l) {
    res.steps.emplace_back();
    for (int r = 0; r < P; ++r) res.steps[l].push_back(layers[l]->last_step(r));
  }
  return res;
}

// --check's bound on the relative error against the float64 oracle. The CPU layer holds 3e-3
// (docs/design.md §Numerics and their bounds); the GPU layer measures 4e-3 .. 7e-3 (the tensor
// cores' FP8 block sums keep fewer bits than the CPU's exact ones; docs/layer-gpu.md), and
// test_layer bounds it at 1.5e-2. The MXFP4 (gpt-oss) layer on the CPU is bounded by 2^-8: the
// RMS of its three bf16 roundings at most 2^-8/sqrt(3) each; without a shared expert all three
// reach every output value, and it measures 2.9e-3, close to 3e-3 (docs/layer.md).
double oracle_tolerance(const RunOptions& o, const ModelSpec& spec) {
  if (o.backend == "cuda") return 1.5e-2;
  return spec.expert_format == "mxfp4" ? 0x1p-8 : 3e-3;
}

const char* oracle_tolerance_source(const RunOptions& o, const ModelSpec& spec) {
  if (o.backend == "cuda") return "the GPU layer's, docs/layer-gpu.md";
  return spec.expert_format == "mxfp4" ? "2^-8, three bf16 roundings: docs/layer.md" : "docs/design.md §Numerics and their bounds";
}

void check_oracle_errors(const RunOptions& o, const ModelSpec& spec, const std::vector<LayerFigures>& figs) {
  for (size_t l = 0; l < figs.size(); ++l)
    MOEKIT_CHECK(figs[l].error_vs_oracle <= oracle_tolerance(o, spec),
                 fmt::format("--check: layer {}: relative error {:.3e} against the float64 oracle is above the {} "
                             "backend's bound {}",
                             l, figs[l].error_vs_oracle, o.backend, oracle_tolerance(o, spec)));
}

// The largest host tables of the run, before any is allocated: the L layers' weights (on the
// CPU also each rank's copy of its slots), the activations x and out ((2L + 1) x B x d bf16)
// with the forced routing (L x B x k ids, B x k weights) and, on the CPU, each layer's receive rows of about 3d + 5 x intermediate bytes: slots x B of
// them in the masked (low-latency) layout, where every slot has room for the whole step, B x k
// in the normal one. The sum leaves smaller buffers out, so it is a lower bound; above the
// machine's memory it is an Error naming the flags, not a run ending in std::bad_alloc.
void check_memory(const RunOptions& o, const ModelSpec& spec, int num_slots) {
  const double L = o.layers, B = double(o.batch), d = double(spec.hidden_size), inter = double(spec.moe_intermediate_size);
  const bool cpu = o.backend == "cpu";
  RandomWeightsOptions wo;
  wo.first_layer = o.first_layer;
  wo.num_layers = o.layers;
  const double expert_bpp = spec.expert_format == "mxfp4" ? 0.53125 : 1.0;  // the ranks' copies: FP8 or MXFP4
  const double weights =
      double(plan_random_weights(spec, wo).tensor_bytes) + (cpu ? L * num_slots * 3 * d * inter * expert_bpp : 0);
  const double activations = (2 * L + 1) * B * d * 2 + (L + 1) * B * spec.num_experts_per_token * 4;  // + routing
  const double rows = o.protocol == "low-latency" ? num_slots * B : B * spec.num_experts_per_token;
  const double buffers = cpu ? L * rows * (3 * d + 5 * inter) : 0.0;
  const double machine = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  MOEKIT_CHECK(weights + activations + buffers <= machine,
               fmt::format("--batch {} --layers {}: the run needs at least {:.1f} GB (weights {:.1f}, activations {:.1f}, "
                           "receive buffers {:.1f}), more than this machine's {:.1f} GB of memory",
                           o.batch, o.layers, (weights + activations + buffers) / 1e9, weights / 1e9, activations / 1e9,
                           buffers / 1e9, machine / 1e9));
}

void run(const RunOptions& o) {
  const ModelSpec spec = load_model_spec(o.model);
  MOEKIT_CHECK(spec.is_moe(), fmt::format("--model {} is dense: it has no MoE layer to run", o.model));
  const int E = spec.num_routed_experts, k = spec.num_experts_per_token, d = int(spec.hidden_size), P = o.ep;
  const int64_t B = o.batch;
  // Sums in int64_t: the flags are ints and may each be near INT_MAX.
  MOEKIT_CHECK(P >= 1 && P <= kMaxRanks && E % P == 0,
               fmt::format("--ep {}: expected in [1, {}] and dividing the {} experts of {}", P, kMaxRanks, E, spec.name));
  MOEKIT_CHECK(B >= 1 && B <= kMaxBatch, fmt::format("--batch {}: expected >= 1 and <= {}", B, kMaxBatch));
  MOEKIT_CHECK(o.layers >= 1 && o.first_layer >= 0 && int64_t(o.first_layer) + o.layers <= spec.num_layers,
               fmt::format("--first-layer {} --layers {}: expected layers inside the model's {}", o.first_layer, o.layers,
                           spec.num_layers));
  const int64_t num_slots = int64_t(E) + o.redundant;
  MOEKIT_CHECK(o.redundant >= 0 && num_slots <= kMaxSlots && num_slots % P == 0,
               fmt::format("--redundant {}: expected >= 0 with E + redundant = {} a multiple of --ep {} and <= {}",
                           o.redundant, num_slots, P, kMaxSlots));
  MOEKIT_CHECK(o.protocol == "low-latency" || o.protocol == "normal",
               fmt::format("--protocol '{}': expected low-latency or normal", o.protocol));
  // Checked here too so that no weights are written for a model the layer cannot run. MXFP4 weights
  // are padded to multiples of 128 at load time (weights.h).
  MOEKIT_CHECK(spec.expert_format == "mxfp4" || (d % 128 == 0 && spec.moe_intermediate_size % 128 == 0),
               fmt::format("--model {}: hidden_size {} and moe_intermediate_size {} must be multiples of 128 (the FP8 "
                           "block size)", spec.name, d, spec.moe_intermediate_size));
  MOEKIT_CHECK(!o.rebalance.on || spec.expert_format != "mxfp4",
               fmt::format("--rebalance with --model {}: its experts are MXFP4, which move no weights while serving "
                           "(FP8 models only)", spec.name));
  check_memory(o, spec, int(num_slots));
  std::optional<Routing> routing;
  if (!o.routing.empty()) routing = parse_routing(o.routing);
  std::optional<RoutingTrace> trace;  // --rebalance: read or sampled before any weight is written
  if (o.rebalance.on) trace = rebalance_trace(o.rebalance, routing.value_or(Routing{}), spec, P, B, o.layers, o.seed);
  const bool tty = isatty(STDERR_FILENO) == 1 && !o.json;

  // Weights: the given checkpoint, or random ones written in the checkpoint format and read back.
  std::optional<TempDir> tmp;
  std::string weights_dir = o.weights;
  uint64_t weight_bytes = 0;
  if (weights_dir.empty()) {
    if (o.save_weights.empty()) {
      tmp.emplace();
      weights_dir = tmp->path;
    } else {
      weights_dir = o.save_weights;
    }
    RandomWeightsOptions wo;
    wo.first_layer = o.first_layer;
    wo.num_layers = o.layers;
    wo.seed = o.seed;
    const uint64_t planned = plan_random_weights(spec, wo).file_bytes;
    if (planned > (uint64_t(1) << 30))
      fmt::print(stderr, "moekit run: writing {:.1f} GB of random weights to {} (pass --weights to reuse a checkpoint)\n",
                 planned / 1e9, weights_dir);
    weight_bytes = write_random_weights(spec, wo, weights_dir, [&](uint64_t done, uint64_t total) {
                     if (tty) fmt::print(stderr, "\rwriting random weights: {:3d}% of {:.1f} MB\033[K", int(100 * done / total), total / 1e6);
                   }).tensor_bytes;
    if (tty) fmt::print(stderr, "\r\033[K");
  }
  const Checkpoint ckpt = Checkpoint::open(weights_dir);

  // Expected per-expert loads (the routing's weights, uniform for the router) drive EPLB's replicas.
  std::vector<double> expected_load(E, 1.0);
  if (routing) expected_load = expert_weights(*routing, E);
  const Placement placement = o.redundant > 0 ? balanced_placement(expected_load, o.redundant, P) : identity_placement(E, P);

  const EpProtocol protocol = o.protocol == "normal" ? EpProtocol::kNormal : EpProtocol::kLowLatency;
  std::vector<MoeLayerWeights> layer_weights;
  for (int l = 0; l < o.layers; ++l) layer_weights.push_back(load_moe_layer(ckpt, spec, o.first_layer + l, 0, E));
  if (trace) {
    RebalanceRunInput in{&spec, o.backend, P, o.protocol, o.pipeline == "fused", o.seed, &layer_weights, &placement,
                         &*trace, o.rebalance.trace.empty() ? to_string(routing.value_or(Routing{})) : o.rebalance.trace,
                         o.check, o.json, o.rebalance};
    run_rebalance(in);
    return;
  }

  // Inputs: N(0, 1) hidden states in bf16; synthetic routing from the simulator's sampler.
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x0(size_t(B) * d);
  for (auto& v : x0) v = float_to_bf16(normal(rng));
  SimulateInput sim;
  sim.num_experts = E;
  sim.topk = k;
  sim.num_ranks = P;
  sim.batch = B;
  sim.seed = o.seed;
  sim.routing = routing.value_or(Routing{});
  sim.trials = std::max(200, o.layers);  // layer l uses sample l; the rest estimate the mean below
  sim.num_threads = 1;
  std::vector<std::vector<int32_t>> forced_idx(o.layers);
  const std::vector<float> forced_w(size_t(B) * k, float(spec.router.routed_scaling_factor / k));
  if (routing)
    for (int l = 0; l < o.layers; ++l) forced_idx[l] = sample_step(sim, l);

  StepResult res;
  if (o.backend == "cuda") {
#ifdef MOEKIT_WITH_CUDA
    CudaRunInput in;
    in.model = &spec;
    in.num_ranks = P;
    in.batch = B;
    in.protocol = protocol;
    in.replica_seed = o.seed;
    in.weights = &layer_weights;
    in.placement = &placement;
    in.x = &x0;
    in.forced_idx = routing ? &forced_idx : nullptr;
    in.forced_weights = routing ? &forced_w : nullptr;
    in.fused = o.pipeline == "fused";
    CudaRunResult cr = run_layers_cuda(in);
    res.steps = std::move(cr.steps);
    res.x = std::move(cr.x);
    res.out = std::move(cr.out);
    res.wall_s = cr.wall_s;
    res.graph_step_s = cr.graph_step_s;
#endif
  } else {
    res = run_layers_cpu(spec, layer_weights, placement, protocol, o.seed, B, x0, routing ? &forced_idx : nullptr,
                         forced_w);
  }
  const std::vector<std::vector<uint16_t>>& x = res.x;
  const std::vector<std::vector<uint16_t>>& out = res.out;
  const double wall = res.wall_s;

  std::vector<LayerFigures> figs(o.layers);
  for (int l = 0; l < o.layers; ++l) {
    figs[l].ranks = res.steps[l];
    for (auto stage : {&StageTimes::gate, &StageTimes::dispatch, &StageTimes::gemm1, &StageTimes::activation,
                       &StageTimes::gemm2, &StageTimes::combine, &StageTimes::shared})
      figs[l].slowest.*stage = max_stage(figs[l].ranks, stage);
    if (o.check) {
      std::vector<int32_t> idx;
      std::vector<float> w;
      for (const auto& st : figs[l].ranks) {
        idx.insert(idx.end(), st.topk_idx.begin(), st.topk_idx.end());
        w.insert(w.end(), st.topk_weights.begin(), st.topk_weights.end());
      }
      const LayerOracle oracle(spec, layer_weights[l]);
      std::vector<float> xf(size_t(B) * d);
      for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_float(x[l][i]);
      std::vector<double> want(xf.size()), got(xf.size());
      oracle.run(xf.data(), int(B), idx.data(), w.data(), want.data(), layer_fp8_scaling(spec));
      for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_float(out[l][i]);
      figs[l].error_vs_oracle = ref::relative_frobenius_error(got.data(), want.data(), got.size());
    }
  }

  // Totals over layers.
  const int e_loc = placement.num_slots / P;
  std::vector<int64_t> msgs(P), disp(P), disp_remote(P), comb(P), comb_remote(P), rows(P), tokens(P);
  std::vector<int32_t> counts;  // every local expert's recv_count, all layers
  int64_t all_msgs = 0, all_tokens = 0;
  std::vector<double> skew(o.layers);
  for (int l = 0; l < o.layers; ++l) {
    double max_rows = 0, sum_rows = 0;
    for (int r = 0; r < P; ++r) {
      const RankStep& st = figs[l].ranks[r];
      msgs[r] += st.ep.dispatch_messages;
      disp[r] += st.ep.dispatch_bytes;
      disp_remote[r] += st.ep.dispatch_bytes_remote;
      comb[r] += st.ep.combine_bytes;
      comb_remote[r] += st.ep.combine_bytes_remote;
      rows[r] += st.ep.recv_rows;
      tokens[r] += st.num_tokens;
      all_msgs += st.ep.dispatch_messages;
      all_tokens += st.num_tokens;
      counts.insert(counts.end(), st.recv_count.begin(), st.recv_count.end());
      max_rows = std::max(max_rows, double(st.ep.recv_rows));
      sum_rows += double(st.ep.recv_rows);
    }
    skew[l] = sum_rows > 0 ? max_rows / (sum_rows / P) : 1.0;
  }
  const double measured_c = double(all_msgs) / double(all_tokens);
  // The planner's closed form P·[1 − (1 − 1/P)^k] and the simulator's estimate for this routing.
  const SimulateResult simres = simulate(sim);
  const auto [cmin, cmax] = std::minmax_element(counts.begin(), counts.end());
  const double cmean = std::accumulate(counts.begin(), counts.end(), 0.0) / double(counts.size());
  const int64_t czero = std::count(counts.begin(), counts.end(), 0);
  double skew_mean = std::accumulate(skew.begin(), skew.end(), 0.0) / double(o.layers);
  StageTimes total;
  for (const auto& f : figs)
    for (auto stage : {&StageTimes::gate, &StageTimes::dispatch, &StageTimes::gemm1, &StageTimes::activation,
                       &StageTimes::gemm2, &StageTimes::combine, &StageTimes::shared})
      total.*stage += f.slowest.*stage;
  const std::vector<std::pair<const char*, double>> stages = {
      {"gate", total.gate},   {"dispatch", total.dispatch}, {"gemm1", total.gemm1},          {"activation", total.activation},
      {"gemm2", total.gemm2}, {"combine", total.combine},   {"shared_expert", total.shared}};
  const std::string routing_text =
      routing ? to_string(*routing) + " (synthetic, from the simulator's sampler)" :
                fmt::format("the model's router ({}{}, top-{}) on random inputs", spec.router.scoring,
                            spec.router.num_groups > 1 ? fmt::format(", {} groups keep {}", spec.router.num_groups,
                                                                     spec.router.topk_groups)
                                                       : "",
                            k);

  if (o.json) {
    nlohmann::json j;
    j["model"] = spec.name;
    j["backend"] = o.backend;
    if (o.backend == "cuda") j["graph_step_s"] = res.graph_step_s;
    j["ep"] = P;
    j["batch"] = B;
    j["layers"] = o.layers;
    j["protocol"] = o.protocol;
    j["routing"] = routing ? to_string(*routing) : "router";
    j["num_slots"] = placement.num_slots;
    j["redundant"] = o.redundant;
    j["weights"] = o.weights.empty() ? "random" : o.weights;
    j["wall_s"] = wall;
    for (const auto& [name, t] : stages) j["stage_s"][name] = t;
    for (int r = 0; r < P; ++r)
      j["ranks"].push_back({{"rank", r},
                            {"tokens", tokens[r]},
                            {"dispatch_messages", msgs[r]},
                            {"dispatch_bytes", disp[r]},
                            {"dispatch_bytes_remote", disp_remote[r]},
                            {"combine_bytes", comb[r]},
                            {"combine_bytes_remote", comb_remote[r]},
                            {"recv_rows", rows[r]}});
    j["recv_count"] = {{"min", *cmin}, {"mean", cmean}, {"max", *cmax}, {"zero", czero}, {"experts", counts.size()}};
    j["dedup_targets"] = {{"measured", measured_c},
                          {"closed_form", simres.dedup_targets.closed_form},
                          {"simulated", simres.dedup_targets.simulated},
                          {"topk", k}};
    j["load_max_over_mean"] = skew;
    if (o.check)
      for (const auto& f : figs) j["error_vs_oracle"].push_back(f.error_vs_oracle);
    fmt::print("{}\n", j.dump(2));
    if (o.check) check_oracle_errors(o, spec, figs);
    return;
  }

  fmt::print("moekit run: {} on {}, EP {} (in-process ranks), batch {} ({}..{} tokens per rank), {} layer{}, {} protocol\n",
             spec.name, o.backend == "cuda" ? "one GPU" : "the CPU", P, B, B / P, (B + P - 1) / P, o.layers,
             o.layers > 1 ? "s" : "", o.protocol);
  fmt::print("weights: {}\n", o.weights.empty() ? fmt::format("random (seed {}), {:.1f} MB written in the checkpoint format to {} and loaded back",
                                                              o.seed, weight_bytes / 1e6, o.save_weights.empty() ? "a temporary directory" : o.save_weights)
                                                : o.weights);
  fmt::print("routing: {}\n", routing_text);
  fmt::print("placement: {} slots on {} ranks ({} per rank){}\n\n", placement.num_slots, P, e_loc,
             o.redundant > 0 ? fmt::format(", {} redundant experts placed by EPLB", o.redundant) : "");

  const double stage_sum = total.gate + total.dispatch + total.gemm1 + total.activation + total.gemm2 + total.combine + total.shared;
  fmt::print("{:<14} {:>10} {:>7}   (slowest rank per stage, summed over layers)\n", "stage", "time (ms)", "share");
  for (const auto& [name, t] : stages) fmt::print("{:<14} {:>10.2f} {:>6.1f}%\n", name, t * 1e3, 100 * t / stage_sum);
  fmt::print("{:<14} {:>10.2f}          (wall time of the step: {:.2f} ms)\n", "sum", stage_sum * 1e3, wall * 1e3);
  if (o.backend == "cuda") fmt::print("one layer's step replayed from a CUDA Graph: {:.1f} us\n", res.graph_step_s * 1e6);
  fmt::print("\n");

  fmt::print("{:>4} {:>7} {:>9} {:>15} {:>15} {:>15} {:>15} {:>9}\n", "rank", "tokens", "messages", "dispatch B",
             "  of which remote", "combine B", "  of which remote", "recv rows");
  for (int r = 0; r < P; ++r)
    fmt::print("{:>4} {:>7} {:>9} {:>15} {:>15} {:>15} {:>15} {:>9}\n", r, tokens[r], msgs[r], disp[r], disp_remote[r],
               comb[r], comb_remote[r], rows[r]);
  fmt::print("\nrecv_count (masked_m) over {} local experts x {} layer{}: min {}, mean {:.2f}, max {}, {} empty\n",
             P * e_loc, o.layers, o.layers > 1 ? "s" : "", *cmin, cmean, *cmax, czero);
  fmt::print("distinct target ranks per token: measured {:.3f}, planner P[1-(1-1/P)^k] = {:.3f}, simulator ({}) {:.3f}; "
             "k = {} without de-duplication\n",
             measured_c, simres.dedup_targets.closed_form, to_string(sim.routing), simres.dedup_targets.simulated, k);
  fmt::print("load (token-expert rows per rank), max/mean:");
  for (int l = 0; l < o.layers; ++l) fmt::print(" {:.3f}", skew[l]);
  fmt::print("{}\n", o.layers > 1 ? fmt::format(" (mean {:.3f})", skew_mean) : "");
  if (o.check) {
    fmt::print("relative error against the float64 oracle:");
    for (const auto& f : figs) fmt::print(" {:.2e}", f.error_vs_oracle);
    fmt::print(" (bound {:.3g}: {})\n", oracle_tolerance(o, spec), oracle_tolerance_source(o, spec));
    check_oracle_errors(o, spec, figs);
  }
}

}  // namespace

void add_run_command(CLI::App& app) {
  static RunOptions o;
  auto* cmd = app.add_subcommand("run", "run L MoE layers for one decode step over P in-process ranks (CPU reference)");
  cmd->add_option("--model", o.model, "model spec (embedded name or JSON file)")->capture_default_str();
  cmd->add_option("--backend", o.backend, "cpu | cuda")->capture_default_str();
  cmd->add_option("--ep", o.ep, "expert-parallel ranks P (threads)")->capture_default_str();
  cmd->add_option("--batch", o.batch, "tokens B of the step, all ranks together")->capture_default_str();
  cmd->add_option("--layers", o.layers, "MoE layers L")->capture_default_str();
  cmd->add_option("--first-layer", o.first_layer, "index of the first layer in the checkpoint")->capture_default_str();
  auto* weights =
      cmd->add_option("--weights", o.weights, "checkpoint (safetensors file or directory); default: random weights");
  cmd->add_option("--save-weights", o.save_weights,
                  "write the random weights into this directory (new, empty, or an earlier --save-weights') and keep them")
      ->excludes(weights);
  cmd->add_option("--routing", o.routing,
                  "uniform | zipf:S | hot:H:R | drift:H:R:PERIOD instead of the router (synthetic skew)");
  cmd->add_option("--protocol", o.protocol, "low-latency (decode, masked) | normal (prefill, contiguous)")->capture_default_str();
  cmd->add_option("--redundant", o.redundant, "redundant experts placed by EPLB")->capture_default_str();
  cmd->add_option("--pipeline", o.pipeline, "staged | fused: the CUDA decode step's kernels (docs/layer-gpu.md)")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed of weights, inputs and routing")->check(kUint64)->capture_default_str();
  cmd->add_flag("--check", o.check, "compare the output with the float64 oracle (slow on large models)");
  cmd->add_flag("--json", o.json, "print JSON instead of the tables");
  add_rebalance_options(cmd, o.rebalance);
  cmd->callback([] {
    MOEKIT_CHECK(o.backend == "cpu" || o.backend == "cuda", fmt::format("--backend '{}': expected cpu or cuda", o.backend));
    MOEKIT_CHECK(o.pipeline == "staged" || o.pipeline == "fused",
                 fmt::format("--pipeline '{}': expected staged or fused", o.pipeline));
    MOEKIT_CHECK(o.pipeline == "staged" || o.backend == "cuda",
                 fmt::format("--pipeline {}: only the cuda backend has a fused pipeline (use --backend cuda)", o.pipeline));
#ifndef MOEKIT_WITH_CUDA
    if (o.backend == "cuda")
      throw Error("--backend cuda: this moekit binary was built without CUDA (MOEKIT_WITH_CUDA=OFF or no nvcc); "
                  "use --backend cpu, or build with CUDA on a machine with nvcc");
#else
    if (o.backend == "cuda") require_cuda_device();  // before gigabytes of random weights are written
#endif
    run(o);
  });
}

}  // namespace moekit::cli
