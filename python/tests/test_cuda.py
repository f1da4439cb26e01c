"""CUDA only (skipped elsewhere): the grouped GEMMs on PyTorch CUDA tensors through DLPack, written
in place (data pointers), and captured into a CUDA Graph with torch.cuda.graph, then replayed on
new data and new masked_m in the same buffers. Run on a GPU host by make test-gpu (or scripts/gpu-python)."""

import numpy as np
import pytest

import moekit
from conftest import bf16_bits_to_float, dequantize_blocks, dequantize_rows, quantize_rows, TorchBackend, torch

pytestmark = pytest.mark.skipif(torch is None or not torch.cuda.is_available() or not moekit.with_cuda,
                                reason="needs PyTorch with a CUDA GPU and moekit built with CUDA")

POISON = 0x7FC1
E, M_MAX, N, K = 4, 16, 256, 512


def _operands(rng):
    aq, as_ = quantize_rows(rng.standard_normal((E, M_MAX, K)).astype(np.float32))
    wq, ws = moekit.per_block_cast_to_fp8((rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(np.float32))
    return aq, as_, wq, ws


def _want(aq, as_, wq, ws):
    return np.einsum("emk,enk->emn", dequantize_rows(aq, as_), dequantize_blocks(wq, ws))


def _check(d, masked_m, want):
    got = TorchBackend("cuda").get(d)
    for e, m in enumerate(masked_m):
        if m:
            g, w = bf16_bits_to_float(got[e, :m]), want[e, :m]
            assert np.linalg.norm(g - w) <= 3e-3 * np.linalg.norm(w)
        assert np.all(got[e, m:] == POISON)


def test_masked_gemm_graph_capture_and_replay(rng):
    cuda = TorchBackend("cuda")
    aq, as_, wq, ws = _operands(rng)
    a = cuda.put(aq, "fp8")
    a_scales = cuda.mn_major((E, M_MAX, K // 128))
    a_scales.copy_(cuda.put(as_))
    b = (cuda.put(wq, "fp8"), cuda.put(ws))
    d = cuda.put(np.full((E, M_MAX, N), POISON, dtype=np.uint16), "bf16")
    masked_m = torch.tensor([3, 0, 16, 7], dtype=torch.int32, device="cuda")
    pointers = [t.data_ptr() for t in (a, a_scales, b[0], b[1], d, masked_m)]

    moekit.m_grouped_fp8_gemm_nt_masked((a, a_scales), b, d, masked_m, 8)  # eager; makes the plan
    torch.cuda.synchronize()
    _check(d, [3, 0, 16, 7], _want(aq, as_, wq, ws))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moekit.m_grouped_fp8_gemm_nt_masked((a, a_scales), b, d, masked_m, 8)

    # New activations, scales and masked_m in the same buffers; the replay must use them.
    aq2, as2, _, _ = _operands(np.random.default_rng(99))
    a.view(torch.uint8).copy_(torch.from_numpy(aq2))
    a_scales.copy_(cuda.put(as2))
    masked_m.copy_(torch.tensor([1, 5, 0, 16], dtype=torch.int32))
    d.view(torch.int16).fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    _check(d, [1, 5, 0, 16], _want(aq2, as2, wq, ws))
    assert [t.data_ptr() for t in (a, a_scales, b[0], b[1], d, masked_m)] == pointers


def test_mixed_devices_are_refused(rng):
    cuda = TorchBackend("cuda")
    aq, as_, wq, ws = _operands(rng)
    a_scales = cuda.mn_major((E, M_MAX, K // 128))
    d = cuda.put(np.zeros((E, M_MAX, N), dtype=np.uint16), "bf16")
    with pytest.raises(ValueError, match="on the same device"):
        moekit.m_grouped_fp8_gemm_nt_masked((cuda.put(aq, "fp8"), a_scales), (cuda.put(wq, "fp8"), cuda.put(ws)), d,
                                            torch.zeros(E, dtype=torch.int32), 8)  # masked_m on the CPU


def test_quantisation_in_a_graph_and_at_serving_size(rng):
    """A DeepSeek-V3-sized activation (bf16, 4 x 128 tokens x 7168) and weight block set quantised on
    the GPU equal the CPU bits; the capture replays on new values in the same buffers."""
    cuda = TorchBackend("cuda")
    x = moekit.float32_to_bf16((rng.standard_normal((4, 128, 7168)) * rng.uniform(0.01, 50, (4, 128, 1))).astype(np.float32))
    xg = cuda.put(x, "bf16")
    q, s = moekit.per_token_cast_to_fp8(xg)
    want_q, want_s = moekit.per_token_cast_to_fp8(x)  # the CPU path (quant.h) on the same bf16 bits
    np.testing.assert_array_equal(cuda.get(q), want_q)
    np.testing.assert_array_equal(cuda.get(s), want_s)
    pointers = (q.data_ptr(), s.data_ptr())

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moekit.per_token_cast_to_fp8(xg, out=(q, s))
    x2 = moekit.float32_to_bf16(rng.standard_normal((4, 128, 7168)).astype(np.float32))
    xg.copy_(cuda.put(x2, "bf16"))
    graph.replay()
    torch.cuda.synchronize()
    want_q2, want_s2 = moekit.per_token_cast_to_fp8(x2)
    np.testing.assert_array_equal(cuda.get(q), want_q2)
    np.testing.assert_array_equal(cuda.get(s), want_s2)
    assert (q.data_ptr(), s.data_ptr()) == pointers

    w = rng.standard_normal((3, 512, 768)).astype(np.float32)
    wq, ws = moekit.per_block_cast_to_fp8(cuda.put(w))
    cq, cs = moekit.per_block_cast_to_fp8(w)
    np.testing.assert_array_equal(cuda.get(wq), cq)
    np.testing.assert_array_equal(cuda.get(ws), cs)


def test_quantisation_reports_non_finite_on_cuda():
    x = torch.ones((3, 256), device="cuda")
    x[2, 130] = float("nan")
    with pytest.raises(moekit.Error, match=r"element 642 \(flattened\) is not finite"):
        moekit.per_token_cast_to_fp8(x)
    moekit.per_token_cast_to_fp8(x, check_finite=False)  # the caller opted out: no synchronisation, no error
    w = torch.ones((128, 128), dtype=torch.bfloat16, device="cuda")
    w[5, 7] = float("inf")
    with pytest.raises(moekit.Error, match=r"element 647 \(flattened\) is not finite"):
        moekit.per_block_cast_to_fp8(w)


# ---- Expert parallelism on the GPU (ep.h, `local` transport): equal to the CPU group bit for bit ----

def _ep_step(group, put, xs, routing, ys):
    """Every rank's dispatch (hooks after all sends), then every rank's combine, DeepEP's calls."""
    from test_ep import SLOTS, T_MAX
    sent = [b.low_latency_dispatch(put(xs[r], "bf16"), put(routing[r][0]), T_MAX, SLOTS, topk_weights=put(routing[r][1]),
                                   return_recv_hook=True) for r, b in enumerate(group.buffers)]
    for s in sent:
        s[4]()
    combined = [b.low_latency_combine(put(ys[r], "bf16"), put(routing[r][0]), put(routing[r][1]), sent[r][2],
                                      return_recv_hook=True) for r, b in enumerate(group.buffers)]
    for c in combined:
        c[2]()
    return sent, [c[0] for c in combined]


def _ep_inputs(rng):
    from test_ep import E_LOC, P, T_MAX, HIDDEN, _routing, _tokens
    xs = [_tokens(r, T_MAX - r, rng) for r in range(P)]
    routing = [_routing(rng, T_MAX - r) for r in range(P)]
    ys = [moekit.float32_to_bf16(rng.integers(-8, 9, size=(E_LOC, P * T_MAX, HIDDEN)).astype(np.float32)) for _ in range(P)]
    return xs, routing, ys


def _compare_ep(cpu, gpu, cuda):
    (c_sent, c_out), (g_sent, g_out) = cpu, gpu
    for r in range(len(c_sent)):
        count = np.asarray(c_sent[r][1])
        np.testing.assert_array_equal(cuda.get(g_sent[r][1]), count)
        for t_cpu, t_gpu in zip(c_sent[r][0] + (c_sent[r][2].recv_src,), g_sent[r][0] + (g_sent[r][2].recv_src,)):
            a, b = np.asarray(t_cpu), cuda.get(t_gpu)
            for e, m in enumerate(count):
                np.testing.assert_array_equal(b[e, :m], a[e, :m])  # rows past recv_count are not written
        np.testing.assert_array_equal(cuda.get(g_out[r]), np.asarray(c_out[r]))


def test_ep_local_cuda_equals_cpu_and_replays_in_a_graph(rng):
    from test_ep import HIDDEN, K, P, SLOTS, T_MAX
    cuda = TorchBackend("cuda")
    cpu_group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K)
    gpu_group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, device="cuda")
    xs, routing, ys = _ep_inputs(rng)
    gpu = _ep_step(gpu_group, cuda.put, xs, routing, ys)
    gpu_group.check()
    _compare_ep(_ep_step(cpu_group, lambda a, kind=None: a, xs, routing, ys), gpu, cuda)
    pointers = [gpu[0][r][0][0].data_ptr() for r in range(P)]

    # The same step captured once; the replay reads new tokens, routing and expert outputs.
    inputs = [(cuda.put(xs[r], "bf16"), cuda.put(routing[r][0]), cuda.put(routing[r][1]), cuda.put(ys[r], "bf16"))
              for r in range(P)]
    keep = lambda t, kind=None: t  # noqa: E731 (inputs already on the GPU)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _ep_step(gpu_group, keep, [i[0] for i in inputs], [(i[1], i[2]) for i in inputs], [i[3] for i in inputs])
    xs2, routing2, ys2 = _ep_inputs(np.random.default_rng(5))
    for r in range(P):
        inputs[r][0].copy_(cuda.put(xs2[r], "bf16"))
        inputs[r][1].copy_(cuda.put(routing2[r][0]))
        inputs[r][2].copy_(cuda.put(routing2[r][1]))
        inputs[r][3].copy_(cuda.put(ys2[r], "bf16"))
    graph.replay()
    gpu_group.check()
    _compare_ep(_ep_step(cpu_group, lambda a, kind=None: a, xs2, routing2, ys2), captured, cuda)
    assert [captured[0][r][0][0].data_ptr() for r in range(P)] == pointers  # the group's own receive memory


def test_ep_cuda_needs_the_hook():
    from test_ep import HIDDEN, K, P, SLOTS, T_MAX
    group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, device="cuda")
    x = torch.zeros((2, HIDDEN), dtype=torch.bfloat16, device="cuda")
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device="cuda")
    w = torch.ones((2, K), device="cuda")
    with pytest.raises(ValueError, match="return_recv_hook=True"):
        group.buffer(0).low_latency_dispatch(x, idx, T_MAX, SLOTS, topk_weights=w)
    with pytest.raises(ValueError, match="must be on cuda"):
        group.buffer(0).low_latency_dispatch(x.cpu(), idx.cpu(), T_MAX, SLOTS, topk_weights=w.cpu(), return_recv_hook=True)


# ---- The MoE layer on the GPU (layer.h) against the float64 oracle and the CPU layer ---------------

@pytest.fixture(scope="module")
def layer_weights(tmp_path_factory):
    from test_layer import MODEL
    path = tmp_path_factory.mktemp("gpu-weights")
    moekit.write_random_weights(MODEL, str(path), num_layers=1, seed=11)
    return path


def test_gpu_layer_matches_oracle_and_replays_in_a_graph(layer_weights, rng):
    from test_layer import MODEL, _inputs, layer_f64, read_safetensors
    cuda = TorchBackend("cuda")
    x, idx, w = _inputs(rng, 6)
    tensors = read_safetensors(layer_weights)
    layer = moekit.MoELayer(MODEL, layer_weights, num_ranks=2, max_tokens=4, device="cuda")
    xs = [cuda.put(x[:3], "bf16"), cuda.put(x[3:], "bf16")]
    routing = [(cuda.put(idx[:3]), cuda.put(w[:3])), (cuda.put(idx[3:]), cuda.put(w[3:]))]
    outs = layer.forward_all(xs, routing=routing)
    layer.check()
    want = layer_f64(tensors, bf16_bits_to_float(x).astype(np.float32), idx, w)
    got = bf16_bits_to_float(np.concatenate([cuda.get(o) for o in outs]))
    # The GPU layer's bound (test_layer's and `moekit run --check`'s): it measures 4e-3 .. 7e-3 against
    # the oracle, as its tensor cores' FP8 block sums keep fewer bits than the CPU's exact ones
    # (docs/layer-gpu.md); a misrouted token or a wrong scale would be off by tens of percent.
    assert np.linalg.norm(got - want) <= 1.5e-2 * np.linalg.norm(want)
    cpu = moekit.MoELayer(MODEL, layer_weights, num_ranks=2, max_tokens=4)
    cpu_out = bf16_bits_to_float(np.concatenate(cpu.forward_all([x[:3], x[3:]], routing=[(idx[:3], w[:3]), (idx[3:], w[3:])])))
    assert np.linalg.norm(got - cpu_out) <= 1.5e-2 * np.linalg.norm(cpu_out)

    # The whole step (both ranks, gate included) captured once, replayed on new tokens in place.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer.forward_all(xs)
    x2, _, _ = _inputs(np.random.default_rng(21), 6)
    xs[0].copy_(cuda.put(x2[:3], "bf16"))
    xs[1].copy_(cuda.put(x2[3:], "bf16"))
    graph.replay()
    layer.check()
    replayed = bf16_bits_to_float(np.concatenate([cuda.get(o) for o in captured]))
    eager = bf16_bits_to_float(np.concatenate(cpu.forward_all([x2[:3], x2[3:]])))  # the CPU layer's own gate
    assert np.linalg.norm(replayed - eager) <= 1e-2 * np.linalg.norm(eager)


def test_gpu_layer_bad_arguments(layer_weights):
    from test_layer import MODEL
    layer = moekit.MoELayer(MODEL, layer_weights, num_ranks=1, max_tokens=4, device="cuda")
    with pytest.raises(ValueError, match="more than max_tokens"):
        layer.forward_all([torch.zeros((9, 256), dtype=torch.bfloat16, device="cuda")])
    with pytest.raises(ValueError, match="must be on cuda"):
        layer.forward_all([torch.zeros((2, 256), dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="forward_all"):
        layer.forward(0, torch.zeros((2, 256), dtype=torch.bfloat16, device="cuda"))



# ---- gpt-oss's block on the GPU: MXFP4 experts with biases, clamped SwiGLU, router logit bias -------

# hidden 160 and inter 96 are padded to 256 and 128 inside the layer; limit 1 makes the clamps act
# (the C++ tests' gpt-oss-style model, tests/oss_test_model.h).
OSS = {
    "name": "py-test-oss", "hidden_size": 160, "num_layers": 1, "num_moe_layers": 1,
    "moe_intermediate_size": 96, "num_routed_experts": 16, "num_experts_per_token": 4,
    "num_shared_experts": 0, "shared_intermediate_size": 0,
    "total_params": 1e7, "active_params": 1e6, "weight_bytes_per_param": 0.53, "kv_bytes_per_token": 1024,
    "router": {"scoring": "topk_softmax", "num_groups": 1, "topk_groups": 1, "routed_scaling_factor": 1.0,
               "normalize_topk": True, "logit_bias": True},
    "expert_format": "mxfp4", "activation": {"kind": "clamped_swiglu", "alpha": 1.702, "limit": 1.0},
    "expert_bias": True,
}


def test_gpu_layer_runs_gpt_oss_like_the_cpu_layer_and_replays(tmp_path, rng):
    moekit.write_random_weights(OSS, str(tmp_path), num_layers=1, seed=5)
    cuda = TorchBackend("cuda")
    tokens = lambda r: moekit.float32_to_bf16(r.standard_normal((6, 160)).astype(np.float32))
    x = tokens(rng)
    cpu = moekit.MoELayer(OSS, tmp_path, num_ranks=2, max_tokens=4)
    gpu = moekit.MoELayer(OSS, tmp_path, num_ranks=2, max_tokens=4, device="cuda")
    xs = [cuda.put(x[:3], "bf16"), cuda.put(x[3:], "bf16")]
    # Both gate with their own router (its logit bias, top-4 then softmax); the GPU layer's MXFP4
    # GEMMs sum in a different order than the CPU's: 1e-3 .. 3e-3 apart in the C++ tests.
    got = bf16_bits_to_float(np.concatenate([cuda.get(o) for o in gpu.forward_all(xs)]))
    gpu.check()
    want = bf16_bits_to_float(np.concatenate(cpu.forward_all([x[:3], x[3:]])))
    assert got.shape == (6, 160) and np.isfinite(got).all()
    assert np.linalg.norm(got - want) <= 1.5e-2 * np.linalg.norm(want)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gpu.forward_all(xs)
    x2 = tokens(np.random.default_rng(22))
    xs[0].copy_(cuda.put(x2[:3], "bf16"))
    xs[1].copy_(cuda.put(x2[3:], "bf16"))
    graph.replay()
    gpu.check()
    replayed = bf16_bits_to_float(np.concatenate([cuda.get(o) for o in captured]))
    want2 = bf16_bits_to_float(np.concatenate(cpu.forward_all([x2[:3], x2[3:]])))
    assert np.linalg.norm(replayed - want2) <= 1.5e-2 * np.linalg.norm(want2)
    assert np.linalg.norm(replayed - got) > 0.1 * np.linalg.norm(got)  # new tokens, new output


# ---- The contiguous grouped GEMM (prefill) on CUDA tensors ------------------------------------------

def _segments(counts):
    """m_indices of the contiguous layout: expert e's counts[e] rows, padded with -1 to a multiple of 128."""
    return np.concatenate([np.r_[np.full(c, e), np.full(-c % 128, -1)] for e, c in enumerate(counts)]).astype(np.int32)


def _check_contiguous(d, m_indices, aq, as_, wq, ws):
    got, w = TorchBackend("cuda").get(d), dequantize_blocks(wq, ws)
    for e in range(E):
        rows = m_indices == e
        if rows.any():
            want = np.einsum("mk,nk->mn", dequantize_rows(aq[rows], as_[rows]), w[e])
            assert np.linalg.norm(bf16_bits_to_float(got[rows]) - want) <= 3e-3 * np.linalg.norm(want)
    assert np.all(got[m_indices < 0] == POISON)  # padding rows are not written


def test_contiguous_gemm_in_place_and_in_a_graph(rng):
    cuda = TorchBackend("cuda")
    m_idx = _segments([5, 0, 130, 17])  # an expert with no rows, one over a block, short ones
    total = len(m_idx)
    aq, as_ = quantize_rows(rng.standard_normal((total, K)).astype(np.float32))
    _, _, wq, ws = _operands(rng)
    a = cuda.put(aq, "fp8")
    a_scales = cuda.mn_major((total, K // 128))
    a_scales.copy_(cuda.put(as_))
    b = (cuda.put(wq, "fp8"), cuda.put(ws))
    d = cuda.put(np.full((total, N), POISON, dtype=np.uint16), "bf16")
    m_indices = cuda.put(m_idx)
    pointers = [t.data_ptr() for t in (a, a_scales, b[0], b[1], d, m_indices)]

    assert moekit.m_grouped_fp8_gemm_nt_contiguous((a, a_scales), b, d, m_indices) is d  # eager; makes the plan
    torch.cuda.synchronize()
    _check_contiguous(d, m_idx, aq, as_, wq, ws)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moekit.m_grouped_fp8_gemm_nt_contiguous((a, a_scales), b, d, m_indices)

    # New rows and new segments (same M_total) in the same buffers; the replay must use them.
    m_idx2 = _segments([128, 200, 0, 60])
    aq2, as2 = quantize_rows(np.random.default_rng(98).standard_normal((total, K)).astype(np.float32))
    a.view(torch.uint8).copy_(torch.from_numpy(aq2))
    a_scales.copy_(cuda.put(as2))
    m_indices.copy_(torch.from_numpy(m_idx2))
    d.view(torch.int16).fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    _check_contiguous(d, m_idx2, aq2, as2, wq, ws)
    assert [t.data_ptr() for t in (a, a_scales, b[0], b[1], d, m_indices)] == pointers


def test_contiguous_gemm_bad_arguments(rng):
    cuda = TorchBackend("cuda")
    m_idx = _segments([5, 0, 0, 0])
    a = cuda.put(np.zeros((128, K), dtype=np.uint8), "fp8")
    a_scales = cuda.mn_major((128, K // 128))
    _, _, wq, ws = _operands(rng)
    b = (cuda.put(wq, "fp8"), cuda.put(ws))
    d = cuda.put(np.zeros((128, N), dtype=np.uint16), "bf16")
    with pytest.raises(TypeError, match="m_indices must have dtype int32"):
        moekit.m_grouped_fp8_gemm_nt_contiguous((a, a_scales), b, d, cuda.put(m_idx.astype(np.int64)))
    with pytest.raises(ValueError, match=r"d must have shape \[M_total=128, N=256\]"):
        moekit.m_grouped_fp8_gemm_nt_contiguous((a, a_scales), b, d[:64], cuda.put(m_idx))
    with pytest.raises(ValueError, match="a\\[1\\] \\(activation scales\\) must have strides"):
        moekit.m_grouped_fp8_gemm_nt_contiguous((a, a_scales.contiguous()), b, d, cuda.put(m_idx))


# ---- Normal mode (prefill) on the GPU: the contiguous layout, equal to the CPU group bit for bit ----

def _normal_inputs(rng):
    from test_ep import HIDDEN, P, T_MAX, _routing, _tokens
    xs = [_tokens(r, T_MAX - r, rng) for r in range(P)]
    routing = [_routing(rng, T_MAX - r) for r in range(P)]
    adds = [moekit.float32_to_bf16(rng.integers(-4, 5, size=(T_MAX - r, HIDDEN)).astype(np.float32)) for r in range(P)]
    return xs, routing, adds


def _normal_cpu_step(group, xs, routing, adds, seed):
    """The CPU group's normal step, a thread per rank. Expert outputs are small integers on the rows
    the step filled and NaN on its padding rows, which the combine must not read."""
    from test_ep import HIDDEN

    def step(buf):
        idx, w = routing[buf.rank]
        (recv_x, recv_scales), m_indices, counts, handle, _ = buf.dispatch(xs[buf.rank], idx, w)
        values = np.random.default_rng(seed + buf.rank).integers(-8, 9, size=(len(m_indices), HIDDEN))
        y = np.where(m_indices[:, None] >= 0, moekit.float32_to_bf16(values.astype(np.float32)), np.uint16(POISON))
        out, _, _ = buf.combine(y, handle, add=adds[buf.rank])
        return recv_x, np.asarray(recv_scales), m_indices, counts, handle.recv_src, y, out

    return group.run(step)


def _normal_gpu_inputs(cuda, xs, routing, adds, cpu, rows):
    """Per rank (x, topk_idx, topk_weights, y, add) on the GPU; y spans the buffers' rows, NaN past
    the CPU step's M_total (rows the GPU step does not fill either, so must not read)."""
    from test_ep import HIDDEN
    inputs = []
    for r in range(len(xs)):
        y = np.full((rows, HIDDEN), POISON, dtype=np.uint16)
        y[:len(cpu[r][5])] = cpu[r][5]
        inputs.append((cuda.put(xs[r], "bf16"), cuda.put(routing[r][0]), cuda.put(routing[r][1]), cuda.put(y, "bf16"),
                       cuda.put(adds[r], "bf16")))
    return inputs


def _normal_gpu_step(group, inputs, outs=None):
    """On one stream, ep.h's order: every rank's dispatch, every hook, every combine, every hook."""
    sent = [b.dispatch(i[0], i[1], i[2], return_recv_hook=True) for b, i in zip(group.buffers, inputs)]
    for s in sent:
        s[5]()
    combined = [b.combine(i[3], s[3], add=i[4], out=None if outs is None else outs[r], return_recv_hook=True)
                for r, (b, i, s) in enumerate(zip(group.buffers, inputs, sent))]
    for c in combined:
        c[3]()
    return sent, [c[0] for c in combined]


def _compare_normal(cpu, gpu, cuda):
    sent, outs = gpu
    for r, ((recv_x, recv_scales, m_indices, counts, recv_src, _, out), s) in enumerate(zip(cpu, sent)):
        (g_x, g_scales), g_m, g_count, handle, _, _ = s
        total = len(m_indices)
        assert cuda.get(handle.recv_total_rows).tolist() == [total]
        np.testing.assert_array_equal(cuda.get(g_count), counts)
        # The step's M_total rows, padding included (zero payload and scales in both).
        np.testing.assert_array_equal(cuda.get(g_x)[:total], recv_x)
        np.testing.assert_array_equal(cuda.get(g_scales)[:total], recv_scales)
        for got, want in ((cuda.get(g_m), m_indices), (cuda.get(handle.recv_src), recv_src)):
            np.testing.assert_array_equal(got[:total], want)
            assert np.all(got[total:] == -1)  # past M_total: skipped by the contiguous GEMM
        assert np.all(np.isfinite(bf16_bits_to_float(out)))  # no NaN row of y was read
        np.testing.assert_array_equal(cuda.get(outs[r]), out)


def _receive_pointers(sent):
    return [[t.data_ptr() for t in (s[0][0], s[0][1], s[1], s[2], s[3].recv_src, s[3].recv_total_rows)] for s in sent]


def test_ep_normal_cuda_equals_cpu_and_replays_in_a_graph():
    from test_ep import HIDDEN, K, P, SLOTS, T_MAX
    cuda = TorchBackend("cuda")
    cpu_group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, block_m=128)  # the CUDA group's default padding
    gpu_group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, device="cuda", protocol="normal")
    rows = gpu_group.max_recv_rows
    assert rows % 128 == 0

    pointers = None
    for seed in (1, 2):  # two eager steps with fresh routing: the same receive memory each time
        xs, routing, adds = _normal_inputs(np.random.default_rng(seed))
        cpu = _normal_cpu_step(cpu_group, xs, routing, adds, seed)
        inputs = _normal_gpu_inputs(cuda, xs, routing, adds, cpu, rows)
        gpu = _normal_gpu_step(gpu_group, inputs)
        gpu_group.check()
        _compare_normal(cpu, gpu, cuda)
        assert gpu[0][0][0][0].shape == (rows, HIDDEN) and gpu[0][0][0][1].shape == (rows, HIDDEN // 128)
        assert pointers is None or _receive_pointers(gpu[0]) == pointers
        pointers = _receive_pointers(gpu[0])

    # The whole step captured once, into fixed outputs; the replay reads new tokens, routing, expert
    # outputs and add terms copied into the captured inputs.
    outs = [torch.empty((T_MAX - r, HIDDEN), dtype=torch.bfloat16, device="cuda") for r in range(P)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _normal_gpu_step(gpu_group, inputs, outs)
    xs, routing, adds = _normal_inputs(np.random.default_rng(3))
    cpu = _normal_cpu_step(cpu_group, xs, routing, adds, 3)
    for dst, src in zip(inputs, _normal_gpu_inputs(cuda, xs, routing, adds, cpu, rows)):
        for d, s in zip(dst, src):
            d.copy_(s)
    graph.replay()
    gpu_group.check()
    _compare_normal(cpu, captured, cuda)
    assert _receive_pointers(captured[0]) == pointers
    assert [o.data_ptr() for o in captured[1]] == [o.data_ptr() for o in outs]


def test_ep_normal_cuda_feeds_the_contiguous_gemm():
    """The receive tensors go to the contiguous GEMM as they are, over the buffers' rows: rows with
    m_indices = -1 (padding, and past the step's M_total) stay untouched."""
    from test_ep import E_LOC, HIDDEN, K, P, SLOTS, T_MAX
    cuda = TorchBackend("cuda")
    group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, device="cuda", protocol="normal")
    xs, routing, _ = _normal_inputs(np.random.default_rng(4))
    sent = [b.dispatch(cuda.put(xs[r], "bf16"), cuda.put(routing[r][0]).long(), cuda.put(routing[r][1]),
                       return_recv_hook=True) for r, b in enumerate(group.buffers)]  # int64 topk_idx, as DeepEP's
    for s in sent:
        s[5]()
    (recv_x, recv_scales), m_indices, recv_count, _, _, _ = sent[0]
    weights = np.random.default_rng(5).standard_normal((E_LOC, 128, HIDDEN)) / 16
    wq, ws = moekit.per_block_cast_to_fp8(weights.astype(np.float32))
    d = cuda.put(np.full((group.max_recv_rows, 128), POISON, dtype=np.uint16), "bf16")
    moekit.m_grouped_fp8_gemm_nt_contiguous((recv_x, recv_scales), (cuda.put(wq, "fp8"), cuda.put(ws)), d, m_indices)
    group.check()

    m = cuda.get(m_indices)
    np.testing.assert_array_equal(np.bincount(m[m >= 0], minlength=E_LOC), cuda.get(recv_count))
    a, a_scales, got, w = cuda.get(recv_x), cuda.get(recv_scales), cuda.get(d), dequantize_blocks(wq, ws)
    for e in range(E_LOC):
        rows = m == e
        if rows.any():
            want = np.einsum("mk,nk->mn", dequantize_rows(a[rows], a_scales[rows]), w[e])
            assert np.linalg.norm(bf16_bits_to_float(got[rows]) - want) <= 3e-3 * np.linalg.norm(want)
    assert np.all(got[m < 0] == POISON)


def test_ep_normal_cuda_bad_arguments():
    from test_ep import HIDDEN, K, P, SLOTS, T_MAX
    cuda = TorchBackend("cuda")
    with pytest.raises(ValueError, match="protocol = 'prefill'"):
        moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, device="cuda", protocol="prefill")
    with pytest.raises(ValueError, match="max_recv_rows = 256 sizes"):
        moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, device="cuda", max_recv_rows=256)  # low-latency has no rows
    group = moekit.LocalGroup(P, T_MAX, HIDDEN, SLOTS, K, device="cuda", protocol="normal")
    buf = group.buffer(0)
    x = torch.zeros((2, HIDDEN), dtype=torch.bfloat16, device="cuda")
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device="cuda")
    w = torch.ones((2, K), device="cuda")
    # Each is refused before a kernel is queued, so the group's step stays whole.
    with pytest.raises(ValueError, match="return_recv_hook=True"):
        buf.dispatch(x, idx, w)
    with pytest.raises(ValueError, match="protocol='normal'"):
        buf.low_latency_dispatch(x, idx, T_MAX, SLOTS, topk_weights=w, return_recv_hook=True)
    with pytest.raises(TypeError, match="topk_weights must have dtype float32"):
        buf.dispatch(x, idx, w.double(), return_recv_hook=True)
    with pytest.raises(ValueError, match="must be on cuda"):
        buf.dispatch(x.cpu(), idx.cpu(), w.cpu(), return_recv_hook=True)

    # combine's x is the contiguous GEMM's output over the buffers' rows, not the step's M_total.
    sent = [b.dispatch(x, idx, w, return_recv_hook=True) for b in group.buffers]
    for s in sent:
        s[5]()
    rows = group.max_recv_rows
    with pytest.raises(ValueError, match=rf"x must have shape \[max_recv_rows={rows}, hidden={HIDDEN}\]"):
        group.buffer(0).combine(torch.zeros((128, HIDDEN), dtype=torch.bfloat16, device="cuda"), sent[0][3],
                                return_recv_hook=True)
    y = cuda.put(np.zeros((rows, HIDDEN), dtype=np.uint16), "bf16")
    with pytest.raises(TypeError, match="add must have dtype bfloat16"):  # checked before the send is queued
        group.buffer(0).combine(y, sent[0][3], add=torch.zeros((2, HIDDEN), device="cuda"), return_recv_hook=True)
    combined = [b.combine(y, s[3], return_recv_hook=True) for b, s in zip(group.buffers, sent)]
    for c in combined:
        c[3]()
    group.check()
    assert torch.all(combined[0][0] == 0)
