// bench_gemm_mxfp4: the MXFP4 grouped GEMM beside moekit's FP8 kernel on the same shapes, and
// beside the copy bandwidth measured in the same run.
//   masked (decode): both expert GEMMs of a layer back to back (GEMM1 [2·inter, hidden], GEMM2
//     [hidden, inter]) for 8 DeepSeek-V3 experts (hidden 7168, inter 2048) and for 8 and 32
//     gpt-oss-120b experts (hidden and inter 2880, padded to 2944 as the loader does), masked_m
//     all 5 / all 16 / random 1..16 / all 44 / binomial around 32 (one rank of gpt-oss-120b at
//     B = 1024: 4096 rows over 128 experts) / all 64. Figures: time of the pair per format, the ratio
//     MXFP4 / FP8 (target <= 0.55), and the MXFP4 bytes read (codes + scales of the experts with
//     tokens) over the time, in TB/s and as a fraction of copy; then the MXFP4 pair again with one
//     activation scale per row (MaskedGemmProblem::a_row_scales, "us row") and its ratio to FP8.
//   contiguous (prefill): 8 experts of the GEMM1 shape (N 4096, K 7168), 512 / 2048 / 8192 rows
//     each, and gpt-oss-120b's GEMM1 over its 128 experts (N 5760, K 2944) at 64 / 256 / 1024 rows
//     each: TFLOP/s of each format and the ratio (target >= 0.9); MXFP4 three ways: 64- and 128-token
//     tiles of the MXFP4 kernel, and the FP8 copy (GemmConfig::mxfp4_fp8_copy: the weights widened
//     once per run, then the FP8 kernel; its time is both kernels'), made first and made beside the
//     GEMM on C SMs (GemmConfig::mxfp4_fp8_copy_ctas; --beside-ctas C1,C2,...: one row each, 0 = the
//     heuristic's count; default 0); and the register kernel again with one activation scale per row
//     (ContiguousGemmProblem::a_row_scales: no block partial to promote), 64- and 128-token tiles.
// Times are medians of per-iteration CUDA events over two rotating input sets (more than the L2
// holds). Usage: bench_gemm_mxfp4 [--json PATH] [--quick] [--mx-stages N] [--mx-block-m M]
// [--mx-widen registers|smem|smem2] [--mx-rows 0|128|256] [--mx-splits N] [--masked-only] [--contiguous-only] [--only-oss] [--beside-ctas LIST] (study knobs, 0 = the heuristic's: N the MXFP4
// masked plans' ring depth, M the token block of their tiles above 32 rows; --mx-widen: every MXFP4
// plan widening in registers, or with one or two widening warpgroups (GemmConfig::mxfp4_widen_wgs;
// smem2 for the masked plans of up to 64 tokens, the others take smem); --masked-only skips the
// contiguous part, --contiguous-only the masked part, --only-oss all but its gpt-oss-120b rows; --trace FILE [--trace-fp8] [--trace-oss] [--trace-gemm2] [--trace-rows R] [--trace-experts E]: only CTA 0's stage trace
// of one GEMM1, trace_gemm1 below, in a build configured with -DMOEKIT_STAGE_TRACE=ON)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "gemm_bench.cuh"
#include "moekit/cuda_check.h"
#include "moekit/gemm.h"
#include "moekit/mxfp4.h"
#include "moekit/reference.h"

using namespace moekit;
using nlohmann::json;
using namespace moekit::gemm_bench;

namespace {

__global__ void fix_scale_words(uint32_t* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = p[i];
    uint32_t w = 124u | (1u << kGemmScaleFastBit);
    for (int g = 0; g < 4; ++g) w |= (((h >> (8 * g)) % 7u) + kGemmShiftBias) << (kGemmShiftFirstBit + 5 * g);
    p[i] = w;
  }
}

