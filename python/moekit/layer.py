"""The MoE layer over P in-process ranks (moekit's CPU reference layer, layer_cpu.h).

    moekit.write_random_weights("tiny-moe", "weights/")           # or a DeepSeek-style checkpoint
    layer = moekit.MoELayer("tiny-moe", "weights/", num_ranks=2, max_tokens=8)
    outs = layer.forward_all([x0, x1])                             # x_r [T_r, hidden] bf16, rank r's tokens

One step runs the whole decode step of docs/design.md §Decode data flow on every rank: gate,
replica choice, dispatch, GEMM1, SiLU·up + FP8, GEMM2, combine, plus the shared expert.

device="cuda" runs the GPU layer (layer.h): the P ranks are virtual ranks on the current GPU and
every kernel of a step goes on PyTorch's current stream, so `forward_all` can be captured by
torch.cuda.graph (call it once before capturing; the graph keeps each rank's token count).

With group= (a torch.distributed ProcessGroup, one process per GPU, device="cuda") the layer is
this process's rank of the group, connected over transport "nvlink" or "nccl" as moekit.Buffer
is; every rank calls `forward(layer.rank, x)` with its own tokens, and the step is capturable too:

    layer = moekit.MoELayer("tiny-moe", "weights/", max_tokens=8, device="cuda", group=group)
    out = layer.forward(layer.rank, x, first_token=...)         # x [T, hidden] bf16 on this GPU
"""

from . import _core, _process
from ._tensors import BF16, _torch, empty, shape_of, stream_of
from .ep import run_ranks

write_random_weights = _core.write_random_weights


