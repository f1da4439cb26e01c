// stamp.cuh: the stage clock of a timed step, from the GPU's own global timer.
//
// A kernel given a stamp pair (two unsigned long longs: [0] first start, [1] last end, in
// %globaltimer nanoseconds) records when its first CTA began work and when its last CTA
// finished, with one atomic per CTA each. A null pair records nothing (the normal case).
// The owner of the pairs resets them before the step (start to ~0, end to 0), so a pair that
// a kernel never touched reads back as "did not run". The timer is coarse (about a
// microsecond on Hopper) but it is the one clock every kernel of every stream shares, which is
// what a timeline of overlapping stages needs (CUDA events order themselves on one stream).
#pragma once

#include <cuda_runtime.h>

namespace moekit {

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Called by one thread per CTA when the CTA starts its work.
__device__ __forceinline__ void stamp_start(unsigned long long* pair) {
  if (pair) atomicMin(pair, global_timer_ns());
}

// Called by one thread per CTA when the CTA's work is done.
__device__ __forceinline__ void stamp_end(unsigned long long* pair) {
  if (pair) atomicMax(pair + 1, global_timer_ns());
}

}  // namespace moekit
