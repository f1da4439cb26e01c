// moekit/ep.h: expert-parallel dispatch and combine on the GPU (the DeepEP role), low-latency
// (decode) and normal (prefill) modes, over three transports. The protocol and the outputs are
// those of the CPU reference (ep_cpu.h); the GPU output equals it bit for bit (FP8 payload,
// scales, recv_count, recv_src, row_expert) and the combine within BF16 rounding.
//
// One EpBuffer per rank. Every call is one kernel on the caller's stream (plus, for the `nccl`
// transport, the grouped send/receive after each send kernel): nothing allocates,
// nothing synchronises with the host and no shape is read back, so a whole step (send, compute,
// receive) is captured by one CUDA Graph and replayed. Step numbers live on the device.
//
// Ranks and slots. P ranks each hold T <= T_max tokens of hidden size d (a multiple of 128).
// topk_idx [T, k] int32 holds PHYSICAL slots (EPLB already chose the replica), -1 = no expert;
// slot s lives on rank s / E_loc as local expert s % E_loc, E_loc = num_slots / P.
//
// Low-latency step, on every rank, in this order:
//   dispatch_send(x, topk_idx, topk_weights, T)   x [T, d] bf16, topk_weights [T, k] fp32.
//       Quantises each token once (1x128 scales, or one per token: EpConfig::x_scaling; exactly
//       quant.h's rule either way) and writes ONE message
//       per distinct target rank into that peer's inbox for this rank, then raises the flag
//       (src -> dst) with a release store of (step, message count). The sender also computes
//       each message's row positions per expert, so the receiver needs no scan.
//   dispatch_recv()                                the hook: call it when the data is needed.
//       Waits (acquire loads, clock64 timeout) for the flags of all P sources and expands the
//       messages into the masked layout of layout.h in canonical order (rows of local expert e
//       by source rank, then source token): recv_x [E_loc, M_max, d] fp8, recv_scales
//       [E_loc, d/128, M_max] fp32, recv_count [E_loc] int32 (= masked_m), recv_src [E_loc, M_max].
//   combine_send(y)                                y [E_loc, M_max, d] bf16 (the GEMM output).
//       For each received message: sum of topk_weights[j] * y[row of j] over its local experts
//       in top-k order, in fp32, rounded once to bf16, sent back as one vector [d].
//   combine_recv(add, out)                          out [T, d] bf16, add [T, d] bf16 or null.
//       out[t] = bf16(add[t] + partial[0][t] + ... + partial[P-1][t]) in fp32, in that fixed
//       order, skipping ranks the token was not sent to (a token with no expert gets add or 0).
// One rank (P = 1, low-latency): there is no peer to wait for, so nothing goes through an inbox
// or a flag. dispatch_send writes the masked layout itself (the same rows, scales, recv_count and
// recv_src, in the same order), dispatch_recv launches nothing (with rows_ready, one small kernel
// that publishes the counts once the send is complete), combine_send without y_ready launches
// nothing and combine_recv makes each token's partial from y itself, with combine_send's
// operations in its order: the same bits in one kernel instead of two. A decode step of one GPU
// (gpt-oss-120b on one H200) is then three EP kernels shorter.
// Normal step (prefill): the same calls with normal_dispatch_recv(), which lays the rows out in
// the contiguous layout (each expert's segment padded to block_m, -1 padding rows) into buffers
// sized for max_recv_rows; the per-expert counts travel in each source's inbox header ahead of
// its flag, so the receiver builds the layout from the counts before it places a row.
// combine_send then takes y [max_recv_rows, d] bf16 and combine_recv is the same. One rank in
// normal mode works as one low-latency rank does: dispatch_send places the rows in the contiguous
// layout itself (after its CTAs have shared the step's per-expert totals), normal_dispatch_recv
// launches nothing, combine_send launches nothing and combine_recv sums y's rows (same bits).
//
// Memory. Peers write into one "symmetric" region per rank; the rest is private:
//   symmetric = 2 parities x P sources x (dispatch inbox + combine inbox), where
//     dispatch inbox = 16 B flag + align16(4 E_loc) counts + T_max x message_bytes
//     message_bytes  = align16(d + 4 d/128 + 4 + 8k):
//                      [fp8 x[d]][fp32 scales[d/128]][int32 src_token][int32 e<<16|pos [k]][fp32 w[k]]
//     combine inbox  = 16 B flag + T_max x 2d
//   private = outputs (masked or contiguous) + routing state + combine map (ep_memory()).
// Two parities let a peer run one step ahead (its next send cannot land on a buffer still being
// read); a peer can never be two steps ahead because each step's receive waits for every peer.
//
// Faults. Every wait times out after timeout_s and writes an error record (kind, rank, peer, step)
// to the rank's device status word; the kernel then finishes without hanging, and check() turns
// the record into a moekit::Error naming them. Host-side arguments (T > T_max, null pointers,
// wrong mode, undersized symmetric memory) are rejected before any kernel runs. topk_idx lives on
// the device, so its validation happens in the send kernel: an entry whose slot is out of
// [-1, num_slots) or repeats an earlier slot of the token is skipped (never written out of
// bounds), a non-finite x value or weight is delivered as is; each is recorded in the status word
// with the token, the entry and the value, and reported by check(); the step still completes, so
// peers are never left waiting. Callers with a host copy of topk_idx can call
// validate_topk_idx() first to get the error before any kernel runs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moekit/layout.h"
#include "moekit/quant.h"