// One GEMM's device buffers in either format (weights, activations, scales, output).
struct Gemm {
  int e, n, k, rows;  // rows: M_max (masked) or M_total (contiguous)
  bool mx;
  uint8_t *a, *w;
  uint32_t* w8m0 = nullptr;
  float *as, *ws = nullptr;
  uint16_t* out;
  Gemm(int e_, int n_, int k_, int rows_, bool mx_, uint32_t seed) : e(e_), n(n_), k(k_), rows(rows_), mx(mx_) {
    a = device_alloc<uint8_t>(size_t(e) * rows * k);
    as = device_alloc<float>(size_t(e) * (k / 128) * rows);
    out = device_alloc<uint16_t>(size_t(e) * rows * n);
    fill_fp8(a, size_t(e) * rows * k, seed);
    fill_scales(as, size_t(e) * (k / 128) * rows, seed + 1);
    if (mx) {
      w = device_alloc<uint8_t>(size_t(e) * n * k / 2);
      w8m0 = device_alloc<uint32_t>(size_t(e) * n * k / 128);
      fill_bytes(w, size_t(e) * n * k / 2, seed + 2);
      // Scale words as mxfp4_scales_for_gemm writes them for scale bytes 118..124: the largest
      // byte, four shift fields, the fast flag (the bench draws shifts in [0, 6]).
      fill_bytes(reinterpret_cast<uint8_t*>(w8m0), size_t(e) * n * k / 32, seed + 3);
      fix_scale_words<<<1024, 256>>>(w8m0, size_t(e) * n * k / 128);
      MOEKIT_CUDA_CHECK_LAUNCH();
    } else {
      w = device_alloc<uint8_t>(size_t(e) * n * k);
      ws = device_alloc<float>(size_t(e) * (n / 128) * (k / 128));
      fill_fp8(w, size_t(e) * n * k, seed + 2);
      fill_scales(ws, size_t(e) * (n / 128) * (k / 128), seed + 3);
    }
  }
  ~Gemm() {
    for (void* p : {(void*)a, (void*)w, (void*)w8m0, (void*)as, (void*)ws, (void*)out}) cudaFree(p);
  }
};

// --mx-stages: the ring depth of the MXFP4 masked plans with tiles of <= 32 tokens (0: the
// heuristic's; larger tiles fit fewer stages and keep theirs).
int g_mx_stages = 0;
// --mx-block-m: the token block of the MXFP4 masked plans the heuristic gives more than 32 tokens
// (0: the heuristic's), to compare 48- and 64-token tiles on the same rows in one process.
int g_mx_block_m = 0;
// --mx-widen: -1 the heuristic's, else GemmConfig::mxfp4_widen_wgs (0 registers, 1 or 2 widening
// warpgroups, gemm_mxfp4_widen.cuh).
int g_mx_widen = -1;
std::vector<int> g_beside_ctas = {0};
// --mx-rows: weight rows per tile of the MXFP4 masked plans of 16, 32 or 48 tokens: 0 the heuristic's, 128, or
// 256 (two 128-row slabs a stage; GemmConfig::block_n).
int g_mx_rows = 0;
// --mx-splits: split-K ways of every MXFP4 masked plan (at most its K blocks; 0 the heuristic's), to
// read what a last round of tiles that fills few SMs costs (docs/gemm-mxfp4.md run 37).
int g_mx_splits = 0;

// row_scales: MaskedGemmProblem::a_row_scales (MXFP4; the kernel reads each row's first slot of the
// random 1x128 scales, which costs the same as a per-token quantisation's).
std::unique_ptr<MaskedGemm> masked_plan(const Gemm& g, const int32_t* m, int expected, bool row_scales = false) {
  MaskedGemmProblem p{g.e, g.n, g.k, g.rows, expected};
  p.weights = g.mx ? WeightFormat::kMxfp4 : WeightFormat::kFp8;
  p.a_row_scales = row_scales;
  MaskedGemmBuffers b;
  b.a = g.a;
  b.a_scales = g.as;
  b.w = g.w;
  b.w_scales = g.ws;
  b.w_mx_scales = g.w8m0;
  b.masked_m = m;
  b.out = g.out;
  GemmConfig c = choose_masked_config(p, 132);
  const bool stages = g.mx && g_mx_stages > 0 && c.block_m <= 32;  // the decode tiles (larger ones fit fewer)
  const bool block = g.mx && g_mx_block_m > 0 && c.block_m > 32 && c.block_m < 128;
  const bool widen = g.mx && g_mx_widen >= 0;
  const bool splits = g.mx && g_mx_splits > 0;
  const bool rows =
      g.mx && g_mx_rows > 0 && c.block_m <= 48 && c.mxfp4_widen_wgs == 0;
  if (stages || block || widen || rows || splits) {
    if (rows) c.block_n = g_mx_rows, c.num_stages = 0;  // the ring depth follows the stage's size
    if (stages) c.num_stages = g_mx_stages;
    if (block) c.block_m = g_mx_block_m, c.num_stages = 0;  // the ring depth follows the tile (split-K stays)
    if (widen) c.mxfp4_widen_wgs = c.block_m <= 64 ? g_mx_widen : std::min(g_mx_widen, 1);
    if (splits) c.num_splits = std::min(g_mx_splits, g.k / 128);
    c.num_ctas = 0;
    return std::make_unique<MaskedGemm>(p, b, &c);
  }
  return std::make_unique<MaskedGemm>(p, b);
}

