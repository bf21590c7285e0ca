"""The FP8 (W8A16) streaming GEMM against the bf16 kernel at Qwen3-8B's shapes, in one process on one GPU (the
microbench of BENCHMARKS.md's "The W8 kernel's bottleneck"; a base tuning, e.g. kernel_dir=DIR, times another tree's
kernels).

Timing: per GEMM (qkv, o_proj, gate_up, down) and rows (1: decode, x resident; 16: verify, x in boxes), a CUDA
graph of at least REPS launches back to back (PDL between them, as in a captured step), the weights taken in turn
from enough copies (>= 256 MB) that none is still in L2 when it comes round again; each config's graph is replayed
in rounds alternating with the others' (drift hits all alike), and the median replay over its launches is one
GEMM's time. Bytes are what a GEMM must read (FP8: codes + scales + row map, bf16: 2 N K); GB/s and the
percentage of the copy bandwidth (the bench's measurement: bytes read + written) follow.
Correctness of the FP8 kernel: float32 outputs against float64 x @ w.T with w dequantized on the device from the
numpy E4M3 table (quant.numerics), as relative error norms; then tests/gpu/test_quant_gemm.py's every-code check
(all finite codes, and a weight of subnormal codes alone, where a flush to zero shows).
Only the instantiations these shapes need are compiled (a few per format, not the 84 of a module).

Usage: PYTHONPATH=$PWD python3 scripts/fp8_ab.py [NAME=VALUE ...]   (a base tuning, as `cudflash bench --tune`)
"""
from __future__ import annotations

import dataclasses
import statistics
import sys

import cupy
import numpy as np

from cudflash.backends import fp8_weight
from cudflash.backends import stream_gemm as sg
from cudflash.backends.cuda_backend import CudaBackend
from cudflash.backends.tuning import parse_tuning
from cudflash.bench import copy_bandwidth_gb_s
from cudflash.errors import ConfigError
from cudflash.quant import QuantizedWeight, dequantize
from cudflash.quant.numerics import E4M3_TABLE

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (1, 16)
LAYERS = 36  # Qwen3-8B: the per-step GEMM time is LAYERS x the sum over SHAPES
STREAM_BYTES = 256 << 20  # per replay, so that no weight is still cached when it comes round again
REPS, ROUNDS, PER_ROUND = 8, 5, 4


def configs(base) -> dict[str, object]:
    """name -> tuning (None: the bf16 weight at the base tuning): FP8 with four and with eight compute warps."""
    return {"bf16": None, **{f"fp8 x{w}": dataclasses.replace(base, stream_gemm_w8_warps=w) for w in (4, 8)}}


def bf16_random(n: int, k: int, seed: int) -> cupy.ndarray:
    x = cupy.random.RandomState(seed).standard_normal((n, k), dtype=cupy.float32) * cupy.float32(0.02)
    return (x.view(cupy.uint32) >> 16).astype(cupy.uint16)  # bf16 bits (truncated): timing only


