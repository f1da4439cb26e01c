# cuBLAS FP8 (torch._scaled_mm, per-tensor scales, BF16 out) at the shapes bench_gemm's contiguous
# problems use, on random bytes as bench_gemm fills its operands (NaN codes replaced); median of
# CUDA-event timings of back-to-back launches.
import torch
torch.manual_seed(0)
def rnd(r, c):
    x = torch.randint(0, 256, (r, c), dtype=torch.uint8, device="cuda")
    x[(x & 0x7F) == 0x7F] = 0x3C
    return x.view(torch.float8_e4m3fn)
shapes = [(8192, 8192, 8192), (4096, 8192, 8192), (4096, 4096, 7168), (16384, 4096, 7168), (65536, 4096, 7168),
          (4096, 7168, 2048), (16384, 7168, 2048), (65536, 7168, 2048)]
for (M, N, K) in shapes:
    a, b = rnd(M, K), rnd(N, K)
    sa = torch.tensor(1e-3, device="cuda"); sb = torch.tensor(1e-3, device="cuda")
    f = lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    for _ in range(10): f()
    ts = []
    for _ in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); f(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    ts.sort(); us = ts[len(ts) // 2]
    print(f"cuBLAS FP8 {M:6d} x {N:5d} x {K:5d}: {us:9.1f} us {2.0*M*N*K/us/1e6:8.1f} TFLOP/s", flush=True)
    del a, b
