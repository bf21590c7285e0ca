"""The step timeline's grouping of CTA events into launches (scripts/step_trace.py), on synthetic events."""
import importlib.util
import sys
from pathlib import Path

import numpy as np


def _load_tool(name: str):
    """A module of scripts/ (tools, not part of the package), imported by path."""
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


trace = _load_tool("step_trace")

GEMM, NORM = trace.MODULES.index("stream_gemm"), trace.MODULES.index("norm")


def word(kind: int, module: int, warps: int, grid: int, cta: int, sm: int = 0) -> int:
    """The packed word of kernels/common.cuh's cf_trace_event."""
    return kind << 62 | module << 56 | sm << 48 | warps << 42 | grid << 21 | cta


def test_decode_reads_the_layout_common_cuh_writes():
    assert trace.decode(word(1, GEMM, 5, 132, 131, sm=77)) == (1, GEMM, 77, 5, 132, 131)


def test_interleaved_launches_of_one_kind_are_told_apart():
    """The next GEMM starts a CTA on an idle SM before the current one's waits have returned: that start belongs to
    the next launch, the releases that follow to the current one."""
    ev = [(10, word(0, GEMM, 5, 2, 0)), (11, word(0, GEMM, 5, 2, 1)),
          (12, word(0, NORM, 8, 1, 0)),
          (13, word(0, GEMM, 5, 2, 0)),  # the next GEMM's CTA 0, early
          (20, word(1, GEMM, 5, 2, 0)), (21, word(1, GEMM, 5, 2, 1)),  # the first GEMM's releases
          (30, word(1, NORM, 8, 1, 0)),
          (31, word(0, GEMM, 5, 2, 1)), (40, word(1, GEMM, 5, 2, 1)), (41, word(1, GEMM, 5, 2, 0))]
    launches = trace.group(np.array(ev, dtype=np.uint64))
    assert [(x.name, x.t_start, x.t_release) for x in launches] == [
        ("stream_gemm 2x5w", 10, 20), ("norm 1x8w", 12, 30), ("stream_gemm 2x5w", 13, 40)]
    assert launches[2].starts == {0: 13, 1: 31} and launches[2].releases == {0: 41, 1: 40}


def test_spans_add_up_to_the_step_and_releases_before_recording_are_dropped():
    ev = [(5, word(1, NORM, 8, 1, 0)),  # a release whose start was not recorded
          (10, word(0, NORM, 8, 1, 0)), (12, word(1, NORM, 8, 1, 0)),
          (11, word(0, GEMM, 5, 1, 0)), (19, word(1, GEMM, 5, 1, 0)),
          (13, word(0, NORM, 8, 1, 0)), (50, word(1, NORM, 8, 1, 0))]
    ordered = trace.spans(trace.group(np.array(ev, dtype=np.uint64)))
    assert [x.span for x in ordered] == [7, 31, 0]
    assert sum(x.span for x in ordered) == ordered[-1].t_release - ordered[0].t_release


def test_an_end_belongs_to_the_launch_its_cta_was_last_released_in():
    """A GEMM CTA's end comes after its release, and possibly after the next GEMM has started a CTA of the same
    index on another SM: it still belongs to the launch that released it."""
    ev = [(10, word(0, GEMM, 5, 2, 0)), (11, word(0, GEMM, 5, 2, 1)),
          (20, word(1, GEMM, 5, 2, 0)), (21, word(1, GEMM, 5, 2, 1)),
          (25, word(2, GEMM, 5, 2, 0)),
          (26, word(0, GEMM, 5, 2, 0)),  # the next GEMM's CTA 0 starts on the SM CTA 0 left
          (29, word(2, GEMM, 5, 2, 1)),
          (30, word(0, GEMM, 5, 2, 1)), (40, word(1, GEMM, 5, 2, 0)), (41, word(1, GEMM, 5, 2, 1)),
          (50, word(2, GEMM, 5, 2, 1)), (52, word(2, GEMM, 5, 2, 0)),
          (60, word(2, NORM, 8, 1, 0))]  # an end with no recorded release: dropped
    first, second = trace.group(np.array(ev, dtype=np.uint64))
    assert first.ends == {0: 25, 1: 29} and second.ends == {0: 52, 1: 50}


