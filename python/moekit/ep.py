"""Expert-parallel dispatch and combine with DeepEP's call shapes.

`LocalGroup` is P ranks inside this process (moekit's `local` transport); `group.buffer(rank)`
is one rank's `Buffer`, whose methods take and return what DeepEP's `Buffer` does:

    (recv_x, recv_scales), recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, topk_weights=topk_weights,
        return_recv_hook=True)
    hook()                                    # the receive: recv_* are valid after it
    y = ...grouped GEMMs on (recv_x, recv_scales) with masked_m = recv_count...
    combined_x, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

Normal mode (prefill) is `dispatch` / `combine`: the rows arrive in the contiguous layout of the
contiguous grouped GEMM (each local expert's segment padded to block_m, m_indices = -1 on padding).

Differences from DeepEP, each because of what moekit's protocol does:
- topk_weights go with the dispatch (keyword `topk_weights=`): the messages carry them, so the
  receiving rank sums a token's local experts before sending one vector back;
  low_latency_combine takes them too, for the same call shape, and checks their shape.
- topk_idx holds physical slots (EPLB's replica choice already made), int32 or int64.
- The receive tensors are the buffer's own, allocated once with the framework of the first x
  and overwritten by the next dispatch (DeepEP's buffers behave the same way); the CPU group's
  normal mode allocates them per step (M_total changes with the routing).
- device="cpu" (ranks are threads): run each rank on its own thread (`group.run(fn)`) or, in
  low-latency mode on one thread, call every rank's send (return_recv_hook=True) before any
  rank's hook. Normal mode exchanges the counts inside `dispatch` (every rank waits for its
  peers'), so it needs a thread per rank.
  device="cuda" (ep.h, P virtual ranks on the current GPU): the group serves one mode, chosen by
  `protocol` ("low-latency" or "normal"), because ep.h sizes its receive buffers for one layout.
  Every call is a kernel on PyTorch's current stream, so the whole step can be captured by
  torch.cuda.graph; on one stream every rank's send must come before any rank's receive, hence
  return_recv_hook=True is required there (normal mode too). `group.check()` synchronises and
  raises the faults a kernel recorded (a timeout, a bad slot, a step over max_recv_rows). The
  receive tensors are the group's device memory at fixed addresses; in normal mode they span
  the buffers' max_recv_rows rows, of which the step fills recv_total_rows (on the device, so
  nothing synchronises) and marks the rest with m_indices = -1, which the contiguous GEMM skips.

`Buffer(group, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk, transport=...)`
is one rank per process, over a torch.distributed process group (_process.py says how the ranks
connect): the CUDA group's calls and tensors as above, for this process's rank only, so the hooks
are optional again (return_recv_hook=False receives at once, as in DeepEP), and `buf.check()`
raises the faults its kernels recorded, a peer that never answered named by its rank.
"""

from concurrent.futures import ThreadPoolExecutor

from . import _core, _process
from ._tensors import BF16, FP8, I32, _torch, dl, empty, empty_mn_major, is_torch, shape_of, stream_of

PROTOCOLS = ("low-latency", "normal")


def _protocol(protocol):
    """'low-latency' (or 'low_latency') or 'normal'; ValueError naming anything else."""
    name = protocol.replace("_", "-") if isinstance(protocol, str) else protocol
    if name not in PROTOCOLS:
        raise ValueError(f"protocol = {protocol!r}: expected 'low-latency' or 'normal'")
    return name


def run_ranks(num_ranks, fn):
    """fn(rank) for every rank, each on its own thread (moekit releases the GIL while a rank waits
    for its peers); returns the results in rank order and re-raises the first error."""
    with ThreadPoolExecutor(max_workers=num_ranks) as pool:
        futures = [pool.submit(fn, rank) for rank in range(num_ranks)]
        return [f.result() for f in futures]


class Handle:
    """What a dispatch hands to its combine: the step it belongs to, the rank's token count and
    the source map of the received rows (recv_src: src_rank * T_max + src_token, -1 on padding).
    Normal mode: total_m, the rows of the contiguous tensors (the step's M_total on the CPU, the
    buffers' max_recv_rows on CUDA, where recv_total_rows [1] holds the step's M_total)."""

    def __init__(self, rank, step, num_tokens, recv_src, total_m=None, recv_total_rows=None):
        self.rank, self.step, self.num_tokens, self.recv_src, self.total_m = rank, step, num_tokens, recv_src, total_m
        self.recv_total_rows = recv_total_rows


