"""Where weights come from: a checkpoint, tensor by tensor with shape checks, or random values made on the
backend itself (synthetic benchmarks: per-step time does not depend on the weights' values)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from cudflash.backends.base import Backend
from cudflash.checkpoint import Checkpoint
from cudflash.model_files import shown
from cudflash.errors import CheckpointError


# Tensors no real model holds as all zeros: the embedding, the LM head and every projection matrix (a zero bias,
# a neutral DFlash2 selector or an identity-initialised conv kernel projection are legitimate and not listed).
NONZERO_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                    "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight", "fc.weight")


class WeightLoader:
    """Tensors of a checkpoint onto the backend, each checked against the shape the model expects and, unless
    the checkpoint is trusted (check_weights=False), refused when it holds NaN / Inf or, for the tensors in
    NONZERO_SUFFIXES, nothing but zeros: one reduction per tensor on the backend, after its conversion."""

    def __init__(self, ckpt: Checkpoint, backend: Backend, prefix: str = "",
                 progress: Callable[[int], None] | None = None, check_weights: bool = True):
        self.ckpt, self.backend, self.prefix = ckpt, backend, prefix
        self.progress = progress  # called with the bytes of each tensor loaded
        self.check_weights = check_weights

    def has(self, name: str) -> bool:
        return self.prefix + name in self.ckpt

    def get(self, name: str, shape: tuple[int, ...]) -> Any:
        full = self.prefix + name
        dtype, raw = self.ckpt.raw(full, shape)
        if self.progress:
            self.progress(raw.nbytes)
        x = self.backend.load(dtype, raw)
        if self.check_weights:
            self._check_values(full, x)
        return x

    def _check_values(self, name: str, x: Any) -> None:
        where = f"{self.ckpt.info(name).file}: tensor {shown(name)}"
        if not self.backend.all_finite(x):
            raise CheckpointError(f"{where} holds NaN or Inf values (a corrupt or diverged checkpoint)")
        if name.endswith(NONZERO_SUFFIXES) and not self.backend.any_nonzero(x):
            raise CheckpointError(f"{where} is all zeros, which no trained model has (an uninitialised or "
                                  f"corrupt checkpoint)")

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
