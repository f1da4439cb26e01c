// `moekit simulate`: Monte Carlo routing against the closed forms (include/moekit/simulate.h).
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>

#include "cli/commands.h"
#include "moekit/check.h"
#include "moekit/simulate.h"
#include "moekit/spec.h"

namespace moekit::cli {
namespace {

struct SimulateOptions {
  std::string model;
  std::optional<int> experts, topk;
  int ranks = 8;
  int64_t batch = 256;
  int64_t trials = 1000;
  uint64_t seed = 1;
  std::string routing = "uniform";
  int threads = 0;
  bool json = false;
  std::string save_trace;
  int layers = 1;
  std::optional<int64_t> steps;
};

// A progress bar on stderr, only when stderr is a terminal and the run has taken 0.3 s
// already (short runs stay quiet; --json stdout is never touched).
class ProgressBar {
 public:
  explicit ProgressBar(std::string what) : what_(std::move(what)), tty_(isatty(STDERR_FILENO) == 1) {}
  ~ProgressBar() {
    if (shown_) fmt::print(stderr, "\r\033[K");
  }
  void operator()(int64_t done, int64_t total) {
    if (!tty_) return;
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (secs < 0.3 && !shown_) return;
    shown_ = true;
    const int width = 30;
    int filled = total > 0 ? int(width * done / total) : width;
    double eta = done > 0 ? secs * double(total - done) / double(done) : 0;
    fmt::print(stderr, "\r{} [{}{}] {:3d}% {}/{}, {:.1f} s, about {:.1f} s left\033[K", what_, std::string(filled, '#'),
               std::string(width - filled, ' '), int(100 * done / std::max<int64_t>(total, 1)), done, total, secs, eta);
    fflush(stderr);
  }

