// Staged weight moves of one rank's layer (see expert_mover.h).
#include "layer/cuda/expert_mover.h"

#include <algorithm>

#include "ep/cuda/ep_format.h"
#include "moekit/check.h"
#include "moekit/cuda_check.h"

namespace moekit::gpu {

ExpertMover::ExpertMover(const SlotBytes& bytes, int staging_slots, size_t chunk_bytes)
    : bytes_(bytes), staging_slots_(staging_slots), chunk_bytes_(chunk_bytes) {
  MOEKIT_CHECK(staging_slots >= 1, fmtr("staging_slots = {}, expected >= 1", staging_slots));
  MOEKIT_CHECK(chunk_bytes >= 4096, fmtr("move_chunk_bytes = {}, expected >= 4096", chunk_bytes));
  const size_t n = size_t(staging_slots);
  MOEKIT_CUDA_CHECK(cudaMalloc(&w1_, n * bytes.w1));
  MOEKIT_CUDA_CHECK(cudaMalloc(&w1s_, n * bytes.w1_scales));
  MOEKIT_CUDA_CHECK(cudaMalloc(&w2_, n * bytes.w2));
  MOEKIT_CUDA_CHECK(cudaMalloc(&w2s_, n * bytes.w2_scales));
  // The lowest priority (the largest number): the step's kernels go first where both wait.
  int least = 0, greatest = 0;
  MOEKIT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  MOEKIT_CUDA_CHECK(cudaStreamCreateWithPriority(&copy_, cudaStreamNonBlocking, least));
  MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&start_, cudaEventDisableTiming));
  MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
}

ExpertMover::~ExpertMover() {
  if (copy_) cudaStreamSynchronize(copy_);
  if (done_) cudaEventDestroy(done_);
  if (start_) cudaEventDestroy(start_);
  if (copy_) cudaStreamDestroy(copy_);
  cudaFree(w1_);
  cudaFree(w1s_);
  cudaFree(w2_);
  cudaFree(w2s_);
}

std::vector<size_t> ExpertMover::chunk_sizes(const SlotBytes& bytes, size_t chunk_bytes, int num_copies) {
  std::vector<size_t> sizes;
  for (int j = 0; j < num_copies; ++j)
    for (size_t operand : {bytes.w1, bytes.w1_scales, bytes.w2, bytes.w2_scales})
      for (size_t off = 0; off < operand; off += chunk_bytes) sizes.push_back(std::min(chunk_bytes, operand - off));
  return sizes;
}

namespace {

// How many chunks one advance(max_bytes) issues from chunk `next` on: whole chunks, at least one.
size_t chunks_per_call(const std::vector<size_t>& sizes, size_t next, size_t max_bytes) {
  size_t n = 0, sent = 0;
  while (next + n < sizes.size() && (n == 0 || sent + sizes[next + n] <= max_bytes)) sent += sizes[next + n++];
  return n;
}

}  // namespace

int ExpertMover::advance_calls(const std::vector<size_t>& sizes, size_t max_bytes) {
  int calls = 0;
  for (size_t next = 0; next < sizes.size(); ++calls) next += chunks_per_call(sizes, next, max_bytes);
  return calls;
}

