"""Token choice from target logits: greedy argmax on the device, or temperature / top-k / top-p sampling.

Speculative acceptance with an argmax drafter is the one-hot case of rejection sampling: drawing the target's
token x_j ~ p_j at every block slot and accepting draft d_{j+1} while d_{j+1} == x_j accepts d with
probability p(d) and, on rejection, leaves x_j distributed as the residual p restricted to tokens != d.
So the emitted stream is distributed exactly as plain sampling from the target.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from cudflash.backends.base import Backend
from cudflash.sampling_params import SamplingParams


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[V] float32 logits -> [V] float64 probabilities after temperature, top-k and top-p."""
    x = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < x.size:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, params.top_p)) + 1]  # smallest prefix reaching top_p
        kept = np.zeros_like(p)
        kept[keep] = p[keep]
        p = kept / kept.sum()
    return p


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    idx = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return min(idx, probs.size - 1)


def choose_tokens(backend: Backend, logits: Any, row_params: list[SamplingParams],
                  row_rngs: list[np.random.Generator]) -> np.ndarray:
    """One token per logits row: argmax on the device for greedy rows, host sampling for the rest."""
    tokens = backend.to_numpy(backend.argmax(logits)).astype(np.int64)
    sampled = [i for i, p in enumerate(row_params) if not p.greedy]
    if sampled:
        rows = backend.to_numpy(backend.take_rows(logits, backend.asarray(np.array(sampled), "i32")))
        for r, i in enumerate(sampled):
            tokens[i] = sample(target_probs(rows[r], row_params[i]), row_rngs[i])
    return tokens


def accepted_prefix(drafts: np.ndarray, targets: np.ndarray) -> int:
    """Number of drafts d_1.. accepted: the longest prefix with drafts[j] == targets[j]."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a
