// Internal to src/ep/cuda: the byte layout of one rank's memory and the kernel arguments,
// shared by the host code (ep_config.cu, ep_buffer.cu) and the kernels (dispatch.cu, combine.cu).
//
// Symmetric region (peers write here), base = EpArgs::symmetric:
//   dispatch inboxes [parity 2][src P] of dispatch_inbox_bytes:
//     [uint64 flag = step << 32 | messages][8 pad][int32 counts[E_loc], padded to 16][T_max messages]
//   combine inboxes  [parity 2][src P] of combine_inbox_bytes:
//     [uint64 flag = step << 32][8 pad][T_max x d bf16]
// One dispatch message (message_bytes, a multiple of 16):
//   [fp8 x[d]][fp32 scales[d/128]][int32 src_token][int32 entry[k]][fp32 weight[k]], padded,
//   entry[j] = local_expert << 16 | row position among this source's rows of that expert, or -1
//   when top-k entry j is not on the receiving rank. The sender computes the positions.
// Private state (only this rank touches it): EpCounters, EpStatusWord, then
//   route_ranks [T_max][k] int32: distinct target ranks of each own token, ascending, -1 padded
//   recv_msgs   [P] int32: messages received from each source this step
//   map_token   [P][T_max] int32: source token of inbox message (s, j)
//   map_rows    [P][T_max][k] int32: output row of each entry of message (s, j), -1 none
//   map_w       [P][T_max][k] fp32: its top-k weight
//   cta_counts  [count_ctas + 1][num_slots + P] int32: the send's counts of each CTA's own tokens;
//               row count_ctas: the step's totals (one rank in normal mode, send_count.cuh)
//   cta_flags   [count_ctas + 1] int32: the step whose counts a CTA (or the totals) were published
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

namespace moekit::gpu {

enum EpPhase : int { kPhaseDispatchSend = 0, kPhaseDispatchRecv = 1, kPhaseCombineSend = 2, kPhaseCombineRecv = 3 };

struct EpCounters {
  unsigned int step[4];  // per phase: steps completed by this rank
  unsigned int done[4];  // per phase: CTAs of the running kernel that finished (last one resets)
  int num_tokens;        // T of the last dispatch_send
  unsigned int send_claims;  // combine_send beside a GEMM: items claimed (its last CTA resets)
  int pad[2];
};

struct EpStatusWord {
  int kind;  // EpErrorKind; the first fault wins
  int phase;
  int rank;
  int peer;
  unsigned int step;
  int token;
  int index;
  int value;
};

constexpr int kEpThreads = 256;
constexpr size_t kEpFlagBytes = 16;

inline size_t align16(size_t n) { return (n + 15) / 16 * 16; }

struct EpArgs {
  int rank, num_ranks, max_tokens, hidden, topk, num_slots, local_experts, max_m;
  int block_m, max_rows;  // normal mode
  int msg_bytes, msg_scale_off, msg_meta_off;
  int dispatch_header_bytes;
  size_t dispatch_inbox_bytes, combine_inbox_bytes;
  int parity_mask;  // 1: double buffered, 0: single
  long long timeout_cycles;
  int pdl;                      // launched as programmatic dependent launches (EpBuffer::set_overlap)
  int self_slab;                // EpConfig::self_slab: the send also fills masked slab E_loc with own tokens
  int direct;                   // one rank: the send writes the receive's layout itself (ep.h)
  int contiguous;               // normal mode: the receive's layout is the contiguous one
  int mxfp4_k_order;            // EpConfig::mxfp4_k_order: rows stored in the MXFP4 GEMM's K order
  int token_scales;             // EpConfig::x_scaling is per token: one scale per token, in each slot
  unsigned long long* stamps;   // [4 phases][2] stage clock (stamp.cuh), or null
  int32_t* rows_ready;          // dispatch_recv's hand-off to a running GEMM (ep.h), or null
  int x_cols;                   // per call: dispatch_send's x row length (<= hidden; past it, zeros)
  int out_cols;                 // per call: combine_recv's out row length (<= hidden)

  uint8_t* symmetric;
  uint8_t* const* peer_dispatch;  // [P]
  uint8_t* const* peer_combine;   // [P]

  EpCounters* ctr;
  EpStatusWord* status;
  int32_t* route_ranks;
  int32_t* send_msgs;  // [P]: messages per peer of the last send, from the CTA with the last tokens
  int32_t* recv_msgs;
  int32_t* map_token;
  int32_t* map_rows;
  float* map_w;
  int count_ctas;       // the send grids the two below have room for
  int send_resident_ctas;  // the send's CTAs the GPU holds at once (its grid may be larger)
  int32_t* cta_counts;  // [count_ctas + 1][num_slots + P]
  int32_t* cta_flags;   // [count_ctas + 1]

