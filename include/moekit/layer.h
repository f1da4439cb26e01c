// moekit/layer.h: one MoE layer on the GPU, one rank of expert parallelism: the decode step
// (low-latency EP, masked GEMMs) and prefill step (normal EP, contiguous GEMMs) of
// docs/design.md §Decode data flow and §Prefill data flow, with the shared expert. The CPU layer
// (layer_cpu.h) is its oracle: same weights, same placement, same routing give the same routing,
// the same recv_count and the same output within the tolerance of
// docs/design.md §Numerics and their bounds (docs/layer-gpu.md says which parts are the same bits).
//
// One step on rank r, all on the caller's stream (plus one side stream of the layer's own):
//   dispatch(x, T, first_token)
//     gate        router_logits (fp64 dot products, rounded once to fp32) -> select_experts
//                 (softmax or sigmoid + bias, group-limited, renormalised, x routed_scaling_factor):
//                 gating.h's rule, one warp per token; or the caller's routing (device arrays).
//     replica     logical expert -> physical slot on the device, eplb.h choose_replicas_for_rank's
//                 rule (a replica on the own rank first, else splitmix64 of (seed, global token,
//                 expert)), so the slots are the CPU layer's.
//     shared      forked onto the layer's side stream: quantise x (1x128), GEMM1, SiLU·up + FP8,
//                 GEMM2, all with the masked GEMM as one "expert" whose masked_m = T: it runs
//                 while dispatch and the routed experts are in flight.
//     send        EpBuffer::dispatch_send (FP8 once per token, one message per target rank).
//   compute()
//     receive     dispatch_recv (masked layout, recv_count = masked_m) or normal_dispatch_recv
//                 (contiguous layout, row_expert), the EP hook.
//     GEMM1       W1 = [gate; up] -> gate_up bf16; activation SiLU(gate)·up + FP8 1x128 (fused);
//     GEMM2       W2 -> y bf16;  combine_send(y).
//   combine(out)  joins the side stream, combine_recv(add = shared output, out).
// forward_decode / forward_prefill run the three on one stream; with the `local` transport (P
// virtual ranks on one GPU and one stream) call every rank's dispatch, then every rank's
// compute, then every rank's combine (a receive waits for all peers' sends).
//
// gpt-oss (expert_format "mxfp4", weights.h): the same step with the MXFP4 GEMMs (gemm.h; 4.25 bits
// per weight, the experts' biases in their epilogues), the router's logit bias, top-k then softmax
// (gating.h "topk_softmax") and the clamped SwiGLU in the activation kernel (reference.h). Such
// models have no shared expert, and their weights come padded to multiples of 128 (hidden 2880 ->
// 2944): x and out stay [T, hidden] for the caller, the layer copies them into and out of padded
// rows (zero columns, so results are unchanged) and its EP buffer has the padded hidden
// (weights.h loaded_expert_sizes). The fused pipeline runs them without the SiLU·up epilogue (PDL chain only);
// set_placement works, staged moves (staging_slots) and peer slot mapping are refused.
//
// Static and captured: every buffer is allocated at set-up for T_max tokens per rank (decode:
// M_max = P T_max rows per local expert; prefill: the EP config's contiguous_rows()), every
// GEMM plan is built then, and nothing in a step allocates, synchronises or reads a shape back,
// so a whole step (of many layers and ranks) is captured by one CUDA Graph and replayed. What a
// graph bakes in: the pointers, num_tokens and first_token. What may change between replays:
// the contents of x and of the caller's routing arrays (and so the routing, recv_count and every
// output).
//
// Statistics (EPLB): every step adds its top-k choices to per-logical-expert counters on the
// device (graph-safe atomics); take_expert_counts() reads and clears them between steps, for
// LoadRecorder (eplb.h) or any other accumulator.
//
// Errors. Host arguments (T > T_max, a rank's EpBuffer of the wrong shape or mode, hidden or
// inter not multiples of 128, a placement that does not match the model and P) are
// moekit::Error before anything runs. Device-side faults (a non-finite router logit, a caller's
// expert id outside [-1, E), -1 meaning no expert) are recorded in the layer's status word; the step still completes
// (a bad entry becomes -1, no expert) so peers never wait, and check() throws naming the token,
// the entry and the value. check() also runs the EpBuffer's check().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "moekit/ep.h"
#include "moekit/spec.h"

