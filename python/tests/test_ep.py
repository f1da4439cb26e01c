"""In-process expert parallelism through the binding (DeepEP's call shapes), checked against a
routing oracle written here: which (rank, token) rows each local expert receives, in layout.h's
canonical order, with their FP8 codes; the combine on values chosen so every sum is exact."""

import numpy as np
import pytest

import moekit
from conftest import NumpyBackend, bf16_bits_to_float, dequantize_blocks, dequantize_rows, encode_e4m3, quantize_rows

P, T_MAX, HIDDEN, SLOTS, K = 2, 4, 256, 8, 3
E_LOC = SLOTS // P


def _routing(rng, num_tokens):
    idx = np.stack([rng.choice(SLOTS, K, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    w = rng.choice([0.25, 0.5, 1.0], size=(num_tokens, K)).astype(np.float32)
    return idx, w


def _tokens(rank, num_tokens, rng):
    """Every token's values encode its rank and index (a misrouted row is caught by value)."""
    x = rng.standard_normal((num_tokens, HIDDEN)).astype(np.float32)
    x[:, 0] = 1000 * rank + np.arange(num_tokens) + 1
    return moekit.float32_to_bf16(x)


def _expected_rows(routing, rank, local):
    """The (src_rank, src_token, j) rows of local expert `local` on `rank`: by source rank, then token."""
    slot = rank * E_LOC + local
    return [(src, t, int(np.where(idx[t] == slot)[0][0]))
            for src, (idx, _) in enumerate(routing) for t in range(len(idx)) if slot in idx[t]]


def _step(backend, rng, num_tokens, use_threads, group=None):
    group = group or moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K)
    xs = [_tokens(r, num_tokens[r], rng) for r in range(P)]
    routing = [_routing(rng, num_tokens[r]) for r in range(P)]
    ys = [rng.integers(-8, 9, size=(E_LOC, P * T_MAX, HIDDEN)).astype(np.float32) for _ in range(P)]
    results = [None] * P

    def dispatch(buf):
        idx, w = routing[buf.rank]
        return buf.low_latency_dispatch(backend.put(xs[buf.rank], "bf16"), backend.put(idx), T_MAX, SLOTS,
                                        topk_weights=backend.put(w), return_recv_hook=not use_threads)

    def combine(buf, handle):
        idx, w = routing[buf.rank]
        y = backend.put(moekit.float32_to_bf16(ys[buf.rank]), "bf16")
        return buf.low_latency_combine(y, backend.put(idx), backend.put(w), handle, return_recv_hook=not use_threads)

    if use_threads:
        sent = group.run(dispatch)
        done = group.run(lambda buf: combine(buf, sent[buf.rank][2]))
    else:
        sent = [dispatch(b) for b in group.buffers]
        for s in sent:
            s[4]()  # the receive hooks, after every rank has sent
        done = [combine(b, sent[b.rank][2]) for b in group.buffers]
        for d in done:
            d[2]()
    for r in range(P):
        results[r] = (sent[r], done[r][0])
    return group, xs, routing, ys, results


@pytest.mark.parametrize("use_threads", [True, False], ids=["threads", "hooks"])
def test_low_latency_dispatch_and_combine(backend, rng, use_threads):
    if backend.is_cuda:
        pytest.skip("the CPU local transport takes CPU tensors")
    num_tokens = [4, 3]
    group, xs, routing, ys, results = _step(backend, rng, num_tokens, use_threads)
    for r in range(P):
        ((recv_x, recv_scales), recv_count, handle, event, hook), combined = results[r]
        recv_x, recv_scales, recv_count = backend.get(recv_x), backend.get(recv_scales), backend.get(recv_count)
        recv_src = np.asarray(handle.recv_src)
        assert recv_x.shape == (E_LOC, P * T_MAX, HIDDEN) and recv_scales.shape == (E_LOC, P * T_MAX, 2)
        for e in range(E_LOC):
            rows = _expected_rows(routing, r, e)
            assert recv_count[e] == len(rows)
            for m, (src, t, _) in enumerate(rows):
                want_q, want_s = quantize_rows(bf16_bits_to_float(xs[src][t:t + 1]).astype(np.float32))
                np.testing.assert_array_equal(recv_x[e, m], want_q[0])
                np.testing.assert_array_equal(recv_scales[e, m], want_s[0])
                assert recv_src[e, m] == src * T_MAX + t
        # Combine: out[t] = sum_j w[t, j] * y[row of (t, j)] on the rank holding slot j; exact here.
        idx, w = routing[r]
        want = np.zeros((num_tokens[r], HIDDEN))
        for t in range(num_tokens[r]):
            for j in range(K):
                dst, local = divmod(int(idx[t, j]), E_LOC)
                m = [(s, tt) for s, tt, _ in _expected_rows(routing, dst, local)].index((r, t))
                want[t] += w[t, j] * ys[dst][local, m]
        np.testing.assert_array_equal(bf16_bits_to_float(backend.get(combined)), want)
        stats = group.buffer(r).stats()
        targets = sum(len({int(s) // E_LOC for s in idx[t]}) for t in range(num_tokens[r]))
        assert stats["dispatch_messages"] == targets  # one message per distinct target rank


def test_per_token_scales(rng):
    """fp8_scaling="per-token": every received row's hidden/128 scales are one value, its token's
    amax / 448 over the whole row, and its codes those of that one scale (quant.h); 1x128 scales of
    the same tokens differ. A bad name is refused with the value."""
    backend = NumpyBackend()
    group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, fp8_scaling="per-token")
    assert group.core.fp8_scaling == "per-token"
    _, xs, routing, _, results = _step(backend, rng, [4, 3], use_threads=True, group=group)
    rows = mixed = 0
    for r in range(P):
        (recv_x, recv_scales), _, _, _, _ = results[r][0]
        for e in range(E_LOC):
            for m, (src, t, _) in enumerate(_expected_rows(routing, r, e)):
                x = bf16_bits_to_float(xs[src][t]).astype(np.float32)
                scale = np.float32(max(np.abs(x).max(), np.float32(1e-4)) / np.float32(448.0))
                np.testing.assert_array_equal(recv_scales[e, m], np.full(HIDDEN // 128, scale, np.float32))
                np.testing.assert_array_equal(recv_x[e, m], encode_e4m3((x / scale).astype(np.float32)))
                mixed += not np.all(quantize_rows(x[None])[1] == scale)
                rows += 1
    assert rows == 7 * K and mixed > 0
    with pytest.raises(ValueError, match="fp8_scaling = 'per-row'"):
        moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, fp8_scaling="per-row")


def test_receive_buffers_are_static_and_feed_the_gemm(rng):
    """recv_x / recv_scales / recv_count go to the masked GEMM as they are (same memory every step)."""
    backend = NumpyBackend()
    group, xs, routing, _, results = _step(backend, rng, [4, 4], use_threads=True)
    (recv_x, recv_scales), recv_count, _, _, _ = results[0][0]
    first = (recv_x.ctypes.data, recv_scales.ctypes.data, recv_count.ctypes.data)
    group, xs, routing, _, results = _step(backend, rng, [2, 4], use_threads=True, group=group)
    (recv_x, recv_scales), recv_count, _, _, _ = results[0][0]
    assert (recv_x.ctypes.data, recv_scales.ctypes.data, recv_count.ctypes.data) == first

    w = (rng.standard_normal((E_LOC, 128, HIDDEN)) / 16).astype(np.float32)
    wq, ws = moekit.per_block_cast_to_fp8(w)
    d = np.zeros((E_LOC, P * T_MAX, 128), dtype=np.uint16)
    moekit.m_grouped_fp8_gemm_nt_masked((recv_x, recv_scales), (wq, ws), d, recv_count, T_MAX)
    want = np.einsum("emk,enk->emn", dequantize_rows(recv_x, recv_scales), dequantize_blocks(wq, ws))
    for e in range(E_LOC):
        m = recv_count[e]
        np.testing.assert_allclose(bf16_bits_to_float(d[e, :m]), want[e, :m], rtol=2 ** -7, atol=1e-3)


def test_normal_dispatch_and_combine(rng):
    group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, block_m=4)
    xs = [_tokens(r, 4, rng) for r in range(P)]
    routing = [_routing(rng, 4) for _ in range(P)]

    def step(buf):
        idx, w = routing[buf.rank]
        (recv_x, recv_scales), m_indices, counts, handle, _ = buf.dispatch(xs[buf.rank], idx, w)
        # Expert outputs: every row of local expert e holds the value e + 1.
        y = moekit.float32_to_bf16(np.repeat((np.maximum(m_indices, 0) + 1).astype(np.float32)[:, None], HIDDEN, 1))
        out, _, _ = buf.combine(y, handle)
        return m_indices, counts, out

    results = group.run(step)
    for r, (m_indices, counts, out) in enumerate(results):
        assert len(m_indices) % 4 == 0
        for e in range(E_LOC):
            rows = _expected_rows(routing, r, e)
            assert counts[e] == len(rows) == np.sum(m_indices == e)
        idx, w = routing[r]
        want = np.array([sum(w[t, j] * (idx[t, j] % E_LOC + 1) for j in range(K)) for t in range(4)])
        np.testing.assert_array_equal(bf16_bits_to_float(out)[:, 0], want)


def test_bad_arguments():
    group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K)
    buf = group.buffer(0)
    x = moekit.float32_to_bf16(np.ones((2, HIDDEN), np.float32))
    idx = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.int32)
    w = np.ones((2, K), np.float32)
    with pytest.raises(TypeError, match="topk_weights is required"):
        buf.low_latency_dispatch(x, idx, T_MAX, SLOTS)
    with pytest.raises(ValueError, match="must be the group's"):
        buf.low_latency_dispatch(x, idx, T_MAX + 1, SLOTS, topk_weights=w)
    with pytest.raises(TypeError, match="x must have dtype bfloat16"):
        buf.low_latency_dispatch(np.ones((2, HIDDEN), np.float32), idx, T_MAX, SLOTS, topk_weights=w)
    with pytest.raises(ValueError, match=r"topk_idx must have shape \[num_tokens=any, num_topk=3\]"):
        buf.low_latency_dispatch(x, idx[:, :2], T_MAX, SLOTS, topk_weights=w)
    with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank = 4"):
        buf.low_latency_dispatch(np.zeros((5, HIDDEN), np.uint16), np.zeros((5, K), np.int32), T_MAX, SLOTS,
                                 topk_weights=np.ones((5, K), np.float32))
    with pytest.raises(moekit.Error):
        buf.low_latency_dispatch(x, np.array([[0, 1, 99], [3, 4, 5]], dtype=np.int32), T_MAX, SLOTS, topk_weights=w)
    with pytest.raises(ValueError, match="handle must be the one returned"):
        buf.low_latency_combine(np.zeros((E_LOC, P * T_MAX, HIDDEN), np.uint16), idx, w, object())
    with pytest.raises(moekit.Error):
        moekit.LocalGroup(P, T_MAX, 200, SLOTS, K)  # hidden not a multiple of 128