  uint8_t* recv_x;
  float* recv_scales;
  int32_t* recv_count;
  int32_t* recv_src;
  int32_t* row_expert;
  int32_t* total_rows;

  // Inboxes of this rank (what peers wrote), by parity and source.
  __host__ __device__ uint8_t* dispatch_inbox(int parity, int src) const {
    return symmetric + (size_t(parity) * num_ranks + src) * dispatch_inbox_bytes;
  }
  __host__ __device__ uint8_t* combine_inbox(int parity, int src) const {
    return symmetric + 2 * size_t(num_ranks) * dispatch_inbox_bytes + (size_t(parity) * num_ranks + src) * combine_inbox_bytes;
  }
  // Where this rank's messages for `dst` go (dst's inbox for this rank), by parity.
  __host__ __device__ uint8_t* dispatch_outbox(int parity, int dst) const {
    return peer_dispatch[dst] + size_t(parity) * num_ranks * dispatch_inbox_bytes;
  }
  __host__ __device__ uint8_t* combine_outbox(int parity, int dst) const {
    return peer_combine[dst] + size_t(parity) * num_ranks * combine_inbox_bytes;
  }
};

// Byte sizes derived from the config (host side, ep_config.cu).
struct EpSizes {
  size_t msg_bytes, msg_scale_off, msg_meta_off;
  size_t dispatch_header_bytes, dispatch_inbox_bytes, combine_inbox_bytes;
  size_t symmetric_bytes;
};

// The private allocation, region by region (offsets are 256-byte aligned; host side, ep_config.cu).
struct PrivateLayout {
  size_t counters, status, route_ranks, send_msgs, recv_msgs, map_token, map_rows, map_w, cta_counts, cta_flags;
  int count_ctas;
  size_t recv_x, recv_scales, recv_count, recv_src, row_expert, total_rows;
  size_t state_bytes, output_bytes, total;
};

struct EpConfig;
EpSizes ep_sizes(const EpConfig& config);                // ep_config.cu
PrivateLayout private_layout(const EpConfig& config);    // ep_config.cu

// What a transport does on the stream right after a send kernel: nothing for transports whose
// kernels write straight into peers' memory; grouped ncclSend/ncclRecv of the inboxes for `nccl`.
class EpExchange {
 public:
  virtual ~EpExchange() = default;
  virtual void after_dispatch_send(cudaStream_t stream) = 0;
  virtual void after_combine_send(cudaStream_t stream) = 0;
  // True when the exchange runs kernels that wait for peers without a deadline (NCCL's), so
  // EpBuffer::check must watch the stream and call abort() once timeout_s has passed.
  virtual bool needs_watchdog() const = 0;
  // Ends the exchange's in-flight and future work (its waiting kernels return); the buffer is
  // unusable afterwards, and its next receive times out naming the peer that sent nothing.
  virtual void abort() = 0;
  // EpBuffer::map_peer_allocations (nvlink); the default refuses, naming the transport.
  virtual std::vector<void*> map_peer_allocations(void* mine);
};

// Kernel launchers (dispatch.cu, combine.cu). Each launches one kernel on the stream.
// How many of dispatch_send's CTAs the device's num_sms SMs hold at once (the occupancy API).
int dispatch_send_resident_ctas(const EpArgs& args, int num_sms);
void launch_dispatch_send(const EpArgs& args, const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
                          int num_tokens, int num_ctas, cudaStream_t stream);
void launch_dispatch_recv(const EpArgs& args, bool contiguous, int num_ctas, cudaStream_t stream);
// One rank (EpArgs::direct) with a GEMM beside the receive: the hand-off's counts, published.
void launch_publish_direct(const EpArgs& args, cudaStream_t stream);
// y_ready: null, or the counters of the GEMM running beside the send (EpBuffer::combine_send).
void launch_combine_send(const EpArgs& args, const uint16_t* y, int32_t* y_ready, int num_ctas, cudaStream_t stream);
// num_ctas: the buffer's grid; max_tokens: its T_max (the grid and each token's slices follow both).
// y: null, or (one rank, EpArgs::direct, after a combine_send that launched nothing) the GEMM
// output whose weighted rows this kernel sums itself.
void launch_combine_recv(const EpArgs& args, const uint16_t* add, uint16_t* out, int num_ctas, int max_tokens,
                         const uint16_t* y, cudaStream_t stream);

}  // namespace moekit::gpu
