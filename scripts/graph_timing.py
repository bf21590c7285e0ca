"""Timing an op the way a captured step runs it: a CUDA graph of many copies (launch gaps amortised), replayed."""
import statistics

import cupy


def graph_ms(backend, fn, copies: int = 20, reps: int = 50) -> float:
    """Median device time of one copy of `fn` (ms), over `reps` replays of a graph of `copies` copies; `fn` runs
    once eagerly first so that its kernels are compiled before the capture."""
    stream = cupy.cuda.get_current_stream()
    fn()
    stream.begin_capture()
    for _ in range(copies):
        fn()
    graph = stream.end_capture()
    graph.upload(stream)
    times = []
    for _ in range(reps):
        start = backend.event()
        graph.launch(stream)
        times.append(backend.elapsed_ms(start, backend.event()) / copies)
    return statistics.median(times)
