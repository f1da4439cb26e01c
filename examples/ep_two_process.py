"""Expert parallelism with one process per GPU, wired the way a serving engine wires DeepEP and
DeepGEMM, on moekit: a torch.distributed process group, moekit.Buffer over it, the FP8 grouped
GEMMs on the received tensors as they are, and the combine.

    torchrun --nproc-per-node 2 examples/ep_two_process.py [--transport nvlink|nccl]
             [--protocol low-latency|normal] [--tokens 64] [--replays 50]

Every rank routes its own random tokens (seeded by its rank) to the experts of every rank, runs
the step once eagerly, then captures it in a CUDA Graph and replays it. Each rank prints its
recv_count and the relative error of its output against a float64 evaluation of the same experts
on its own tokens (activations unquantised there, so a few percent: the two FP8 activation
quantisations; a misrouted token would be off by ~100%), and whether the replays equal the eager
step bit for bit; rank 0 prints the time per replayed step. Exit status 1 when a check fails.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

try:
    import moekit
except ImportError:  # not pip-installed: the module built in this tree
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "build" / "python"))
    import moekit

INTER = 256  # each expert's intermediate size (a multiple of 128, as the GEMMs need)


def expert_weights(num_experts, hidden, inter, seed, device):
    """Every expert's W1 = [gate; up] [E, 2 inter, hidden] and W2 [E, hidden, inter], FP8 with 128x128
    block scales (DeepSeek-V3's checkpoint format), the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    return moekit.per_block_cast_to_fp8(w1.to(device)), moekit.per_block_cast_to_fp8(w2.to(device))


def local_experts(weights, rank, num_local):
    """This rank's slots [rank * E_loc, (rank + 1) * E_loc) of an (fp8, scales) pair."""
    q, s = weights
    return q[rank * num_local:(rank + 1) * num_local], s[rank * num_local:(rank + 1) * num_local]


class Experts:
    """The engine's expert computation on one rank's received rows, with DeepGEMM's calls:
    GEMM1 -> SiLU(gate) * up -> FP8 -> GEMM2. Its buffers are allocated once for the EP buffer's
    receive layout (masked [E_loc, M_max] rows, or the contiguous buffers' rows), as an engine's
    are: a GEMM plan binds its buffers at its first call, so a step captured in a CUDA Graph after
    one eager step replays the same plans."""

    def __init__(self, w1, w2, rows):
        self.w1, self.w2 = w1, w2
        device, inter, hidden = w1[0].device, w1[0].shape[-2] // 2, w2[0].shape[-2]
        self.gate_up = torch.empty(rows + (2 * inter,), dtype=torch.bfloat16, device=device)
        self.act = (torch.empty(rows + (inter,), dtype=torch.float8_e4m3fn, device=device),
                    torch.empty(rows[:-1] + (inter // 128, rows[-1]), device=device).transpose(-1, -2))
        self.y = torch.empty(rows + (hidden,), dtype=torch.bfloat16, device=device)

    def _activation(self, valid):
        """SiLU(gate) * up in fp32, 0 on rows the dispatch did not fill, quantised 1x128 into self.act."""
        inter = self.gate_up.shape[-1] // 2
        g = self.gate_up.float()
        h = torch.where(valid[..., None], torch.nn.functional.silu(g[..., :inter]) * g[..., inter:], 0.0)
        moekit.per_token_cast_to_fp8(h, out=self.act, check_finite=False)

    def masked(self, recv, recv_count, expected_m):
        """Low-latency mode: recv = (recv_x [E_loc, M_max, hidden], recv_scales), masked_m = recv_count."""
        moekit.m_grouped_fp8_gemm_nt_masked(recv, self.w1, self.gate_up, recv_count, expected_m)
        rows = torch.arange(self.gate_up.shape[1], device=self.gate_up.device)
        self._activation(rows[None, :] < recv_count[:, None])
        return moekit.m_grouped_fp8_gemm_nt_masked(self.act, self.w2, self.y, recv_count, expected_m)

    def contiguous(self, recv, m_indices):
        """Normal mode: recv = (recv_x [rows, hidden], recv_scales), m_indices -1 on padding rows."""
        moekit.m_grouped_fp8_gemm_nt_contiguous(recv, self.w1, self.gate_up, m_indices)
        self._activation(m_indices >= 0)
        return moekit.m_grouped_fp8_gemm_nt_contiguous(self.act, self.w2, self.y, m_indices)


def moe_step(buf, experts, x, topk_idx, topk_weights, num_max_tokens, num_experts):
    """One rank's MoE step: dispatch -> the experts' GEMMs -> combine, DeepEP's calls; returns the
    output [T, hidden] and recv_count (tokens per local expert, on the GPU). The hook splits an
    exchange into its send and its receive: an engine runs other work between them."""
    if buf.protocol == "low-latency":  # decode
        recv, recv_count, handle, _, hook = buf.low_latency_dispatch(
            x, topk_idx, num_max_tokens, num_experts, topk_weights=topk_weights, return_recv_hook=True)
        hook()
        y = experts.masked(recv, recv_count, expected_m=num_max_tokens)
        out, _, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle, return_recv_hook=True)
        hook()
        return out, recv_count
    recv, m_indices, recv_count, handle, _ = buf.dispatch(x, topk_idx, topk_weights)  # prefill
    y = experts.contiguous(recv, m_indices)
    out, _, _ = buf.combine(y, handle)
    return out, recv_count


def receive_rows(buf, num_max_tokens):
    """The rows of a buffer's receive tensors: (E_loc, M_max = P * T_max) or (max_recv_rows,)."""
    if buf.protocol == "low-latency":
        return (buf.num_local_experts, buf.num_ranks * num_max_tokens)
    return (buf.max_recv_rows,)


def _reference(x, topk_idx, topk_weights, w1, w2):
    """float64: out[t] = sum_j w[t, j] * W2[e] (SiLU(gate) * up)(W1[e] x[t]), dequantised weights."""
    def dequant(q, s):
        return q.double() * s.double().repeat_interleave(128, -2).repeat_interleave(128, -1)
    W1, W2 = dequant(*w1), dequant(*w2)
    inter = W1.shape[1] // 2
    xf = x.double()
    out = torch.zeros_like(xf)
    for t in range(x.shape[0]):
        for e, w in zip(topk_idx[t].tolist(), topk_weights[t].tolist()):
            g = W1[e] @ xf[t]
            out[t] += w * (W2[e] @ (torch.nn.functional.silu(g[:inter]) * g[inter:]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="nvlink", choices=("nvlink", "nccl"))
    ap.add_argument("--protocol", default="low-latency", choices=("low-latency", "normal"))
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank (num_max_dispatch_tokens_per_rank)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts-per-rank", type=int, default=4)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args(argv)

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast: nothing here uses it
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    rank, P = group.rank(), group.size()
    T, d, E, k = args.tokens, args.hidden, args.experts_per_rank * P, args.topk

    # The engine's set-up: one Buffer per process (a collective), the experts' weights and buffers.
    buf = moekit.Buffer(group, T, d, E, k, transport=args.transport, protocol=args.protocol)
    w1, w2 = expert_weights(E, d, INTER, seed=1, device="cuda")
    experts = Experts(local_experts(w1, rank, E // P), local_experts(w2, rank, E // P), receive_rows(buf, T))

    # This rank's tokens and routing (the router's top-k, softmax weights; slots = experts here).
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, d, generator=g).to(torch.bfloat16).cuda()
    logits = torch.randn(T, E, generator=g)
    top, topk_idx = logits.topk(k, dim=1)
    topk_idx, topk_weights = topk_idx.cuda(), torch.softmax(top, dim=1).cuda()  # int64, as DeepEP's

    out, recv_count = moe_step(buf, experts, x, topk_idx, topk_weights, T, E)
    buf.check()
    counts = recv_count.tolist()
    want = _reference(x.cpu(), topk_idx.cpu(), topk_weights.cpu(), tuple(t.cpu() for t in w1),
                      tuple(t.cpu() for t in w2))
    err = ((out.cpu().double() - want).norm() / want.norm()).item()

    # The same step captured once, then replayed: the pointers are fixed, so it replays in place.
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = moe_step(buf, experts, x, topk_idx, topk_weights, T, E)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(args.replays):
        graph.replay()
    end.record()
    buf.check()
    step_us = start.elapsed_time(end) * 1e3 / args.replays
    same = bool(torch.equal(captured.view(torch.int16), eager.view(torch.int16)))

    ok = err < 0.1 and same
    print(f"rank {rank} of {P} ({args.transport}, {args.protocol}): recv_count {counts}, relative error vs "
          f"float64 {err:.2e}, graph replays equal the eager step: {same}{'' if ok else '  FAILED'}", flush=True)
    dist.barrier(device_ids=[local_rank])  # no rank frees its buffer while a peer may still write into it
    if rank == 0:
        print(f"{T} tokens per rank, hidden {d}, {E} experts, top-{k}: {step_us:.1f} us per replayed step "
              f"(dispatch + 2 GEMMs + combine)", flush=True)
    del graph, captured, buf
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
