// The roofline planner (see include/moekit/plan.h). Every formula of the plan is in this file,
// each next to the docs/theory.md section that derives it; nothing here does I/O.
#include "moekit/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "moekit/check.h"
#include "moekit/limits.h"

namespace moekit {

// ---------------------------------------------------------------------------------------------
// Closed forms shared with the simulator.

// docs/theory.md §Coverage: C(B) = 1 − (1 − k/E)^B, the expected share of experts hit by B
// tokens. Written as −expm1(B·log1p(−k/E)) so a small k/E keeps its digits.
double coverage_closed_form(int num_experts, int topk, double batch) {
  if (topk >= num_experts) return 1.0;  // every expert every step (log1p(−1) would be −inf)
  return -std::expm1(batch * std::log1p(-double(topk) / num_experts));
}

// docs/theory.md §All-to-all bytes: C = P·[1 − (1 − 1/P)^k] distinct target ranks per token after de-duplication.
// It treats the k picks as independent uniform ranks (sampling with replacement).
double dedup_targets_closed_form(int num_ranks, int topk) {
  if (num_ranks == 1) return 1.0;
  return num_ranks * -std::expm1(topk * std::log1p(-1.0 / num_ranks));
}

// docs/theory.md §Statistical skew: CV_e = sqrt((1 − k/E)/(B·k/E)), the coefficient of variation of one expert's
// load when each of B tokens picks it with probability p = k/E (Binomial(B, p): σ/μ = sqrt((1 − p)/(B·p))).
double cv_expert_closed_form(int num_experts, int topk, double batch) {
  double p = double(topk) / num_experts;
  return std::sqrt((1.0 - p) / (batch * p));
}

// docs/theory.md §Statistical skew: S₀ ≈ 1 + sqrt(2 ln P)·CV_gpu with CV_gpu = CV_e/sqrt(e), e = E/P experts per GPU.
double imbalance_closed_form(int num_experts, int topk, int num_ranks, double batch) {
  double e = double(num_experts) / num_ranks;
  return 1.0 + std::sqrt(2.0 * std::log(double(num_ranks))) * cv_expert_closed_form(num_experts, topk, batch) /
                   std::sqrt(e);
}

// docs/theory.md §EPLB gain: the MoE layer speeds up S = S₀/S₁; end to end 1 / (f/S + 1 − f).
double eplb_gain(double f, double speedup) {
  MOEKIT_CHECK(std::isfinite(f) && f >= 0 && f <= 1,
               fmt::format("--f = {} must be in [0, 1] (the balanceable share of step time)", f));
  MOEKIT_CHECK(std::isfinite(speedup) && speedup > 0,
               fmt::format("--speedup = {} must be > 0 (the MoE layer speed-up S0/S1)", speedup));
  return 1.0 / (f / speedup + 1.0 - f);
}

// ---------------------------------------------------------------------------------------------
// Parsing helpers for the command line (pure: strings in, values or Errors out).

ComputeDtype parse_dtype(std::string_view s) {
  if (s == "fp8") return ComputeDtype::fp8;
  if (s == "bf16") return ComputeDtype::bf16;
  throw Error(fmt::format("--dtype '{}' is unknown: expected fp8 or bf16", s));
}

const char* to_string(ComputeDtype d) { return d == ComputeDtype::fp8 ? "fp8" : "bf16"; }

// docs/theory.md §Padding: E[⌈X/BM⌉ | X ≥ 1], X ~ Poisson(mean). Summed over the pmf outward from
// its mode, where every term is representable (e^−mean alone underflows from mean ≈ 745 on), until
// the terms no longer change the sum.
double expected_token_blocks(int bm, double mean) {
  MOEKIT_CHECK(bm >= 1 && bm <= kMaxTokenBlock && mean > 0 && std::isfinite(mean),
               fmt::format("expected_token_blocks: BM = {} and mean = {}, expected BM in [1, {}] and a finite mean > 0",
                           bm, mean, kMaxTokenBlock));
  // Rows spread over many blocks: X mod BM is uniform, so the round-up averages (BM − 1)/(2 BM)
  // (agrees with the sum to 1e-11 at mean = 1e5), and the sum would take ~18·√mean terms.
  if (mean > 1e5 && 4.0 * bm <= std::sqrt(mean)) return mean / bm + (bm - 1) / (2.0 * bm);
  const double mode = std::floor(mean);
  const double p_mode = std::exp(-mean + mode * std::log(mean) - std::lgamma(mode + 1));
  auto blocks = [bm](double x) { return std::ceil(x / bm); };
  double sum = mode >= 1 ? p_mode * blocks(mode) : 0;  // Σ ⌈x/BM⌉·p(x) over x ≥ 1
  double p = p_mode;
  for (double x = mode; p > 0; ++x) {  // upward (past the mode the terms only shrink): p(x + 1) = p(x)·mean/(x + 1)
    p *= mean / (x + 1);
    const double term = p * blocks(x + 1);
    if (sum + term == sum) break;
    sum += term;
  }
  p = p_mode;
  for (double x = mode; x > 1 && p > 0; --x) {  // downward to x = 1: p(x − 1) = p(x)·x/mean
    p *= x / mean;
    const double term = p * blocks(x - 1);
    if (sum + term == sum) break;
    sum += term;
  }
  return sum / -std::expm1(-mean);  // P(X ≥ 1) = 1 − e^−mean
}

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

int64_t parse_batch_value(std::string_view item, std::string_view whole) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
  MOEKIT_CHECK(ec != std::errc::result_out_of_range,
               fmt::format("--batch '{}': '{}' is out of range", whole, item));
  MOEKIT_CHECK(ec == std::errc() && ptr == item.data() + item.size() && !item.empty(),
               fmt::format("--batch '{}': '{}' is not an integer (expected a list like 1,8,64 or a range 1..1024)",
                           whole, item));
  MOEKIT_CHECK(v >= 1, fmt::format("--batch '{}': batch {} must be >= 1 (tokens per decode step)", whole, v));
  MOEKIT_CHECK(v <= kMaxPlanBatch, fmt::format("--batch '{}': batch {} must be <= {}", whole, v, kMaxPlanBatch));
  return v;
}

}  // namespace

