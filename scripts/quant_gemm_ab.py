"""The quantized (W8A16 FP8, W4A16 NVFP4) streaming GEMMs against the bf16 kernel at Qwen3-8B's shapes, in one
process on one GPU (the microbench of BENCHMARKS.md's "The W8 kernel's bottleneck" and "NVFP4 weights"; a base
tuning, e.g. kernel_dir=DIR, times another tree's kernels).

Timing: per GEMM (qkv, o_proj, gate_up, down) and rows (1: decode, x resident; 16: verify, x in boxes), a CUDA
graph of at least REPS launches back to back (PDL between them, as in a captured step), the weights taken in turn
from enough copies (>= 256 MB) that none is still in L2 when it comes round again; each format's graph is replayed
in rounds alternating with the others' (drift hits all alike), and the median replay over its launches is one
GEMM's time. Bytes are what a GEMM must read (the weight's nbytes: codes, scales, row maps); GB/s and the
percentage of the copy bandwidth (the bench's measurement: bytes read + written) follow.
Correctness of each quantized kernel first: float32 outputs against float64 x @ w.T with w dequantized on the
device in float64 from the weight's own layout, as relative error norms (tests/gpu/test_quant_gemm.py and
test_fp4_gemm.py check every code). Only the instantiations these shapes need are compiled.

Usage: PYTHONPATH=$PWD python3 scripts/quant_gemm_ab.py [NAME=VALUE ...]   (a base tuning, as `cudflash bench --tune`)
"""
from __future__ import annotations

import statistics
import sys

import cupy
import numpy as np

from cudflash.backends import fp4_weight, fp8_weight, w4_layout
from cudflash.backends import stream_gemm as sg
from cudflash.backends.cuda_backend import CudaBackend
from cudflash.backends.tuning import CudaTuning, parse_tuning
from cudflash.bench import copy_bandwidth_gb_s
from cudflash.errors import ConfigError
from cudflash.quant.numerics import E4M3_TABLE

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (1, 16)
LAYERS = 36  # Qwen3-8B: the per-step GEMM time is LAYERS x the sum over SHAPES
STREAM_BYTES = 256 << 20  # per replay, so that no weight is still cached when it comes round again
REPS, ROUNDS, PER_ROUND = 8, 5, 4


def bf16_random(shape: tuple[int, int], std: float, seed: int) -> cupy.ndarray:
    n, k = shape
    x = cupy.random.RandomState(seed).standard_normal((n, k), dtype=cupy.float32) * cupy.float32(std)
    return (x.view(cupy.uint32) >> 16).astype(cupy.uint16)  # bf16 bits (truncated): timing only


FORMATS = {"bf16": bf16_random, "fp8": fp8_weight.random_fp8, "nvfp4": fp4_weight.random_fp4}


