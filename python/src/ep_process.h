// python/src/ep_process.h: one rank of an expert-parallel group that spans processes (one process
// per GPU), the binding's side of moekit.Buffer and moekit.MoELayer over a torch.distributed
// process group. The Python package talks over the caller's group; this turns what it brings back
// into connect_ep's EpProcessGroup, so the peers are mapped by the same code as launch_ranks' ranks.
#pragma once
#if defined(MOEKIT_WITH_CUDA)

#include <nanobind/nanobind.h>

#include <memory>
#include <string>

#include "moekit/ep.h"

namespace moekit::py {

// "nvlink" or "nccl"; anything else is a ValueError naming it.
gpu::EpTransport transport_arg(const std::string& transport);

// rank of num_ranks on CUDA device `device`. nccl_unique_id: the 128 bytes one rank made with
// _core.nccl_unique_id() (`nccl`), empty for `nvlink`. all_gather: a Python callable bytes ->
// bytes returning every rank's bytes in rank order (`nvlink` swaps its CUDA IPC handles with it),
// None for `nccl`. Called with the GIL held (the callable runs inside); restores the current device.
std::unique_ptr<gpu::EpBuffer> connect_process(const gpu::EpConfig& config, int rank, int num_ranks, int device,
                                               const std::string& transport, nanobind::bytes nccl_unique_id,
                                               nanobind::handle all_gather);

}  // namespace moekit::py

#endif  // MOEKIT_WITH_CUDA
