"""Where weights come from: a checkpoint, tensor by tensor with shape checks, or random values made on the
backend itself (synthetic benchmarks: per-step time does not depend on the weights' values)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from cudflash.backends.base import Backend
from cudflash.checkpoint import Checkpoint


class WeightLoader:
    def __init__(self, ckpt: Checkpoint, backend: Backend, prefix: str = "",
                 progress: Callable[[int], None] | None = None):
        self.ckpt, self.backend, self.prefix = ckpt, backend, prefix
        self.progress = progress  # called with the bytes of each tensor loaded

    def has(self, name: str) -> bool:
        return self.prefix + name in self.ckpt

    def get(self, name: str, shape: tuple[int, ...]) -> Any:
        dtype, raw = self.ckpt.raw(self.prefix + name, shape)
        if self.progress:
            self.progress(raw.nbytes)
        return self.backend.load(dtype, raw)

    def fused(self, names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> Any:
        """Concatenate along the output dimension (rows), e.g. q/k/v -> qkv."""
        return self.backend.cat([self.get(n, s) for n, s in names_and_shapes], axis=0)

    def gate_up(self, gate: str, up: str, shape: tuple[int, int]) -> Any:
        """The MLP's gate and up projections [I, H] as the backend's fused gate_up weight (Backend.swiglu)."""
        return self.backend.gate_up_weight(self.get(gate, shape), self.get(up, shape))


class RandomWeights:
    """The WeightLoader interface over random values: matrices ~ N(0, std^2), vectors (norms, biases) ~ 1."""

    def __init__(self, backend: Backend, seed: int = 0, std: float = 0.02, untied: bool = True):
        self.backend, self.seed, self.std, self.untied = backend, seed, std, untied
        self.count = 0

    def has(self, name: str) -> bool:
        return name == "lm_head.weight" and self.untied

    def get(self, name: str, shape: tuple[int, ...]) -> Any:
        self.count += 1
        if len(shape) == 1:
            return self.backend.load("F32", np.ones(shape, dtype=np.float32))
        return self.backend.random(shape, self.std, self.seed + self.count)

    def fused(self, names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> Any:
        rows = sum(s[0] for _, s in names_and_shapes)
        return self.get(names_and_shapes[0][0], (rows,) + tuple(names_and_shapes[0][1][1:]))

    def gate_up(self, gate: str, up: str, shape: tuple[int, int]) -> Any:
        return self.get(gate, (2 * shape[0], shape[1]))  # random either way: the row order does not matter