std::vector<int64_t> parse_batch_list(std::string_view s) {
  MOEKIT_CHECK(!trim(s).empty(), std::string("--batch is empty: expected a list like 1,8,64 or a range 1..1024"));
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string_view::npos) comma = s.size();
    std::string_view item = trim(s.substr(pos, comma - pos));
    MOEKIT_CHECK(!item.empty(), fmt::format("--batch '{}': empty item (two commas, or a trailing comma?)", s));
    size_t dots = item.find("..");
    if (dots == std::string_view::npos) {
      out.push_back(parse_batch_value(item, s));
    } else {
      int64_t lo = parse_batch_value(trim(item.substr(0, dots)), s);
      int64_t hi = parse_batch_value(trim(item.substr(dots + 2)), s);
      MOEKIT_CHECK(lo <= hi, fmt::format("--batch '{}': range '{}' runs backwards ({} > {})", s, item, lo, hi));
      for (int64_t b = lo;; b *= 2) {  // lo, 2·lo, 4·lo, … while <= hi (b > hi/2 ⇔ 2·b > hi)
        out.push_back(b);
        if (b > hi / 2) break;
      }
      out.push_back(hi);
    }
    pos = comma + 1;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

double parse_duration_ms(std::string_view s) {
  std::string_view t = trim(s);
  double scale = 1.0;  // to milliseconds
  auto ends_with = [&](std::string_view suffix) {
    return t.size() >= suffix.size() && t.substr(t.size() - suffix.size()) == suffix;
  };
  if (ends_with("ms")) {
    t.remove_suffix(2);
  } else if (ends_with("us")) {
    t.remove_suffix(2), scale = 1e-3;
  } else if (ends_with("s")) {
    t.remove_suffix(1), scale = 1e3;
  }
  t = trim(t);
  double v = 0;
  auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  MOEKIT_CHECK(ec == std::errc() && ptr == t.data() + t.size() && !t.empty(),
               fmt::format("--tpot-sla '{}' is not a duration: expected a number of milliseconds like 30 or 30ms "
                           "(or 0.03s, 30000us)",
                           s));
  MOEKIT_CHECK(std::isfinite(v) && v > 0, fmt::format("--tpot-sla '{}' must be > 0", s));
  return v * scale;
}