namespace moekit::gpu {

enum class EpMode { kLowLatency, kNormal };
enum class EpTransport { kLocal, kNvlink, kNccl };

const char* ep_mode_name(EpMode mode);
const char* ep_transport_name(EpTransport transport);

constexpr int kEpMaxTopk = 32;
constexpr int kEpMaxRanks = 1024;

struct EpConfig {
  int num_ranks = 1;        // P
  int max_tokens = 0;       // T_max per rank (the prefill chunk in normal mode)
  int hidden = 0;           // d, a multiple of 128
  int topk = 0;             // k
  int num_slots = 0;        // physical experts (E + redundant), a multiple of P
  EpMode mode = EpMode::kLowLatency;
  int block_m = 128;        // normal mode: expert segments padded to a multiple of this
  int max_recv_rows = 0;    // normal mode: rows of the contiguous output; 0 = the worst case
  double timeout_s = 30.0;  // every wait on a peer
  int num_ctas = 0;         // CTAs per kernel; 0 = the device's SM count (see two_batch_num_ctas)
  // Low-latency only: the masked outputs get one more expert slab, E_loc, into which
  // dispatch_send writes this rank's own T tokens, quantised as in the messages, in token order,
  // with recv_count[E_loc] = T. A shared expert then runs in the same grouped GEMM as the routed
  // experts (the fused decode pipeline, layer.h), with no quantisation kernel of its own.
  bool self_slab = false;
  // The quantised rows in the MXFP4 GEMM's K order (mxfp4.h mxfp4_k_position: permuted inside each
  // 128-deep block, 4-byte units moving whole; the scales unchanged): what an MXFP4 layer's
  // experts read. The send then stores each 16-byte chunk as four words.
  bool mxfp4_k_order = false;
  // How dispatch_send scales a token's FP8 values (quant.h): 1x128, or one scale per token (its
  // largest finite magnitude over all of d) written into each of its d/128 scale slots, so every
  // reader of 1x128 scales still works and gemm.h's a_row_scales reads the first slot. An MXFP4
  // layer's normal mode takes per token (layer_cpu.h layer_fp8_scaling); ep_cpu.h's EpConfig has
  // the same field, and both ends give the same bits.
  Fp8Scaling x_scaling = Fp8Scaling::kPerBlock;

  int slots_per_rank() const { return num_slots / num_ranks; }  // E_loc
  int max_m() const { return num_ranks * max_tokens; }          // M_max = P * T_max
  int k_blocks() const { return hidden / kQuantBlock; }
  // Worst case of the contiguous layout: every token of every rank on min(k, E_loc) local
  // experts, plus block_m - 1 padding rows per expert.
  int64_t worst_case_rows() const;
  int contiguous_rows() const;  // max_recv_rows, or worst_case_rows() when it is 0, rounded up to lcm(128, block_m)
  size_t message_bytes() const;

