"""FP8 quantisation through the binding against the value-table oracle of conftest.py, on every
backend: NumPy, PyTorch CPU and (on a GPU host) PyTorch CUDA, whose kernels give the same bits."""

import numpy as np
import pytest

import moekit
from conftest import bf16_bits_to_float, dequantize_blocks, dequantize_rows, quantize_rows, E4M3


def _cast_back(backend, q, s):
    """per_token_cast_back is a CPU helper: CUDA results come to the host first (strides kept)."""
    return moekit.per_token_cast_back(q.cpu(), s.cpu()) if backend.is_cuda else moekit.per_token_cast_back(q, s)


def test_per_token_matches_oracle(backend, rng):
    x = (rng.standard_normal((3, 5, 384)) * rng.uniform(0.01, 100, (3, 5, 1))).astype(np.float32)
    x[0, 0, :128] = 0  # an all-zero group takes the floor scale
    q, s = moekit.per_token_cast_to_fp8(backend.put(x))
    want_q, want_s = quantize_rows(x)
    assert tuple(q.shape) == (3, 5, 384) and tuple(s.shape) == (3, 5, 3)
    np.testing.assert_array_equal(backend.get(q), want_q)
    np.testing.assert_array_equal(backend.get(s), want_s)
    assert backend.get(s)[0, 0, 0] == np.float32(1e-4) / np.float32(448)
    # Round trip: each value within half an e4m3 step (2^-4 relative) of its group's scale grid.
    back = backend.get(_cast_back(backend, q, s))
    np.testing.assert_array_equal(back, dequantize_rows(want_q, want_s).astype(np.float32))
    assert np.all(np.abs(back - x) <= np.repeat(want_s, 128, axis=-1) * 448 * 2.0 ** -4 + 1e-30)


def test_per_token_scales_are_mn_major(backend):
    x = np.arange(2 * 256, dtype=np.float32).reshape(2, 256) - 200
    _, s = moekit.per_token_cast_to_fp8(backend.put(x))
    # Memory order [K/128, M]: the scales of the two rows for one K block are adjacent.
    flat = backend.get(s).T.copy().ravel()
    _, want = quantize_rows(x)
    np.testing.assert_array_equal(flat, want.T.ravel())
    if hasattr(s, "stride"):
        assert s.stride() == (1, 2)
    else:
        assert s.strides == (4, 8)


def test_per_token_bf16_input(backend, rng):
    x = rng.standard_normal((4, 128)).astype(np.float32)
    bits = moekit.float32_to_bf16(x)
    q, s = moekit.per_token_cast_to_fp8(backend.put(bits, "bf16"))
    want_q, want_s = quantize_rows(bf16_bits_to_float(bits).astype(np.float32))
    np.testing.assert_array_equal(backend.get(q), want_q)
    np.testing.assert_array_equal(backend.get(s), want_s)


def test_per_block_matches_oracle(backend, rng):
    w = rng.standard_normal((2, 256, 384)).astype(np.float32)
    q, s = moekit.per_block_cast_to_fp8(backend.put(w))
    assert tuple(s.shape) == (2, 2, 3)
    blocks = w.reshape(2, 2, 128, 3, 128)
    amax = np.abs(blocks).max(axis=(2, 4))
    want_s = (np.maximum(amax, np.float32(1e-4)) / np.float32(448)).astype(np.float32)
    np.testing.assert_array_equal(backend.get(s), want_s)
    got = dequantize_blocks(backend.get(q), want_s)
    rel = np.linalg.norm(got - w) / np.linalg.norm(w)
    assert rel < 0.05  # e4m3 has 3 mantissa bits: about 2-3% rms
    assert np.isnan(E4M3[backend.get(q)]).sum() == 0


def test_out_buffers_are_written_in_place(backend, rng):
    """The caller's tensors are the ones written: same objects, same data pointers."""
    x = backend.put(rng.standard_normal((6, 256)).astype(np.float32))
    q = backend.put(np.zeros((6, 256), dtype=np.uint8), "fp8")
    s = backend.mn_major((6, 2))
    q_ptr, s_ptr = backend.ptr(q), backend.ptr(s)
    rq, rs = moekit.per_token_cast_to_fp8(x, out=(q, s))
    assert rq is q and rs is s
    assert backend.ptr(rq) == q_ptr and backend.ptr(rs) == s_ptr
    want_q, want_s = quantize_rows(backend.get(x))
    np.testing.assert_array_equal(backend.get(q), want_q)
    np.testing.assert_array_equal(backend.get(s), want_s)


def test_bad_arguments(backend):
    x = np.ones((4, 256), dtype=np.float32)
    with pytest.raises(TypeError, match=r"x must have dtype float32 or bfloat16.*got float64"):
        moekit.per_token_cast_to_fp8(backend.put(x.astype(np.float64)))
    with pytest.raises(ValueError, match=r"K = 200 .* multiple of 128"):
        moekit.per_token_cast_to_fp8(backend.put(np.ones((4, 200), dtype=np.float32)))
    with pytest.raises(ValueError, match=r"x must be contiguous"):
        moekit.per_token_cast_to_fp8(backend.put(np.ones((256, 4), dtype=np.float32)).T)
    with pytest.raises(ValueError, match=r"x_scales must have strides"):
        moekit.per_token_cast_to_fp8(backend.put(x), out=(backend.put(np.zeros((4, 256), np.uint8), "fp8"),
                                                         backend.put(np.zeros((4, 2), np.float32))))
    with pytest.raises(ValueError, match=r"x_fp8 must have shape \[M=4, K=256\], got \[4, 128\]"):
        moekit.per_token_cast_to_fp8(backend.put(x), out=(backend.put(np.zeros((4, 128), np.uint8), "fp8"),
                                                         backend.mn_major((4, 2))))
    with pytest.raises(moekit.Error, match="not finite"):
        moekit.per_token_cast_to_fp8(backend.put(np.full((1, 128), np.inf, dtype=np.float32)))
    with pytest.raises(ValueError, match=r"N = 64 .* multiple of 128"):
        moekit.per_block_cast_to_fp8(backend.put(np.ones((64, 128), dtype=np.float32)))


def test_read_only_output_is_refused():
    x = np.ones((2, 128), dtype=np.float32)
    q = np.zeros((2, 128), dtype=np.uint8)
    q.setflags(write=False)
    s = np.zeros((1, 2), dtype=np.float32).swapaxes(0, 1)
    with pytest.raises(ValueError, match="x_fp8 is written by moekit and must be writable"):
        moekit.per_token_cast_to_fp8(x, out=(q, s))


def test_not_a_tensor():
    with pytest.raises(TypeError, match=r"x must be a tensor that supports DLPack .* got list"):
        moekit.per_token_cast_to_fp8([[1.0] * 128])