def dequant64(w) -> cupy.ndarray:
    n, k = w.shape
    if isinstance(w, fp8_weight.Fp8Weight):
        table = cupy.asarray(E4M3_TABLE.astype(np.float64))
        scale = w.scale[w.rows][:, cupy.arange(k) // fp8_weight.SCALE_COLS].astype(cupy.float64)
        return table[w.data.astype(cupy.int32)] * scale
    return w4_layout.dequantize_device_layout(w.data, w.scale, w.gscale, xp=cupy).astype(cupy.float64)


def median_replay_us(stream, graphs: dict[str, tuple[cupy.cuda.Graph, int]]) -> dict[str, float]:
    """name -> the median over replays of (replay time / launches in it), the graphs replayed in rounds."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for g, _ in graphs.values():  # warm-up
        g.launch(stream)
    for _ in range(ROUNDS):
        for name, (g, launches) in graphs.items():
            for _ in range(PER_ROUND):
                start.record(stream)
                g.launch(stream)
                end.record(stream)
                end.synchronize()
                times[name].append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / launches)
    return {name: statistics.median(t) for name, t in times.items()}


def backend_from_argv(argv: list[str]) -> tuple[CudaTuning, CudaBackend]:
    """The base tuning the command line names (NAME=VALUE ...) and a CUDA backend with it; exits where the streaming
    GEMM cannot run."""
    try:
        base = parse_tuning(argv)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    cb = CudaBackend(tuning=base)
    if not sg.available():
        raise SystemExit("needs sm_90 and the driver's tensor-map encoder")
    return base, cb


def copies(make, shape: tuple[int, int], seed: int, first=None) -> list:
    """`first` (made with `seed` if not given) and more weights of the shape, seeds seed + 1, ..., enough to stream
    STREAM_BYTES per replay."""
    first = make(shape, 0.02, seed=seed) if first is None else first
    return [first] + [make(shape, 0.02, seed=seed + j) for j in range(1, -(-STREAM_BYTES // first.nbytes))]


def captured(stream, launch, ws: list) -> tuple[cupy.cuda.Graph, int]:
    """(a graph of max(REPS, len(ws)) launch(w) calls, the weights taken in turn; its launch count), after one
    launch outside it (compiled, pool and tensor maps warm)."""
    launch(ws[0])
    stream.synchronize()
    launches = max(REPS, len(ws))
    with stream:
        stream.begin_capture()
        for r in range(launches):
            launch(ws[r % len(ws)])
        return stream.end_capture(), launches


def main() -> None:
    base, cb = backend_from_argv(sys.argv[1:])
    sms = cb.num_sms
    rng = np.random.default_rng(0)
    stream = cb.stream  # the backend's (current) stream: every launch and capture here is on it
    copy = copy_bandwidth_gb_s(cb)
    print(f"copy bandwidth {copy:.0f} GB/s (read + write); {sms} SMs; base tuning {base.changed() or 'defaults'}")

    weights = {}  # (format, shape name) -> copies enough to stream STREAM_BYTES per replay
    for fi, (fmt, make) in enumerate(FORMATS.items()):
        for i, (s, (n, k)) in enumerate(SHAPES.items()):
            weights[fmt, s] = copies(make, (n, k), seed=1000 * fi + 10 * i)
    xs = {(s, m): cb.asarray(rng.standard_normal((m, k)).astype(np.float32), "act")
          for s, (n, k) in SHAPES.items() for m in ROWS}
    y32 = {m: cupy.empty((m, 1), cupy.float32) for m in ROWS}
    names: dict[str, set[str]] = {}
    for (fmt, s), ws in weights.items():
        for m in ROWS:
            names.setdefault(fmt, set()).add(sg.kernel_name(m, ws[0], y32[m], sms, base))
    names_t = {k: tuple(sorted(v)) for k, v in names.items()}

    def launch(x, w, y, fmt):
        sg._launch(x, w, y, sms, base, sg.PLAIN, sg.Epilogue(), names=names_t[fmt])

    print("\ncorrectness: relative error norm vs float64 x @ dequant(w).T")
    bad = []
    for fmt in FORMATS:
        if fmt == "bf16":
            continue
        for s, (n, k) in SHAPES.items():
            w = weights[fmt, s][0]
            w64 = dequant64(w)
            line = []
            for m in ROWS:
                x = xs[(s, m)]
                ref = cupy.asarray(cb.to_numpy(x), dtype=cupy.float64) @ w64.T
                y = cupy.full((m, n), cupy.nan, dtype=cupy.float32)
                launch(x, w, y, fmt)
                err = float(cupy.linalg.norm(y - ref) / cupy.linalg.norm(ref))
                line.append(f"m={m} {err:.1e}")
                if not err < 1e-5 or not bool(cupy.isfinite(y).all()):
                    bad.append(f"{fmt} {s} m={m}: error {err:.3g}")
            print(f"  {fmt:6s} {s:8s}: " + ", ".join(line), flush=True)
            del w64

    print(f"\ntiming: median of {ROUNDS * PER_ROUND} graph replays of >= {REPS} GEMMs each, us per GEMM")
    per_fmt = {f: {m: 0.0 for m in ROWS} for f in FORMATS}
    floors = {f: 0.0 for f in FORMATS}
    print(f"{'GEMM':8s} {'rows':>4s} {'format':8s} {'us':>8s} {'GB/s':>7s} {'% copy':>7s} {'x floor':>7s}")
    for s, (n, k) in SHAPES.items():
        for m in ROWS:
            x, y = xs[(s, m)], cupy.empty((m, n), cupy.float32)
            graphs = {}
            for fmt in FORMATS:
                graphs[fmt] = captured(stream, lambda w, fmt=fmt: launch(x, w, y, fmt), weights[fmt, s])
            us = median_replay_us(stream, graphs)
            for fmt in FORMATS:
                nbytes = weights[fmt, s][0].nbytes
                if m == ROWS[0]:
                    floors[fmt] += nbytes / copy / 1e3
                gbs = nbytes / us[fmt] / 1e3
                per_fmt[fmt][m] += us[fmt]
                print(f"{s:8s} {m:4d} {fmt:8s} {us[fmt]:8.2f} {gbs:7.0f} {100 * gbs / copy:6.1f}% "
                      f"{us[fmt] / (nbytes / copy / 1e3):7.2f}", flush=True)
    print(f"\nper step ({LAYERS} layers x the four GEMMs), ms (and the byte floor of those GEMMs)")
    for fmt in FORMATS:
        print(f"  {fmt:8s} floor {LAYERS * floors[fmt] / 1e3:6.3f}  " + "  ".join(
            f"{m:2d} rows {LAYERS * per_fmt[fmt][m] / 1e3:6.3f}" for m in ROWS))
    print("\nFAILED: " + "; ".join(bad) if bad else "\nall formats correct")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
