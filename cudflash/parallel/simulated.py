"""N tensor-parallel ranks of the target simulated in one process on the numpy backend, each on its own thread,
meeting in SimulatedGroup's collectives: the CPU proof that the sharding arithmetic equals the unsharded model.

Each rank owns its model shard and its KV cache (its KV heads only: the bytes per block are divided by
size / replicas); the batch (ids, positions, slots, attention metadata) is the same on every rank.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

import numpy as np

from cudflash.backends.base import Backend
from cudflash.config import TargetConfig
from cudflash.models.batch import ForwardBatch, KVCache
from cudflash.models.target import TargetModel
from cudflash.parallel.comm import SimulatedGroup
from cudflash.parallel.config import TensorParallel
from cudflash.parallel.vocab import gather_logits, greedy_tokens

R = TypeVar("R")


class SimulatedRanks:
    """A SimulatedGroup and the threads that run one function per rank."""

    def __init__(self, size: int):
        self.size = size
        self.group = SimulatedGroup(size)

    def run(self, fn: Callable[[int], R]) -> list[R]:
        """fn(rank) on one thread per rank; a rank's exception aborts the group (no rank is left at a barrier)
        and is raised here."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(r: int) -> None:
            try:
                results[r] = fn(r)
            except BaseException as e:  # noqa: BLE001: re-raised in the caller
                errors.append(e)
                self.group.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class SimulatedTarget:
    """size rank models of one target; forward() runs every rank and returns rank 0's view (replicated)."""

    def __init__(self, cfg: TargetConfig, loader_for: Callable[[int], Any], backend: Backend, size: int,
                 num_blocks: int, block_size: int, rope: tuple[Any, Any]):
        """loader_for(rank): a WeightLoader of the checkpoint (each rank reads its own slices); rope: the
        (cos, sin) tables; num_blocks: KV blocks per rank, every rank's pool the same block count."""
        self.cfg, self.b, self.size = cfg, backend, size
        self.sim = SimulatedRanks(size)
        self.group = self.sim.group
        self.ranks: list[TargetModel] = []
        self.kv: list[KVCache] = []
        for r in range(size):
            m = TargetModel(cfg, loader_for(r), backend, TensorParallel(r, size), self.group.communicator(r))
            m.rope_cos, m.rope_sin = rope
            shape = (cfg.num_layers, num_blocks, block_size, m.num_kv_heads, cfg.head_dim)  # this rank's heads
            self.ranks.append(m)
            self.kv.append(KVCache(backend.zeros(shape, "act"), backend.zeros(shape, "act")))

    def forward_logits(self, batch: ForwardBatch, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(full float32 logits [len(rows), V] gathered, greedy tokens int32 [len(rows)] reduced) at `rows`."""
        def rank(r: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
            m, b = self.ranks[r], self.b
            hidden, _ = m.forward(batch, self.kv[r])
            local = m.logits(b.take_rows(hidden, b.asarray(rows, "i32")))
            return gather_logits(b, m.comm, local), greedy_tokens(b, m.comm, local, m.vocab_start)

        out = self.sim.run(rank)
        for logits, tokens in out[1:]:  # the collectives give every rank the same bits
            assert np.array_equal(logits, out[0][0]) and np.array_equal(tokens, out[0][1])
        return out[0]
