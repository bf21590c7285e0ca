"""TensorParallel: which slice of every sharded weight one rank holds (docs/tensor_parallel.md states the rules).

The rules are pure arithmetic on (rank, size) and the model's shape, so the loader, the model and the KV cache
sizing all ask this one object and can never disagree.
"""
from __future__ import annotations

from dataclasses import dataclass

from cudflash.errors import ConfigError

SUPPORTED_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size not in SUPPORTED_SIZES:
            allowed = ", ".join(map(str, SUPPORTED_SIZES))
            raise ConfigError(f"tensor_parallel_size={self.size}: must be one of {allowed}")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")

    def check_heads(self, num_heads: int, num_kv_heads: int, label: str = "the target") -> None:
        """Query heads split evenly; KV heads split evenly, or (fewer KV heads than ranks) each replicated on
        size / num_kv_heads ranks, which needs num_kv_heads to divide size."""
        if num_heads % self.size:
            raise ConfigError(f"tensor_parallel_size={self.size} does not divide the {num_heads} query heads of "
                              f"{label}")
        if (num_kv_heads % self.size) if num_kv_heads >= self.size else (self.size % num_kv_heads):
            raise ConfigError(f"tensor_parallel_size={self.size} and the {num_kv_heads} KV heads of {label}: one "
                              f"must divide the other")

    def q_heads(self, num_heads: int) -> range:
        n = num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, num_kv_heads: int) -> range:
        """The KV heads this rank's query heads read. num_kv_heads >= size: an even split. Fewer (vLLM's rule):
        rank r holds KV head r // (size / num_kv_heads); since query heads are grouped by KV head in order, rank r's
        query heads q_heads(...) all belong to that KV head."""
        if num_kv_heads >= self.size:
            n = num_kv_heads // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        head = self.rank // (self.size // num_kv_heads)
        return range(head, head + 1)

    def split(self, n: int) -> range:
        """An even split of n (the MLP's intermediate size): n must divide by size."""
        if n % self.size:
            raise ConfigError(f"tensor_parallel_size={self.size} does not divide the intermediate size {n}")
        k = n // self.size
        return range(self.rank * k, (self.rank + 1) * k)

    def vocab(self, vocab_size: int) -> range:
        """The LM head's rows: chunks of ceil(V / size), the last rank's shorter (possibly empty). Uneven, not
        padded, on the CPU: the gather concatenates in rank order and argmax offsets by the chunk start, so no
        padded row can ever win (docs/tensor_parallel.md: the GPU pads to equal chunks and masks them to -inf)."""
        chunk = -(-vocab_size // self.size)
        return range(min(self.rank * chunk, vocab_size), min((self.rank + 1) * chunk, vocab_size))


def rows_of_heads(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)