namespace moekit {
struct MoeLayerWeights;  // weights.h
struct Placement;        // eplb.h
class LoadRecorder;      // eplb.h
struct ExpertMove;       // rebalance.h
}  // namespace moekit

namespace moekit::gpu {

// How a decode step's kernels follow each other (prefill always runs staged).
//   kStaged: one kernel per stage, each starting when the one before has drained the GPU (but
//            GEMM1 and GEMM2, which start under the previous kernel's tail by programmatic
//            dependent launch): the reference, bit for bit the pipeline every figure before the
//            fused one was taken with.
//   kFused:  the same data flow in fewer kernels that overlap their neighbours:
//            - the gate's top-k selection and the replica choice are one kernel;
//            - SiLU·up + FP8 happens in GEMM1's epilogue (gemm.h kSiluMulFp8, routed and shared
//              experts) where its tiles hold at most 32 tokens, the weights are FP8 and the
//              activation is SiLU·up: GEMM1 writes the FP8 activations and the activation kernel
//              is gone; otherwise GEMM1 writes BF16 and the activation kernel runs;
//            - the shared expert is no separate stage: when it has the routed experts' shapes
//              it is local expert E_loc of the routed GEMMs (its weights slot E_loc, its rows the
//              EP buffer's self slab, which the send fills: no kernel of its own); otherwise its
//              GEMMs run in line right after the send, while the peers' tokens are on their way
//              (overlap_shared is ignored either way: on the side stream its persistent GEMMs held
//              the SMs the send and the receive needed, docs/layer-gpu.md item 47);
//            - every kernel of the chain is a programmatic dependent launch: it is scheduled
//              under the tail of the one before and waits for it on the device, and GEMM2 streams
//              its first weight tiles before GEMM1 has finished (the EpBuffer's kernels too:
//              EpBuffer::set_overlap);
//            - GEMM1 runs beside the dispatch receive and takes each expert once its rows have
//              landed (GpuLayerConfig::recv_ready). Like every kernel scheduled early it holds its
//              SMs while it waits, so a fused layer is not for two micro-batches sharing one GPU.
//            The outputs equal the staged pipeline's within the GEMM library's bound (the same
//            bits where both GEMM1s split K alike); routing, slots and recv_count are identical.
//            Layers whose T_max exceeds kFusedMaxTokens (fused_max_tokens) run staged even when
//            fused is asked for (decided at construction): there the shared expert's rows (T per
//            rank) take several token blocks of the routed GEMMs, each reading its weights again,
//            where the staged side stream runs it under the dispatch. Measured (EP8 rank, graph
//            step by events; docs/layer-gpu.md items 38 and 47): fused faster than staged by 3-6%
//            at 128 tokens per rank, by 6% for Qwen3.5 and even for DeepSeek-V3 at 256, by 3% and
//            2% at 512 (DeepSeek-V3 on the stage clock, which leaves out the side stream's graph
//            nodes, 1-1.5% slower at 256 and 512). Above 512 not measured.
//            MOEKIT_PRINT_CONFIGS=1 prints each layer's choice at construction (staged or fused,
//            the shared expert merged, the gated GEMM1, the hand-offs' grids).
enum class GpuPipeline { kStaged, kFused };
constexpr int kFusedMaxTokens = 512;
const char* gpu_pipeline_name(GpuPipeline pipeline);

struct GpuLayerConfig {
  int max_tokens = 0;          // T_max per rank: 1 .. the EpBuffer's T_max
  uint64_t replica_seed = 0;   // choose_replicas' hash seed (the CPU layer's replica_seed)
  int expected_m = 0;          // rows per active local expert the GEMM heuristic plans for; 0: upper_typical_rows
                               // (gemm.h) of P T_max k rows over the slots
  bool overlap_shared = true;  // staged: shared expert on the side stream (false: on the caller's stream)
  // Staged decode with the shared expert on the side stream: its GEMMs run on this many CTAs and
  // the routed GEMM1 on the other SMs, so that the shared expert, launched first, does not hold
  // every SM while the dispatch and the routed GEMM1 wait for them (0: every GEMM takes every SM).
  // Below the device's SM count; where the shared expert is not on the side stream (fused, merged,
  // in line, prefill) it changes nothing.
  int shared_ctas = 0;
  GpuPipeline pipeline = GpuPipeline::kStaged;  // decode only
  // Fused: the shared expert as expert E_loc of the routed GEMMs where it fits (the EpBuffer then
  // needs a self slab: layer_ep_config with the same merge_shared).
  bool merge_shared = true;
  // Fused, with the SiLU·up epilogue: GEMM2 waits for each expert's rows (GEMM1 signals them), not
  // for GEMM1's whole grid (gemm.h kPreviousGemmPerExpert). False: the grid, as before.
  bool expert_ready = true;
  // Fused, FP8: GEMM1 starts beside the dispatch receive and loads each expert's rows as they land
  // (ep.h dispatch_recv with rows_ready, gemm.h kDispatchPerExpert): the receive runs on recv_ctas
  // CTAs (at most the EpBuffer's), and GEMM1's CTAs hold the other SMs meanwhile, with their
  // schedule computed and their first weights loaded. False: GEMM1 waits for the receive's grid.
  // (Not taken by MXFP4 layers. The receive counts the buffer's slabs, which must be GEMM1's
  // experts: a layer that does not merge the shared expert over a buffer with a self slab is
  // refused.)
  bool recv_ready = true;
  // The receive's CTAs then; 0: 8 where a rank holds one token (T_max = 1: its few rows need no
  // more, and 8 more GEMM1 CTAs start beside it), else one per 4 tokens of T_max, from 16 up to
  // 64 (docs/layer-gpu.md items 30 and 38: 16 CTAs took 89 us for 2046 rows at 256 tokens per rank).
  int recv_ctas = 0;
  // Fused, FP8: the combine send starts beside GEMM2 and sends each message as soon as GEMM2 has
  // stored its experts' rows (ep.h combine_send with y_ready, gemm.h set_early_trigger), on the
  // SMs GEMM2's CTAs leave in its last round; combine_ctas CTAs (0: the EpBuffer's, whose CTAs
  // claim the messages as they find an SM). False: it waits for GEMM2's grid. (Taken where
  // recv_ready is.)
  bool combine_ready = true;
  int combine_ctas = 0;
  // Fused, merged shared expert, with recv_ready: GEMM1 walks the shared expert (slab E_loc) first,
  // and its CTAs ask the L2 for its W1 while they wait for the receive to publish masked_m, when
  // HBM carries little else (gemm.h set_last_expert_first). Same bits either way. 1: on, 0: off,
  // -1: automatic, on above one token per rank (measured on an H200, EP8 rank: 0-2.6% faster
  // steps at 8-64 tokens per rank; 1-3% slower at one token, where GEMM1 is one round of tiles
  // and the prefetch only delays the dispatch: docs/layer-gpu.md item 32).
  int shared_first = -1;
  // Layers whose T_max is above this many tokens per rank run staged even when fused is asked for
  // (kFusedMaxTokens above says why); the EpBuffer must come from layer_ep_config with the same
  // value, since the self slab follows it.
  int fused_max_tokens = kFusedMaxTokens;
  // Moves while serving (begin_moves): experts this rank can stage at once, each with its own
  // W1, W2 and scales beside the live slots (0: no staged moves; set_placement still works).
  int staging_slots = 0;
  size_t move_chunk_bytes = size_t(4) << 20;  // one copy of a move's chunked transfer
  // Prefill, MXFP4: where the contiguous GEMMs widen their weights into an FP8 copy once per run
  // (gemm.h GemmConfig::mxfp4_fp8_copy), the memory for that copy: fp8_copy_workspace_bytes of
  // device memory, at least gpu_layer_fp8_copy_bytes, 16-byte aligned. The layer's two GEMMs share
  // it, and so may layers that run one after another on one stream, never two at once (gpt-oss-120b
  // on one GPU: one 2.2 GB copy for all 36 layers, where copies of their own would take 79 GB).
  // Null: a layer whose GEMMs copy allocates its own; one whose GEMMs do not copy ignores it.
  uint8_t* fp8_copy_workspace = nullptr;
  size_t fp8_copy_workspace_bytes = 0;
};

// The FP8 copy workspace a prefill layer of `model` on an EP buffer of config `ec` takes where its
// GEMMs copy their MXFP4 weights (GpuLayerConfig::fp8_copy_workspace): E_loc x 2 inter x d bytes of
// the loaded (padded) sizes, GEMM1's copy, which GEMM2's fits in. 0 for FP8 models.
size_t gpu_layer_fp8_copy_bytes(const ModelSpec& model, const EpConfig& ec);

// Where one rank's FP8 expert slots live (MXFP4 layers: invalid), as this process addresses them: device pointers of this
// GPU, or of a peer's mapped into this process. W1 [E_loc, 2 inter, d] fp8 and its scales
// [E_loc, 2 inter/128, d/128], W2 [E_loc, d, inter] fp8 and its scales [E_loc, d/128, inter/128].
struct GpuExpertSlots {
  const uint8_t* w1 = nullptr;
  const float* w1_scales = nullptr;
  const uint8_t* w2 = nullptr;
  const float* w2_scales = nullptr;
  bool valid() const { return w1 && w1_scales && w2 && w2_scales; }
};

// The EP configuration a layer of `model` needs for P ranks holding num_slots physical experts.
// Decode: T_max is rounded up so that M_max = P T_max is a multiple of 4 (the GEMM's TMA rows of
// scales). Prefill: segments padded to the contiguous GEMM's kContiguousAlign rows. The fused
// pipeline's layers, when the shared expert has the routed experts' shapes, run it as local
// expert E_loc of the routed GEMMs: their buffer has self_slab (ep.h).
// pipeline, fused_max_tokens, merge_shared: GpuLayerConfig's of the layers that will use the buffer
// (no self slab where they do not merge the shared expert). A layer over a buffer with a self slab
// it would not fill (staged, above its fused_max_tokens, or not merging) is refused, naming why.
EpConfig layer_ep_config(const ModelSpec& model, int num_slots, int num_ranks, int max_tokens, EpMode mode,
                         GpuPipeline pipeline = GpuPipeline::kStaged, int fused_max_tokens = kFusedMaxTokens,
                         bool merge_shared = true);

// Stage timings of one step measured with CUDA events on the caller's stream, milliseconds
// (filled only when a step runs with timing on; never inside a captured graph).
struct GpuStageTimes {
  float gate = 0, dispatch_send = 0, dispatch_recv = 0, gemm1 = 0, activation = 0, gemm2 = 0, combine_send = 0,
        combine_recv = 0;
};

// The stage clock of one step (set_timeline): the stages a timeline shows, in the order of the
// layer's stamp pairs (the four EP phases last, as EpBuffer::set_timeline takes them).
enum class GpuStage {
  kSharedQuant, kSharedGemm1, kSharedActivation, kSharedGemm2,  // the shared expert, side stream
  kGate, kGemm1, kActivation, kGemm2,                              // the routed experts
  kDispatchSend, kDispatchRecv, kCombineSend, kCombineRecv,        // EP
  kCount
};
const char* gpu_stage_name(GpuStage stage);
// When a stage's first kernel's first CTA started and its last kernel's last CTA ended, in the
// GPU's %globaltimer nanoseconds (one clock for every stream); both 0 when it did not run.
struct GpuStageClock {
  uint64_t start_ns = 0, end_ns = 0;
  bool ran() const { return end_ns != 0; }
};

class GpuMoeLayer {
 public:
  // weights: all E routed experts of the layer (load_moe_layer(ckpt, spec, l, 0, E)), router and
  // shared experts; the rank's local experts are the slots rank * E_loc + i of placement layer
  // `placement_layer`, and their weights are copied to the device here. `ep` is this rank's
  // buffer (EpLocalGroup::rank(r) or connect_ep()); it must outlive the layer. The current CUDA
  // device is used. share_weights_with: a layer of the same rank, model and placement whose device
  // weights this one uses instead of its own copy (two micro-batches of one layer, each with its
  // own EP buffer); it must outlive this one, and set_placement is refused on both.
  GpuMoeLayer(const ModelSpec& model, const MoeLayerWeights& weights, const Placement& placement, int placement_layer,
              EpBuffer& ep, const GpuLayerConfig& config, const GpuMoeLayer* share_weights_with = nullptr);
  ~GpuMoeLayer();
  GpuMoeLayer(const GpuMoeLayer&) = delete;
  GpuMoeLayer& operator=(const GpuMoeLayer&) = delete;