def dequant64(w: fp8_weight.Fp8Weight) -> cupy.ndarray:
    n, k = w.shape
    table = cupy.asarray(E4M3_TABLE.astype(np.float64))
    scale = w.scale[w.rows][:, cupy.arange(k) // fp8_weight.SCALE_COLS].astype(cupy.float64)
    return table[w.data.astype(cupy.int32)] * scale


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


def main() -> None:
    try:
        base = parse_tuning(sys.argv[1:])
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    cb = CudaBackend(tuning=base)
    if not sg.available():
        raise SystemExit("needs sm_90 and the driver's tensor-map encoder")
    sms, cfgs = cb.num_sms, configs(base)
    rng = np.random.default_rng(0)
    stream = cb.stream  # the backend's (current) stream: every launch and capture here is on it
    copy = copy_bandwidth_gb_s(cb)
    print(f"copy bandwidth {copy:.0f} GB/s (read + write); {sms} SMs; base tuning {base.changed() or 'defaults'}")

    # The weights (copies enough to stream STREAM_BYTES per replay), x and y per shape and rows.
    fp8 = {s: [fp8_weight.random_fp8((n, k), 0.02, seed=10 * i + j) for j in range(
        -(-STREAM_BYTES // (n * k)))] for i, (s, (n, k)) in enumerate(SHAPES.items())}
    bf16 = {s: [bf16_random(n, k, 100 + 10 * i + j) for j in range(-(-STREAM_BYTES // (2 * n * k)))]
            for i, (s, (n, k)) in enumerate(SHAPES.items())}
    xs = {(s, m): cb.asarray(rng.standard_normal((m, k)).astype(np.float32), "act")
          for s, (n, k) in SHAPES.items() for m in ROWS}
    # The every-code check's weight (256 x 2048, the test's): its plan's instantiations are compiled too.
    finite = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)
    codes = rng.choice(finite, size=(256, 2048)).astype(np.uint8)
    codes[:, :256] = np.resize(finite, 256)
    qall = QuantizedWeight("fp8", (256, 2048), codes, rng.uniform(0.5, 2, (2, 16)).astype(np.float32), (128, 128))
    sub = np.where((codes & 0x78) == 0, codes, 0).astype(np.uint8)
    qsub = QuantizedWeight("fp8", (256, 2048), sub, np.ones((2, 16), np.float32), (128, 128))
    every = [(qall, fp8_weight.upload(qall)), (qsub, fp8_weight.upload(qsub))]

    # The instantiations each module needs (the FP8 and the bf16 module, each compiled once).
    y32 = {m: cupy.empty((m, 1), cupy.float32) for m in ROWS}
    names: dict[str, set[str]] = {}
    for cname, t in cfgs.items():
        for s in SHAPES:
            for m in ROWS:
                w = bf16[s][0] if t is None else fp8[s][0]
                names.setdefault("bf16" if t is None else "fp8", set()).add(
                    sg.kernel_name(m, w, y32[m], sms, t or base))
        if t is not None:
            for m in ROWS:
                names["fp8"].add(sg.kernel_name(m, every[0][1], y32[m], sms, t))
    names_t = {k: tuple(sorted(v)) for k, v in names.items()}

    def launch(x, w, y, t):
        key = "bf16" if t is None else "fp8"
        sg._launch(x, w, y, sms, t or base, sg.PLAIN, sg.Epilogue(), names=names_t[key])

    # Correctness first (and the compile of every module).
    print("\ncorrectness: relative error norm vs float64 x @ dequant(w).T")
    bad = []
    for s, (n, k) in SHAPES.items():
        w64 = dequant64(fp8[s][0])
        for m in ROWS:
            x = xs[(s, m)]
            ref = cupy.asarray(cb.to_numpy(x), dtype=cupy.float64) @ w64.T
            line = []
            for cname, t in cfgs.items():
                if t is None:
                    continue
                y = cupy.full((m, n), cupy.nan, dtype=cupy.float32)
                launch(x, fp8[s][0], y, t)
                err = float(cupy.linalg.norm(y - ref) / cupy.linalg.norm(ref))
                line.append(f"{cname} {err:.1e}")
                if not err < 1e-5 or not bool(cupy.isfinite(y).all()):
                    bad.append(f"{s} m={m} {cname}: error {err:.3g}")
            print(f"  {s:8s} m={m:2d}: " + ", ".join(line), flush=True)
        del w64
    for cname, t in cfgs.items():
        if t is None:
            continue
        for m in ROWS:
            x = rng.standard_normal((m, 2048)).astype(np.float32) * np.float32(0.1)
            dx = cb.asarray(x, "act")
            xr = cb.to_numpy(dx).astype(np.float64)
            for (q, w), extra in zip(every, (0.0, 1e-30)):
                y = cupy.empty((m, 256), cupy.float32)
                launch(dx, w, y, t)
                wd = dequantize(q).astype(np.float64)
                ref = xr @ wd.T
                bound = np.abs(xr) @ np.abs(wd).T * 2e-6 + extra
                ok = bool(np.all(np.abs(cupy.asnumpy(y) - ref) <= bound)) and np.abs(ref).max() > 0
                kind = "every code" if extra == 0 else "subnormal codes"
                print(f"  {cname} m={m:2d} {kind}: {'ok' if ok else 'FAILED'}")
                if not ok:
                    bad.append(f"{cname} m={m} {kind}")

    # Timing.
    print(f"\ntiming: median of {ROUNDS * PER_ROUND} graph replays of >= {REPS} GEMMs each, us per GEMM")
    per_config = {c: {m: 0.0 for m in ROWS} for c in cfgs}
    floors = {m: 0.0 for m in ROWS}
    print(f"{'GEMM':8s} {'rows':>4s} {'config':12s} {'us':>8s} {'GB/s':>7s} {'% copy':>7s} {'x floor':>7s}")
    for s, (n, k) in SHAPES.items():
        for m in ROWS:
            x, y = xs[(s, m)], cupy.empty((m, n), cupy.float32)
            graphs = {}
            for cname, t in cfgs.items():
                ws = bf16[s] if t is None else fp8[s]
                launch(x, ws[0], y, t)  # compiled already; pool and tensor maps warm
                stream.synchronize()
                launches = max(REPS, len(ws))
                with stream:
                    stream.begin_capture()
                    for r in range(launches):
                        launch(x, ws[r % len(ws)], y, t)
                    graphs[cname] = (stream.end_capture(), launches)
            us = median_replay_us(stream, graphs)
            fp8_bytes = fp8[s][0].nbytes
            floors[m] += fp8_bytes / copy / 1e3
            for cname, t in cfgs.items():
                nbytes = 2 * n * k if t is None else fp8_bytes
                gbs = nbytes / us[cname] / 1e3
                per_config[cname][m] += us[cname]
                print(f"{s:8s} {m:4d} {cname:12s} {us[cname]:8.2f} {gbs:7.0f} {100 * gbs / copy:6.1f}% "
                      f"{us[cname] / (nbytes / copy / 1e3):7.2f}", flush=True)
    print(f"\nper step ({LAYERS} layers x the four GEMMs), ms; the FP8 byte floor of those GEMMs: "
          + ", ".join(f"{m} rows {LAYERS * floors[m] / 1e3:.3f}" for m in ROWS))
    for cname in cfgs:
        print(f"  {cname:12s} " + "  ".join(f"{m:2d} rows {LAYERS * per_config[cname][m] / 1e3:6.3f}" for m in ROWS))
    print("\nFAILED: " + "; ".join(bad) if bad else "\nall configs correct")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