def _launch(name: str, start: int, release: int, span: int, ends: tuple[int, ...] = (),
            later: tuple[int, ...] = ()) -> trace.Launch:
    """One launch whose CTA 0 starts at `start` and the others (if any) at `later`."""
    starts = dict(enumerate((start, *later)))
    return trace.Launch(name, max(1, len(ends), len(starts)), starts, {0: release}, dict(enumerate(ends)), span)


def test_layer_means_average_each_position_over_the_layers_of_the_common_sequence():
    """Layers start at every fourth GEMM; a layer whose launches differ (here the first, with a norm in it) is left
    out, and a GEMM position averages its CTA ends after the release and how early its CTAs started."""
    g, n, r = "stream_gemm 2x5w", "norm 1x8w", "rope 3x4w"

    def layer(t0: int, rope_span: int, odd: bool = False) -> list[trace.Launch]:
        gemms = [_launch(g, t0 - 5, t0, 10, ends=(t0 + 4, t0 + 8), later=(t0 - 1,))]
        gemms.append(_launch(n if odd else r, t0 + 5, t0 + 10, rope_span))
        gemms += [_launch(g, t0 + 10 * i, t0 + 10 * i + 10, 10, ends=(t0 + 10 * i + 12,) * 2) for i in (1, 2, 3)]
        return gemms

    ordered = layer(0, 1, odd=True) + layer(100, 2) + layer(200, 4) + layer(300, 6)
    count, positions = trace.layer_means(ordered)
    assert count == 2  # layers 1 and 2: layer 0 differs, layer 3 has no GEMM after it to close it
    assert [p.name for p in positions] == [g, r, g, g, g]
    assert positions[1].span == 3 and positions[1].early == (5, 5, 5)
    assert positions[0].early == (5, 1, 1)  # the CTA that started 1 before the release is the median of two
    assert positions[0].ends == (4, 8, 8) and positions[1].ends is None


def test_layer_means_need_two_whole_layers():
    assert trace.layer_means([_launch("stream_gemm 1x5w", 0, 1, 1, ends=(2,))] * 5) == (0, [])


def test_read_tags_each_buffer_with_its_module_and_keeps_the_rest_of_the_word():
    """Every module is compiled with module number 0 (one tuple of options for all): the reader writes each buffer's
    own number into its events, leaving time, kind, SM, warps, grid and CTA as the kernel wrote them."""
    ev = np.array([(7, word(1, 0, 5, 132, 131, sm=77)), (9, word(2, 0, 4, 8, 3, sm=1))], dtype=np.uint64)
    out = trace.tagged(ev, GEMM)
    assert [trace.decode(int(w)) for w in out[:, 1]] == [(1, GEMM, 77, 5, 132, 131), (2, GEMM, 1, 4, 8, 3)]
    assert out[:, 0].tolist() == [7, 9] and trace.decode(int(ev[0, 1]))[1] == 0  # the input is left as it was
    assert trace.decode(int(trace.tagged(out, NORM)[0, 1]))[1] == NORM  # a number already there is replaced


def test_the_options_switch_on_what_common_cuh_records():
    """step_trace.OPTIONS define what kernels/common.cuh's recording needs, and the package's modules are the ones
    the reader names."""
    from cudflash.backends import kernel_source

    common = (kernel_source.kernel_root() / "common.cuh").read_text()
    assert "#ifdef CF_TRACE\n" in common and "CF_TRACE_MODULE" in common
    assert trace.OPTIONS[0] == "-DCF_TRACE" and any(o.startswith("-DCF_TRACE_MODULE=") for o in trace.OPTIONS)
    assert kernel_source.module_names() == trace.MODULES