  // x [T, d] bf16 on the device, 0 <= T <= T_max; first_token: global index of this rank's token
  // 0 (the replica hash uses global ids). routing_idx [T, k] int32 logical experts and
  // routing_weights [T, k] fp32, device pointers, replace the gate (both or neither). x and the
  // routing arrays must stay untouched until compute() has been issued.
  void dispatch(const uint16_t* x, int num_tokens, int64_t first_token, cudaStream_t stream,
                const int32_t* routing_idx = nullptr, const float* routing_weights = nullptr);
  void compute(cudaStream_t stream);
  // out [T, d] bf16 on the device.
  void combine(uint16_t* out, cudaStream_t stream);

  // One rank per process: the three phases in order. forward_decode needs a low-latency EpBuffer,
  // forward_prefill a normal one.
  void forward_decode(const uint16_t* x, int num_tokens, int64_t first_token, uint16_t* out, cudaStream_t stream,
                      const int32_t* routing_idx = nullptr, const float* routing_weights = nullptr);
  void forward_prefill(const uint16_t* x, int num_tokens, int64_t first_token, uint16_t* out, cudaStream_t stream,
                       const int32_t* routing_idx = nullptr, const float* routing_weights = nullptr);

  // Synchronises `stream` and throws moekit::Error for a fault recorded by this layer's kernels
  // or its EpBuffer (the record is cleared first).
  void check(cudaStream_t stream);

