// Internal to src/ep/cuda: device helpers every EP kernel uses: system-scope flags, the
// timed wait, the status word, the last-CTA step counter and the top-k entry rule.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ep_state.cuh"
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

// Spins until the flag carries `step` in its upper half; returns the flag, or 0 on a timeout
// (recorded) or when another wait of this rank already timed out (so one dead peer costs one
// timeout, not one per CTA or per kernel).
__device__ __forceinline__ uint64_t wait_flag(const EpArgs& a, const uint64_t* flag, unsigned step, int phase, int peer) {
  const long long start = clock64();
  for (;;) {
    const uint64_t v = ld_acquire_sys(flag);
    if (unsigned(v >> 32) == step) return v;
    const int kind = ld_volatile(&a.status->kind);
    if (kind == int(EpErrorKind::kTimeout)) return 0;
    if (clock64() - start > a.timeout_cycles) {
      record_fault(a, EpErrorKind::kTimeout, phase, peer, step, -1, -1, 0);
      return 0;
    }
    __nanosleep(64);
  }
}

// The step this kernel runs: one past the last completed step of its phase. Read by every CTA
// before it signs off in finish_cta(), so the last CTA may advance it.
__device__ __forceinline__ unsigned current_step(const EpArgs& a, int phase) {
  return *reinterpret_cast<volatile unsigned*>(&a.ctr->step[phase]) + 1;
}

// Every CTA calls this once at its end (all threads). Returns true in the last CTA to finish,
// after a fence that orders every CTA's earlier writes (system scope) before what it does next.
__device__ __forceinline__ bool finish_cta(const EpArgs& a, int phase) {
  __shared__ int last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned prev = atomicAdd(&a.ctr->done[phase], 1u);
    last = prev == gridDim.x - 1;
    if (last) __threadfence_system();
  }
  __syncthreads();
  return last;
}
__device__ __forceinline__ void advance_step(const EpArgs& a, int phase, unsigned step) {
  a.ctr->step[phase] = step;
  a.ctr->done[phase] = 0;
}

// Top-k entry j of a token after the validity rule: the slot, -1 for "no expert", -2 for a slot
// out of [-1, num_slots), -3 for a slot already taken by an earlier entry of the token.
__device__ __forceinline__ int entry_slot(const int32_t* row, int j, int num_slots) {
  const int v = row[j];
  if (v == -1) return -1;
  if (v < -1 || v >= num_slots) return -2;
  for (int i = 0; i < j; ++i)
    if (row[i] == v) return -3;
  return v;
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

}  // namespace moekit::gpu
