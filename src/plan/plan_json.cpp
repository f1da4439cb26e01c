// PlanResult as JSON: the machine form of `moekit plan --json` (keys as named in the issue).
#include <nlohmann/json.hpp>

#include "moekit/plan.h"

namespace moekit {
namespace {

using ojson = nlohmann::ordered_json;

template <class T>
ojson opt(const std::optional<T>& v) {
  return v ? ojson(*v) : ojson(nullptr);
}

// The figures of one step; row_json adds the decode rates and the comparison without MTP.
ojson step_json(const PlanRow& r, const PlanResult& res) {
  return ojson{
      {"batch", r.batch},
      {"mtp_tokens_per_step", r.tokens_per_step},
      {"tokens_per_gpu", r.tokens_per_gpu},
      {"coverage", r.coverage},
      {"routed_weight_bytes", res.routed_weight_bytes},
      {"other_weight_bytes", res.other_weight_bytes},
      {"step_weight_bytes_per_gpu", r.step_weight_bytes_per_gpu},
      {"weight_read_ms", r.weight_read_ms},
      {"compute_ms", r.compute_ms},
      {"floor_ms", r.floor_ms},
      {"comm_ms", opt(r.comm_ms)},
      {"dominant", r.dominant},
      {"expected_rows_per_expert", opt(r.expected_rows_per_expert)},
      {"dedup_targets", opt(r.dedup_targets)},
      {"dispatch_bytes_per_gpu", opt(r.dispatch_bytes_per_gpu)},
      {"combine_bytes_per_gpu", opt(r.combine_bytes_per_gpu)},
      {"combine_bytes_prereduced_per_gpu", opt(r.combine_bytes_prereduced_per_gpu)},
      {"cv_expert", opt(r.cv_expert)},
      {"imbalance_stat", opt(r.imbalance_stat)},
      {"tpot_ms", r.tpot_ms},
      {"tokens_per_s_per_seq", r.tokens_per_s_per_seq},
      {"tokens_per_s", r.tokens_per_s},
      {"meets_sla", res.input.tpot_sla_ms ? ojson(r.tpot_ms <= *res.input.tpot_sla_ms) : ojson(nullptr)},
  };
}

ojson row_json(const PlanRow& r, const PlanRow& plain, const PlanResult& res) {
  ojson j = step_json(r, res);
  j["accept_length"] = res.accept_length;
  j["tpot_ms_no_mtp"] = plain.tpot_ms;
  j["tokens_per_s_per_seq_no_mtp"] = plain.tokens_per_s_per_seq;
  j["tokens_per_s_no_mtp"] = plain.tokens_per_s;
  j["mtp_speedup"] = plain.tpot_ms / r.tpot_ms;
  // Without MTP the row itself is the plain decode: no second copy.
  j["no_mtp"] = res.input.mtp > 0 ? step_json(plain, res) : ojson(nullptr);
  return j;
}

}  // namespace

std::string plan_to_json(const PlanResult& res) {
  const PlanInput& in = res.input;
  ojson j;
  j["model"] = in.model.name;
  j["gpu"] = in.gpu.name;
  j["ep"] = in.ep;
  j["dtype"] = to_string(in.dtype);
  j["context"] = in.context;
  j["mem_fraction"] = in.mem_fraction;
  j["tpot_sla_ms"] = opt(in.tpot_sla_ms);
  j["mtp"] = in.mtp;
  j["accept_length"] = res.accept_length;
  j["accept_length_is_bound"] = res.accept_length_is_bound;
  j["is_moe"] = res.is_moe;
  j["flops"] = res.flops;
  j["hbm_bandwidth"] = in.gpu.hbm_bandwidth;
  j["ridge"] = res.ridge;
  j["routed_weight_bytes"] = res.routed_weight_bytes;
  j["other_weight_bytes"] = res.other_weight_bytes;
  j["comm_link"] = res.is_moe ? ojson(res.comm_link) : ojson(nullptr);
  j["comm_bandwidth"] = res.is_moe ? ojson(res.comm_bandwidth) : ojson(nullptr);
  j["comm_latency_us"] = res.is_moe ? ojson(res.comm_latency_us) : ojson(nullptr);
  j["knee_batch"] = res.knee_batch;
  if (res.batch_sla) j["batch_sla"] = *res.batch_sla;  // absent without --tpot-sla
  j["batch_mem"] = res.batch_mem;
  j["operating_point"] = res.operating_point;
  j["binding"] = res.binding;
  j["bm_star"] = res.bm_star;
  if (res.is_moe) {
    ojson pad = ojson::array();
    for (const PaddingRow& p : res.padding)
      pad.push_back(ojson{{"bm", p.bm},
                          {"expected_m", p.expected_m},
                          {"waste_expected", opt(p.waste_expected)},
                          {"waste_m5", p.waste_m5},
                          {"m_max", kPaddingMMax},
                          {"waste_pad_to_m_max", opt(p.waste_pad_to_m_max)},
                          {"waste_pad_to_m_max_m5", p.waste_pad_to_m_max_m5},
                          {"weight_reads_expected", opt(p.weight_reads_expected)}});
    j["padding"] = pad;
  } else {
    j["padding"] = nullptr;  // no experts, no per-expert padding
  }
  ojson rows = ojson::array();
  for (size_t i = 0; i < res.rows.size(); ++i) rows.push_back(row_json(res.rows[i], res.rows_no_mtp[i], res));
  j["rows"] = rows;
  if (res.is_moe) {
    ojson formats = ojson::array();
    for (const ExpertFormatPlan& f : res.expert_formats) {
      ojson frows = ojson::array();
      for (const PlanRow& r : f.rows)
        frows.push_back(ojson{{"batch", r.batch},
                              {"step_weight_bytes_per_gpu", r.step_weight_bytes_per_gpu},
                              {"weight_read_ms", r.weight_read_ms},
                              {"floor_ms", r.floor_ms},
                              {"dominant", r.dominant},
                              {"tpot_ms", r.tpot_ms}});
      formats.push_back(ojson{{"format", f.format},
                              {"bytes_per_param", f.bytes_per_param},
                              {"routed_weight_bytes", f.routed_weight_bytes},
                              {"rows", frows}});
    }
    j["expert_formats"] = formats;
  } else {
    j["expert_formats"] = nullptr;  // no routed experts
  }
  j["notes"] = ojson::array({
      "floor_ms = max(weight_read_ms, compute_ms); comm_ms is reported apart and is not in the floor",
      "comm_ms = moe_layers x [(dispatch + combine_prereduced bytes) x (P-1)/P / link bandwidth + 2 x latency]; "
      "nvlink when ep <= gpus_per_node, else network",
      "dispatch/combine bytes are per GPU and per MoE layer; dispatch counts the FP8 payload without scales",
      "MoE-only figures are null for a dense model (num_routed_experts = 0), whose coverage is 1",
      "batch_sla = 0 means no batch meets the SLA; operating_point = floor(min(knee_batch, batch_sla, batch_mem)) >= 0",
      "batch counts sequences; with mtp = N each verifies N + 1 tokens per step (mtp_tokens_per_step = batch x (N + 1)), "
      "and every step figure is that of those tokens; tpot_ms = floor_ms / accept_length, and the SLA, batch_sla and "
      "meets_sla apply to it; knee_batch = the weight GEMMs' knee in tokens / (N + 1); batch_mem counts the KV of "
      "batch sequences; accept_length_is_bound: accept_length was not given and is N + 1, every draft accepted",
      "*_no_mtp and no_mtp: the same batch decoded one token per sequence and step (no_mtp is null when mtp = 0)",
      "expert_formats: the same rows with the routed experts stored in FP8 (1 B per value + one fp32 scale per "
      "128x128 block) and in MXFP4 (4-bit values + one e8m0 byte per 32: 4.25 bits), the other weights at "
      "weight_bytes_per_param; null for a dense model",
  });
  return j.dump(2);
}

}  // namespace moekit