void ExpertMover::begin(std::vector<Copy> copies, cudaStream_t after) {
  MOEKIT_CHECK(!active_, "begin_moves: the moves of the last plan are still in flight");
  MOEKIT_CHECK(int(copies.size()) <= staging_slots_,
               fmtr("begin_moves: {} slots to move onto this rank, more than its staging_slots = {} "
                    "(GpuLayerConfig; RebalancerConfig::max_moves_per_gpu keeps plans within it)",
                    copies.size(), staging_slots_));
  for (const Copy& c : copies) MOEKIT_CHECK(c.src.valid(), fmtr("begin_moves: slot {} has no source", c.slot));
  copies_ = std::move(copies);
  chunks_.clear();
  sizes_.clear();
  next_ = 0;
  total_ = 0;
  // Staging slot j receives copy j, operand by operand, in chunks (the order of chunk_sizes()).
  auto add = [&](void* dst, const void* src, size_t bytes) {
    for (size_t off = 0; off < bytes; off += chunk_bytes_) {
      chunks_.push_back({static_cast<uint8_t*>(dst) + off, static_cast<const uint8_t*>(src) + off,
                         std::min(chunk_bytes_, bytes - off)});
      sizes_.push_back(chunks_.back().bytes);
    }
    total_ += bytes;
  };
  for (size_t j = 0; j < copies_.size(); ++j) {
    const GpuExpertSlots& s = copies_[j].src;
    add(w1_ + j * bytes_.w1, s.w1, bytes_.w1);
    add(reinterpret_cast<uint8_t*>(w1s_) + j * bytes_.w1_scales, s.w1_scales, bytes_.w1_scales);
    add(w2_ + j * bytes_.w2, s.w2, bytes_.w2);
    add(reinterpret_cast<uint8_t*>(w2s_) + j * bytes_.w2_scales, s.w2_scales, bytes_.w2_scales);
  }
  // The copies follow everything issued on the step stream so far: the last commit among it, so
  // the staging slots are free again and the sources hold the placement this plan starts from.
  MOEKIT_CUDA_CHECK(cudaEventRecord(start_, after));
  MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(copy_, start_, 0));
  active_ = true;
  waited_ = false;
  if (chunks_.empty()) MOEKIT_CUDA_CHECK(cudaEventRecord(done_, copy_));
}

size_t ExpertMover::advance(size_t max_bytes) {
  MOEKIT_CHECK(active_, "advance_moves: no moves were begun");
  size_t sent = 0;
  for (size_t n = chunks_per_call(sizes_, next_, max_bytes); n > 0; --n) {
    const Chunk& c = chunks_[next_++];
    // cudaMemcpyDefault: the addresses say where they live (this GPU, a mapped peer, the host).
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, copy_));
    sent += c.bytes;
  }
  if (sent > 0 && issued()) MOEKIT_CUDA_CHECK(cudaEventRecord(done_, copy_));
  return sent;
}

void ExpertMover::wait(cudaStream_t stream) {
  MOEKIT_CHECK(active_ && issued(), "wait_moves: issue every chunk first (advance_moves until moves_issued)");
  MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(stream, done_, 0));
  waited_ = true;
}

int ExpertMover::commit(const LiveSlots& live, cudaStream_t stream) {
  MOEKIT_CHECK(active_ && waited_, "commit_moves: call wait_moves and run one step first");
  for (size_t j = 0; j < copies_.size(); ++j) {
    const size_t i = size_t(copies_[j].slot);
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(live.w1 + i * bytes_.w1, w1_ + j * bytes_.w1, bytes_.w1,
                                      cudaMemcpyDeviceToDevice, stream));
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<uint8_t*>(live.w1_scales) + i * bytes_.w1_scales,
                                      reinterpret_cast<uint8_t*>(w1s_) + j * bytes_.w1_scales, bytes_.w1_scales,
                                      cudaMemcpyDeviceToDevice, stream));
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(live.w2 + i * bytes_.w2, w2_ + j * bytes_.w2, bytes_.w2,
                                      cudaMemcpyDeviceToDevice, stream));
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<uint8_t*>(live.w2_scales) + i * bytes_.w2_scales,
                                      reinterpret_cast<uint8_t*>(w2s_) + j * bytes_.w2_scales, bytes_.w2_scales,
                                      cudaMemcpyDeviceToDevice, stream));
  }
  const int n = int(copies_.size());
  active_ = false;
  copies_.clear();
  chunks_.clear();
  return n;
}

void ExpertMover::abort() {
  if (copy_) MOEKIT_CUDA_CHECK(cudaStreamSynchronize(copy_));
  active_ = false;
  waited_ = false;
  copies_.clear();
  chunks_.clear();
  next_ = 0;
}

}  // namespace moekit::gpu
