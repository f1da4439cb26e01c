#!/usr/bin/env python3
"""Checks moekit's safetensors files against the reference implementation (the `safetensors`
package from PyPI, with NumPy). Called by tests/cpu/test_weights.cpp; every value written or
checked here follows a formula that the C++ test computes on its own.

  write-basic FILE          write tensors of several dtypes with the package's serializer
  check-basic FILE          read a file moekit wrote with the package and assert every value
  write-deepseek DIR LAYER NUM_EXPERTS HIDDEN INTER SHARED_INTER
                            write one MoE layer of a DeepSeek-style FP8 checkpoint, sharded over
                            two files with model.safetensors.index.json
  summarize DIR             read a sharded checkpoint (index + files) with the package, check the
                            index against the files and every fp8 weight against its scales' shape,
                            print JSON {tensor: {"dtype", "shape", "sum", "sumsq"}} of the values
                            (fp8 weights dequantised with their weight_scale_inv, MXFP4 blocks
                            with their scales, which count as bytes)

Exit status: 0 on success, 1 on a failed check, 3 when numpy or safetensors is missing.
"""
import json
import os
import sys

try:
    import numpy as np
    import safetensors
    from safetensors import deserialize, safe_open, serialize_file
    from safetensors.numpy import save_file
except ImportError as e:  # the C++ test turns this into a clear failure
    print(f"python3 ({sys.executable}) cannot import numpy/safetensors: {e}; "
          "install them with `python3 -m pip install numpy safetensors` (scripts/setup does)")
    sys.exit(3)


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


# NumPy has no fp8 or bf16 type, so safetensors.numpy cannot write them (it names the dtype after
# the array's: uint8 would be written as U8). The package's own low-level serializer takes any
# of its dtypes over raw bytes: a TensorSpec since safetensors 0.6, a dict before.
TensorSpec = getattr(safetensors, "TensorSpec", None)


def spec(dtype, arr):
    """The serializer's description of a tensor of `dtype` whose raw bytes are those of `arr`.
    Returns it with the contiguous array, which must stay alive until the file is written."""
    arr = np.ascontiguousarray(arr)
    if TensorSpec is None:
        return {"dtype": dtype, "shape": list(arr.shape), "data": arr.tobytes()}, arr
    return TensorSpec(dtype=dtype, shape=list(arr.shape), data_ptr=arr.ctypes.data, data_len=arr.nbytes), arr


# ---- basic dtypes ----------------------------------------------------------------------------
# fp8 [3, 7]: byte i = (37 i + 5) % 256; f32 [2, 3]: 0.25 i - 1; bf16 [5]: bits 0x3F80 + i;
# i64 [2]: -3, 2^40; empty f32 [0, 4]; scalar f64 []: 2.5.

def basic_expected():
    return {
        "fp8": ("F8_E4M3", [3, 7], ((np.arange(21) * 37 + 5) % 256).astype(np.uint8).reshape(3, 7)),
        "f32": ("F32", [2, 3], (np.arange(6, dtype=np.float32) * 0.25 - 1).reshape(2, 3)),
        "bf16": ("BF16", [5], (0x3F80 + np.arange(5)).astype(np.uint16)),
        "i64": ("I64", [2], np.array([-3, 1 << 40], dtype=np.int64)),
        "empty": ("F32", [0, 4], np.zeros((0, 4), dtype=np.float32)),
        "scalar": ("F64", [], np.array(2.5, dtype=np.float64)),
    }


PY_DTYPE = {"F8_E4M3": "float8_e4m3fn", "F32": "float32", "BF16": "bfloat16", "I64": "int64", "F64": "float64"}


def write_basic(path):
    # Every tensor but the 0-d "scalar": TensorSpec records shape [] as [1] (safetensors 0.8).
    specs, keep = {}, []
    for name, (dtype, shape, arr) in basic_expected().items():
        if name == "scalar":
            continue
        s, a = spec(PY_DTYPE[dtype], arr)
        specs[name] = s
        keep.append(a)
    serialize_file(specs, path, metadata={"origin": "python", "format": "pt"})


