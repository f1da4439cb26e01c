// GpuMoeLayer's placements (include/moekit/layer.h): a new placement of the same slots between
// steps from the host weights (set_placement), and the staged weight moves between GPUs that
// rebalancing while serving uses (begin_moves ... commit_moves; docs/eplb.md has the protocol).
#include <algorithm>
#include <cstring>

#include "ep/cuda/ep_format.h"
#include "layer/cuda/layer_impl.cuh"
#include "moekit/check.h"
#include "moekit/weights.h"

namespace moekit::gpu {

void GpuMoeLayer::Impl::upload_table(const Placement& placement, int layer, cudaStream_t stream) {
  MOEKIT_CHECK(placement.max_replicas <= replicas.max_replicas,
               fmtr("placement with {} replicas of one expert, expected at most {}", placement.max_replicas,
                    replicas.max_replicas));
  std::vector<int32_t> table(size_t(num_experts) * replicas.max_replicas, -1);
  const int32_t* src = placement.log2phy_row(layer);
  for (int e = 0; e < num_experts; ++e)
    std::copy(src + size_t(e) * placement.max_replicas, src + size_t(e + 1) * placement.max_replicas,
              table.begin() + size_t(e) * replicas.max_replicas);
  const int32_t* count = placement.replica_count_row(layer);
  if (stream) {
    // Pageable sources: the copies are staged before they return, so the vectors may go.
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(log2phy, table.data(), table.size() * 4, cudaMemcpyHostToDevice, stream));
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(replica_count, count, size_t(num_experts) * 4, cudaMemcpyHostToDevice, stream));
  } else {
    MOEKIT_CUDA_CHECK(cudaMemcpy(log2phy, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    MOEKIT_CUDA_CHECK(cudaMemcpy(replica_count, count, size_t(num_experts) * 4, cudaMemcpyHostToDevice));
  }
}

int GpuMoeLayer::set_placement(const Placement& placement, int placement_layer, const MoeLayerWeights& weights,
                               cudaStream_t stream) {
  Impl& s = *impl_;
  MOEKIT_CHECK(s.phase == Impl::Phase::kIdle, fmtr("rank {}: set_placement during a step", s.rank));
  MOEKIT_CHECK(!s.owner && s.num_sharers == 0,
               fmtr("rank {}: set_placement on a layer that shares its weights with another", s.rank));
  MOEKIT_CHECK(placement.num_experts == s.num_experts && placement.num_gpus == s.ec.num_ranks &&
                   placement.num_slots == s.ec.num_slots,
               fmtr("new placement of {} experts in {} slots on {} GPUs, expected {} experts in {} slots on {}",
                    placement.num_experts, placement.num_slots, placement.num_gpus, s.num_experts, s.ec.num_slots,
                    s.ec.num_ranks));
  MOEKIT_CHECK(placement_layer >= 0 && placement_layer < placement.num_layers,
               fmtr("placement layer {}, expected 0..{}", placement_layer, placement.num_layers - 1));
  MOEKIT_CHECK(weights.first_expert == 0 && weights.num_local_experts() == s.num_experts,
               fmtr("layer weights hold experts [{}, {}), expected all {}", weights.first_expert,
                    weights.first_expert + weights.num_local_experts(), s.num_experts));
  MOEKIT_CHECK(!(s.mover && s.mover->active()), fmtr("rank {}: set_placement while moves are in flight", s.rank));
  MOEKIT_CHECK(weights.is_mxfp4() == s.mxfp4 && (!s.mxfp4 || (weights.padded_hidden == s.d &&
                                                              weights.padded_intermediate == s.inter)),
               fmtr("rank {}: set_placement with {} weights of hidden {}, the layer holds {} of hidden {}", s.rank,
                    weights.is_mxfp4() ? "MXFP4" : "FP8", weights.is_mxfp4() ? weights.padded_hidden : weights.hidden_size,
                    s.mxfp4 ? "MXFP4" : "FP8", s.d));
  s.upload_table(placement, placement_layer, stream);
  *s.current = placement;
  s.placement_layer = placement_layer;
  const int32_t* phy2log = placement.phy2log_row(placement_layer);
  int moved = 0;
  for (int i = 0; i < s.e_loc; ++i) {
    const int e = phy2log[s.rank * s.e_loc + i];
    if (e == s.local_experts[i]) continue;
    // Only the changed slot's operands travel: W1, W2 and their block scales.
    auto copy = [&](const ExpertWeights& all, uint8_t* w, float* scales) {
      const WeightLayout& l = all.layout;
      const size_t w_per = size_t(l.n) * l.k, s_per = size_t(l.n / kQuantBlock) * (l.k / kQuantBlock);
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(w + i * w_per, all.w.data() + e * w_per, w_per, cudaMemcpyHostToDevice, stream));
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(scales + i * s_per, all.scales.data() + e * s_per, s_per * sizeof(float),
                                        cudaMemcpyHostToDevice, stream));
    };
    // MXFP4: the slot's codes, scale words and biases in the GEMM's encodings (pageable copies from
    // temporaries: each returns once its source is staged).
    auto copy_mxfp4 = [&](const Mxfp4ExpertWeights& all, uint8_t* w, uint32_t* words, float* bias) {
      std::vector<uint8_t> c;
      std::vector<uint32_t> sw;
      std::vector<float> b;
      gather_mxfp4(all, &e, 0, 1, c, sw, b);
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(w + i * c.size(), c.data(), c.size(), cudaMemcpyHostToDevice, stream));
      MOEKIT_CUDA_CHECK(cudaMemcpyAsync(words + i * sw.size(), sw.data(), sw.size() * 4, cudaMemcpyHostToDevice, stream));
      if (bias) MOEKIT_CUDA_CHECK(cudaMemcpyAsync(bias + i * b.size(), b.data(), b.size() * 4, cudaMemcpyHostToDevice, stream));
    };
    if (s.mxfp4) {
      copy_mxfp4(weights.w1_mxfp4, s.w1, s.w1_mx, s.b1);
      copy_mxfp4(weights.w2_mxfp4, s.w2, s.w2_mx, s.b2);
    } else {
      copy(weights.w1, s.w1, s.w1s);
      copy(weights.w2, s.w2, s.w2s);
    }
    s.local_experts[i] = e;
    ++moved;
  }
  return moved;
}

