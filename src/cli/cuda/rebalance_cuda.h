// `moekit run --rebalance --backend cuda`: the loop's backend on one GPU (run_rebalance.h). The L
// layers run as P virtual ranks over the `local` transport on one stream; a plan's moves are the
// layers' staged moves (layer.h begin_moves .. commit_moves) from the peers' slots: before each
// step, chunks of at most --copy-gbps x the last step's time, issued right before its kernels so
// that they run beside it; once all are out, one barrier step, then the switch.
#pragma once

#include <memory>

#include "cli/run_rebalance.h"

namespace moekit::cli {

std::unique_ptr<RebalanceBackend> make_cuda_backend(const RebalanceRunInput& in, const Placement& placement,
                                                    int max_tokens);

}  // namespace moekit::cli
