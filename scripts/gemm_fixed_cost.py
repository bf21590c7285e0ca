"""What one streaming GEMM costs beyond its bytes, per weight format: time = fixed + bytes / rate, fitted over N.

For each format (bf16, fp8, nvfp4) and rows (1: decode, x resident; 16: verify, x in boxes), K = 4096 and N from 512
to 24576 rows: the median per-GEMM time of a CUDA graph of back-to-back launches (PDL between them, as in a
captured step; the weights taken in turn from copies larger than L2, as in scripts/quant_gemm_ab.py), then a least
squares line through (bytes, us). The intercept is the fixed cost of a GEMM (launch, the wait for the kernel in front,
x's load, the pipeline's fill and drain, the final sums); the slope's inverse the rate a long GEMM streams at, beside
the measured copy bandwidth. Issue 23: is a quantized step short of its floor by a cost per GEMM (144 of them in a
Qwen3-8B step) or by a rate?

With `--l2` every launch reads the same weight, at the N whose weight fits in L2 (at most L2_BYTES): the rate
is then the loop's own, without HBM (compute or issue bound), beside the rate from HBM.

Usage: PYTHONPATH=$PWD python3 scripts/gemm_fixed_cost.py [--l2] [NAME=VALUE ...]   (a base tuning, as `cudflash bench --tune`)
"""
from __future__ import annotations

import sys

import cupy
import numpy as np

from cudflash.backends import stream_gemm as sg
from cudflash.bench import copy_bandwidth_gb_s

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_gemm_ab import FORMATS, backend_from_argv, captured, copies, median_replay_us  # noqa: E402

K = 4096
NS = (512, 1024, 2048, 4096, 8192, 16384, 24576)
ROWS = (1, 16)
L2_BYTES = 20 << 20  # --l2: weights at most this big (H100 and H200 have 50 and 60 MB of L2)


def main() -> None:
    hot = "--l2" in sys.argv
    base, cb = backend_from_argv([a for a in sys.argv[1:] if a != "--l2"])
    sms, stream = cb.num_sms, cb.stream
    copy = copy_bandwidth_gb_s(cb)
    rng = np.random.default_rng(0)
    print(f"copy bandwidth {copy:.0f} GB/s (read + write); {sms} SMs; K = {K}; base tuning {base.changed() or 'defaults'}"
          f"; weights {'in L2 (one copy each)' if hot else 'from HBM (copies larger than L2)'}")
    xs = {m: cb.asarray(rng.standard_normal((m, K)).astype(np.float32), "act") for m in ROWS}
    for fmt, make in FORMATS.items():
        firsts = {n: make((n, K), 0.02, seed=n) for n in NS}
        if hot:
            firsts = {n: w for n, w in firsts.items() if w.nbytes <= L2_BYTES}
        # Every instantiation this format needs, compiled as one module (one NVRTC call, not one per shape).
        names = tuple(sorted({sg.kernel_name(m, firsts[n], cupy.empty((m, 1), cupy.float32), sms, base)
                              for n in firsts for m in ROWS}))
        for m in ROWS:
            points = []
            for n in firsts:
                ws = [firsts[n]] if hot else copies(make, (n, K), seed=n, first=firsts[n])
                y = cupy.empty((m, n), cupy.float32)

                def launch(w):
                    sg._launch(xs[m], w, y, sms, base, sg.PLAIN, sg.Epilogue(), names=names)

                us = median_replay_us(stream, {fmt: captured(stream, launch, ws)})[fmt]
                points.append((firsts[n].nbytes, us))
                del ws
            b = np.array([p[0] for p in points], dtype=np.float64)
            t = np.array([p[1] for p in points], dtype=np.float64)
            slope, fixed = np.polyfit(b, t, 1)  # us per byte, us
            rate = 1e-3 / slope  # GB/s
            cells = "  ".join(f"N {n}: {u:6.2f} us" for n, (_, u) in zip(firsts, points))
            print(f"{fmt:6s} rows {m:2d}: fixed {fixed:5.2f} us, rate {rate:5.0f} GB/s ({100 * rate / copy:4.1f}% of "
                  f"copy)  |  {cells}", flush=True)


if __name__ == "__main__":
    main()