GpuExpertSlots GpuMoeLayer::expert_slots() const {
  const Impl& s = *impl_;
  return {s.w1, s.w1s, s.w2, s.w2s};
}

std::vector<GpuExpertSlots> GpuMoeLayer::map_peer_slots() {
  Impl& s = *impl_;
  MOEKIT_CHECK(!s.mxfp4, fmtr("rank {}: map_peer_slots on an MXFP4 layer (its slots move only through set_placement)",
                              s.rank));
  // Four collectives, in the same order on every rank.
  const std::vector<void*> w1 = s.ep->map_peer_allocations(s.w1), w1s = s.ep->map_peer_allocations(s.w1s),
                           w2 = s.ep->map_peer_allocations(s.w2), w2s = s.ep->map_peer_allocations(s.w2s);
  std::vector<GpuExpertSlots> out(w1.size());
  for (size_t r = 0; r < out.size(); ++r)
    out[r] = {static_cast<const uint8_t*>(w1[r]), static_cast<const float*>(w1s[r]), static_cast<const uint8_t*>(w2[r]),
              static_cast<const float*>(w2s[r])};
  return out;
}

void GpuMoeLayer::set_peer_slots(const std::vector<GpuExpertSlots>& peers) {
  Impl& s = *impl_;
  MOEKIT_CHECK(int(peers.size()) == s.ec.num_ranks,
               fmtr("rank {}: set_peer_slots with {} entries, expected one per rank ({})", s.rank, peers.size(),
                    s.ec.num_ranks));
  MOEKIT_CHECK(!(s.mover && s.mover->active()), fmtr("rank {}: set_peer_slots while moves are in flight", s.rank));
  s.peers = peers;
}

