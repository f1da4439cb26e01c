// Token -> replica choice (see choose_replicas in include/moekit/eplb.h for the contract).
#include <fmt/format.h>

#include "eplb/internal.h"
#include "moekit/check.h"
#include "moekit/eplb.h"

namespace moekit {
namespace {

void check_layer(const Placement& p, int layer, int topk) {
  MOEKIT_CHECK(layer >= 0 && layer < p.num_layers,
               fmt::format("choose_replicas: layer {} out of range [0, {})", layer, p.num_layers));
  MOEKIT_CHECK(topk > 0, fmt::format("choose_replicas: topk = {} must be > 0", topk));
}

// Every id is checked before any slot is written, so bad input leaves topk_slot untouched.
void check_ids(const int32_t* topk_idx, int num_tokens, int topk, int num_experts, int64_t first_token) {
  for (size_t i = 0; i < size_t(num_tokens) * topk; ++i)
    MOEKIT_CHECK(topk_idx[i] >= -1 && topk_idx[i] < num_experts,
                 fmt::format("choose_replicas: token {} expert id {} out of range [0, {})",
                             first_token + int64_t(i / topk), topk_idx[i], num_experts));
}

}  // namespace

void choose_replicas_for_rank(const Placement& p, int layer, int rank, const int32_t* topk_idx, int num_local, int topk,
                              int64_t first_token, uint64_t seed, int32_t* topk_slot) {
  check_layer(p, layer, topk);
  MOEKIT_CHECK(rank >= 0 && rank < p.num_gpus,
               fmt::format("choose_replicas: rank {} out of range [0, {})", rank, p.num_gpus));
  MOEKIT_CHECK(
      num_local >= 0 && first_token >= 0,
      fmt::format("choose_replicas: num_local = {}, first_token = {}: expected both >= 0", num_local, first_token));
  const int32_t* log2phy = p.log2phy_row(layer);
  const int32_t* count = p.replica_count_row(layer);
  const int per_gpu = p.slots_per_gpu();
  check_ids(topk_idx, num_local, topk, p.num_experts, first_token);
  for (int t = 0; t < num_local; ++t)
    for (int j = 0; j < topk; ++j) {
      const int32_t e = topk_idx[size_t(t) * topk + j];
      int32_t& out = topk_slot[size_t(t) * topk + j];
      if (e == -1) {
        out = -1;
        continue;
      }
      out = eplb_detail::pick_replica(log2phy + size_t(e) * p.max_replicas, count[e], per_gpu, rank,
                                      eplb_detail::pair_hash(seed, first_token + t, e));
    }
}

void choose_replicas(const Placement& p, int layer, const int32_t* topk_idx, int num_tokens, int topk, uint64_t seed,
                     int32_t* topk_slot) {
  check_layer(p, layer, topk);
  MOEKIT_CHECK(num_tokens >= 0, fmt::format("choose_replicas: num_tokens = {} must be >= 0", num_tokens));
  check_ids(topk_idx, num_tokens, topk, p.num_experts, 0);
  // Walk the ranks, each with its contiguous run of tokens floor(t * P / T) == rank.
  const int64_t T = num_tokens, P = p.num_gpus;
  for (int64_t rank = 0, begin = 0; rank < P; ++rank) {
    const int64_t end = ((rank + 1) * T + P - 1) / P;  // first t with floor(t * P / T) > rank
    if (end > begin)
      choose_replicas_for_rank(p, layer, int(rank), topk_idx + begin * topk, int(end - begin), topk, begin, seed,
                               topk_slot + begin * topk);
    begin = end;
  }
}

}  // namespace moekit