struct Shape {
  const char* name;
  int experts, hidden, inter;
};

// The pair GEMM1 + GEMM2 of `shape` in one format, two rotating sets; returns the median us.
double time_pair(const Shape& s, bool mx, const std::vector<int32_t>& mm, int iters, std::string& config,
                 bool row_scales = false) {
  const int max_m = 128, expected = *std::max_element(mm.begin(), mm.end());
  int32_t* m = device_alloc<int32_t>(mm.size());
  MOEKIT_CUDA_CHECK(cudaMemcpy(m, mm.data(), mm.size() * 4, cudaMemcpyHostToDevice));
  std::vector<std::unique_ptr<Gemm>> g;
  std::vector<std::unique_ptr<MaskedGemm>> plans;
  for (int set = 0; set < 2; ++set) {
    g.push_back(std::make_unique<Gemm>(s.experts, 2 * s.inter, s.hidden, max_m, mx, 100 * set + 1));
    g.push_back(std::make_unique<Gemm>(s.experts, s.hidden, s.inter, max_m, mx, 100 * set + 51));
    plans.push_back(masked_plan(*g[2 * set], m, expected, row_scales));
    plans.push_back(masked_plan(*g[2 * set + 1], m, expected, row_scales));
  }
  config = plans[0]->config().to_string();
  const double us = median_us(iters, [&](int i) {
    plans[2 * (i % 2)]->run(nullptr);
    plans[2 * (i % 2) + 1]->run(nullptr);
  });
  MOEKIT_CUDA_CHECK(cudaGetLastError());
  cudaFree(m);
  return us;
}

json run_masked(const Shape& s, const std::string& name, const std::vector<int32_t>& mm, double copy_tbps, int iters) {
  std::string cfg8, cfg4, cfg4r;
  const double us8 = time_pair(s, false, mm, iters, cfg8), us4 = time_pair(s, true, mm, iters, cfg4);
  const double us4r = time_pair(s, true, mm, iters, cfg4r, true);
  int hit = 0;
  for (int x : mm) hit += x > 0;
  const double params = double(hit) * 3.0 * s.hidden * s.inter;  // both GEMMs of the experts with tokens
  const double mx_bytes = params * (0.5 + 1.0 / 32), fp8_bytes = params * (1.0 + 4.0 / 16384);
  json r{{"shape", s.name}, {"experts", s.experts}, {"case", name}, {"masked_m", mm}, {"us_fp8", us8},
         {"us_mxfp4", us4}, {"ratio", us4 / us8}, {"mxfp4_TBps", mx_bytes / (us4 * 1e-6) / 1e12},
         {"fp8_TBps", fp8_bytes / (us8 * 1e-6) / 1e12}, {"config_fp8", cfg8}, {"config_mxfp4", cfg4},
         {"us_mxfp4_row_scales", us4r}, {"ratio_row_scales", us4r / us8}};
  r["mxfp4_fraction_of_copy"] = r["mxfp4_TBps"].get<double>() / copy_tbps;
  std::printf("%-22s %-11s %9.1f %9.1f %7.3f %9.3f %7.1f%% %9.3f %9.1f %7.3f   %s\n", (std::string(s.name) + " x" +
              std::to_string(s.experts)).c_str(), name.c_str(), us8, us4, us4 / us8, r["mxfp4_TBps"].get<double>(),
              100 * r["mxfp4_fraction_of_copy"].get<double>(), r["fp8_TBps"].get<double>(), us4r, us4r / us8,
              cfg4.c_str());
  return r;
}

