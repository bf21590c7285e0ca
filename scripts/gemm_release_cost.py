"""What one stream GEMM costs after its release, away from the rest of a step.

In a captured step a GEMM's CTAs are resident early (PDL) and fill their ring with weight while the kernels in front
run; what the step pays for the GEMM is the time from its release (the kernel in front completing) to its own
completion. This measures that in isolation: a graph of [spin kernel (one CTA, PDL, spins SPIN_US then writes x),
GEMM] against a graph of the spin alone, with four weights in turn so that none stays in L2. The difference is the
GEMM's cost after release, completion included; the floor is its weight bytes at 4.25 TB/s.
Usage: PYTHONPATH=$PWD python3 scripts/gemm_release_cost.py [NAME=VALUE ...]
  NAME=VALUE: a field of the CUDA backend's tuning, as `cudflash bench --tune` takes it, e.g.
  stream_gemm_prefill_stages=0 or kernel_dir=/tmp/base/kernels
"""
import statistics
import sys

import cupy
import numpy as np

from cudflash.backends import pdl
from cudflash.backends import stream_gemm as sg
from cudflash.backends.tuning import CudaTuning, parse_tuning
from cudflash.errors import ConfigError

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SWIGLU = {"gate_up+swiglu": (24576, 4096)}  # the same GEMM with its SwiGLU epilogue (bf16 [M, N / 2] out)
SPIN_US = 20
SPIN = r"""
extern "C" __global__ void spin(long long ns, unsigned short* x, int n) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = 0x3f80;  // bf16 1.0
}"""


def graph(stream: cupy.cuda.Stream, fn) -> cupy.cuda.Graph:
    with stream:
        stream.begin_capture()
        fn()
        return stream.end_capture()


def median_us(stream: cupy.cuda.Stream, graphs: list, reps: int = 60) -> float:
    """Median replay time, the graphs taken in turn, after ten warm-up replays."""
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    for i in range(10):
        graphs[i % len(graphs)].launch(stream)
    for i, (a, b) in enumerate(events):
        a.record(stream)
        graphs[i % len(graphs)].launch(stream)
        b.record(stream)
    stream.synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(a, b) * 1e3 for a, b in events)


def release_cost(n: int, k: int, m: int, spin: cupy.RawKernel, stream: cupy.cuda.Stream, sms: int,
                 tuning: CudaTuning, swiglu: bool = False) -> float:
    x = cupy.zeros((m, k), dtype=cupy.uint16)  # bf16 bits; the kernels only see pointers
    y = cupy.empty((m, n // 2), dtype=cupy.uint16) if swiglu else cupy.empty((m, n), dtype=cupy.float32)
    weights = [(cupy.random.standard_normal((n, k), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
               for _ in range(4)]

    def spin_x():
        pdl.launch(spin, (1,), (128,), (np.int64(SPIN_US * 1000), x, np.int32(m * k)), 0, stream)

    alone = [graph(stream, spin_x)]
    with_gemm = [graph(stream, lambda w=w: (spin_x(), sg.stream_gemm(x, w, y, sms, tuning, swiglu))) for w in weights]
    return median_us(stream, with_gemm) - median_us(stream, alone)


def main() -> None:
    try:
        tuning = parse_tuning(sys.argv[1:])
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    if not (sg.available() and pdl.available()):
        raise SystemExit("needs sm_90 or later, the driver's tensor-map encoder and PDL")
    spin = cupy.RawKernel(SPIN, "spin")
    stream = cupy.cuda.Stream(non_blocking=True)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    print(f"{'GEMM':8s} {'N x K':>12s} {'floor us':>8s} {'M=1 us':>8s} {'M=16 us':>8s}")
    for name, (n, k) in {**SHAPES, **SWIGLU}.items():
        costs = [release_cost(n, k, m, spin, stream, sms, tuning, name in SWIGLU) for m in (1, 16)]
        print(f"{name:8s} {f'{n}x{k}':>12s} {n * k * 2 / 4.25e6:8.2f} {costs[0]:8.2f} {costs[1]:8.2f}", flush=True)


if __name__ == "__main__":
    main()
