"""One MoE layer step the way a serving engine drives DeepEP and DeepGEMM, on moekit.

P in-process ranks, each with T tokens: router top-k -> EPLB replica slots -> low-latency dispatch
(FP8, hook) -> masked grouped GEMM1 on the received buffers as they are -> SiLU(gate)*up -> FP8
-> masked GEMM2 -> combine. Tensors are PyTorch's when it is installed (else NumPy). With
--device cuda (moekit built with CUDA) the whole step stays on the GPU: the P ranks are virtual
ranks of one GPU (LocalGroup(device="cuda")), every call a kernel on PyTorch's current stream, and
nothing goes through the host. Prints each rank's recv_count and the error against a float64
evaluation (the only host copies are that check's).

    python3 examples/moe_layer.py [--ranks 2] [--tokens 8] [--device cpu|cuda] [--numpy]
"""

import argparse
import sys

import numpy as np

try:
    import moekit
except ImportError:  # not pip-installed: the module built in this tree
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "build-py" / "python"))
    import moekit


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--numpy", action="store_true", help="NumPy arrays even where PyTorch exists")
    args = ap.parse_args(argv)
    P, T, d, inter, E, k = args.ranks, args.tokens, 256, 128, 16, 4
    rng = np.random.default_rng(0)
    try:
        import torch
    except ImportError:
        torch = None
    if args.numpy:
        torch = None
    dev = args.device if torch is not None else "cpu"

    def tensor(a, kind=None, device="cpu"):  # NumPy -> the engine's framework
        if torch is None:
            return a
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16) if kind == "bf16" else np.ascontiguousarray(a))
        t = t.view(torch.bfloat16) if kind == "bf16" else t
        return t.to(device)

    def silu_and_mul(gate_up, recv_count):  # SiLU(gate) * up in fp32 on the tensors' device
        rows = np.arange(P * T)[None, :, None]
        if torch is None:
            g = np.where(rows < recv_count[:, None, None], moekit.bf16_to_float32(gate_up), 0)
            return (g[..., :inter] / (1 + np.exp(-g[..., :inter])) * g[..., inter:]).astype(np.float32)
        valid = torch.from_numpy(rows).to(gate_up.device) < recv_count[:, None, None]
        g = torch.where(valid, gate_up.float(), 0.0)
        return torch.nn.functional.silu(g[..., :inter]) * g[..., inter:]

    def host(t):
        if torch is None:
            return t
        t = t.cpu()
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()

    # Weights as an engine holds them: [E, N, K] FP8 with 128x128 block scales (DeepSeek-V3's format).
    w1 = tensor((rng.standard_normal((E, 2 * inter, d)) / np.sqrt(d)).astype(np.float32), device=dev)
    w2 = tensor((rng.standard_normal((E, d, inter)) / np.sqrt(inter)).astype(np.float32), device=dev)
    w1q, w2q = moekit.per_block_cast_to_fp8(w1), moekit.per_block_cast_to_fp8(w2)

    # Router on each rank, then EPLB: loads -> placement (no redundant slots here) -> slots.
    x = [moekit.float32_to_bf16(rng.standard_normal((T, d)).astype(np.float32)) for _ in range(P)]
    routing = []
    for r in range(P):
        logits = rng.standard_normal((T, E))
        idx = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
        w = np.take_along_axis(np.exp(logits), idx, 1)
        routing.append((idx, (w / w.sum(1, keepdims=True)).astype(np.float32)))
    load = np.bincount(np.concatenate([i.ravel() for i, _ in routing]), minlength=E)[None].astype(np.float64)
    phy2log, log2phy, _ = moekit.rebalance(load, E, 1, 1, P)
    slot_of = {int(e): int(s) for s, e in enumerate(np.asarray(phy2log)[0])}

    group = moekit.LocalGroup(P, T, d, E, k, device=dev)
    e_loc = E // P
    sent = []
    for r, buf in enumerate(group.buffers):  # every rank sends, then the hooks receive
        idx = tensor(np.vectorize(slot_of.get)(routing[r][0]).astype(np.int32), device=dev)
        weights = tensor(routing[r][1], device=dev)
        sent.append(buf.low_latency_dispatch(tensor(x[r], "bf16", dev), idx, T, E, topk_weights=weights,
                                             return_recv_hook=True) + (idx, weights))
    for s in sent:
        s[4]()
    outs = []
    for r, buf in enumerate(group.buffers):
        (recv_x, recv_scales), recv_count, handle, _, _, idx, weights = sent[r]
        experts = [int(np.asarray(phy2log)[0][r * e_loc + i]) for i in range(e_loc)]
        raw = (lambda q: q.view(torch.uint8)) if torch is not None else (lambda q: q)  # fp8 as bytes to index
        wa = [(raw(w1q[0])[experts], w1q[1][experts]), (raw(w2q[0])[experts], w2q[1][experts])]
        if torch is not None:
            wa = [(q.view(torch.float8_e4m3fn), s) for q, s in wa]
        gate_up = moekit.empty(recv_x, (e_loc, P * T, 2 * inter), moekit._tensors.BF16)
        moekit.m_grouped_fp8_gemm_nt_masked((recv_x, recv_scales), wa[0], gate_up, recv_count, T)
        h = silu_and_mul(gate_up, recv_count)  # rows past recv_count are zero, not garbage
        hq = moekit.per_token_cast_to_fp8(h)
        y = moekit.empty(recv_x, (e_loc, P * T, d), moekit._tensors.BF16)
        moekit.m_grouped_fp8_gemm_nt_masked(hq, wa[1], y, recv_count, T)
        combined, _, hook = buf.low_latency_combine(y, idx, weights, handle, return_recv_hook=True)
        outs.append((combined, recv_count, hook))
    for _, _, hook in outs:  # every rank has sent its combine: receive
        hook()

    # float64 evaluation: out = sum_j w_j * W2 silu(W1 x) with the dequantised FP8 weights.
    def deq(q, s):
        codes = host(q.view(torch.uint8) if torch is not None else q).astype(np.int64)
        table = _e4m3()
        return table[codes] * np.repeat(np.repeat(host(s), 128, -2), 128, -1)
    W1, W2 = deq(*w1q), deq(*w2q)
    err_num = err_den = 0.0
    for r in range(P):
        got = moekit.bf16_to_float32(host(outs[r][0])).astype(np.float64)
        xf = moekit.bf16_to_float32(x[r]).astype(np.float64)
        want = np.zeros_like(got)
        for t in range(T):
            for e, wt in zip(routing[r][0][t], routing[r][1][t]):
                g = W1[e] @ xf[t]
                want[t] += wt * (W2[e] @ (g[:inter] / (1 + np.exp(-g[:inter])) * g[inter:]))
        err_num += np.sum((got - want) ** 2)
        err_den += np.sum(want ** 2)
        print(f"rank {r}: recv_count {host(outs[r][1]).tolist()}  out {tuple(got.shape)}")
    err = np.sqrt(err_num / err_den)
    print(f"framework {'torch' if torch is not None else 'numpy'}, GEMMs on {dev}: "
          f"relative error vs float64 {err:.2e} (FP8 activations and weights, bf16 outputs)")
    return err


def _e4m3():
    v = np.empty(256)
    for c in range(256):
        e, m = (c >> 3) & 15, c & 7
        v[c] = (-1 if c & 128 else 1) * (m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    v[127] = v[255] = np.nan
    return v


if __name__ == "__main__":
    main()
