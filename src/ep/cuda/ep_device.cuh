// Internal to src/ep/cuda: device helpers every EP kernel uses: system-scope flags, the
// timed wait, the status word, the last-CTA step counter, the top-k entry rule and small
// warp-wide scans.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ep_state.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/warp_prefix.cuh"
#include "moekit/ep.h"

namespace moekit::gpu {

// Flags cross GPUs, so both sides use system scope: the payload written before a release store
// is visible to whoever observes the flag with an acquire load.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }

// Records the first fault of this rank; later faults keep the first record.
__device__ __forceinline__ void record_fault(const EpArgs& a, EpErrorKind kind, int phase, int peer, unsigned step,
                                             int token, int index, int value) {
  EpStatusWord* s = a.status;
  if (atomicCAS(&s->kind, 0, -1) != 0) return;  // -1: being written
  s->phase = phase;
  s->rank = a.rank;
  s->peer = peer;
  s->step = step;
  s->token = token;
  s->index = index;
  s->value = value;
  __threadfence();
  atomicExch(&s->kind, int(kind));
}

// Spins until done() (its loads acquire); returns false on a timeout (recorded with the peer, and
// with index and value where the wait is for a count) or when another wait of this rank already
// timed out (so one dead peer costs one timeout, not one per CTA or per kernel). The sleep between
// polls starts at min_ns and doubles up to max_ns.
template <class Done>
__device__ __forceinline__ bool timed_wait(const EpArgs& a, int phase, int peer, unsigned step, int index, int value,
                                           unsigned min_ns, unsigned max_ns, Done&& done) {
  const long long start = clock64();
  for (unsigned ns = min_ns;; ns = min(2 * ns, max_ns)) {
    if (done()) return true;
    if (ld_volatile(&a.status->kind) == int(EpErrorKind::kTimeout)) return false;
    if (clock64() - start > a.timeout_cycles) {
      record_fault(a, EpErrorKind::kTimeout, phase, peer, step, -1, index, value);
      return false;
    }
    __nanosleep(ns);
  }
}

// Spins until the flag carries `step` in its upper half; returns the flag, or 0 (timed_wait).
__device__ __forceinline__ uint64_t wait_flag(const EpArgs& a, const uint64_t* flag, unsigned step, int phase, int peer) {
  uint64_t v = 0;
  const bool ok = timed_wait(a, phase, peer, step, -1, 0, 64, 64, [&] {
    v = ld_acquire_sys(flag);
    return unsigned(v >> 32) == step;
  });
  return ok ? v : 0;
}

// Every EP kernel's first call: under a programmatic dependent launch (EpBuffer::set_overlap)
// the kernel may have been scheduled while the previous kernel on the stream still runs, so it
// waits for that kernel (and everything before it) before it reads any state, then lets the next
// kernel on the stream be scheduled. Without the launch attribute both are no-ops. Thread 0 of
// each CTA stamps the stage clock when the CTA starts its work.
//
// The dispatch receive is the exception: the kernel before it is this rank's own dispatch send,
// and everything the receive reads of a send (its own included) it reads behind that send's flag,
// with acquire loads; what else it touches the send never writes. So it does not wait for the
// send kernel to complete (a grid's completion behind its system-scope fences took 4.5 us at
// decode sizes, stage clock), only for its flags. What comes after it still waits for it, and the
// flag's release covers every write of the send (the self slab too), so the chain stays ordered.
// (The trigger is safe here too: the send triggered only after its own wait, so every kernel
// before the send is complete when a kernel after the receive is scheduled.)
__device__ __forceinline__ void begin_ep_kernel(const EpArgs& a, int phase) {
  if (phase == kPhaseDispatchRecv) {
    ptx::launch_dependents();
    if (threadIdx.x == 0 && a.stamps) stamp_start(a.stamps + 2 * phase);
    return;
  }
  begin_kernel(a.stamps ? a.stamps + 2 * phase : nullptr);
}

// The step this kernel runs: one past the last completed step of its phase. Read by every CTA
// before it signs off in finish_cta(), so the last CTA may advance it.
__device__ __forceinline__ unsigned current_step(const EpArgs& a, int phase) {
  return *reinterpret_cast<volatile unsigned*>(&a.ctr->step[phase]) + 1;
}

// Orders this thread's (and, through a preceding barrier, its CTA's) earlier writes before its
// later ones for every observer in the system, peers' GPUs included. acq_rel, not sc: the EP
// protocols are message passing (payload, then flag), which never needs the sequential
// consistency of __threadfence_system() (MEMBAR.SC.SYS, far slower than MEMBAR.ALL.SYS).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// The CTA sign-off counter: release of this CTA's work, acquire of every earlier CTA's. GPU scope:
// the CTAs of one kernel share the GPU, and causality is transitive, so a later system-scope
// release (a peer's flag) still covers what the counter ordered.
__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Every CTA calls this once at its end (all threads). Returns true in the last CTA to finish; its
// threads then see every CTA's writes (the counter's acquire, spread over the CTA by the barrier).
// `wrote_peers`: send kernels, whose payload went into peers' memory (over NVLink for `nvlink`):
// thread 0 fences at system scope after the barrier, so the CTA's payload is visible system-wide
// before the counter can make the last CTA raise a flag. Receive kernels wrote only this rank's
// outputs, which the next kernel on the stream reads: the counter alone orders the CTAs' reads of
// the step before the last CTA advances it.
__device__ __forceinline__ bool finish_cta(const EpArgs& a, int phase, bool wrote_peers) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (wrote_peers) fence_acq_rel_sys();
    last = atom_add_acq_rel_gpu(&a.ctr->done[phase], 1u) == gridDim.x - 1;
    if (a.stamps) stamp_end(a.stamps + 2 * phase);
  }
  __syncthreads();
  return last;
}
__device__ __forceinline__ void advance_step(const EpArgs& a, int phase, unsigned step) {
  a.ctr->step[phase] = step;
  a.ctr->done[phase] = 0;
}