// fp8_copy: the MXFP4 weights widened into an FP8 copy per run, then the FP8 kernel
// (GemmConfig::mxfp4_fp8_copy); the time is both kernels'. beside_ctas >= 0 (with fp8_copy): the copy
// beside the GEMM on that many SMs (0: the heuristic's count).
double time_contiguous(bool mx, int experts, int rows_per_expert, int n, int k, int iters, std::string& config,
                       int block_m = 0, bool fp8_copy = false, int beside_ctas = -1, bool row_scales = false) {
  // The contiguous layout: each expert's rows padded to kContiguousAlign (row_expert -1), so that no
  // block of the GEMM's rows spans two experts (gemm.h). The padding is multiplied like any row;
  // the TFLOP/s count real rows only.
  const int segment = (rows_per_expert + kContiguousAlign - 1) / kContiguousAlign * kContiguousAlign;
  const int total = experts * segment;
  std::vector<int32_t> re(total);
  for (int i = 0; i < total; ++i) re[i] = i % segment < rows_per_expert ? i / segment : -1;
  ref::check_contiguous_segments(re.data(), total, kContiguousAlign, experts);  // the layout the kernels assume
  int32_t* d_re = device_alloc<int32_t>(total);
  MOEKIT_CUDA_CHECK(cudaMemcpy(d_re, re.data(), total * 4, cudaMemcpyHostToDevice));
  Gemm g(1, n, k, total, false, 7);  // activations and output (one "expert" of M_total rows)
  Gemm w(experts, n, k, 4, mx, 9);   // the weights
  ContiguousGemmProblem p{experts, n, k, total};
  p.weights = mx ? WeightFormat::kMxfp4 : WeightFormat::kFp8;
  p.a_row_scales = row_scales;  // (g.as holds K/128 rows of M_total scales; the first serves)
  ContiguousGemmBuffers b;
  b.a = g.a;
  b.a_scales = g.as;
  b.row_expert = d_re;
  b.w = w.w;
  b.w_scales = w.ws;
  b.w_mx_scales = w.w8m0;
  b.out = g.out;
  GemmConfig forced = fp8_copy ? choose_mxfp4_fp8_copy_config(p, 132) : choose_contiguous_config(p, 132);
  if (block_m > 0) forced.block_m = block_m;
  if (mx && !fp8_copy && g_mx_widen >= 0) forced.mxfp4_widen_wgs = std::min(g_mx_widen, 1);  // (two: masked only)
  forced.num_ctas = 0;
  if (fp8_copy && beside_ctas >= 0) {
    int dev = 0, sms = 0;
    MOEKIT_CUDA_CHECK(cudaGetDevice(&dev));
    MOEKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    forced = choose_mxfp4_fp8_copy_beside_config(p, sms, beside_ctas);
  }
  ContiguousGemm plan(p, b, &forced);
  config = plan.config().to_string();
  const double us = median_us(iters, [&](int) { plan.run(nullptr); });
  cudaFree(d_re);
  return us;
}

