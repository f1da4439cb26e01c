// The MoE layer on the GPU, one EP rank (see include/moekit/layer.h).
#include "moekit/layer.h"

#include <algorithm>

#include "ep/cuda/ep_format.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/gating.cuh"
#include "kernels/cuda/quantize.cuh"
#include "layer/cuda/expert_mover.h"
#include "layer/cuda/layer_impl.cuh"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/eplb.h"
#include "moekit/gemm.h"
#include "moekit/layer_cpu.h"
#include "moekit/layout.h"
#include "moekit/rebalance.h"
#include "moekit/weights.h"

namespace moekit::gpu {

namespace {

const char* fault_name(int kind) {
  switch (LayerFault(kind)) {
    case LayerFault::kNonFiniteLogit: return "a non-finite router logit";
    case LayerFault::kBadExpert: return "a routing expert id outside [-1, E)";
    default: return "an unknown fault";
  }
}

}  // namespace

const char* gpu_pipeline_name(GpuPipeline pipeline) {
  return pipeline == GpuPipeline::kFused ? "fused" : "staged";
}

const char* gpu_stage_name(GpuStage stage) {
  switch (stage) {
    case GpuStage::kSharedQuant: return "shared quant";
    case GpuStage::kSharedGemm1: return "shared GEMM1";
    case GpuStage::kSharedActivation: return "shared activation";
    case GpuStage::kSharedGemm2: return "shared GEMM2";
    case GpuStage::kGate: return "gate";
    case GpuStage::kGemm1: return "GEMM1";
    case GpuStage::kActivation: return "activation";
    case GpuStage::kGemm2: return "GEMM2";
    case GpuStage::kDispatchSend: return "dispatch send";
    case GpuStage::kDispatchRecv: return "dispatch receive";
    case GpuStage::kCombineSend: return "combine send";
    case GpuStage::kCombineRecv: return "combine receive";
    default: return "?";
  }
}

GpuMoeLayer::~GpuMoeLayer() = default;

// Here rather than in ~GpuMoeLayer so that a constructor that throws half-way frees what it made.
GpuMoeLayer::Impl::~Impl() {
  mover.reset();  // its copies may read this layer's own slots: let them land first
  if (owner) --owner->num_sharers;
  gemm1.reset();
  gemm2.reset();
  shared1.reset();
  shared2.reset();
  cgemm1.reset();
  cgemm2.reset();
  for (auto e : events)
    if (e) cudaEventDestroy(e);
  if (fork) cudaEventDestroy(fork);
  if (join) cudaEventDestroy(join);
  if (side) cudaStreamDestroy(side);
  for (void* p : allocations) cudaFree(p);
}

void GpuMoeLayer::Impl::run_shared(const uint16_t* x, cudaStream_t stream) {
  launch_quantize_tokens(x, num_tokens, d, t_pad, sx, sx_scales, s_m, stream, launch(GpuStage::kSharedQuant));
  shared1->run(stream);
  if (!gated)
    launch_silu_mul_quant_masked(s_gate_up, 1, t_pad, shared_inter, s_m, s_act, s_act_scales, stream,
                                 launch(GpuStage::kSharedActivation), activation);
  shared2->run(stream);
}

// Points every kernel of the layer at its stamp pair (on) or at none (off).
void GpuMoeLayer::Impl::set_clocks(bool on) {
  timeline = on;
  auto pair = [&](GpuStage st) { return on ? clocks + 2 * int(st) : nullptr; };
  if (gemm1) gemm1->set_timeline(pair(GpuStage::kGemm1));
  if (gemm2) gemm2->set_timeline(pair(GpuStage::kGemm2));
  if (cgemm1) cgemm1->set_timeline(pair(GpuStage::kGemm1));
  if (cgemm2) cgemm2->set_timeline(pair(GpuStage::kGemm2));
  if (shared1) shared1->set_timeline(pair(GpuStage::kSharedGemm1));
  if (shared2) shared2->set_timeline(pair(GpuStage::kSharedGemm2));
}

void GpuMoeLayer::dispatch(const uint16_t* x, int num_tokens, int64_t first_token, cudaStream_t stream,
                           const int32_t* routing_idx, const float* routing_weights) {
  Impl& s = *impl_;
  MOEKIT_CHECK(s.phase == Impl::Phase::kIdle,
               fmtr("rank {}: dispatch called before the previous step's combine", s.rank));
  MOEKIT_CHECK(num_tokens >= 0 && num_tokens <= s.t_max,
               fmtr("rank {}: {} tokens, expected 0..T_max = {}", s.rank, num_tokens, s.t_max));
  MOEKIT_CHECK(first_token >= 0, fmtr("rank {}: first_token = {}, expected >= 0", s.rank, first_token));
  MOEKIT_CHECK((routing_idx == nullptr) == (routing_weights == nullptr),
               "dispatch: give both routing_idx and routing_weights, or neither");
  MOEKIT_CHECK(x != nullptr || num_tokens == 0, fmtr("rank {}: x is null with {} tokens", s.rank, num_tokens));
  s.num_tokens = num_tokens;
  s.timed_step = s.timing;
  // The EP buffer may serve other layers (one EP group per batch shape): point its launch mode and
  // stage clock at this layer's for the kernels of this step.
  s.ep->set_overlap(s.fused);
  s.ep->set_timeline(s.timeline ? s.clocks + 2 * int(GpuStage::kDispatchSend) : nullptr);  // the 4 EP phases in order
  if (s.timeline)
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(s.clocks, s.clocks_reset, 2 * kNumClocks * sizeof(unsigned long long),
                                      cudaMemcpyDeviceToDevice, stream));
  s.mark(kStart, stream);
  // MXFP4's padded hidden size: the router and the send read the model's rows (x_cols), or the
  // rows go into x_pad, whose padding columns stay zero.
  const int x_cols = s.d != s.model_d && !s.x_pad ? s.model_d : 0;
  if (s.x_pad && num_tokens > 0) {
    MOEKIT_CUDA_CHECK(cudaMemcpy2DAsync(s.x_pad, size_t(s.d) * 2, x, size_t(s.model_d) * 2, size_t(s.model_d) * 2,
                                        num_tokens, cudaMemcpyDeviceToDevice, stream));
    x = s.x_pad;
  }
  // The shared expert needs only x: on the side stream it is forked first so that it runs under
  // everything up to the combine receive. In line, the staged pipeline runs it first; the fused
  // one runs an unmerged shared expert right after the send (below).
  if (s.side_shared) {
    MOEKIT_CUDA_CHECK(cudaEventRecord(s.fork, stream));
    MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(s.side, s.fork, 0));
    s.run_shared(x, s.side);
    MOEKIT_CUDA_CHECK(cudaEventRecord(s.join, s.side));
  } else if (s.shared_inter > 0 && !s.fused) {
    s.run_shared(x, stream);
  }
  const ReplicaMap map{s.replicas, s.rank, first_token, s.cfg.replica_seed, s.topk_slot, s.counts};
  const LaunchOptions gate = s.launch(GpuStage::kGate);
  if (!routing_idx) {
    launch_router_logits(x, num_tokens, s.d, s.router_w, s.num_experts, s.logits, stream, gate, s.router_logit_bias,
                         x_cols);
    // Fused: the replica choice happens in the selection kernel itself.
    launch_select_experts(s.logits, num_tokens, s.num_experts, s.k, s.router, s.router_bias, s.topk_idx, s.topk_w,
                          s.status, stream, s.fused ? &map : nullptr, gate);
  }
  if (routing_idx || !s.fused)
    launch_map_replicas(map, num_tokens, s.k, routing_idx, routing_weights, s.topk_idx, s.topk_w, s.status, stream,
                        gate);
  s.mark(kGate, stream);
  s.ep->dispatch_send(x, s.topk_slot, s.topk_w, num_tokens, stream, x_cols);
  // Fused: the shared expert streams its weights while the peers' tokens travel (the receive
  // comes next). A persistent GEMM on a side stream holds every SM: started at the fork it kept
  // the gate and the send off the GPU for its whole length (measured, docs/layer-gpu.md).
  s.mark(kSend, stream);  // (fused: the shared expert's time shows in the next stage's events)
  if (s.shared_inter > 0 && s.fused && !s.merged) s.run_shared(x, stream);
  s.phase = Impl::Phase::kDispatched;
}

