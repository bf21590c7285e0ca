"""Where one captured step's time goes, kernel by kernel: a timeline from %globaltimer, with no profiler.

Runs `cudflash bench --synthetic qwen3-8b --backend cuda --batch 1 --prompt-len 512 --new 20` with every kernel
compiled with CF_TRACE (kernels/common.cuh): thread 0 of each CTA records when the CTA starts and when its wait on
the kernel in front returns. One late autoregressive step and one late speculative step (graph replays) are
recorded. CTAs are grouped into launches in time order, and each launch gets:
  release  its first CTA's wait returning (about when the kernel in front has completed), relative to the step;
  span     the next launch's release minus its own: the time the chain spent on it, completion included;
  early    how long before its release its first CTA was resident (PDL lets it start behind the kernel in front).
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
import numpy as np  # noqa: E402

from cudflash import bench  # noqa: E402
from cudflash.backends import kernel_loader  # noqa: E402
from cudflash.cli import main  # noqa: E402

CAPTURE_AFTER = 15  # record the 16th step of each kind (after the bench's warm-up: graphs are captured by then)


def buffers():
    """(module name, counter, events) device views of every traced module's buffers."""
    out = []
    for name, mod in kernel_loader.traced:
        count = cupy.ndarray((1,), cupy.uint32, memptr=mod.get_global("cf_trace_count"))
        events = cupy.ndarray((2 << 18,), cupy.uint64, memptr=mod.get_global("cf_trace"))
        out.append((name, count, events))
    return out


def read_events() -> np.ndarray:
    """All recorded events, [n, 2] uint64 (time, info), sorted by time."""
    rows = []
    for _, count, events in buffers():
        n = min(int(count.get()[0]), 1 << 18)
        rows.append(events[: 2 * n].get().reshape(n, 2))
    ev = np.concatenate(rows) if rows else np.zeros((0, 2), np.uint64)
    return ev[np.argsort(ev[:, 0], kind="stable")]


def launches(ev: np.ndarray) -> list[dict]:
    """Group CTA events into launches. Under PDL a grid starts only after every CTA of the one in front has
    started, and its waits return only after that one completed, so for one kind of kernel (module, warps, grid
    size) a CTA's start belongs to the earliest launch that has not started that CTA, and its release to the
    earliest that started it and has not released it."""
    out, open_by_key = [], defaultdict(list)
    for t, info in ev.tolist():
        kind, module = info >> 62, (info >> 56) & 63
        warps, grid, cta = (info >> 42) & 63, (info >> 21) & 0x1FFFFF, info & 0x1FFFFF
        pending = open_by_key[(module, warps, grid)]
        if kind == 0:
            launch = next((x for x in pending if cta not in x["starts"]), None)
            if launch is None:
                launch = {"name": f"{kernel_loader.TRACE_MODULES[module]} {grid}x{warps}w", "grid": grid,
                          "starts": {}, "releases": {}}
                pending.append(launch)
                out.append(launch)
            launch["starts"][cta] = t
        else:
            launch = next((x for x in pending if cta in x["starts"] and cta not in x["releases"]), None)
            if launch is None:
                continue  # started before the recording began
            launch["releases"][cta] = t
            if len(launch["releases"]) == launch["grid"]:
                pending.remove(launch)
    for launch in out:
        launch["t_start"] = min(launch["starts"].values())
        launch["t_release"] = min(launch["releases"].values(), default=None)
    return [x for x in out if x["t_release"] is not None]


def report(title: str, ls: list[dict]) -> None:
    ls.sort(key=lambda x: x["t_release"])
    t0 = ls[0]["t_start"]
    for a, b in zip(ls, ls[1:]):
        a["span"] = b["t_release"] - a["t_release"]
    ls[-1]["span"] = 0
    total = (ls[-1]["t_release"] - t0) / 1e3
    print(f"\n=== {title}: {len(ls)} launches, first start to last release {total:.1f} us")
    by = defaultdict(list)
    for x in ls:
        by[x["name"]].append(x["span"] / 1e3)
    print(f"{'kernel (module CTAs x warps)':36s} {'launches':>8s} {'mean span us':>12s} {'sum us':>9s}")
    for name, spans in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:36s} {len(spans):8d} {statistics.mean(spans):12.2f} {sum(spans):9.1f}")
    gemms = [i for i, x in enumerate(ls) if x["name"].startswith("stream_gemm")]
    if len(gemms) > 44:  # one layer in the middle: from its 4 k-th GEMM to the next layer's
        lo, hi = gemms[40], gemms[44]
        print(f"{'one layer, in order':36s} {'release us':>10s} {'span us':>8s} {'early us':>9s}")
        for x in ls[lo:hi + 1]:
            early = (x["t_release"] - x["t_start"]) / 1e3
            print(f"{x['name']:36s} {(x['t_release'] - t0) / 1e3:10.1f} {x['span'] / 1e3:8.2f} {early:9.2f}")


seen = defaultdict(int)
real_step = bench.engine_step


def traced_step(runner, plan, block, proposer, *timer):
    kind = "autoregressive step" if block == 1 else f"speculative step (block {block})"
    if timer:  # a measured step (prefills pass no timer)
        seen[kind] += 1
    if not timer or seen[kind] != CAPTURE_AFTER + 1:
        return real_step(runner, plan, block, proposer, *timer)
    cupy.cuda.Device().synchronize()
    for _, count, _ in buffers():
        count.fill(0)
    cupy.cuda.Device().synchronize()
    out = real_step(runner, plan, block, proposer, *timer)
    cupy.cuda.Device().synchronize()
    report(kind, launches(read_events()))
    return out


bench.engine_step = traced_step
main(["bench", "--synthetic", "qwen3-8b", "--backend", "cuda", "--batch", "1", "--prompt-len", "512", "--new", "20",
      *sys.argv[1:]])
