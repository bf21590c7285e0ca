"""Token choice at verification: greedy acceptance, or speculative rejection sampling (lossless).

For each sequence the target has scored its pending token and k drafts (k + 1 logits rows). Greedy: accept
the longest prefix of drafts equal to the target's argmax, then emit the argmax after it. Sampling (standard
speculative sampling): accept draft d_j with probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection
emit a token from the residual max(p_j - q_j, 0) and stop; if all k are accepted emit a bonus token from
p_k. With an argmax drafter q_j is one-hot and the rule reduces to "accept with probability p_j(d_j), else
sample from p_j without d_j". Either way every emitted token is distributed exactly as the target's own
(temperature, top-k and top-p applied to p before acceptance).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cudflash.backends.base import Backend
from cudflash.engine.sequence import Sequence
from cudflash.engine.tree import DraftTree, walk
from cudflash.sampling_params import SamplingParams


@dataclass(slots=True)
class VerifyGroup:
    seq: Sequence
    first_row: int  # this sequence's rows in the logits: first_row .. first_row + len(drafts)
    drafts: np.ndarray  # int64 [k]
    q: np.ndarray | None = None  # float [k, V] draft distributions; None = one-hot on the drafts (argmax drafter)
    tree: DraftTree | None = None  # the drafts are this tree's nodes (row 0 the root): walked, not a prefix
    path: list[int] | None = None  # set by verify_tokens for a tree: the storage rows of the matched path


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


def accepted_prefix(drafts: np.ndarray, targets: np.ndarray) -> int:
    """Number of drafts accepted: the longest prefix with drafts[j] == targets[j]."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def rejection_sample(rows: np.ndarray, drafts: np.ndarray, q: np.ndarray | None, params: SamplingParams,
                     rng: np.random.Generator) -> list[int]:
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = target_probs(rows[j], params)
        q_d = 1.0 if q is None else float(q[j][d])
        if q_d > 0 and rng.random() * q_d < p[d]:
            out.append(int(d))
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q[j], 0.0)
        out.append(sample(residual if residual.sum() > 0 else p, rng))
        return out
    out.append(sample(target_probs(rows[len(drafts)], params), rng))
    return out


def verify_tokens(backend: Backend, logits: Any, groups: list[VerifyGroup], argmax: np.ndarray) -> list[list[int]]:
    """The tokens each group emits: its accepted drafts and one target token. `argmax` [R] of the logits rows comes
    from the verify phase, which computes it on the device."""
    sampled = [g for g in groups if not g.seq.params.greedy]
    host_rows: dict[int, np.ndarray] = {}
    if sampled:
        rows = np.concatenate([np.arange(g.first_row, g.first_row + len(g.drafts) + 1) for g in sampled])
        values = backend.to_numpy(backend.take_rows(logits, backend.asarray(rows.astype(np.int32), "i32")))
        host_rows = {int(r): values[i] for i, r in enumerate(rows)}
    emitted = []
    for g in groups:
        k = len(g.drafts)
        if g.tree is not None:  # follow the target's own choice at each node while it is a child
            params, rng = g.seq.params, g.seq.rng
            if params.greedy:
                choose = lambda row, g=g: int(argmax[g.first_row + row])  # noqa: E731
            else:
                choose = lambda row, g=g: sample(target_probs(host_rows[g.first_row + row], params), rng)  # noqa: E731
            g.path, tokens = walk(g.tree, choose)
            emitted.append(tokens)
        elif g.seq.params.greedy:
            targets = argmax[g.first_row:g.first_row + k + 1]
            a = accepted_prefix(g.drafts, targets)
            emitted.append([int(t) for t in g.drafts[:a]] + [int(targets[a])])
        else:
            rows = np.stack([host_rows[g.first_row + j] for j in range(k + 1)])
            emitted.append(rejection_sample(rows, g.drafts, g.q, g.seq.params, g.seq.rng))
    return emitted
