"""Times the Gated DeltaNet kernels (kernels/gdn.cu) at Qwen3.5-9B's GDN shapes, batch 1, against their byte floor.

    PYTHONPATH=$PWD python3 scripts/bench_gdn.py [--bandwidth 4.28e12] [--iters 200] [--kernel-dir DIR]

Each case runs `iters` calls captured in one CUDA graph, replayed between two CUDA events after a warm-up replay
(and, for the record, the same calls launched eagerly from Python); the floor is the bytes the op must move (the
state read, plus written at a commit; inputs and outputs listed separately) over the given bandwidth (H200 HBM3e
copy bandwidth, H200.md). Prints one line per case and a JSON list at the end.
"""
from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np

from cudflash.backends.base import build_meta
from cudflash.backends.cuda_backend import CudaBackend

HK, HV, DK, DV, TAPS = 16, 32, 128, 128, 4  # Qwen3.5-9B (hybrid_config defaults)
CONV_DIM = 2 * HK * DK + HV * DV


def timed(b: CudaBackend, fn, iters: int) -> tuple[float, float]:
    """(us per call launched eagerly, us per call replayed from a CUDA graph of `iters` calls). The eager figure is
    the Python launch path (the GPU waits for the host); the graph's is the kernel itself, as the engine's captured
    steps run it."""
    for _ in range(5):
        fn()
    start = b.event()
    for _ in range(iters):
        fn()
    end = b.event()
    eager = b.elapsed_ms(start, end) * 1e3 / iters
    b.stream.begin_capture()
    for _ in range(iters):
        fn()
    graph = b.stream.end_capture()
    graph.launch(b.stream)  # warm-up replay
    start = b.event()
    graph.launch(b.stream)
    end = b.event()
    return eager, b.elapsed_ms(start, end) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth", type=float, default=4.28e12)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--kernel-dir", help="the CUDA sources to time (an A/B of one tree: tuning.kernel_dir)")
    args = ap.parse_args()
    b = CudaBackend({"kernel_dir": args.kernel_dir} if args.kernel_dir else None)
    rng = np.random.default_rng(0)
    results = []
    slots = b.asarray([0], "i32")
    states = cp.asarray((rng.standard_normal((2, HV, DK, DV)) * 0.1).astype(np.float32))
    conv_states = cp.asarray(rng.standard_normal((2, CONV_DIM, TAPS - 1)).astype(np.float32))
    w = b.asarray(rng.standard_normal((CONV_DIM, TAPS)).astype(np.float32) * 0.5, "act")
    a_log, dt_bias = cp.zeros(HV, cp.float32), cp.zeros(HV, cp.float32)
    state_bytes = HV * DK * DV * 4
    for rows, commit, op in ((1, True, "gdn_recurrent"), (16, False, "gdn_recurrent"), (16, True, "gdn_recurrent"),
                             (512, True, "gdn_chunked")):
        meta = b.prepare_meta(build_meta([rows], [rows], [[0]]))
        qkv = cp.asarray(rng.standard_normal((rows, CONV_DIM)).astype(np.float32))
        ab = cp.asarray(rng.standard_normal((rows, 2 * HV)).astype(np.float32))
        fn = lambda: getattr(b, op)(qkv, ab[:, :HV], ab[:, HV:], a_log, dt_bias, states, slots, meta, commit)  # noqa
        eager, us = timed(b, fn, args.iters)
        moved = state_bytes * (2 if commit else 1)
        io = rows * (CONV_DIM + 2 * HV + HV * DV) * 4
        results.append(dict(op=op, rows=rows, commit=commit, us=us, eager_us=eager, state_bytes=moved, io_bytes=io,
                            floor_us=moved / args.bandwidth * 1e6, floor_all_us=(moved + io) / args.bandwidth * 1e6))
    for rows in (1, 16):
        meta = b.prepare_meta(build_meta([rows], [rows], [[0]]))
        x = cp.asarray(rng.standard_normal((rows, CONV_DIM + 64)).astype(np.float32))[:, :CONV_DIM]
        fn = lambda: b.causal_conv1d(x, w, conv_states, slots, meta, True)  # noqa: E731
        eager, us = timed(b, fn, args.iters)
        moved = 2 * CONV_DIM * (TAPS - 1) * 4
        io = 2 * rows * CONV_DIM * 4 + CONV_DIM * TAPS * 2
        results.append(dict(op="causal_conv1d", rows=rows, commit=True, us=us, eager_us=eager, state_bytes=moved, io_bytes=io,
                            floor_us=moved / args.bandwidth * 1e6, floor_all_us=(moved + io) / args.bandwidth * 1e6))
    for r in results:
        print(f"{r['op']:14s} rows {r['rows']:4d} commit {r['commit']!s:5s}: {r['us']:8.2f} us   floor (state) "
              f"{r['floor_us']:6.2f} us = {r['us'] / r['floor_us']:6.2f}x   floor (all bytes) {r['floor_all_us']:6.2f} us   "
              f"eager launch {r['eager_us']:6.1f} us")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
