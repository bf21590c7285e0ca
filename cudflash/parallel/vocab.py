"""The vocab-parallel LM head's reductions, exact: each equals what the unsharded head gives.

Greedy: each rank's shard argmax (first index on ties) and its value; the winner is the largest value, and among
equal values the lowest rank, whose vocab chunk comes first, so the lowest global index: the unsharded argmax's
own tie rule. Each logit is the same dot product over H as unsharded (the LM head is column-parallel: no sum
across ranks), so the values compared are the unsharded logits. Sampling: the shards are gathered into the full
[T, V] row, in vocab order, and the tp=1 sampler runs on it unchanged: the same distribution and, for the same
seed, the same tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from cudflash.backends.base import Backend
from cudflash.parallel.comm import Communicator


def greedy_tokens(backend: Backend, comm: Communicator, local_logits: Any, vocab_start: int,
                  nonfinite: int = -1) -> np.ndarray:
    """int32 [T]: the argmax over the whole vocabulary of rows whose shard [T, V_r] this rank holds from
    vocab_start; `nonfinite` where any shard of the row holds a NaN or an infinity (as Backend.argmax)."""
    x = backend.to_numpy(local_logits)
    t = x.shape[0]
    if x.shape[1]:
        idx = backend.to_numpy(backend.argmax(local_logits, nonfinite)).astype(np.int64)
        bad = idx == nonfinite
        val = np.where(bad, -np.inf, x[np.arange(t), np.where(bad, 0, idx)])
    else:  # an empty last chunk (V < size * chunk): never wins
        idx, bad, val = np.zeros(t, np.int64), np.zeros(t, bool), np.full(t, -np.inf, np.float32)
    # [3, T] per rank -> [3, T * size] gathered; one collective for value, index and the non-finite flag
    mine = np.stack([val.astype(np.float64), (idx + vocab_start).astype(np.float64), bad.astype(np.float64)])
    every = comm.all_gather(mine[:, None, :], axis=1)  # [3, size, T]
    vals, ids, bads = every[0], every[1].astype(np.int64), every[2].astype(bool)
    winner = np.argmax(vals, axis=0)  # first (lowest) rank among equal maxima
    out = ids[winner, np.arange(t)].astype(np.int32)
    out[bads.any(axis=0)] = nonfinite
    return out


def gather_logits(backend: Backend, comm: Communicator, local_logits: Any) -> np.ndarray:
    """float32 [T, V]: the full logits, shards concatenated in rank (= vocab) order."""
    return comm.all_gather(backend.to_numpy(local_logits), axis=1)
