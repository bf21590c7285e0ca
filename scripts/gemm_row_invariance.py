"""Is a cuBLAS GEMM row's result independent of how many rows the launch has (bitwise)?

Speculative greedy output can equal autoregressive output exactly in bf16 only if a verify row (one of 16 x
batch rows) computes the same bits as the same row decoded alone. Prints, per weight shape and row count M, how
many of the first row's outputs differ from the M = 1 launch.
Usage: PYTHONPATH=$PWD python3 scripts/gemm_row_invariance.py
"""
import cupy

from cudflash.backends.cuda_backend import CudaBackend

SHAPES = {"tiny qkv": (640, 384), "tiny o": (384, 384), "tiny gate_up": (2048, 384), "tiny down": (384, 1024),
          "tiny lm_head": (8192, 384), "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (24576, 4096),
          "8b down": (4096, 12288), "8b lm_head": (151936, 4096)}
ROWS = (2, 3, 4, 8, 16, 32, 48, 64, 128, 256, 512, 1024, 4096)
b = CudaBackend()
for name, (n, k) in SHAPES.items():
    w = b.random((n, k), 0.05, n)
    x = b.random((max(ROWS), k), 1.0, k)
    one = b.linear(x[:1], w, out_f32=True)
    diffs = []
    for m in ROWS:
        y = b.linear(x[:m], w, out_f32=True)
        diffs.append(int((y[0] != one[0]).sum()))
    print(f"{name:<14} " + " ".join(f"M={m}:{d}" for m, d in zip(ROWS, diffs)), flush=True)