// The validity rule for top-k entries, evaluated by a whole warp: lane = group * k + j holds
// entry j of the group's token (several tokens per warp when k < 32). An entry is valid when its
// slot is in [0, num_slots) and no earlier entry of the token has the same slot; -1 is "no expert".
// first_on_rank marks the first valid entry of the token on its rank (that entry's lane sends the
// message). Every lane of the warp must call it.
struct EntryInfo {
  bool valid;
  bool first_on_rank;
  int rank;   // slot / E_loc for valid entries, -1 otherwise
  int fault;  // 0, or EpErrorKind::kBadSlot / kDuplicateSlot
};
// The key of an entry that takes no part in a match: one value for every such lane, not one per
// lane, since only the participating lanes read their masks and a match over fewer distinct
// values is cheaper (keys of real entries stay below it: group < 32, slot < 2^20).
constexpr int kNoMatchKey = 1 << 30;
__device__ __forceinline__ EntryInfo classify_entry(int slot, bool active, int group, int num_slots, int local_experts) {
  const int lane = threadIdx.x & 31;
  const unsigned earlier = (1u << lane) - 1;
  const bool in_range = active && slot >= 0 && slot < num_slots;
  const unsigned same_slot = __match_any_sync(0xFFFFFFFFu, in_range ? (group << 20) | slot : kNoMatchKey);
  EntryInfo e;
  e.valid = in_range && (same_slot & earlier) == 0;
  e.rank = e.valid ? slot / local_experts : -1;
  const unsigned same_rank = __match_any_sync(0xFFFFFFFFu, e.valid ? (group << 20) | e.rank : kNoMatchKey);
  e.first_on_rank = e.valid && (same_rank & earlier) == 0;
  e.fault = !active || slot == -1 ? 0
            : !in_range           ? int(EpErrorKind::kBadSlot)
            : !e.valid            ? int(EpErrorKind::kDuplicateSlot)
                                  : 0;
  return e;
}

// A top-k entry's code, as the send plans it and a message carries it (ep_state.cuh): the local
// expert and the entry's row position among its source's rows of that expert; -1 for no row.
__device__ __forceinline__ int pack_entry(int local_expert, int pos) { return (local_expert << 16) | pos; }
__device__ __forceinline__ int entry_expert(int code) { return code >> 16; }
__device__ __forceinline__ int entry_pos(int code) { return code & 0xFFFF; }

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// The larger magnitude of two bf16 pairs, pair by pair, in one instruction (max.xorsign.abs: the
// result's magnitude is max(|a|, |b|), its sign bit a XOR the caller drops). kKeepNan: a NaN wins
// (so a pair folded over a chunk has an all-ones exponent iff the chunk holds a NaN or an
// infinity); else a NaN loses to the other operand, as fmaxf's does.
template <bool kKeepNan>
__device__ __forceinline__ uint32_t bf16x2_absmax(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (kKeepNan) asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// The four pairs of a 16-byte chunk folded into one pair.
template <bool kKeepNan>
__device__ __forceinline__ uint32_t bf16x8_absmax(uint4 v) {
  return bf16x2_absmax<kKeepNan>(bf16x2_absmax<kKeepNan>(v.x, v.y), bf16x2_absmax<kKeepNan>(v.z, v.w));
}
// The magnitude of a folded pair as one float (the larger of its halves), and whether both are finite.
__device__ __forceinline__ float bf16x2_fold_max(uint32_t m) {
  return fmaxf(bf16_lo(m & 0x7FFF7FFFu), bf16_hi(m & 0x7FFF7FFFu));
}
__device__ __forceinline__ bool bf16x2_finite(uint32_t m) {
  return (m & 0x7F80u) != 0x7F80u && (m & 0x7F800000u) != 0x7F800000u;
}

}  // namespace moekit::gpu
