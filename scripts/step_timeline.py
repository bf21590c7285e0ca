"""Where one captured step's time goes, kernel by kernel: a timeline from %globaltimer, with no profiler.

Runs `cudflash bench --synthetic qwen3-8b --backend cuda --batch 1 --prompt-len 512 --new 20` with every kernel
compiled with CF_TRACE (kernels/common.cuh): thread 0 of each CTA records when the CTA starts and when its wait on
the kernel in front returns. One late autoregressive step and one late speculative step (graph replays) are
recorded. CTAs are grouped into launches in time order, and each launch gets:
  release  its first CTA's wait returning (about when the kernel in front has completed), relative to the step;
  span     the next launch's release minus its own: the time the chain spent on it, completion included;
  early    how long before its release its first CTA was resident (PDL lets it start behind the kernel in front);
  ends     for kernels that mark it (stream_gemm), when the first, the median and the last CTA had written their
           outputs, after the release: the spread is how unevenly a launch's equal shares of work finish.
The spans of one step add up to its device time; the table sums them per kind of kernel, and one layer's launches
are listed in order. The recording adds a global atomic and two stores per CTA event, so spans are a little long.
Usage: python3 scripts/step_timeline.py [extra bench arguments, e.g. --prompt-len 2048]
"""
import os
import statistics
import sys
from collections import defaultdict

os.environ["CUDFLASH_TRACE"] = "1"  # before cudflash compiles anything

import cupy  # noqa: E402

from cudflash import bench  # noqa: E402
from cudflash.backends import kernel_loader, trace  # noqa: E402
from cudflash.cli import main  # noqa: E402

CAPTURE_AFTER = 15  # record the 16th measured step of each kind (after the bench's warm-up: graphs are captured)


def report(title: str, launches: list[trace.Launch]) -> None:
    ls = trace.spans(launches)
    t0 = ls[0].t_start
    print(f"\n=== {title}: {len(ls)} launches, first start to last release {(ls[-1].t_release - t0) / 1e3:.1f} us")
    by = defaultdict(list)
    for x in ls:
        by[x.name].append(x.span / 1e3)
    print(f"{'kernel (module CTAs x warps)':36s} {'launches':>8s} {'mean span us':>12s} {'sum us':>9s}")
    for name, sp in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:36s} {len(sp):8d} {statistics.mean(sp):12.2f} {sum(sp):9.1f}")
    gemms = [i for i, x in enumerate(ls) if x.name.startswith("stream_gemm")]
    # A layer runs from one qkv GEMM to the next (four GEMMs): average each position over the layers of that shape,
    # which one layer's sample is too noisy for (single kernels vary by 0.5-1 us from layer to layer).
    layers = [ls[gemms[i]:gemms[i + 4]] for i in range(4, len(gemms) - 8, 4)]
    layers = [x for x in layers if [y.name for y in x] == [y.name for y in layers[0]]] if layers else []
    if layers:
        print(f"{'a layer, in order (mean of ' + str(len(layers)) + ')':36s} {'span us':>8s} {'early us':>9s} "
              f"{'ends us (first, median, last)':>30s}")
        for pos in range(len(layers[0])):
            at = [x[pos] for x in layers]
            ends = [sorted((t - x.t_release) / 1e3 for t in x.ends.values()) for x in at]
            picks = (0, len(ends[0]) // 2, -1) if ends[0] else ()  # every launch of a position has the same grid
            ends_text = " ".join(f"{statistics.mean(e[q] for e in ends):6.2f}" for q in picks)
            print(f"{at[0].name:36s} {statistics.mean(x.span for x in at) / 1e3:8.2f} "
                  f"{statistics.mean(x.t_release - x.t_start for x in at) / 1e3:9.2f} {ends_text:>30s}")


seen: dict[str, int] = defaultdict(int)
real_step = bench.engine_step


def traced_step(runner, plan, block, proposer, *timer):
    kind = "autoregressive step" if block == 1 else f"speculative step (block {block})"
    if timer:  # a measured step (prefills pass no timer)
        seen[kind] += 1
    if not timer or seen[kind] != CAPTURE_AFTER + 1:
        return real_step(runner, plan, block, proposer, *timer)
    cupy.cuda.Device().synchronize()
    trace.reset(kernel_loader.traced)
    out = real_step(runner, plan, block, proposer, *timer)
    cupy.cuda.Device().synchronize()
    report(kind, trace.group(trace.read(kernel_loader.traced)))
    return out


bench.engine_step = traced_step
main(["bench", "--synthetic", "qwen3-8b", "--backend", "cuda", "--batch", "1", "--prompt-len", "512", "--new", "20",
      *sys.argv[1:]])