// ---------------------------------------------------------------------------------------------
// The plan.

namespace {

double dense_flops(const GpuSpec& gpu, ComputeDtype dtype) { return dtype == ComputeDtype::fp8 ? gpu.fp8_flops : gpu.bf16_flops; }

// Tokens a sequence verifies per step: its N drafts and the one it would decode anyway.
int64_t tokens_per_sequence(const PlanInput& in) { return int64_t(in.mtp) + 1; }

// Parameters of all routed experts, whole model: num_moe_layers·E·3·hidden·moe_inter (gate, up and
// down projections of a SwiGLU expert).
double routed_params(const ModelSpec& m) { return double(m.num_moe_layers) * m.num_routed_experts * m.params_per_expert(); }

// Bytes of all routed experts, whole model (docs/theory.md §Weight traffic and the floor, W_routed·bpp).
double routed_weight_bytes(const ModelSpec& m) { return routed_params(m) * m.weight_bytes_per_param; }

void validate(const PlanInput& in) {
  // The specs are validated again through their JSON form, so a hand-built ModelSpec or GpuSpec
  // with a zero bandwidth or k > E cannot reach a division below.
  parse_model_spec(to_json(in.model), fmt::format("model '{}'", in.model.name));
  parse_gpu_spec(to_json(in.gpu), fmt::format("gpu '{}'", in.gpu.name));
  MOEKIT_CHECK(in.ep >= 1, fmt::format("--ep = {} must be >= 1 (expert-parallel GPUs)", in.ep));
  MOEKIT_CHECK(in.ep <= kMaxRanks, fmt::format("--ep = {} must be <= {} (expert-parallel GPUs)", in.ep, kMaxRanks));
  if (in.model.is_moe())
    MOEKIT_CHECK(in.model.num_routed_experts % in.ep == 0,
                 fmt::format("--ep = {} must divide num_routed_experts = {} of model '{}' (experts are placed E/P "
                             "per GPU); try one of its divisors",
                             in.ep, in.model.num_routed_experts, in.model.name));
  MOEKIT_CHECK(!in.batches.empty(), std::string("--batch: no batch sizes given"));
  for (int64_t b : in.batches)
    MOEKIT_CHECK(b >= 1 && b <= kMaxPlanBatch, fmt::format("--batch: batch {} must be >= 1 and <= {}", b, kMaxPlanBatch));
  MOEKIT_CHECK(in.context >= 1, fmt::format("--context = {} must be >= 1 (tokens of KV cache per sequence)", in.context));
  MOEKIT_CHECK(in.context <= kMaxContext, fmt::format("--context = {} must be <= {}", in.context, kMaxContext));
  MOEKIT_CHECK(std::isfinite(in.mem_fraction) && in.mem_fraction > 0 && in.mem_fraction <= 1,
               fmt::format("--mem-fraction = {} must be in (0, 1]", in.mem_fraction));
  if (in.tpot_sla_ms)
    MOEKIT_CHECK(std::isfinite(*in.tpot_sla_ms) && *in.tpot_sla_ms > 0,
                 fmt::format("--tpot-sla = {} ms must be > 0", *in.tpot_sla_ms));
  MOEKIT_CHECK(in.mtp >= 0 && in.mtp <= kMaxMtp,
               fmt::format("--mtp = {} must be in [0, {}] (tokens drafted per sequence and step; 0: no speculative "
                           "decoding)",
                           in.mtp, kMaxMtp));
  if (in.accept_length) {
    const double L = *in.accept_length;
    MOEKIT_CHECK(std::isfinite(L) && L >= 1 && L <= in.mtp + 1,
                 fmt::format("--accept = {} must be in [1, N + 1] = [1, {}] with --mtp {} (the mean tokens a sequence "
                             "advances per step: at least the one it always decodes, at most every draft accepted)",
                             L, in.mtp + 1, in.mtp));
  }
  // The step's tokens, B·(N + 1), are counted in doubles: they must stay within 2^53 as B does.
  for (int64_t b : in.batches)
    MOEKIT_CHECK(b <= kMaxPlanBatch / tokens_per_sequence(in),
                 fmt::format("--batch: batch {} with --mtp {} verifies {} x {} tokens per step, beyond 2^53", b,
                             in.mtp, b, tokens_per_sequence(in)));
}

// The largest B with tpot_ms(B) <= SLA, or 0 when even B = 1 misses it.
// tpot_ms(B) = max(weight_read_ms, compute_ms)/L at T = B·(N + 1) tokens is non-decreasing in B
// (coverage and compute both grow with B), so bisection over integers finds it. The upper end is
// the first B at which compute alone misses the SLA, 2·N_active·B·(N + 1)/(P·F·L) > SLA, capped
// so that T stays within 2^53 (where doubles stop counting integers exactly; no deployment
// comes near). At most 54 steps.
int64_t batch_sla(const PlanInput& in, double sla_ms) {
  if (plan_row(in, 1).tpot_ms > sla_ms) return 0;
  const double flops = dense_flops(in.gpu, in.dtype);
  const double L = accept_length(in);
  const double per_seq = double(tokens_per_sequence(in));
  const double max_batch = std::floor(double(kMaxPlanBatch) / per_seq);  // 2^53 tokens
  double hi_real = std::floor(sla_ms * 1e-3 * in.ep * flops * L / (2.0 * in.model.active_params * per_seq)) + 1;
  int64_t lo = 1;
  int64_t hi = int64_t(std::clamp(hi_real, 2.0, max_batch));
  if (plan_row(in, hi).tpot_ms <= sla_ms) return hi;  // only at the cap
  while (hi - lo > 1) {  // invariant: tpot(lo) <= SLA < tpot(hi)
    int64_t mid = lo + (hi - lo) / 2;
    (plan_row(in, mid).tpot_ms <= sla_ms ? lo : hi) = mid;
  }
  return lo;
}

PaddingRow padding_row(int bm, double expected_m) {
  // docs/theory.md §Padding: a tile with at least one real row computes all BM rows, so the FLOP waste
  // is ⌈M_e/BM⌉·BM/M_e; padding every expert to M_max computes ⌈M_max/BM⌉·BM rows.
  auto waste = [bm](double rows_computed_for, double m) { return std::ceil(rows_computed_for / bm) * bm / m; };
  PaddingRow r;
  r.bm = bm;
  r.expected_m = expected_m;
  if (expected_m > 0) r.waste_expected = waste(expected_m, expected_m);
  r.waste_m5 = waste(kPaddingSmallM, kPaddingSmallM);
  if (expected_m > 0 && expected_m <= kPaddingMMax) r.waste_pad_to_m_max = waste(kPaddingMMax, expected_m);
  r.waste_pad_to_m_max_m5 = waste(kPaddingMMax, kPaddingSmallM);
  if (expected_m > 0) r.weight_reads_expected = expected_token_blocks(bm, expected_m);
  return r;
}

// plan_row with the routed experts at `expert_bpp` bytes per parameter and every other weight at
// the spec's weight_bytes_per_param.
PlanRow plan_row_with_experts_at(const PlanInput& in, int64_t batch, double expert_bpp);

}  // namespace