  // Per-logical-expert token counts [E] accumulated since the last call (synchronises `stream`,
  // then clears them).
  std::vector<int64_t> take_expert_counts(cudaStream_t stream);
  // take_expert_counts() into an EPLB statistics accumulator, as layer `layer` of the step
  // (the caller ends the step with recorder.end_step() after the last layer).
  void record_load(LoadRecorder& recorder, int layer, cudaStream_t stream);

  // EPLB between steps: moves to a new placement of the same slots (placement layer
  // `placement_layer`; weights: all E experts). Issued on `stream` after the step before it, so the
  // next step uses it: the replica table is rewritten and only the local slots whose logical
  // expert changed get new weights. No pointer changes, so a captured graph stays valid and
  // replays with the new placement. Every rank must apply the same placement before the next
  // step. Returns the number of local slots whose weights moved.
  int set_placement(const Placement& placement, int placement_layer, const MoeLayerWeights& weights,
                    cudaStream_t stream);

  // ---- EPLB while serving: staged weight moves (rebalance.h; docs/eplb.md "the move protocol") ----
  // A plan's moves are copied from a GPU that already holds each expert (this GPU, else a peer
  // through the mapping below, else the host weights) into staging slots, in chunks on the
  // layer's own copy stream, while steps run on the old placement; the live slots and the
  // replica table change only at commit_moves(), between two steps, in stream order on the step
  // stream. No pointer changes, so captured graphs stay valid. Every rank runs the same schedule:
  //   boundary b0            begin_moves(...) on every rank (after a step: copies follow it)
  //   every boundary         advance_moves(budget): at most `budget` more bytes of copies
  //   once all are issued    wait_moves(stream): the next step's kernels wait for this rank's
  //                          copies on the device (no host wait); then run that step
  //   the boundary after it  commit_moves(stream) on every rank: the new placement from the next step
  // That step's all-to-all cannot finish on any rank before every rank's sends, which follow its
  // copies, so when a rank commits (overwriting slots a peer may have copied from) every peer's
  // copies have landed. A step never reads a staging slot, and the live slots are written only
  // by the commit, in the stream order of the steps: no step reads a half-copied expert.

