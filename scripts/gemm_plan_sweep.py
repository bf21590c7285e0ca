"""The streaming GEMM's launch plans at every synthetic model's weight shapes: plan_for's choice against the others.

    PYTHONPATH=$PWD python3 scripts/gemm_plan_sweep.py [--models qwen3-8b,qwen3-4b,qwen3.5-9b] [--rows 1,16]

For each weight [N, K] of a model's step (as the CUDA backend holds it: fused qkv / in_proj, interleaved gate_up) and
each row count, times y = x @ w.T for plan_for's plan and for every other (t, grid, stages) in a small set and every
split plan (stream-K over all SMs, blocks of SPLIT_T tiles), each
call replayed from a CUDA graph over a rotation of weight copies larger than L2 (so every call streams its weight
from HBM, as a step does). Prints per shape the bandwidth of each plan as a share of the measured copy bandwidth,
plan_for's and the best, and a JSON list at the end. The plans are set by replacing stream_gemm.plan_for for the
run (every plan computes y up to float32 rounding).
"""
from __future__ import annotations

import argparse
import json
import math

import cupy as cp
import numpy as np

from cudflash.backends import stream_gemm
from cudflash.backends.cuda_backend import CudaBackend

# Per model: (name, N, K, GEMMs of that shape per forward). The LM head is one GEMM; the layer counts are the models'.
SHAPES = {
    "qwen3-8b": [("qkv", 6144, 4096, 36), ("o", 4096, 4096, 36), ("gate_up", 24576, 4096, 36),
                 ("down", 4096, 12288, 36), ("lm_head", 151936, 4096, 1)],
    "qwen3-4b": [("qkv", 6144, 2560, 36), ("o", 2560, 4096, 36), ("gate_up", 19456, 2560, 36),
                 ("down", 2560, 9728, 36), ("lm_head", 151936, 2560, 1)],
    "qwen3.5-9b": [("gdn in_proj", 12352, 4096, 24), ("gdn out_proj", 4096, 4096, 24), ("attn qkvg", 10240, 4096, 8),
                   ("attn o", 4096, 4096, 8), ("gate_up", 24576, 4096, 32), ("down", 4096, 12288, 32),
                   ("lm_head", 248320, 4096, 1)],
    "qwen3.5-27b": [("gdn in_proj", 16432, 5120, 48), ("gdn out_proj", 5120, 6144, 48),
                    ("attn qkvg", 14336, 5120, 16), ("attn o", 5120, 6144, 16), ("gate_up", 34816, 5120, 64),
                    ("down", 5120, 17408, 64)],
}
ROTATION_BYTES = 256 << 20  # > 5x the H200's 50 MiB L2
REPS, TRIALS = 8, 5


def candidates(n: int, k: int, sms: int) -> list[stream_gemm.Plan]:
    plans = []
    tiles = math.ceil(n / 16)
    for t in (1, 2, 3, 4):
        blocks = math.ceil(tiles / t)
        most = max(2, min(16, (stream_gemm.SMEM_BUDGET - stream_gemm.Plan.fixed_bytes(t))
                          // stream_gemm.Plan.stage_bytes(t)))
        grids = {math.ceil(blocks / math.ceil(blocks / sms)), min(blocks, sms)}
        for grid in sorted(grids):
            for stages in sorted({most, min(most, 6)}):
                plans.append(stream_gemm.Plan(t=t, grid=grid, stages=stages))
        if t == stream_gemm.SPLIT_T and blocks * (k // stream_gemm.KT) >= sms:
            plans.append(stream_gemm.split_plan(sms))
    return plans


def timed_ms(b: CudaBackend, fn_list) -> float:
    for fn in fn_list[:2]:
        fn()
    b.stream.begin_capture()
    for _ in range(REPS):
        for fn in fn_list:
            fn()
    graph = b.stream.end_capture()
    graph.launch(b.stream)
    times = []
    for _ in range(TRIALS):
        start = b.event()
        graph.launch(b.stream)
        end = b.event()
        times.append(b.elapsed_ms(start, end) / (REPS * len(fn_list)))
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-8b,qwen3-4b,qwen3.5-9b")
    ap.add_argument("--rows", default="1,16")
    args = ap.parse_args()
    b = CudaBackend()
    sms = b.num_sms
    src = cp.ones(1 << 28, dtype=cp.uint8)
    dst = cp.empty_like(src)
    copy_ms = timed_ms(b, [lambda: dst.data.copy_from_device_async(src.data, src.nbytes)])
    copy_bw = 2 * src.nbytes / copy_ms / 1e6  # GB/s, read + write
    del src, dst
    print(f"copy bandwidth {copy_bw:.0f} GB/s, {sms} SMs")
    default_plan = stream_gemm.plan_for
    results = []
    for model in args.models.split(","):
        for name, n, k, count in SHAPES[model]:
            copies = max(1, min(16, ROTATION_BYTES // (2 * n * k)))
            ws = [b.random((n, k), 0.02, 10 + i) for i in range(copies)]
            for m in (int(r) for r in args.rows.split(",")):
                x = b.random((m, k), 1.0, 3)
                y = cp.empty((m, n), dtype=cp.float32)
                fns = [lambda w=w: stream_gemm.stream_gemm(x, w, y, sms, b.tuning) for w in ws]
                chosen = default_plan(n, k, sms)
                rows = []
                for plan in candidates(n, k, sms):
                    stream_gemm.plan_for = lambda n_, k_, s_, bits=16, warps=4, split=True, plan=plan: plan
                    ms = timed_ms(b, fns)
                    rows.append((plan, ms))
                stream_gemm.plan_for = default_plan
                ms_default = timed_ms(b, fns)
                best_plan, best_ms = min(rows, key=lambda r: r[1])
                whole_plan, whole_ms = min((r for r in rows if not r[0].split), key=lambda r: r[1])
                floor_ms = 2 * n * k / copy_bw / 1e6
                tag = lambda p: f"t{p.t} g{p.grid} s{p.stages}{' split' if p.split else ''}"  # noqa: E731
                print(f"{model:11s} {name:13s} [{n:6d}, {k:5d}] rows {m:2d}: plan_for {tag(chosen)} "
                      f"{ms_default * 1e3:8.1f} us ({floor_ms / ms_default:5.1%} of copy) | best "
                      f"{tag(best_plan)} {best_ms * 1e3:8.1f} us "
                      f"({floor_ms / best_ms:5.1%}) | x{count} per forward: {(ms_default - best_ms) * count * 1e3:6.1f} us"
                      f" | best whole {tag(whole_plan)} {whole_ms * 1e3:.1f} | split " +
                      " ".join(f"t{p.t} {ms * 1e3:.1f}" for p, ms in rows if p.split))
                results.append(dict(model=model, name=name, n=n, k=k, rows=m, count=count, floor_us=floor_ms * 1e3,
                                    plan_for=dict(t=chosen.t, grid=chosen.grid, stages=chosen.stages,
                                                  split=chosen.split, us=ms_default * 1e3),
                                    plans=[dict(t=p.t, grid=p.grid, stages=p.stages, split=p.split, us=ms * 1e3)
                                           for p, ms in rows]))
            del ws
            cp.get_default_memory_pool().free_all_blocks()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