void GpuMoeLayer::begin_moves(const Placement& placement, int placement_layer, const std::vector<ExpertMove>& moves,
                              const MoeLayerWeights* host_weights, cudaStream_t stream) {
  Impl& s = *impl_;
  MOEKIT_CHECK(s.phase == Impl::Phase::kIdle, fmtr("rank {}: begin_moves during a step", s.rank));
  MOEKIT_CHECK(!s.owner && s.num_sharers == 0,
               fmtr("rank {}: begin_moves on a layer that shares its weights with another", s.rank));
  MOEKIT_CHECK(s.mover != nullptr,
               fmtr("rank {}: begin_moves on a layer with staging_slots = 0 (GpuLayerConfig); set_placement copies "
                    "from the host instead", s.rank));
  MOEKIT_CHECK(placement_layer == s.placement_layer,
               fmtr("rank {}: begin_moves for placement layer {}, but this layer serves layer {}", s.rank,
                    placement_layer, s.placement_layer));
  validate_moves(*s.current, placement, placement_layer, moves);
  MOEKIT_CHECK(placement.max_replicas <= s.replicas.max_replicas,
               fmtr("placement with {} replicas of one expert, expected at most {}", placement.max_replicas,
                    s.replicas.max_replicas));
  if (host_weights)
    MOEKIT_CHECK(host_weights->first_expert == 0 && host_weights->num_local_experts() == s.num_experts &&
                     host_weights->hidden_size == s.d && host_weights->intermediate_size == s.inter,
                 fmtr("rank {}: begin_moves host weights hold experts [{}, {}) of hidden {} and inter {}, expected "
                      "all {} of hidden {} and inter {}",
                      s.rank, host_weights->first_expert, host_weights->first_expert + host_weights->num_local_experts(),
                      host_weights->hidden_size, host_weights->intermediate_size, s.num_experts, s.d, s.inter));
  const SlotBytes& b = s.slot_bytes;
  // The operands of one slot of `slots` (a rank's arrays), at local index i.
  auto at = [&](const GpuExpertSlots& slots, size_t i) {
    return GpuExpertSlots{slots.w1 + i * b.w1, slots.w1_scales + i * (b.w1_scales / sizeof(float)),
                          slots.w2 + i * b.w2, slots.w2_scales + i * (b.w2_scales / sizeof(float))};
  };
  std::vector<ExpertMover::Copy> copies;
  for (const ExpertMove& m : moves) {
    if (m.layer != placement_layer || m.dst_gpu != s.rank) continue;
    const size_t src_local = size_t(m.src_slot % s.e_loc);
    GpuExpertSlots src;
    if (m.src_gpu == s.rank) {
      src = at(GpuExpertSlots{s.w1, s.w1s, s.w2, s.w2s}, src_local);  // a copy inside this GPU
    } else if (int(s.peers.size()) > m.src_gpu && s.peers[m.src_gpu].valid()) {
      src = at(s.peers[m.src_gpu], src_local);  // from the peer's slot, over NVLink
    } else {
      MOEKIT_CHECK(host_weights != nullptr,
                   fmtr("rank {}: slot {} needs expert {} from rank {}, whose slots this process cannot read "
                        "(set_peer_slots), and no host weights were given", s.rank, m.slot, m.expert, m.src_gpu));
      const size_t e = size_t(m.expert);  // host arrays hold every expert: [E, ...]
      src = at(GpuExpertSlots{host_weights->w1.w.data(), host_weights->w1.scales.data(), host_weights->w2.w.data(),
                              host_weights->w2.scales.data()},
               e);
    }
    copies.push_back({m.slot % s.e_loc, src});
  }
  s.mover->begin(std::move(copies), stream);
  s.pending = std::make_unique<Placement>(placement);
}

size_t GpuMoeLayer::advance_moves(size_t max_bytes) {
  MOEKIT_CHECK(impl_->mover, fmtr("rank {}: advance_moves without staging_slots", impl_->rank));
  return impl_->mover->advance(max_bytes);
}

bool GpuMoeLayer::moves_issued() const { return !impl_->mover || impl_->mover->issued(); }

void GpuMoeLayer::wait_moves(cudaStream_t stream) {
  MOEKIT_CHECK(impl_->mover, fmtr("rank {}: wait_moves without staging_slots", impl_->rank));
  impl_->mover->wait(stream);
}

int GpuMoeLayer::commit_moves(cudaStream_t stream) {
  Impl& s = *impl_;
  MOEKIT_CHECK(s.phase == Impl::Phase::kIdle, fmtr("rank {}: commit_moves during a step", s.rank));
  MOEKIT_CHECK(s.mover && s.mover->active() && s.pending,
               fmtr("rank {}: commit_moves without moves in flight (begin_moves first)", s.rank));
  check(stream);  // the barrier step completed on every rank (a dead peer is the EP's named timeout)
  const int n = s.mover->commit(LiveSlots{s.w1, s.w1s, s.w2, s.w2s}, stream);
  s.upload_table(*s.pending, s.placement_layer, stream);
  const int32_t* phy2log = s.pending->phy2log_row(s.placement_layer);
  s.local_experts.assign(phy2log + s.rank * s.e_loc, phy2log + (s.rank + 1) * s.e_loc);
  s.current = std::move(s.pending);
  return n;
}

void GpuMoeLayer::abort_moves() {
  Impl& s = *impl_;
  if (s.mover) s.mover->abort();
  s.pending.reset();
}

bool GpuMoeLayer::moving() const { return impl_->mover && impl_->mover->active(); }
size_t GpuMoeLayer::move_bytes() const { return impl_->mover ? impl_->mover->total_bytes() : 0; }

int GpuMoeLayer::advance_calls(int rank, const std::vector<ExpertMove>& moves, int placement_layer,
                               size_t max_bytes) const {
  const Impl& s = *impl_;
  MOEKIT_CHECK(rank >= 0 && rank < s.ec.num_ranks, fmtr("advance_calls: rank {}, expected 0..{}", rank, s.ec.num_ranks - 1));
  int copies = 0;
  for (const ExpertMove& m : moves) copies += m.layer == placement_layer && m.dst_gpu == rank;
  return ExpertMover::advance_calls(ExpertMover::chunk_sizes(s.slot_bytes, s.cfg.move_chunk_bytes, copies), max_bytes);
}

}  // namespace moekit::gpu
