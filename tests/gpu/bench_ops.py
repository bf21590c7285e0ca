"""Micro-benchmark of the CUDA backend's hot ops. Run on a GPU machine: `PYTHONPATH=. python tests/gpu/bench_ops.py`.

Each measurement captures REPS calls of the op into one CUDA graph and times graph replays with device events
(median of several), so Python launch overhead is excluded and only device time is reported. Inputs are random
(never zeros) and the attention KV working sets are 128 MiB or more, twice the H200's L2 or more.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cudflash.backends.base import build_meta  # noqa: E402
from cudflash.backends.cuda_backend import CudaBackend  # noqa: E402

REPS, TRIALS = 10, 7
cb = CudaBackend()
rows: list[tuple[str, str, float, str]] = []


def report(label: str, ms: str, rate: float, unit: str) -> None:
    rows.append((label, ms, rate, unit))
    print(f"{label:40s} {ms:>10s} {rate:10.1f}  {unit}", flush=True)


def device_time_ms(fn) -> float:
    """Median device time of one fn() call, from graph replays of REPS back-to-back calls."""
    cp.cuda.Device().synchronize()  # inputs were made on the legacy stream, which a non-blocking one ignores
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # warm-up: compile, cuBLAS heuristics, pool blocks
        stream.synchronize()
        stream.begin_capture()
        keep = [fn() for _ in range(REPS)]  # outputs stay referenced while the graph lives
        graph = stream.end_capture()
        graph.launch(stream)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(TRIALS):
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / REPS)
    del keep
    return float(np.median(times))


def rand_act(*shape: int, scale: float = 1.0):
    return cb._to_act(cp.random.standard_normal(shape, dtype=cp.float32) * scale)


def bench_copy() -> None:
    n = 1 << 30  # 1 GiB each way
    src, dst = cp.random.standard_normal(n // 4, dtype=cp.float32), cp.empty(n // 4, dtype=cp.float32)
    ms = device_time_ms(lambda: dst.data.copy_from_device_async(src.data, n))  # cudaMemcpyAsync
    report("device copy 1 GiB", f"{ms:.3f}", 2 * n / ms / 1e6, "GB/s (read+write)")


def bench_attention(label: str, n: int, q_len: int, ctx: int, causal: bool, hq: int = 32, hk: int = 8,
                    d: int = 128, block_size: int = 16) -> None:
    nblk = -(-ctx // block_size)
    perm = np.random.default_rng(0).permutation(n * nblk).astype(np.int32)
    tables = [perm[i * nblk:(i + 1) * nblk].tolist() for i in range(n)]
    kc = rand_act(n * nblk, block_size, hk, d)
    vc = rand_act(n * nblk, block_size, hk, d)
    q = rand_act(n * q_len, hq * d)
    meta = cb.prepare_meta(build_meta([q_len] * n, [ctx] * n, tables))
    ms = device_time_ms(lambda: cb.attention(q, kc, vc, meta, d ** -0.5, causal))
    kv_bytes = 2 * n * ctx * hk * d * 2
    if q_len >= 512:  # prefill: arithmetic-bound, report TFLOP/s
        flops = 4 * n * hq * d * (q_len * q_len / 2 if causal else q_len * ctx)
        report(label, f"{ms:.3f}", flops / ms / 1e9, "TFLOP/s")
    else:
        report(label, f"{ms:.3f}", kv_bytes / ms / 1e6, "GB/s of K+V")


def bench_gemm(m: int, n: int, k: int) -> None:
    x, w = rand_act(m, k), rand_act(n, k, scale=k ** -0.5)
    ms = device_time_ms(lambda: cb.linear(x, w))
    tflops = 2 * m * n * k / ms / 1e9
    gbs = 2 * (m * k + n * k + m * n) / ms / 1e6
    report(f"GEMM M={m} N={n} K={k}", f"{ms:.3f}", tflops, f"TFLOP/s ({gbs:.0f} GB/s)")


def bench_small_ops() -> None:
    x, w = rand_act(16, 4096), rand_act(4096)
    ms = device_time_ms(lambda: cb.add_rms_norm(x, x, w, 1e-6))
    report("add_rms_norm 16x4096", f"{ms * 1e3:.1f} us", 3 * 16 * 4096 * 2 / ms / 1e6, "GB/s")
    logits = rand_act(16, 151936)
    ms = device_time_ms(lambda: cb.argmax(logits))
    report("argmax 16x151936 bf16", f"{ms * 1e3:.1f} us", 16 * 151936 * 2 / ms / 1e6, "GB/s")


def main() -> None:
    props = cp.cuda.runtime.getDeviceProperties(0)
    print(f"device: {props['name'].decode()}  SMs: {cb.num_sms}  cupy {cp.__version__}  act dtype {cb.act}  "
          f"cublas {cb.blas.path}")
    bench_copy()
    bench_attention("decode  n=1  q=1  ctx=32768", 1, 1, 32768, True)
    bench_attention("decode  n=8  q=1  ctx=4096", 8, 1, 4096, True)
    bench_attention("decode  n=64 q=1  ctx=1024", 64, 1, 1024, True)
    bench_attention("verify  n=1  q=16 ctx=32768", 1, 16, 32768, True)
    bench_attention("verify  n=8  q=16 ctx=4096", 8, 16, 4096, True)
    bench_attention("drafter n=8  q=16 ctx=4096 non-causal", 8, 16, 4096, False)
    bench_attention("prefill n=1  q=2048 causal", 1, 2048, 2048, True)
    bench_attention("prefill n=1  q=8192 causal", 1, 8192, 8192, True)
    bench_gemm(4096, 4096, 4096)
    bench_gemm(16, 12288, 4096)
    bench_gemm(1, 12288, 4096)
    bench_gemm(2048, 24576, 4096)
    bench_small_ops()
    print(f"\n{'op':40s} {'ms':>10s} {'rate':>10s}  unit")
    for label, ms, rate, unit in rows:
        print(f"{label:40s} {ms:>10s} {rate:10.1f}  {unit}")


if __name__ == "__main__":
    main()
