// Internal to src/layer/cuda: the staged weight moves of one rank's layer (layer.h begin_moves ..
// commit_moves; docs/eplb.md "the move protocol").
//
// Staging: `staging_slots` experts' W1, W2 and scales of the mover's own, beside the layer's
// live slots, so that the copies of a move never touch memory a step reads:
//   staging w1  [staging_slots, 2 inter, d] fp8     scales [staging_slots, 2 inter/128, d/128] fp32
//   staging w2  [staging_slots, d, inter] fp8       scales [staging_slots, d/128, inter/128] fp32
// begin() orders the copy stream after the caller's step stream; advance() issues chunks of at
// most chunk_bytes on the copy stream (lowest priority), from any address the GPU can read
// (this GPU, a peer's memory mapped here, host memory); commit() copies each staged slot into
// its live slot on the caller's stream, one copy per operand, after wait() made that stream wait
// for the last chunk.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "moekit/layer.h"

namespace moekit::gpu {

// Bytes of one slot's operands.
struct SlotBytes {
  size_t w1 = 0, w1_scales = 0, w2 = 0, w2_scales = 0;
  size_t total() const { return w1 + w1_scales + w2 + w2_scales; }
};

// The layer's live arrays, [slots, ...] each.
struct LiveSlots {
  uint8_t* w1 = nullptr;
  float* w1_scales = nullptr;
  uint8_t* w2 = nullptr;
  float* w2_scales = nullptr;
};

class ExpertMover {
 public:
  ExpertMover(const SlotBytes& bytes, int staging_slots, size_t chunk_bytes);
  ~ExpertMover();
  ExpertMover(const ExpertMover&) = delete;
  ExpertMover& operator=(const ExpertMover&) = delete;

  // One moved slot: live slot `slot` gets the operands that start at `src` (the source slot's).
  struct Copy {
    int slot = 0;
    GpuExpertSlots src;
  };
  // Starts a plan of at most staging_slots copies; `after`: the caller's step stream.
  void begin(std::vector<Copy> copies, cudaStream_t after);
  size_t advance(size_t max_bytes);  // issues whole chunks (at least one while any is left)
  bool issued() const { return next_ == chunks_.size(); }
  size_t total_bytes() const { return total_; }
  void wait(cudaStream_t stream);  // `stream` waits for every chunk issued
  // Staged slots into the live ones on `stream` (after wait()); returns the slots written.
  int commit(const LiveSlots& live, cudaStream_t stream);
  void abort();  // waits for the chunks in flight, then forgets the plan
  bool active() const { return active_; }
  int staging_slots() const { return staging_slots_; }

  // The chunk sizes of `num_copies` copies, in issue order (each copy: W1, its scales, W2, its
  // scales, each cut into chunk_bytes pieces), and how many advance(max_bytes) calls issue them.
  static std::vector<size_t> chunk_sizes(const SlotBytes& bytes, size_t chunk_bytes, int num_copies);
  static int advance_calls(const std::vector<size_t>& chunk_sizes, size_t max_bytes);

 private:
  struct Chunk {
    void* dst;
    const void* src;
    size_t bytes;
  };
  SlotBytes bytes_;
  int staging_slots_;
  size_t chunk_bytes_;
  uint8_t *w1_ = nullptr, *w2_ = nullptr;
  float *w1s_ = nullptr, *w2s_ = nullptr;
  cudaStream_t copy_ = nullptr;
  cudaEvent_t start_ = nullptr, done_ = nullptr;
  std::vector<Copy> copies_;
  std::vector<Chunk> chunks_;
  std::vector<size_t> sizes_;  // chunks_[i].bytes
  size_t next_ = 0, total_ = 0;
  bool active_ = false, waited_ = false;
};

}  // namespace moekit::gpu