  // This layer's expert slots (for the ranks of the `local` transport: every rank reads them).
  GpuExpertSlots expert_slots() const;
  // Collective over the EP group (nvlink transport, one process per GPU): maps every rank's slots
  // into this process through EpBuffer::map_peer_allocations; returns them by rank.
  std::vector<GpuExpertSlots> map_peer_slots();
  // Where the moves may copy from: peers[r] is rank r's slots as this process can read them, or
  // invalid (all null) where it cannot (the `nccl` transport: copies then come from the host
  // weights given to begin_moves). This rank's own entry is ignored (its own slots are used).
  void set_peer_slots(const std::vector<GpuExpertSlots>& peers);
  // Starts moving to `placement` (the same slots; layer `placement_layer`, which must be the one
  // this layer serves) with the plan's `moves` (validate_moves() checks them; only the moves whose
  // destination is this rank are copied here). host_weights: all E experts of the layer, for
  // moves whose source rank has no valid entry in the peers (else may be null; pageable host
  // memory makes those copies synchronous for the host). stream: the step stream; the copies start
  // after the work issued on it so far. Refused during a step, while moves are in flight, on a
  // layer that shares its weights, or when this rank's moved slots exceed staging_slots.
  void begin_moves(const Placement& placement, int placement_layer, const std::vector<ExpertMove>& moves,
                   const MoeLayerWeights* host_weights, cudaStream_t stream);
  // Issues whole chunks, at least one while any is left, until `max_bytes` more would be passed;
  // returns the bytes issued (0 when all were issued before).
  size_t advance_moves(size_t max_bytes);
  bool moves_issued() const;  // every chunk of the plan is issued (or there were none)
  // `stream` waits on the device for every copy issued so far; call it once all are issued,
  // before issuing the step that serves as the barrier.
  void wait_moves(cudaStream_t stream);
  // The switch, after that step: synchronises `stream` once and checks the layer and its EP buffer
  // (a peer that died during the moves shows as the EP's named timeout: then it throws and the
  // old placement stays; call abort_moves()); else copies the staged weights into the live slots
  // and writes the new replica table on `stream`. Returns the number of this rank's slots switched.
  int commit_moves(cudaStream_t stream);
  void abort_moves();     // drops the plan (after the copies in flight land); the old placement stays
  bool moving() const;    // begin_moves() was called and neither commit_moves() nor abort_moves()
  size_t move_bytes() const;  // this rank's bytes to copy in the current plan
  // How many advance_moves(max_bytes) calls rank `rank`'s layer of this model and config needs to
  // issue its chunks of `moves` (layer `placement_layer`; 0 when it receives none). Every rank can
  // compute it for every rank from the plan alone: with one budget for all, the largest count is
  // the boundary after which every rank calls wait_moves, agreed without a message.
  int advance_calls(int rank, const std::vector<ExpertMove>& moves, int placement_layer, size_t max_bytes) const;

