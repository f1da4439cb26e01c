// moekit/plan.h: the roofline planner: the model of docs/theory.md turned into numbers.
//
// Pure functions over a ModelSpec and a GpuSpec: no I/O, no GPU. `plan()` takes a deployment
// (expert-parallel degree P, a list of global decode batches B, an optional TPOT SLA, the
// context length, the memory fraction and the dtype whose dense rate F is used) and returns,
// per batch, the weight-read time, the compute time and the floor of one decode step, the
// coverage, the all-to-all bytes and the statistical load skew; and, for the deployment, the
// throughput knee B*, the SLA and memory caps, the operating point min(B*, B_SLA, B_mem) with
// the constraint that binds, the critical block size BM* and the padding waste of the expert
// GEMM. Every formula lives in src/plan/plan.cpp next to the docs/theory.md section that derives it.
//
// Units: bytes, milliseconds, FLOP/s, B/s. B is the global batch of one decode step: B
// sequences, each verifying N + 1 tokens per step, so the step carries T = B·(N + 1) tokens,
// spread evenly over P GPUs (T/P may be fractional: it is an average). Without speculative
// decoding (N = 0, the default) a sequence is one token per step and T = B.
//
// Speculative decoding (multi-token prediction, or any draft-and-verify scheme): each step
// verifies N drafted tokens plus one per sequence, and a sequence advances by the mean
// accepted length L (1 <= L <= N + 1; by default N + 1, the bound where every draft is
// accepted). The step's figures (coverage, rows per expert, weight traffic, compute,
// all-to-all bytes, floor) are those of T tokens; the time per output token is floor / L.
// The TPOT SLA applies to that TPOT, the knee is counted in sequences (the weight GEMMs' knee
// in tokens over N + 1), and the memory cap counts the KV cache of B sequences. The draft
// module's own weights and compute are not counted.
//
// Dense models (num_routed_experts == 0) have coverage 1 (every weight is read every step)
// and no expert-parallel all-to-all: the MoE-only figures are std::nullopt (null in JSON).
//
// Bad input (P < 1, P not dividing E, no batches, a batch < 1, mem_fraction outside (0, 1],
// context < 1, a non-positive SLA, N outside [0, kMaxMtp], L outside [1, N + 1], B·(N + 1)
// beyond 2^53, and P, B or context past moekit/limits.h) throws moekit::Error naming the value.
// Within those bounds and the spec's ranges (spec.h) every figure is finite.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/spec.h"