  // Throws moekit::Error naming the field, its value and what was expected.
  void validate() const;
};

// num_ctas for the EP buffers of two micro-batches in flight at once (two-batch overlap):
// (SMs - 16) / 2. A receive kernel spins until its peers' data arrives and holds one SM per CTA;
// with a full-GPU grid on each micro-batch, rank A's receive can occupy every SM while it waits
// for a send of rank B that waits in turn for A's other micro-batch's send, which then never
// finds an SM: both time out (seen on 2 H200s at 512 tokens per rank). Half the SMs each, less 16
// for the other stream's sends and GEMMs, keeps one free SM per wait. -1: the current device.
int two_batch_num_ctas(int device = -1);

// What one rank allocates, reported before anything is allocated.
struct EpMemory {
  size_t symmetric_bytes = 0;  // peers write here: both inboxes, both parities
  size_t output_bytes = 0;     // recv_x, recv_scales, recv_count, recv_src (+ row_expert)
  size_t state_bytes = 0;      // step counters, status word, routing and combine map
  size_t total() const { return symmetric_bytes + output_bytes + state_bytes; }
  std::string describe() const;
};
EpMemory ep_memory(const EpConfig& config);

// Host-side check of a host copy of topk_idx [T, k]: slots in [-1, num_slots), no slot twice in a
// token, T <= T_max. Throws moekit::Error naming the token, the position and the value.
void validate_topk_idx(const EpConfig& config, const int32_t* topk_idx_host, int num_tokens);

// The device status word's error kinds (check() reports them).
enum class EpErrorKind : int { kNone = 0, kTimeout = 1, kBadSlot = 2, kDuplicateSlot = 3, kNotFinite = 4, kCapacity = 5 };

// The peer-visible memory of one rank as the transport sees it.
struct EpPeers {
  void* symmetric = nullptr;         // this rank's symmetric region (device memory)
  size_t symmetric_bytes = 0;        // checked against ep_memory().symmetric_bytes
  std::vector<void*> peer_dispatch;  // [P]: where this rank's dispatch messages for rank r go
  std::vector<void*> peer_combine;   // [P]: where this rank's combine vectors for rank r go
  bool double_buffered = true;       // false for nccl: stream order replaces the parity
};

class EpExchange;  // transport hook run after each send kernel (nccl); internal

class EpBuffer {
 public:
  // Binds a rank to its peers' memory. Prefer the factories below; this is the seam they use.
  EpBuffer(const EpConfig& config, int rank, EpTransport transport, const EpPeers& peers,
           std::shared_ptr<EpExchange> exchange = nullptr);
  ~EpBuffer();
  EpBuffer(const EpBuffer&) = delete;
  EpBuffer& operator=(const EpBuffer&) = delete;

  const EpConfig& config() const;
  int rank() const;
  EpTransport transport() const;

