"""Recording a CUDA graph on a stream, with nothing in the process allowed to break the recording.

A capture in CUDA's default (global) mode is invalidated by any synchronising CUDA call made meanwhile, by any
thread: cudaFreeHost or cudaFree of an earlier engine's page-locked buffers, graphs or modules, run by Python's
cycle collector at whatever allocation happens to trigger it (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, intermittent,
seen when one process builds a second LLM). So the collector runs just before the capture and is off during it,
as torch.cuda.graph does. No cupy import: the stream is anything with begin_capture / end_capture.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any


def capture(stream: Any, fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """(graph, fn(*args)) recorded on `stream`. If fn raises, the capture is ended (its graph dropped) so that the
    stream is usable again, and fn's error propagates."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        stream.begin_capture()
        try:
            out = fn(*args)
        except BaseException:
            with contextlib.suppress(Exception):  # an invalidated capture also fails to end: fn's error is the news
                stream.end_capture()
            raise
        return stream.end_capture(), out
    finally:
        if enabled:
            gc.enable()
