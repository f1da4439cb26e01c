// cuda_graph.h: CapturedGraph, the work a callable issues on a stream, captured once as a CUDA
// Graph and instantiated, for replays with launch().
//
// The capture is ended even when the callable throws (a moekit::Error from a bad argument, say),
// so a failure never leaves the stream capturing, which would make every later CUDA call on it
// fail. The capture mode is thread-local: work other threads issue meanwhile is not captured and
// does not break the capture.
#pragma once

#include <cuda_runtime.h>

#include "moekit/cuda_check.h"

namespace moekit {

class CapturedGraph {
 public:
  template <class Issue>
  CapturedGraph(cudaStream_t stream, Issue&& issue) {
    MOEKIT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      issue();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph_);  // (its own error, if any, is the lesser one)
      if (graph_) cudaGraphDestroy(graph_);
      throw;
    }
    MOEKIT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    MOEKIT_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  void launch(cudaStream_t stream) const { MOEKIT_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace moekit