namespace moekit {

enum class ComputeDtype { fp8, bf16 };

// "fp8" | "bf16"; anything else is an Error that lists both.
ComputeDtype parse_dtype(std::string_view s);
const char* to_string(ComputeDtype d);

// "1,8,64,256" or ranges "LO..HI" that double from LO up to HI (HI included when it is not
// hit exactly), mixed freely: "1..1024,1536". The result is sorted and de-duplicated.
// Empty lists, non-integers, values < 1 are Errors naming the item.
std::vector<int64_t> parse_batch_list(std::string_view s);

// "30ms", "30" (milliseconds), "0.03s" or "30000us" -> milliseconds; must be finite and > 0.
double parse_duration_ms(std::string_view s);

struct PlanInput {
  ModelSpec model;
  GpuSpec gpu;
  int ep = 1;                          // P: expert-parallel ranks (GPUs)
  std::vector<int64_t> batches;        // global decode batches B (sequences per step)
  std::optional<double> tpot_sla_ms;   // --tpot-sla; B_SLA is computed only when set
  int64_t context = 4096;              // tokens of KV cache held per sequence
  double mem_fraction = 0.85;          // share of HBM for weights + KV (docs/theory.md §The operating point)
  ComputeDtype dtype = ComputeDtype::fp8;  // picks F: gpu.fp8_flops or gpu.bf16_flops
  int mtp = 0;                         // --mtp N: tokens drafted per sequence and step (0: plain decode)
  std::optional<double> accept_length; // --accept L: mean tokens a sequence advances per step; unset: N + 1
};

// The largest N accepted: draft-and-verify schemes verify a few tokens per sequence (tree
// drafts a few dozen); a larger N is a typo, and the cap keeps B·(N + 1) far from overflow.
inline constexpr int kMaxMtp = 64;

// L as the plan uses it: input.accept_length, or N + 1 when unset.
double accept_length(const PlanInput& input);

// One decode step at one batch. std::nullopt marks figures a dense model does not have.
struct PlanRow {
  int64_t batch = 0;                    // B, sequences
  int64_t tokens_per_step = 0;          // T = B·(N + 1), the tokens the step verifies (B without MTP)
  double tokens_per_gpu = 0;            // T/P
  double coverage = 1;                  // share of routed experts hit in the step (1 for dense)
  double step_weight_bytes_per_gpu = 0;
  double weight_read_ms = 0;
  double compute_ms = 0;
  double floor_ms = 0;                  // max(weight_read_ms, compute_ms)
  std::optional<double> comm_ms;        // dispatch + combine of all MoE layers (not in the floor)
  std::string dominant;                 // "weights" | "compute" | "communication": the largest term
  std::optional<double> expected_rows_per_expert;  // M_e = T·k/E
  std::optional<double> dedup_targets;             // distinct target ranks per token
  std::optional<double> dispatch_bytes_per_gpu;    // per MoE layer, FP8 payload
  std::optional<double> combine_bytes_per_gpu;     // per MoE layer, BF16, one message per expert
  std::optional<double> combine_bytes_prereduced_per_gpu;  // per MoE layer, BF16, one per target rank
  std::optional<double> cv_expert;                 // CV_e of one expert's load
  std::optional<double> imbalance_stat;            // S₀ from statistical fluctuation alone
  double tpot_ms = 0;                   // floor_ms / L: time per output token of one sequence
  double tokens_per_s_per_seq = 0;      // 1000 / tpot_ms
  double tokens_per_s = 0;              // B · tokens_per_s_per_seq, the whole deployment
};

// Bytes per routed-expert parameter of an expert weight format (spec.h's expert_format), values
// and scales together:
//   "fp8":   1 B per e4m3 value plus one fp32 scale per 128x128 block: 1 + 4/16384 = 1.000244 B;
//   "mxfp4": 4 bits per e2m1 value plus one e8m0 byte per 32 values: 4.25 bits = 0.53125 B.
// Any other name is an Error listing both.
double expert_bytes_per_param(std::string_view format);
inline constexpr const char* kExpertFormats[] = {"fp8", "mxfp4"};

// The same deployment with the routed experts stored in one format: what the format changes.
struct ExpertFormatPlan {
  std::string format;               // "fp8" | "mxfp4"
  double bytes_per_param = 0;       // expert_bytes_per_param(format)
  double routed_weight_bytes = 0;   // num_moe_layers·E·3·d·moe_intermediate_size·bytes_per_param
  // One per input batch: the plan's rows with the routed experts at this format's bytes and every
  // other weight at the spec's weight_bytes_per_param. Only the weight traffic and what follows
  // from it (weight_read_ms, floor_ms, dominant, tpot_ms, tokens/s) differ from the plan's rows.
  std::vector<PlanRow> rows;
};

// Padding waste of the expert GEMM for one block size BM (docs/theory.md §Padding).
struct PaddingRow {
  int bm = 0;
  double expected_m = 0;                  // M_e at the operating point
  std::optional<double> waste_expected;   // ⌈M_e/BM⌉·BM/M_e at the expected M_e (null when M_e = 0)
  double waste_m5 = 0;                    // the same at M_e = 5
  std::optional<double> waste_pad_to_m_max;  // ⌈M_max/BM⌉·BM/M_e, M_max = 64 (null when M_e > M_max or 0)
  double waste_pad_to_m_max_m5 = 0;       // the same at M_e = 5
  // E[⌈X/BM⌉ | X ≥ 1], X ~ Poisson(M_e): token blocks of a hit expert, i.e. how many times a
  // masked GEMM streams its weights when BM = M_e is planned for (null when M_e = 0).
  std::optional<double> weight_reads_expected;
};

struct PlanResult {
  PlanInput input;
  bool is_moe = false;
  double flops = 0;            // F, dense FLOP/s for the dtype
  double ridge = 0;            // F / HBM bandwidth, FLOP per byte
  double routed_weight_bytes = 0;
  double other_weight_bytes = 0;
  std::string comm_link;       // "nvlink" (P <= gpus_per_node) or "network"
  double comm_bandwidth = 0;   // B/s per GPU, one direction
  double comm_latency_us = 0;
  double accept_length = 1;    // L (N + 1 when not given)
  bool accept_length_is_bound = true;  // L was not given: N + 1, every draft accepted
  double knee_batch = 0;       // B*, sequences: the weight GEMMs' knee in tokens over N + 1
  std::optional<int64_t> batch_sla;  // largest B with tpot_ms <= SLA (0: none meets it)
  double batch_mem = 0;        // may be <= 0 when the weights alone do not fit
  int64_t operating_point = 0; // ⌊min(B*, B_SLA, B_mem)⌋, at least 0
  std::string binding;         // "knee" | "sla" | "memory"
  double bm_star = 0;          // Ridge·bpp/2
  std::vector<PaddingRow> padding;  // empty for dense models
  std::vector<PlanRow> rows;        // one per input batch, in input order
  std::vector<PlanRow> rows_no_mtp; // the same batches decoded without MTP (N = 0, L = 1);
                                    // equal to rows when N = 0
  // MoE models: the rows with the routed experts in FP8, then in MXFP4 (kExpertFormats order), so
  // that the two floors can be set side by side; empty for dense models. The figures above use the
  // spec's weight_bytes_per_param for every weight, as before.
  std::vector<ExpertFormatPlan> expert_formats;
};

// The fixed constants of the padding table (docs/theory.md §Padding).
inline constexpr int kPaddingBlockSizes[] = {8, 16, 32, 64, 128};
inline constexpr int kPaddingMMax = 64;
inline constexpr double kPaddingSmallM = 5;

PlanResult plan(const PlanInput& input);

// One row without validation of the list, for callers that sweep B (the plot, B_SLA).
// `input` must have passed plan()'s checks, and batch·(N + 1) must fit in int64.
PlanRow plan_row(const PlanInput& input, int64_t batch);

// docs/theory.md §EPLB gain: end-to-end 1 / (f/S + 1 − f); f in [0, 1], S > 0.
double eplb_gain(double f, double speedup);

// Closed forms shared with the simulator, k ≤ E, P ≥ 1, B ≥ 1. Derived in
// docs/theory.md §Coverage, §All-to-all bytes and §Statistical skew.
double coverage_closed_form(int num_experts, int topk, double batch);  // 1 − (1 − k/E)^B
double dedup_targets_closed_form(int num_ranks, int topk);             // P·[1 − (1 − 1/P)^k]
double cv_expert_closed_form(int num_experts, int topk, double batch); // sqrt((1 − k/E)/(B·k/E))
double imbalance_closed_form(int num_experts, int topk, int num_ranks, double batch);  // 1 + sqrt(2 ln P)·CV_e/sqrt(E/P)

// docs/theory.md §Padding: E[⌈X/BM⌉ | X ≥ 1] for X ~ Poisson(mean), the token blocks of BM rows an
// expert that gets rows needs when its rows are Poisson around `mean` (uniform routing). BM in
// [1, kMaxTokenBlock] (which bounds the sum to a few million terms), mean finite and > 0; throws
// moekit::Error naming the value otherwise.
inline constexpr int kMaxTokenBlock = 1 << 16;
double expected_token_blocks(int bm, double mean);

// The result as JSON (keys as in the issue: rows[], knee_batch, batch_mem, ...).
std::string plan_to_json(const PlanResult& result);

}  // namespace moekit