class MoELayer:
    """One MoE layer of `model` (a spec name, JSON path or dict) with its weights from
    `weights_dir` (layer `layer` of the checkpoint), served by `num_ranks` in-process ranks of at
    most `max_tokens` tokens each. protocol: "low-latency" (masked GEMMs) or "normal" (contiguous);
    phy2log: the slots' logical experts (EPLB's placement of this layer), identity when None.
    group: a torch.distributed ProcessGroup instead of num_ranks (device="cuda"): this process is
    rank group.rank() of group.size(), on torch.cuda.current_device(), connected over `transport`
    ("nvlink" or "nccl"); every rank constructs it with the same arguments (a collective), and a
    kernel waits timeout_s for a peer before check() names it."""

    def __init__(self, model, weights_dir, num_ranks=None, max_tokens=None, layer=0, protocol="low-latency",
                 phy2log=None, block_m=64, replica_seed=0, timeout_s=60.0, device="cpu", expected_m=0, group=None,
                 transport="nvlink"):
        if max_tokens is None:
            raise TypeError("max_tokens is required (the most tokens a rank passes in one step)")
        if phy2log is not None and hasattr(phy2log, "detach"):
            phy2log = phy2log.detach().cpu()
        self.is_cuda = str(device).startswith("cuda")
        self.rank = None  # this process's rank, over a process group
        if group is not None:
            if not self.is_cuda:
                raise ValueError(f"moekit.MoELayer: a process group runs the GPU layer: pass device='cuda' (got "
                                 f"device={device!r})")
            self._connect(model, weights_dir, num_ranks, max_tokens, layer, protocol, phy2log, replica_seed, timeout_s,
                          expected_m, group, transport)
            return
        if num_ranks is None:
            raise TypeError("pass num_ranks (in-process ranks) or group (a torch.distributed ProcessGroup)")
        if self.is_cuda:
            if not hasattr(_core, "CudaMoeLayer"):
                raise ValueError("device='cuda': this moekit was built without CUDA")
            self.core = _core.CudaMoeLayer(model, str(weights_dir), layer, num_ranks, max_tokens, protocol, phy2log,
                                           replica_seed, expected_m)
        else:
            self.core = _core.CpuMoeLayer(model, str(weights_dir), layer, num_ranks, max_tokens, protocol, phy2log,
                                          block_m, replica_seed, timeout_s)

    def _connect(self, model, weights_dir, num_ranks, max_tokens, layer, protocol, phy2log, replica_seed, timeout_s,
                 expected_m, group, transport):
        what = "moekit.MoELayer"
        _process.check_transport(transport)
        _process.check_group(group, what)
        if num_ranks is not None and num_ranks != group.size():
            raise ValueError(f"{what}: num_ranks = {num_ranks}, but the group has {group.size()} ranks (leave it None)")
        if not hasattr(_core, "CudaMoeLayer"):
            raise ValueError(f"{what}: device='cuda': this moekit was built without CUDA")
        args = dict(model=model if isinstance(model, str) else repr(model), layer=layer, max_tokens=max_tokens,
                    protocol=protocol, transport=transport, replica_seed=replica_seed, expected_m=expected_m,
                    timeout_s=float(timeout_s), phy2log=None if phy2log is None else [int(v) for v in phy2log])
        exchange = _process.connect_args(group, transport, args, what)
        self.core = _core.CudaMoeLayer.connect(model, str(weights_dir), layer, **exchange, max_tokens=max_tokens,
                                               protocol=protocol, phy2log=phy2log, replica_seed=replica_seed,
                                               expected_m=expected_m, timeout_s=float(timeout_s))
        self.rank = exchange["rank"]

    @property
    def num_ranks(self):
        return self.core.num_ranks

    def forward(self, rank, x, first_token=0, topk_idx=None, topk_weights=None, out=None):
        """Rank `rank`'s part of one step (call it on that rank's thread, every rank in the same
        step): x [T, hidden] bf16 -> out [T, hidden] bf16. first_token: the global index of x's first
        token (the replica choice hashes global ids). topk_idx / topk_weights [T, k] (int32 logical
        experts, float32) replace the gate's routing when given.
        Over a process group: `rank` is this process's (layer.rank), x on its GPU; the whole step
        (gate, dispatch, GEMMs, combine) goes on PyTorch's current stream and can be captured."""
        if self.rank is not None:
            if rank != self.rank:
                raise ValueError(f"rank = {rank}: this process is rank {self.rank} of the layer's group")
            if out is None:
                out = empty(x, (shape_of(x, "x")[0], self.core.hidden), BF16)
            if topk_idx is not None and topk_idx.dtype != _torch().int32:
                topk_idx = topk_idx.to(_torch().int32)
            self.core.forward(x, out, first_token, topk_idx, topk_weights, stream_of(x))
            return out
        if self.is_cuda:
            raise ValueError("device='cuda': the ranks share one stream, so a step is forward_all(), not one rank")
        if out is None:
            out = empty(x, (shape_of(x, "x")[0], self.core.hidden), BF16)
        self.core.forward(rank, x, out, first_token, topk_idx, topk_weights)
        return out

    def forward_all(self, xs, routing=None):
        """One step of every rank, each on its own thread: xs[r] are rank r's tokens; routing, when
        given, is a list of (topk_idx, topk_weights) per rank. Returns the outputs in rank order."""
        if self.rank is not None:
            raise ValueError(f"this layer is rank {self.rank} of a process group: call forward({self.rank}, x) "
                             "with this process's tokens")
        if len(xs) != self.num_ranks:
            raise ValueError(f"xs must hold one tensor per rank ({self.num_ranks}), got {len(xs)}")
        firsts = [0]
        for x in xs[:-1]:
            firsts.append(firsts[-1] + shape_of(x, "x")[0])
        if self.is_cuda:
            outs = [empty(x, (shape_of(x, "x")[0], self.core.hidden), BF16) for x in xs]
            idx = w = None
            if routing is not None:
                int32 = _torch().int32
                idx = [i if i.dtype == int32 else i.to(int32) for i, _ in routing]
                w = [wt for _, wt in routing]
            self.core.forward_all(list(xs), outs, firsts, idx, w, stream_of(xs[0]))
            return outs

        def step(rank):
            idx, w = routing[rank] if routing is not None else (None, None)
            return self.forward(rank, xs[rank], firsts[rank], idx, w)

        return run_ranks(self.num_ranks, step)

    def last_step(self, rank):
        """What rank `rank` saw in its last step: routing, recv_count, messages, stage times (s). CPU only."""
        if self.is_cuda:
            raise ValueError("last_step() is the CPU layer's; on the GPU use check() and the outputs")
        return self.core.last_step(rank)

    def check(self):
        """CUDA: waits for the current stream and raises moekit.Error for a fault a kernel recorded."""
        if self.is_cuda:
            self.core.check(_torch().cuda.current_stream().cuda_stream)
