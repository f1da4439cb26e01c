# An anchor for moekit's MXFP4 grouped GEMM (docs/gemm-mxfp4.md): the way Hopper serving engines
# run gpt-oss's experts today, a Triton kernel that loads the packed e2m1 codes and e8m0 scales,
# widens them to BF16 in registers and multiplies BF16 activations (vLLM and SGLang do this with
# Triton kernels; this one is written here, from the format's definition, so that the comparison
# runs on any GPU host with PyTorch and Triton and without either engine installed).
#
# Problems: bench_gemm_mxfp4's masked ones, GEMM1 + GEMM2 of
#   deepseek-v3 x8:   8 experts, W1 [4096, 7168], W2 [7168, 2048]
#   gpt-oss-120b x32: 32 experts, W1 [5888, 2944], W2 [2944, 2944] (the loader's padding)
# with 16 tokens per expert (M_max 128). Checked against a PyTorch dequantise-and-matmul of the
# same operands first (fresh random data), then timed (triton.testing.do_bench, median).
# Weight bytes = codes + scales (4.25 bits per weight); TB/s = weight bytes / time.
#
#   python3 bench/anchors/mxfp4_triton.py     (writes $OUT/mxfp4_triton.json)
import json
import os

import torch
import triton
import triton.language as tl

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda"


@triton.jit
def _e2m1_to_bf16(code):
    # code: int32 in [0, 16): sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0
    # is subnormal (0.5 * mantissa). Magnitudes 2..7 are (mag << 6) + 0x3F00 as BF16 bits (exponent
    # e - 1 + 127, the mantissa bit on top), 1 is 0.5 = 0x3F00, 0 is 0; the sign goes to bit 15.
    mag = code & 7
    bits = tl.where(mag >= 2, (mag << 6) + 0x3F00, tl.where(mag == 1, 0x3F00, 0)) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _masked_mxfp4_gemm(x_ptr, w_ptr, s_ptr, out_ptr, masked_m_ptr, M_MAX, N, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[e, m, n] = sum_k x[e, m, k] * w[e, n, k]; x bf16 [E, M_MAX, K], w codes [E, N, K/2] (low
    # nibble first), scales [E, N, K/32] e8m0, out bf16 [E, M_MAX, N]; rows >= masked_m[e] skipped.
    e = tl.program_id(2)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rows = tl.load(masked_m_ptr + e)
    if pid_m * BLOCK_M >= rows:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_base = x_ptr + e.to(tl.int64) * M_MAX * K
    w_base = w_ptr + e.to(tl.int64) * N * (K // 2)
    s_base = s_ptr + e.to(tl.int64) * N * (K // 32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_base + offs_m[:, None] * K + k0 + offs_k[None, :], mask=offs_m[:, None] < rows, other=0.0)
        packed = tl.load(w_base + offs_n[:, None] * (K // 2) + k0 // 2 + offs_kb[None, :]).to(tl.int32)
        lo = _e2m1_to_bf16(packed & 15)
        hi = _e2m1_to_bf16(packed >> 4)
        w = tl.interleave(lo, hi).to(tl.float32)  # [BLOCK_N, BLOCK_K]: element 2j low nibble, 2j + 1 high
        sc = tl.load(s_base + offs_n[:, None] * (K // 32) + k0 // 32 + offs_g[None, :]).to(tl.float32)
        scale = tl.exp2(sc - 127.0)  # [BLOCK_N, BLOCK_K / 32], exact powers of two
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(tl.bfloat16)
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + e.to(tl.int64) * M_MAX * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(tl.bfloat16), mask=offs_m[:, None] < rows)


def gemm(x, w, s, masked_m, block_n, block_k, num_warps, num_stages):
    E, m_max, K = x.shape
    N = w.shape[1]
    out = torch.empty(E, m_max, N, device=DEV, dtype=torch.bfloat16)
    grid = (N // block_n, m_max // 16, E)
    _masked_mxfp4_gemm[grid](x, w, s, out, masked_m, m_max, N, K, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                             num_warps=num_warps, num_stages=num_stages)
    return out


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)


def dequantize(w, s):
    E, N, kh = w.shape
    table = E2M1.to(DEV)
    vals = torch.stack([table[(w & 15).long()], table[(w >> 4).long()]], dim=-1).reshape(E, N, 2 * kh)
    return vals * torch.exp2(s.float() - 127.0).repeat_interleave(32, dim=-1)


def operands(E, N, K, m_max, rows, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(E, m_max, K, device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    w = torch.randint(0, 256, (E, N, K // 2), device=DEV, dtype=torch.uint8, generator=g)
    s = torch.randint(118, 123, (E, N, K // 32), device=DEV, dtype=torch.uint8, generator=g)
    masked_m = torch.full((E,), rows, device=DEV, dtype=torch.int32)
    return x, w, s, masked_m


def main():
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    copy_us = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=100, return_mode="median") * 1e3
    res["copy_TBps"] = 2 * n / (copy_us * 1e-6) / 1e12
    del a, b
    print(f"copy bandwidth {res['copy_TBps']:.3f} TB/s (read + write)", flush=True)
    problems = {"deepseek-v3 x8": (8, 2048, 7168), "gpt-oss-120b x32": (32, 2944, 2944)}
    configs = [(64, 128, 4, 3), (32, 128, 4, 4), (64, 128, 4, 5), (128, 128, 4, 3), (64, 256, 4, 3), (128, 128, 8, 4)]
    for name, (E, inter, d) in problems.items():
        x1, w1, s1, mm = operands(E, 2 * inter, d, 128, 16, 1)
        x2, w2, s2, _ = operands(E, d, inter, 128, 16, 2)
        # Correctness of every config on GEMM1 against the dequantised product (rows < 16 only).
        want = torch.einsum("emk,enk->emn", x1[:, :16].float(), dequantize(w1, s1))
        nbytes = sum(t.numel() for t in (w1, s1, w2, s2))
        best = None
        for cfg in configs:
            if (2 * inter) % cfg[0] or d % cfg[0] or d % cfg[1] or inter % cfg[1]:
                continue  # the kernel has no N or K tails
            try:
                got = gemm(x1, w1, s1, mm, *cfg)[:, :16].float()
            except Exception as exc:  # noqa: BLE001 (a config that does not compile on this Triton)
                print(f"{name}: config {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            err = ((got - want).norm() / want.norm()).item()
            if err > 1e-2:
                raise SystemExit(f"{name}: config {cfg}: relative error {err:.2e} against the dequantised product")
            us = triton.testing.do_bench(lambda: (gemm(x1, w1, s1, mm, *cfg), gemm(x2, w2, s2, mm, *cfg)),
                                         warmup=10, rep=100, return_mode="median") * 1e3
            tbs = nbytes / (us * 1e-6) / 1e12
            print(f"{name:18s} all 16  BN {cfg[0]:3d} BK {cfg[1]:3d} warps {cfg[2]} stages {cfg[3]}: {us:8.1f} us "
                  f"{tbs:6.3f} TB/s  err {err:.1e}", flush=True)
            row = {"problem": name, "masked_m": 16, "block_n": cfg[0], "block_k": cfg[1], "warps": cfg[2],
                   "stages": cfg[3], "us": us, "TBps": tbs, "rel_err": err}
            res["rows"].append(row)
            if best is None or us < best["us"]:
                best = row
        if best:
            print(f"{name:18s} best Triton MXFP4 (BF16 activations): {best['us']:.1f} us, {best['TBps']:.3f} TB/s", flush=True)
    with open(os.path.join(OUT, "mxfp4_triton.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
