"""CUDA only (skipped elsewhere): the grouped GEMMs on PyTorch CUDA tensors through DLPack, written
in place (data pointers), and captured into a CUDA Graph with torch.cuda.graph, then replayed on
new data and new masked_m in the same buffers. Run on the GPU machine by scripts/gpu-python."""

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


def test_quantisation_has_no_cuda_path_yet():
    x = torch.zeros((2, 128), device="cuda")
    with pytest.raises(ValueError, match="no CUDA path"):
        moekit.per_token_cast_to_fp8(x)
