"""How the package allocates outputs and hands tensors to the C++ core.

moekit's C++ core never allocates a tensor: it writes into tensors that the caller passes.
The convenience functions of this package allocate those outputs with the framework of their
first input (PyTorch on the input's device, or NumPy), so a PyTorch caller gets PyTorch tensors
from PyTorch's allocator (and its CUDA-Graph memory pool during a capture).

Dtypes that NumPy lacks travel as raw bits of the same width: fp8 e4m3 as uint8, bf16 as
uint16. PyTorch tensors keep their real dtypes (torch.float8_e4m3fn, torch.bfloat16); an fp8
tensor is passed to the core as a uint8 view of the same memory, which works with every
PyTorch version's DLPack export.
"""

import sys

import numpy as np

# Logical dtypes of moekit's tensors.
FP8 = "fp8"
BF16 = "bf16"
F32 = "f32"
I32 = "i32"
I64 = "i64"

_NUMPY_DTYPES = {FP8: np.uint8, BF16: np.uint16, F32: np.float32, I32: np.int32, I64: np.int64}


def _torch():
    return sys.modules.get("torch")


def is_torch(t):
    torch = _torch()
    return torch is not None and isinstance(t, torch.Tensor)


def _torch_dtype(kind):
    torch = _torch()
    return {FP8: torch.float8_e4m3fn, BF16: torch.bfloat16, F32: torch.float32, I32: torch.int32, I64: torch.int64}[kind]


def shape_of(t, name):
    """t's shape as a tuple, or the binding's TypeError for something that is not a tensor."""
    shape = getattr(t, "shape", None)
    if shape is None:
        raise TypeError(f"{name} must be a tensor that supports DLPack (NumPy, PyTorch, CuPy ...), "
                        f"got {type(t).__name__}")
    return tuple(shape)


def empty(like, shape, kind):
    """An uninitialised tensor of `shape` and logical dtype `kind`, in `like`'s framework and device."""
    if is_torch(like):
        return _torch().empty(shape, dtype=_torch_dtype(kind), device=like.device)
    return np.empty(shape, dtype=_NUMPY_DTYPES[kind])


def empty_mn_major(like, shape):
    """fp32 scales of logical shape [..., M, K/128] whose memory is [..., K/128, M] (layout.h)."""
    swapped = tuple(shape[:-2]) + (shape[-1], shape[-2])
    t = empty(like, swapped, F32)
    return t.transpose(-1, -2) if is_torch(t) else t.swapaxes(-1, -2)


def dl(t):
    """What the core receives: the tensor itself, or for a PyTorch fp8 tensor a uint8 view of it."""
    if is_torch(t) and t.dtype == _torch().float8_e4m3fn:
        return t.view(_torch().uint8)
    return t


def stream_of(t):
    """The CUDA stream the caller's framework works on (PyTorch's current stream, which is the
    capture stream inside torch.cuda.graph), or 0 for CPU tensors."""
    if is_torch(t) and t.is_cuda:
        return _torch().cuda.current_stream(t.device).cuda_stream
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray):
        return cupy.cuda.get_current_stream().ptr
    return 0


def bf16_to_float32(bits):
    """NumPy uint16 bf16 bits -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(x):
    """NumPy float32 -> uint16 bf16 bits, rounded to nearest even (NaN kept quiet)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)