void GpuMoeLayer::compute(cudaStream_t stream) {
  Impl& s = *impl_;
  MOEKIT_CHECK(s.phase == Impl::Phase::kDispatched, fmtr("rank {}: compute called without a dispatch", s.rank));
  if (s.decode) {
    if (s.recv_ready) s.ep->dispatch_recv(stream, s.recv_ready, s.recv_ctas);
    else s.ep->dispatch_recv(stream);
    s.mark(kRecv, stream);
    s.gemm1->run(stream);
    s.mark(kGemm1, stream);
    if (!s.gated)
      launch_silu_mul_quant_masked(s.gate_up, s.routed_slabs(), s.m_max, s.inter, s.ep->recv_count(),
                                   s.act, s.act_scales, stream, s.launch(GpuStage::kActivation), s.activation);
    s.mark(kAct, stream);
    s.gemm2->run(stream);
  } else {
    s.ep->normal_dispatch_recv(stream);
    s.mark(kRecv, stream);
    s.cgemm1->run(stream);
    s.mark(kGemm1, stream);
    launch_silu_mul_quant_contiguous(s.gate_up, s.rows, s.inter, s.ep->row_expert(), s.act, s.act_scales, stream,
                                     s.launch(GpuStage::kActivation), s.activation);
    s.mark(kAct, stream);
    s.cgemm2->run(stream);
  }
  s.mark(kGemm2, stream);
  if (s.combine_ready) s.ep->combine_send(s.y, stream, s.combine_ready, s.combine_ctas);
  else s.ep->combine_send(s.y, stream);
  s.mark(kCombineSend, stream);
  s.phase = Impl::Phase::kComputed;
}

