// `moekit plan`: the roofline planner (include/moekit/plan.h) as a table, JSON and gnuplot plots.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <optional>
#include <string_view>

#include "cli/commands.h"
#include "io/file_io.h"
#include "moekit/check.h"
#include "moekit/plan.h"

namespace moekit::cli {
namespace {

struct PlanOptions {
  std::string model = "deepseek-v3";
  std::string gpu = "h200";
  int ep = 8;
  std::string batch = "1..1024";
  std::string tpot_sla;
  int64_t context = 4096;
  double mem_fraction = 0.85;
  std::string dtype = "fp8";
  int mtp = 0;
  std::optional<double> accept;
  bool json = false;
  std::string plot_dir;
  bool eplb_gain = false;
  std::optional<double> f, speedup;
};

std::string opt_fixed(const std::optional<double>& v, int digits) {
  return v ? fmt::format("{:.{}f}", *v, digits) : std::string("—");
}

std::string compact(double v) {
  if (std::abs(v) >= 1e5) return fmt::format("{:.4g}", v);
  if (std::abs(v) >= 100) return fmt::format("{:.0f}", v);
  return fmt::format("{:.3g}", v);
}

// One decode step per batch. Without MTP the first column is B in tokens (one per sequence)
// and a floor above the SLA is marked; with MTP (`with_tokens`) B counts sequences, a column
// gives the step's tokens, and the SLA is marked on the TPOT in the decode table instead.
void print_step_table(const PlanResult& r, const std::vector<PlanRow>& rows, bool with_tokens) {
  const PlanInput& in = r.input;
  const std::string tokens_head = with_tokens ? fmt::format(" {:>8}", "tokens") : "";
  const std::string tokens_unit = with_tokens ? fmt::format(" {:>8}", "(/step)") : "";
  fmt::print("{:>8}{} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>8} {:>9} {:>14} {:>7} {:>6}\n", "batch B", tokens_head,
             "B/GPU", "coverage", "M_e", "weights/GPU", "wt read", "compute", "comm", "floor", "dominant", "ranks/", "S0");
  fmt::print("{:>8}{} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>8} {:>9} {:>14} {:>7} {:>6}\n",
             with_tokens ? "(seqs)" : "(tokens)", tokens_unit, "(tokens)", "(%)", "(rows)", "(GB)", "(ms)", "(ms)", "(ms)",
             "(ms)", "", "token", "(stat)");
  for (const PlanRow& row : rows) {
    std::string floor = fmt::format("{:.3f}", row.floor_ms);
    if (!with_tokens && in.tpot_sla_ms && row.floor_ms > *in.tpot_sla_ms) floor += "!";
    fmt::print("{:>8}{} {:>8} {:>8.1f} {:>8} {:>10.2f} {:>9.3f} {:>9.3f} {:>8} {:>9} {:>14} {:>7} {:>6}\n", row.batch,
               with_tokens ? fmt::format(" {:>8}", row.tokens_per_step) : "", compact(row.tokens_per_gpu),
               row.coverage * 100, opt_fixed(row.expected_rows_per_expert, 2), row.step_weight_bytes_per_gpu / 1e9,
               row.weight_read_ms, row.compute_ms, opt_fixed(row.comm_ms, 3), floor, row.dominant,
               opt_fixed(row.dedup_targets, 2), opt_fixed(row.imbalance_stat, 3));
  }
}

// With MTP: per batch, the TPOT and tokens/s with and without it, side by side.
void print_decode_table(const PlanResult& r) {
  const PlanInput& in = r.input;
  auto tpot = [&](double ms) {
    return fmt::format("{:.3f}", ms) + (in.tpot_sla_ms && ms > *in.tpot_sla_ms ? "!" : "");
  };
  fmt::print("decode per sequence and in total: TPOT = floor / L (L = {:.4g} with MTP-{}, 1 without)\n",
             r.accept_length, in.mtp);
  fmt::print("{:>8} | {:>9} {:>10} {:>11} | {:>9} {:>10} {:>11} | {:>7}\n", "batch B", "TPOT", "tok/s", "tok/s",
             "TPOT", "tok/s", "tok/s", "speedup");
  fmt::print("{:>8} | {:>9} {:>10} {:>11} | {:>9} {:>10} {:>11} |\n", "(seqs)", "(ms)", "per seq", "total", "(ms)",
             "per seq", "total");
  fmt::print("{:>8} | {:^32} | {:^32} |\n", "", fmt::format("with MTP-{}", in.mtp), "without MTP");
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const PlanRow& row = r.rows[i];
    const PlanRow& plain = r.rows_no_mtp[i];
    fmt::print("{:>8} | {:>9} {:>10.1f} {:>11.1f} | {:>9} {:>10.1f} {:>11.1f} | {:>6.2f}x\n", row.batch, tpot(row.tpot_ms),
               row.tokens_per_s_per_seq, row.tokens_per_s, tpot(plain.tpot_ms), plain.tokens_per_s_per_seq,
               plain.tokens_per_s, plain.tpot_ms / row.tpot_ms);
  }
  fmt::print("  speedup = TPOT without / TPOT with.{}\n\n",
             in.tpot_sla_ms ? fmt::format(" '!': TPOT above the {} ms SLA.", *in.tpot_sla_ms) : "");
}

// The floors with the routed experts in FP8 and in MXFP4, side by side (plan.h expert_formats).
void print_format_table(const PlanResult& r) {
  if (r.expert_formats.size() != 2) return;
  const ExpertFormatPlan &fp8 = r.expert_formats[0], &mx = r.expert_formats[1];
  const ModelSpec& m = r.input.model;
  fmt::print("\nexpert weight formats: the routed experts in FP8 or MXFP4, the other {:.1f} GB at the spec's {} B/param\n",
             r.other_weight_bytes / 1e9, m.weight_bytes_per_param);
  fmt::print("  FP8   {:.6f} B/param (e4m3 values, one fp32 scale per 128x128 block): routed experts {:.1f} GB\n",
             fp8.bytes_per_param, fp8.routed_weight_bytes / 1e9);
  fmt::print("  MXFP4 {:.6f} B/param (e2m1 values, one e8m0 scale per 32):          routed experts {:.1f} GB\n",
             mx.bytes_per_param, mx.routed_weight_bytes / 1e9);
  fmt::print("{:>8} | {:>9} {:>9} | {:>9} {:>9} | {:>9}\n", "batch B", "wt read", "floor", "wt read", "floor", "MXFP4/FP8");
  fmt::print("{:>8} | {:>9} {:>9} | {:>9} {:>9} | {:>9}\n", r.input.mtp > 0 ? "(seqs)" : "(tokens)", "(ms)", "(ms)",
             "(ms)", "(ms)", "floor");
  fmt::print("{:>8} | {:^19} | {:^19} |\n", "", "FP8 experts", "MXFP4 experts");
  for (size_t i = 0; i < fp8.rows.size(); ++i) {
    const PlanRow &a = fp8.rows[i], &b = mx.rows[i];
    fmt::print("{:>8} | {:>9.3f} {:>9.3f} | {:>9.3f} {:>9.3f} | {:>8.3f}x\n", a.batch, a.weight_read_ms, a.floor_ms,
               b.weight_read_ms, b.floor_ms, b.floor_ms / a.floor_ms);
  }
}

// The human table: one row per batch, then the deployment's figures, each with its formula.
void print_table(const PlanResult& r) {
  const PlanInput& in = r.input;
  const ModelSpec& m = in.model;
  const GpuSpec& g = in.gpu;
  fmt::print("moekit plan: {} ({:.4g}B params, {:.4g}B active", m.name, m.total_params / 1e9, m.active_params / 1e9);
  if (r.is_moe)
    fmt::print(", E = {}, k = {}", m.num_routed_experts, m.num_experts_per_token);
  else
    fmt::print(", dense");
  fmt::print(") on {} x {}, EP{}, {}\n", in.ep, g.name, in.ep, to_string(in.dtype));
  fmt::print("  F = {:.0f} TFLOP/s, HBM {:.2f} TB/s, Ridge = F/BW = {:.0f} FLOP/B; weights {:.1f} GB", r.flops / 1e12,
             g.hbm_bandwidth / 1e12, r.ridge, (r.routed_weight_bytes + r.other_weight_bytes) / 1e9);
  if (r.is_moe)
    fmt::print(" (routed {:.1f} GB + other {:.1f} GB)\n  all-to-all over {} ({:.0f} GB/s, {:.1f} us per collective)",
               r.routed_weight_bytes / 1e9, r.other_weight_bytes / 1e9, r.comm_link == "nvlink" ? "NVLink" : "the network",
               r.comm_bandwidth / 1e9, r.comm_latency_us);
  fmt::print("\n");
  const bool mtp = in.mtp > 0;
  if (mtp)
    fmt::print("  speculative decoding MTP-{}: each sequence verifies {} tokens per step and advances by L = {:.4g} on "
               "average{}\n",
               in.mtp, in.mtp + 1, r.accept_length,
               r.accept_length_is_bound ? " (N + 1: the optimistic bound, every draft accepted; --accept L for a measured one)"
                                        : " (--accept)");
  fmt::print("\n");

  if (mtp) {
    fmt::print("with MTP-{}: one decode step verifies B x {} tokens\n", in.mtp, in.mtp + 1);
    print_step_table(r, r.rows, true);
    fmt::print("\nwithout MTP: one decode step of B tokens\n");
    print_step_table(r, r.rows_no_mtp, true);
    fmt::print("  floor = max(wt read, compute); {};\n  dominant = the largest of the three.\n\n",
               r.is_moe ? fmt::format("comm (dispatch + combine over all {} MoE layers) is not in it", m.num_moe_layers)
                        : std::string("a dense model has no expert-parallel all-to-all (comm —)"));
    print_decode_table(r);
  } else {
    print_step_table(r, r.rows, false);
    fmt::print("  floor = max(wt read, compute); {};\n  dominant = the largest of the three.{}\n\n",
               r.is_moe ? fmt::format("comm (dispatch + combine over all {} MoE layers) is not in it", m.num_moe_layers)
                        : std::string("a dense model has no expert-parallel all-to-all (comm —)"),
               in.tpot_sla_ms ? fmt::format(" '!': floor above the {} ms SLA.", *in.tpot_sla_ms) : "");
  }

  const double bpp = m.weight_bytes_per_param;
  if (mtp)
    fmt::print("knee        B*    = {:>9.1f}   Ridge x total_params x bpp / (2 x active_params x (N + 1)) = {:.0f} x {:.4g} "
               "x {} / (2 x {:.4g} x {})\n",
               r.knee_batch, r.ridge, m.total_params, bpp, m.active_params, in.mtp + 1);
  else
    fmt::print("knee        B*    = {:>9.1f}   Ridge x total_params x bpp / (2 x active_params) = {:.0f} x {:.4g} x {} / (2 x {:.4g})\n",
               r.knee_batch, r.ridge, m.total_params, bpp, m.active_params);
  if (r.batch_sla)
    fmt::print("TPOT SLA    B_SLA = {:>9}     largest B with {} <= {} ms{}\n", *r.batch_sla,
               mtp ? "TPOT = floor / L" : "floor", *in.tpot_sla_ms, *r.batch_sla == 0 ? " (none: even B = 1 misses it)" : "");
  else
    fmt::print("TPOT SLA    B_SLA =         —     (no --tpot-sla)\n");
  fmt::print("memory      B_mem = {:>9.1f}   ({} x {:.0f} GB x {} - {:.1f} GB weights) / ({:.0f} B KV/token x {} tokens)\n",
             r.batch_mem, in.ep, g.hbm_bytes / 1e9, in.mem_fraction, m.total_params * bpp / 1e9, m.kv_bytes_per_token,
             in.context);
  const char* binding_name = r.binding == "knee" ? "the throughput knee B*"
                             : r.binding == "sla" ? "the TPOT SLA (B_SLA)"
                                                  : "memory (B_mem)";
  fmt::print("operating point B = {} = min of the above, bound by {}\n", r.operating_point, binding_name);
  if (r.batch_mem <= 0)
    fmt::print("  warning: the weights alone ({:.1f} GB) do not fit in {} x {:.0f} GB x {}: add GPUs or raise --mem-fraction\n",
               m.total_params * bpp / 1e9, in.ep, g.hbm_bytes / 1e9, in.mem_fraction);
  fmt::print("\nBM* = Ridge x bpp / 2 = {:.1f} rows: expert GEMM tiles with BM below it hide pad rows in weight reads\n",
             r.bm_star);
  if (r.is_moe) {
    double me = r.padding.empty() ? 0 : r.padding.front().expected_m;
    fmt::print("padding waste ceil(M_e/BM) x BM / M_e at the expected M_e = {:.2f} rows (B = {}{}) and at M_e = 5;\n"
               "padding every expert to M_max = {} rows; weight reads per hit expert, E[ceil(X/BM) | X >= 1] for\n"
               "Poisson rows X around M_e (a masked GEMM streams an expert's weights once per token block):\n",
               me, r.operating_point,
               in.mtp > 0 ? fmt::format(", {} tokens", r.operating_point * (in.mtp + 1)) : std::string(), kPaddingMMax);
    fmt::print("{:>6} {:>12} {:>10} {:>18} {:>18} {:>13}\n", "BM", "tile, at M_e", "tile, at 5", "pad to M_max, M_e",
               "pad to M_max, 5", "weight reads");
    auto times = [](const std::optional<double>& v) { return v ? fmt::format("{:.2f}x", *v) : std::string("—"); };
    auto reads = [](const std::optional<double>& v) { return v ? fmt::format("{:.3f}", *v) : std::string("—"); };
    for (const PaddingRow& p : r.padding)
      fmt::print("{:>6} {:>12} {:>10} {:>18} {:>18} {:>13}\n", p.bm, times(p.waste_expected), times(p.waste_m5),
                 times(p.waste_pad_to_m_max), times(p.waste_pad_to_m_max_m5), reads(p.weight_reads_expected));
    if (!r.padding.empty() && !r.padding.front().waste_pad_to_m_max)
      fmt::print("  (— : M_e is above M_max = {} or zero, so padding to M_max does not apply)\n", kPaddingMMax);
    print_format_table(r);
  }
}

// ---------------------------------------------------------------------------------------------
// --plot DIR: plan.dat (a dense sweep of B), plan-rows.dat (the table's rows), plan.gp, and the
// PNGs gnuplot draws from them. plan.gp picks pngcairo when gnuplot has it, else png.

std::vector<int64_t> plot_grid(int64_t lo, int64_t hi) {
  std::vector<int64_t> grid;
  const int n = 240;
  for (int i = 0; i <= n; ++i) {
    double b = std::exp(std::log(double(lo)) + (std::log(double(hi)) - std::log(double(lo))) * i / n);
    grid.push_back(std::max<int64_t>(1, std::llround(b)));
  }
  grid.erase(std::unique(grid.begin(), grid.end()), grid.end());
  return grid;
}

// A gnuplot double-quoted string holding only letters, digits, space and .,:()=+/_- ; any other
// byte becomes '?'. The text carries model and GPU names from spec files, and gnuplot runs
// `command` in backquotes even inside double quotes and ends a command at a newline: no
// escaping rule is as simple to trust as a character set with nothing to escape.
std::string gp_quote(const std::string& s) {
  std::string out = "\"";
  constexpr std::string_view kPunctuation = " .,:()=+/_-";
  for (char c : s)
    out += std::isalnum(static_cast<unsigned char>(c)) || kPunctuation.find(c) != std::string_view::npos ? c : '?';
  return out + "\"";
}

void make_plot_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MOEKIT_CHECK(!ec && std::filesystem::is_directory(dir),
               fmt::format("--plot '{}': cannot create the directory: {}", dir,
                           ec ? ec.message() : std::string("a file is in the way")));
}

