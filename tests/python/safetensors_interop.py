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
  mutants DIR COUNT SEED    the differential mode: write COUNT files made by mutating small valid
                            files (header bytes, lengths, offsets, dtypes, shapes, NUL, byte order
                            mark, whitespace, duplicates, nesting, truncation; deterministic for a
                            SEED) and DIR/verdicts.json, the package's verdict on each: accepted with
                            its tensors (dtype, shape, bytes) and metadata, or refused with its error

Exit status: 0 on success, 1 on a failed check, 3 when numpy or safetensors is missing.
"""
import functools
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


# ---- the differential mode: mutated files and the package's verdict ---------------------------

class Pairs(list):
    """A JSON object as a list of (key, value) pairs, so that a key may repeat."""


class Raw(str):
    """JSON text written as is (4.0, 1e999, deep nesting, a 400-digit integer)."""


def dump(v):
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, Pairs):
        return "{" + ",".join(json.dumps(k) + ":" + dump(x) for k, x in v) + "}"
    if isinstance(v, dict):
        return dump(Pairs(v.items()))
    if isinstance(v, list):
        return "[" + ",".join(dump(x) for x in v) + "]"
    return json.dumps(v)


ALL_DTYPES = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
              "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


@functools.lru_cache(maxsize=None)
def package_dtypes():
    """The dtype names the installed package knows, from its own error message, so that a dtype
    added by a later version shows up in the mutants (and fails the test until moekit knows it)."""
    import re
    h = b'{"a":{"dtype":"?","shape":[1],"data_offsets":[0,1]}}'
    try:
        deserialize(len(h).to_bytes(8, "little") + h + b"1")
    except Exception as e:
        return tuple(re.findall(r"`([A-Z0-9_]+)`", str(e).split("expected one of", 1)[-1]))
    fail("the package accepted the dtype '?'")
BAD_DTYPES = ["F7", "u8", "", "F8_E4M3FN", "F32 ", "BF16\\u0000"]
HUGE = [2**31, 2**32, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64]


def base_files():
    """Small valid files as (metadata, [(name, dtype, shape)]) with the data laid out in order."""
    return [
        ({"format": "pt"}, [("w.fp8", "F8_E4M3", [3, 5]), ("a.f32", "F32", [2, 2]), ("z.bf16", "BF16", [4]),
                            ("empty", "I64", [0, 3]), ("scalar", "F64", [])]),
        (None, [("x", "U8", [7])]),
        ({"k": "v", "generator": "test"}, [("f4", "F4", [2, 4]), ("c", "C64", [1]), ("e8", "F8_E8M0", [3]),
                                           ("f6", "F6_E2M3", [4])]),
        ({}, []),
        (None, [("b", "BOOL", [2, 2]), ("i", "I32", [1, 3]), ("h", "F16", [1]), ("u", "U64", [1])]),
    ]


def build_entries(tensors):
    entries, offset = [], 0
    for name, dtype, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        size = n * ALL_DTYPES[dtype] // 8
        entries.append([name, Pairs([("dtype", dtype), ("shape", list(shape)), ("data_offsets", [offset, offset + size])])])
        offset += size
    return entries, offset


def assemble(meta_items, entries, data, pad=True):
    members = list(meta_items) + [(n, e) for n, e in entries]
    text = dump(Pairs(members)).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return text, data


def field(entry, key, default):
    """A field of an entry that an earlier mutation may have replaced by something else."""
    v = dict(entry).get(key, default) if isinstance(entry, Pairs) else default
    return v if type(v) is type(default) else default


def with_field(entry, key, value):
    return Pairs([(k, value if k == key else v) for k, v in entry])


def is_whole(entry):
    return isinstance(entry, Pairs) and {"dtype", "shape", "data_offsets"} <= set(dict(entry))


SAME_WIDTH = [["BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"], ["I16", "U16", "F16", "BF16"],
              ["I32", "U32", "F32"], ["I64", "U64", "F64", "C64"]]


def keep_valid(rng, meta_items, entries, data, i):
    """A change the package accepts (when the file was valid before): the corpus needs both kinds."""
    kind = rng.choice(["reshape", "same_width_dtype", "dtype_as_map", "entry_as_array", "dup_tensor", "extra_field",
                       "metadata", "reorder", "add_empty"])
    e = entries[i][1] if entries else None
    if kind in ("reshape", "same_width_dtype", "dtype_as_map", "entry_as_array", "dup_tensor") and not is_whole(e):
        kind = "metadata"
    if kind == "reshape":
        shape = field(e, "shape", [])
        n = 1
        for d in shape:
            n *= d
        entries[i][1] = with_field(e, "shape", rng.choice([list(reversed(shape)), [n], shape + [1], [1] + shape]))
    elif kind == "same_width_dtype":
        dt = field(e, "dtype", "U8")
        group = next((g for g in SAME_WIDTH if dt in g), [dt])
        entries[i][1] = with_field(e, "dtype", rng.choice(group))
    elif kind == "dtype_as_map":
        entries[i][1] = with_field(e, "dtype", {field(e, "dtype", "U8"): None})
    elif kind == "entry_as_array":
        d = dict(e)
        entries[i][1] = [d["dtype"], d["shape"], d["data_offsets"]]
    elif kind == "dup_tensor":  # the last entry of a name counts; the first must only be well formed
        first = rng.choice([e, Pairs([("dtype", "U8"), ("shape", [1]), ("data_offsets", [99, 100])])])
        entries.insert(i, [entries[i][0], first])
    elif kind == "extra_field" and entries and isinstance(e, Pairs):
        raw = rng.choice(['{"a":[1,2,{"b":null}]}', "[" * 100 + "]" * 100, "1e-999", "18446744073709551616", '"x"'])
        entries[i][1] = Pairs(list(e) + [("extra", Raw(raw))])
    elif kind == "reorder":
        rng.shuffle(entries)
    elif kind == "add_empty":
        offs = [0, 0] if not entries or not is_whole(e) else [field(e, "data_offsets", [0, 0])[1]] * 2
        entries.insert(rng.randrange(len(entries) + 1),
                       [f"empty{rng.randrange(1000)}", Pairs([("dtype", rng.choice(list(ALL_DTYPES))),
                                                             ("shape", [0, rng.randrange(5)]), ("data_offsets", offs)])])
    else:
        kind = "metadata"
        meta_items = [("__metadata__", rng.choice([None, Pairs(), Pairs([("a", "x"), ("a", "y")]),
                                                   Pairs([("a", "x\u0000y"), ("b", "\u00e9")])]))]
    return meta_items, entries, data, "ok_" + kind


def break_maybe(rng, meta_items, entries, data, i):
    """A change that usually makes the file invalid, sometimes not (that is the point)."""
    kind = rng.choice(["offset", "offset_huge", "swap_offsets", "dtype", "dtype_form", "shape_dim", "shape_huge",
                       "shape_type", "overflow", "entry_array", "dup_tensor", "dup_field", "metadata", "extra_field",
                       "drop_field", "drop_tensor", "data_size"])
    e = entries[i][1] if entries else None
    needs_whole = ("offset", "offset_huge", "swap_offsets", "dtype", "dtype_form", "shape_dim", "shape_huge",
                   "shape_type", "entry_array", "dup_tensor")
    if kind in needs_whole and not is_whole(e):
        kind = rng.choice(["metadata", "data_size"] + (["drop_tensor"] if entries else []))
    if kind in ("dup_field", "extra_field", "drop_field") and not isinstance(e, Pairs):
        kind = "metadata"
    if not entries and kind not in ("metadata", "data_size"):
        kind = "metadata"
    if kind == "offset":
        offs = list(field(e, "data_offsets", [0, 0]))
        j = rng.randrange(2)
        offs[j] = max(offs[j] + rng.choice([-8, -1, 1, 2, 8]), rng.choice([0, -1]))
        entries[i][1] = with_field(e, "data_offsets", offs)
    elif kind == "offset_huge":
        offs = list(field(e, "data_offsets", [0, 0]))
        offs[rng.randrange(2)] = rng.choice(HUGE + [-1])
        entries[i][1] = with_field(e, "data_offsets", offs)
    elif kind == "swap_offsets":
        j = rng.randrange(len(entries))
        if is_whole(entries[j][1]):
            a, b = field(e, "data_offsets", [0, 0]), field(entries[j][1], "data_offsets", [0, 0])
            entries[i][1] = with_field(e, "data_offsets", b)
            entries[j][1] = with_field(entries[j][1], "data_offsets", a)
    elif kind == "dtype":
        dt = rng.choice(list(package_dtypes()) + BAD_DTYPES)
        entries[i][1] = with_field(e, "dtype", Raw(json.dumps(dt).replace("\\\\u0000", "\\u0000")))
    elif kind == "dtype_form":
        dt = field(e, "dtype", "U8")
        entries[i][1] = with_field(e, "dtype", rng.choice([{dt: None}, Raw('{"%s":[]}' % dt), [dt],
                                                           {dt: None, "U8": None}, {}, 8, None]))
    elif kind in ("shape_dim", "shape_huge", "shape_type"):
        shape = list(field(e, "shape", []))
        if kind == "shape_dim":
            op = rng.choice(["append", "remove", "set"])
            if op == "append" or not shape:
                shape.insert(rng.randrange(len(shape) + 1), rng.choice([0, 1, 2, 3]))
            elif op == "remove":
                shape.pop(rng.randrange(len(shape)))
            else:
                shape[rng.randrange(len(shape))] = rng.choice([0, 1, 2, 4, 5, 8])
        elif kind == "shape_huge":
            shape.insert(rng.randrange(len(shape) + 1), rng.choice(HUGE))
            if rng.random() < 0.6:  # an empty tensor: the product is 0, if nothing overflowed before the 0
                shape.insert(rng.randrange(len(shape) + 1), 0)
        else:
            raw = rng.choice(["4.0", "-1", '"4"', "null", "true", "4e0", "-0"])
            shape = Raw("[" + ",".join([raw] + [str(d) for d in shape]) + "]")
        entries[i][1] = with_field(e, "shape", shape)
    elif kind == "overflow":
        entries[i][1] = Pairs([("dtype", "F64"), ("shape", rng.choice([[2**31, 2**30], [2**61], [2**62, 4, 0],
                                                                        [0, 2**62, 4], [2**32, 2**32], [2**58, 0]])),
                               ("data_offsets", [0, 0])])
    elif kind == "entry_array":
        d = dict(e)
        arr = [d["dtype"], d["shape"], d["data_offsets"]]
        entries[i][1] = rng.choice([arr[:2], arr + [1], list(reversed(arr)), Raw(dump(arr))])
    elif kind == "dup_tensor":
        first = rng.choice([5, Pairs([("dtype", "U8")]), Pairs([("dtype", "X"), ("shape", [1]), ("data_offsets", [0, 1])])])
        entries.insert(i, [entries[i][0], first])
    elif kind == "dup_field":
        pairs = list(e)
        k, v = rng.choice(pairs + [("x", 1)])
        pairs.insert(rng.randrange(len(pairs) + 1), (k, v))
        entries[i][1] = Pairs(pairs)
    elif kind == "extra_field":
        levels = rng.choice([124, 125, 126, 127, 128, 200])
        raw = rng.choice(["1e999", "-1e999", "1" + "0" * 400, "[" * levels + "]" * levels, '"\\ud800"'])
        pairs = list(e)
        pairs.insert(rng.randrange(len(pairs) + 1), ("extra", Raw(raw)))
        entries[i][1] = Pairs(pairs)
    elif kind == "drop_field":
        pairs = list(e)
        pairs.pop(rng.randrange(len(pairs)))
        entries[i][1] = Pairs(pairs)
    elif kind == "drop_tensor":
        entries.pop(i)
    elif kind == "data_size":
        data = data + bytes(rng.randrange(1, 9)) if rng.random() < 0.5 or not data else data[:-rng.randrange(1, len(data) + 1)]
    else:
        kind = "metadata"
        value = rng.choice([Pairs([("a", 1)]), Pairs([("a", Pairs([("b", "c")]))]), Pairs([("a", 1), ("a", "y")]),
                            ["a"], "a", Raw("[" * 130 + "]" * 130)])
        meta_items = [("__metadata__", value)] + ([("__metadata__", Pairs())] if rng.random() < 0.3 else [])
    return meta_items, entries, data, kind


def header_mutation(rng, meta_items, entries, data):
    """One change to the header's content; returns (meta_items, entries, data, description)."""
    i = rng.randrange(len(entries)) if entries else 0
    change = keep_valid if rng.random() < 0.45 else break_maybe
    return change(rng, meta_items, entries, data, i)


