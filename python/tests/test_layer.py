"""The whole MoE layer over in-process ranks through the binding, against a float64 evaluation
written here from the checkpoint's bytes (read with a NumPy safetensors reader of its own)."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import moekit
from conftest import bf16_bits_to_float, dequantize_blocks, dequantize_rows, quantize_rows

MODEL = {
    "name": "py-test-moe", "hidden_size": 256, "num_layers": 1, "num_moe_layers": 1,
    "moe_intermediate_size": 128, "num_routed_experts": 16, "num_experts_per_token": 4,
    "num_shared_experts": 1, "shared_intermediate_size": 128,
    "total_params": 1e7, "active_params": 1e6, "weight_bytes_per_param": 1.0, "kv_bytes_per_token": 1024,
    "router": {"scoring": "sigmoid", "num_groups": 4, "topk_groups": 2, "routed_scaling_factor": 2.5,
               "normalize_topk": True},
}
D, INTER, E, K = 256, 128, 16, 4


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights")
    info = moekit.write_random_weights(MODEL, str(path), num_layers=1, seed=7)
    assert info["tensor_bytes"] > 0
    return path


def read_safetensors(directory):
    """{name: NumPy array} from every .safetensors file: 8-byte header length, JSON header, data."""
    dtypes = {"F8_E4M3": np.uint8, "F32": np.float32, "BF16": np.uint16}
    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        raw = file.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        for name, t in header.items():
            if name == "__metadata__":
                continue
            begin, end = t["data_offsets"]
            tensors[name] = np.frombuffer(raw[8 + n + begin:8 + n + end], dtype=dtypes[t["dtype"]]).reshape(t["shape"])
    return tensors


def expert_f64(tensors, prefix, x):
    """SwiGLU expert on x [T, d] fp32 with the pipeline's activation roundings (reference.h)."""
    def w(proj):
        return dequantize_blocks(tensors[f"{prefix}.{proj}.weight"], tensors[f"{prefix}.{proj}.weight_scale_inv"])

    q, s = quantize_rows(x)
    a = dequantize_rows(q, s)
    g = bf16_bits_to_float(moekit.float32_to_bf16((a @ w("gate_proj").T).astype(np.float32))).astype(np.float32)
    u = bf16_bits_to_float(moekit.float32_to_bf16((a @ w("up_proj").T).astype(np.float32))).astype(np.float32)
    v = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
    q2, s2 = quantize_rows(v)
    return dequantize_rows(q2, s2) @ w("down_proj").T


def layer_f64(tensors, x, idx, w):
    out = expert_f64(tensors, "model.layers.0.mlp.shared_experts", x)
    for t in range(len(x)):
        for j in range(K):
            out[t] += w[t, j] * expert_f64(tensors, f"model.layers.0.mlp.experts.{idx[t, j]}", x[t:t + 1])[0]
    return out


def _inputs(rng, num_tokens):
    x = moekit.float32_to_bf16(rng.standard_normal((num_tokens, D)).astype(np.float32))
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (num_tokens, K)).astype(np.float32)
    return x, idx, w


@pytest.mark.parametrize("protocol", ["low-latency", "normal"])
def test_layer_matches_float64(weights_dir, rng, protocol):
    x, idx, w = _inputs(rng, 6)
    layer = moekit.MoELayer(MODEL, weights_dir, num_ranks=2, max_tokens=4, protocol=protocol, block_m=8)
    outs = layer.forward_all([x[:3], x[3:]], routing=[(idx[:3], w[:3]), (idx[3:], w[3:])])
    got = bf16_bits_to_float(np.concatenate(outs))
    want = layer_f64(read_safetensors(weights_dir), bf16_bits_to_float(x).astype(np.float32), idx, w)
    # The CPU layer's 3e-3 (docs/design.md §Numerics and their bounds), plus room for this oracle
    # rounding GEMM1's float64 sum (not an fp32 one) to bf16.
    assert np.linalg.norm(got - want) <= 4e-3 * np.linalg.norm(want)
    step = layer.last_step(1)
    assert step["num_tokens"] == 3 and len(step["topk_idx"]) == 3 * K
    assert sum(layer.last_step(0)["recv_count"]) + sum(step["recv_count"]) == 6 * K  # every pair once


def test_gate_routing_and_rank_count(weights_dir, rng):
    """The gate's own routing; P = 1 and P = 2 give the same tokens' outputs up to combine rounding,
    and a redundant-expert placement (EPLB) changes nothing but where experts run."""
    x, _, _ = _inputs(rng, 8)
    one = moekit.MoELayer(MODEL, weights_dir, num_ranks=1, max_tokens=8).forward_all([x])[0]
    two = moekit.MoELayer(MODEL, weights_dir, num_ranks=2, max_tokens=4).forward_all([x[:4], x[4:]])
    a, b = bf16_bits_to_float(one), bf16_bits_to_float(np.concatenate(two))
    assert np.all(np.isfinite(a)) and np.abs(a).max() > 0
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(a)
    load = np.arange(1, E + 1, dtype=np.float64)[None, :]
    phy2log, _, _ = moekit.rebalance(load, 20, 1, 1, 2)
    eplb = moekit.MoELayer(MODEL, weights_dir, num_ranks=2, max_tokens=4, phy2log=phy2log[0])
    c = bf16_bits_to_float(np.concatenate(eplb.forward_all([x[:4], x[4:]])))
    assert np.linalg.norm(a - c) <= 1e-2 * np.linalg.norm(a)


def test_layer_bad_arguments(weights_dir, rng):
    layer = moekit.MoELayer(MODEL, weights_dir, num_ranks=1, max_tokens=4)
    x, idx, w = _inputs(rng, 5)
    with pytest.raises(moekit.Error):
        layer.forward_all([x])  # 5 tokens > T_max = 4
    with pytest.raises(TypeError, match="x must have dtype bfloat16"):
        layer.forward(0, np.zeros((2, D), np.float32))
    with pytest.raises(ValueError, match="pass topk_idx and topk_weights together"):
        layer.forward(0, x[:2], 0, idx[:2], None)
    with pytest.raises(ValueError, match="protocol = 'fast'"):
        moekit.MoELayer(MODEL, weights_dir, num_ranks=1, max_tokens=4, protocol="fast")
    with pytest.raises(moekit.Error):
        moekit.MoELayer(MODEL, weights_dir / "missing", num_ranks=1, max_tokens=4)
