"""One streaming GEMM launched a few times, plainly (no graph), for a hardware-counter profiler to read.

Issue 23: is the W4 / W8 loop short of the copy rate because an issue pipe (ALU, FMA, tensor) is saturated, or
because its warps wait (memory, barriers, dependent instructions)? Nsight Compute answers from counters, e.g.

    ncu --clock-control none -k regex:stream_gemm --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
        --print-details all python3 scripts/gemm_counters.py nvfp4 24576 4096 1

Each launch reads its own weight copy (enough copies to stream more than L2 holds), as a step does; x's rows are
random. With `--l2`, every launch reads the same weight: where it fits L2, the loop's rate without HBM.

Usage: PYTHONPATH=$PWD python3 scripts/gemm_counters.py FORMAT N K ROWS [--l2] [NAME=VALUE ...]
"""
from __future__ import annotations

import sys

import cupy
import numpy as np

from cudflash.backends import stream_gemm as sg

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_gemm_ab import FORMATS, backend_from_argv, copies  # noqa: E402

LAUNCHES = 6


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--l2"]
    if len(args) < 4 or args[0] not in FORMATS:
        raise SystemExit(__doc__.rsplit("Usage: ", 1)[1])
    fmt, n, k, m = args[0], int(args[1]), int(args[2]), int(args[3])
    base, cb = backend_from_argv(args[4:])
    make = FORMATS[fmt]
    ws = [make((n, k), 0.02, seed=0)] if "--l2" in sys.argv else copies(make, (n, k), seed=0)
    x = cb.asarray(np.random.default_rng(0).standard_normal((m, k)).astype(np.float32), "act")
    y = cupy.empty((m, n), cupy.float32)
    names = (sg.kernel_name(m, ws[0], y, cb.num_sms, base),)  # compile this instantiation alone
    for r in range(LAUNCHES):
        sg._launch(x, ws[r % len(ws)], y, cb.num_sms, base, sg.PLAIN, sg.Epilogue(), names=names)
    cb.stream.synchronize()
    print(f"{names[0]}: {fmt} [{n}, {k}] x {m} rows, {LAUNCHES} launches, {len(ws)} weight copies of {ws[0].nbytes / 1e6:.1f} MB, "
          f"y[0, :4] = {cupy.asnumpy(y[0, :4])}")


if __name__ == "__main__":
    main()