def byte_mutation(rng, header, data):
    """One change to the bytes: (header, data, length override or None, description)."""
    kind = rng.choice(["flip", "insert", "delete", "nul", "bom", "whitespace", "whitespace", "length", "truncate",
                       "utf8", "escape_name"])
    length = None
    if kind == "flip" and header:
        i = rng.randrange(len(header))
        header = header[:i] + bytes([rng.choice([0x00, 0xFF, 0x7B, 0x7D, 0x22, 0x2C, 0x20, 0x09, 0x0A, 0x5B, 0x5D,
                                                 0x30, 0x31, 0x39, 0x2D, 0x2E, 0x65, 0xC3, 0xEF, rng.randrange(256)])]) + header[i + 1:]
    elif kind == "insert":
        i = rng.randrange(len(header) + 1)
        header = header[:i] + bytes([rng.choice([0x20, 0x0A, 0x00, 0x2C, 0x22, rng.randrange(256)])]) + header[i:]
    elif kind == "delete" and header:
        i = rng.randrange(len(header))
        header = header[:i] + header[i + 1:]
    elif kind == "nul":
        where = rng.choice(["end", "pad", "start", "middle"])
        if where == "end":
            header = header + b"\x00" * rng.randrange(1, 9)
        elif where == "pad":
            header = header.rstrip(b" ") + b"\x00" + b" " * rng.randrange(0, 7)
        elif where == "start":
            header = b"\x00" + header
        else:
            i = rng.randrange(len(header) + 1)
            header = header[:i] + b"\x00" + header[i:]
    elif kind == "bom":
        header = rng.choice([b"\xef\xbb\xbf" + header, header + b"\xef\xbb\xbf", b" \xef\xbb\xbf" + header])
    elif kind == "whitespace":
        ws = [b" ", b"\t", b"\n", b"\r"] * 3 + [b"\x0b", b"\x0c", b"\xc2\xa0"]
        pad = b"".join(rng.choice(ws) for _ in range(rng.randrange(1, 6)))
        header = rng.choice([pad + header, header + pad, header.rstrip(b" ") + pad])
    elif kind == "length":
        n = len(header)
        length = rng.choice([n - 1, n + 1, n - 8, n + 8, n + len(data), 0, 2**64 - 1, 2**63, 100_000_001,
                             rng.randrange(2**64)]) % 2**64
    elif kind == "truncate":
        total = 8 + len(header) + len(data)
        cut = rng.randrange(total)
        if cut < 8:
            return None, None, cut, kind  # fewer than 8 bytes
        if cut < 8 + len(header):
            header, data = header[:cut - 8], b""
            length = None  # the length field still says the full header
            return header, data, -1, kind
        data = data[:cut - 8 - len(header)]
    elif kind == "utf8":
        bad = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xc3\xa9"])
        i = header.find(b'"', 1)
        if i > 0:
            header = header[:i + 1] + bad + header[i + 1:]
    elif kind == "escape_name":
        i = header.find(b'"', 1)
        if i > 0:
            header = header[:i + 1] + rng.choice([b"\\u0000", b"\\ud800", b"\\ud83d\\ude00", b"\\x", b"\\/"]) + header[i + 1:]
    return header, data, length, kind


