"""Shared test helpers: the tensor backends the tests run on, and NumPy oracles written
independently of moekit's C++ (FP8 by its value table, not by bit manipulation).

Backends: "numpy" always; "torch-cpu" where PyTorch imports; "torch-cuda" where PyTorch sees a
GPU and moekit was built with CUDA. Every test that takes `backend` runs on each of them, so a
GPU host runs the same tests on CUDA tensors (make test-gpu, or scripts/gpu-python).
"""

import numpy as np
import pytest

import moekit

try:
    import torch
except ImportError:  # CI has NumPy only
    torch = None


# ---- FP8 e4m3 by its value table --------------------------------------------------------------

def _e4m3_table():
    values = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, man = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            values[code] = np.nan
        elif exp == 0:
            values[code] = sign * man * 2.0 ** -9
        else:
            values[code] = sign * (1 + man / 8) * 2.0 ** (exp - 7)
    return values


E4M3 = _e4m3_table()
_POS = E4M3[:127]  # codes 0..126: 0 up to 448, increasing


def encode_e4m3(y):
    """float32 array -> e4m3 codes: nearest value, ties to the even code, saturating at 448."""
    y = np.asarray(y, dtype=np.float64)
    mag = np.minimum(np.abs(y), 448.0)
    hi = np.clip(np.searchsorted(_POS, mag), 1, 126)
    lo = hi - 1
    d_lo, d_hi = mag - _POS[lo], _POS[hi] - mag
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code | np.where(y < 0, 0x80, 0)).astype(np.uint8)


def quantize_rows(x):
    """x [..., M, K] float32 -> (codes [..., M, K], scales [..., M, K/128]) by quant.h's rule."""
    x = np.asarray(x, dtype=np.float32)
    groups = x.reshape(x.shape[:-1] + (x.shape[-1] // 128, 128))
    amax = np.abs(groups).max(axis=-1)
    scales = (np.maximum(amax, np.float32(1e-4)) / np.float32(448.0)).astype(np.float32)
    q = encode_e4m3((groups / scales[..., None]).astype(np.float32))
    return q.reshape(x.shape), scales


def dequantize_rows(q, scales):
    k = q.shape[-1]
    return E4M3[q] * np.repeat(scales.astype(np.float64), 128, axis=-1)[..., :k]


def dequantize_blocks(q, scales):
    """[..., N, K] codes with [..., N/128, K/128] scales -> float64."""
    s = np.repeat(np.repeat(scales.astype(np.float64), 128, axis=-2), 128, axis=-1)
    return E4M3[q] * s


def bf16_bits_to_float(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---- Backends -----------------------------------------------------------------------------------

class NumpyBackend:
    name = "numpy"
    is_cuda = False

    def put(self, arr, kind=None):
        return np.ascontiguousarray(arr)

    def get(self, t):
        return np.asarray(t)

    def ptr(self, t):
        return t.ctypes.data

    def mn_major(self, shape):
        """An fp32 scale tensor of logical shape [..., M, K/128], memory [..., K/128, M]."""
        return np.zeros(shape[:-2] + (shape[-1], shape[-2]), dtype=np.float32).swapaxes(-1, -2)


class TorchBackend:
    is_cuda = False

    def __init__(self, device):
        self.device = device
        self.name = f"torch-{device}"
        self.is_cuda = device == "cuda"

    def put(self, arr, kind=None):
        """NumPy -> torch on the device; kind 'fp8' / 'bf16' reinterprets uint8 / uint16 bits."""
        arr = np.ascontiguousarray(arr)
        if kind == "fp8":
            return torch.from_numpy(arr.view(np.uint8)).to(self.device).view(torch.float8_e4m3fn)
        if kind == "bf16":
            return torch.from_numpy(arr.view(np.int16)).to(self.device).view(torch.bfloat16)
        return torch.from_numpy(arr).to(self.device)

    def get(self, t):
        t = t.detach().cpu()
        if t.dtype == torch.float8_e4m3fn:
            return t.view(torch.uint8).numpy()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def ptr(self, t):
        return t.data_ptr()

    def mn_major(self, shape):
        return torch.zeros(shape[:-2] + (shape[-1], shape[-2]), dtype=torch.float32, device=self.device).transpose(-1, -2)


def _backends():
    out = [pytest.param(NumpyBackend(), id="numpy")]
    if torch is not None:
        out.append(pytest.param(TorchBackend("cpu"), id="torch-cpu"))
        if torch.cuda.is_available() and moekit.with_cuda:
            out.append(pytest.param(TorchBackend("cuda"), id="torch-cuda"))
    return out


@pytest.fixture(params=_backends())
def backend(request):
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