  // Runs the shared expert on the side stream (true, the default of GpuLayerConfig) or in line on
  // the caller's stream, from the next step on (to measure what the overlap hides).
  void set_shared_overlap(bool on);

  // Event timing of the stages of every step issued while on (not capturable: for eager runs only).
  void set_timing(bool on);
  GpuStageTimes last_times() const;  // synchronises on the step's last event

  // Stage clock of the steps issued from now on (also inside a captured graph: a step issued
  // with it on resets and fills the layer's stamp pairs, one per GpuStage): every kernel stamps
  // its CTAs' start and end with the GPU's global timer, so a timeline shows what overlapped
  // (events cannot: they order themselves on one stream). Costs two atomics per CTA. (Each
  // dispatch also sets the EpBuffer's launch mode and stage clock to this layer's: EpBuffer::
  // set_overlap and set_timeline.)
  void set_timeline(bool on);
  // The stamps of the last step issued with the timeline on (synchronises `stream`), by GpuStage.
  std::vector<GpuStageClock> last_timeline(cudaStream_t stream) const;

  int num_local_experts() const;
  int num_tokens() const;  // of the last dispatch
  const GpuLayerConfig& config() const;
  EpBuffer& ep() const;

  // Device views of the last step, for tests: [T_max, k] logical experts, weights, physical slots;
  // logits [T_max, E] (gate only); the shared expert's output [T_max, d] bf16.
  const int32_t* topk_idx() const;
  const float* topk_weights() const;
  const int32_t* topk_slot() const;
  const float* logits() const;
  const uint16_t* shared_out() const;
  // The routed experts' intermediate buffers of the last step (device), in the EpBuffer's layout:
  // masked [E_loc, M_max, ...] (decode) or contiguous [rows, ...] (prefill; row_expert says which).
  struct ExpertBuffers {
    const uint16_t* gate_up = nullptr;  // GEMM1 output, 2 inter columns (null: GEMM1's SiLU·up epilogue)
    const uint8_t* act = nullptr;       // SiLU·up in FP8, inter columns
    const float* act_scales = nullptr;  // [E_loc, inter/128, M_max] or [inter/128, rows]
    const uint16_t* y = nullptr;        // GEMM2 output, d columns
    int rows = 0;                       // M_max (per expert) or the contiguous rows
  };
  ExpertBuffers expert_buffers() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace moekit::gpu
