"""The step timeline's events (scripts/step_timeline.py): what kernels compiled with CF_TRACE record
(kernels/common.cuh), read off the device and grouped into launches. A tool, not part of the package: the product
only compiles the recording in when a tuning's nvrtc_options ask for it (`OPTIONS`).

Thread 0 of every CTA records two events: when the CTA starts, and when its wait on the kernel in front returns
(its "release"); a kernel that marks it (stream_gemm, attention, rope) records a third when the CTA's outputs are
written (its "end"). An event is two uint64: the %globaltimer time in ns and a packed word,
kind (bits 62-63: 0 start, 1 release, 2 end) | module (56-61) | SM (48-55) | warps per CTA (42-47) | CTAs in the
grid (21-41) | CTA index (0-20). Each compiled module has its own buffer; every module is compiled with module
number 0 (the options are one tuple for all) and `read` writes each buffer's own module number into its events.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

MODULES = ("argmax", "attention", "draft_heads", "elementwise", "fp4_dequant", "fp8_act_quant", "fp8_dequant", "gdn",
           "gdn_chunk", "memory", "norm", "rope", "stream_gemm")
CAP = 1 << 18  # CF_TRACE_CAP: events per module buffer
OPTIONS = ("-DCF_TRACE", "-DCF_TRACE_MODULE=0")  # the tuning's nvrtc_options that compile the recording in
_MODULE_BITS = np.uint64(63 << 56)


@dataclass
class Launch:
    """One kernel launch as its CTAs recorded it (times in ns)."""

    name: str  # module, CTAs x warps per CTA
    grid: int
    starts: dict[int, int] = field(default_factory=dict)  # CTA index -> start time
    releases: dict[int, int] = field(default_factory=dict)  # CTA index -> time its wait returned
    ends: dict[int, int] = field(default_factory=dict)  # CTA index -> time its outputs were written (if marked)
    span: int = 0  # the next launch's first release minus this one's (set by `spans`)

    @property
    def t_start(self) -> int:
        return min(self.starts.values())

    @property
    def t_release(self) -> int:
        return min(self.releases.values())


def decode(info: int) -> tuple[int, int, int, int, int, int]:
    """(kind, module, SM, warps, grid, CTA) of a packed event word."""
    return (info >> 62, (info >> 56) & 63, (info >> 48) & 255, (info >> 42) & 63, (info >> 21) & 0x1FFFFF,
            info & 0x1FFFFF)


def group(events: np.ndarray) -> list[Launch]:
    """Events [n, 2] (time, word) -> launches in the order they started, each with a release.

    Under PDL a grid starts only after every CTA of the one in front has started, and its waits return only after
    that one completed. So for one kind of kernel (module, warps, grid size), a CTA's start belongs to the earliest
    launch that has not started that CTA, and its release to the earliest that started it and has not released
    it, even where a GEMM's next launch starts CTAs on idle SMs before the current one's waits return."""
    out: list[Launch] = []
    pending: dict[tuple[int, int, int], list[Launch]] = defaultdict(list)
    last_release: dict[tuple[int, int, int, int], Launch] = {}  # (kind of kernel, CTA) -> its latest release's launch
    for t, info in sorted(events.tolist()):
        kind, module, _, warps, grid, cta = decode(info)
        open_launches = pending[(module, warps, grid)]
        if kind == 2:  # an end follows its own CTA's release
            launch = last_release.get((module, warps, grid, cta))
            if launch is not None:
                launch.ends[cta] = t
            continue
        if kind == 0:
            launch = next((x for x in open_launches if cta not in x.starts), None)
            if launch is None:
                launch = Launch(f"{MODULES[module]} {grid}x{warps}w", grid)
                open_launches.append(launch)
                out.append(launch)
            launch.starts[cta] = t
            continue
        launch = next((x for x in open_launches if cta in x.starts and cta not in x.releases), None)
        if launch is None:
            continue  # started before the recording began
        launch.releases[cta] = t
        last_release[(module, warps, grid, cta)] = launch
        if len(launch.releases) == launch.grid:
            open_launches.remove(launch)
    return [x for x in out if x.releases]


def spans(launches: list[Launch]) -> list[Launch]:
    """Sorted by release, each with its span: the spans add up to the time from the first release to the last."""
    ordered = sorted(launches, key=lambda x: x.t_release)
    for a, b in zip(ordered, ordered[1:]):
        a.span = b.t_release - a.t_release
    return ordered


@dataclass
class Position:
    """One launch of a repeating layer, averaged over the layers with the same launch sequence (times in ns)."""

    name: str
    span: float
    early: tuple[float, float, float]  # its release minus the start of its first, median and last CTA
    ends: tuple[float, float, float] | None  # first, median and last CTA end after the release (if marked)


def layer_means(ordered: list[Launch], gemms_per_layer: int = 4) -> tuple[int, list[Position]]:
    """Launches ordered by release (`spans`) cut into layers at every gemms_per_layer-th stream GEMM; each position
    averaged over the layers of the most common launch sequence (one layer's sample is too noisy to read alone).
    Returns (layers averaged, positions); (0, []) with fewer than two whole layers."""
    gemms = [i for i, x in enumerate(ordered) if x.name.startswith("stream_gemm")]
    cuts = gemms[::gemms_per_layer]
    layers = [ordered[a:b] for a, b in zip(cuts, cuts[1:])]
    if len(layers) < 2:
        return 0, []
    names = [tuple(x.name for x in layer) for layer in layers]
    common = max(set(names), key=names.count)
    layers = [layer for layer, n in zip(layers, names) if n == common]

    def means(rows: list[list[int]]) -> tuple[float, float, float]:  # of the first, median and last of each row
        picks = (0, len(rows[0]) // 2, -1)  # every launch of one position has the same grid
        return tuple(float(np.mean([r[q] for r in rows])) for q in picks)

    out = []
    for at in zip(*layers):
        ends = [sorted(t - x.t_release for t in x.ends.values()) for x in at]
        early = [sorted(x.t_release - t for t in x.starts.values())[::-1] for x in at]
        out.append(Position(at[0].name, float(np.mean([x.span for x in at])), means(early),
                            means(ends) if all(ends) else None))
    return len(layers), out


def tagged(events: np.ndarray, module: int) -> np.ndarray:
    """Events [n, 2] (time, word) of one module's buffer with `module` as the word's module number."""
    out = events.copy()
    out[:, 1] = (out[:, 1] & ~_MODULE_BITS) | np.uint64(module << 56)
    return out


def traced_modules() -> list[tuple[str, object]]:
    """(name, module) of every module this process compiled with the recording in (kernel_loader.loaded)."""
    from cudflash.backends import kernel_loader

    return [(name, mod) for name, options, mod in kernel_loader.loaded if OPTIONS[0] in options]


def buffers(modules) -> list[tuple[str, object, object]]:
    """(name, event count, events): device views of each traced module's buffers."""
    import cupy

    return [(name, cupy.ndarray((1,), cupy.uint32, memptr=mod.get_global("cf_trace_count")),
             cupy.ndarray((2 * CAP,), cupy.uint64, memptr=mod.get_global("cf_trace"))) for name, mod in modules]


def reset(modules) -> None:
    for _, count, _ in buffers(modules):
        count.fill(0)


def read(modules) -> np.ndarray:
    """Every module's recorded events, [n, 2] uint64 (time, word), each tagged with its module's number."""
    rows = [np.zeros((0, 2), np.uint64)]
    for name, count, events in buffers(modules):
        n = min(int(count.get()[0]), CAP)
        rows.append(tagged(events[: 2 * n].get().reshape(n, 2), MODULES.index(name)))
    return np.concatenate(rows)