class LocalGroup:
    """P in-process ranks of one expert-parallel group (ep_cpu.h on the CPU, ep.h on CUDA).

    num_experts counts physical slots (experts plus redundant replicas), a multiple of num_ranks;
    rank r holds slots [r * E_loc, (r + 1) * E_loc). hidden is a multiple of 128.
    protocol: "low-latency" or "normal", the mode of a CUDA group's buffers (the CPU group serves
    both). block_m: normal mode's segment padding; None is 64 on the CPU and 128 on CUDA, the
    padding the CUDA contiguous GEMM needs. max_recv_rows (CUDA, normal mode): rows of the
    contiguous receive buffers, rounded up to a multiple of 128 and of block_m; None sizes them
    for the worst case (every token of every rank on min(k, E_loc) local experts). fp8_scaling:
    how the dispatch scales each token's FP8 values, "1x128" (one scale per 128 columns, DeepEP's) or
    "per-token" (one scale for the whole row, written into each of its hidden/128 scale slots, so
    recv_scales keeps its shape; the per-token FP8 of vLLM and TensorRT-LLM)."""

    def __init__(self, num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk,
                 block_m=None, timeout_s=30.0, device="cpu", protocol="low-latency", max_recv_rows=None,
                 fp8_scaling="1x128"):
        self.is_cuda = str(device).startswith("cuda")
        self.protocol = _protocol(protocol)
        if max_recv_rows is not None and not (self.is_cuda and self.protocol == "normal"):
            raise ValueError(f"max_recv_rows = {max_recv_rows} sizes the contiguous receive buffers of a CUDA group "
                             "made with protocol='normal'; leave it None here (low-latency mode has none, the CPU "
                             "group sizes its tensors per step)")
        if self.is_cuda:
            if not hasattr(_core, "CudaEpGroup"):
                raise ValueError("device='cuda': this moekit was built without CUDA")
            self.core = _core.CudaEpGroup(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_topk, num_experts,
                                          timeout_s, protocol=self.protocol,
                                          block_m=128 if block_m is None else block_m,
                                          max_recv_rows=max_recv_rows or 0, fp8_scaling=fp8_scaling)
        else:
            self.core = _core.LocalEpGroup(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_topk, num_experts,
                                           64 if block_m is None else block_m, timeout_s, fp8_scaling=fp8_scaling)
        self.buffers = [Buffer._of(self, self, r) for r in range(num_ranks)]

    @property
    def shares_stream(self):
        """CUDA: every rank's kernels go on one stream, so every send must precede any receive."""
        return self.is_cuda

    def check(self):
        """CUDA: waits for the current stream and raises moekit.Error for any fault a rank's kernel
        recorded (nothing to do on the CPU, where errors are raised by the calls themselves)."""
        if self.is_cuda:
            import torch
            for r in range(self.num_ranks):
                self.core.check(r, torch.cuda.current_stream().cuda_stream)

    @property
    def num_ranks(self):
        return self.core.num_ranks

    @property
    def max_recv_rows(self):
        """CUDA, normal mode: the rows of every rank's contiguous receive tensors, the shape
        [max_recv_rows, hidden] that combine's x (the contiguous GEMM's output) must have."""
        if not (self.is_cuda and self.protocol == "normal"):
            raise ValueError("max_recv_rows belongs to a CUDA group made with protocol='normal'")
        return self.core.max_recv_rows

    def buffer(self, rank):
        return self.buffers[rank]

    def run(self, fn):
        """fn(buffer) on every rank, each on its own thread; returns the results in rank order."""
        return run_ranks(self.num_ranks, lambda rank: fn(self.buffers[rank]))


class _OwnRank:
    """The EP state behind a Buffer over a process group: this process's one rank on its GPU."""
    is_cuda = True
    shares_stream = False

    def __init__(self, core, protocol):
        self.core, self.protocol = core, protocol

    @property
    def num_ranks(self):
        return self.core.num_ranks

    @property
    def max_recv_rows(self):
        if self.protocol != "normal":
            raise ValueError("max_recv_rows belongs to a buffer made with protocol='normal'")
        return self.core.max_recv_rows