def check_basic(path):
    with open(path, "rb") as f:
        raw = {name: t for name, t in deserialize(f.read())}
    expected = basic_expected()
    if sorted(raw) != sorted(expected):
        fail(f"tensors {sorted(raw)}, expected {sorted(expected)}")
    for name, (dtype, shape, arr) in expected.items():
        t = raw[name]
        if t["dtype"] != dtype or list(t["shape"]) != shape:
            fail(f"{name}: dtype {t['dtype']} shape {t['shape']}, expected {dtype} {shape}")
        if bytes(t["data"]) != arr.tobytes():
            fail(f"{name}: bytes differ")
    # The numpy front end reads the dtypes numpy has.
    with safe_open(path, framework="np") as f:
        if f.metadata() != {"origin": "moekit", "format": "pt"}:
            fail(f"metadata {f.metadata()}")
        for name in ["f32", "i64", "empty", "scalar"]:
            got = f.get_tensor(name)
            if got.dtype != expected[name][2].dtype or not np.array_equal(got, expected[name][2]):
                fail(f"{name}: {got!r} != {expected[name][2]!r}")
    print(f"OK: {len(raw)} tensors checked with safetensors {safetensors.__version__}")


# ---- a DeepSeek-style layer ------------------------------------------------------------------
# Expert e (the shared experts use e = 99), projection p (gate 0, up 1, down 2), layer l:
#   weight byte (r, c) = (31 r + 7 c + 13 e + 101 p + l) % 256
#   scale (rb, cb)     = (1 + 4 rb + cb + 16 e + 64 p) / 1024
# router bf16 bits (e, i) = 0x0100 + (e * hidden + i) % 0x3E00; bias[e] = 0.125 e - 0.25.

PROJS = ["gate_proj", "up_proj", "down_proj"]


def weight_bytes(rows, cols, e, p, l):
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return ((31 * r + 7 * c + 13 * e + 101 * p + l) % 256).astype(np.uint8)