 private:
  std::string what_;
  bool tty_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

std::string se_or_dash(std::optional<double> z) { return z ? fmt::format("{:+.1f}", *z) : std::string("—"); }

void print_table(const SimulateResult& r) {
  const SimulateInput& in = r.input;
  fmt::print("moekit simulate: E = {}, k = {}, P = {} ({} experts per GPU, contiguous), B = {} tokens per step, "
             "routing {}, {} trials, seed {}\n\n",
             in.num_experts, in.topk, in.num_ranks, in.num_experts / in.num_ranks, in.batch, to_string(in.routing),
             in.trials, in.seed);
  fmt::print("{:<26} {:>22} {:>12} {:>11} {:>7} {:>12} {:>8}\n", "figure", "simulated +- s.e.", "closed form", "gap",
             "(s.e.)", "reference", "(s.e.)");
  auto row = [](const char* name, const Metric& m) {
    fmt::print("{:<26} {:>12.5f} +- {:<7.5f} {:>12.5f} {:>+11.5f} {:>7} {:>12} {:>8}\n", name, m.simulated,
               m.std_error, m.closed_form, m.gap(), se_or_dash(m.gap_in_se(m.closed_form)),
               m.reference ? fmt::format("{:.5f}", *m.reference) : std::string("—"),
               m.reference ? se_or_dash(m.gap_in_se(*m.reference)) : std::string("—"));
  };
  row("coverage", r.coverage);
  row("distinct ranks per token", r.dedup_targets);
  row("S0 = max/mean GPU load", r.s0);
  row("CV of expert loads", r.cv_expert);
  fmt::print("\nclosed forms (docs/theory.md, uniform routing): coverage 1-(1-k/E)^B; ranks P[1-(1-1/P)^k];\n"
             "  S0 1+sqrt(2 ln P) CV_e/sqrt(E/P); CV_e sqrt((1-k/E)/(B k/E)). What each assumes:\n");
  for (const auto* m : {&r.coverage, &r.dedup_targets, &r.s0, &r.cv_expert})
    fmt::print("  - {}\n", m->closed_form_assumes);
  if (r.coverage.reference) {
    fmt::print("references (uniform routing): distinct ranks {}; S0 {}.\n", r.dedup_targets.reference_is,
               r.s0.reference_is);
  } else {
    fmt::print("routing is skewed: the closed forms describe uniform routing, so the gaps measure the skew.\n");
  }
}

void run_simulate(const SimulateOptions& o) {
  SimulateInput in;
  MOEKIT_CHECK(!o.model.empty() || o.experts.has_value() == o.topk.has_value(),
               std::string(o.experts ? "--experts needs --topk (or --model to take k from)"
                                     : "--topk needs --experts (or --model to take E from)"));
  if (!o.model.empty() || !o.experts || !o.topk) {
    // E and k from a model spec (deepseek-v3 unless --model names another); --experts/--topk override.
    ModelSpec m = load_model_spec(o.model.empty() ? "deepseek-v3" : o.model);
    MOEKIT_CHECK(m.is_moe(), fmt::format("--model '{}' is dense (num_routed_experts = 0): there is no routing to "
                                         "simulate",
                                         m.name));
    in.num_experts = m.num_routed_experts;
    in.topk = m.num_experts_per_token;
  }
  if (o.experts) in.num_experts = *o.experts;
  if (o.topk) in.topk = *o.topk;
  in.num_ranks = o.ranks;
  in.batch = o.batch;
  in.trials = o.trials;
  in.seed = o.seed;
  in.routing = parse_routing(o.routing);
  in.num_threads = o.threads;
  if (o.steps) MOEKIT_CHECK(!o.save_trace.empty(), std::string("--steps goes with --save-trace"));
  MOEKIT_CHECK(o.layers == 1 || !o.save_trace.empty(), std::string("--layers goes with --save-trace"));

  // The trace is sampled first, so that a bad --batch/--layers/--steps or a missing folder
  // fails before the statistics are printed.
  check_simulate_work(in);  // before the trace's sampling, which is work too
  std::optional<RoutingTrace> trace;
  const int64_t steps = o.steps.value_or(o.trials);
  if (!o.save_trace.empty()) {
    check_output_option(o.save_trace, "--save-trace", {{o.model, "--model"}});
    trace = sample_trace(in, o.layers, steps);
  }
  SimulateResult r;
  {
    ProgressBar bar("simulate");
    r = simulate(in, [&bar](int64_t done, int64_t total) { bar(done, total); });
  }
  if (o.json)
    fmt::print("{}\n", simulate_to_json(r));
  else
    print_table(r);
  if (trace) {
    write_trace(*trace, o.save_trace);
    fmt::print(stderr, "moekit simulate: trace of {} layer(s) x {} steps x {} tokens x top-{} written to {}\n", o.layers,
               steps, in.batch, in.topk, o.save_trace);
  }
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  static SimulateOptions o;
  auto* cmd = app.add_subcommand("simulate", "Monte Carlo routing: coverage, distinct ranks, load skew S0, expert CV "
                                             "against the closed forms");
  cmd->add_option("--model", o.model, "take E and k from this model (embedded name or JSON file; default deepseek-v3)");
  cmd->add_option("--experts", o.experts, "routed experts E (overrides --model)");
  cmd->add_option("--topk", o.topk, "experts per token k (overrides --model)");
  cmd->add_option("--ranks", o.ranks, "expert-parallel GPUs P (must divide E)")->capture_default_str();
  cmd->add_option("--batch", o.batch, "tokens per step B, all GPUs together")->capture_default_str();
  cmd->add_option("--trials", o.trials, "simulated steps")->capture_default_str();
  cmd->add_option("--seed", o.seed, "random seed")->check(kUint64)->capture_default_str();
  cmd->add_option("--routing", o.routing,
                  "uniform | zipf:S | hot:H:R (H experts R times as likely) | drift:H:R:PERIOD (the hot block moves on "
                  "by H experts every PERIOD steps)")
      ->capture_default_str();
  cmd->add_option("--threads", o.threads, "worker threads, 0 = all (results do not depend on it)")
      ->capture_default_str();
  cmd->add_flag("--json", o.json, "print JSON instead of the table");
  cmd->add_option("--save-trace", o.save_trace, "write the sampled top-k indices as a moekit trace (JSON)");
  cmd->add_option("--layers", o.layers, "layers in the saved trace")->capture_default_str();
  cmd->add_option("--steps", o.steps, "steps in the saved trace (default: --trials)");
  cmd->callback([] { run_simulate(o); });
}

}  // namespace moekit::cli