  // Low-latency and normal mode: the same send. x bf16 bits [T, d], topk_idx int32 [T, k],
  // topk_weights fp32 [T, k], all device pointers, 0 <= T <= T_max. x_cols > 0: x is [T, x_cols]
  // (x_cols a multiple of 16, at most d) and its columns past x_cols count as zero, for a model
  // whose hidden size the buffer pads to a multiple of 128 (gpt-oss: 2880 in 2944) without a
  // padded copy of x.
  void dispatch_send(const uint16_t* x, const int32_t* topk_idx, const float* topk_weights, int num_tokens,
                     cudaStream_t stream, int x_cols = 0);
  void dispatch_recv(cudaStream_t stream);         // low-latency: masked layout
  // The low-latency receive handing its rows on, expert by expert, to a kernel that already runs
  // beside it (the fused decode pipeline's GEMM1, gemm.h Overlap::kDispatchPerExpert).
  // rows_ready: slabs + 2 device ints, zero at the call (the consumer zeroes them after use);
  // slabs = E_loc, + 1 with self_slab. Once recv_count is final the receive sets the self slab's
  // count to recv_count[E_loc] and raises rows_ready[slabs + 1] (release); then after each
  // message it adds 1 to rows_ready[e] per row of expert e it stored (release). After a timeout
  // recv_count is 0 for every routed expert, and every CTA that timed out sets gemm.h's
  // kRowsReadyAbort in rows_ready[slabs + 1] (its peers may have published real counts), so nothing
  // waits for rows that will not come; the counters are then the caller's to zero again.
  // rows_ready[slabs] is the consumer's own (its CTA count). num_ctas: the receive's grid,
  // 1..EpConfig::num_ctas; the SMs it leaves free take the consumer's CTAs while it copies.
  void dispatch_recv(cudaStream_t stream, int32_t* rows_ready, int num_ctas);
  void normal_dispatch_recv(cudaStream_t stream);  // normal: contiguous layout
  void combine_send(const uint16_t* y, cudaStream_t stream);
  // The low-latency combine send beside the GEMM that writes y (the fused decode pipeline's GEMM2,
  // gemm.h MaskedGemm::set_early_trigger): launched right after that GEMM, it starts once the
  // GEMM's CTAs have, takes the SMs they leave, and sends each message as soon as the GEMM has
  // stored the rows of the message's local experts. y_ready: E_loc (+ 1 with self_slab) device
  // ints, the GEMM's ready_out, zero at the call: expert e's rows are all in y once y_ready[e]
  // reaches (hidden / 64) · recv_count[e] (hidden is a multiple of 128). Every CTA then waits for the
  // GEMM's grid before it signs off, so the flags, and the next kernel on the stream, find all of
  // y stored (the self slab's rows that combine_recv adds too); the last CTA zeroes y_ready. The
  // kernel before it on the stream must be that GEMM, and only the dispatch receive (complete
  // before the GEMM started) may have written what else it reads. A counter that does not get
  // there within timeout_s is recorded as this rank's fault, naming the expert. num_ctas: the
  // send's grid, 1..EpConfig::num_ctas.
  void combine_send(const uint16_t* y, cudaStream_t stream, int32_t* y_ready, int num_ctas);
  // out_cols > 0: out is [T, out_cols] (a multiple of 8, at most d) and gets the first out_cols
  // columns of each row (the padded model of dispatch_send's x_cols); add stays [T, d].
  void combine_recv(const uint16_t* add, uint16_t* out, cudaStream_t stream, int out_cols = 0);

  // Outputs: device memory owned by the buffer, at fixed addresses for its life.
  // Low-latency: recv_x [E_loc, M_max, d] fp8, recv_scales [E_loc, d/128, M_max], recv_count
  // [E_loc] (masked_m), recv_src [E_loc, M_max]; with self_slab, E_loc + 1 slabs of recv_x,
  // recv_scales and recv_count (recv_src keeps E_loc).
  // Normal: recv_x [rows, d], recv_scales [d/128, rows], row_expert [rows] (-1 for padding and
  // for rows past the step's total), recv_src [rows] (-1 likewise), recv_total_rows [1] (the
  // step's padded M_total), recv_count [E_loc] (real rows per expert); rows = contiguous_rows().
  MaskedLayout masked_layout() const;
  ContiguousLayout contiguous_layout() const;
  uint8_t* recv_x() const;
  float* recv_scales() const;
  int32_t* recv_count() const;
  int32_t* recv_src() const;
  int32_t* row_expert() const;
  int32_t* recv_total_rows() const;

  // Synchronises with the stream and throws moekit::Error if a kernel of this rank recorded a
  // fault (a timeout names this rank, the peer and the step). The record is cleared first.
  void check(cudaStream_t stream);

  // Programmatic dependent launch of this buffer's kernels from the next call on (off by
  // default): each kernel may be scheduled while the previous kernel on the stream finishes, and
  // waits for it (griddepcontrol.wait) before reading anything (the dispatch receive reads only
  // behind the senders' flags instead), so results do not change; the
  // launch and ramp-up of each kernel hide under the tail of the one before (the fused decode
  // pipeline, layer.h). Keep it off where a receive of another EP group on another stream of the
  // same GPU must find free SMs while this buffer's kernels wait (two micro-batches on one GPU):
  // a kernel scheduled early holds its SM while it waits.
  void set_overlap(bool on);
  // Stage clock: the next kernels write, per phase (dispatch send, dispatch receive, combine
  // send, combine receive), the %globaltimer nanoseconds of their first CTA's start and last
  // CTA's end into stamps[2·phase] (atomicMin) and stamps[2·phase + 1] (atomicMax), a device
  // array of 8 the caller resets. Null (the default) records nothing.
  void set_timeline(unsigned long long* stamps);

