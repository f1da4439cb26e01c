# An anchor for moekit's compute-bound GEMMs (docs/gemm.md): cuBLAS's dense FP8 GEMM through
# PyTorch (`torch._scaled_mm`, e4m3 x e4m3 -> BF16, one scale per tensor), the rate every prefill
# figure of bench_gemm is read against. It has no per-block scales, so it does less work per
# FLOP than moekit's two-level accumulation: a ceiling, not a like-for-like kernel.
#
# Problems (M x N x K): the dense 8192^3, and bench_gemm problem 3's shapes as one dense GEMM of
# all rows (8 experts x 512 / 2048 / 8192 rows, N 4096, K 7168) plus the GEMM2 shape (N 7168,
# K 2048). Each is checked once against a BF16 matmul of the same operands, then timed
# (triton.testing.do_bench, median of fresh launches over the same operands).
#
#   python3 bench/anchors/cublas_fp8.py      (writes $OUT/cublas_fp8.json)
import json
import os

import torch
import triton

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda"


def operands(m, n, k):
    a = (torch.randn(m, k, device=DEV) * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device=DEV) * 0.5).to(torch.float8_e4m3fn)
    return a, b


def run(m, n, k):
    a, b = operands(m, n, k)
    one = torch.ones((), device=DEV)
    mm = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    got = mm().float()
    ref = (a[:1024].to(torch.bfloat16) @ b.to(torch.bfloat16).t()).float()
    rel = ((got[:1024] - ref).norm() / ref.norm()).item()
    us = triton.testing.do_bench(mm, warmup=25, rep=200, return_mode="median") * 1e3
    tflops = 2.0 * m * n * k / (us * 1e-6) / 1e12
    print(f"cuBLAS FP8 {m:6d} x {n:5d} x {k:5d}: {us:9.1f} us {tflops:7.1f} TFLOP/s (rel err {rel:.1e})")
    return {"m": m, "n": n, "k": k, "us": us, "TFLOPs": tflops, "rel_err_vs_bf16": rel}


def main():
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    res["rows"].append(dict(run(8192, 8192, 8192), name="dense 8192^3"))
    for rows in (512, 2048, 8192):
        res["rows"].append(dict(run(8 * rows, 4096, 7168), name=f"problem 3 shape, {rows} rows/expert x 8"))
    res["rows"].append(dict(run(8 * 2048, 7168, 2048), name="GEMM2 shape, 2048 rows/expert x 8"))
    with open(os.path.join(OUT, "cublas_fp8.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