double expert_bytes_per_param(std::string_view format) {
  // Values plus scales: FP8 one fp32 per 128 x 128 values, MXFP4 one byte per 32 values.
  if (format == "fp8") return 1.0 + 4.0 / (128.0 * 128.0);
  if (format == "mxfp4") return (4.0 + 8.0 / 32.0) / 8.0;
  throw Error(fmt::format("expert weight format '{}' is unknown: expected fp8 or mxfp4", format));
}

double accept_length(const PlanInput& in) { return in.accept_length.value_or(double(tokens_per_sequence(in))); }

PlanRow plan_row(const PlanInput& in, int64_t batch) {
  return plan_row_with_experts_at(in, batch, in.model.weight_bytes_per_param);
}

namespace {

PlanRow plan_row_with_experts_at(const PlanInput& in, int64_t batch, double expert_bpp) {
  const ModelSpec& m = in.model;
  const GpuSpec& g = in.gpu;
  // Every figure of the step is that of the T = B·(N + 1) tokens it verifies: to the MoE
  // layers a drafted token is one more token (T = B without MTP).
  const int64_t tokens = batch * tokens_per_sequence(in);
  const double T = double(tokens);
  const double P = in.ep;
  const double F = dense_flops(g, in.dtype);
  const double bpp = m.weight_bytes_per_param;
  const double d = double(m.hidden_size);

  PlanRow r;
  r.batch = batch;
  r.tokens_per_step = tokens;
  r.tokens_per_gpu = T / P;

  // docs/theory.md §Weight traffic and the floor: weight traffic of a step ≈ [C(B)·W_routed + W_other]·bpp, split
  // evenly over the P GPUs. A dense model reads every weight every step (C = 1). The routed
  // experts may be stored at their own bytes per parameter (expert_bpp; the spec's bpp otherwise).
  const double routed = routed_params(m) * expert_bpp;
  const double other = m.total_params * bpp - routed_weight_bytes(m);
  r.coverage = m.is_moe() ? coverage_closed_form(m.num_routed_experts, m.num_experts_per_token, T) : 1.0;
  r.step_weight_bytes_per_gpu = (r.coverage * routed + other) / P;
  r.weight_read_ms = r.step_weight_bytes_per_gpu / g.hbm_bandwidth * 1e3;

  // docs/theory.md §Weight traffic and the floor: compute of a step is 2·N_active FLOP per token.
  r.compute_ms = 2.0 * m.active_params * T / (P * F) * 1e3;
  // docs/theory.md §Weight traffic and the floor: the floor is the larger of the two (communication is reported apart).
  r.floor_ms = std::max(r.weight_read_ms, r.compute_ms);

  if (m.is_moe()) {
    const double E = m.num_routed_experts;
    const double k = m.num_experts_per_token;
    // docs/theory.md §Padding (rows per expert): each token sends k rows spread over E experts.
    r.expected_rows_per_expert = T * k / E;
    // docs/theory.md §All-to-all bytes: bytes per GPU and MoE layer. Dispatch sends one FP8 copy per distinct target
    // rank (1 B per element; the 1×128 scales, d/32 B more, are left out); combine returns BF16,
    // one message per expert (k), or one per target rank when a rank sums its experts first.
    r.dedup_targets = dedup_targets_closed_form(in.ep, m.num_experts_per_token);
    r.dispatch_bytes_per_gpu = r.tokens_per_gpu * *r.dedup_targets * d * 1.0;
    r.combine_bytes_per_gpu = r.tokens_per_gpu * k * d * 2.0;
    r.combine_bytes_prereduced_per_gpu = r.tokens_per_gpu * *r.dedup_targets * d * 2.0;
    // docs/theory.md §Statistical skew: S₀ = 1 + sqrt(2 ln P)·CV_e/sqrt(E/P).
    r.cv_expert = cv_expert_closed_form(m.num_routed_experts, m.num_experts_per_token, T);
    r.imbalance_stat = imbalance_closed_form(m.num_routed_experts, m.num_experts_per_token, in.ep, T);
    // docs/theory.md §Communication time: the time of a step, every MoE layer doing one dispatch and one
    // combine (pre-reduced, as moekit's combine sends: docs/design.md §Decode data flow). Only the bytes that leave
    // the GPU cost link time: under uniform routing a (P − 1)/P share of the target ranks are
    // remote. Each collective pays the link latency α once. Over NVLink inside one node
    // (P <= gpus_per_node), else over the network (the slowest link decides the all-to-all).
    if (in.ep > 1) {
      const bool nvlink = in.ep <= g.gpus_per_node;
      const double bw = nvlink ? g.nvlink_bandwidth : g.network_bandwidth;
      const double alpha_s = (nvlink ? g.nvlink_latency_us : g.network_latency_us) * 1e-6;
      const double remote_bytes = (*r.dispatch_bytes_per_gpu + *r.combine_bytes_prereduced_per_gpu) * (P - 1) / P;
      r.comm_ms = m.num_moe_layers * (remote_bytes / bw + 2.0 * alpha_s) * 1e3;
    } else {
      r.comm_ms = 0.0;
    }
  }

  r.dominant = "weights";
  double largest = r.weight_read_ms;
  if (r.compute_ms > largest) r.dominant = "compute", largest = r.compute_ms;
  if (r.comm_ms && *r.comm_ms > largest) r.dominant = "communication";

  // One step advances every sequence by L tokens on average (L = 1 without MTP, so the TPOT
  // is the floor). A rejected draft costs its share of the step all the same.
  r.tpot_ms = r.floor_ms / accept_length(in);
  r.tokens_per_s_per_seq = 1e3 / r.tpot_ms;
  r.tokens_per_s = double(batch) * r.tokens_per_s_per_seq;
  return r;
}

}  // namespace