void GpuMoeLayer::combine(uint16_t* out, cudaStream_t stream) {
  Impl& s = *impl_;
  MOEKIT_CHECK(s.phase == Impl::Phase::kComputed, fmtr("rank {}: combine called without compute", s.rank));
  MOEKIT_CHECK(out != nullptr || s.num_tokens == 0, fmtr("rank {}: out is null", s.rank));
  const bool shared = s.shared_inter > 0 && s.num_tokens > 0;
  if (s.side_shared) MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream, s.join, 0));
  s.ep->combine_recv(shared ? s.s_out : nullptr, s.out_pad ? s.out_pad : out, stream,
                     s.d != s.model_d && !s.out_pad ? s.model_d : 0);
  if (s.out_pad && s.num_tokens > 0)
    MOEKIT_CUDA_CHECK(cudaMemcpy2DAsync(out, size_t(s.model_d) * 2, s.out_pad, size_t(s.d) * 2, size_t(s.model_d) * 2,
                                        s.num_tokens, cudaMemcpyDeviceToDevice, stream));
  s.mark(kCombineRecv, stream);
  s.phase = Impl::Phase::kIdle;
}

void GpuMoeLayer::forward_decode(const uint16_t* x, int num_tokens, int64_t first_token, uint16_t* out,
                                 cudaStream_t stream, const int32_t* routing_idx, const float* routing_weights) {
  MOEKIT_CHECK(impl_->decode, "forward_decode needs a low-latency EpBuffer");
  dispatch(x, num_tokens, first_token, stream, routing_idx, routing_weights);
  compute(stream);
  combine(out, stream);
}

void GpuMoeLayer::forward_prefill(const uint16_t* x, int num_tokens, int64_t first_token, uint16_t* out,
                                  cudaStream_t stream, const int32_t* routing_idx, const float* routing_weights) {
  MOEKIT_CHECK(!impl_->decode, "forward_prefill needs a normal-mode EpBuffer");
  dispatch(x, num_tokens, first_token, stream, routing_idx, routing_weights);
  compute(stream);
  combine(out, stream);
}

void GpuMoeLayer::check(cudaStream_t stream) {
  Impl& s = *impl_;
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s.side));
  LayerStatus st{};
  MOEKIT_CUDA_CHECK(cudaMemcpy(&st, s.status, sizeof st, cudaMemcpyDeviceToHost));
  if (st.kind != 0) {
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(s.status, 0, sizeof(LayerStatus), stream));  // before the next step
    const bool logit = st.kind == int(LayerFault::kNonFiniteLogit);
    throw Error(fmtr("MoE layer rank {}: {}: token {}, {} {}, value {}", s.rank, fault_name(st.kind), st.token,
                     logit ? "expert" : "top-k entry", st.entry, st.value));
  }
  try {
    s.ep->check(stream);
  } catch (const Error&) {
    // A timed-out receive may have left rows counted or the abort bit raised after GEMM1 zeroed
    // the hand-off counters (ep.h): zeroed again here, with every kernel done, for the next step.
    if (s.recv_ready) {
      MOEKIT_CUDA_CHECK(cudaMemsetAsync(s.recv_ready, 0, sizeof(int32_t) * (s.routed_slabs() + 2), stream));
      MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    throw;
  }
}

