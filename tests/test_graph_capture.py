"""engine/graph_capture.py: the cycle collector runs before a capture, never during it, and a failed capture
leaves the stream out of capture mode."""
import gc

import pytest

from cudflash.engine.graph_capture import capture


class RecordingStream:
    def __init__(self, log: list[str]):
        self.log, self.capturing = log, False

    def begin_capture(self):
        self.log.append("begin")
        self.capturing = True

    def end_capture(self):
        self.log.append("end")
        self.capturing = False
        return "graph"


class Cycle:
    """Garbage only the cycle collector frees; its finaliser stands for a synchronising free (cudaFreeHost)."""

    def __init__(self, log: list[str]):
        self.me, self.log = self, log

    def __del__(self):
        self.log.append("freed")


def test_garbage_is_collected_before_the_capture_and_the_collector_is_off_inside():
    log: list[str] = []
    Cycle(log)  # unreachable at once, alive until a collection
    stream = RecordingStream(log)

    def step(n):
        log.append(f"enabled={gc.isenabled()}")
        for _ in range(n):  # enough new cycles to trigger a collection if the collector were on
            Cycle(log)
        return n

    was = gc.isenabled()
    graph, out = capture(stream, step, 5000)
    assert (graph, out) == ("graph", 5000)
    assert log[:3] == ["freed", "begin", "enabled=False"]
    end = log.index("end")
    assert "freed" not in log[3:end]  # nothing freed between begin and end (afterwards the collector may run)
    assert gc.isenabled() == was
    gc.collect()


def test_a_failing_step_ends_the_capture_and_raises_its_own_error():
    log: list[str] = []
    stream = RecordingStream(log)

    def step():
        raise ValueError("kernel launch failed")

    with pytest.raises(ValueError, match="kernel launch failed"):
        capture(stream, step)
    assert not stream.capturing and log == ["begin", "end"]
    assert gc.isenabled()
