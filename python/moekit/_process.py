"""How a buffer or a layer over a torch.distributed process group is connected (one process per
GPU, rank = the group's rank, device = torch.cuda.current_device()). The ranks swap what ep.h's
cross-process transports need through the caller's group:

    nvlink  every rank's CUDA IPC handle of its symmetric region, all-gathered over the group
            (moekit then loads no NCCL);
    nccl    an NCCL unique id that rank 0 makes, handed to every rank by the all-gather below.

Before anything is allocated the ranks all-gather their arguments: a rank whose arguments differ
from rank 0's, or that could not make its part, makes every rank raise moekit.Error naming it,
instead of leaving the others waiting in a collective. The mapping itself is the C++ core's
(connect_ep), the same as for ranks started by its own launcher.
"""

import os

from . import _core
from ._tensors import _torch

TRANSPORTS = ("nvlink", "nccl")


def check_transport(transport):
    if transport not in TRANSPORTS:
        raise ValueError(f"transport = {transport!r}: expected 'nvlink' or 'nccl'")


def check_group(group, what):
    """`group` must be a torch.distributed ProcessGroup; TypeError naming what it is otherwise."""
    if _torch() is not None:  # a ProcessGroup exists only where PyTorch was imported
        import torch.distributed as dist
        if dist.is_available() and isinstance(group, dist.ProcessGroup):
            return
    raise TypeError(f"{what}: group must be a torch.distributed ProcessGroup (one process per GPU, e.g. "
                    f"torch.distributed.group.WORLD after init_process_group), got {type(group).__name__}")


def disagreement(entries, what):
    """entries[r] = {"args": dict, "error": str or None} from rank r. The first problem in words
    (a rank that failed, then the first argument that differs from rank 0's), or None."""
    for r, entry in enumerate(entries):
        if entry["error"]:
            return f"{what}: rank {r} failed before connecting: {entry['error']}"
    first = entries[0]["args"]
    for r, entry in enumerate(entries[1:], 1):
        for key in sorted(set(first) | set(entry["args"])):
            if entry["args"].get(key) != first.get(key):
                return (f"{what}: rank {r} has {key} = {entry['args'].get(key)!r}, rank 0 has {first.get(key)!r}; "
                        "every rank of the group must pass the same arguments")
    return None


def connect_args(group, transport, args, what):
    """The keyword arguments of _core's connect() for this process's rank of `group`: rank,
    num_ranks, device, transport, nccl_unique_id and all_gather. A collective: every rank of the
    group calls it with the same `args` (a dict of plain values)."""
    torch = _torch()
    rank, num_ranks = group.rank(), group.size()
    nccl_unique_id, error = b"", None
    if transport == "nccl":
        use_pytorch_nccl()
        if rank == 0:
            try:
                nccl_unique_id = _core.nccl_unique_id()
            except Exception as e:  # the peers must hear of it, not wait for NCCL's bootstrap
                error = str(e)
    entries = [None] * num_ranks
    torch.distributed.all_gather_object(entries, {"args": args, "error": error, "nccl_unique_id": nccl_unique_id},
                                        group=group)
    problem = disagreement(entries, what)
    if problem:
        raise _core.Error(problem)
    return dict(rank=rank, num_ranks=num_ranks, device=torch.cuda.current_device(), transport=transport,
                nccl_unique_id=entries[0]["nccl_unique_id"],
                all_gather=_all_gather_bytes(group) if transport == "nvlink" else None)


def _all_gather_bytes(group):
    """bytes -> every rank's bytes in rank order, over the caller's group (what nvlink swaps)."""
    def all_gather(mine):
        pieces = [None] * group.size()
        _torch().distributed.all_gather_object(pieces, mine, group=group)
        return b"".join(pieces)
    return all_gather


def use_pytorch_nccl():
    """moekit opens NCCL with dlopen (MOEKIT_NCCL_LIBRARY, else libnccl.so.2 on the loader's path).
    Where PyTorch's wheel brings NCCL (the package nvidia.nccl), that is the library
    torch.distributed has loaded, and moekit is pointed at it; a MOEKIT_NCCL_LIBRARY already set
    is kept."""
    if os.environ.get("MOEKIT_NCCL_LIBRARY"):
        return
    try:
        import nvidia.nccl
    except ImportError:
        return
    for folder in getattr(nvidia.nccl, "__path__", []):
        path = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.exists(path):
            os.environ["MOEKIT_NCCL_LIBRARY"] = path
            return
