// moekit/ep_cpu.h: expert-parallel dispatch and combine over P in-process ranks (the `local`
// transport, ranks as threads): the reference protocol the GPU transports reproduce byte for byte.
//
// Ranks and slots. P ranks each hold T <= T_max tokens of hidden size d (a multiple of 128).
// topk_idx [T, k] holds PHYSICAL slots (EPLB has already mapped logical experts to replicas):
// num_slots = E + redundant, a multiple of P; slot s lives on rank s / slots_per_rank as its
// local expert s % slots_per_rank (E_loc = slots_per_rank). A token's k slots are distinct;
// -1 means "no expert" (DeepEP's convention: the entry is skipped, a token with none gets only `add`).
//
// Low-latency mode (decode, fixed buffers, the layout of layout.h's MaskedLayout):
//   dispatch_send  validates everything first (T <= T_max, slots in range and distinct per token,
//                  finite x and weights), then quantises each token ONCE to FP8 (1x128 scales,
//                  or one per token: EpConfig::x_scaling, quant.h) and writes one message per
//                  DISTINCT target rank, not per expert, into
//                  that peer's inbox for this source, in token order; then it raises the flag
//                  (src -> dst) with the step number (release). A message is
//                    [fp8 x[d]][fp32 scales[d/128]][int32 src_token][int32 topk_idx[k]][fp32 topk_weights[k]]
//                  padded to 16 bytes: message_bytes() = align16(d + 4d/128 + 4 + 8k) (as ep.h's).
//   dispatch_recv  (the hook, called when the data are needed) waits for the flags of all P
//                  sources (timeout: an Error naming this rank, the peer and the step) and expands
//                  the messages into the masked layout in the canonical order of layout.h: rows of
//                  local expert e ordered by source rank, then by source token:
//                    recv_x [E_loc, M_max, d] fp8, recv_scales [E_loc, d/128, M_max] fp32,
//                    recv_count [E_loc] int32 (= the GEMM's masked_m), recv_src [E_loc, M_max] int32
//                    (src_rank * T_max + src_token). Rows at or past recv_count are not written.
//   combine_send   takes the expert outputs y [E_loc, M_max, d] bf16 (rows past recv_count are not
//                  read), and for each received message (source rank, source token) sums
//                  topk_weights[j] * y[row of j] over the message's local experts j in top-k order,
//                  in fp32, rounds once to bf16 and writes ONE vector [d] into the source's combine
//                  inbox for this rank; then raises the flag (this rank -> src).
//   combine_recv   waits for the combine flags of all P peers and writes
//                    out[t] = bf16( add[t] + partial[0][t] + partial[1][t] + ... + partial[P-1][t] )
//                  summed in fp32 in that fixed order (add first, then ranks 0..P-1, skipping ranks
//                  the token was not sent to), so the result is deterministic. `add` [T, d] bf16 is
//                  optional (the shared expert's output, as DeepEP's combine takes a bias).
// Normal mode (prefill, the layout of layout.h's ContiguousLayout):
//   normal_notify  checks T <= T_max (then the prefill chunk) and the slots as above (the finite x
//                  and weights are normal_dispatch_send's checks), exchanges
//                  counts first (the rows each peer will receive per local expert), waits for all of
//                  them and returns the receive layout: each local expert's segment padded to a
//                  multiple of block_m. The caller sizes its buffers from it (M_total changes per step).
//   normal_dispatch_send / normal_dispatch_recv  as in low-latency mode (same messages), but the
//                  receiver places rows in the contiguous layout: expert segments in order, rows of a
//                  segment ordered by source rank then token, then -1 padding rows
//                  (recv_x [M_total, d], recv_scales [d/128, M_total], row_expert [M_total], recv_src [M_total]).
//   normal_combine_send / combine_recv  as above, y [M_total, d] bf16.
//
// Each rank runs its step on its own thread, in the order dispatch_send, dispatch_recv,
// combine_send, combine_recv (normal: notify, dispatch_send, dispatch_recv, combine_send,
// combine_recv); the group checks that order. Every rank takes part in every step, even with T = 0,
// because peers wait for its flags. Bad input is rejected before anything is written or sent. A
// rank that fails calls abort() (run_ranks() does it), so its peers stop waiting at once with an
// Error naming the failed rank instead of running into their timeout.
//
// Bytes: a rank's dispatch bytes are messages * message_bytes(); combine bytes are one bf16
// vector (2d) per message it received. Both are counted with and without the rank's own inbox
// (messages to oneself move no data between GPUs).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moekit/quant.h"

