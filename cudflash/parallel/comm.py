"""The collectives a tensor-parallel rank calls, and an in-process implementation for N simulated ranks.

A GPU communicator (NCCL through cupy.cuda.nccl) implements the same two methods; the models never know which.
"""
from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np


class Communicator(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: Any) -> Any: ...  # the sum over ranks, the same array on every rank
    def all_gather(self, x: Any, axis: int = -1) -> Any: ...  # concatenation in rank order along axis


class SimulatedGroup:
    """N ranks in one process, one thread each: every collective is a rendezvous at a barrier. Sums run in the
    fixed order rank 0, 1, ..., N-1 on every rank, so all ranks get bitwise the same result (as NCCL's ring gives
    every rank the same bits), and the result is deterministic run to run."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = size
        self._slots: list[Any] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout)

    def communicator(self, rank: int) -> "SimulatedCommunicator":
        return SimulatedCommunicator(self, rank)

    def abort(self) -> None:
        """A rank failed: wake the others (they raise BrokenBarrierError) instead of leaving them waiting."""
        self._barrier.abort()

    def exchange(self, rank: int, x: Any) -> list[Any]:
        """Every rank's x, in rank order. Two barriers: all have written before any reads, and all have read
        before the next collective overwrites a slot."""
        self._slots[rank] = x
        self._barrier.wait()
        parts = list(self._slots)
        self._barrier.wait()
        return parts


class SimulatedCommunicator:
    def __init__(self, group: SimulatedGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        parts = self.group.exchange(self.rank, x)
        total = np.array(parts[0], dtype=np.float32, copy=True)
        for p in parts[1:]:
            total += p
        return total

    def all_gather(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.concatenate(self.group.exchange(self.rank, x), axis=axis)