// One contiguous row count: the FP8 kernel, the MXFP4 kernel in 64- and 128-token tiles, and the
// FP8 copy, with what the copy adds over the FP8 kernel against the bytes it moves (codes, scale
// words, e4m3 written).
json run_contiguous(const char* shape, int experts, int n, int k, int rows, bool quick) {
  const int iters = quick ? 5 : 10;
  std::string c8, c4, c4b, cc;
  const double us8 = time_contiguous(false, experts, rows, n, k, iters, c8);
  const double us4 = time_contiguous(true, experts, rows, n, k, iters, c4);
  const double us4b = time_contiguous(true, experts, rows, n, k, iters, c4b, 64);
  const double usc = time_contiguous(true, experts, rows, n, k, iters, cc, 0, true);
  const double flops = 2.0 * experts * rows * double(n) * k;
  const auto tf = [&](double us) { return flops / (us * 1e-6) / 1e12; };
  const double tf8 = tf(us8);
  const std::string label = std::string(shape) + ", " + std::to_string(rows);
  std::printf("%-40s %10s %10.1f %9s %9.1f %7.3f   %s\n", label.c_str(), "", us4b, "", tf(us4b), tf(us4b) / tf8,
              c4b.c_str());
  std::printf("%-40s %10.1f %10.1f %9.1f %9.1f %7.3f   %s\n", label.c_str(), us8, us4, tf8, tf(us4), tf(us4) / tf8,
              c4.c_str());
  const double weights = double(experts) * n * k, copy_bytes = weights / 2 + weights / 128 * 4 + weights;
  const double copy_us = usc - us8;
  std::printf("%-40s %10s %10.1f %9s %9.1f %7.3f   %s (over fp8: %.1f us, %.2f TB/s of copy bytes)\n", label.c_str(),
              "", usc, "", tf(usc), tf(usc) / tf8, cc.c_str(), copy_us, copy_bytes / (copy_us * 1e-6) / 1e12);
  std::string cr, crb;
  const double usr = time_contiguous(true, experts, rows, n, k, iters, cr, 0, false, -1, true);
  const double usrb = time_contiguous(true, experts, rows, n, k, iters, crb, 64, false, -1, true);
  for (const auto& [us, cfg] : {std::pair{usrb, crb}, std::pair{usr, cr}})
    std::printf("%-40s %10s %10.1f %9s %9.1f %7.3f   %s (row scales)\n", label.c_str(), "", us, "", tf(us), tf(us) / tf8,
                cfg.c_str());
  json beside = json::array();
  for (int ctas : g_beside_ctas) {
    std::string cb;
    const double usb = time_contiguous(true, experts, rows, n, k, iters, cb, 0, true, ctas);
    std::printf("%-40s %10s %10.1f %9s %9.1f %7.3f   %s (beside: %.0f%% of the copy-first time)\n", label.c_str(), "",
                usb, "", tf(usb), tf(usb) / tf8, cb.c_str(), 100 * usb / usc);
    beside.push_back({{"ctas_asked", ctas}, {"us", usb}, {"ratio", tf(usb) / tf8}, {"config", cb}});
  }
  return json{{"shape", shape},         {"experts", experts},          {"n", n}, {"beside", beside},
              {"k", k},                 {"rows_per_expert", rows},     {"us_fp8", us8},
              {"us_mxfp4", us4},        {"us_mxfp4_64", us4b},         {"TFLOPs_fp8", tf8},
              {"TFLOPs_mxfp4", tf(us4)}, {"ratio", tf(us4) / tf8},     {"ratio_64", tf(us4b) / tf8},
              {"config_fp8", c8},       {"config_mxfp4", c4},          {"us_mxfp4_copy", usc},
              {"TFLOPs_mxfp4_copy", tf(usc)}, {"ratio_copy", tf(usc) / tf8}, {"copy_over_fp8_us", copy_us},
              {"config_mxfp4_copy", cc}, {"us_mxfp4_rows", usr}, {"us_mxfp4_rows_64", usrb},
              {"ratio_rows", tf(usr) / tf8}, {"ratio_rows_64", tf(usrb) / tf8}, {"config_mxfp4_rows", cr}};
}