  // Maps one device allocation of every rank of the group into this process, for copies between
  // GPUs outside the EP protocol (a rebalance's weight moves, layer.h). Collective: every rank
  // calls it with the base pointer of one of its own cudaMalloc allocations, the ranks' calls in
  // the same order. nvlink: the CUDA IPC handles travel through the group's NCCL all-gather and
  // are opened here (closed when this buffer goes); entry r is rank r's allocation as this
  // process addresses it, entry rank() is `mine`. local and nccl: moekit::Error (local ranks
  // share one process, so their pointers are already valid everywhere; nccl maps no peer memory).
  std::vector<void*> map_peer_allocations(void* mine);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The `local` transport: P virtual ranks in this process on the current device, each with its
// own symmetric region; peers' inboxes are plain pointers. The device code is the one NVLink
// peers run. Issue each rank's calls in protocol order; on ONE stream call every rank's send
// before any rank's receive (a receive kernel waits for its peers' sends, and a later kernel on
// the same stream cannot run before it).
class EpLocalGroup {
 public:
  explicit EpLocalGroup(const EpConfig& config);
  ~EpLocalGroup();
  EpLocalGroup(const EpLocalGroup&) = delete;
  EpLocalGroup& operator=(const EpLocalGroup&) = delete;
  EpBuffer& rank(int r);
  int num_ranks() const { return int(ranks_.size()); }

 private:
  std::vector<void*> symmetric_;
  std::vector<std::unique_ptr<EpBuffer>> ranks_;
};

// Transports across processes (one process per GPU). `nvlink` maps the peers' symmetric regions
// with CUDA IPC (each rank's handle swapped through the group's all-gather); `nccl` keeps all
// memory local and moves each step's inboxes with grouped ncclSend/ncclRecv right after each send
// kernel (fixed sizes, so it stays graph-capturable). NCCL is loaded at run time (dlopen of
// libnccl.so.2, or MOEKIT_NCCL_LIBRARY), so nothing links against it.
//
// What the ranks swap at set-up comes from whoever started them: launch_ranks hands every rank
// the same NCCL unique id, and `nvlink` all-gathers its handles over NCCL; a framework that
// already has a process group (torch.distributed: moekit's Python Buffer) supplies all_gather
// instead, and the NCCL unique id only for `nccl` (made by one rank with make_nccl_unique_id()
// and sent to the others over that group), so `nvlink` then loads no NCCL at all. Either way the
// same code maps the peers.
struct EpProcessGroup {
  int rank = 0;
  int num_ranks = 1;
  int device = 0;
  // 128 bytes (ncclUniqueId): the `nccl` transport's communicator, and `nvlink`'s set-up
  // exchange where all_gather is empty. Empty otherwise.
  std::vector<uint8_t> nccl_unique_id;
  // all_gather(mine) returns every rank's `mine` (of one size on every rank), in rank order.
  // Empty: NCCL's all-gather over a communicator made from nccl_unique_id.
  std::function<std::vector<uint8_t>(const std::vector<uint8_t>& mine)> all_gather;
};
// Throws moekit::Error when an argument is bad, or names what the all-gather returned when it is
// not num_ranks pieces with this rank's own at position rank.
std::unique_ptr<EpBuffer> connect_ep(const EpConfig& config, const EpProcessGroup& group, EpTransport transport);

// A fresh NCCL unique id (128 bytes) for EpProcessGroup::nccl_unique_id; loads NCCL. One rank
// makes it and the group hands it to the others; that rank's process hosts NCCL's bootstrap.
std::vector<uint8_t> make_nccl_unique_id();

// The launcher: forks one process per GPU (rank r uses device r), hands every rank the same NCCL
// unique id (rank 0 makes it and publishes it in a shared page; the parent never touches NCCL or
// CUDA, so forking stays safe), runs body(group) in each, and
// returns the number of ranks that failed (threw, exited non-zero, crashed or passed
// timeout_s; stragglers are killed). NCCL_NVLS_ENABLE=0 is set in every child.
int launch_ranks(int num_ranks, double timeout_s, int (*body)(const EpProcessGroup& group, void* arg), void* arg);

// The number of CUDA devices, asked in a short-lived child process so that the caller's process
// stays free of CUDA state and may still fork ranks.
int count_devices_in_child();

}  // namespace moekit::gpu
