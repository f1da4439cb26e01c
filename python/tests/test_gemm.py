"""Grouped GEMMs through the binding, DeepGEMM's argument order, against a float64 product of the
dequantised operands (conftest.py's value table). CPU tensors run the reference, CUDA tensors
the Hopper kernels; the tolerance is the bf16 output rounding."""

import numpy as np
import pytest

import moekit
from conftest import bf16_bits_to_float, dequantize_blocks, dequantize_rows, quantize_rows

POISON = 0x7FC1  # a bf16 NaN that no result can be


def _weights(rng, num_experts, n, k):
    w = (rng.standard_normal((num_experts, n, k)) / np.sqrt(k)).astype(np.float32)
    q, s = moekit.per_block_cast_to_fp8(w)
    return q, s


def _activations(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return quantize_rows(x)


def _check_close(got_bits, want):
    got = bf16_bits_to_float(got_bits)
    assert np.linalg.norm(got - want) <= 3e-3 * np.linalg.norm(want)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=1e-3 * np.abs(want).max())


def _masked_problem(backend, rng, num_experts=3, max_m=8, n=256, k=384):
    aq, as_ = _activations(rng, (num_experts, max_m, k))
    wq, ws = _weights(rng, num_experts, n, k)
    a_scales = backend.mn_major((num_experts, max_m, k // 128))
    a_scales[...] = backend.put(as_)
    a = (backend.put(aq, "fp8"), a_scales)
    b = (backend.put(wq, "fp8"), backend.put(ws))
    want = np.einsum("emk,enk->emn", dequantize_rows(aq, as_), dequantize_blocks(wq, ws))
    return a, b, want


def test_masked_gemm(backend, rng):
    num_experts, max_m, n = 3, 8, 256
    a, b, want = _masked_problem(backend, rng, num_experts, max_m, n)
    masked_m_np = np.array([5, 0, 8], dtype=np.int32)
    d = backend.put(np.full((num_experts, max_m, n), POISON, dtype=np.uint16), "bf16")
    d_ptr = backend.ptr(d)
    out = moekit.m_grouped_fp8_gemm_nt_masked(a, b, d, backend.put(masked_m_np), 4)
    assert out is d and backend.ptr(out) == d_ptr  # written in the caller's tensor
    got = backend.get(d)
    for e, m in enumerate(masked_m_np):
        _check_close(got[e, :m], want[e, :m]) if m else None
        assert np.all(got[e, m:] == POISON), f"rows past masked_m[{e}] = {m} were written"


def test_masked_gemm_bad_arguments(backend, rng):
    a, b, _ = _masked_problem(backend, rng)
    d = backend.put(np.zeros((3, 8, 256), dtype=np.uint16), "bf16")
    mm = backend.put(np.array([1, 2, 3], dtype=np.int32))
    gemm = moekit.masked_grouped_gemm
    with pytest.raises(TypeError, match=r"a\[0\] \(activations\) must have dtype float8_e4m3fn"):
        gemm((a[1], a[1]), b, d, mm, 4)
    with pytest.raises(ValueError, match=r"a\[1\] \(activation scales\) must have strides"):
        gemm((a[0], backend.put(np.zeros((3, 8, 3), np.float32))), b, d, mm, 4)
    with pytest.raises(ValueError, match=r"d must have shape \[E_loc=3, M_max=8, N=256\], got \[3, 8, 128\]"):
        gemm(a, b, backend.put(np.zeros((3, 8, 128), dtype=np.uint16), "bf16"), mm, 4)
    with pytest.raises(TypeError, match="masked_m must have dtype int32, got int64"):
        gemm(a, b, d, backend.put(np.array([1, 2, 3], dtype=np.int64)), 4)
    with pytest.raises(ValueError, match=r"b\[0\] \(weights\) must have shape \[E_loc=3, N=any, K=384\]"):
        gemm(a, (b[0][:2], b[1][:2]), d, mm, 4)
    with pytest.raises(TypeError, match=r"b must be a pair"):
        gemm(a, b[0], d, mm, 4)
    if not backend.is_cuda:  # on the GPU masked_m stays on the device and is clamped (gemm.h)
        with pytest.raises(ValueError, match=r"masked_m\[2\] = 9 must be in \[0, M_max = 8\]"):
            gemm(a, b, d, backend.put(np.array([1, 2, 9], dtype=np.int32)), 4)


def test_contiguous_gemm(backend, rng):
    k, n, align = 256, 128, 128
    # Two experts, each segment padded to 128 rows: 100 rows of expert 1, then 128 of expert 0.
    m_indices = np.full(2 * align, -1, dtype=np.int32)
    m_indices[:100] = 1
    m_indices[align:2 * align] = 0
    aq, as_ = _activations(rng, (2 * align, k))
    wq, ws = _weights(rng, 2, n, k)
    a_scales = backend.mn_major((2 * align, k // 128))
    a_scales[...] = backend.put(as_)
    d = backend.put(np.full((2 * align, n), POISON, dtype=np.uint16), "bf16")
    out = moekit.m_grouped_fp8_gemm_nt_contiguous((backend.put(aq, "fp8"), a_scales), (backend.put(wq, "fp8"), backend.put(ws)),
                                                  d, backend.put(m_indices))
    assert out is d
    got = backend.get(d)
    a64, w64 = dequantize_rows(aq, as_), dequantize_blocks(wq, ws)
    rows = m_indices >= 0
    want = np.einsum("mk,mnk->mn", a64[rows], w64[m_indices[rows]])
    _check_close(got[rows], want)
    assert np.all(got[~rows] == POISON)
    with pytest.raises(ValueError, match=r"m_indices must have shape \[M_total=256\]"):
        moekit.contiguous_grouped_gemm((backend.put(aq, "fp8"), a_scales), (backend.put(wq, "fp8"), backend.put(ws)), d,
                                       backend.put(m_indices[:10]))
