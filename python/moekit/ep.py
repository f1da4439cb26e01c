"""Expert-parallel dispatch and combine with DeepEP's call shapes.

`LocalGroup` is P ranks inside this process (moekit's `local` transport); `group.buffer(rank)`
is one rank's `Buffer`, whose methods take and return what DeepEP's `Buffer` does:

    (recv_x, recv_scales), recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, topk_weights=topk_weights,
        return_recv_hook=True)
    hook()                                    # the receive: recv_* are valid after it
    y = ...grouped GEMMs on (recv_x, recv_scales) with masked_m = recv_count...
    combined_x, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

Differences from DeepEP, each because of what moekit's protocol does:
- topk_weights go with the dispatch (keyword `topk_weights=`): the messages carry them, so the
  receiving rank sums a token's local experts before sending one vector back;
  low_latency_combine takes them too, for the same call shape, and checks their shape.
- topk_idx holds physical slots (EPLB's replica choice already made), int32 or int64.
- The receive tensors are the buffer's own, allocated once with the framework of the first x
  and overwritten by the next dispatch (DeepEP's buffers behave the same way).
- device="cpu" (ranks are threads): run each rank on its own thread (`group.run(fn)`) or, on
  one thread, call every rank's send (return_recv_hook=True) before any rank's hook.
  device="cuda" (ep.h, P virtual ranks on the current GPU, low-latency mode): every call is a
  kernel on PyTorch's current stream, so the whole step can be captured by torch.cuda.graph; on
  one stream every rank's send must come before any rank's receive, hence
  return_recv_hook=True is required there. `group.check()` synchronises and raises the faults a
  kernel recorded (a timeout, a bad slot). The receive tensors are the group's device memory.
"""

from concurrent.futures import ThreadPoolExecutor

from . import _core
from ._tensors import BF16, FP8, I32, _torch, dl, empty, empty_mn_major, shape_of, stream_of


def run_ranks(num_ranks, fn):
    """fn(rank) for every rank, each on its own thread (moekit releases the GIL while a rank waits
    for its peers); returns the results in rank order and re-raises the first error."""
    with ThreadPoolExecutor(max_workers=num_ranks) as pool:
        futures = [pool.submit(fn, rank) for rank in range(num_ranks)]
        return [f.result() for f in futures]


class Handle:
    """What a dispatch hands to its combine: the step it belongs to, the rank's token count and
    the source map of the received rows (recv_src: src_rank * T_max + src_token)."""

    def __init__(self, rank, step, num_tokens, recv_src, total_m=None):
        self.rank, self.step, self.num_tokens, self.recv_src, self.total_m = rank, step, num_tokens, recv_src, total_m


class LocalGroup:
    """P in-process ranks of one expert-parallel group (ep_cpu.h).

    num_experts counts physical slots (experts plus redundant replicas), a multiple of num_ranks;
    rank r holds slots [r * E_loc, (r + 1) * E_loc). hidden is a multiple of 128."""

    def __init__(self, num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk,
                 block_m=64, timeout_s=30.0, device="cpu"):
        self.is_cuda = str(device).startswith("cuda")
        if self.is_cuda:
            if not hasattr(_core, "CudaEpGroup"):
                raise ValueError("device='cuda': this moekit was built without CUDA")
            self.core = _core.CudaEpGroup(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_topk, num_experts,
                                          timeout_s)
        else:
            self.core = _core.LocalEpGroup(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_topk, num_experts,
                                           block_m, timeout_s)
        self.buffers = [Buffer(self, r) for r in range(num_ranks)]

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

    def buffer(self, rank):
        return self.buffers[rank]

    def run(self, fn):
        """fn(buffer) on every rank, each on its own thread; returns the results in rank order."""
        return run_ranks(self.num_ranks, lambda rank: fn(self.buffers[rank]))