class Buffer:
    """DeepEP's Buffer: one rank of expert parallelism. Made here, it is this process's rank of
    `group`, a torch.distributed ProcessGroup with one process per GPU; LocalGroup.buffer(r) is one
    of P ranks inside this process.

    Every rank of the group constructs it with the same arguments (a collective; any argument that
    differs from rank 0's raises moekit.Error on every rank). num_experts counts physical slots, a
    multiple of the group's size; hidden a multiple of 128. transport: "nvlink" (CUDA IPC mapping
    of the peers' memory: the kernels write into it) or "nccl" (grouped send/receive after each
    send kernel). protocol: "low-latency" (low_latency_dispatch / low_latency_combine, masked
    layout) or "normal" (dispatch / combine, contiguous layout). block_m, max_recv_rows: as for
    LocalGroup(device="cuda"). timeout_s: how long a kernel waits for a peer before recording a
    fault that check() raises. fp8_scaling: as for LocalGroup. The rank is group.rank(), the GPU
    torch.cuda.current_device()."""

    def __init__(self, group, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk, *, transport="nvlink",
                 protocol="low-latency", block_m=None, max_recv_rows=None, timeout_s=30.0, fp8_scaling="1x128"):
        what = "moekit.Buffer"
        _process.check_transport(transport)
        protocol = _protocol(protocol)
        if max_recv_rows is not None and protocol != "normal":
            raise ValueError(f"max_recv_rows = {max_recv_rows} sizes the contiguous receive buffers of "
                             "protocol='normal'; leave it None in low-latency mode")
        _process.check_group(group, what)
        if not hasattr(_core, "CudaEpGroup"):
            raise ValueError(f"{what} over a process group runs on CUDA: this moekit was built without CUDA")
        args = dict(num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=hidden,
                    num_experts=num_experts, num_topk=num_topk, transport=transport, protocol=protocol,
                    block_m=128 if block_m is None else block_m, max_recv_rows=max_recv_rows or 0,
                    timeout_s=float(timeout_s), fp8_scaling=fp8_scaling)
        exchange = _process.connect_args(group, transport, args, what)
        core = _core.CudaEpGroup.connect(**exchange, max_tokens=num_max_dispatch_tokens_per_rank, hidden=hidden,
                                         topk=num_topk, num_slots=num_experts, timeout_s=args["timeout_s"],
                                         protocol=protocol, block_m=args["block_m"],
                                         max_recv_rows=args["max_recv_rows"], fp8_scaling=fp8_scaling)
        self._init(_OwnRank(core, protocol), group, exchange["rank"])

    @classmethod
    def _of(cls, ep, group, rank):
        """Rank `rank` of an in-process group `ep` (a LocalGroup, which is also its `group`)."""
        self = cls.__new__(cls)
        self._init(ep, group, rank)
        return self

    def _init(self, ep, group, rank):
        self._ep = ep  # what the calls go to: a LocalGroup or this process's _OwnRank
        self.group, self.rank = group, rank
        self.step = 0
        self._recv = None  # the receive tensors of the buffer's mode, made at the first dispatch

    @property
    def num_ranks(self):
        return self._ep.num_ranks

    group_size = num_ranks  # DeepEP's name

    @property
    def protocol(self):
        """The mode of a CUDA buffer's layout, "low-latency" or "normal" (the CPU group serves both)."""
        return self._ep.protocol

    @property
    def num_local_experts(self):
        """E_loc: the slots this rank holds, [rank * E_loc, (rank + 1) * E_loc)."""
        return self._ep.core.num_local_experts

    @property
    def max_recv_rows(self):
        """CUDA, normal mode: the rows of the contiguous receive tensors, the shape
        [max_recv_rows, hidden] that combine's x (the contiguous GEMM's output) must have."""
        return self._ep.max_recv_rows

    def check(self):
        """CUDA: waits for PyTorch's current stream and raises moekit.Error for a fault this rank's
        kernels recorded (a peer that did not answer within timeout_s, named by its rank; a bad
        slot; a step over max_recv_rows). Nothing to do on the CPU."""
        if self._ep.is_cuda:
            self._ep.core.check(self.rank, _torch().cuda.current_stream().cuda_stream)

    def _check_sizes(self, num_max_dispatch_tokens_per_rank, num_experts):
        core = self._ep.core
        if num_max_dispatch_tokens_per_rank != core.max_tokens or num_experts != core.num_slots:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank = {num_max_dispatch_tokens_per_rank} and num_experts = "
                f"{num_experts} must be the group's ({core.max_tokens}, {core.num_slots})")

    def _expect_cuda_protocol(self, protocol, call):
        """A CUDA group's buffers hold one mode's layout: the other mode's calls are refused before
        any kernel is queued (a send without its receive would leave the peers a step behind)."""
        if self._ep.is_cuda and self._ep.protocol != protocol:
            raise ValueError(f"{call} is {protocol} mode; this CUDA buffer was made with "
                             f"protocol='{self._ep.protocol}' (make one with protocol='{protocol}')")

    def _receive_tensors(self, like):
        """CUDA: the group's own memory of this rank, for its mode (ep.h's outputs). CPU, low-latency
        mode: tensors of like's framework, allocated once."""
        if self._recv is None and self._ep.is_cuda:
            import torch
            core = self._ep.core
            tensors = core.normal_outputs(self.rank) if self._ep.protocol == "normal" else core.outputs(self.rank)
            self._recv = (tensors[0].view(torch.float8_e4m3fn),) + tuple(tensors[1:])
        if self._recv is None:
            core = self._ep.core
            e, m, d = core.num_local_experts, core.max_m, core.hidden
            self._recv = (empty(like, (e, m, d), FP8), empty_mn_major(like, (e, m, d // 128)),
                          empty(like, (e,), I32), empty(like, (e, m), I32))
        return self._recv

    # ---- low-latency mode (decode) ----------------------------------------------------------------

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *, topk_weights=None,
                             use_fp8=True, async_finish=False, return_recv_hook=False):
        """x [T, hidden] bf16, topk_idx [T, k] slots -> ((recv_x [E_loc, M_max, hidden] fp8,
        recv_scales [E_loc, M_max, hidden/128] MN-major), recv_count [E_loc] int32, handle, event, hook).
        Rows of local expert e are ordered by source rank, then source token (layout.h); recv_count
        is the masked GEMM's masked_m. With return_recv_hook the receive waits for hook()."""
        if topk_weights is None:
            raise TypeError("topk_weights is required: moekit's dispatch carries the combine weights "
                            "(pass topk_weights=[T, k] float32)")
        if not use_fp8:
            raise ValueError("use_fp8=False: moekit dispatches FP8 only (1x128 or per-token scales: the group's "
                             "fp8_scaling)")
        self._check_sizes(num_max_dispatch_tokens_per_rank, num_experts)
        self._expect_cuda_protocol("low-latency", "low_latency_dispatch")
        num_tokens = shape_of(x, "x")[0]
        recv_x, recv_scales, recv_count, recv_src = self._receive_tensors(x)
        core = self._ep.core
        if self._ep.is_cuda:
            _expect_hook(self._ep, return_recv_hook)
            core.dispatch_send(self.rank, x, _int32_topk_idx(topk_idx), topk_weights, stream_of(x))

            def hook():
                core.dispatch_recv(self.rank, stream_of(x))
        else:
            core.dispatch_send(self.rank, x, topk_idx, topk_weights)

            def hook():
                core.dispatch_recv(self.rank, dl(recv_x), recv_scales, recv_count, recv_src)
        self.step += 1
        handle = Handle(self.rank, self.step, num_tokens, recv_src)

        if not return_recv_hook:
            hook()
            hook = _done
        return (recv_x, recv_scales), recv_count, handle, None, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, add=None, zero_copy=False, async_finish=False,
                            return_recv_hook=False, out=None):
        """x [E_loc, M_max, hidden] bf16 (the expert outputs in the received layout) -> (combined_x
        [T, hidden] bf16, event, hook): out[t] = add[t] + sum_j topk_weights[t, j] * y(t, j), summed in
        fp32 in a fixed order. `add` is an optional [T, hidden] bf16 term (the shared expert's output)."""
        self._expect_cuda_protocol("low-latency", "low_latency_combine")
        self._check_handle(handle)
        shape = shape_of(topk_weights, "topk_weights")
        if tuple(shape) != (handle.num_tokens, self._ep.core.topk):
            raise ValueError(f"topk_weights must have shape [{handle.num_tokens}, {self._ep.core.topk}] "
                             f"(the dispatch's), got {list(shape)}")
        if out is None:
            out = empty(x, (handle.num_tokens, self._ep.core.hidden), BF16)
        core = self._ep.core
        if self._ep.is_cuda:
            _expect_hook(self._ep, return_recv_hook)
            core.combine_send(self.rank, x, handle.num_tokens, add, out, stream_of(x))

            def hook():
                core.combine_recv(self.rank, handle.num_tokens, add, out, stream_of(out))
        else:
            core.combine_send(self.rank, x)

            def hook():
                core.combine_recv(self.rank, handle.num_tokens, add, out)

        if not return_recv_hook:
            hook()
            hook = _done
        return out, None, hook

    # ---- normal mode (prefill) ----------------------------------------------------------------

    def dispatch(self, x, topk_idx, topk_weights, *, async_finish=False, return_recv_hook=False):
        """Normal mode: counts first, then the rows in the contiguous layout of the contiguous GEMM.
        -> ((recv_x [M, hidden] fp8, recv_scales [M, hidden/128] MN-major),
            m_indices [M] int32 (local expert per row, -1 padding), num_recv_tokens_per_expert,
            handle, event), plus the hook when return_recv_hook (the receive waits for it).
        CPU: M is the step's M_total, the counts a list; every rank must call it on its own
        thread (each waits for its peers' counts), so use group.run().
        CUDA: the buffers' own tensors, M = max_recv_rows at fixed addresses; the step fills the
        first handle.recv_total_rows[0] rows and m_indices is -1 past them; the counts are
        recv_count [E_loc] int32 on the device. In a LocalGroup return_recv_hook=True is required:
        call every rank's dispatch, then every rank's hook."""
        core = self._ep.core
        if self._ep.is_cuda:
            self._expect_cuda_protocol("normal", "dispatch")
            _expect_hook(self._ep, return_recv_hook)
            num_tokens = shape_of(x, "x")[0]
            recv_x, recv_scales, m_indices, recv_src, recv_total_rows, recv_count = self._receive_tensors(x)
            core.dispatch_send(self.rank, x, _int32_topk_idx(topk_idx), topk_weights, stream_of(x))

            def hook():
                core.normal_dispatch_recv(self.rank, stream_of(x))
            self.step += 1
            handle = Handle(self.rank, self.step, num_tokens, recv_src, core.max_recv_rows, recv_total_rows)
            return _with_hook(((recv_x, recv_scales), m_indices, recv_count, handle, None), hook, return_recv_hook)

        layout = core.normal_notify(self.rank, topk_idx)
        total_m, hidden = layout["total_m"], core.hidden
        recv_x, recv_scales = empty(x, (total_m, hidden), FP8), empty_mn_major(x, (total_m, hidden // 128))
        m_indices, recv_src = empty(x, (total_m,), I32), empty(x, (total_m,), I32)
        core.normal_dispatch_send(self.rank, layout["num_tokens"], x, topk_weights)

        def hook():
            core.normal_dispatch_recv(self.rank, total_m, dl(recv_x), recv_scales, m_indices, recv_src)
        self.step += 1
        handle = Handle(self.rank, self.step, layout["num_tokens"], recv_src, total_m)
        result = (recv_x, recv_scales), m_indices, layout["expert_rows"], handle, None
        return _with_hook(result, hook, return_recv_hook)

    def combine(self, x, handle, *, add=None, out=None, async_finish=False, return_recv_hook=False):
        """Normal mode: x [M, hidden] bf16 (the contiguous GEMM's output, M as the dispatch's
        m_indices; rows with m_indices = -1 are not read) -> (combined_x [T, hidden] bf16, None,
        event), plus the hook when return_recv_hook; the same sums as low_latency_combine.
        CUDA, LocalGroup: return_recv_hook=True is required (every rank's combine, then every hook)."""
        self._expect_cuda_protocol("normal", "combine")
        self._check_handle(handle)
        core = self._ep.core
        if out is None:
            out = empty(x, (handle.num_tokens, core.hidden), BF16)
        if self._ep.is_cuda:
            _expect_hook(self._ep, return_recv_hook)
            core.combine_send(self.rank, x, handle.num_tokens, add, out, stream_of(x))

            def hook():
                core.combine_recv(self.rank, handle.num_tokens, add, out, stream_of(out))
        else:
            core.normal_combine_send(self.rank, handle.total_m, x)

            def hook():
                core.combine_recv(self.rank, handle.num_tokens, add, out)
        return _with_hook((out, None, None), hook, return_recv_hook)

    def stats(self):
        """What this rank moved in its last step (messages, bytes, distinct targets per token)."""
        return self._ep.core.stats(self.rank)

    def _check_handle(self, handle):
        if not isinstance(handle, Handle) or handle.rank != self.rank or handle.step != self.step:
            raise ValueError("handle must be the one returned by this rank's latest dispatch")


def _expect_hook(ep, return_recv_hook):
    if ep.shares_stream and not return_recv_hook:
        raise ValueError("device='cuda' runs every rank on one stream: pass return_recv_hook=True and call "
                         "the hooks after every rank has sent")


def _int32_topk_idx(topk_idx):
    """The CUDA kernels read int32 slots: DeepEP's int64 indices are narrowed by a PyTorch op on the
    current stream (captured with the step); any other dtype reaches the binding's TypeError."""
    torch = _torch()
    if is_torch(topk_idx) and topk_idx.dtype == torch.int64:
        return topk_idx.to(torch.int32)
    return topk_idx


def _with_hook(result, hook, return_recv_hook):
    """Normal mode's results keep their CPU shape; return_recv_hook appends the receive's hook."""
    if return_recv_hook:
        return result + (hook,)
    hook()
    return result


def _done():
    """The hook of a call made without return_recv_hook: the receive already ran."""
