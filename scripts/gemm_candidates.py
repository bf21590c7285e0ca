"""Are there faster cuBLASLt algorithms than cublasGemmEx's pick for the decode / verify GEMMs of Qwen3-8B?

For each weight shape of one layer (+ LM head) and each row count, times cublasGemmEx and every candidate of
cuBLASLt's heuristic list (median of 20 runs, CUDA events, L2 flushed before each run so weights come from HBM
as they do in a step). Prints us and % of the copy bandwidth for the weight bytes.
Usage: PYTHONPATH=$PWD python3 scripts/gemm_candidates.py
"""
import ctypes
import re
import statistics

import cupy

from cudflash.backends.cublas import Cublas, CUDA_R_32F, loaded_library
from cudflash.backends.cublaslt import CublasLt
from cudflash.backends.cuda_backend import CudaBackend

BW = 4.25e12
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
ROWS = (1, 16, 128, 512)

backend = CudaBackend()
cb = Cublas()
lt = CublasLt(loaded_library(re.compile(r"/libcublasLt\.so(\.\d+)*$")), cb.workspace.nbytes)
stream = cupy.cuda.get_current_stream()
cb.bind(stream.ptr)
flush = cupy.empty(200 << 20, dtype=cupy.uint8)


def timed(fn) -> float:
    times = []
    for _ in range(20):
        flush.fill(1)
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3)
    return statistics.median(times)


print(f"{'gemm':<8}{'M':>5}{'GemmEx us':>11}  candidates us (% of copy bandwidth for the weights)")
for name, (n, k) in SHAPES.items():
    w = backend.random((n, k), 0.02, n)
    for m in ROWS:
        x = backend.random((m, k), 1.0, m)
        y = cupy.empty((m, n), dtype=cupy.float32)
        ref_t = timed(lambda: cb.gemm_bf16(x, w, y))
        ref = y.copy()
        plan = lt.plan(m, n, k, k, CUDA_R_32F)
        cells = []
        for j in range(len(plan.candidates) if plan else 0):
            y.fill(float("nan"))
            t = timed(lambda: lt.matmul(plan, j, x.data.ptr, w.data.ptr, y.data.ptr, cb._alpha, cb._beta,
                                        cb.workspace.data.ptr, stream.ptr))
            err = float(cupy.abs(y - ref).max() / cupy.abs(ref).max())
            cells.append(f"{t:7.1f}({100 * n * k * 2 / BW / t * 1e6:3.0f}%{'' if err < 1e-5 else ' ERR%.0e' % err})")
        print(f"{name:<8}{m:>5}{ref_t:>9.1f}({100 * n * k * 2 / BW / ref_t * 1e6:3.0f}%)  " + " ".join(cells),
              flush=True)