void write_plot(const PlanResult& r, const std::string& dir) {
  namespace fs = std::filesystem;
  make_plot_dir(dir);
  const PlanInput& in = r.input;
  const bool comm = r.is_moe && in.ep > 1;

  int64_t lo = in.batches.front(), hi = in.batches.back();
  // Widen the sweep so the operating point shows, within reason (1000x the largest batch).
  double want_hi = std::max<double>(hi, 1.25 * double(r.operating_point));
  hi = int64_t(std::min(want_hi, 1000.0 * double(hi)));
  if (hi <= lo) hi = lo + 1;
  {
    std::string dat = "# moekit plan sweep: B weight_read_ms compute_ms comm_ms floor_ms coverage\n";
    for (int64_t b : plot_grid(lo, hi)) {
      PlanRow row = plan_row(in, b);
      dat += fmt::format("{} {:.9g} {:.9g} {} {:.9g} {:.9g}\n", b, row.weight_read_ms, row.compute_ms,
                         row.comm_ms ? fmt::format("{:.9g}", *row.comm_ms) : std::string("NaN"), row.floor_ms,
                         row.coverage);
    }
    write_file_atomically((fs::path(dir) / "plan.dat").string(), dat, "plot data file");
    std::string rows = "# moekit plan rows: B floor_ms coverage\n";
    for (const PlanRow& row : r.rows) rows += fmt::format("{} {:.9g} {:.9g}\n", row.batch, row.floor_ms, row.coverage);
    write_file_atomically((fs::path(dir) / "plan-rows.dat").string(), rows, "plot data file");
  }

  const std::string what = fmt::format("{} on {} x {} (EP{}, {})", in.model.name, in.ep, in.gpu.name, in.ep,
                                       to_string(in.dtype));
  const int64_t op = r.operating_point;
  const bool op_shown = op >= lo && op <= hi;
  const std::string op_label = fmt::format("operating point B = {} ({})", op, r.binding);
  std::string gp;
  gp += "# Generated by `moekit plan --plot`. Re-render: scripts/plot-plan DIR, or cd DIR && gnuplot plan.gp\n";
  gp += "if (strstrt(GPVAL_TERMINALS, \"pngcairo\") > 0) {\n"
        "  set terminal pngcairo size 1100,680 enhanced font \"Sans,11\"\n"
        "} else {\n"
        "  set terminal png size 1100,680 enhanced\n"
        "}\n";
  gp += "set datafile missing \"NaN\"\nset grid\nset logscale x\nset format x \"%g\"\n";
  gp += fmt::format("set xlabel \"global batch B (tokens per decode step, {} per GPU)\"\n", "B/" + std::to_string(in.ep));
  gp += fmt::format("set xrange [{}:{}]\n", lo, hi);
  const PlanRow op_row = plan_row(in, std::max<int64_t>(op, 1));
  // The operating point: a dashed vertical line, its label at height `label_y` (graph units),
  // and a dot on the curve at (op, y).
  auto marks = [&](double label_y, double y) {
    std::string s = "unset arrow\nunset label\n";
    if (op_shown) {
      s += fmt::format("set arrow from {0}, graph 0 to {0}, graph 1 nohead lw 2 dt 2 lc rgb \"#c00000\"\n", op);
      // The label goes on the side of the line with more room.
      const double at = std::log(double(op) / lo) / std::log(double(hi) / lo);
      s += fmt::format("set label {} at {}, graph {} {} tc rgb \"#c00000\"\n", gp_quote(op_label), op, label_y,
                       at < 0.6 ? "left offset 0.8,0" : "right offset -0.8,0");
      s += fmt::format("set label \"\" at {}, first {:.9g} point pt 6 ps 3 lw 2 lc rgb \"#c00000\"\n", op, y);
    }
    if (r.knee_batch >= lo && r.knee_batch <= hi && r.binding != "knee")
      s += fmt::format("set arrow from {0:.6g}, graph 0 to {0:.6g}, graph 1 nohead dt 3 lc rgb \"#606060\"\n"
                       "set label \"knee B* = {1:.0f}\" at {0:.6g}, graph 0.05 left offset 0.5,0 tc rgb \"#606060\"\n",
                       r.knee_batch, r.knee_batch);
    return s;
  };

  gp += "set output \"plan-floor.png\"\n";
  gp += fmt::format("set title {} noenhanced\n", gp_quote(what + ": floor of one decode step and its parts"));
  gp += "set ylabel \"time per step (ms)\"\nset logscale y\nset format y \"%g\"\nset key bottom right box opaque\n";
  gp += marks(0.96, op_row.floor_ms);
  if (in.tpot_sla_ms)
    gp += fmt::format("set arrow from graph 0, first {0:.6g} to graph 1, first {0:.6g} nohead dt 4 lc rgb \"#0060c0\"\n"
                      "set label \"TPOT SLA {0:g} ms\" at graph 0.99, first {0:.6g} right offset 0,-0.8 tc rgb \"#0060c0\"\n",
                      *in.tpot_sla_ms);
  gp += "plot \"plan.dat\" using 1:5 with lines lw 9 lc rgb \"#b8b8b8\" title \"floor = max(weight read, compute)\", \\\n"
        "     \"\" using 1:2 with lines lw 2 lc rgb \"#1f77b4\" title \"weight read\", \\\n"
        "     \"\" using 1:3 with lines lw 2 lc rgb \"#2ca02c\" title \"compute\"";
  if (comm)
    gp += fmt::format(", \\\n     \"\" using 1:4 with lines lw 2 dt 2 lc rgb \"#ff7f0e\" title \"communication over {} (not in the floor)\"",
                      r.comm_link == "nvlink" ? "NVLink" : "the network");
  gp += ", \\\n     \"plan-rows.dat\" using 1:2 with points pt 7 ps 1.2 lc rgb \"black\" title \"rows of the table\"\n";

  gp += "set output \"plan-coverage.png\"\n";
  gp += fmt::format("set title {} noenhanced\n", gp_quote(what + ": coverage, the share of routed experts hit per step"));
  gp += "unset logscale y\nset format y \"%g%%\"\nset yrange [0:105]\nset ylabel \"coverage C(B) = 1 - (1 - k/E)^B\"\n"
        "set key bottom right box opaque\n";
  gp += marks(0.3, op_row.coverage * 100);
  gp += "plot \"plan.dat\" using 1:($6*100) with lines lw 3 lc rgb \"#1f77b4\" title \"coverage\", \\\n"
        "     \"plan-rows.dat\" using 1:($3*100) with points pt 7 ps 1.2 lc rgb \"black\" title \"rows of the table\"\n";
  gp += "unset output\n";
  write_file_atomically((fs::path(dir) / "plan.gp").string(), gp, "gnuplot script");

  // gnuplot runs in DIR (fork + chdir + exec: no shell, so no quoting of DIR).
  fflush(stdout);
  pid_t pid = fork();
  MOEKIT_CHECK(pid >= 0, std::string("--plot: fork failed"));
  if (pid == 0) {
    if (chdir(dir.c_str()) != 0) _exit(126);
    execlp("gnuplot", "gnuplot", "plan.gp", (char*)nullptr);
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  MOEKIT_CHECK(rc != 127, fmt::format("--plot: gnuplot is not installed (apt-get install gnuplot-nox, or make setup); "
                                      "the data and the script are in '{}': run scripts/plot-plan {} once it is",
                                      dir, dir));
  MOEKIT_CHECK(rc == 0, fmt::format("--plot: gnuplot failed (exit status {}) on '{}/plan.gp'", rc, dir));
}

void run_eplb_gain(const PlanOptions& o) {
  MOEKIT_CHECK(o.f.has_value(), std::string("--eplb-gain needs --f F (the balanceable share of step time, in [0, 1])"));
  MOEKIT_CHECK(o.speedup.has_value(), std::string("--eplb-gain needs --speedup S (the MoE layer speed-up S0/S1, > 0)"));
  double gain = eplb_gain(*o.f, *o.speedup);
  if (o.json)
    fmt::print("{{\"eplb_gain\": {}, \"f\": {}, \"speedup\": {}}}\n", gain, *o.f, *o.speedup);
  else
    fmt::print("EPLB end-to-end gain 1 / (f/S + 1 - f) = {:.3f}x   (f = {}, S = S0/S1 = {})\n", gain, *o.f, *o.speedup);
}

void run_plan(const PlanOptions& o) {
  MOEKIT_CHECK(!o.f && !o.speedup, std::string("--f and --speedup go with --eplb-gain"));
  PlanInput in;
  // Flags first (cheap, and the common mistakes), then the specs.
  in.ep = o.ep;
  in.batches = parse_batch_list(o.batch);
  if (!o.tpot_sla.empty()) in.tpot_sla_ms = parse_duration_ms(o.tpot_sla);
  in.context = o.context;
  in.mem_fraction = o.mem_fraction;
  in.dtype = parse_dtype(o.dtype);
  in.mtp = o.mtp;
  in.accept_length = o.accept;
  in.model = load_model_spec(o.model);
  in.gpu = load_gpu_spec(o.gpu);
  PlanResult r = plan(in);
  if (!o.plot_dir.empty()) make_plot_dir(o.plot_dir);  // before any output, so a bad DIR prints nothing
  if (o.json)
    fmt::print("{}\n", plan_to_json(r));
  else
    print_table(r);
  if (!o.plot_dir.empty()) {
    write_plot(r, o.plot_dir);
    fmt::print(stderr, "moekit plan: plots in {0}/plan-floor.png and {0}/plan-coverage.png (data: plan.dat, script: plan.gp)\n",
               o.plot_dir);
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  static PlanOptions o;
  auto* cmd = app.add_subcommand("plan", "Roofline plan of a decode step: floor, coverage, all-to-all, operating point");
  cmd->add_option("--model", o.model, "model: embedded name or JSON file")->capture_default_str();
  cmd->add_option("--gpu", o.gpu, "GPU: embedded name or JSON file")->capture_default_str();
  cmd->add_option("--ep", o.ep, "expert-parallel GPUs P")->capture_default_str();
  cmd->add_option("--batch", o.batch, "global batches B: a list 1,8,64 and/or doubling ranges 1..1024")
      ->capture_default_str();
  cmd->add_option("--tpot-sla", o.tpot_sla, "TPOT SLA, e.g. 30ms or 30 (milliseconds)");
  cmd->add_option("--context", o.context, "tokens of KV cache per sequence")->capture_default_str();
  cmd->add_option("--mem-fraction", o.mem_fraction, "share of HBM for weights and KV cache, in (0, 1]")
      ->capture_default_str();
  cmd->add_option("--dtype", o.dtype, "dense rate F to use: fp8 or bf16")->capture_default_str();
  cmd->add_option("--mtp", o.mtp, "speculative decoding: tokens drafted per sequence and step (0: none)")
      ->capture_default_str();
  cmd->add_option("--accept", o.accept, "mean accepted length L in [1, N + 1] with --mtp N (default N + 1, the bound)");
  cmd->add_flag("--json", o.json, "print JSON instead of the table");
  cmd->add_option("--plot", o.plot_dir, "draw PNG plots with gnuplot into DIR");
  cmd->add_flag("--eplb-gain", o.eplb_gain, "print the EPLB end-to-end gain 1/(f/S + 1 - f) and exit");
  cmd->add_option("--f", o.f, "balanceable share of step time, for --eplb-gain");
  cmd->add_option("--speedup", o.speedup, "MoE layer speed-up S0/S1, for --eplb-gain");
  cmd->callback([] { o.eplb_gain ? run_eplb_gain(o) : run_plan(o); });
}

}  // namespace moekit::cli
