"""The engine's view of a tensor-parallel target on the CPU backend: N simulated ranks behind TargetModel's
interface (embed, forward, logits, rope tables), so the runner, the sampler and the drafter run unchanged.

The runner's KV cache holds every rank's heads side by side on the heads axis: [layers, blocks, block_size,
size * Hk_r, D], rank r's cache the view of heads r * Hk_r .. (r + 1) * Hk_r (its own heads: KV replicated where
Hk < size is stored once per rank, as on N GPUs). Block-wise ops on the whole cache (a draft tree's copy_slots)
then move every rank's heads at once. logits() gathers the vocab shards: the full row, exactly the unsharded
logits' values, so greedy argmax and sampling downstream are the tp=1 code (vocab.py; the GPU engine will reduce
greedy rows with greedy_tokens instead of moving [T, V]).
"""
from __future__ import annotations

from typing import Any, Callable

from cudflash.backends.base import Backend
from cudflash.config import TargetConfig
from cudflash.errors import ConfigError
from cudflash.models.batch import ForwardBatch, KVCache
from cudflash.models.target import TargetModel
from cudflash.parallel.config import TensorParallel
from cudflash.parallel.simulated import SimulatedRanks
from cudflash.parallel.vocab import gather_logits


class TensorParallelTarget:
    def __init__(self, cfg: TargetConfig, loader_for: Callable[[int], Any], backend: Backend, size: int):
        if backend.name != "cpu":
            raise ConfigError(f"tensor_parallel_size={size} on the {backend.name} backend: the NCCL communicator and "
                              f"the per-GPU rank processes are not there yet (docs/tensor_parallel.md); use 1")
        TensorParallel(0, size).check_heads(cfg.num_heads, cfg.num_kv_heads, str(cfg.path))
        self.cfg, self.b, self.size = cfg, backend, size
        self.sim = SimulatedRanks(size)
        self.ranks = [TargetModel(cfg, loader_for(r), backend, TensorParallel(r, size), self.sim.group.communicator(r))
                      for r in range(size)]
        self.rank_kv_heads = self.ranks[0].num_kv_heads
        self.num_kv_heads = size * self.rank_kv_heads  # heads axis of the runner's cache

    @property
    def rope_cos(self) -> Any:
        return self.ranks[0].rope_cos

    @rope_cos.setter
    def rope_cos(self, table: Any) -> None:
        for m in self.ranks:
            m.rope_cos = table

    @property
    def rope_sin(self) -> Any:
        return self.ranks[0].rope_sin

    @rope_sin.setter
    def rope_sin(self, table: Any) -> None:
        for m in self.ranks:
            m.rope_sin = table

    def rank_kv(self, kv: KVCache, r: int) -> KVCache:
        h = slice(r * self.rank_kv_heads, (r + 1) * self.rank_kv_heads)
        return KVCache(kv.k[:, :, :, h], kv.v[:, :, :, h])

    def embed(self, ids: Any) -> Any:
        return self.ranks[0].embed(ids)  # replicated

    def forward(self, batch: ForwardBatch, kv: KVCache, tap_layers: list[int] | None = None) -> tuple[Any, Any]:
        """Rank 0's (hidden, taps): after the last all-reduce every rank holds the same bits."""
        return self.sim.run(lambda r: self.ranks[r].forward(batch, self.rank_kv(kv, r), tap_layers))[0]

    def logits(self, hidden: Any) -> Any:
        """float32 [T, V]: every rank's vocab shard of the same (replicated) hidden rows, gathered in vocab order."""
        return self.sim.run(lambda r: gather_logits(self.b, self.ranks[r].comm, self.ranks[r].logits(hidden)))[0]


def check_tensor_parallel(size: int, backend: Backend) -> int:
    """`size` if the engine can run it on `backend`, else a ConfigError that says why. 1 is always today's path."""
    if not isinstance(size, int) or isinstance(size, bool):
        raise ConfigError(f"tensor_parallel_size={size!r}: must be an int, one of 1, 2, 4, 8")
    TensorParallel(0, size)  # refuses sizes outside 1, 2, 4, 8
    if size == 1 or backend.name == "cpu":
        return size
    import cupy  # only a CUDA backend gets here

    visible = cupy.cuda.runtime.getDeviceCount()
    if size > visible:
        raise ConfigError(f"tensor_parallel_size={size} needs {size} GPUs; this machine has {visible}")
    raise ConfigError(f"tensor_parallel_size={size} on the {backend.name} backend: the NCCL communicator, one rank "
                      f"process per GPU and collectives in the CUDA graphs are not there yet "
                      f"(docs/tensor_parallel.md); use 1, or backend='cpu' to simulate the ranks")