namespace moekit {

struct EpConfig {
  int num_ranks = 1;        // P
  int max_tokens = 0;       // T_max per rank
  int hidden = 0;           // d, a multiple of 128
  int topk = 0;             // k
  int num_slots = 0;        // physical experts (E + redundant), a multiple of P
  int block_m = 64;         // normal mode: expert segments padded to a multiple of this
  double timeout_s = 30.0;  // every wait on a peer
  // How dispatch_send scales a token's FP8 values: 1x128, or one scale per token written into each
  // of its d/128 slots (quant.h), what an MXFP4 layer's prefill takes (layer_cpu.h).
  Fp8Scaling x_scaling = Fp8Scaling::kPerBlock;

  int slots_per_rank() const { return num_slots / num_ranks; }  // E_loc
  int max_m() const { return num_ranks * max_tokens; }          // M_max = P * T_max
  int k_blocks() const { return hidden / 128; }
  size_t message_bytes() const;  // one dispatch message, see above
};

// Validates P >= 1, T_max >= 1, d a positive multiple of 128, 1 <= k <= num_slots, num_slots a
// multiple of P, block_m >= 1, timeout > 0. Errors name the field and its value.
void validate_ep_config(const EpConfig& config);

// What one rank moved in its last step.
struct EpStats {
  int64_t num_tokens = 0;             // T
  int64_t dispatch_messages = 0;      // one per (token, distinct target rank)
  int64_t dispatch_bytes = 0;         // all messages, own inbox included
  int64_t dispatch_bytes_remote = 0;  // to other ranks only
  int64_t recv_messages = 0;          // messages received (tokens in the inbox)
  int64_t recv_rows = 0;              // token-expert rows expanded (sum of recv_count)
  int64_t combine_bytes = 0;          // bf16 vectors sent back, own inbox included
  int64_t combine_bytes_remote = 0;

  // Distinct target ranks per token, C_P of docs/theory.md §All-to-all bytes.
  double targets_per_token() const { return num_tokens ? double(dispatch_messages) / double(num_tokens) : 0.0; }
};

// The receive side of normal mode.
struct ContiguousRecv {
  int total_m = 0;                 // M_total, sum of padded segments
  std::vector<int> expert_rows;    // real rows per local expert (the counts)
  std::vector<int> segment_begin;  // first row of each local expert's segment
};

class LocalEpGroup {
 public:
  explicit LocalEpGroup(const EpConfig& config);
  ~LocalEpGroup();
  LocalEpGroup(const LocalEpGroup&) = delete;
  LocalEpGroup& operator=(const LocalEpGroup&) = delete;

  const EpConfig& config() const { return config_; }

  // Low-latency mode. x [T, d] bf16 bits, topk_idx [T, k] physical slots, topk_weights [T, k].
  void dispatch_send(int rank, int num_tokens, const uint16_t* x, const int32_t* topk_idx, const float* topk_weights);
  void dispatch_recv(int rank, uint8_t* recv_x, float* recv_scales, int32_t* recv_count, int32_t* recv_src);
  void combine_send(int rank, const uint16_t* y);
  // add: [T, d] bf16 or nullptr; out: [T, d] bf16.
  void combine_recv(int rank, const uint16_t* add, uint16_t* out);

  // Normal mode.
  ContiguousRecv normal_notify(int rank, int num_tokens, const int32_t* topk_idx);
  void normal_dispatch_send(int rank, const uint16_t* x, const float* topk_weights);
  void normal_dispatch_recv(int rank, uint8_t* recv_x, float* recv_scales, int32_t* row_expert, int32_t* recv_src);
  void normal_combine_send(int rank, const uint16_t* y);

  const EpStats& stats(int rank) const;

  // Marks the group failed: every wait of every rank throws an Error naming `rank` and `why`.
  void abort(int rank, const std::string& why);

 private:
  struct Rank;
  enum class Phase;
  void check_rank(int rank) const;
  void check_tokens(int rank, int num_tokens, const int32_t* topk_idx) const;
  void check_payload(int rank, int num_tokens, const uint16_t* x, const float* topk_weights) const;
  void advance(Rank& me, Phase from, Phase to, const char* call);
  void wait_flag(int rank, int peer, const std::atomic<int64_t>& flag, int64_t step, const char* what) const;
  void send_messages(int rank, int num_tokens, const uint16_t* x, const int32_t* topk_idx, const float* topk_weights);
  void wait_dispatch(int rank);
  void send_combine(int rank, const uint16_t* y);

  EpConfig config_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::atomic<bool> aborted_{false};
  std::atomic<int> abort_rank_{-1};
  std::string abort_why_;
};

// Runs fn(rank) for rank 0..P-1, each on its own thread, and waits for all. The first rank to
// throw aborts the group (so its peers stop waiting) and its error is rethrown here; errors of
// peers that only report the abort are not.
void run_ranks(LocalEpGroup& group, const std::function<void(int rank)>& fn);

}  // namespace moekit