class Buffer:
    """One rank of a LocalGroup, with DeepEP's Buffer methods."""

    def __init__(self, group, rank):
        self.group, self.rank = group, rank
        self.step = 0
        self._recv = None  # (recv_x, recv_scales, recv_count, recv_src), allocated at the first dispatch

    @property
    def num_ranks(self):
        return self.group.num_ranks

    def _check_sizes(self, num_max_dispatch_tokens_per_rank, num_experts):
        core = self.group.core
        if num_max_dispatch_tokens_per_rank != core.max_tokens or num_experts != core.num_slots:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank = {num_max_dispatch_tokens_per_rank} and num_experts = "
                f"{num_experts} must be the group's ({core.max_tokens}, {core.num_slots})")

    def _receive_tensors(self, like):
        if self._recv is None and self.group.is_cuda:
            import torch
            recv_x, recv_scales, recv_count, recv_src = self.group.core.outputs(self.rank)
            self._recv = (recv_x.view(torch.float8_e4m3fn), recv_scales, recv_count, recv_src)
        if self._recv is None:
            core = self.group.core
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
            raise ValueError("use_fp8=False: moekit dispatches FP8 (1x128 scales) only")
        self._check_sizes(num_max_dispatch_tokens_per_rank, num_experts)
        num_tokens = shape_of(x, "x")[0]
        recv_x, recv_scales, recv_count, recv_src = self._receive_tensors(x)
        core = self.group.core
        if self.group.is_cuda:
            if not return_recv_hook:
                raise ValueError("device='cuda' runs every rank on one stream: pass return_recv_hook=True and call "
                                 "the hooks after every rank has sent")
            if topk_idx.dtype != _torch_int32():
                topk_idx = topk_idx.to(_torch_int32())  # DeepEP's int64 indices; the kernels read int32
            stream = stream_of(x)
            core.dispatch_send(self.rank, x, topk_idx, topk_weights, stream)

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
        self._check_handle(handle)
        shape = shape_of(topk_weights, "topk_weights")
        if tuple(shape) != (handle.num_tokens, self.group.core.topk):
            raise ValueError(f"topk_weights must have shape [{handle.num_tokens}, {self.group.core.topk}] "
                             f"(the dispatch's), got {list(shape)}")
        if out is None:
            out = empty(x, (handle.num_tokens, self.group.core.hidden), BF16)
        core = self.group.core
        if self.group.is_cuda:
            if not return_recv_hook:
                raise ValueError("device='cuda' runs every rank on one stream: pass return_recv_hook=True and call "
                                 "the hooks after every rank has sent")
            core.combine_send(self.rank, x, stream_of(x))

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

    def dispatch(self, x, topk_idx, topk_weights, *, async_finish=False):
        """Normal mode: counts first, then the rows in the contiguous layout of the contiguous GEMM.
        -> ((recv_x [M_total, hidden] fp8, recv_scales [M_total, hidden/128] MN-major),
            m_indices [M_total] int32 (local expert per row, -1 padding),
            num_recv_tokens_per_expert_list, handle, event).
        Every rank must call it (each waits for its peers' counts), so use group.run()."""
        core = self.group.core
        if self.group.is_cuda:
            raise ValueError("normal mode on device='cuda' has no binding yet: use a CPU group")
        layout = core.normal_notify(self.rank, topk_idx)
        total_m, hidden = layout["total_m"], core.hidden
        recv_x, recv_scales = empty(x, (total_m, hidden), FP8), empty_mn_major(x, (total_m, hidden // 128))
        m_indices, recv_src = empty(x, (total_m,), I32), empty(x, (total_m,), I32)
        core.normal_dispatch_send(self.rank, layout["num_tokens"], x, topk_weights)
        core.normal_dispatch_recv(self.rank, total_m, dl(recv_x), recv_scales, m_indices, recv_src)
        self.step += 1
        handle = Handle(self.rank, self.step, layout["num_tokens"], recv_src, total_m)
        return (recv_x, recv_scales), m_indices, layout["expert_rows"], handle, None

    def combine(self, x, handle, *, add=None, out=None, async_finish=False):
        """Normal mode: x [M_total, hidden] bf16 (the contiguous GEMM's output) -> (combined_x
        [T, hidden] bf16, None, event), the same sums as low_latency_combine."""
        self._check_handle(handle)
        if out is None:
            out = empty(x, (handle.num_tokens, self.group.core.hidden), BF16)
        self.group.core.normal_combine_send(self.rank, handle.total_m, x)
        self.group.core.combine_recv(self.rank, handle.num_tokens, add, out)
        return out, None, None

    def stats(self):
        """What this rank moved in its last step (messages, bytes, distinct targets per token)."""
        return self.group.core.stats(self.rank)

    def _check_handle(self, handle):
        if not isinstance(handle, Handle) or handle.rank != self.rank or handle.step != self.step:
            raise ValueError("handle must be the one returned by this rank's latest dispatch")


def _torch_int32():
    return _torch().int32


def _done():
    """The hook of a call made without return_recv_hook: the receive already ran."""
