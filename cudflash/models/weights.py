"""Moving checkpoint tensors onto a backend: one tensor at a time, with shape checks and fused concatenations."""
from __future__ import annotations

from typing import Any, Callable

from cudflash.backends.base import Backend
from cudflash.checkpoint import Checkpoint


class WeightLoader:
    def __init__(self, ckpt: Checkpoint, backend: Backend, prefix: str = "",
                 progress: Callable[[int], None] | None = None):
        self.ckpt, self.backend, self.prefix = ckpt, backend, prefix
        self.progress = progress  # called with the bytes of each tensor loaded

    def get(self, name: str, shape: tuple[int, ...]) -> Any:
        full = self.prefix + name
        dtype, raw = self.ckpt.raw(full, shape)
        if self.progress:
            self.progress(raw.nbytes)
        return self.backend.load(dtype, raw)

    def maybe(self, name: str, shape: tuple[int, ...]) -> Any | None:
        return self.get(name, shape) if self.prefix + name in self.ckpt else None

    def fused(self, names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> Any:
        """Concatenate along the output dimension (rows), e.g. q/k/v -> qkv, gate/up -> gate_up."""
        return self.backend.cat([self.get(n, s) for n, s in names_and_shapes], axis=0)