def mutant(rng, seed_data):
    meta, tensors = rng.choice(base_files())
    entries, size = build_entries(tensors)
    data = bytes(seed_data[i % len(seed_data)] for i in range(size))
    meta_items = [] if meta is None else [("__metadata__", meta)]
    steps = []
    for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3])):
        meta_items, entries, data, kind = header_mutation(rng, meta_items, entries, data)
        steps.append(kind)
    header, data = assemble(meta_items, entries, data, pad=rng.random() < 0.8)
    length = None
    if rng.random() < 0.4 or not steps:
        header, data, length, kind = byte_mutation(rng, header, data)
        steps.append(kind)
        if header is None:  # a file shorter than the 8-byte length
            return bytes(8)[:length], steps
        if length == -1:  # cut inside the header: the length field keeps the full size
            return (len(header) + 64).to_bytes(8, "little") + header, steps
    n = len(header) if length is None else length
    return n.to_bytes(8, "little") + header + data, steps


def package_verdict(path, raw):
    try:
        tensors = deserialize(raw)
    except Exception as e:  # the package raises SafetensorError, or others on odd input
        return {"accepted": False, "error": f"{type(e).__name__}: {e}"[:300]}
    out = {"accepted": True, "tensors": {}}
    for name, t in tensors:
        out["tensors"][name] = {"dtype": t["dtype"], "shape": list(t["shape"]), "hex": bytes(t["data"]).hex()}
    try:
        with safe_open(path, framework="np") as f:
            out["metadata"] = f.metadata()
    except Exception as e:
        fail(f"{path}: deserialize accepts it but safe_open refuses: {e}")
    # moekit holds shapes as int64_t: a dimension above 2^63 - 1 (an empty tensor) is its one refusal.
    out["int64_deviation"] = any(d > 2**63 - 1 for t in out["tensors"].values() for d in t["shape"])
    return out


def write_mutants(out_dir, count, seed):
    import random
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    seed_data = bytes(rng.randrange(256) for _ in range(251))
    verdicts = []
    for i in range(count):
        raw, steps = mutant(rng, seed_data)
        name = f"m{i:04d}.safetensors"
        path = os.path.join(out_dir, name)
        with open(path, "wb") as f:
            f.write(raw)
        v = package_verdict(path, raw)
        v.update({"file": name, "mutations": steps})
        verdicts.append(v)
    with open(os.path.join(out_dir, "verdicts.json"), "w") as f:
        json.dump(verdicts, f)
    accepted = sum(v["accepted"] for v in verdicts)
    print(f"OK: {count} mutants, {accepted} accepted and {count - accepted} refused by safetensors {safetensors.__version__}")


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
    elif cmd == "mutants" and len(argv) == 5:
        write_mutants(argv[2], int(argv[3]), int(argv[4]))
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv)
