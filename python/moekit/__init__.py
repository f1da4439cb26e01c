"""moekit: an MoE serving core (planner, EPLB, FP8 grouped GEMMs, expert-parallel dispatch and
combine, the MoE layer), callable from Python on any DLPack tensor (PyTorch, NumPy, CuPy ...).

Names and argument order follow DeepGEMM's and DeepEP's Python APIs where the semantics match,
so switching an engine is a one-line change; docs/python.md lists the correspondence.

Tensors are never copied: inputs are read where they are, outputs are written into tensors the
caller passes (`out=`) or that this package allocates with the caller's framework. A wrong dtype
raises TypeError, a wrong shape, stride or device ValueError, each naming the argument and what
was expected; moekit's own checks raise moekit.Error (a ValueError) with the core's message.
"""

from . import _core
from ._core import Error, embedded_gpus, embedded_models, gpu_spec, model_spec
from ._tensors import bf16_to_float32, dl, empty, empty_mn_major, float32_to_bf16, is_torch, shape_of, stream_of, FP8, F32

from .ep import Buffer, LocalGroup, run_ranks
from .layer import MoELayer, write_random_weights

with_cuda = _core.with_cuda

__all__ = [
    "Error", "with_cuda",
    "model_spec", "gpu_spec", "embedded_models", "embedded_gpus",
    "plan", "rebalance", "rebalance_experts", "balance",
    "per_token_cast_to_fp8", "per_block_cast_to_fp8", "per_token_cast_back",
    "m_grouped_fp8_gemm_nt_masked", "masked_grouped_gemm",
    "m_grouped_fp8_gemm_nt_contiguous", "contiguous_grouped_gemm", "clear_gemm_plans",
    "LocalGroup", "Buffer", "run_ranks", "MoELayer", "write_random_weights",
    "bf16_to_float32", "float32_to_bf16",
]


# ---- Planner ---------------------------------------------------------------------------------

plan = _core.plan


# ---- EPLB (DeepSeek EPLB's vocabulary) --------------------------------------------------------

def _host(t):
    return t.detach().cpu() if is_torch(t) else t


def _like(result, like):
    if is_torch(like):
        import torch
        return torch.from_numpy(result)
    return result


def rebalance(weight, num_slots, num_groups, num_nodes, num_gpus):
    """DeepSeek EPLB's placement, entry for entry: weight [L, E] loads (any numeric tensor) ->
    (phy2log [L, num_slots], log2phy [L, E, max_replicas] (-1 padded), replica_count [L, E]),
    int64, as PyTorch tensors for a PyTorch weight, else NumPy arrays. Hierarchical when
    num_groups % num_nodes == 0, else global. GPU loads are read on the host (.cpu())."""
    host = _host(weight)
    return tuple(_like(r, weight) for r in _core.rebalance(host, num_slots, num_groups, num_nodes, num_gpus))


# EPLB's own name (eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)).
rebalance_experts = rebalance


def balance(weight, phy2log, num_groups, num_nodes, num_gpus):
    """Per-GPU loads and balancedness (mean/max per layer) before (identity placement) and after phy2log."""
    report = _core.balance(_host(weight), _host(phy2log), num_groups, num_nodes, num_gpus)
    for key in ("gpu_load_before", "gpu_load_after"):
        flat = report[key]
        report[key] = [flat[i:i + num_gpus] for i in range(0, len(flat), num_gpus)]
    return report


# ---- FP8 quantisation (DeepGEMM's utils names) ------------------------------------------------

def per_token_cast_to_fp8(x, out=None, check_finite=True):
    """x [..., M, K] fp32 or bf16 (K a multiple of 128) -> (x_fp8 [..., M, K], x_scales [..., M, K/128]).

    One fp32 scale per token and 128 columns: scale = amax / 448, x_fp8 = e4m3(x / scale).
    x_scales is MN-major (its memory is [..., K/128, M]), the layout the grouped GEMMs read.
    `out=(x_fp8, x_scales)` writes into the caller's tensors instead of allocating. CUDA tensors
    are quantised on the current stream; a NaN or infinity is a ValueError, which on CUDA costs
    one synchronisation: check_finite=False (or a CUDA-Graph capture) skips that check.
    """
    if out is None:
        shape = shape_of(x, "x")
        out = (empty(x, shape, FP8), empty_mn_major(x, shape[:-1] + (shape[-1] // 128,)))
    _core.quantize_per_token(x, dl(out[0]), out[1], stream_of(x), check_finite)
    return out


def per_block_cast_to_fp8(w, out=None, check_finite=True):
    """w [..., N, K] fp32 or bf16 (N, K multiples of 128) -> (w_fp8 [..., N, K], w_scales [..., N/128, K/128]),
    one fp32 scale per 128x128 block (DeepSeek-V3's checkpoint format). CUDA tensors as in
    per_token_cast_to_fp8."""
    if out is None:
        shape = shape_of(w, "w")
        out = (empty(w, shape, FP8), empty(w, shape[:-2] + (shape[-2] // 128, shape[-1] // 128), F32))
    _core.quantize_per_block(w, dl(out[0]), out[1], stream_of(w), check_finite)
    return out


def per_token_cast_back(x_fp8, x_scales, out=None):
    """The inverse of per_token_cast_to_fp8: fp32 [..., M, K] = e4m3 value x its scale."""
    if out is None:
        out = empty(x_fp8, shape_of(x_fp8, "x_fp8"), F32)
    _core.dequantize_per_token(dl(x_fp8), x_scales, out)
    return out


# ---- Grouped GEMMs (DeepGEMM's names and argument order) --------------------------------------

def _pair(p, name):
    if not isinstance(p, (tuple, list)) or len(p) != 2:
        raise TypeError(f"{name} must be a pair ({name}, {name}_scales), got {type(p).__name__}")
    return (dl(p[0]), p[1])


def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m):
    """Masked grouped GEMM (decode): d[e, :masked_m[e]] = a[e] . b[e]^T in bf16.

    a = (a [E_loc, M_max, K] fp8, a_scales [E_loc, M_max, K/128] fp32 MN-major),
    b = (w [E_loc, N, K] fp8, w_scales [E_loc, N/128, K/128] fp32), d [E_loc, M_max, N] bf16,
    masked_m [E_loc] int32 on the tensors' device, expected_m an int that only steers the tile
    choice. Rows at or past masked_m[e] are neither read nor written. CPU tensors run the
    reference, CUDA tensors the Hopper kernel on the current stream (graph-capturable after one
    call on the same buffers)."""
    _core.gemm_masked(_pair(a, "a"), _pair(b, "b"), d, masked_m, int(expected_m), stream_of(d))
    return d


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices):
    """Contiguous grouped GEMM (prefill): d[m] = a[m] . b[m_indices[m]]^T in bf16.

    a = (a [M_total, K] fp8, a_scales [M_total, K/128] fp32 MN-major), b as in the masked GEMM,
    d [M_total, N] bf16, m_indices [M_total] int32: the local expert of each row, -1 for padding
    rows (not written). Expert segments are padded to 128 rows on CUDA (gemm.h)."""
    _core.gemm_contiguous(_pair(a, "a"), _pair(b, "b"), d, m_indices, stream_of(d))
    return d


# The names of the issue.
masked_grouped_gemm = m_grouped_fp8_gemm_nt_masked
contiguous_grouped_gemm = m_grouped_fp8_gemm_nt_contiguous
clear_gemm_plans = _core.clear_gemm_plans
