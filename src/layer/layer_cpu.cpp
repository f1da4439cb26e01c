// The MoE layer on the CPU over P in-process ranks (see include/moekit/layer_cpu.h).
#include "moekit/layer_cpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include "moekit/bf16.h"
#include "moekit/check.h"
#include "moekit/eplb.h"
#include "moekit/gating.h"
#include "moekit/layout.h"
#include "moekit/rebalance.h"
#include "moekit/weights.h"

namespace moekit {

const char* protocol_name(EpProtocol protocol) {
  return protocol == EpProtocol::kLowLatency ? "low-latency" : "normal";
}

namespace {

// One grouped GEMM's weight operand on one rank, FP8 or MXFP4: the two formats' reference GEMMs
// behind one call. Pointers into the rank's arrays.
struct GemmWeights {
  bool mxfp4 = false;
  int num_experts = 0, n = 0, k = 0;
  const uint8_t* w = nullptr;
  const float* fp8_scales = nullptr;   // FP8: [E_loc, N/128, K/128]
  const uint8_t* mx_scales = nullptr;  // MXFP4: [E_loc, N, K/32]
  const float* bias = nullptr;         // MXFP4 with expert biases: [E_loc, N]

  void masked(const MaskedLayout& a_layout, const uint8_t* a, const float* a_scales, const int32_t* masked_m,
              uint16_t* out) const {
    if (mxfp4)
      ref::grouped_gemm_masked_mxfp4(a_layout, a, a_scales, masked_m, {num_experts, n, k}, w, mx_scales, bias, out);
    else
      ref::grouped_gemm_masked(a_layout, a, a_scales, masked_m, {num_experts, n, k}, w, fp8_scales, out);
  }
  void contiguous(const ContiguousLayout& a_layout, const uint8_t* a, const float* a_scales, const int32_t* row_expert,
                  uint16_t* out) const {
    if (mxfp4)
      ref::grouped_gemm_contiguous_mxfp4(a_layout, a, a_scales, row_expert, {num_experts, n, k}, w, mx_scales, bias, out);
    else
      ref::grouped_gemm_contiguous(a_layout, a, a_scales, row_expert, {num_experts, n, k}, w, fp8_scales, out);
  }
};

}  // namespace

// One rank's weights and static buffers.
struct CpuMoeLayer::Rank {
  // Local experts' weights, gathered from the logical experts their slots hold: FP8 (w, scales) or
  // MXFP4 (w, mx_scales, bias), as GemmWeights gemm1 and gemm2 see them.
  std::vector<uint8_t> w1, w2;
  std::vector<float> w1_scales, w2_scales;
  std::vector<uint8_t> w1_mx_scales, w2_mx_scales;
  std::vector<float> w1_bias, w2_bias;
  GemmWeights gemm1, gemm2;
  // Own tokens padded to the GEMMs' hidden size (MXFP4 only): x in, the combine's output out.
  std::vector<uint16_t> x_padded, out_padded;
  // Receive side and expert outputs: the masked layout (low-latency) or contiguous rows (normal).
  std::vector<uint8_t> recv_x, act;
  std::vector<float> recv_scales, act_scales;
  std::vector<int32_t> recv_count, recv_src, row_expert;
  std::vector<uint16_t> gate_up, y;
  int rows = 0;  // M_max or M_total
  // Own tokens.
  std::vector<float> x, logits;
  std::vector<uint16_t> shared_out;
  RankStep step;
};

namespace {

using Clock = std::chrono::steady_clock;

template <class F>
void timed(double& seconds, F&& f) {
  const auto start = Clock::now();
  f();
  seconds += std::chrono::duration<double>(Clock::now() - start).count();
}

// Copies the `per` elements of expert e out of an all-experts array into slot i of a rank's array.
template <class T>
void copy_expert(const std::vector<T>& all, size_t per, int e, int i, std::vector<T>& dst) {
  dst.resize(std::max(dst.size(), (size_t(i) + 1) * per));
  std::copy_n(all.begin() + ptrdiff_t(size_t(e) * per), per, dst.begin() + ptrdiff_t(size_t(i) * per));
}

// Copies expert `e`'s operand out of an all-experts ExpertWeights into slot `i` of a rank's arrays.
void gather_expert(const ExpertWeights& all, int e, int i, std::vector<uint8_t>& w, std::vector<float>& scales) {
  const WeightLayout& l = all.layout;
  copy_expert(all.w, size_t(l.n) * l.k, e, i, w);
  copy_expert(all.scales, size_t(l.n / kQuantBlock) * (l.k / kQuantBlock), e, i, scales);
}

void gather_expert(const Mxfp4ExpertWeights& all, int e, int i, std::vector<uint8_t>& w, std::vector<uint8_t>& scales,
                   std::vector<float>& bias) {
  const Mxfp4WeightLayout& l = all.layout;
  copy_expert(all.w, size_t(l.n) * l.row_bytes(), e, i, w);
  copy_expert(all.scales, size_t(l.n) * l.row_scales(), e, i, scales);
  if (!all.bias.empty()) copy_expert(all.bias, size_t(l.n), e, i, bias);
}

}  // namespace

ref::Activation activation_of(const ActivationSpec& a) {
  if (a.kind == "silu") return {};
  MOEKIT_CHECK(a.kind == "clamped_swiglu", fmt::format("activation kind '{}', expected silu or clamped_swiglu", a.kind));
  return {ref::Activation::Kind::kClampedSwiglu, float(a.alpha), float(a.limit)};
}

CpuMoeLayer::CpuMoeLayer(const ModelSpec& model, const MoeLayerWeights& weights, const Placement& placement,
                         int placement_layer, const CpuLayerConfig& config)
    : model_(model), config_(config), placement_layer_(placement_layer) {
  MOEKIT_CHECK(model.is_moe(), fmt::format("model '{}' is dense: it has no MoE layer", model.name));
  mxfp4_ = model.expert_format == "mxfp4";
  MOEKIT_CHECK(weights.is_mxfp4() == mxfp4_,
               fmt::format("layer weights are {}, model '{}' has expert_format {}", weights.is_mxfp4() ? "MXFP4" : "FP8",
                           model.name, model.expert_format));
  if (!mxfp4_) {
    MOEKIT_CHECK(model.hidden_size % kQuantBlock == 0,
                 fmt::format("model '{}': hidden_size (the GEMM's K) = {}, expected a multiple of {}", model.name,
                             model.hidden_size, kQuantBlock));
    MOEKIT_CHECK(model.moe_intermediate_size % kQuantBlock == 0,
                 fmt::format("model '{}': moe_intermediate_size = {}, expected a multiple of {}", model.name,
                             model.moe_intermediate_size, kQuantBlock));
  }
  MOEKIT_CHECK(weights.hidden_size == model.hidden_size && weights.intermediate_size == model.moe_intermediate_size,
               fmt::format("layer weights have hidden {} and inter {}, the model {} and {}", weights.hidden_size,
                           weights.intermediate_size, model.hidden_size, model.moe_intermediate_size));
  // MXFP4 weights come padded (weights.h); FP8 ones are the model's sizes.
  MOEKIT_CHECK(!mxfp4_ || (weights.padded_hidden % kQuantBlock == 0 && weights.padded_intermediate % kQuantBlock == 0 &&
                           weights.padded_hidden >= weights.hidden_size &&
                           weights.padded_intermediate >= weights.intermediate_size),
               fmt::format("layer weights padded to hidden {} and inter {}, expected multiples of {} at least {} and {}",
                           weights.padded_hidden, weights.padded_intermediate, kQuantBlock, weights.hidden_size,
                           weights.intermediate_size));
  model_hidden_ = int(model.hidden_size);
  hidden_ = mxfp4_ ? int(weights.padded_hidden) : model_hidden_;
  inter_ = mxfp4_ ? int(weights.padded_intermediate) : int(model.moe_intermediate_size);
  num_experts_ = model.num_routed_experts;
  topk_ = model.num_experts_per_token;
  activation_ = activation_of(model.activation);
  MOEKIT_CHECK(weights.first_expert == 0 && weights.num_local_experts() == num_experts_,
               fmt::format("layer weights hold experts [{}, {}), expected all {} experts of '{}'", weights.first_expert,
                           weights.first_expert + weights.num_local_experts(), num_experts_, model.name));
  MOEKIT_CHECK(placement.num_experts == num_experts_ && placement.num_gpus == config.num_ranks,
               fmt::format("placement for {} experts on {} GPUs, expected {} experts on P = {} ranks",
                           placement.num_experts, placement.num_gpus, num_experts_, config.num_ranks));
  MOEKIT_CHECK(placement_layer >= 0 && placement_layer < placement.num_layers,
               fmt::format("placement layer {}, expected 0..{}", placement_layer, placement.num_layers - 1));
  num_slots_ = placement.num_slots;
  validate_ep_config(ep_config());
  MOEKIT_CHECK(config.block_m >= 1, fmt::format("block_m = {}, expected >= 1", config.block_m));
  placement_ = std::make_unique<Placement>(placement);
  phy2log_.assign(placement.phy2log_row(placement_layer), placement.phy2log_row(placement_layer) + num_slots_);

  // The router reads the padded x: its weight gets zero columns there (exact: adds zeros).
  router_weight_.assign(size_t(num_experts_) * hidden_, 0.0f);
  for (int e = 0; e < num_experts_; ++e)
    std::copy_n(weights.router_weight.begin() + ptrdiff_t(size_t(e) * model_hidden_), model_hidden_,
                router_weight_.begin() + ptrdiff_t(size_t(e) * hidden_));
  router_bias_ = weights.router_bias;
  router_logit_bias_ = weights.router_logit_bias;
  if (weights.has_shared_experts()) {
    shared_inter_ = weights.shared_w1.layout.n / 2;
    shared_w1_ = weights.shared_w1.w;
    shared_w1_scales_ = weights.shared_w1.scales;
    shared_w2_ = weights.shared_w2.w;
    shared_w2_scales_ = weights.shared_w2.scales;
  }

  const int e_loc = num_local_experts(), t_max = config.max_tokens, m_max = config.num_ranks * t_max;
  for (int r = 0; r < config.num_ranks; ++r) {
    auto me = std::make_unique<Rank>();
    for (int i = 0; i < e_loc; ++i) {
      const int e = phy2log_[size_t(r) * e_loc + i];
      if (mxfp4_) {
        gather_expert(weights.w1_mxfp4, e, i, me->w1, me->w1_mx_scales, me->w1_bias);
        gather_expert(weights.w2_mxfp4, e, i, me->w2, me->w2_mx_scales, me->w2_bias);
      } else {
        gather_expert(weights.w1, e, i, me->w1, me->w1_scales);
        gather_expert(weights.w2, e, i, me->w2, me->w2_scales);
      }
    }
    auto bias = [](const std::vector<float>& b) { return b.empty() ? nullptr : b.data(); };
    me->gemm1 = {mxfp4_, e_loc, 2 * inter_, hidden_, me->w1.data(), me->w1_scales.data(), me->w1_mx_scales.data(), bias(me->w1_bias)};
    me->gemm2 = {mxfp4_, e_loc, hidden_, inter_, me->w2.data(), me->w2_scales.data(), me->w2_mx_scales.data(), bias(me->w2_bias)};
    if (hidden_ != model_hidden_) {
      me->x_padded.assign(size_t(t_max) * hidden_, 0);  // the padding columns stay zero
      me->out_padded.resize(size_t(t_max) * hidden_);
    }
    me->x.resize(size_t(t_max) * hidden_);
    me->logits.resize(size_t(t_max) * num_experts_);
    me->shared_out.resize(size_t(t_max) * hidden_);
    me->recv_count.resize(e_loc);
    if (config.protocol == EpProtocol::kLowLatency) {
      me->rows = m_max;
      const size_t rows = size_t(e_loc) * m_max;
      me->recv_x.resize(rows * hidden_);
      me->recv_scales.resize(rows * (hidden_ / kQuantBlock));
      me->recv_src.resize(rows);
      me->gate_up.resize(rows * 2 * inter_);
      me->act.resize(rows * inter_);
      me->act_scales.resize(rows * (inter_ / kQuantBlock));
      me->y.resize(rows * hidden_);
    }
    ranks_.push_back(std::move(me));
  }
}

CpuMoeLayer::~CpuMoeLayer() = default;

int CpuMoeLayer::num_local_experts() const { return num_slots_ / config_.num_ranks; }

Fp8Scaling layer_fp8_scaling(const ModelSpec& model) {
  return model.expert_format == "mxfp4" ? Fp8Scaling::kPerToken : Fp8Scaling::kPerBlock;
}

Fp8Scaling CpuMoeLayer::x_scaling() const { return layer_fp8_scaling(model_); }

EpConfig CpuMoeLayer::ep_config() const {
  EpConfig c;
  c.num_ranks = config_.num_ranks;
  c.max_tokens = config_.max_tokens;
  c.hidden = hidden_;
  c.topk = topk_;
  c.num_slots = num_slots_;
  c.block_m = config_.block_m;
  c.timeout_s = config_.timeout_s;
  c.x_scaling = x_scaling();
  return c;
}

int64_t CpuMoeLayer::apply_moves(const Placement& placement, const std::vector<ExpertMove>& moves) {
  MOEKIT_CHECK(!mxfp4_, fmt::format("CpuMoeLayer::apply_moves: model '{}' has MXFP4 experts, which move no weights "
                                    "while serving (as on the GPU); {} moves refused", model_.name, moves.size()));
  validate_moves(*placement_, placement, placement_layer_, moves);
  const int e_loc = num_local_experts();
  // One slot's operands: W1 = [gate; up] [2 inter, d] and W2 [d, inter] in FP8, with 1x128 block scales.
  struct Operand {
    std::vector<uint8_t> Rank::*w;
    std::vector<float> Rank::*scales;
    size_t w_per, s_per;
  };
  const Operand operands[2] = {
      {&Rank::w1, &Rank::w1_scales, size_t(2) * inter_ * hidden_, size_t(2 * inter_ / kQuantBlock) * (hidden_ / kQuantBlock)},
      {&Rank::w2, &Rank::w2_scales, size_t(hidden_) * inter_, size_t(hidden_ / kQuantBlock) * (inter_ / kQuantBlock)}};
  // Read every source first (a slot can be one move's source and another's destination).
  std::vector<const ExpertMove*> mine;
  for (const ExpertMove& m : moves)
    if (m.layer == placement_layer_) mine.push_back(&m);
  std::vector<std::vector<uint8_t>> w(mine.size() * 2);
  std::vector<std::vector<float>> sc(mine.size() * 2);
  for (size_t i = 0; i < mine.size(); ++i)
    for (int o = 0; o < 2; ++o) {
      const Rank& src = *ranks_[mine[i]->src_gpu];
      const size_t at = size_t(mine[i]->src_slot % e_loc);
      const Operand& op = operands[o];
      w[2 * i + o].assign((src.*op.w).begin() + at * op.w_per, (src.*op.w).begin() + (at + 1) * op.w_per);
      sc[2 * i + o].assign((src.*op.scales).begin() + at * op.s_per, (src.*op.scales).begin() + (at + 1) * op.s_per);
    }
  int64_t bytes = 0;
  for (size_t i = 0; i < mine.size(); ++i)
    for (int o = 0; o < 2; ++o) {
      Rank& dst = *ranks_[mine[i]->dst_gpu];
      const size_t at = size_t(mine[i]->slot % e_loc);
      const Operand& op = operands[o];
      std::copy(w[2 * i + o].begin(), w[2 * i + o].end(), (dst.*op.w).begin() + at * op.w_per);
      std::copy(sc[2 * i + o].begin(), sc[2 * i + o].end(), (dst.*op.scales).begin() + at * op.s_per);
      bytes += int64_t(op.w_per + op.s_per * sizeof(float));
    }
  *placement_ = placement;
  phy2log_.assign(placement.phy2log_row(placement_layer_), placement.phy2log_row(placement_layer_) + num_slots_);
  return bytes;
}

const RankStep& CpuMoeLayer::last_step(int rank) const {
  MOEKIT_CHECK(rank >= 0 && rank < config_.num_ranks, fmt::format("rank = {}, expected 0..{}", rank, config_.num_ranks - 1));
  return ranks_[rank]->step;
}

CpuMoeLayer::RankBuffers CpuMoeLayer::buffers(int rank) const {
  last_step(rank);  // checks the rank
  const Rank& me = *ranks_[rank];
  return {me.recv_x.data(), me.recv_scales.data(), me.recv_src.data(),
          config_.protocol == EpProtocol::kNormal ? me.row_expert.data() : nullptr, me.y.data(), me.rows};
}

void CpuMoeLayer::forward(LocalEpGroup& group, int rank, int num_tokens, int64_t first_token, const uint16_t* x,
                          uint16_t* out, const int32_t* routing_idx, const float* routing_weights) {
  MOEKIT_CHECK(rank >= 0 && rank < config_.num_ranks, fmt::format("rank = {}, expected 0..{}", rank, config_.num_ranks - 1));
  MOEKIT_CHECK(num_tokens >= 0 && num_tokens <= config_.max_tokens,
               fmt::format("rank {}: {} tokens, expected 0..T_max = {}", rank, num_tokens, config_.max_tokens));
  MOEKIT_CHECK((routing_idx == nullptr) == (routing_weights == nullptr),
               "forward: give both routing_idx and routing_weights, or neither");
  const EpConfig ec = group.config();
  MOEKIT_CHECK(ec.num_ranks == config_.num_ranks && ec.max_tokens >= config_.max_tokens && ec.hidden == hidden_ &&
                   ec.topk == topk_ && ec.num_slots == num_slots_ && ec.x_scaling == x_scaling(),
               "forward: the EP group was not made from this layer's ep_config()");
  Rank& me = *ranks_[rank];
  RankStep& step = me.step;
  StageTimes times;
  const int k = topk_, d = hidden_;
  // MXFP4's padded hidden size: the step works on x and out with zero columns up to hidden_.
  const bool padded = d != model_hidden_;
  uint16_t* const out_model = out;
  if (padded) {
    for (int t = 0; t < num_tokens; ++t)
      std::copy_n(x + size_t(t) * model_hidden_, model_hidden_, me.x_padded.begin() + ptrdiff_t(size_t(t) * d));
    x = me.x_padded.data();
    out = me.out_padded.data();
  }
  step.num_tokens = num_tokens;
  step.topk_idx.resize(size_t(num_tokens) * k);
  step.topk_weights.resize(size_t(num_tokens) * k);
  step.topk_slot.resize(size_t(num_tokens) * k);

  timed(times.gate, [&] {
    for (size_t i = 0; i < size_t(num_tokens) * d; ++i) me.x[i] = bf16_to_float(x[i]);
    if (routing_idx) {
      for (size_t i = 0; i < size_t(num_tokens) * k; ++i)
        MOEKIT_CHECK(routing_idx[i] >= 0 && routing_idx[i] < num_experts_,
                     fmt::format("rank {}: routing topk_idx[{}, {}] = {}, expected an expert in 0..{}", rank, i / k,
                                 i % k, routing_idx[i], num_experts_ - 1));
      std::copy(routing_idx, routing_idx + size_t(num_tokens) * k, step.topk_idx.begin());
      std::copy(routing_weights, routing_weights + size_t(num_tokens) * k, step.topk_weights.begin());
    } else if (num_tokens > 0) {
      ref::router_logits(me.x.data(), num_tokens, d, router_weight_.data(), num_experts_, me.logits.data(),
                         router_logit_bias_.empty() ? nullptr : router_logit_bias_.data());
      ref::select_experts(me.logits.data(), num_tokens, num_experts_, k, model_.router,
                          router_bias_.empty() ? nullptr : router_bias_.data(), step.topk_idx.data(),
                          step.topk_weights.data());
    }
    if (num_tokens > 0)
      choose_replicas_for_rank(*placement_, placement_layer_, rank, step.topk_idx.data(), num_tokens, k, first_token,
                               config_.replica_seed, step.topk_slot.data());
  });
  if (config_.protocol == EpProtocol::kLowLatency) forward_low_latency(group, rank, x, me, times);
  else forward_normal(group, rank, x, me, times);

  // The shared expert runs on the rank's own tokens while the combine is in flight; its output is
  // the combine's `add` term, so the routed and shared parts are summed once, in fp32.
  timed(times.shared, [&] {
    if (shared_inter_ > 0 && num_tokens > 0) {
      const ref::ExpertFp8 sw{d, shared_inter_, shared_w1_.data(), shared_w1_scales_.data(), shared_w2_.data(),
                              shared_w2_scales_.data()};
      ref::shared_expert(me.x.data(), num_tokens, sw, me.shared_out.data(), activation_);
    }
  });
  timed(times.combine, [&] {
    group.combine_recv(rank, shared_inter_ > 0 ? me.shared_out.data() : nullptr, out);
    if (padded)
      for (int t = 0; t < num_tokens; ++t)
        std::copy_n(out + size_t(t) * d, model_hidden_, out_model + size_t(t) * model_hidden_);
  });
  step.ep = group.stats(rank);
  step.times = times;
}

void CpuMoeLayer::forward_low_latency(LocalEpGroup& group, int rank, const uint16_t* x, Rank& me, StageTimes& times) {
  RankStep& step = me.step;
  const MaskedLayout a1{num_local_experts(), me.rows, hidden_}, a2{num_local_experts(), me.rows, inter_};
  timed(times.dispatch, [&] {
    group.dispatch_send(rank, step.num_tokens, x, step.topk_slot.data(), step.topk_weights.data());
    group.dispatch_recv(rank, me.recv_x.data(), me.recv_scales.data(), me.recv_count.data(), me.recv_src.data());
  });
  // recv_count is masked_m: the GEMMs read it, nothing is copied or reordered.
  timed(times.gemm1, [&] {
    me.gemm1.masked(a1, me.recv_x.data(), me.recv_scales.data(), me.recv_count.data(), me.gate_up.data());
  });
  timed(times.activation, [&] {
    ref::activation_quant_masked(activation_, a2, me.gate_up.data(), me.recv_count.data(), me.act.data(),
                                 me.act_scales.data(), x_scaling());
  });
  timed(times.gemm2, [&] {
    me.gemm2.masked(a2, me.act.data(), me.act_scales.data(), me.recv_count.data(), me.y.data());
  });
  step.recv_count = me.recv_count;
  timed(times.combine, [&] { group.combine_send(rank, me.y.data()); });
}

void CpuMoeLayer::forward_normal(LocalEpGroup& group, int rank, const uint16_t* x, Rank& me, StageTimes& times) {
  RankStep& step = me.step;
  const int d = hidden_;
  ContiguousRecv recv;
  timed(times.dispatch, [&] {
    recv = group.normal_notify(rank, step.num_tokens, step.topk_slot.data());
    // The counts came first: size this step's contiguous buffers before any row arrives.
    const size_t rows = size_t(recv.total_m);
    me.rows = recv.total_m;
    me.recv_x.resize(rows * d);
    me.recv_scales.resize(rows * (d / kQuantBlock));
    me.recv_src.resize(rows);
    me.row_expert.resize(rows);
    me.gate_up.resize(rows * 2 * inter_);
    me.act.resize(rows * inter_);
    me.act_scales.resize(rows * (inter_ / kQuantBlock));
    me.y.resize(rows * d);
    group.normal_dispatch_send(rank, x, step.topk_weights.data());
    group.normal_dispatch_recv(rank, me.recv_x.data(), me.recv_scales.data(), me.row_expert.data(), me.recv_src.data());
  });
  const ContiguousLayout a1{recv.total_m, d}, a2{recv.total_m, inter_};
  if (recv.total_m > 0) {
    timed(times.gemm1, [&] {
      me.gemm1.contiguous(a1, me.recv_x.data(), me.recv_scales.data(), me.row_expert.data(), me.gate_up.data());
    });
    timed(times.activation, [&] {
      ref::activation_quant_contiguous(activation_, a2, me.gate_up.data(), me.row_expert.data(), me.act.data(),
                                       me.act_scales.data(), x_scaling());
    });
    timed(times.gemm2, [&] {
      me.gemm2.contiguous(a2, me.act.data(), me.act_scales.data(), me.row_expert.data(), me.y.data());
    });
  }
  step.recv_count.assign(recv.expert_rows.begin(), recv.expert_rows.end());
  timed(times.combine, [&] { group.normal_combine_send(rank, me.y.data()); });
}

Placement identity_placement(int num_experts, int num_ranks) {
  std::vector<int32_t> phy2log(num_experts);
  std::iota(phy2log.begin(), phy2log.end(), 0);
  return placement_from_phy2log(phy2log, 1, num_experts, num_experts, 1, 1, num_ranks);
}

Placement balanced_placement(const std::vector<double>& expert_load, int redundant, int num_ranks) {
  MOEKIT_CHECK(redundant >= 0, fmt::format("redundant experts = {}, expected >= 0", redundant));
  return rebalance({expert_load}, int(expert_load.size()) + redundant, 1, 1, num_ranks);
}

std::unique_ptr<LayerWeightsF64> dequantize_layer_f64(const MoeLayerWeights& weights) {
  MOEKIT_CHECK(!weights.is_mxfp4(), "dequantize_layer_f64: the weights are MXFP4; use LayerOracle, which decodes them "
                                    "expert by expert");
  auto out = std::make_unique<LayerWeightsF64>();
  auto dequantize = [](const ExpertWeights& ew, std::vector<double>& dst) {
    const WeightLayout& l = ew.layout;
    dst.resize(l.w_elems());
    const size_t w_per = size_t(l.n) * l.k, s_per = size_t(l.n / kQuantBlock) * (l.k / kQuantBlock);
    for (int e = 0; e < l.num_experts; ++e)
      ref::dequantize_weights_f64(ew.w.data() + e * w_per, ew.scales.data() + e * s_per, l.n, l.k,
                                  dst.data() + e * w_per);
  };
  dequantize(weights.w1, out->w1);
  dequantize(weights.w2, out->w2);
  ref::MoeWeightsF64& v = out->view;
  v.hidden = int(weights.hidden_size);
  v.inter = int(weights.intermediate_size);
  v.num_experts = weights.num_local_experts();
  v.w1 = out->w1.data();
  v.w2 = out->w2.data();
  if (weights.has_shared_experts()) {
    dequantize(weights.shared_w1, out->shared_w1);
    dequantize(weights.shared_w2, out->shared_w2);
    v.shared_inter = weights.shared_w1.layout.n / 2;
    v.shared_w1 = out->shared_w1.data();
    v.shared_w2 = out->shared_w2.data();
  }
  return out;
}

LayerOracle::LayerOracle(const ModelSpec& model, const MoeLayerWeights& weights)
    : hidden_(int(model.hidden_size)), topk_(model.num_experts_per_token) {
  MOEKIT_CHECK(weights.hidden_size == model.hidden_size && weights.first_expert == 0 &&
                   weights.num_local_experts() == model.num_routed_experts,
               fmt::format("LayerOracle: weights of hidden {} with experts [{}, {}), expected hidden {} and all {} experts",
                           weights.hidden_size, weights.first_expert, weights.first_expert + weights.num_local_experts(),
                           model.hidden_size, model.num_routed_experts));
  const ref::Activation act = activation_of(model.activation);
  if (!weights.is_mxfp4()) {
    fp8_ = dequantize_layer_f64(weights);
    fp8_->view.activation = act;
    return;
  }
  const Mxfp4ExpertWeights &w1 = weights.w1_mxfp4, &w2 = weights.w2_mxfp4;
  mxfp4_ = {int(weights.padded_hidden), int(weights.padded_intermediate), w1.layout.num_experts, w1.w.data(),
            w1.scales.data(), w2.w.data(), w2.scales.data(), w1.bias.empty() ? nullptr : w1.bias.data(),
            w2.bias.empty() ? nullptr : w2.bias.data(), act};
}

void LayerOracle::run(const float* x, int num_tokens, const int32_t* topk_idx, const float* topk_weights,
                      double* out, Fp8Scaling scaling) const {
  MOEKIT_CHECK(!fp8_ || scaling == Fp8Scaling::kPerBlock,
               fmt::format("LayerOracle::run: {} activations for FP8 weights, whose layers scale them 1x128",
                           fp8_scaling_name(scaling)));
  if (fp8_) {
    ref::moe_layer_f64(x, num_tokens, topk_idx, topk_weights, topk_, fp8_->view, out);
    return;
  }
  const int d = hidden_, d_p = mxfp4_.hidden;
  std::vector<float> x_padded(size_t(num_tokens) * d_p, 0.0f);
  for (int t = 0; t < num_tokens; ++t) std::copy_n(x + size_t(t) * d, d, x_padded.begin() + ptrdiff_t(size_t(t) * d_p));
  std::vector<double> out_padded(x_padded.size());
  ref::moe_layer_mxfp4_f64(x_padded.data(), num_tokens, topk_idx, topk_weights, topk_, mxfp4_, out_padded.data(),
                           scaling);
  for (int t = 0; t < num_tokens; ++t) std::copy_n(out_padded.begin() + ptrdiff_t(size_t(t) * d_p), d, out + size_t(t) * d);
}

}  // namespace moekit