def scale_values(rows, cols, e, p):
    rb, cb = np.meshgrid(np.arange(-(-rows // 128)), np.arange(-(-cols // 128)), indexing="ij")
    return ((1 + 4 * rb + cb + 16 * e + 64 * p) / 1024).astype(np.float32)


def write_deepseek(out_dir, layer, num_experts, hidden, inter, shared_inter):
    os.makedirs(out_dir, exist_ok=True)
    pre = f"model.layers.{layer}.mlp"
    fp8_specs, keep, f32_tensors = {}, [], {}

    def add_mlp(prefix, e, mlp_inter):
        for p, proj in enumerate(PROJS):
            rows, cols = (hidden, mlp_inter) if proj == "down_proj" else (mlp_inter, hidden)
            s, a = spec("float8_e4m3fn", weight_bytes(rows, cols, e, p, layer))
            fp8_specs[f"{prefix}.{proj}.weight"] = s
            keep.append(a)
            f32_tensors[f"{prefix}.{proj}.weight_scale_inv"] = scale_values(rows, cols, e, p)

    for e in range(num_experts):
        add_mlp(f"{pre}.experts.{e}", e, inter)
    if shared_inter > 0:
        add_mlp(f"{pre}.shared_experts", 99, shared_inter)
    e, i = np.meshgrid(np.arange(num_experts), np.arange(hidden), indexing="ij")
    s, a = spec("bfloat16", (0x0100 + (e * hidden + i) % 0x3E00).astype(np.uint16))
    fp8_specs[f"{pre}.gate.weight"] = s
    keep.append(a)
    f32_tensors[f"{pre}.gate.e_score_correction_bias"] = (np.arange(num_experts) * 0.125 - 0.25).astype(np.float32)
    f32_tensors[f"model.layers.{layer}.self_attn.unrelated"] = np.ones((2, 2), dtype=np.float32)

    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file(f32_tensors, os.path.join(out_dir, files[0]), metadata={"format": "pt"})  # the numpy front end
    serialize_file(fp8_specs, os.path.join(out_dir, files[1]), metadata={"format": "pt"})  # raw bytes, any dtype
    weight_map = {name: files[0] for name in f32_tensors}
    weight_map.update({name: files[1] for name in fp8_specs})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=2)


# ---- reading a moekit checkpoint -------------------------------------------------------------

def fp8_e4m3_table():
    """The 256 e4m3fn values, decoded from the bit fields (independent of moekit's fp8.h)."""
    out = np.zeros(256, dtype=np.float64)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp, man = (b >> 3) & 0xF, b & 0x7
        if exp == 0xF and man == 0x7:
            out[b] = np.nan
        elif exp == 0:
            out[b] = sign * man * 2.0 ** -9
        else:
            out[b] = sign * (1 + man / 8) * 2.0 ** (exp - 7)
    return out


def summarize(ckpt_dir):
    with open(os.path.join(ckpt_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    tensors = {}
    for file_name in sorted(set(weight_map.values())):
        with open(os.path.join(ckpt_dir, file_name), "rb") as f:
            for name, t in deserialize(f.read()):
                if weight_map.get(name) != file_name:
                    fail(f"{file_name} holds {name}, which the index places in {weight_map.get(name)}")
                tensors[name] = t
    if sorted(tensors) != sorted(weight_map):
        fail(f"the index names {len(weight_map)} tensors, the files hold {len(tensors)}")
    total = sum(len(t["data"]) for t in tensors.values())
    if index["metadata"]["total_size"] != total:
        fail(f"index total_size {index['metadata']['total_size']}, the tensors hold {total} bytes")
    table = fp8_e4m3_table()
    out = {}
    for name, t in tensors.items():
        dtype, shape = t["dtype"], list(t["shape"])
        if dtype == "F8_E4M3":
            rows, cols = shape
            s = tensors[name + "_scale_inv"]
            sshape = [-(-rows // 128), -(-cols // 128)]
            if s["dtype"] != "F32" or list(s["shape"]) != sshape:
                fail(f"{name}_scale_inv: {s['dtype']} {s['shape']}, expected F32 {sshape}")
            scales = np.frombuffer(s["data"], dtype="<f4").reshape(sshape).astype(np.float64)
            q = table[np.frombuffer(t["data"], dtype=np.uint8).reshape(rows, cols)]
            values = q * np.repeat(np.repeat(scales, 128, axis=0), 128, axis=1)[:rows, :cols]
        elif dtype == "BF16":
            bits = np.frombuffer(t["data"], dtype="<u2").astype(np.uint32) << 16
            values = bits.view(np.float32).astype(np.float64)
        elif dtype == "F32":
            values = np.frombuffer(t["data"], dtype="<f4").astype(np.float64)
        elif dtype == "U8" and name.endswith("_blocks"):
            # MXFP4 (gpt-oss): 16 bytes per block of 32 e2m1 codes, low nibble first, each block
            # times 2^(scale - 127) from the tensor of the same name ending in _scales.
            s = tensors[name[: -len("_blocks")] + "_scales"]
            if s["dtype"] != "U8" or list(s["shape"]) != shape[:-1]:
                fail(f"{name}: scales {s['dtype']} {s['shape']}, expected U8 {shape[:-1]}")
            codes = np.frombuffer(t["data"], dtype=np.uint8).reshape(-1, 16)
            nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(-1, 32)
            e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
            exponents = np.frombuffer(s["data"], dtype=np.uint8).astype(np.int64).reshape(-1, 1) - 127
            values = np.ldexp(e2m1[nibbles], exponents)
        elif dtype == "U8":
            values = np.frombuffer(t["data"], dtype=np.uint8).astype(np.float64)
        else:
            fail(f"{name}: unexpected dtype {dtype}")
        out[name] = {"dtype": dtype, "shape": shape, "sum": float(values.sum()), "sumsq": float((values ** 2).sum())}
    print(json.dumps(out))


def main(argv):
    cmd = argv[1] if len(argv) > 1 else ""
    if cmd == "write-basic" and len(argv) == 3:
        write_basic(argv[2])
    elif cmd == "check-basic" and len(argv) == 3:
        check_basic(argv[2])
    elif cmd == "write-deepseek" and len(argv) == 8:
        write_deepseek(argv[2], *map(int, argv[3:8]))
    elif cmd == "summarize" and len(argv) == 3:
        summarize(argv[2])
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv)
