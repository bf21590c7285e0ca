"""Where one captured step's time goes, kernel by kernel: a timeline from %globaltimer, with no profiler.

Runs `cudflash bench --synthetic qwen3-8b --backend cuda --batch 1 --prompt-len 512 --new 20` with every kernel
compiled with CF_TRACE (kernels/common.cuh): thread 0 of each CTA records when the CTA starts and when its wait on
the kernel in front returns. One late autoregressive step and one late speculative step (graph replays) are
recorded. CTAs are grouped into launches in time order, and each launch gets:
  release  its first CTA's wait returning (about when the kernel in front has completed), relative to the step;
  span     the next launch's release minus its own: the time the chain spent on it, completion included;
  early    how long before its release its first, median and last CTA were resident (PDL lets a CTA start behind
           the kernel in front once its SM has room: a late one streams its share after the release alone);
  ends     for kernels that mark it (stream_gemm, attention, rope), when the first, the median and the last CTA had
           written their outputs, after the release: the spread is how unevenly a launch's equal shares of work
           finish, and the last end against the span is what completing the grid and releasing the next costs.
The spans of one step add up to its device time; the table sums them per kind of kernel, and one layer's launches
are listed in order. The recording adds a global atomic and two stores per CTA event, so spans are a little long.
The recording is compiled in through the bench's tuning (`--tune nvrtc_options=-DCF_TRACE ...`, step_trace.OPTIONS).
Usage: python3 scripts/step_timeline.py [extra bench arguments, e.g. --prompt-len 2048 or --tune NAME=VALUE]
With STEP_TIMELINE_DUMP=DIR set, each recorded step's raw events are also saved as DIR/ar.npy and DIR/spec.npy
([n, 2] uint64, step_trace.read's format), for reading with scripts/step_trace.py away from the GPU.
"""
import os
import statistics
import sys
from collections import defaultdict

import cupy
import numpy as np
import step_trace as trace  # scripts/, beside this file

from cudflash.engine.spec_decode import SpeculativeStep
from cudflash.cli import main

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
    count, positions = trace.layer_means(ls)
    if positions:
        print(f"{f'a layer, in order (mean of {count})':36s} {'span us':>8s} {'early us (first, median, last)':>30s} "
              f"{'ends us (first, median, last)':>30s}")
        for p in positions:
            early = " ".join(f"{t / 1e3:6.2f}" for t in p.early)
            ends = " ".join(f"{t / 1e3:6.2f}" for t in p.ends) if p.ends else ""
            print(f"{p.name:36s} {p.span / 1e3:8.2f} {early:>30s} {ends:>30s}")


seen: dict[str, int] = defaultdict(int)
real_step = SpeculativeStep.run


def traced_step(step, plan, block, *timer):
    kind = "autoregressive step" if block == 1 else f"speculative step (block {block})"
    if timer:  # a measured step (prefills pass no timer)
        seen[kind] += 1
    if not timer or seen[kind] != CAPTURE_AFTER + 1:
        return real_step(step, plan, block, *timer)
    cupy.cuda.Device().synchronize()
    modules = trace.traced_modules()
    if not modules:
        raise SystemExit("no module was compiled with the recording in: a --tune nvrtc_options=... replaced "
                         f"{' '.join(trace.OPTIONS)}; pass those options with yours")
    trace.reset(modules)
    out = real_step(step, plan, block, *timer)
    cupy.cuda.Device().synchronize()
    events = trace.read(modules)
    if os.environ.get("STEP_TIMELINE_DUMP"):
        np.save(os.path.join(os.environ["STEP_TIMELINE_DUMP"], "ar.npy" if block == 1 else "spec.npy"), events)
    report(kind, trace.group(events))
    return out


SpeculativeStep.run = traced_step
main(["bench", "--synthetic", "qwen3-8b", "--backend", "cuda", "--batch", "1", "--prompt-len", "512", "--new", "20",
      "--tune", "nvrtc_options=" + " ".join(trace.OPTIONS), *sys.argv[1:]])