PlanResult plan(const PlanInput& in) {
  validate(in);
  const ModelSpec& m = in.model;
  const GpuSpec& g = in.gpu;
  const double bpp = m.weight_bytes_per_param;

  PlanResult res;
  res.input = in;
  res.is_moe = m.is_moe();
  res.flops = dense_flops(g, in.dtype);
  // docs/theory.md §Notation: Ridge = F/BW, FLOP per byte.
  res.ridge = res.flops / g.hbm_bandwidth;
  res.routed_weight_bytes = routed_weight_bytes(m);
  res.other_weight_bytes = m.total_params * bpp - res.routed_weight_bytes;
  const bool nvlink = in.ep <= g.gpus_per_node;
  res.comm_link = nvlink ? "nvlink" : "network";
  res.comm_bandwidth = nvlink ? g.nvlink_bandwidth : g.network_bandwidth;
  res.comm_latency_us = nvlink ? g.nvlink_latency_us : g.network_latency_us;

  res.accept_length = accept_length(in);
  res.accept_length_is_bound = !in.accept_length.has_value();
  PlanInput no_mtp = in;
  no_mtp.mtp = 0;
  no_mtp.accept_length.reset();
  for (int64_t b : in.batches) {
    res.rows.push_back(plan_row(in, b));
    res.rows_no_mtp.push_back(plan_row(no_mtp, b));
  }

  // docs/theory.md §The knee: B* ≈ Ridge·W_total·bpp / (2·N_active) tokens per step (full coverage,
  // same sharding); a sequence verifies N + 1 of them, so the knee in sequences is that / (N + 1).
  res.knee_batch = res.ridge * m.total_params * bpp / (2.0 * m.active_params) / double(tokens_per_sequence(in));
  // docs/theory.md §The operating point: the TPOT cap, the largest B whose TPOT (floor / L) meets the SLA.
  if (in.tpot_sla_ms) res.batch_sla = batch_sla(in, *in.tpot_sla_ms);
  // docs/theory.md §The operating point (KV pool ∝ B, capped by memory): what is left of P GPUs' HBM share after the
  // weights, over the KV bytes of one sequence of `context` tokens. The N drafted tokens of a
  // step are a few more KV rows per sequence, not N + 1 sequences: B_mem does not depend on N.
  res.batch_mem = (in.ep * g.hbm_bytes * in.mem_fraction - m.total_params * bpp) /
                  (m.kv_bytes_per_token * double(in.context));

  // docs/theory.md §The operating point: min(B*, B_SLA, B_max_mem); ties go to the first named.
  double op = res.knee_batch;
  res.binding = "knee";
  if (res.batch_sla && double(*res.batch_sla) < op) op = double(*res.batch_sla), res.binding = "sla";
  if (res.batch_mem < op) op = res.batch_mem, res.binding = "memory";
  res.operating_point = op <= 0 ? 0 : int64_t(std::floor(std::min(op, double(kMaxPlanBatch))));

  // docs/theory.md §Padding: a tile's intensity is 2·BM/bpp, so BM* = Ridge·bpp/2.
  res.bm_star = res.ridge * bpp / 2.0;
  if (m.is_moe()) {
    // The expert GEMM of a step sees the operating point's B·(N + 1) tokens.
    double expected_m = double(res.operating_point) * double(tokens_per_sequence(in)) * m.num_experts_per_token /
                        m.num_routed_experts;
    for (int bm : kPaddingBlockSizes) res.padding.push_back(padding_row(bm, expected_m));
    // The floors with the routed experts in each format, side by side.
    for (const char* format : kExpertFormats) {
      ExpertFormatPlan f;
      f.format = format;
      f.bytes_per_param = expert_bytes_per_param(format);
      f.routed_weight_bytes = routed_params(m) * f.bytes_per_param;
      for (int64_t b : in.batches) f.rows.push_back(plan_row_with_experts_at(in, b, f.bytes_per_param));
      res.expert_formats.push_back(std::move(f));
    }
  }
  return res;
}

}  // namespace moekit