// --trace FILE: one GEMM1 (MXFP4, or FP8 with --trace-fp8) of DeepSeek-V3 x 8 (or gpt-oss-120b x 32
// with --trace-oss) at `rows` rows per expert (--trace-rows, default 16; the heuristic's plan), CTA
// 0's stage trace (MaskedGemm::set_stage_trace) after two warm-up runs, as CSV (SM cycles from its
// first event), and the medians of: the stage period at the first math warp; how long that warp
// waited for the stage; from the wait's end to its wgmmas' commit (the widening, MXFP4) and to its
// hand-back; from that hand-back to the producer's next copy into the same ring slot; from the
// copies' issue to the warp's use; and how many stages were issued ahead of the one waited for.
// experts > 0 (--trace-experts) replaces the shape's expert count: with one or two experts the
// weights stay in the L2 across the warm-up runs (a DeepSeek-V3 GEMM1 expert is 15.6 MB in MXFP4,
// 29 MB in FP8), so the trace shows what a stage costs the kernel when HBM is not in the way.
// gemm2 (--trace-gemm2): the shape's GEMM2 instead (N hidden, K inter).
void trace_gemm1(const std::string& path, bool mx, bool oss, int rows, int experts, bool gemm2) {
  Shape s = oss ? Shape{"gpt-oss-120b", 32, 2944, 2944} : Shape{"deepseek-v3", 8, 7168, 2048};
  if (experts > 0) s.experts = experts;
  const std::vector<int32_t> mm(s.experts, rows);
  int32_t* m = device_alloc<int32_t>(mm.size());
  MOEKIT_CUDA_CHECK(cudaMemcpy(m, mm.data(), mm.size() * 4, cudaMemcpyHostToDevice));
  Gemm g(s.experts, gemm2 ? s.hidden : 2 * s.inter, gemm2 ? s.inter : s.hidden, 128, mx, 1);
  auto plan = masked_plan(g, m, rows);
  constexpr int kN = kStageTraceWords;
  long long* d = device_alloc<long long>(kN);
  plan->run(nullptr);
  plan->run(nullptr);
  MOEKIT_CUDA_CHECK(cudaMemset(d, 0, kN * sizeof(long long)));
  plan->set_stage_trace(d);
  plan->run(nullptr);
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<long long> t(kN);
  MOEKIT_CUDA_CHECK(cudaMemcpy(t.data(), d, kN * sizeof(long long), cudaMemcpyDeviceToHost));
  cudaFree(d);
  cudaFree(m);
  auto ev = [&](int i, int k) { return t[size_t(i) * kStageTraceEvents + k]; };
  int n = 0;  // stages with every event recorded
  while (n < kStageTraceStages && ev(n, kStageTraceWaitEnd) != 0 && ev(n, kStageTraceWeightsIssued) != 0 &&
         ev(n, kStageTraceReleased) != 0)
    ++n;
  long long t0 = n > 0 ? ev(0, 0) : 0;
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < kStageTraceEvents; ++k) t0 = std::min(t0, ev(i, k));
  std::string csv = "stage,weights_issued,activations_issued,wait_begin,wait_end,mma_committed,released\n";
  std::vector<double> waited, latency, period, issued_ahead, widen, held, refill;
  const int stages = plan->config().num_stages;
  for (int i = 0; i < n; ++i) {
    csv += std::to_string(i);
    for (int k = 0; k < kStageTraceEvents; ++k) csv += "," + std::to_string(ev(i, k) - t0);
    csv += "\n";
    const long long issued = std::max(ev(i, kStageTraceWeightsIssued), ev(i, kStageTraceActivationsIssued));
    waited.push_back(double(ev(i, kStageTraceWaitEnd) - ev(i, kStageTraceWaitBegin)));
    latency.push_back(double(ev(i, kStageTraceWaitEnd) - issued));
    widen.push_back(double(ev(i, kStageTraceMmaIssued) - ev(i, kStageTraceWaitEnd)));
    held.push_back(double(ev(i, kStageTraceReleased) - ev(i, kStageTraceWaitEnd)));
    if (i + stages < n) refill.push_back(double(ev(i + stages, kStageTraceWeightsIssued) - ev(i, kStageTraceReleased)));
    if (i > 0) period.push_back(double(ev(i, kStageTraceWaitEnd) - ev(i - 1, kStageTraceWaitEnd)));
    int k = i;  // stages whose weights were issued before this one's wait began
    while (k + 1 < n && ev(k + 1, kStageTraceWeightsIssued) <= ev(i, kStageTraceWaitBegin)) ++k;
    issued_ahead.push_back(double(k - i));
  }
  write_text_file(path, csv);
  using bench::median;
  // Every CTA's global-timer stamps (ns, one clock for all SMs): entry, first tile, last tile's end,
  // from the earliest entry.
  std::vector<double> entry, begin, end;
  long long first = 0;
  const int ctas = std::min(plan->config().num_ctas, kStageTraceCtas);
  auto cta = [&](int c, int k) { return t[kStageTraceCtaBase + size_t(c) * kStageTraceCtaEvents + k]; };
  for (int c = 0; c < ctas; ++c)
    if (cta(c, kStageTraceCtaEntry) != 0 && (first == 0 || cta(c, kStageTraceCtaEntry) < first)) first = cta(c, kStageTraceCtaEntry);
  for (int c = 0; c < ctas; ++c) {
    if (cta(c, kStageTraceCtaEntry) == 0 || cta(c, kStageTraceCtaEnd) == 0) continue;
    entry.push_back((cta(c, kStageTraceCtaEntry) - first) * 1e-3);
    begin.push_back((cta(c, kStageTraceCtaBegin) - first) * 1e-3);
    end.push_back((cta(c, kStageTraceCtaEnd) - first) * 1e-3);
  }
  auto range = [](const std::vector<double>& v) {
    if (v.empty()) return std::string("-");
    char b[96];
    std::snprintf(b, sizeof b, "%.1f / %.1f / %.1f", *std::min_element(v.begin(), v.end()), median(v),
                  *std::max_element(v.begin(), v.end()));
    return std::string(b);
  };
  std::printf("\nCTAs (%zu), us from the first entry, min / median / max: entry %s; first tile %s; last tile's end %s;"
              " CTA 0's first tile %.1f, end %.1f\n",
              entry.size(), range(entry).c_str(), range(begin).c_str(), range(end).c_str(),
              entry.empty() ? 0.0 : (cta(0, kStageTraceCtaBegin) - first) * 1e-3,
              entry.empty() ? 0.0 : (cta(0, kStageTraceCtaEnd) - first) * 1e-3);
  // CTA 0's whole span per stage (first wait's end to last hand-back), per 128 weight rows: steadier
  // than the median period over a few dozen stages, and it counts the tile boundaries (run 36).
  const int slabs = std::max(1, plan->config().block_n / 128);
  const double span = n > 1 ? double(ev(n - 1, kStageTraceReleased) - ev(0, kStageTraceWaitEnd)) / (n - 1) / slabs : 0;
  std::printf("\nstage trace, %s GEMM%d of %s x%d at %d rows, CTA 0, %d stages (%s), SM cycles, medians:\n"
              "  period %.0f; first math warp waiting %.0f, wait end -> wgmmas committed %.0f, -> handed back %.0f;"
              " hand-back -> refill issued %.0f; issue -> use %.0f; stages issued ahead of the one waited for %.0f\n"
              "  CTA 0's span per stage and 128 weight rows %.0f\n"
              "  wrote %s\n",
              mx ? "MXFP4" : "FP8", gemm2 ? 2 : 1, s.name, s.experts, rows, n, plan->config().to_string().c_str(), median(period),
              median(waited), median(widen), median(held), median(refill), median(latency), median(issued_ahead), span,
              path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  std::string trace_path;
  bool trace_fp8 = false, trace_oss = false, trace_gemm2 = false;
  int trace_rows = 16, trace_experts = 0;
  bool quick = false, masked_only = false, contiguous_only = false, only_oss = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--mx-stages") && i + 1 < argc) g_mx_stages = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--mx-block-m") && i + 1 < argc) g_mx_block_m = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--mx-widen") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v != "registers" && v != "smem" && v != "smem2") {
        std::fprintf(stderr, "bench_gemm_mxfp4: --mx-widen %s; expected registers, smem or smem2\n", v.c_str());
        return 2;
      }
      g_mx_widen = v == "smem" ? 1 : v == "smem2" ? 2 : 0;
    }
    else if (!std::strcmp(argv[i], "--mx-rows") && i + 1 < argc) {
      g_mx_rows = std::atoi(argv[++i]);
      if (g_mx_rows != 0 && g_mx_rows != 128 && g_mx_rows != 256) {
        std::fprintf(stderr, "bench_gemm_mxfp4: --mx-rows %s; expected 0, 128 or 256\n", argv[i]);
        return 2;
      }
    }
    else if (!std::strcmp(argv[i], "--mx-splits") && i + 1 < argc) {
      g_mx_splits = std::atoi(argv[++i]);
      if (g_mx_splits < 0 || g_mx_splits > 16) {
        std::fprintf(stderr, "bench_gemm_mxfp4: --mx-splits %s; expected 0..16\n", argv[i]);
        return 2;
      }
    }
    else if (!std::strcmp(argv[i], "--masked-only")) masked_only = true;
    else if (!std::strcmp(argv[i], "--contiguous-only")) contiguous_only = true;
    else if (!std::strcmp(argv[i], "--only-oss")) only_oss = true;
    else if (!std::strcmp(argv[i], "--beside-ctas") && i + 1 < argc) {
      g_beside_ctas.clear();
      std::stringstream list(argv[++i]);
      for (std::string v; std::getline(list, v, ',');) {
        if (v.empty() || v.size() > 6 || v.find_first_not_of("0123456789") != std::string::npos) {
          std::fprintf(stderr, "bench_gemm_mxfp4: --beside-ctas value '%s'; expected 0 .. the device's SMs - 1\n",
                       v.c_str());
          return 2;
        }
        g_beside_ctas.push_back(std::atoi(v.c_str()));
      }
    }
    else if (!std::strcmp(argv[i], "--trace") && i + 1 < argc) trace_path = argv[++i];
    else if (!std::strcmp(argv[i], "--trace-fp8")) trace_fp8 = true;
    else if (!std::strcmp(argv[i], "--trace-oss")) trace_oss = true;
    else if (!std::strcmp(argv[i], "--trace-gemm2")) trace_gemm2 = true;
    else if (!std::strcmp(argv[i], "--trace-rows") && i + 1 < argc) trace_rows = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--trace-experts") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v.empty() || v.size() > 3 || v.find_first_not_of("0123456789") != std::string::npos || std::stoi(v) > 128) {
        std::fprintf(stderr, "bench_gemm_mxfp4: --trace-experts '%s'; expected 0 (the shape's) .. 128\n", v.c_str());
        return 2;
      }
      trace_experts = std::stoi(v);
    }
    else {
      std::fprintf(stderr, "usage: bench_gemm_mxfp4 [--json PATH] [--quick] [--mx-stages N] [--mx-block-m M] "
                           "[--mx-widen registers|smem|smem2] [--mx-rows 0|128|256] [--mx-splits N] [--masked-only] [--contiguous-only] [--only-oss] [--beside-ctas LIST] [--trace FILE [--trace-fp8] [--trace-oss] [--trace-gemm2] [--trace-rows R] [--trace-experts E]]\n");
      return 2;
    }
  }
  try {
    if (!trace_path.empty()) {  // the stage trace alone
      MOEKIT_CHECK(trace_rows >= 1 && trace_rows <= 128,
                   "bench_gemm_mxfp4: --trace-rows " + std::to_string(trace_rows) + ", expected 1..128");
      trace_gemm1(trace_path, !trace_fp8, trace_oss, trace_rows, trace_experts, trace_gemm2);
      return 0;
    }
    const int sms = query_device().num_sms;  // the copy beside the GEMM leaves the GEMM at least one SM
    for (int c : g_beside_ctas)
      MOEKIT_CHECK(c < sms, "bench_gemm_mxfp4: --beside-ctas " + std::to_string(c) + ", expected 0.." +
                                std::to_string(sms - 1) + " on this device");
    json out;
    const double copy = bench::measure_copy_bandwidth() / 1e12;
    out["copy_TBps"] = copy;
    std::printf("copy bandwidth %.3f TB/s (read + write)\n", copy);
    const int iters = quick ? 10 : 30;
    if (!contiguous_only)
      std::printf("\nmasked, GEMM1 + GEMM2 back to back, M_max 128\n%-22s %-11s %9s %9s %7s %9s %8s %9s %9s %7s   %s\n",
                  "shape", "masked_m", "us fp8", "us mxfp4", "ratio", "mx TB/s", "%copy", "fp8 TB/s", "us row",
                  "ratio", "config (mxfp4 gemm1)");
    std::mt19937 rng(2026);
    std::uniform_int_distribution<int> d16(1, 16);
    for (const Shape& s : {Shape{"deepseek-v3", 8, 7168, 2048}, Shape{"gpt-oss-120b", 8, 2944, 2944},
                           Shape{"gpt-oss-120b", 32, 2944, 2944}}) {
      if (contiguous_only) break;
      std::vector<int32_t> rnd(s.experts), binom(s.experts);
      for (auto& x : rnd) x = d16(rng);
      std::binomial_distribution<int> b32(4096, 1.0 / 128);
      for (auto& x : binom) x = std::min(b32(rng), 48);  // the rare expert above 48 would take a second block
      for (auto& [name, mm] : std::vector<std::pair<std::string, std::vector<int32_t>>>{
               {"all 5", std::vector<int32_t>(s.experts, 5)}, {"all 16", std::vector<int32_t>(s.experts, 16)},
               {"rand 1..16", rnd}, {"all 44", std::vector<int32_t>(s.experts, 44)}, {"binom 32", binom},
               {"all 64", std::vector<int32_t>(s.experts, 64)}})
        out["masked"].push_back(run_masked(s, name, mm, copy, iters));
    }
    if (!masked_only) {
      // The MISSION shapes, then gpt-oss-120b's GEMM1 over all 128 experts at the rows per expert
      // a prefill chunk of 2K / 8K / 32K tokens per rank gives (T k / E = T / 32): where the copy,
      // which widens every expert once per run, has the fewest rows to pay for it.
      std::printf("\ncontiguous (MXFP4 rows: 64-token tiles, 128-token tiles, the FP8 copy first, row scales in 64- "
                  "and 128-token tiles, the copy beside)\n%-40s %10s %10s %9s %9s %7s   %s\n",
                  "shape, rows/expert", "us fp8", "us mxfp4", "TF fp8", "TF mxfp4", "ratio", "config (mxfp4)");
      for (int rows : {512, 2048, 8192})
        if (!only_oss) out["contiguous"].push_back(run_contiguous("8 experts N 4096 K 7168", 8, 4096, 7168, rows, quick));
      for (int rows : {64, 256, 1024})
        out["contiguous_oss"].push_back(run_contiguous("gpt-oss-120b 128 x N 5760 K 2944", 128, 5760, 2944, rows, quick));
    }
    if (!json_path.empty()) write_text_file(json_path, out.dump(1));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm_mxfp4: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