std::vector<int64_t> GpuMoeLayer::take_expert_counts(cudaStream_t stream) {
  Impl& s = *impl_;
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<unsigned long long> raw(s.num_experts);
  MOEKIT_CUDA_CHECK(cudaMemcpy(raw.data(), s.counts, raw.size() * sizeof(raw[0]), cudaMemcpyDeviceToHost));
  MOEKIT_CUDA_CHECK(cudaMemsetAsync(s.counts, 0, raw.size() * sizeof(raw[0]), stream));  // before the next step
  return std::vector<int64_t>(raw.begin(), raw.end());
}

void GpuMoeLayer::record_load(LoadRecorder& recorder, int layer, cudaStream_t stream) {
  MOEKIT_CHECK(recorder.num_experts() == impl_->num_experts,
               fmtr("record_load: the recorder counts {} experts, the layer routes {}", recorder.num_experts(),
                    impl_->num_experts));
  const std::vector<int64_t> counts = take_expert_counts(stream);
  recorder.record_counts(layer, counts.data());
}

void GpuMoeLayer::set_timing(bool on) { impl_->timing = on; }

void GpuMoeLayer::set_timeline(bool on) {
  MOEKIT_CHECK(impl_->phase == Impl::Phase::kIdle, "set_timeline during a step");
  impl_->set_clocks(on);
}

std::vector<GpuStageClock> GpuMoeLayer::last_timeline(cudaStream_t stream) const {
  const Impl& s = *impl_;
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(s.side));
  std::vector<unsigned long long> raw(2 * kNumClocks);
  MOEKIT_CUDA_CHECK(cudaMemcpy(raw.data(), s.clocks, raw.size() * sizeof(raw[0]), cudaMemcpyDeviceToHost));
  std::vector<GpuStageClock> out(kNumClocks);
  for (int i = 0; i < kNumClocks; ++i)
    if (raw[2 * i + 1] != 0) out[i] = {raw[2 * i], raw[2 * i + 1]};
  return out;
}

void GpuMoeLayer::set_shared_overlap(bool on) {
  MOEKIT_CHECK(impl_->phase == Impl::Phase::kIdle, "set_shared_overlap during a step");
  impl_->cfg.overlap_shared = on;
}

GpuStageTimes GpuMoeLayer::last_times() const {
  const Impl& s = *impl_;
  MOEKIT_CHECK(s.timed_step, "last_times: the last step ran without set_timing(true)");
  MOEKIT_CUDA_CHECK(cudaEventSynchronize(s.events[kCombineRecv]));
  auto ms = [&](Stage a, Stage b) {
    float v = 0;
    MOEKIT_CUDA_CHECK(cudaEventElapsedTime(&v, s.events[a], s.events[b]));
    return v;
  };
  GpuStageTimes t;
  t.gate = ms(kStart, kGate);
  t.dispatch_send = ms(kGate, kSend);
  t.dispatch_recv = ms(kSend, kRecv);
  t.gemm1 = ms(kRecv, kGemm1);
  t.activation = ms(kGemm1, kAct);
  t.gemm2 = ms(kAct, kGemm2);
  t.combine_send = ms(kGemm2, kCombineSend);
  t.combine_recv = ms(kCombineSend, kCombineRecv);
  return t;
}

int GpuMoeLayer::num_local_experts() const { return impl_->e_loc; }
int GpuMoeLayer::num_tokens() const { return impl_->num_tokens; }
const GpuLayerConfig& GpuMoeLayer::config() const { return impl_->cfg; }
EpBuffer& GpuMoeLayer::ep() const { return *impl_->ep; }
const int32_t* GpuMoeLayer::topk_idx() const { return impl_->topk_idx; }
const float* GpuMoeLayer::topk_weights() const { return impl_->topk_w; }
const int32_t* GpuMoeLayer::topk_slot() const { return impl_->topk_slot; }
const float* GpuMoeLayer::logits() const { return impl_->logits; }
const uint16_t* GpuMoeLayer::shared_out() const { return impl_->s_out; }
GpuMoeLayer::ExpertBuffers GpuMoeLayer::expert_buffers() const {
  const Impl& s = *impl_;
  return {s.gate_up, s.act, s.act_scales, s.y, s.rows};
}

}  // namespace moekit::gpu
